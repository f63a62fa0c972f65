"""Host time per decode step of the engine under the server's serve loop against the offline engine, on CPU.

Both sides build the same engine (``builtin:tiny-llama`` by default, on CPU, the overlap schedule on as on a GPU)
with the model's forward swapped for fixed random logits, so a step is the engine's host work alone: scheduling,
inputs, the sampler's call, the bookkeeping of the ids. Offline is ``OfflineDriver`` driven as ``LLM.generate``
drives it (engine/offline.py). Server is the engine process the HTTP server starts (engine_main, serve_loop.py)
behind a ``ProcessClient`` whose front-end only receives its batches: what the engine process does per iteration
besides the step (draining its inbox, the stats, splitting the outputs by front-end, pickling them to the pipe,
any thread that shares its GIL) is what the comparison isolates.

Per side, ``--batch`` requests of ``--prompt-len`` tokens decode together; the measure is the wall time between
the ends of two consecutive full-batch decode steps (their telemetry records' ``time``), i.e. the engine's
iteration period when nothing waits on a device; beside it the CPU time per step of the engine's process (every
thread) and of its step loop's thread, and ``off_cpu_ms``, the mean period less that thread's CPU time: the time
the step loop could not run (waiting for the GIL, or for a core on a busy machine). ``--repeats`` alternate offline and server runs; the table gives the median
over runs of each run's medians, and ``vs_offline``, the median over run pairs of server period / offline period.

``--profile`` runs the server's engine process under cProfile and prints where its time went (cumulative, top 25).

Run: python3 -m benchmarks.serve_host [--batch 64] [--steps 300] [--repeats 3] [--profile]
(writes benchmarks/results/serve_host.json)
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import print_table, write_result
from graphserve.config import EngineConfig
from graphserve.engine.messages import EngineLoadFailed, EngineReady, StepBatch
from graphserve.engine.request import EngineRequest
from graphserve.sampling_params import SamplingParams

_LOGITS: dict[tuple[int, int], torch.Tensor] = {}


def run_delay_s() -> float:
    """Seconds this thread has spent runnable but waiting for a core (the kernel's schedstat; 0 where absent)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except OSError:
        return 0.0


def instrument(eager_ops: int = 0) -> None:
    """Swap every runner's forward for fixed random logits of the right shape, and stamp each step record with
    the process's CPU time and its thread's (``cpu_s``, ``thread_cpu_s``) and the count of writes the step loop
    left to a sender thread so far (``sender_tails``): this process only.

    ``eager_ops``: a prefill or mixed forward also runs this many one-element torch ops, each of which lets go of
    the GIL and takes it back as a kernel launch does: on a GPU such a step is an eager forward whose host
    launches (about 30 ms for dummy:qwen3-0.6b's 256-token prefill on an H100, the launch_ms of
    results/http_text.json's idle steps) outlast the device's work, so any thread or process that takes the
    step loop's GIL or core shows in the step's time, where a graph-replayed decode step hides it."""
    from graphserve.engine import output_router, runner, telemetry

    record = telemetry.Telemetry.record
    tails = [0]

    def stamped(self, rec):
        rec.cpu_s, rec.thread_cpu_s = time.process_time(), time.thread_time()  # pickled with the record
        rec.sender_tails = tails[0]
        rec.run_delay_s = run_delay_s()
        record(self, rec)

    telemetry.Telemetry.record = stamped
    write_now = output_router.Sender._write_now

    def counted(self, message):
        write_now(self, message)
        tails[0] += self._tail is not None

    output_router.Sender._write_now = counted
    scratch = torch.zeros(1)

    def forward_logits(self, batch):
        key = (batch.num_seqs, self.info.vocab_size)
        logits = _LOGITS.get(key)
        if logits is None:
            logits = _LOGITS[key] = torch.randn(key, generator=torch.Generator().manual_seed(0))
        if batch.mode != "decode":
            for _ in range(eager_ops):
                torch.add(scratch, 1.0, out=scratch)
        self.last_shape = runner.StepShape(batch.num_seqs, False, "eager")
        self.last_comm = (0, 0)
        return logits

    runner.ModelRunner.forward_logits = forward_logits


def engine_target(config: EngineConfig, inbox: Any, outboxes: list, log_level: int, log_format: str | None,
                  queued: Any, profile_path: str | None = None, eager_ops: int = 0) -> None:
    """The server's engine process (serve_loop.engine_main) with the fake forward, optionally under cProfile."""
    from graphserve.engine.serve_loop import engine_main

    torch.set_num_threads(1)
    instrument(eager_ops)
    if profile_path is None:
        engine_main(config, inbox, outboxes, log_level, log_format, queued)
        return
    from graphserve.engine import serve_loop

    serve = serve_loop.serve
    prof = cProfile.Profile()

    def profiled(*a: Any, **kw: Any) -> None:  # the serve loop only: not the imports, the load, the warm-up
        prof.enable()
        try:
            serve(*a, **kw)
        finally:
            prof.disable()
            prof.dump_stats(profile_path)

    serve_loop.serve = profiled
    engine_main(config, inbox, outboxes, log_level, log_format, queued)


def make_config(args: argparse.Namespace) -> EngineConfig:
    total = args.prompt_len + args.steps + 64
    return EngineConfig(model=args.model, device="cpu", overlap_schedule=args.overlap, max_model_len=total + 16,
                        max_running_requests=args.batch, num_kv_tokens=args.batch * (total + 32))


def make_requests(args: argparse.Namespace, vocab: int, tag: str) -> list[EngineRequest]:
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=args.steps + 32, temperature=0.0, ignore_eos=True)
    return [EngineRequest(f"{tag}{i}#{i}", torch.randint(10, vocab - 10, (args.prompt_len,), generator=gen).tolist(),
                          params, arrival_time=time.monotonic()) for i in range(args.batch)]


def summary(records: list[Any], batch: int, skip: int = 5) -> dict[str, float]:
    """Over consecutive full-batch decode steps (the first ``skip`` pairs dropped): the median wall ms between
    their ends, and the mean CPU ms per step of the engine's process and of its step thread."""
    pairs = [(a, b) for a, b in zip(records, records[1:])
             if a.kind == b.kind == "decode" and a.batch_size == b.batch_size == batch][skip:]
    periods = [1000.0 * (b.time - a.time) for a, b in pairs]
    n = len(pairs)
    thread_cpu = 1000.0 * sum(b.thread_cpu_s - a.thread_cpu_s for a, b in pairs) / n
    return {"period_ms": statistics.median(periods), "period_p10_ms": statistics.quantiles(periods, n=10)[0],
            "cpu_ms": 1000.0 * sum(b.cpu_s - a.cpu_s for a, b in pairs) / n, "step_thread_cpu_ms": thread_cpu,
            # the step loop's thread off the CPU: waiting for the GIL, or for a core (a busy machine)
            "off_cpu_ms": statistics.fmean(periods) - thread_cpu,
            "gc_ms": sum(b.gc_ms for _, b in pairs) / n, "steps": n}


def run_offline(args: argparse.Namespace) -> dict[str, float]:
    from graphserve.engine.gc_clock import freeze_heap
    from graphserve.engine.offline import OfflineDriver
    from graphserve.engine.warmup import warm_up

    instrument()
    engine = OfflineDriver(make_config(args), stream_outputs=False)  # as LLM.generate builds it
    warm_up(engine.core)
    freeze_heap()  # as the server's engine process does, and http_overhead's offline baseline
    try:
        before = engine.core.telemetry.last_step()
        for req in make_requests(args, engine.info.vocab_size, "off"):
            engine.add_processed(req)
        while engine.has_unfinished_requests():  # LLM._run's loop
            engine.step()
        records = [r for r in engine.core.telemetry.records() if r.step > before]
    finally:
        gc.unfreeze()
    return summary(records, args.batch)


def run_server(args: argparse.Namespace, profile_path: str | None = None) -> dict[str, float]:
    import functools

    from graphserve.engine.process_client import ProcessClient

    records: list[Any] = []
    finished: set[str] = set()
    ready = threading.Event()
    done = threading.Event()
    info: dict[str, Any] = {}

    def on_message(msg: Any) -> None:
        if isinstance(msg, (EngineReady, EngineLoadFailed)):
            info["ready"] = msg
            ready.set()
        elif isinstance(msg, StepBatch):
            records.extend(msg.records)
            flat = msg.outputs
            finished.update(flat.request_ids[row] for row in flat.finishes)
            if len(finished) >= args.batch:
                done.set()

    target = functools.partial(engine_target, profile_path=profile_path)
    client = ProcessClient(make_config(args), on_message, lambda code: done.set(), target=target)
    client.start()
    try:
        if not ready.wait(600):
            raise RuntimeError("the engine process did not report ready within 600 s")
        if isinstance(info["ready"], EngineLoadFailed):
            raise RuntimeError(f"the engine failed to load: {info['ready'].message}")
        client.add(make_requests(args, info["ready"].info.vocab_size, "srv"))
        if not done.wait(600):
            raise RuntimeError("the server run did not finish within 600 s")
    finally:
        client.shutdown()
    records.sort(key=lambda r: r.step)
    records = [r for r in records if r.batch_size > 0]
    return summary(records, args.batch)


def print_profile(path: str, top: int = 25) -> str:
    out = io.StringIO()
    stats = pstats.Stats(path, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()



def paired_runs(args: argparse.Namespace, offline: Callable, server: Callable, compared: str
                ) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, float]]]]:  # fmt: skip
    """``args.repeats`` offline and server runs, alternated so a drift of the machine lands on both; one row per
    side with each figure's median, and the server's ``vs_offline``: the median of its paired ratios of
    ``compared``."""
    runs: dict[str, list[dict[str, float]]] = {"offline": [], "server": []}
    for _ in range(args.repeats):
        runs["offline"].append(offline(args))
        runs["server"].append(server(args))
    rows = []
    for path, rs in runs.items():
        row: dict[str, Any] = {"path": path}
        for k in rs[0]:
            row[k] = statistics.median(r[k] for r in rs)
        rows.append(row)
    rows[0]["vs_offline"] = 1.0
    rows[1]["vs_offline"] = statistics.median(srv[compared] / off[compared]
                                              for off, srv in zip(runs["offline"], runs["server"]))
    return rows, runs

def profiled_run(args: argparse.Namespace, server: Callable) -> str:
    """One more server run under cProfile (``server(args, profile_path=...)``); its printed summary."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "engine.prof")
        server(args, profile_path=path)
        text = print_profile(path)
    print(text)
    return text


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="builtin:tiny-llama")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=300, help="decode steps per run")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="offline/server run pairs; medians are reported")
    p.add_argument("--overlap", choices=["on", "off"], default="on", help="the overlap schedule (on: as on a GPU)")
    p.add_argument("--profile", action="store_true", help="cProfile the server's engine process (one extra run)")
    p.add_argument("--name", default="serve_host", help="result file name under benchmarks/results")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows, runs = paired_runs(args, run_offline, run_server, "period_ms")
    print(f"ms per full-batch decode step (batch {args.batch}, fake forward, overlap {args.overlap}; median of "
          f"{args.repeats} runs' medians)")
    print_table(rows, list(rows[1]))
    payload: dict[str, Any] = {"model": args.model, "batch": args.batch, "steps": args.steps,
                               "prompt_len": args.prompt_len, "overlap": args.overlap, "repeats": args.repeats,
                               "rows": rows, "runs": runs}
    if args.profile:
        payload["profile"] = profiled_run(args, run_server)
    write_result(args.name, payload)


if __name__ == "__main__":
    main()
