"""The first story's setting: graphs captured up to 32, a running batch of 64.

Decode throughput and peak memory at batch 32 (graph) and 64 (captured pieces replayed one after
another, graphserve's split path) against the naive alternative, plain eager at 64 (what SGLang
falls back to), in the same run. Peak memory is max_memory_allocated during the step over the
memory held before it.

Run: python3 -m benchmarks.cliff [--models dummy:qwen3-0.6b dummy:llama3-8b] [--ctx 1024]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import cuda_time_ms, print_table, write_result
from benchmarks.decode import make_batch
from graphserve.config import EngineConfig, default_cuda_graph_sizes
from graphserve.engine.graphs import GraphRunner
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.models.loader import load_model

GiB = 1 << 30


def peak_extra_bytes(fn) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench_model(name: str, ctx: int, max_bs: int, big_bs: int) -> list[dict]:
    device = torch.device("cuda")
    cfg = EngineConfig(model=name, device="cuda", max_model_len=ctx + 64, cuda_graph_max_bs=max_bs)
    loaded = load_model(cfg, device)
    model, info = loaded.model, loaded.info
    dtype = next(model.parameters()).dtype
    bsz = cfg.block_size
    num_blocks = big_bs * ((ctx + 1) // bsz + 2) + 2
    kv = [torch.randn(2, num_blocks, bsz, info.num_kv_heads, info.head_dim, device=device, dtype=dtype).mul_(0.5)
          for _ in range(info.num_layers)]
    backend = TritonAttentionBackend()
    graphs = GraphRunner(model, backend, kv, default_cuda_graph_sizes(max_bs), cfg.max_model_len // bsz + 1,
                         cfg.max_model_len, device)
    rows = []
    with torch.inference_mode():
        graphs.capture()
        small = make_batch(max_bs, ctx, kv, backend)
        big = make_batch(big_bs, ctx, kv, backend)
        cases = [
            (f"graph@{max_bs}", max_bs, lambda: graphs.replay(small).argmax(-1)),
            (f"split-graph@{big_bs}", big_bs, lambda: graphs.replay_split(big).argmax(-1)),
            (f"eager@{big_bs}", big_bs,
             lambda: model.compute_logits(model.forward(big.input_ids, big.positions, big)).argmax(-1)),
        ]
        for label, bs, fn in cases:
            ms = cuda_time_ms(fn, warmup=3, iters=20)
            extra = peak_extra_bytes(fn)
            rows.append({"model": name, "case": label, "bs": bs, "step_ms": ms, "tok_s": bs / (ms / 1e3),
                         "peak_extra_gib": extra / GiB, "graph_pool_gib": graphs.pool_bytes / GiB})
    base = rows[0]["tok_s"]
    for r in rows:
        r["ratio_vs_graph32"] = r["tok_s"] / base
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["dummy:qwen3-0.6b", "dummy:llama3-8b"])
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--max-bs", type=int, default=32)
    p.add_argument("--big-bs", type=int, default=64)
    args = p.parse_args()
    rows = []
    for m in args.models:
        rows += bench_model(m, args.ctx, args.max_bs, args.big_bs)
        torch.cuda.empty_cache()
    print_table(rows, ["model", "case", "bs", "step_ms", "tok_s", "peak_extra_gib", "graph_pool_gib", "ratio_vs_graph32"])
    write_result("cliff", {"rows": rows, "ctx": args.ctx})


if __name__ == "__main__":
    main()
