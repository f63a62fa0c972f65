"""DeepSeek-V4 decode against its floor: dummy:deepseek-v4-flash-l6 whole steps replayed from CUDA graphs, and its
attention alone against the bytes it must read.

Steps: at each batch size and context that the KV pool holds (the rest are listed under ``skipped`` with the bytes
they would need), every sequence decoding its token at position ``ctx`` over ``ctx`` cached tokens, routing uniform
(``--routing router`` takes the random router's choice), one step replayed from its graph. Floor: the dense weights,
the lm_head and the batch's embedding rows, the routed experts touched (``ModelDescription.decode_read_bytes`` less
its KV term), and the cache bytes each layer must read for each sequence (``step_cache_bytes``): the window's
latents; HCA every compressed entry; CSA every indexer key and the ``index_topk`` entries chosen; and each
compressed layer's compressor checkpoint (the fp32 accumulators of the sequence's open groups, read every step; the
step's own projections never leave it). Over the best read bandwidth measured in the same run.

Attention alone (``attention_alone``): per layer, CSA's indexer scores and top-k and every layer's attention kernel,
on random queries at the step's shapes, replayed from one CUDA graph of all six layers' calls, against its bytes
(``attention_bytes``: the step's cache bytes without the checkpoints). It reads the compact pages as the engine
lays them out (layers/kv_layout.CompactCache: a checkpoint and one entry row per ``rate`` tokens a block) and one
latent cache that all layers share (a layer reads only its 128-token window of it: 2 MB at bs 16, the only bytes a
later layer may find in L2), so 512k tokens at bs 16 fit one GPU.

Pool: the compact layout keeps 9,344 B a token over the six layers at the default ``--block-size 16`` (31,232 B
when every token's row kept its compressor state), so bs 64 x ctx 64k (4.2M tokens) needs a 36.5 GiB pool beside
23.8 GiB of weights: an 80 GB card holds it (122 GiB before).

Targets (printed, written under ``targets``): the bs-64 ctx-64k step <= 1.4 x floor; attention at bs 16 ctx 512k
<= 1.5 x its bytes at the measured rate.

Run: python3 -m benchmarks.v4_decode [--bs 1 16 64] [--ctx 4096 65536 524288] [--quick]   (v4_decode.json)
``--quick`` (bs 1 and 64 at 4k and 64k, attention at bs 16 and 64k) is under 4 minutes on an H100.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoConfig

from benchmarks.common import cuda_time_ms, print_table, write_result
from benchmarks.decode import make_batch
from benchmarks.decode_setup import HEADROOM, captured_graphs, context_kv_caches, release_gpu_memory
from benchmarks.kernels import graph_time_ms
from benchmarks.moe import _replay, experts_touched, set_routing, touched_total
from benchmarks.roofline import measured_read_bw
from graphserve.config import EngineConfig
from graphserve.kernels import dsa, v4_attention
from graphserve.kernels.dsa_indexer import compressed_indexer_scores
from graphserve.layers.attention_triton import TritonAttentionBackend
from graphserve.layers.kv_layout import CompactCache
from graphserve.models.deepseek_v4_shape import CSA, SLIDING, V4Shape, v4_shape_from_config
from graphserve.models.loader import load_model
from graphserve.models.presets import get_preset_config

MODEL = "dummy:deepseek-v4-flash-l6"
COLS = ["bs", "ctx", "experts_touched", "step_ms", "floor_ms", "ratio"]
ATTN_COLS = ["bs", "ctx", "attn_ms", "floor_ms", "ratio"]
# GPU memory kept free beside the KV pool: the captured graphs' pool and the step's activations at bs 64
RESERVE_BYTES = 6 << 30
STEP_TARGET, ATTN_TARGET = 1.4, 1.5
GiB = 1 << 30


def attention_bytes(s: V4Shape, ctx: int, itemsize: int) -> int:
    """Cache bytes one sequence's attention reads at position ``ctx`` over all layers: its window's latents; HCA every
    visible entry; CSA every indexer key and the ``index_topk`` entries chosen."""
    total = 0
    for i, t in enumerate(s.layer_types):
        total += min(ctx + 1, s.sliding_window) * s.head_dim
        m = s.rate(i)
        if not m:
            continue
        entries = (ctx + 1) // m
        total += entries * s.index_head_dim + min(entries, s.index_topk) * s.head_dim if t == CSA else \
            entries * s.head_dim  # fmt: skip
    return total * itemsize


def step_cache_bytes(s: V4Shape, ctx: int, itemsize: int) -> int:
    """``attention_bytes`` and each compressed layer's compressor checkpoint (fp32), which every step reads."""
    return attention_bytes(s, ctx, itemsize) + sum(4 * s.state_floats(i) for i in s.compressed_layers)


def pool_bytes(info, bs: int, ctx: int, block_size: int) -> int:
    """What ``context_kv_caches`` allocates for ``bs`` sequences of ``ctx + 1`` tokens."""
    return (bs * (-(-(ctx + 1) // block_size)) + 2) * block_size * info.kv.bytes_per_token


def bench_steps(sizes: list[int], contexts: list[int], routing: str, bw) -> tuple[list[dict], list[dict]]:
    device = torch.device("cuda")
    cfg = EngineConfig(model=MODEL, device="cuda", max_model_len=max(contexts) + HEADROOM)
    loaded = load_model(cfg, device)
    model, info = loaded.model, loaded.info
    s, desc, itemsize = model.shape, info.description, info.kv.dtype.itemsize
    backend = TritonAttentionBackend()
    layers = set_routing(model, routing)
    rows, skipped = [], []
    with torch.inference_mode():
        for ctx in contexts:
            free = torch.cuda.mem_get_info(device)[0] - RESERVE_BYTES
            fit = [bs for bs in sizes if pool_bytes(info, bs, ctx, cfg.block_size) <= free]
            for bs in sizes:
                if bs not in fit:
                    need = pool_bytes(info, bs, ctx, cfg.block_size)
                    skipped.append({"bs": bs, "ctx": ctx, "pool_gib": need / GiB, "free_gib": free / GiB})
                    print(f"bs={bs} ctx={ctx}: the pool needs {need / GiB:.1f} GiB, {free / GiB:.1f} GiB free: skipped")
            if not fit:
                continue
            kv_caches = context_kv_caches(info, max(fit), ctx, cfg.block_size, device)
            graphs = captured_graphs(model, backend, kv_caches, fit, ctx, cfg, device)
            for bs in fit:
                batch = make_batch(bs, ctx, kv_caches, backend, info.vocab_size)
                ms = cuda_time_ms(_replay(graphs, batch), warmup=3, iters=20)
                touched = experts_touched(layers)
                kv_model = desc.kv_read_bytes(bs, bs * (ctx + 1))
                nbytes = desc.decode_read_bytes(bs, bs * (ctx + 1), touched) - kv_model + \
                    bs * step_cache_bytes(s, ctx, itemsize)  # fmt: skip
                bw.observe(f"{MODEL} decode bs={bs} ctx={ctx}", nbytes, ms)
                rows.append({"model": MODEL, "bs": bs, "ctx": ctx, "routing": routing,
                             "experts_touched": touched_total(touched), "step_ms": ms, "bytes": nbytes,
                             "cache_bytes": bs * step_cache_bytes(s, ctx, itemsize),
                             "card": torch.cuda.get_device_name(0)})  # fmt: skip
                print(f"{MODEL} bs={bs} ctx={ctx}: step {ms:.3f} ms, {nbytes / 1e9:.3f} GB")
            del graphs, kv_caches
            release_gpu_memory()
    del model, loaded
    release_gpu_memory()
    return rows, skipped


def _table(bs: int, ctx: int, block_size: int, first: int, device) -> torch.Tensor:
    """Block tables of ``bs`` sequences of ``ctx + 1`` tokens on consecutive blocks from ``first``, one spare
    column (the dummy block)."""
    per = -(-(ctx + 1) // block_size)
    cols = torch.arange(per, device=device, dtype=torch.int32)
    table = torch.zeros(bs, per + 1, dtype=torch.int32, device=device)
    table[:, :per] = first + torch.arange(bs, device=device, dtype=torch.int32)[:, None] * per + cols
    return table


def attention_alone(s: V4Shape, bs: int, ctx: int, block_size: int, device: str = "cuda",
                    dtype: torch.dtype = torch.bfloat16) -> tuple[float, int]:  # fmt: skip
    """(ms, bytes) of one step's attention over all layers at ``bs`` x ``ctx`` (module docstring)."""
    per = -(-(ctx + 1) // block_size)
    slots = (bs * per + 1) * block_size
    table = _table(bs, ctx, block_size, 1, device)
    latents = torch.randn(slots, s.head_dim, device=device, dtype=dtype).mul_(0.5)
    # the engine reads the window through its block -> latent page map (layers/kv_layout.py): one page a block here
    latent_page = torch.arange(slots // block_size, device=device, dtype=torch.int32)
    row_seq = torch.arange(bs, device=device, dtype=torch.int32)
    positions = torch.full((bs,), ctx, device=device, dtype=torch.int64)
    calls = []
    for i, t in enumerate(s.layer_types):
        m = s.rate(i)
        rows = None
        if t != SLIDING:  # random entries; the checkpoint ahead of them is never read here
            rows = torch.randn(slots // block_size, page_width(s, i, block_size, dtype), device=device, dtype=dtype)
            rows.mul_(0.5)
        q = torch.randn(bs, s.num_heads, s.head_dim, device=device, dtype=dtype)
        sinks = torch.randn(s.num_heads, device=device)
        ix = None
        if t == CSA:
            ix = (torch.randn(bs, s.index_n_heads, s.index_head_dim, device=device, dtype=dtype),
                  torch.rand(bs, s.index_n_heads, device=device) * (s.index_n_heads * s.index_head_dim) ** -0.5)
        calls.append((m, rows, q, sinks, ix, s.state_floats(i), s.entry_width(i)))
    keys_of = {m: table.shape[1] * block_size // m for m, *_ in calls if m}
    lasts = {m: ((positions + 1) // m - 1).int() for m in keys_of}

    def step():
        for m, rows, q, sinks, ix, sf, ew in calls:
            idx = None
            if ix is not None:
                scores = compressed_indexer_scores(ix[0], ix[1], rows, s.head_dim, m, block_size, table, row_seq,
                                                   lasts[m], keys_of[m], state_floats=sf, entry_width=ew)  # fmt: skip
                idx = dsa.topk_indices(scores, lasts[m], s.index_topk)
            v4_attention.v4_attention(q, latents, rows, 0, table, row_seq, positions, sinks, s.head_dim**-0.5,
                                      s.sliding_window, m, block_size, idx, sf, ew, latent_page=latent_page)  # fmt: skip

    ms = graph_time_ms(step, calls=2, replays=5)
    return ms, bs * attention_bytes(s, ctx, dtype.itemsize)


def page_width(s: V4Shape, layer: int, block_size: int, dtype: torch.dtype) -> int:
    """Elements of one block's compact page of ``layer`` (as KVLayout.allocate lays it out)."""
    return CompactCache(s.rate(layer), s.entry_width(layer), 4 * s.state_floats(layer)).page_width(block_size,
                                                                                                   dtype.itemsize)


def attention_memory(s: V4Shape, bs: int, ctx: int, block_size: int, dtype: torch.dtype = torch.bfloat16) -> int:
    blocks = bs * -(-(ctx + 1) // block_size) + 1
    pages = sum(page_width(s, i, block_size, dtype) for i in s.compressed_layers)
    return (blocks * block_size * s.head_dim + blocks * pages) * dtype.itemsize


def targets(rows: list[dict], attn: list[dict]) -> dict:
    out: dict = {}
    step = next((r for r in rows if r["bs"] == 64 and r["ctx"] == 65536), None)
    out["step_ratio_bs64_ctx64k"] = {"value": step["ratio"] if step else None, "target": STEP_TARGET,
                                     "met": bool(step and step["ratio"] <= STEP_TARGET),
                                     "note": None if step else "not run: the KV pool does not hold it (skipped)"}
    a = next((r for r in attn if r["bs"] == 16 and r["ctx"] == 524288), None)
    out["attention_ratio_bs16_ctx512k"] = {"value": a["ratio"] if a else None, "target": ATTN_TARGET,
                                           "met": bool(a and a["ratio"] <= ATTN_TARGET),
                                           "note": None if a else "not run (--quick, or memory)"}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bs", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--ctx", nargs="+", type=int, default=[4096, 65536, 524288])
    p.add_argument("--attn", nargs=2, type=int, default=[16, 524288], metavar=("BS", "CTX"),
                   help="batch and context of the attention-alone row")
    p.add_argument("--routing", default="uniform", choices=["uniform", "router"])
    p.add_argument("--quick", action="store_true", help="bs 1 and 64 at 4k and 64k; attention at bs 16, 64k")
    args = p.parse_args()
    if args.quick:
        args.bs, args.ctx, args.attn = [1, 64], [4096, 65536], [16, 65536]
    start = time.perf_counter()
    bw = measured_read_bw()
    print(bw.describe())
    rows, skipped = bench_steps(args.bs, args.ctx, args.routing, bw)
    s = v4_shape_from_config(AutoConfig.for_model(**get_preset_config(MODEL.removeprefix("dummy:"))))
    attn = []
    bs, ctx = args.attn
    block_size = EngineConfig(model=MODEL).block_size
    need, free = attention_memory(s, bs, ctx, block_size), torch.cuda.mem_get_info()[0] - RESERVE_BYTES
    if need <= free:
        with torch.inference_mode():
            ms, nbytes = attention_alone(s, bs, ctx, block_size)
        bw.observe(f"{MODEL} attention bs={bs} ctx={ctx}", nbytes, ms)
        attn.append({"model": MODEL, "bs": bs, "ctx": ctx, "attn_ms": ms, "bytes": nbytes,
                     "card": torch.cuda.get_device_name(0)})
        print(f"attention bs={bs} ctx={ctx}: {ms:.3f} ms, {nbytes / 1e9:.3f} GB")
    else:
        skipped.append({"attention": True, "bs": bs, "ctx": ctx, "need_gib": need / GiB, "free_gib": free / GiB})
        print(f"attention bs={bs} ctx={ctx}: needs {need / GiB:.1f} GiB, {free / GiB:.1f} GiB free: skipped")
    release_gpu_memory()
    bw.probe_again()
    for r in rows:
        r.update(bw.ratios(r["step_ms"], r["bytes"]))
    for r in attn:
        r.update(bw.ratios(r["attn_ms"], r["bytes"]))
    found = targets(rows, attn)
    write_result("v4_decode", {"read_bandwidth": bw.summary(), "card": torch.cuda.get_device_name(0), "rows": rows,
                               "attention": attn, "skipped": skipped, "targets": found})  # fmt: skip
    print(f"DeepSeek-V4-Flash (6 layers) decode: {time.perf_counter() - start:.0f} s\n")
    print_table(rows, COLS)
    print()
    print_table(attn, ATTN_COLS)
    for name, v in found.items():
        print(f"{name}: {v}")


if __name__ == "__main__":
    main()
