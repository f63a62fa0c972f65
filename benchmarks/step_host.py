"""How much of a timed decode step is host time: the step synced per call (as benchmarks.decode and benchmarks.fp8
time it) against the same step replayed ten times between one pair of events, and the host's time in each part.

``GraphRunner.replay`` stages the batch's inputs (one launch, kernels/graph_inputs.py) and then launches the captured
graph. Timed the way the decode benchmarks time a step (an event, the call, an event, a sync), the GPU starts each
call with its queue empty: it waits while the host stages the inputs and launches the graph, and that wait is part of
the step's time. Back to back the host issues the next call while the GPU still runs the last, so the same wait is
hidden. ``synced_ms - back_to_back_ms`` is the host time a synced step exposes; ``stage_host_us`` and
``graph_launch_host_us`` are the host's time in ``stage`` and in the graph's launch (medians of 20, each after a sync).

Run: python3 -m benchmarks.step_host [--models dummy:llama3-8b] [--quantization fp8] [--rounds 2]
(writes benchmarks/results/step_host.json)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import cuda_time_ms, print_table, write_result
from benchmarks.decode import make_batch
from benchmarks.decode_setup import captured_graphs
from graphserve.config import EngineConfig
from graphserve.kernels.argmax import greedy_argmax
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.models.loader import load_model

CASES = ((1, 512), (64, 2048))  # (batch, context): the FP8 decode table's batch-1 and batch-64 rows


def measure(name: str, quantization: str, rounds: int) -> list[dict]:
    dev = torch.device("cuda")
    ctx = max(c for _, c in CASES)
    sizes = [bs for bs, _ in CASES]
    cfg = EngineConfig(model=name, device="cuda", quantization=quantization, max_model_len=ctx + 64)
    loaded = load_model(cfg, dev)
    info = loaded.info
    bsz = cfg.block_size
    kv = info.kv.allocate(max(sizes) * (ctx + 2 * bsz) // bsz + 2, bsz, dev, fill="random")
    backend = TritonAttentionBackend()
    rows = []
    with torch.inference_mode():
        graphs = captured_graphs(loaded.model, backend, kv, sizes, ctx, cfg, dev)
        for bs, c in CASES:
            batch = make_batch(bs, c, kv, backend)
            ps = graphs.padded_size(bs)

            def step(b=batch):
                return greedy_argmax(graphs.replay(b))

            def ten():
                for _ in range(10):
                    step()

            for rnd in range(rounds):
                synced = cuda_time_ms(step, warmup=3, iters=20)
                piped = cuda_time_ms(ten, warmup=1, iters=10) / 10
                staged, launched = [], []
                for _ in range(20):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    graphs.stage(batch, ps)
                    t1 = time.perf_counter()
                    graphs.graphs[ps].replay()
                    t2 = time.perf_counter()
                    staged.append((t1 - t0) * 1e6)
                    launched.append((t2 - t1) * 1e6)
                torch.cuda.synchronize()
                rows.append({"model": name, "quantization": quantization, "bs": bs, "ctx": c, "round": rnd,
                             "synced_ms": synced, "back_to_back_ms": piped, "host_exposed_ms": synced - piped,
                             "stage_host_us": statistics.median(staged),
                             "graph_launch_host_us": statistics.median(launched)})
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["dummy:llama3-8b"])
    p.add_argument("--quantization", default="fp8")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds} is invalid: must be >= 1")
    rows = [r for m in args.models for r in measure(m, args.quantization, args.rounds)]
    print_table(rows, ["model", "bs", "ctx", "round", "synced_ms", "back_to_back_ms", "host_exposed_ms",
                       "stage_host_us", "graph_launch_host_us"])
    write_result("step_host", {"rows": rows})


if __name__ == "__main__":
    main()
