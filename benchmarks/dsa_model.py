"""DeepSeek sparse attention decode against its floor: dummy:glm-5-l5 whole steps, sparse and forced dense.

One decode step replayed from its CUDA graph at each batch size and context, every sequence attending over
``ctx`` cached tokens, routing uniform (``--routing router`` takes the random router's own choice), as
benchmarks/deepseek.py measures V2-Lite. Floor: the bytes the step must read
(``ModelDescription.decode_read_bytes``): dense weights (MLA and indexer projections, the dense layers, router
gates, shared experts), the lm_head, the batch's embedding rows, the routed experts touched, every indexer key of
each context and, past ``index_topk``, only the ``index_topk`` latent rows each sequence's attention reads per
layer; over the best read bandwidth measured in the same run.

Two modes per context, each captured on its own:

- ``sparse``: the model as it ships (``index_topk`` 2048);
- ``dense``: every indexer asked for as many positions as the block tables hold, so the selection is the whole
  context and sparse MLA reads every latent row: dense MLA attention on the same shapes and kernels. Its floor
  counts every latent row. Where the two modes' attention times cross is where sparse attention starts to win.

``attn_ms`` is the step's attention alone: each layer's indexer (scores and top-k, for the layers that own one)
and its sparse MLA over the caches the step reads, at the step's shapes, replayed from one CUDA graph of all the
layers' calls. ``attn_per_req_ms`` divides it by the batch.

Targets (printed, and written under ``targets``): the bs-64 ctx-32k step <= 1.35 x floor; attention's time per
request per step at ctx 32k over ctx 4k, bs 64, <= 2.5; sparse attention >= 3x faster than dense at ctx 32k, bs 64.

Run: python3 -m benchmarks.dsa_model [--bs 1 64] [--ctx 4096 32768] [--routing uniform router]   (dsa_decode.json)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time

import torch

from benchmarks.common import cuda_time_ms, print_table, write_result
from benchmarks.decode import make_batch
from benchmarks.decode_setup import HEADROOM, captured_graphs, context_kv_caches
from benchmarks.kernels import graph_time_ms
from benchmarks.moe import _replay, experts_touched, set_routing, touched_total
from benchmarks.roofline import measured_read_bw
from graphserve.config import EngineConfig
from graphserve.kernels import dsa
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.layers.dsa_attention import DsaAttention
from graphserve.models.loader import load_model

COLS = ["model", "mode", "bs", "ctx", "experts_touched", "step_ms", "floor_ms", "ratio", "attn_ms", "attn_per_req_ms"]
GLM5 = "dummy:glm-5-l5"


def dsa_layers(model: torch.nn.Module) -> list[DsaAttention]:
    return [m for m in model.modules() if isinstance(m, DsaAttention)]


@contextlib.contextmanager
def selecting(model: torch.nn.Module, topk: int | None):
    """Every indexer asked for ``topk`` positions (None: as the model ships)."""
    indexers = [a.indexer for a in dsa_layers(model) if a.indexer is not None]
    kept = [ix.topk for ix in indexers]
    try:
        for ix in indexers:
            ix.topk = topk or ix.topk
        yield
    finally:
        for ix, k in zip(indexers, kept):
            ix.topk = k


def attention_ms(model: torch.nn.Module, batch, max_len: int) -> float:
    """One step's attention alone: per layer the indexer's scores and top-k (layers owning one) and sparse MLA, over
    the batch's caches and block tables, on random queries at the step's shapes, from one CUDA graph."""
    t = batch.num_tokens
    dev = batch.block_tables.device
    row_seq, row_pos = dsa.token_rows(batch.query_start_loc, batch.seq_lens, t)
    calls = []
    for a in dsa_layers(model):
        q_lat = torch.randn(t, a.num_heads, a.kv_lora_rank, device=dev, dtype=torch.bfloat16) * 0.1
        q_rope = torch.randn(t, a.num_heads, a.rope, device=dev, dtype=torch.bfloat16) * 0.1
        ix = a.indexer
        q_ix = w_ix = None
        if ix is not None:
            q_ix = torch.randn(t, ix.n_heads, ix.head_dim, device=dev, dtype=torch.bfloat16)
            w_ix = torch.rand(t, ix.n_heads, device=dev) * ix.weight_scale
        calls.append((a, q_lat, q_rope, q_ix, w_ix))

    def step():
        idx = None
        for a, q_lat, q_rope, q_ix, w_ix in calls:
            ix = a.indexer
            if ix is not None:
                # a forced-dense selection asks for the captured tables' width; this batch's tables are narrower
                idx = dsa.indexer_topk(q_ix, w_ix, batch.kv_caches[ix.cache_index], batch.block_tables, row_seq,
                                       row_pos, max_len, min(ix.topk, max_len))  # fmt: skip
            dsa.sparse_mla(q_lat, q_rope, batch.kv_caches[a.layer_idx], batch.block_tables, row_seq, idx, a.scale)

    return graph_time_ms(step, calls=2, replays=5)


def bench(sizes: list[int], contexts: list[int], routing: str, bw) -> list[dict]:
    device = torch.device("cuda")
    top = max(contexts)
    cfg = EngineConfig(model=GLM5, device="cuda", max_model_len=top + 64)
    loaded = load_model(cfg, device)
    model, info = loaded.model, loaded.info
    desc = info.description
    dense_desc = dataclasses.replace(desc, attn_topk=0)  # every latent row read, as forced-dense attention does
    kv_caches = context_kv_caches(info, max(sizes), top, cfg.block_size, device)
    backend = TritonAttentionBackend()
    layers = set_routing(model, routing)
    rows = []
    with torch.inference_mode():
        for ctx in contexts:
            for mode in ("sparse", "dense"):
                # the dense mode's selection spans the captured block tables (captured_graphs' width), so every
                # position in context is selected
                topk = None if mode == "sparse" else ((ctx + HEADROOM) // cfg.block_size + 1) * cfg.block_size
                with selecting(model, topk):
                    graphs = captured_graphs(model, backend, kv_caches, sizes, ctx, cfg, device)
                    for bs in sizes:
                        batch = make_batch(bs, ctx, kv_caches, backend, info.vocab_size)
                        ms = cuda_time_ms(_replay(graphs, batch), warmup=3, iters=20)
                        touched = experts_touched(layers)
                        d = desc if mode == "sparse" else dense_desc
                        nbytes = d.decode_read_bytes(bs, bs * (ctx + 1), touched)
                        bw.observe(f"{GLM5} {mode} decode bs={bs} ctx={ctx}", nbytes, ms)
                        attn = attention_ms(model, batch, batch.block_tables.shape[1] * cfg.block_size)
                        row = {"model": GLM5, "mode": mode, "bs": bs, "ctx": ctx, "routing": routing,
                               "experts_touched": touched_total(touched), "step_ms": ms, "bytes": nbytes,
                               "attn_ms": attn, "attn_per_req_ms": attn / bs,
                               "card": torch.cuda.get_device_name(0)}  # fmt: skip
                        rows.append(row)
                        print(f"{GLM5} {mode} bs={bs} ctx={ctx}: step {ms:.3f} ms, attention {attn:.3f} ms")
                    del graphs
                torch.cuda.empty_cache()
    return rows


def targets(rows: list[dict]) -> dict:
    pick = {(r["mode"], r["bs"], r["ctx"]): r for r in rows}
    out: dict = {}
    s32, s4, d32 = pick.get(("sparse", 64, 32768)), pick.get(("sparse", 64, 4096)), pick.get(("dense", 64, 32768))
    if s32:
        out["step_ratio_bs64_ctx32k"] = {"value": s32["ratio"], "target": 1.35, "met": s32["ratio"] <= 1.35}
    if s32 and s4:
        v = s32["attn_per_req_ms"] / s4["attn_per_req_ms"]
        out["attn_growth_32k_over_4k_bs64"] = {"value": v, "target": 2.5, "met": v <= 2.5}
    if s32 and d32:
        v = d32["attn_ms"] / s32["attn_ms"]
        out["sparse_speedup_attn_ctx32k_bs64"] = {"value": v, "target": 3.0, "met": v >= 3.0}
    crossings = sorted(ctx for (mode, bs, ctx), r in pick.items()
                       if mode == "sparse" and bs == 64 and ("dense", 64, ctx) in pick
                       and r["attn_ms"] < pick[("dense", 64, ctx)]["attn_ms"])  # fmt: skip
    out["sparse_faster_from_ctx_bs64"] = crossings[0] if crossings else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bs", nargs="+", type=int, default=[1, 64])
    p.add_argument("--ctx", nargs="+", type=int, default=[4096, 32768])
    p.add_argument("--routing", default="uniform", choices=["uniform", "router"])
    args = p.parse_args()
    start = time.perf_counter()
    bw = measured_read_bw()
    print(bw.describe())
    rows = bench(args.bs, args.ctx, args.routing, bw)
    bw.probe_again()
    for r in rows:
        r.update(bw.ratios(r["step_ms"], r["bytes"]))
    found = targets(rows)
    write_result("dsa_decode", {"read_bandwidth": bw.summary(), "rows": rows, "targets": found})
    print(f"GLM-5 (5 layers) decode: {time.perf_counter() - start:.0f} s\n")
    print_table(rows, COLS)
    for name, v in found.items():
        print(f"{name}: {v}")


if __name__ == "__main__":
    main()
