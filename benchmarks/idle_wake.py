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

import torch

from benchmarks.common import PrefillProbe, print_table, write_result


def gpu_cycles_per_s() -> float:
    """The rate ``torch.cuda._sleep`` counts its cycles at, measured with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 50_000_000
    torch.cuda._sleep(cycles)  # first call: launch set-up out of the timing
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1000)


def wait(gap_s: float, how: str, cycles_per_s: float) -> None:
    if how == "spin":
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:
            pass
        return
    if how == "gpu_busy":  # one kernel keeps the GPU busy until 1 ms before the request (none for a shorter gap)
        torch.cuda._sleep(int(max(0.0, gap_s - 0.001) * cycles_per_s))
    time.sleep(gap_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:qwen3-0.6b")
    p.add_argument("--gaps-ms", type=float, nargs="+", default=[0, 2, 20, 200, 1000])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--input-len", type=int, default=256)
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats} is invalid: must be >= 1")
    if any(g < 0 for g in args.gaps_ms):
        p.error(f"--gaps-ms {args.gaps_ms} is invalid: every gap must be >= 0")

    from graphserve import LLM
    from graphserve.engine.warmup import warm_up

    llm = LLM(args.model, max_model_len=2048)
    limit = llm.engine.core.max_model_len
    if not 1 <= args.input_len < limit:
        p.error(f"--input-len {args.input_len} is invalid: must be >= 1 and below the engine's max_model_len {limit}")
    warm_up(llm.engine.core)
    timed = PrefillProbe(llm)
    vocab = llm.engine.info.vocab_size
    gpu = torch.cuda.is_available()
    cycles_per_s = gpu_cycles_per_s() if gpu else 0.0
    modes = ["sleep", "spin"] + (["gpu_busy"] if gpu else [])
    rows = []
    serial = 0
    for gap_ms in args.gaps_ms:
        for how in modes if gap_ms > 0 else ["none"]:
            walls, steps = [], []
            for _ in range(args.repeats):
                serial += 1  # a distinct prompt each time: no prefix-cache hit
                prompt = [(serial * 7919 + 31 * i) % (vocab - 20) + 10 for i in range(args.input_len)]
                wait(gap_ms / 1000, how, cycles_per_s)
                wall_ms, step_ms = timed(prompt)
                walls.append(wall_ms)
                steps.append(step_ms)
            rows.append({"model": args.model, "gap_ms": gap_ms, "wait": how,
                         "request_ms": statistics.median(walls), "prefill_step_ms": statistics.median(steps),
                         "request_ms_max": max(walls)})
    print_table(rows, ["model", "gap_ms", "wait", "request_ms", "prefill_step_ms", "request_ms_max"])
    write_result("idle_wake", {"input_len": args.input_len, "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
