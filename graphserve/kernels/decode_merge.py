"""Merging split-KV decode partials: each split's (log-sum-exp, normalised accumulator) -> the output.

Two forms of one computation. ``merge_partials`` runs inside kernels/decode_attention.py's split
kernel, in the program that finishes last, for the query heads of its kv head; ``_decode_merge_kernel``
is the separate launch (one program per sequence and query head) it replaced, kept so the two can
be timed against each other (benchmarks.launches). The weights are ``exp2(lse - max lse)``; an empty
split has lse -inf and weight 0, and a row whose splits are all empty (a padding row) comes out 0.
A sliding window or attention sinks change nothing here: the split kernel cuts its splits from the window's first
key, and folds each head's sink into split 0's sum, whose log-sum-exp then carries it into these weights.

``store_heads`` writes the heads' output rows, for the split kernel's direct store and its merge alike:
in the output dtype, or as fp8 with one scale per head (``QUANT``), the form an FP8 o_proj reads when
its input is quantized per 128-column group and a head is one group. The rows are first rounded to
the dtype the unquantized store would write, so the fp8 values and scales are those that
kernels/fp8_quant.per_token_group_quant would make from that store, bit for bit.

``emit_heads`` adds the row form (``QUANT_ROW``): one scale per sequence over all its heads, the input an FP8
o_proj reads per token (one dot chain over K, kernels/fp8_gemv.py's X_TOKEN). A row's heads come from one program a
kv head, so each stores its heads rounded to the output dtype into a scratch row, counts itself done on the
sequence's counter, and the last quantizes the whole row from L2 (a few KB) and resets the counter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphserve.kernels.fp8_quant import quantize_rows, quantized, scale_of
from graphserve.kernels.pdl import pdl_enter

# fp32 partials one in-kernel merge step holds ([heads of a kv head, splits, head_dim]): 128 per
# thread at 4 warps, so a bs-1 merge of up to 16 splits x 8 heads x 128 (a 1k-2k context, see
# min_split_len in kernels/decode_attention.py) is one L2 round trip. The split kernel then takes
# 168 registers on sm_90 and no spills (benchmarks.kernel_ptxas; 128 at 8192 elements)
MERGE_TILE_ELEMS = 16384


@triton.jit
def _merge_chunk(
    mo_base, ml_base, heads, h_mask, offs_d, d_mask, s0, num_splits, m, total, acc,
    stride_mo_h, stride_mo_s, stride_ml_h, CHUNK_S: tl.constexpr,
):  # fmt: skip
    """Folds splits [s0, s0 + CHUNK_S) into the running (max, weight sum, weighted sum) of every head.

    The chunk's log-sum-exps and partials are loaded together (one L2 round trip per chunk) and the
    running sums rescaled to the new maximum, as online softmax does along the context."""
    offs_s = s0 + tl.arange(0, CHUNK_S)
    hs_mask = h_mask[:, None] & (offs_s < num_splits)[None, :]
    # .cg: from L2, where the other programs' stores are, never from a stale L1 line
    lse = tl.load(ml_base + heads[:, None] * stride_ml_h + offs_s[None, :], mask=hs_mask, other=float("-inf"),
                  cache_modifier=".cg")  # fmt: skip
    o = tl.load(
        mo_base + heads[:, None, None] * stride_mo_h + offs_s[None, :, None] * stride_mo_s + offs_d[None, None, :],
        mask=hs_mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg",
    )
    m_new = tl.maximum(m, tl.max(lse, 1))
    # every split so far empty (a padding row): keep the reference at 0 so no -inf - -inf appears
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_ref)  # 0 while nothing was merged (m -inf)
    w = tl.exp2(lse - m_ref[:, None])  # [heads, chunk]; an empty split's -inf gives 0
    return m_new, total * alpha + tl.sum(w, 1), acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)


@triton.jit
def store_heads(
    o_base, s_base, heads, h_mask, offs_d, d_mask, o, stride_oh, stride_sh,
    QUANT: tl.constexpr, ROUND: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr,
):  # fmt: skip
    """Store fp32 rows ``o`` [heads, BLOCK_D] at ``o_base + head * stride_oh``: in ``o_base``'s dtype, or with
    ``QUANT`` rounded to ``ROUND`` (the unquantized output's dtype) and quantized, one scale per head at
    ``s_base + head * stride_sh`` (kernels/fp8_quant.quantize_rows)."""
    mask = h_mask[:, None] & d_mask[None, :]
    ptrs = o_base + heads[:, None] * stride_oh + offs_d[None, :]
    if QUANT:
        rounded = tl.where(mask, o.to(ROUND).to(tl.float32), 0.0)
        q, scale = quantize_rows(rounded, o_base.dtype.element_ty, FP8_MAX_C, MIN_SCALE_C)
        tl.store(ptrs, q, mask=mask)
        tl.store(s_base + heads * stride_sh, scale, mask=h_mask)
    else:
        tl.store(ptrs, o.to(o_base.dtype.element_ty), mask=mask)


@triton.jit
def emit_heads(
    o_base, s_base, row_base, row_counter, parts, heads, h_mask, offs_d, d_mask, o, stride_oh, stride_sh,
    QUANT: tl.constexpr, QUANT_ROW: tl.constexpr, ROUND: tl.constexpr, ROW: tl.constexpr, ROW_CHUNK: tl.constexpr,
    FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr,
):  # fmt: skip
    """``store_heads``, or with ``QUANT_ROW`` the heads into the sequence's scratch row (``row_base``, ``ROUND``
    dtype, heads of ``stride_oh`` elements side by side) and, in the last of the row's ``parts`` programs to
    arrive on ``row_counter``, the whole row (``ROW`` elements) quantized with one scale: fp8 at ``o_base``
    (contiguous across heads), the scale at ``s_base``."""
    if QUANT_ROW:
        store_heads(row_base, s_base, heads, h_mask, offs_d, d_mask, o, stride_oh, 0, False, ROUND, FP8_MAX_C,
                    MIN_SCALE_C)  # fmt: skip
        tl.debug_barrier()  # every thread's heads are in the row before the block counts itself done
        done = tl.atomic_add(row_counter, 1, sem="acq_rel", scope="gpu")
        if done == parts - 1:
            # two passes over the row from L2 (.cg: where the other programs' stores are, never a stale L1 line),
            # ROW_CHUNK values a step, so the tail holds no whole row in registers beside the kernel's own state
            cols = tl.arange(0, ROW_CHUNK)
            amax = tl.zeros((ROW_CHUNK,), dtype=tl.float32)
            for c0 in tl.static_range(0, ROW, ROW_CHUNK):
                x = tl.load(row_base + c0 + cols, mask=c0 + cols < ROW, other=0.0, cache_modifier=".cg")
                amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
            scale = scale_of(tl.max(amax, axis=0), FP8_MAX_C, MIN_SCALE_C)
            for c0 in tl.static_range(0, ROW, ROW_CHUNK):
                in_row = c0 + cols < ROW
                x = tl.load(row_base + c0 + cols, mask=in_row, other=0.0, cache_modifier=".cg")
                tl.store(o_base + c0 + cols, quantized(x.to(tl.float32), scale, o_base.dtype.element_ty, FP8_MAX_C),
                         mask=in_row)  # fmt: skip
            tl.store(s_base, scale)
            tl.atomic_xchg(row_counter, 0, sem="relaxed", scope="gpu")
    else:
        store_heads(o_base, s_base, heads, h_mask, offs_d, d_mask, o, stride_oh, stride_sh, QUANT, ROUND, FP8_MAX_C,
                    MIN_SCALE_C)  # fmt: skip


@triton.jit
def merge_partials(
    mo_base, ml_base, heads, h_mask, offs_d, d_mask, num_splits, stride_mo_h, stride_mo_s, stride_ml_h,
    BLOCK_HM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_S: tl.constexpr,
):  # fmt: skip
    """The log-sum-exp weighted mean of one sequence's first ``num_splits`` split partials, for the given heads
    (fp32 [BLOCK_HM, BLOCK_D]; the caller stores it with ``store_heads``).

    One pass: a merge of at most CHUNK_S splits (a short context at batch 1) is a single L2 round
    trip after the counter, where first reading every log-sum-exp for the maximum made it two."""
    m = tl.full([BLOCK_HM], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_HM], dtype=tl.float32)
    acc = tl.zeros([BLOCK_HM, BLOCK_D], dtype=tl.float32)
    # a while loop, compiled too: a for loop would be software-pipelined with NUM_STAGES shared-memory
    # buffers of a whole chunk each, on top of the main loop's K/V stages, for two or three steps
    s0 = 0
    while s0 < num_splits:
        m, total, acc = _merge_chunk(mo_base, ml_base, heads, h_mask, offs_d, d_mask, s0, num_splits, m, total, acc,
                                     stride_mo_h, stride_mo_s, stride_ml_h, CHUNK_S)  # fmt: skip
        s0 += CHUNK_S
    return acc / tl.maximum(total, 1e-30)[:, None]


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,
    num_splits,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
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
    # an empty split (lse -inf, weight 0) is not read: a split kernel may leave its partial unwritten
    o = tl.load(
        mid_o_ptr + seq * stride_mo_b + head * stride_mo_h + offs_s[:, None] * stride_mo_s + offs_d[None, :],
        mask=(s_mask & (lse > float("-inf")))[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    merged = tl.sum(w[:, None] * o, 0) / tl.maximum(total, 1e-30)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d, merged.to(out_ptr.dtype.element_ty), mask=d_mask)
