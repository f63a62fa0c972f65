"""Host time of an engine step with the prefix cache's events recorded (`--kv-events`) and without, on CPU.

Each step is what the serve loop runs on the host for one front-end: ``core.step()`` with the model forward swapped
for fixed random logits (benchmarks.host_path's instrumentation; the sampler's tensor math, device work on a GPU, is
left out), then the events' way out: ``take_events``, their pickling onto the front-end's pipe and back, and the
front-end's ``CacheEventLog.extend``. With the events off the block pool logs nothing and that way is empty.

Two workloads at ``--batch`` sequences: ``decode``, the batch decoding steadily (each sequence fills a block every 16
steps: a "stored" event each), and ``churn``, sequences finishing after 8..64 tokens and replaced at once by new
random prompts of ``--prompt-len`` tokens in a KV pool that holds the batch about 1.5 times, so every step prefills
(stored events) and evicts (removed events). Engines with and without events alternate, ``--repeats`` times; the
table shows the median over repeats of each one's median µs per step: ``*_host_us`` the whole step, ``*_events_us``
the events' way out alone (the quieter measure of what recording adds: a step's own time varies by more on a busy
host), and ``on/off``.

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


def measure(kind: str, batch: int, prompt_len: int, steps: int, kv_events: bool, seed: int) -> dict[str, float]:
    core, work = build(kind, batch, prompt_len, steps, kv_events, seed)
    timer = PieceTimer()
    instrument(core, timer, core.info.vocab_size, batch)
    log = CacheEventLog()
    for _ in range(batch * prompt_len // EngineConfig().chunked_prefill_size + 2):
        work.step()  # admission and the first prefills
    for _ in range(steps // 4):  # into the steady state: a churning pool full of cached blocks
        work.step()
        log.extend(core.block_manager.take_events())
    step_us, events_us, counts = [], [], []
    for _ in range(steps):
        timer.step.clear()
        t0 = time.perf_counter()
        work.step()
        t1 = time.perf_counter()
        events = core.block_manager.take_events()
        log.extend(pickle.loads(pickle.dumps(events, protocol=pickle.HIGHEST_PROTOCOL)))
        t2 = time.perf_counter()
        step_us.append((t1 - t0 - timer.step["sampler"] - timer.step["forward"]) * 1e6)
        events_us.append((t2 - t1) * 1e6)
        counts.append(len(events))
    return {"step_us": statistics.median(step_us), "events_us": statistics.median(events_us),
            "host_us": statistics.median(s + e for s, e in zip(step_us, events_us)),
            "events_per_step": statistics.mean(counts)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=200, help="timed steps per engine")
    p.add_argument("--repeats", type=int, default=3, help="engines per workload and setting, alternating")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    args = p.parse_args()
    torch.set_num_threads(1)  # host work is single-threaded; keep the sampler's math off the other cores
    rows = []
    for kind in args.workloads:
        runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for r in range(args.repeats):
            for on in (False, True) if r % 2 == 0 else (True, False):
                runs[on].append(measure(kind, args.batch, args.prompt_len, args.steps, on, seed=r))
        med = {on: {k: statistics.median(x[k] for x in runs[on]) for k in runs[on][0]} for on in runs}
        rows.append({"case": kind, "bs": args.batch, "events_per_step": med[True]["events_per_step"],
                     "off_host_us": med[False]["host_us"], "on_host_us": med[True]["host_us"],
                     "off_events_us": med[False]["events_us"], "on_events_us": med[True]["events_us"],
                     "on/off": med[True]["host_us"] / med[False]["host_us"]})
    print("µs of host time per engine step (median), prefix-cache events off and on (--kv-events)")
    print_table(rows, list(rows[0]))
    write_result("kv_events", {"model": "builtin:tiny-llama", "device": "cpu", "prompt_len": args.prompt_len,
                               "steps": args.steps, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
