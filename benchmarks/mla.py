"""MLA attention kernels against the bytes of the latent cache they must read.

Decode: the absorbed attention kernel alone (kernels/mla_attention.py) at batch 1, 16, 64, 256 and
context 1024, 4096, 16384 with DeepSeek-V2-Lite's 16 heads (and V3's 128 at --v3-rows). Floor: the
latent cache rows in context (``batch x ctx x 576`` bf16) plus the queries and outputs, over the
best read bandwidth measured in the same run (benchmarks/roofline.py). Times come from CUDA-graph
replay, as decode runs in the engine.

Tiles: at batch 64, context 4096 the decode kernel is timed over a small grid of tile choices
(heads per program, context tokens per step, warps, stages); the best is reported beside the
default so the default can be moved to it.

Extend: one chunk on a cached prefix, the absorbed kernel against the expanded form (``kv_b_proj``
over the chunk and its prefix, then SDPA with 192-wide keys), to keep the choice made in
kernels/mla_attention.py measured.

Run: python3 -m benchmarks.mla [--quick]   (writes benchmarks/results/mla.json)
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from benchmarks.common import cuda_time_ms, print_table, write_result
from benchmarks.kernels import graph_time_ms
from benchmarks.roofline import measured_read_bw
from graphserve.kernels.mla_attention import DECODE_CONFIG, mla_attention

DT = torch.bfloat16
RANK, ROPE, NOPE, V, PAGE = 512, 64, 128, 128, 16
COLS = ["heads", "bs", "ctx", "config", "us", "floor_us", "ratio", "gbs"]


def setup(heads: int, batch: int, ctx: int, tokens: int | None = None):
    blocks = -(-ctx // PAGE)
    cache = torch.randn(batch * blocks + 1, PAGE, 1, RANK + ROPE, device="cuda", dtype=DT).mul_(0.5)
    tables = (torch.randperm(batch * blocks, device="cuda").int() + 1).view(batch, blocks)
    tokens = batch if tokens is None else tokens
    q_lat = torch.randn(tokens, heads, RANK, device="cuda", dtype=DT).mul_(0.1)
    q_rope = torch.randn(tokens, heads, ROPE, device="cuda", dtype=DT).mul_(0.1)
    return cache, tables, torch.full((batch,), ctx, dtype=torch.int32, device="cuda"), q_lat, q_rope


def decode_bytes(heads: int, batch: int, ctx: int) -> int:
    return 2 * (batch * ctx * (RANK + ROPE) + batch * heads * (RANK + ROPE) + batch * heads * RANK)


def bench_decode(bw, heads: int, batch: int, ctx: int, configs: list[dict | None] = (None,)) -> list[dict]:
    """One row per tile choice (None: the kernel's default), all on the same inputs."""
    cache, tables, lens, q_lat, q_rope = setup(heads, batch, ctx)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q_lat)
    nbytes = decode_bytes(heads, batch, ctx)
    rows = []
    for cfg in configs:
        try:
            ms = graph_time_ms(lambda c=cfg: mla_attention(q_lat, q_rope, cache, tables, lens, qsl, 0.1,
                                                           max_query_len=1, out=out, config=c))
        except Exception as e:  # out of shared memory or registers for this tile: not a candidate
            print(f"tile {_name(cfg)} skipped: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        bw.observe(f"mla decode h={heads} bs={batch} ctx={ctx} {_name(cfg)}", nbytes, ms)
        rows.append({"heads": heads, "bs": batch, "ctx": ctx, "config": _name(cfg), "ms": ms, "bytes": nbytes})
    return rows


def _name(cfg: dict | None) -> str:
    cfg = {**DECODE_CONFIG, **(cfg or {})}
    return f"h{cfg['BLOCK_H']}n{cfg['BLOCK_N']}w{cfg['num_warps']}s{cfg['num_stages']}"


def tile_grid(heads: int, quick: bool) -> list[dict]:
    if quick:
        grid = itertools.product([16, 32], [16, 32], [4, 8], [2])
    elif heads <= 16:
        grid = itertools.product([16, 32], [16, 32, 64], [4, 8], [1, 2])
    else:
        grid = itertools.product([16, 32, 64], [16, 32], [4, 8], [2])
    return [{"BLOCK_H": bh, "BLOCK_N": bn, "num_warps": w, "num_stages": st} for bh, bn, w, st in grid]


def expanded_extend(q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, w_kv_b: torch.Tensor, scale: float):
    """The alternative to the absorbed kernel: K/V for the whole context from kv_b_proj, then SDPA."""
    heads, ctx, qlen = w_kv_b.shape[0], latent.shape[0], q.shape[0]
    kv = torch.einsum("lr,hcr->hlc", latent, w_kv_b)
    k = torch.cat((kv[..., :NOPE], k_rope[None].expand(heads, -1, -1)), dim=-1)
    mask = torch.arange(ctx, device="cuda")[None, :] <= torch.arange(ctx - qlen, ctx, device="cuda")[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], kv[None, ..., NOPE:], attn_mask=mask,
                                          scale=scale)


def bench_extend(heads: int, chunk: int, prefix: int) -> dict:
    ctx = prefix + chunk
    cache, tables, lens, q_lat, q_rope = setup(heads, 1, ctx, tokens=chunk)
    qsl = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    absorbed = cuda_time_ms(lambda: mla_attention(q_lat, q_rope, cache, tables, lens, qsl, 0.1,
                                                  max_query_len=chunk), warmup=3, iters=10)
    w_kv_b = torch.randn(heads, NOPE + V, RANK, device="cuda", dtype=DT).mul_(0.02)
    w_uk = w_kv_b[:, :NOPE]
    q = torch.randn(chunk, heads, NOPE + ROPE, device="cuda", dtype=DT)

    def absorbed_full():  # with the absorption and un-absorption matmuls the expanded form does not need
        ql = torch.bmm(q[..., :NOPE].transpose(0, 1), w_uk)
        o = mla_attention(ql.transpose(0, 1), q[..., NOPE:], cache, tables, lens, qsl, 0.1, max_query_len=chunk)
        return torch.bmm(o.transpose(0, 1), w_kv_b[:, NOPE:].transpose(1, 2))

    rows = cache[tables[0].long()].flatten(0, 2)[:ctx]

    def expanded():
        return expanded_extend(q, rows[:, :RANK], rows[:, RANK:], w_kv_b, 0.1)

    return {"heads": heads, "chunk": chunk, "prefix": prefix, "absorbed_kernel_ms": absorbed,
            "absorbed_ms": cuda_time_ms(absorbed_full, warmup=3, iters=10),
            "expanded_ms": cuda_time_ms(expanded, warmup=3, iters=10)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer shapes and tiles (well under a minute)")
    p.add_argument("--bs", nargs="+", type=int, default=[1, 16, 64, 256])
    p.add_argument("--ctx", nargs="+", type=int, default=[1024, 4096, 16384])
    args = p.parse_args()
    if args.quick:
        args.bs, args.ctx = [1, 64, 256], [1024, 4096]
    bw = measured_read_bw()
    print(bw.describe())
    rows = [r for bs in args.bs for ctx in args.ctx for r in bench_decode(bw, 16, bs, ctx)]
    rows += [r for bs in (1, 64) for r in bench_decode(bw, 128, bs, 4096)]  # V3's heads: 8 head blocks
    tiles = bench_decode(bw, 16, 64, 4096, tile_grid(16, args.quick))
    if not args.quick:
        tiles += bench_decode(bw, 128, 64, 4096, tile_grid(128, False))
    for r in rows + tiles:  # every row against the best rate of the whole run
        r.update(bw.ratios(r["ms"], r["bytes"]))
        r.update(us=r["ms"] * 1e3, floor_us=r["floor_ms"] * 1e3, gbs=r["bytes"] / r["ms"] / 1e6)
    extend = [bench_extend(16, chunk, 4096) for chunk in (64, 512, 2048)] + [bench_extend(128, 512, 4096)]
    print_table(rows, COLS)
    print("\ndecode tiles at bs 64, ctx 4096:")
    print_table(sorted(tiles, key=lambda r: r["ms"])[:12], COLS)
    print("\nextend (one chunk on a 4096-token prefix):")
    print_table(extend, ["heads", "chunk", "prefix", "absorbed_kernel_ms", "absorbed_ms", "expanded_ms"])
    write_result("mla", {"read_bandwidth": bw.summary(), "default_decode_config": DECODE_CONFIG, "decode": rows,
                         "decode_tiles": tiles, "extend": extend})


if __name__ == "__main__":
    main()
