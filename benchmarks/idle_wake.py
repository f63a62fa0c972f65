"""What an idle gap costs the next request: a 256-token prompt, one token out, after the engine has had
nothing to do for a while, with the gap spent three ways.

- ``sleep``: the host thread sleeps (what an engine blocked on its request queue does);
- ``spin``: the host thread busy-polls the clock through the gap (an engine that spins on its queue);
- ``gpu_busy``: the host sleeps while one long kernel keeps the GPU busy until just before the request.

Each row gives the request's wall time through ``LLM.generate`` and its prefill step's own ``step_ms`` (the
engine's telemetry), median over ``--repeats`` distinct prompts (no prefix-cache hit). The rows at gap 0 are
the warm reference. If ``sleep`` is slow where ``spin`` is not, the host wakes slowly; if ``gpu_busy`` is
fast where ``sleep`` is not, the device does.

Run: python3 -m benchmarks.idle_wake [--model dummy:qwen3-0.6b] [--gaps-ms 0 2 20 200 1000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.common import print_table, write_result


def wait(gap_s: float, how: str) -> None:
    if gap_s <= 0:
        return
    if how == "spin":
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:
            pass
        return
    if how == "gpu_busy" and gap_s > 0.002:
        # torch.cuda._sleep spins the GPU for a number of clock cycles: aim for the gap less 1 ms
        cycles = int((gap_s - 0.001) * torch.cuda.clock_rate() * 1e6) if hasattr(torch.cuda, "clock_rate") \
            else int((gap_s - 0.001) * 1.5e9)
        torch.cuda._sleep(cycles)
    time.sleep(gap_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:qwen3-0.6b")
    p.add_argument("--gaps-ms", type=float, nargs="+", default=[0, 2, 20, 200, 1000])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--input-len", type=int, default=256)
    args = p.parse_args()

    from graphserve import LLM, SamplingParams
    from graphserve.server.warmup import warm_up

    llm = LLM(args.model, max_model_len=2048)
    warm_up(llm.engine.core)
    records: list[Any] = []
    llm.engine.core.telemetry.add_listener(records.append)
    vocab = llm.engine.info.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    modes = ["sleep", "spin"] + (["gpu_busy"] if torch.cuda.is_available() else [])
    rows = []
    serial = 0
    for gap_ms in args.gaps_ms:
        for how in modes if gap_ms > 0 else ["none"]:
            walls, steps = [], []
            for _ in range(args.repeats):
                serial += 1
                prompt = [(serial * 7919 + 31 * i) % (vocab - 20) + 10 for i in range(args.input_len)]
                wait(gap_ms / 1000, how)
                records.clear()
                t0 = time.perf_counter()
                llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                walls.append(1000 * (time.perf_counter() - t0))
                steps.append(sum(r.step_ms for r in records if r.prefill_tokens > 0))
            rows.append({"model": args.model, "gap_ms": gap_ms, "wait": how,
                         "request_ms": statistics.median(walls), "prefill_step_ms": statistics.median(steps),
                         "request_ms_max": max(walls)})
    print_table(rows, ["model", "gap_ms", "wait", "request_ms", "prefill_step_ms", "request_ms_max"])
    write_result("idle_wake", {"input_len": args.input_len, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
