"""Prefill and mixed steps of the engine under the server's serve loop against the offline engine, on CPU, with
requests arriving in waves.

The workload of ``benchmarks.http_overhead`` at C clients, shrunk: ``--clients`` closed-loop clients each run
``--waves`` requests of ``--prompt-len`` prompt and ``--output-len`` output tokens (ignore_eos), so every
request of a wave finishes in the same step and the next wave arrives together. Both sides build the same
engine with serve_host.py's fake forward, whose prefill and mixed steps also run ``--eager-ops`` one-element
torch ops (an eager forward's launches: each lets go of the GIL and takes it back).

Offline is ``OfflineDriver`` as ``LLM.generate`` drives it: every request added up front, the running batch
capped at C. Server is the engine process of the HTTP server (engine_main) behind a ``ProcessClient``: the
requests reach it over the real queue, one ``AddRequests`` per request as the front-end sends them, and the
front-end here is the server's own output path without HTTP: the pipe's reader thread, the output thread
(output_pump.py) detokenizing every step's rows for streaming, and an asyncio loop that, as each request
finishes, tokenizes its client's next prompt (``--prompts-as text``, as text clients send) and sends it.

Per side, over the steps with prefill tokens: how many, their summed and mean step_ms (the wall time that
http_overhead's ``other_s`` sums), prefill tokens per step, and per step the CPU time of the engine's step
thread, ``off_cpu_ms`` (step_ms less that CPU: the step loop waiting for the GIL or for a core), the CPU time
of the engine's other threads, the collector's ms; the decode steps' mean step_ms beside them; and the whole
run's wall time. ``--repeats`` alternate offline and server runs; medians are reported.

Run: python3 -m benchmarks.serve_waves [--clients 64] [--waves 3] [--eager-ops 3000] [--prompts-as text]
     [--profile]   (writes benchmarks/results/serve_waves.json)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import os
import statistics
import threading
import time
from typing import Any

import torch

from benchmarks.common import print_table, write_result
from benchmarks.serve_host import engine_target, instrument, paired_runs, profiled_run
from graphserve.config import EngineConfig
from graphserve.engine.messages import EngineLoadFailed, EngineReady, StepBatch
from graphserve.sampling_params import SamplingParams


def make_config(args: argparse.Namespace) -> EngineConfig:
    total = 2 * args.prompt_len + args.output_len  # a text round trip may lengthen a prompt
    return EngineConfig(model=args.model, device="cpu", overlap_schedule="on", max_model_len=total + 16,
                        max_running_requests=args.clients, num_kv_tokens=args.clients * (total + 64),
                        chunked_prefill_size=args.chunk)


def make_prompts(args: argparse.Namespace, tokenizer: Any, vocab: int) -> list[Any]:
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(10, vocab - 10, (args.prompt_len,), generator=gen).tolist()
           for _ in range(args.clients * args.waves)]
    if args.prompts_as == "ids":
        return ids
    # decoded to text and tokenized again by whoever takes the request, as http_overhead's text prompts are; the
    # round trip may change the length a little, the same on both sides
    return [tokenizer.decode(p) for p in ids]


def params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)


def summary(records: list[Any], wall_s: float) -> dict[str, float]:
    """Over the steps with prefill tokens (prefill, mixed) and, apart, the decode steps."""
    records = [r for r in records if r.batch_size > 0]
    other = [(a, b) for a, b in zip(records, records[1:]) if b.prefill_tokens and b.step == a.step + 1]
    decode = [r for r in records if not r.prefill_tokens]
    n = max(len(other), 1)
    thread_cpu = [1000.0 * (b.thread_cpu_s - a.thread_cpu_s) for a, b in other]
    proc_cpu = [1000.0 * (b.cpu_s - a.cpu_s) for a, b in other]
    return {"wall_s": wall_s, "steps": len(records), "other_steps": len(other),
            "other_s": sum(b.step_ms for _, b in other) / 1000.0,
            "other_step_ms": sum(b.step_ms for _, b in other) / n,
            "prefill_tok_per_step": sum(b.prefill_tokens for _, b in other) / n,
            "other_thread_cpu_ms": sum(thread_cpu) / n,
            "other_off_cpu_ms": sum(b.step_ms for _, b in other) / n - sum(thread_cpu) / n,
            # of that off-CPU time, the part the step thread was runnable, waiting for a core: the rest it waited
            # on something (the GIL, a lock, a read)
            "other_run_delay_ms": 1000.0 * sum(b.run_delay_s - a.run_delay_s for a, b in other) / n,
            "other_threads_cpu_ms": (sum(proc_cpu) - sum(thread_cpu)) / n,
            "other_gc_ms": sum(b.gc_ms for _, b in other) / n,
            "sender_tails": records[-1].sender_tails - records[0].sender_tails,
            "decode_steps": len(decode),
            "decode_step_ms": statistics.fmean(r.step_ms for r in decode) if decode else 0.0}


def pinned_engine(*a: Any, cpus: list[int] | None = None, **kw: Any) -> None:
    """The engine process, on ``cpus`` where given."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    engine_target(*a, **kw)


def run_offline(args: argparse.Namespace) -> dict[str, float]:
    from graphserve.engine.gc_clock import freeze_heap
    from graphserve.engine.offline import OfflineDriver
    from graphserve.engine.warmup import warm_up

    instrument(args.eager_ops)
    mask = os.sched_getaffinity(0)
    if args.engine_cpus:
        os.sched_setaffinity(0, args.engine_cpus)
    engine = OfflineDriver(make_config(args), stream_outputs=False)  # as LLM.generate builds it
    warm_up(engine.core)
    freeze_heap()
    try:
        prompts = make_prompts(args, engine.tokenizer, engine.info.vocab_size)
        before = engine.core.telemetry.last_step()
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):  # LLM.generate: every request in before the first step
            engine.add_request(f"off{i}", prompt, params(args))
        while engine.has_unfinished_requests():
            engine.step()
        wall = time.perf_counter() - t0
        records = [r for r in engine.core.telemetry.records() if r.step > before]
    finally:
        gc.unfreeze()
        os.sched_setaffinity(0, mask)
    out = summary(records, wall)
    out["frontend_cpu_s"] = 0.0  # the caller is the front-end, on the step loop's thread
    out["engine_cpu_s"] = records[-1].cpu_s - records[0].cpu_s
    return out


class WaveFrontend:
    """The server's side of the pipe without HTTP: reader thread -> output thread (detokenizes) -> loop, which
    streams every delta to nobody and sends each client's next request as its previous one finishes."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.records: list[Any] = []
        self.ready = threading.Event()
        self.done = threading.Event()
        self.info: dict[str, Any] = {}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="wave-frontend-loop", daemon=True)
        self._thread.start()
        self.pump: Any = None
        self.client: Any = None
        self.next_of: dict[str, int] = {}  # request id -> its client
        self.left: list[list[Any]] = []  # per client, the prompts it has still to send
        self.finished = 0
        self.t0 = self.t1 = 0.0

    def on_message(self, msg: Any) -> None:  # the reader thread
        if isinstance(msg, (EngineReady, EngineLoadFailed)):
            self.info["ready"] = msg
            self.ready.set()
        elif isinstance(msg, StepBatch):
            self.records.extend(msg.records)
            self.pump.push(msg.outputs, msg.failed)

    def start(self, vocab: int) -> None:
        from graphserve.engine.input_processor import InputProcessor
        from graphserve.engine.output_processor import OutputProcessor
        from graphserve.models.loader import load_tokenizer
        from graphserve.server.output_pump import OutputPump

        msg = self.info["ready"]
        tokenizer = load_tokenizer(self.args.model)
        self.inputs = InputProcessor(tokenizer, msg.info, make_config(self.args), (msg.num_usable_blocks,
                                                                                   msg.block_size))
        self.outputs = OutputProcessor(tokenizer)
        self.pump = OutputPump(self.outputs, self.loop, self.deliver)
        prompts = make_prompts(self.args, tokenizer, vocab)
        c = self.args.clients
        self.left = [prompts[i::c] for i in range(c)]
        self.total = len(prompts)
        self.t0 = time.perf_counter()
        for i in range(c):
            self.loop.call_soon_threadsafe(self.send, i)

    def send(self, client: int) -> None:  # the loop: as the front-end's route does, one request at a time
        prompt = self.left[client].pop(0)
        rid = f"c{client}w{len(self.left[client])}#{client}"
        req = self.inputs.process(rid, prompt, params(self.args))  # tokenizes a text prompt here
        self.outputs.add(rid, req.prompt_token_ids, req.params, stream=True)
        self.next_of[rid] = client
        self.client.add([req])

    def deliver(self, deltas: list[Any], failed: dict[str, str]) -> None:  # the loop
        if failed:
            raise RuntimeError(f"requests failed: {failed}")
        for d in deltas:
            if not d.finished:
                continue
            self.finished += 1
            client = self.next_of.pop(d.request_id)
            if self.left[client]:
                self.send(client)
        if self.finished >= self.total:
            self.t1 = time.perf_counter()
            self.done.set()

    def close(self) -> None:
        if self.pump is not None:
            self.pump.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def run_server(args: argparse.Namespace, profile_path: str | None = None) -> dict[str, float]:
    from graphserve.engine.process_client import ProcessClient

    mask = os.sched_getaffinity(0)
    if args.frontend_cpus:  # before any of the front-end's threads starts: a thread inherits its creator's CPUs
        os.sched_setaffinity(0, args.frontend_cpus)
    fe = WaveFrontend(args)
    target = functools.partial(pinned_engine, profile_path=profile_path, eager_ops=args.eager_ops,
                               cpus=args.engine_cpus)
    client = ProcessClient(make_config(args), fe.on_message, lambda code: fe.done.set(), target=target)
    fe.client = client
    client.start()
    try:
        if not fe.ready.wait(600):
            raise RuntimeError("the engine process did not report ready within 600 s")
        if isinstance(fe.info["ready"], EngineLoadFailed):
            raise RuntimeError(f"the engine failed to load: {fe.info['ready'].message}")
        cpu0 = time.process_time()
        fe.start(fe.info["ready"].info.vocab_size)
        if not fe.done.wait(600) or fe.finished < fe.total:
            raise RuntimeError(f"the server run finished {fe.finished} of {fe.total} requests")
        frontend_cpu = time.process_time() - cpu0
    finally:
        client.shutdown()
        fe.close()
        os.sched_setaffinity(0, mask)
    records = sorted(fe.records, key=lambda r: r.step)
    out = summary(records, fe.t1 - fe.t0)
    # the front-end's CPU over the run (tokenizing, detokenizing, the loop) against the engine's step thread
    out["frontend_cpu_s"] = frontend_cpu
    out["engine_cpu_s"] = records[-1].cpu_s - records[0].cpu_s
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:tiny-llama")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--waves", type=int, default=3, help="requests per client, run one after the other")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--chunk", type=int, default=2048, help="--chunked-prefill-size of both engines")
    p.add_argument("--eager-ops", type=int, default=3000, help="one-element torch ops per prefill or mixed step")
    p.add_argument("--prompts-as", choices=("ids", "text"), default="text")
    p.add_argument("--repeats", type=int, default=3, help="offline/server run pairs; medians are reported")
    p.add_argument("--profile", action="store_true", help="cProfile the server's engine process (one extra run)")
    p.add_argument("--engine-cpus", type=int, nargs="*", default=None, help="pin the engine (both sides) here")
    p.add_argument("--frontend-cpus", type=int, nargs="*", default=None, help="pin the server's front-end here")
    p.add_argument("--name", default="serve_waves", help="result file name under benchmarks/results")
    args = p.parse_args()
    for name in ("clients", "waves", "prompt_len", "output_len", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} is invalid: must be >= 1")
    if args.eager_ops < 0:
        p.error(f"--eager-ops {args.eager_ops} is invalid: must be >= 0")
    torch.set_num_threads(1)
    rows, runs = paired_runs(args, run_offline, run_server, "other_s")
    print(f"steps with prefill tokens ({args.clients} clients x {args.waves} waves, {args.prompt_len} in / "
          f"{args.output_len} out as {args.prompts_as}, {args.eager_ops} ops per eager step; median of "
          f"{args.repeats} runs; vs_offline: other_s)")
    print_table(rows, list(rows[1]))
    payload: dict[str, Any] = {k: getattr(args, k) for k in ("model", "clients", "waves", "prompt_len", "output_len",
                                                             "chunk", "eager_ops", "prompts_as", "repeats",
                                                             "engine_cpus", "frontend_cpus")}
    payload.update(rows=rows, runs=runs, cpus=os.cpu_count())
    if args.profile:
        payload["profile"] = profiled_run(args, run_server)
    write_result(args.name, payload)


if __name__ == "__main__":
    main()
