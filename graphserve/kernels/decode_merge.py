"""Merging split-KV decode partials: each split's (log-sum-exp, normalised accumulator) -> the output.

Two forms of one computation. ``merge_partials`` runs inside kernels/decode_attention.py's split
kernel, in the program that finishes last, for the query heads of its kv head; ``_decode_merge_kernel``
is the separate launch (one program per sequence and query head) it replaced, kept so the two can
be timed against each other (benchmarks.launches). The weights are ``exp2(lse - max lse)``; an empty
split has lse -inf and weight 0, and a row whose splits are all empty (a padding row) comes out 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

# fp32 partials one in-kernel merge step holds ([heads of a kv head, splits, head_dim]): 64 per thread
# at 4 warps, so a bs-1 merge of 18 splits x 8 heads x 128 takes 3 dependent L2 round trips
MERGE_TILE_ELEMS = 8192


@triton.jit
def _merge_chunk(
    mo_base, ml_base, heads, h_mask, offs_d, d_mask, s0, num_splits, m, acc,
    stride_mo_h, stride_mo_s, stride_ml_h, CHUNK_S: tl.constexpr,
):  # fmt: skip
    """acc += sum over splits [s0, s0 + CHUNK_S) of exp2(lse - m) * partial, for every head of a kv head."""
    offs_s = s0 + tl.arange(0, CHUNK_S)
    hs_mask = h_mask[:, None] & (offs_s < num_splits)[None, :]
    # .cg: from L2, where the other programs' stores are, never from a stale L1 line
    lse = tl.load(ml_base + heads[:, None] * stride_ml_h + offs_s[None, :], mask=hs_mask, other=float("-inf"),
                  cache_modifier=".cg")  # fmt: skip
    w = tl.exp2(lse - m[:, None])  # [heads, chunk]; an empty split's -inf gives 0
    o = tl.load(
        mo_base + heads[:, None, None] * stride_mo_h + offs_s[None, :, None] * stride_mo_s + offs_d[None, None, :],
        mask=hs_mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg",
    )
    return acc + tl.sum(w[:, :, None] * o, 1)


@triton.jit
def merge_partials(
    mo_base, ml_base, o_base, heads, h_mask, offs_d, d_mask, num_splits,
    stride_mo_h, stride_mo_s, stride_ml_h, stride_oh,
    BLOCK_HM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr,
):  # fmt: skip
    """The log-sum-exp weighted mean of one sequence's first ``num_splits`` split partials, for the given heads."""
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(ml_base + heads[:, None] * stride_ml_h + offs_s[None, :],
                  mask=h_mask[:, None] & (offs_s < num_splits)[None, :], other=float("-inf"),
                  cache_modifier=".cg")  # fmt: skip
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (a padding row): weights 0, output 0
    total = tl.sum(tl.exp2(lse - m[:, None]), 1)
    acc = tl.zeros([BLOCK_HM, BLOCK_D], dtype=tl.float32)
    # a while loop, compiled too: a for loop would be software-pipelined with NUM_STAGES shared-memory
    # buffers of a whole chunk each, on top of the main loop's K/V stages, for two or three steps
    s0 = 0
    while s0 < num_splits:
        acc = _merge_chunk(mo_base, ml_base, heads, h_mask, offs_d, d_mask, s0, num_splits, m, acc,
                           stride_mo_h, stride_mo_s, stride_ml_h, CHUNK_S)  # fmt: skip
        s0 += CHUNK_S
    merged = acc / tl.maximum(total, 1e-30)[:, None]
    tl.store(o_base + heads[:, None] * stride_oh + offs_d[None, :], merged.to(o_base.dtype.element_ty),
             mask=h_mask[:, None] & d_mask[None, :])  # fmt: skip


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,
    num_splits,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + seq * stride_ml_b + head * stride_ml_h + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights all 0, output 0
    w = tl.exp2(lse - m)
    o = tl.load(
        mid_o_ptr + seq * stride_mo_b + head * stride_mo_h + offs_s[:, None] * stride_mo_s + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    merged = tl.sum(w[:, None] * o, 0) / tl.maximum(total, 1e-30)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d, merged.to(out_ptr.dtype.element_ty), mask=d_mask)
