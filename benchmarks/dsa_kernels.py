"""DeepSeek sparse attention kernels (kernels/dsa.py) against the bytes they must read, beside dense MLA decode.

At GLM-5's and DeepSeek-V3.2's per-rank shapes at tp 1 (64 and 128 heads, indexer 32 and 64 heads x 128,
kv_lora 512 + rope 64, top-k 2048, 16-token blocks), batch 1, 16, 64 and context 4k, 32k, 128k, decode
(one query row a sequence):

- ``sparse_mla``: attention over the 2048 selected latent rows of each row; bytes = those rows (576 bf16
  each) plus the queries and outputs;
- ``dense_mla``: the existing absorbed decode kernel (kernels/mla_attention.py) over the whole context, at the
  tile and split count the engine picks; bytes = every latent row in context plus queries and outputs;
- ``indexer_scores`` (bf16 and FP8 index cache), ``topk`` (the Triton radix select, ``torch.topk`` over
  tie-exact int64 keys, and plain ``torch.topk`` on the fp32 scores, which has no tie rule, for reference)
  and ``indexer_topk`` (scores + the default top-k, the indexer's whole cost); bytes = every index key in
  context (D bf16, or D + 4 bytes in the FP8 form) plus the queries; the ``[T, ctx]`` fp32 scores the two
  kernels pass between them are counted apart (``scores_bytes``), not in the ratio.

Each row: time from CUDA-graph replay, bytes, achieved GB/s and ``pct_bw``, the ratio to the best read
bandwidth measured in the same run (benchmarks/roofline.py, probed before and after), and for the attention
rows the FLOPs and the fraction of the same run's bf16 matmul peak (``pct_mma``): with 64 or 128 heads each
latent row meets 121-242 FLOPs per byte, so the tensor cores bound these kernels as much as memory does.
Every point's sequences come from one pool of blocks (the 64 x 128k point's), shuffled; a point small enough
to sit in L2 rotates over several disjoint sets of sequences within one graph, so no call finds its bytes
cached. ``--tiles``: the sparse kernel at bs 64, ctx 32k under a few tiles of the dense kernel's sweep.

Targets (printed): sparse MLA at bs 64, ctx 32k >= 75% of the read bandwidth on its bytes; sparse >= 3x
faster than dense at ctx 32k, bs 64.

Run: python3 -m benchmarks.dsa_kernels [--quick] [--tiles]      (writes benchmarks/results/dsa_kernels.json)
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.common import print_table, write_result
from benchmarks.kernels import graph_time_ms
from benchmarks.roofline import matmul_tflops, measured_read_bw
from graphserve.kernels import dsa
from graphserve.kernels.common import sm_count
from graphserve.kernels.dsa_reference import index_cache_shape
from graphserve.kernels.dsa_topk import choose_topk_method, topk_indices_torch, topk_indices_triton
from graphserve.kernels.mla_attention import mla_attention
from graphserve.kernels.mla_config import MLATile

MODELS = {"glm-5": (64, 32), "deepseek-v3.2": (128, 64)}  # (heads, indexer heads) per rank at tp 1
# GLM-5 at tp 4: 16 heads a rank, where a latent row meets 30 FLOPs a byte and memory alone bounds the kernel
# (the indexer is not split across ranks); timed at bs 64, ctx 32k only
TP4 = {"glm-5 tp4": (16, 32)}
RANK, ROPE, DI, TOPK, PAGE = 512, 64, 128, 2048, 16
BATCHES, CONTEXTS = (1, 16, 64), (4096, 32768, 131072)
POOL_TOKENS = 64 * 131072
MAX_SETS = 64
TILES = ["hm-h64n32w8s2o1", "hm-h64n32w8s3o1", "hm-h64n16w8s3o1", "tm-h64n32w8s3o1", "hm-h32n32w8s2o1"]
COLS = ["model", "kernel", "cache", "bs", "ctx", "us", "bytes", "gbs", "pct_bw", "pct_mma"]


class Pool:
    """The latent cache and both index-cache forms over POOL_TOKENS tokens of random values."""

    def __init__(self) -> None:
        self.blocks = POOL_TOKENS // PAGE + 1  # block 0: the dummy block
        self.latent = torch.randn(self.blocks, PAGE, 1, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
        self.index_bf16 = torch.randn(self.blocks, PAGE, DI, device="cuda", dtype=torch.bfloat16)
        shape, dtype = index_cache_shape(self.blocks, PAGE, DI, fp8=True)
        self.index_fp8 = torch.empty(shape, dtype=dtype, device="cuda")
        flat = self.index_bf16.view(-1, DI)
        for s in range(0, flat.shape[0], 1 << 20):  # the FP8 form holds the same keys, quantized
            slots = torch.arange(s, min(s + (1 << 20), flat.shape[0]), device="cuda")
            dsa.write_index_cache(flat[slots], self.index_fp8, slots)

    def tables(self, seqs: int, ctx: int) -> torch.Tensor:
        per_seq = -(-ctx // PAGE)
        return (torch.randperm(self.blocks - 1, device="cuda")[: seqs * per_seq].int() + 1).view(seqs, per_seq)


def rotation(bs: int, ctx: int, bytes_per_call: float, l2_bytes: int) -> int:
    """Disjoint sets of sequences a graph cycles through: enough that their bytes are 4x L2, as the pool allows."""
    fits = max(1, POOL_TOKENS // (bs * ctx))
    return max(1, min(MAX_SETS, fits, math.ceil(4 * l2_bytes / bytes_per_call)))


def timed(fn_of_set, sets: int, nbytes: float) -> float:
    """Graph-replay ms of one call, cycling ``fn_of_set(i)`` over ``sets`` sets within the graph."""
    counter = [0]

    def call():
        fn_of_set(counter[0] % sets)
        counter[0] += 1

    calls = max(2, min(64, max(sets, int(4e8 // max(nbytes, 1)))))
    calls = -(-calls // sets) * sets
    return graph_time_ms(call, calls=calls)


def row(model, kernel, cache, bs, ctx, ms, nbytes, flops=0.0, **extra) -> dict:
    r = {"model": model, "kernel": kernel, "cache": cache, "bs": bs, "ctx": ctx, "ms": ms, "us": ms * 1e3,
         "bytes": nbytes, "flops": flops, **extra}  # fmt: skip
    print_table([r], COLS[:7])
    return r


def bench_point(pool: Pool, model: str, bs: int, ctx: int, l2: int, tiles: list[MLATile] | None = None) -> list[dict]:
    heads, hi = {**MODELS, **TP4}[model]
    out_rows = []
    qo_bytes = bs * heads * (RANK + ROPE + RANK) * 2
    sparse_bytes = bs * TOPK * (RANK + ROPE) * 2 + qo_bytes
    dense_bytes = bs * ctx * (RANK + ROPE) * 2 + qo_bytes
    sets = rotation(bs, ctx, min(sparse_bytes, bs * ctx * (DI + 4)), l2)  # enough for the smallest reader
    tables = pool.tables(sets * bs, ctx)
    views = [tables[s * bs : (s + 1) * bs] for s in range(sets)]
    q_lat = torch.randn(bs, heads, RANK, device="cuda", dtype=torch.bfloat16) * 0.1
    q_rope = torch.randn(bs, heads, ROPE, device="cuda", dtype=torch.bfloat16) * 0.1
    out = torch.empty_like(q_lat)
    row_seq = torch.arange(bs, dtype=torch.int32, device="cuda")
    row_pos = torch.full((bs,), ctx - 1, dtype=torch.int32, device="cuda")
    # a random 2048 of each row's positions: the indexer's selection is spread over the context likewise
    idx = [torch.rand(bs, ctx, device="cuda").topk(TOPK, dim=-1).indices.int() for _ in range(sets)]
    scale = (128 + ROPE) ** -0.5

    for tile in tiles or [None]:
        name = "sparse_mla" if tile is None else f"sparse_mla {tile.name}"
        try:
            ms = timed(lambda s, t=tile: dsa.sparse_mla(q_lat, q_rope, pool.latent, views[s], row_seq, idx[s], scale,
                                                         out=out, tile=t), sets, sparse_bytes)  # fmt: skip
        except Exception as e:  # a tile of the sweep that does not compile or fit this card
            if tile is None:
                raise
            print(f"{name} skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        out_rows.append(row(model, name, "bf16", bs, ctx, ms, sparse_bytes, 2 * bs * heads * TOPK * (2 * RANK + ROPE),
                            sets=sets))  # fmt: skip
    if tiles:
        return out_rows

    dense_sets = rotation(bs, ctx, dense_bytes, l2)
    seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(bs + 1, dtype=torch.int32, device="cuda")
    ms = timed(lambda s: mla_attention(q_lat, q_rope, pool.latent, views[s % sets], seq_lens, qsl, scale,
                                       max_query_len=1, out=out), min(dense_sets, sets), dense_bytes)  # fmt: skip
    out_rows.append(row(model, "dense_mla", "bf16", bs, ctx, ms, dense_bytes, 2 * bs * heads * ctx * (2 * RANK + ROPE),
                        sets=min(dense_sets, sets)))  # fmt: skip

    q = torch.randn(bs, hi, DI, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(bs, hi, device="cuda") * hi**-0.5 * DI**-0.5
    for form, cache, width in (("bf16", pool.index_bf16, DI * 2), ("fp8", pool.index_fp8, DI + 4)):
        key_bytes = bs * ctx * width + q.numel() * 2
        isets = sets
        scores = [torch.empty(bs, ctx, device="cuda") for _ in range(isets)]
        extra = {"sets": isets, "scores_bytes": bs * ctx * 4}
        ms = timed(lambda s, c=cache, sc=scores: dsa.indexer_scores(q, w, c, views[s], row_seq, row_pos, ctx, out=sc[s]),
                   isets, key_bytes)  # fmt: skip
        out_rows.append(row(model, "indexer_scores", form, bs, ctx, ms, key_bytes, **extra))
        ms = timed(lambda s, c=cache: dsa.indexer_topk(q, w, c, views[s], row_seq, row_pos, ctx, TOPK), isets,
                   key_bytes)  # fmt: skip
        method = choose_topk_method(bs, ctx, sm_count(q.device)) if dsa.TOPK_METHOD == "auto" else dsa.TOPK_METHOD
        out_rows.append(row(model, "indexer_topk", form, bs, ctx, ms, key_bytes, topk=method, **extra))
        if form == "fp8":
            continue  # top-k alone does not depend on the cache form
        topk_out = torch.empty(bs, TOPK, dtype=torch.int32, device="cuda")
        for name, fn in (
            ("topk_triton", lambda s, sc=scores, o=topk_out: topk_indices_triton(sc[s], row_pos, TOPK, out=o)),
            ("topk_torch_exact", lambda s, sc=scores: topk_indices_torch(sc[s], row_pos, TOPK)),
            ("topk_torch_plain", lambda s, sc=scores: torch.topk(sc[s], TOPK, dim=-1, sorted=False)),
        ):
            ms = timed(fn, isets, bs * ctx * 4)
            out_rows.append(row(model, name, "fp32 scores", bs, ctx, ms, bs * ctx * 4, sets=isets))
    return out_rows


def finish(rows: list[dict], bw, peak: float, card: str) -> None:
    for r in rows:  # a row that read faster than every probe raises the floor (work under 2x L2 is not counted)
        bw.observe(f"{r['model']} {r['kernel']} {r['cache']} bs={r['bs']} ctx={r['ctx']}", r["bytes"], r["ms"])
    for r in rows:
        r["card"] = card
        r["gbs"] = r["bytes"] / r["ms"] / 1e6
        r["pct_bw"] = r["gbs"] / bw.best_gbs
        r["read_gbs"] = bw.best_gbs
        r["tflops"] = r["flops"] / r["ms"] / 1e9 if r["flops"] else None
        r["pct_mma"] = r["tflops"] / peak if r["flops"] else None


def targets(rows: list[dict]) -> list[dict]:
    """The two targets at bs 64, ctx 32k, per model."""
    found = []
    for model in {r["model"]: None for r in rows}:
        pick = {r["kernel"]: r for r in rows if r["model"] == model and r["bs"] == 64 and r["ctx"] == 32768}
        if "sparse_mla" in pick and "dense_mla" in pick:
            sparse, dense = pick["sparse_mla"], pick["dense_mla"]
            found.append({"model": model, "sparse_pct_bw": sparse["pct_bw"], "sparse_pct_bw_target": 0.75,
                          "sparse_over_dense_speedup": dense["ms"] / sparse["ms"], "speedup_target": 3.0,
                          "sparse_pct_mma": sparse["pct_mma"]})  # fmt: skip
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bs 64 only, ctx 4k and 32k")
    parser.add_argument("--tiles", action="store_true", help="also the sparse kernel under a few tiles, bs 64 ctx 32k")
    args = parser.parse_args()
    card = torch.cuda.get_device_name(0)
    bw = measured_read_bw()
    peak = matmul_tflops()
    print(f"{card}: {bw.describe()}; bf16 matmul {peak:.0f} TFLOP/s")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    pool = Pool()
    batches, contexts = ((64,), (4096, 32768)) if args.quick else (BATCHES, CONTEXTS)
    rows: list[dict] = []
    tile_rows: list[dict] = []
    for model in MODELS:
        for ctx in contexts:
            for bs in batches:
                rows += bench_point(pool, model, bs, ctx, l2)
        if args.tiles:
            tile_rows += bench_point(pool, model, 64, 32768, l2, [MLATile.parse(t) for t in TILES])
        if model == "glm-5":
            rows += bench_point(pool, "glm-5 tp4", 64, 32768, l2)
        finish(rows + tile_rows, bw, peak, card)  # a partial file if a later model does not finish
        write_result("dsa_kernels", {"read_bandwidth": bw.summary(), "matmul_tflops": peak, "rows": rows,
                                     "tiles": tile_rows, "targets": targets(rows), "complete": False})  # fmt: skip
    bw.probe_again()
    finish(rows + tile_rows, bw, peak, card)
    print_table(rows + tile_rows, COLS)
    found = targets(rows)
    print_table(found, list(found[0]) if found else ["model"])
    write_result("dsa_kernels", {"read_bandwidth": bw.summary(), "matmul_tflops": peak, "rows": rows,
                                 "tiles": tile_rows, "targets": found, "complete": True})  # fmt: skip


if __name__ == "__main__":
    main()
