"""Host time of an engine step with the prefix cache's events recorded (`--kv-events`) and without, on CPU.

Each step is what the serve loop runs on the host for one front-end: ``core.step()`` with the model forward swapped
for fixed random logits (benchmarks.host_path's instrumentation; the sampler's tensor math, device work on a GPU, is
left out), then the events' way out: ``take_events``, their pickling onto the front-end's pipe and back, and the
front-end's ``CacheEventLog.extend``. With the events off the block pool logs nothing and that way is empty.

Two workloads at ``--batch`` sequences: ``decode``, the batch decoding steadily (each sequence fills a block every 16
steps: a "stored" event each), and ``churn``, sequences finishing after 8..64 tokens and replaced at once by new
random prompts of ``--prompt-len`` tokens in a KV pool that holds the batch about 1.5 times, so every step prefills
(stored events) and evicts (removed events). Two engines on the same requests, one with events and one without,
step in alternation (``--repeats`` pairs, fresh each time); the table shows the median over pairs of each one's
median µs per step: ``*_host_us`` the whole step, ``on_minus_off_us`` the median of the step-by-step differences
(the same step of the same requests, taken moments apart), ``*_events_us`` the events' way out alone, and
``on/off``.

Run: python3 -m benchmarks.kv_events [--batch 64] [--steps 200] [--repeats 3]   (writes results/kv_events.json)
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time

import torch

from benchmarks.common import print_table, write_result
from benchmarks.host_path import PieceTimer, instrument
from graphserve.config import EngineConfig
from graphserve.engine.core import EngineCore
from graphserve.engine.request import EngineRequest
from graphserve.sampling_params import SamplingParams
from graphserve.server.cache_events import CacheEventLog

WORKLOADS = ("decode", "churn")


class Workload:
    def __init__(self, core: EngineCore, kind: str, batch: int, prompt_len: int, decode_tokens: int, seed: int):
        self.core, self.kind, self.prompt_len, self.decode_tokens = core, kind, prompt_len, decode_tokens
        self.rng = random.Random(seed)
        self.serial = 0
        for _ in range(batch):
            self.add()

    def add(self) -> None:
        # decode: long enough to outlast the run; churn: short, so sequences keep finishing and arriving
        max_tokens = self.decode_tokens if self.kind == "decode" else self.rng.randrange(8, 65)
        prompt = [self.rng.randrange(3, self.core.info.vocab_size) for _ in range(self.prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.core.add_request(EngineRequest(f"r{self.serial}", prompt, params, arrival_time=time.monotonic()))
        self.serial += 1

    def step(self) -> None:
        finished = sum(o.finish_reason is not None for o in self.core.step())
        for _ in range(finished):
            self.add()


def build(kind: str, batch: int, prompt_len: int, steps: int, kv_events: bool, seed: int
          ) -> tuple[EngineCore, Workload]:
    decode_tokens = 2 * steps + 64  # outlasts the run: the decode batch stays full
    max_len = prompt_len + (80 if kind == "churn" else decode_tokens)
    tokens = batch * max_len * 3 // 2 if kind == "churn" else batch * max_len
    config = EngineConfig(model="builtin:tiny-llama", device="cpu", max_model_len=max_len, max_running_requests=batch,
                          num_kv_tokens=tokens, kv_events=kv_events)
    core = EngineCore(config)
    if config.kv_events:  # as the serve loop does once the engine is warm (engine/serve_loop.py)
        core.block_manager.record_events()
    return core, Workload(core, kind, batch, prompt_len, decode_tokens, seed)


class Engine:
    """One engine of the pair, instrumented, with its front-end's event log."""

    def __init__(self, kind: str, batch: int, prompt_len: int, steps: int, kv_events: bool, seed: int):
        self.core, self.work = build(kind, batch, prompt_len, steps, kv_events, seed)
        self.timer = PieceTimer()
        instrument(self.core, self.timer, self.core.info.vocab_size, batch)
        self.log = CacheEventLog()
        self.step_us: list[float] = []
        self.events_us: list[float] = []
        self.counts: list[int] = []

    def step(self, timed: bool) -> None:
        self.timer.step.clear()
        t0 = time.perf_counter()
        self.work.step()
        t1 = time.perf_counter()
        events = self.core.block_manager.take_events()
        self.log.extend(pickle.loads(pickle.dumps(events, protocol=pickle.HIGHEST_PROTOCOL)))
        t2 = time.perf_counter()
        if timed:
            self.step_us.append((t1 - t0 - self.timer.step["sampler"] - self.timer.step["forward"]) * 1e6)
            self.events_us.append((t2 - t1) * 1e6)
            self.counts.append(len(events))


def measure(kind: str, batch: int, prompt_len: int, steps: int, seed: int) -> dict[bool, dict[str, float]]:
    """Two engines on the same requests, one recording events, stepped in alternation (the order swapped every
    step) so that whatever else loads the host loads both alike."""
    pair = {on: Engine(kind, batch, prompt_len, steps, on, seed) for on in (False, True)}
    for _ in range(batch * prompt_len // EngineConfig().chunked_prefill_size + 2 + steps // 4):
        for on in (False, True):  # admission, the first prefills, then into a churning pool full of cached blocks
            pair[on].step(timed=False)
    for i in range(steps):
        for on in (False, True) if i % 2 == 0 else (True, False):
            pair[on].step(timed=True)
    assert pair[False].work.serial == pair[True].work.serial, "the two engines ran different requests"
    out = {}
    for on, e in pair.items():
        host = [s + ev for s, ev in zip(e.step_us, e.events_us)]
        out[on] = {"host_us": statistics.median(host), "events_us": statistics.median(e.events_us),
                   "events_per_step": statistics.mean(e.counts)}
    out[True]["paired_us"] = statistics.median(
        (s + ev) - (s0 + ev0) for s, ev, s0, ev0 in zip(pair[True].step_us, pair[True].events_us,
                                                     pair[False].step_us, pair[False].events_us))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=200, help="timed steps per engine")
    p.add_argument("--repeats", type=int, default=3, help="fresh engine pairs per workload")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    args = p.parse_args()
    torch.set_num_threads(1)  # host work is single-threaded; keep the sampler's math off the other cores
    rows = []
    for kind in args.workloads:
        runs = [measure(kind, args.batch, args.prompt_len, args.steps, seed=r) for r in range(args.repeats)]
        med = {on: {k: statistics.median(x[on][k] for x in runs) for k in runs[0][on]} for on in (False, True)}
        rows.append({"case": kind, "bs": args.batch, "events_per_step": med[True]["events_per_step"],
                     "off_host_us": med[False]["host_us"], "on_host_us": med[True]["host_us"],
                     "on_minus_off_us": med[True]["paired_us"],
                     "off_events_us": med[False]["events_us"], "on_events_us": med[True]["events_us"],
                     "on/off": med[True]["host_us"] / med[False]["host_us"]})
    print("µs of host time per engine step (median), prefix-cache events off and on (--kv-events)")
    print_table(rows, list(rows[0]))
    write_result("kv_events", {"model": "builtin:tiny-llama", "device": "cpu", "prompt_len": args.prompt_len,
                               "steps": args.steps, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
