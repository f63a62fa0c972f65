"""Host work per decode step, measured on CPU without the model forward.

Builds an EngineCore on CPU (``builtin:tiny-llama`` by default) and replaces the model forward
with a preallocated random logits tensor of the right shape, so each ``core.step()`` is the
engine's own host work: ``Scheduler.schedule``, ``ModelRunner.prepare_inputs``, the sampling
tensors, the step's bookkeeping once its ids are known (``Scheduler.advance``, ``EngineCore._emit``,
the prefix-cache commit), the stop-string check of the requests that have stop strings
(``--stop-strings half``: every other request has two that never match) and the telemetry record.
The sampler itself runs too, but on CPU its tensor math stands in for what is device work on a
GPU, so it is reported apart and left out of the host total.

N requests are admitted and prefilled first; then ``--steps`` decode steps at batch size N are
timed piece by piece (each piece wrapped with a timer), ``--repeats`` times; the table shows the
median over repeats of each piece's median µs per step, and their sum as the host total.

Run: python3 -m benchmarks.host_path [--batch-sizes 64 256 512] [--steps 30] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.common import print_table, write_result
from graphserve.config import EngineConfig
from graphserve.engine.core import EngineCore
from graphserve.engine.request import EngineRequest
from graphserve.sampling_params import SamplingParams

PIECES = ["schedule", "prepare_inputs", "sampling_tensors", "advance", "stop_strings", "record", "other"]


class PieceTimer:
    """Accumulates the wall time of wrapped callables into the current step's buckets."""

    def __init__(self):
        self.step: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[name] += time.perf_counter() - t0

        return timed


def build_core(model: str, batch: int, prompt_len: int, max_tokens: int) -> EngineCore:
    config = EngineConfig(model=model, device="cpu", max_model_len=prompt_len + max_tokens + 16,
                          max_running_requests=batch, num_kv_tokens=batch * (prompt_len + max_tokens + 32))
    return EngineCore(config)


def instrument(core: EngineCore, timer: PieceTimer, vocab: int, batch: int) -> None:
    """Swap the forward for fixed random logits and time each host piece of ``core.step``."""
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    runner = core.runner
    runner.forward_logits = timer.wrap("forward", lambda fb: logits[: fb.num_seqs])
    runner.prepare_inputs = timer.wrap("prepare_inputs", runner.prepare_inputs)
    runner.sampler.sample = timer.wrap("sampler", runner.sampler.sample)
    runner.launch = timer.wrap("launch", runner.launch)
    scheduler = core.scheduler
    scheduler.schedule = timer.wrap("schedule", scheduler.schedule)
    scheduler.advance = timer.wrap("advance", scheduler.advance)
    scheduler.commit_full_blocks = timer.wrap("advance", scheduler.commit_full_blocks)
    core._emit = timer.wrap("advance", core._emit)
    core.stop_checker.check = timer.wrap("stop_strings", core.stop_checker.check)  # inside _emit: taken out below
    core._record = timer.wrap("record", core._record)


# Stop strings the random model never writes: the engine checks them every step and the batch stays full.
NEVER_STOPS = ["<|no such end|>", "\n\n\n\n\n"]


def add_requests(core: EngineCore, batch: int, prompt_len: int, max_tokens: int, sampling: str,
                 stop_strings: str = "none") -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = core.info.vocab_size
    for i in range(batch):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        if sampling == "greedy":
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        else:  # a mix: greedy and nucleus rows in one batch, as a server sees them
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 else 0.8, top_p=0.95,
                                    seed=i, ignore_eos=True)
        if stop_strings == "all" or (stop_strings == "half" and i % 2 == 0):
            params.stop = list(NEVER_STOPS)
        core.add_request(EngineRequest(f"r{i}", prompt, params, arrival_time=time.monotonic()))


def measure(model: str, batch: int, steps: int, prompt_len: int, sampling: str, stop_strings: str = "none"
            ) -> dict[str, float]:
    """µs per step for each piece (median over ``steps`` full-batch decode steps)."""
    # sequences admitted early decode while later ones prefill: leave room for those tokens too
    max_tokens = steps + 16 + batch * prompt_len // EngineConfig().chunked_prefill_size
    core = build_core(model, batch, prompt_len, max_tokens)
    timer = PieceTimer()
    instrument(core, timer, core.info.vocab_size, batch)
    add_requests(core, batch, prompt_len, max_tokens, sampling, stop_strings)
    while len(core.scheduler.running) < batch or any(s.num_pending_tokens != 1 for s in core.scheduler.running):
        core.step()  # admission and prefill (the forward is fake, so this is quick)
    for _ in range(3):  # warm-up decode steps
        core.step()
    per_piece: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        timer.step.clear()
        t0 = time.perf_counter()
        core.step()
        total = time.perf_counter() - t0
        t = timer.step
        assert len(core.scheduler.running) == batch, "a sequence left the batch mid-measurement"
        pieces = {
            "schedule": t["schedule"],
            "prepare_inputs": t["prepare_inputs"],
            # what launch does besides preparing, the (fake) forward and the sampler's math
            "sampling_tensors": t["launch"] - t["prepare_inputs"] - t["forward"] - t["sampler"],
            "advance": t["advance"] - t["stop_strings"],
            "stop_strings": t["stop_strings"],
            "record": t["record"],
        }
        host = total - t["sampler"] - t["forward"]
        pieces["other"] = host - sum(pieces.values())
        pieces["sampler"] = t["sampler"]
        for k, v in pieces.items():
            per_piece[k].append(v * 1e6)
    result = {k: statistics.median(v) for k, v in per_piece.items()}
    # Sum of the pieces' medians: a step preempted by another process (a spike of several ms in
    # one piece) then moves one piece's sample, not the whole total.
    result["host_total"] = sum(result[k] for k in PIECES)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="builtin:tiny-llama")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per repeat")
    p.add_argument("--repeats", type=int, default=5, help="fresh engines per batch size; the median is reported")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--sampling", choices=["greedy", "mixed"], default="greedy")
    p.add_argument("--stop-strings", choices=["none", "half", "all"], default="none",
                   help="which requests carry stop strings (that never match): the engine's per-step check")
    p.add_argument("--name", default="host_path", help="result file name under benchmarks/results")
    args = p.parse_args()
    torch.set_num_threads(1)  # host work is single-threaded; keep the sampler's math from taking the cores
    rows = []
    for bs in args.batch_sizes:
        runs = [measure(args.model, bs, args.steps, args.prompt_len, args.sampling, args.stop_strings) for _ in range(args.repeats)]
        row = {"bs": bs}
        for k in [*PIECES, "host_total", "sampler"]:
            row[k] = statistics.median(r[k] for r in runs)
        row["host_us_per_seq"] = row["host_total"] / bs
        rows.append(row)
    print("µs per decode step (median); host_total excludes the sampler's tensor math")
    print_table(rows, list(rows[0]))
    write_result(args.name, {"model": args.model, "sampling": args.sampling, "stop_strings": args.stop_strings,
                             "prompt_len": args.prompt_len,
                             "steps": args.steps, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
