"""The first story's setting: graphs captured up to 32, a running batch of 64.

Decode throughput and peak memory at batch 32 (graph) and 64 three ways, in the same run: captured
pieces replayed one after another (graphserve's split path), plain eager (what SGLang falls back
to), and a graph captured at 64 (what raising --cuda-graph-max-bs to 64 buys). ``vs_full_graph``
puts each 64-row case against that full capture: the cost of not capturing the running size.
``vs_graph32`` is kept for the earlier rows, but it holds 1.00 for the split path by construction
(two replays of the same graph). Each step is also put against its floor (weights + KV read at the
best read rate of the run, benchmarks.roofline) and the datasheet bandwidth. Peak memory is
max_memory_allocated during the step over the memory held before it.

Run: python3 -m benchmarks.cliff [--models dummy:qwen3-0.6b dummy:llama3-8b] [--ctx 1024]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import cuda_time_ms, print_table, write_result
from benchmarks.decode import make_batch, step_cost
from benchmarks.roofline import ReadBandwidth, matmul_tflops, measured_read_bw
from graphserve.config import EngineConfig, default_cuda_graph_sizes
from graphserve.engine.graphs import GraphRunner
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.models.loader import load_model

GiB = 1 << 30
COLS = ["model", "case", "bs", "step_ms", "tok_s", "vs_full_graph", "vs_graph32", "ratio", "ratio_datasheet",
        "peak_extra_gib", "graph_pool_gib"]


def peak_extra_bytes(fn) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench_model(name: str, ctx: int, max_bs: int, big_bs: int, bw: ReadBandwidth) -> list[dict]:
    device = torch.device("cuda")
    cfg = EngineConfig(model=name, device="cuda", max_model_len=ctx + 64, cuda_graph_max_bs=max_bs)
    loaded = load_model(cfg, device)
    model, info = loaded.model, loaded.info
    bsz = cfg.block_size
    num_blocks = big_bs * ((ctx + 1) // bsz + 2) + 2
    kv = info.kv.allocate(num_blocks, bsz, device, fill="random")
    backend = TritonAttentionBackend()
    blocks_per_seq = cfg.max_model_len // bsz + 1
    graphs = GraphRunner(model, backend, kv, default_cuda_graph_sizes(max_bs), blocks_per_seq, cfg.max_model_len, device)
    full = GraphRunner(model, backend, kv, [big_bs], blocks_per_seq, cfg.max_model_len, device)
    rows = []
    with torch.inference_mode():
        graphs.capture()
        full.capture()
        small = make_batch(max_bs, ctx, kv, backend)
        big = make_batch(big_bs, ctx, kv, backend)
        cases = [
            (f"graph@{max_bs}", max_bs, lambda: graphs.replay(small).argmax(-1), graphs),
            (f"split-graph@{big_bs}", big_bs, lambda: graphs.replay_split(big).argmax(-1), graphs),
            (f"eager@{big_bs}", big_bs,
             lambda: model.compute_logits(model.forward(big.input_ids, big.positions, big)).argmax(-1), None),
            (f"full-graph@{big_bs}", big_bs, lambda: full.replay(big).argmax(-1), full),
        ]
        for label, bs, fn, runner in cases:
            ms = cuda_time_ms(fn, warmup=3, iters=20)
            extra = peak_extra_bytes(fn)
            read, flops = step_cost(info, bs, ctx)
            bw.observe(f"{name} {label}", read, ms)
            rows.append({"model": name, "case": label, "bs": bs, "step_ms": ms, "tok_s": bs / (ms / 1e3),
                         "read_bytes": read, "flops": flops,
                         "peak_extra_gib": extra / GiB,
                         "graph_pool_gib": runner.pool_bytes / GiB if runner is not None else 0.0})
    full_tok_s = rows[-1]["tok_s"]
    for r in rows:
        r["vs_graph32"] = r["tok_s"] / rows[0]["tok_s"]
        r["vs_full_graph"] = r["tok_s"] / full_tok_s if r["bs"] == big_bs else None
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["dummy:qwen3-0.6b", "dummy:llama3-8b"])
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--max-bs", type=int, default=32)
    p.add_argument("--big-bs", type=int, default=64)
    args = p.parse_args()
    bw, peak = measured_read_bw(), matmul_tflops()
    rows = []
    for m in args.models:
        rows += bench_model(m, args.ctx, args.max_bs, args.big_bs, bw)
        torch.cuda.empty_cache()
    for r in rows:  # against the best read rate of the whole run, steps included
        r.update(bw.ratios(r["step_ms"], r["read_bytes"], r["flops"], peak))
    print(f"floor: {bw.describe()}")
    print_table(rows, COLS)
    write_result("cliff", {"rows": rows, "ctx": args.ctx, "max_bs": args.max_bs, "big_bs": args.big_bs,
                           "ceilings": {"read": bw.summary(), "matmul_tflops": peak}})


if __name__ == "__main__":
    main()
