"""Host time between GPU steps: is the engine loop ever the bottleneck?

Runs ``--num-requests`` decode-heavy requests through the engine (all running at once), then,
for the steady decode steps at full batch, compares the step's wall time (telemetry: schedule,
build inputs, replay, sample, update; with the overlap schedule, the interval between two steps'
ids arriving) with the time the GPU needs for the same batch alone
(CUDA-graph replay + sampling timed with events on the same engine). The difference is host
work that does not overlap the GPU; the target is under 5% of the step. The step is measured as
the cadence: wall time between consecutive steps' telemetry records, so output processing between
engine steps counts too. Runs the engine with the overlap schedule off, then on.

The difference is reported as measured, negative included (with the overlap schedule the loop can
run ahead of a GPU time taken apart, which has its own launch and copy-back), next to its resolution:
the 95% bootstrap interval of the difference of the two medians. An interval that holds 0 means the
host cost is below what this method can resolve.

Run: python3 -m benchmarks.overhead [--model dummy:qwen3-0.6b] [--num-requests 256]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from benchmarks.common import cuda_times_ms, median_difference_ci, print_table, write_result
from graphserve import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dummy:qwen3-0.6b")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    args = p.parse_args()
    rows = []
    for mode in ("off", "on"):
        rows.append(measure(args, mode))
        gc.collect()  # the engine is gone once measure returns: give its memory back before the next
        torch.cuda.empty_cache()
    print_table(rows, list(rows[0]))
    write_result("overhead", {"rows": rows})


def measure(args: argparse.Namespace, overlap: str) -> dict:
    """One engine with ``--overlap-schedule overlap``: its steady full-batch step against the GPU's share."""
    n = args.num_requests
    llm = LLM(args.model, max_model_len=args.input_len + args.output_len + 16, cuda_graph_max_bs=n,
              overlap_schedule=overlap)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 30000, (args.input_len,), generator=gen).tolist()} for _ in range(n)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    core = llm.engine.core
    start = len(core.telemetry.records())
    timings = _time_host_phases(core)
    llm.generate(prompts, params, use_tqdm=False)
    recs = [r for r in core.telemetry.records()[start:] if r.kind == "decode" and r.batch_size == n]
    recs = recs[len(recs) // 4 :]  # steady state: past the first quarter of full-batch decode steps
    step_ms = statistics.median(r.step_ms for r in recs)
    # wall time from one step's record to the next: everything the host does per step, the output
    # processing between two engine steps included (step_ms leaves that out when steps run one by one)
    cadences = [(b.time - a.time) * 1e3 for a, b in zip(recs, recs[1:]) if b.step == a.step + 1]
    cadence_ms = statistics.median(cadences)

    # the GPU's share: replay of the same batch shape (context ~ mid-run) + greedy sampling
    from benchmarks.decode import make_batch

    runner = core.runner
    ctx = args.input_len + args.output_len // 2
    batch = make_batch(n, ctx, runner.kv_caches, runner.attn_backend)
    with torch.inference_mode():
        gpu_times = cuda_times_ms(lambda: runner.graphs.replay(batch).argmax(-1).cpu(), warmup=3, iters=50)
    gpu_ms = statistics.median(gpu_times)
    host = cadence_ms - gpu_ms  # as measured: negative when the loop runs ahead of the GPU time taken apart
    lo, hi = median_difference_ci(cadences, gpu_times)
    row = {"model": args.model, "overlap": overlap, "bs": n, "steps": len(recs), "step_ms": step_ms,
           "cadence_ms": cadence_ms, "gpu_ms": gpu_ms, "host_ms": host, "host_ci_low_ms": lo, "host_ci_high_ms": hi,
           "host_fraction": host / cadence_ms,
           **{f"{k}_ms": statistics.median(v[len(v) // 2 :]) for k, v in timings.items()}}
    return row



PROFILE_FROM = 120  # launch count at which ten steps are profiled


def _time_host_phases(core) -> dict[str, list[float]]:
    """Wall time of each step's phases on the host (ms): scheduling, launching (inputs, graph replay
    and sampling queued), and waiting for the step's ids. A launch that takes as long as the device
    step is blocked on the device somewhere."""
    timings: dict[str, list[float]] = {"schedule": [], "launch": [], "wait": []}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timings[name].append((time.perf_counter() - t0) * 1e3)
        return wrapper

    core.scheduler.schedule = timed("schedule", core.scheduler.schedule)
    launch = core.runner.launch

    calls = [0]
    profiler = []

    def launch_and_time_wait(sched):
        # ten steady steps under the profiler: the CUDA runtime calls show any host-device sync
        calls[0] += 1
        if calls[0] == PROFILE_FROM and torch.cuda.is_available():
            profiler.append(torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]))
            profiler[0].__enter__()
        if calls[0] == PROFILE_FROM + 10 and profiler:
            profiler[0].__exit__(None, None, None)
            print(profiler[0].key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
        pending = timed("launch", launch)(sched)
        pending.result = timed("wait", pending.result)
        return pending

    core.runner.launch = launch_and_time_wait
    return timings


if __name__ == "__main__":
    main()
