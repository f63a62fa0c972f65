"""Decode step time against the physical floor, graphs on and off.

For each model, batch size and context: the step is one decode forward (embedding, layers,
logits) plus greedy sampling, with every sequence attending over ``ctx`` cached tokens. The floor
is max(bytes that must be read / measured read bandwidth, FLOPs / measured matmul peak), where the
bytes are every weight the step uses (only the batch's rows of the embedding table) plus the KV
cache in context. The bandwidth is the best of benchmarks.roofline's probes and of the rates the
steps themselves reach, all in this run, so no row can beat its floor; ``ratio_datasheet`` is the
same step against the card's datasheet bandwidth.

Run: python3 -m benchmarks.decode [--models dummy:qwen3-0.6b dummy:llama3-8b] [--bs 1 8 32 128 256] [--ctx 512 2048]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from benchmarks.common import cuda_time_ms, print_table, write_result
from benchmarks.roofline import ReadBandwidth, matmul_tflops, measured_read_bw
from graphserve.config import EngineConfig
from graphserve.engine.graphs import GraphRunner
from graphserve.kernels.argmax import greedy_argmax
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.layers.forward_batch import ForwardBatch, contiguous_batch
from graphserve.models.loader import load_model


def step_cost(info, bs: int, ctx: int, experts_touched: int | Sequence[int] | None = None) -> tuple[int, int]:
    """(bytes read, FLOPs) of one decode step of ``bs`` rows over ``ctx`` cached tokens each.

    The bytes are the model's own description (models/description.py: every weight the step reads,
    the batch's embedding rows, the KV in context): the same figures `graphserve plan` prints. A MoE
    model's step reads the experts its router chose (``experts_touched``: one count per MoE layer from the
    step's own counts, benchmarks/moe.experts_touched, or their sum); without it, the fewest a step can touch.
    FLOPs: each matmul weight once per row, attention 4·ctx·heads·head_dim per row and layer."""
    desc = info.description
    read = desc.decode_read_bytes(bs, bs * ctx, experts_touched)
    matmul = desc.dense_params + (desc.lm_head_params or desc.embed_params) + desc.num_moe_layers * desc.top_k * \
        desc.expert_params
    flops = 2 * bs * matmul + 4 * bs * ctx * info.num_layers * info.num_heads * info.head_dim
    return read, flops


def make_batch(bs: int, ctx: int, kv_caches, backend, vocab_size: int = 1000) -> ForwardBatch:
    """``bs`` sequences decoding their token at position ``ctx`` over ``ctx`` cached tokens (input ids drawn from
    ``[0, vocab_size)``)."""
    return contiguous_batch([1] * bs, [ctx + 1] * bs, kv_caches, backend, vocab_size=vocab_size)


def _step_fn(model, graphs: GraphRunner | None, batch: ForwardBatch):
    """One decode step (forward + greedy sampling), replayed from a graph or run eagerly."""
    if graphs is not None:
        return lambda: greedy_argmax(graphs.replay(batch))
    return lambda: greedy_argmax(model.compute_logits(model.forward(batch.input_ids, batch.positions, batch)))


def bench_model(name: str, sizes: list[int], ctxs: list[int], bw: ReadBandwidth) -> list[dict]:
    """Step times with the bytes and FLOPs each must move; the ratios are filled in by ``add_ratios``."""
    device = torch.device("cuda")
    cfg = EngineConfig(model=name, device="cuda", max_model_len=max(ctxs) + 64)
    loaded = load_model(cfg, device)
    model, info = loaded.model, loaded.info
    bsz = cfg.block_size
    max_blocks = (max(ctxs) + 64) // bsz + 1
    tokens = max(sizes) * max(ctxs) + max(sizes) * 2 * bsz
    num_blocks = tokens // bsz + 2
    kv_caches = info.kv.allocate(num_blocks, bsz, device, fill="random")
    backend = TritonAttentionBackend()
    rows = []
    graphs = GraphRunner(model, backend, kv_caches, sizes, max_blocks, cfg.max_model_len, device)
    with torch.inference_mode():
        graphs.capture()
        for ctx in ctxs:
            for bs in sizes:
                batch = make_batch(bs, ctx, kv_caches, backend)
                read, flops = step_cost(info, bs, ctx)
                for graph in (True, False):
                    ms = cuda_time_ms(_step_fn(model, graphs if graph else None, batch), warmup=3, iters=20)
                    bw.observe(f"{name} decode step bs={bs} ctx={ctx}", read, ms)
                    rows.append({"model": name, "bs": bs, "ctx": ctx, "graph": graph, "step_ms": ms,
                                 "read_bytes": read, "flops": flops})
                    print_table(rows[-1:], ["model", "bs", "ctx", "graph", "step_ms", "read_bytes"])
    torch.cuda.empty_cache()
    return rows


COLS = ["model", "bs", "ctx", "graph", "step_ms", "floor_ms", "ratio", "ratio_datasheet"]


def add_ratios(rows: list[dict], bw: ReadBandwidth, peak: float) -> None:
    """Each row against the floor at the best read rate of the whole run (probes and steps alike)."""
    for r in rows:
        r.update(bw.ratios(r["step_ms"], r["read_bytes"], r["flops"], peak))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["dummy:qwen3-0.6b", "dummy:llama3-8b"])
    p.add_argument("--bs", nargs="+", type=int, default=[1, 8, 32, 128, 256])
    p.add_argument("--ctx", nargs="+", type=int, default=[512, 2048])
    args = p.parse_args()
    bw, peak = measured_read_bw(), matmul_tflops()
    print(f"probes: {bw.describe()}; bf16 matmul peak {peak:.0f} TFLOP/s")
    rows = []
    for m in args.models:
        rows += bench_model(m, args.bs, args.ctx, bw)
    add_ratios(rows, bw, peak)
    print()
    print(f"floor: {bw.describe()}")
    print_table(rows, COLS)
    write_result("decode", {"ceilings": {"read": bw.summary(), "matmul_tflops": peak}, "rows": rows})


if __name__ == "__main__":
    main()
