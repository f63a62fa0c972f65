"""Paged decode attention (one new query token per sequence), split-KV ("flash-decoding").

Grid of the main kernel: (sequence, kv head, split). One program handles every query head of its
kv head (GQA), so each K/V block is read from HBM once per kv head, not once per query head. The
context of a sequence is cut into ``num_splits`` equal pieces; each program writes a partial
(log-sum-exp, normalised accumulator) to scratch. When there is only one split the main kernel
writes the output directly.

With several splits the pieces are merged inside the same launch: each program counts itself done
on a per-(sequence, kv head) counter, and the one that finds it is the last reads every partial of
its kv head back from L2 and writes the output (kernels/decode_merge.py). At batch 1 the separate
merge kernel (still there, ``fused_merge=False``, for comparison) cost 2.3 us plus a ~0.8 us gap
per layer on an H200 for a merge that reads a few tens of KB. The counter's atomic is acq_rel at GPU scope after a barrier
that orders the block's stores; the last program resets it, so it is zero for the next layer and
the next graph replay.

The output can come out quantized (``out_scale``), which saves the FP8 o_proj's quantization launch
(layers/quant/fp8.py): fp8 with one scale per sequence and head, the input a block-scaled o_proj reads in
128-column groups (kernels/decode_merge.store_heads), or with one scale per sequence, the input a per-channel o_proj
reads per token: the last of a sequence's kv-head programs quantizes its row (kernels/decode_merge.emit_heads).

The kernel can also take the step's token as the qkv projection leaves it (``decode_attention_qkv``, a
``NewToken``): each program norms (per-head q/k RMSNorm, where the model has it) and rotates its q heads inside
its steps, after each K load; the program whose split holds the new position rotates the new K, writes K and V
to the cache and takes them into its softmax from registers after its loop. That is kernels/qk_rope_kv.py's
launch folded in, with its roundings (layers/attention_triton.py says where the engine uses it).

An fp8 (e4m3) cache is widened in registers to fp16, with q and the probabilities in fp16 too: the
e4m3 -> fp16 conversion is one instruction per two elements and exact, where the chain to bf16 takes
several per element, and fp16 holds p more finely than bf16. The bf16 path is untouched.

Launch shape (``DecodeTile``: context tokens per inner step, warps, stages): one measured for a bf16 cache at
every batch, and for an fp8 cache its own in two bands of (sequence, kv head) pairs, with the split counts that
go with them (``choose_tile``, ``choose_num_splits``; benchmarks.decode_splits --tiles measures them).

CUDA-graph safety: no host syncs and no allocation that depends on data. The grid depends only on
static sizes (batch, kv heads and the split count, which comes from batch size, the block-table
width and the SM count), never on ``seq_lens`` values; the scratch space and the counters can be
preallocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphserve.kernels.common import interpreting, sm_count
from graphserve.kernels.decode_merge import MERGE_TILE_ELEMS, _decode_merge_kernel, emit_heads, merge_partials
from graphserve.kernels.fp8_quant import FP8_DTYPE, FP8_MAX, MIN_SCALE, fp16_saturated
from graphserve.kernels.kv_write import cache_value, check_cache
from graphserve.kernels.pdl import pdl_args, pdl_enter
from graphserve.kernels.qk_rope_kv import check_qkv_args

LOG2E = 1.4426950408889634
MAX_SPLITS = 32  # beyond this the merge costs more than the extra parallelism gains
BLOCK_N = 64  # context tokens per inner step
# The launch may cut a context into splits of one inner step (the grid comes from the block-table
# capacity, so a long context gets its parallelism), but on device a split never takes fewer than
# ``min_split_len`` tokens (by default one inner step of the launch shape): the splits past the context
# exit at once and the merge reads only the used ones. One inner step per split measured fastest at batch
# 1 on the H200 (benchmarks.decode_latency, results/decode_latency.json: a 1k context in 6.8-7.1 us at 64
# tokens per split against 8.1-8.6 us at 128 for the qwen3-30b-a3b and llama3-8b head shapes): more
# programs in flight beat a shorter merge.
PROGRAMS_PER_SM = 2  # enough resident programs per SM to hide HBM latency
# An fp8 cache's step widens K and V in registers before the tensor cores: more work between loads. From 256
# (sequence, kv head) pairs it runs the FP8_CACHE_TILE (2 warps, 2 stages: more programs resident an SM) at three
# splits: of 6 launch shapes x 8 split counts on an H200 (benchmarks/results/decode_tiles.json) the fastest or
# within 1% of it at every such batch of llama3-8b's heads (8 kv, context 2048: batch 64 87.8 us against 120.6 with
# the bf16 tile at 3 splits and 152.6 at one; batch 256 341.2 against 470.7 at the bf16 tile's one split) and of
# qwen3-30b-a3b's (4 kv, context 1024) at batch 128 and 256; at its batch 64, 29.8 us against 37.0, 3.3% behind
# 128-token steps at 2 splits. Past FP8_CACHE_PAIRS[1] pairs one split (the scratch for 3 splits grows with the
# batch: up to 4095 pairs it holds 3 splits of 1023 sequences at 4 kv heads, FP8_CACHE_MIN_KV_HEADS).
FP8_CACHE_SPLITS = 3
FP8_CACHE_PAIRS = (256, 4096)  # (sequence, kv head) pairs where an fp8 cache takes FP8_CACHE_SPLITS
FP8_CACHE_MIN_KV_HEADS = 4
NUM_WARPS, NUM_STAGES = 4, 3  # a bf16 cache: the best of BLOCK_N 16..128, 2..8 warps, 2..4 stages on H200


# One scale per sequence (``out_scale`` [B, 1]): the last kv head's program quantizes the row, ROW_CHUNK values a step
MAX_QUANT_ROW = 16384
ROW_CHUNK = 1024

MAX_TILE_BLOCK_N = 256  # K and V tiles of 256 tokens x 128 dims already fill a program's shared memory at 2 stages


@dataclass(frozen=True)
class DecodeTile:
    """The split kernel's launch shape: context tokens per inner step, warps, pipeline stages."""

    block_n: int = BLOCK_N
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES

    def label(self) -> str:
        """``64x4w3s``: tokens per step, warps, stages (the benchmarks' rows name a shape so)."""
        return f"{self.block_n}x{self.num_warps}w{self.num_stages}s"

    def validate(self) -> None:
        if not 16 <= self.block_n <= MAX_TILE_BLOCK_N or self.block_n & (self.block_n - 1):
            raise ValueError(f"decode tile block_n={self.block_n} must be a power of two in 16..{MAX_TILE_BLOCK_N}")
        if self.num_warps not in (1, 2, 4, 8) or self.num_stages < 1:
            raise ValueError(f"decode tile num_warps={self.num_warps} must be 1, 2, 4 or 8 and num_stages="
                             f"{self.num_stages} at least 1")


DEFAULT_TILE = DecodeTile()
FP8_CACHE_TILE = DecodeTile(64, 2, 2)
# Between FP8_SMALL_PAIRS and FP8_CACHE_PAIRS[0] (sequence, kv head) pairs an fp8 cache runs 128-token steps on 2
# warps, split so that pairs * splits is about FP8_SMALL_PROGRAMS: the fastest of the 6 launch shapes x 8 split
# counts timed, or within 8% of it, at those batches of both head shapes on an H200 (benchmarks/results/
# decode_tiles.json: llama3-8b's heads at batch 4, 32 pairs, 10.9 us at 16 splits against 13.6 at the bf16
# tile's 9; at batch 16, 29.7 against 35.3; qwen3-30b-a3b's at batch 32, 15.3 against 18.7). Below, where a
# batch of 1-4 sequences has few (sequence, kv head) pairs, the bf16 tile's one-step splits measured faster.
FP8_SMALL_TILE = DecodeTile(128, 2, 2)
FP8_SMALL_PAIRS = 32
FP8_SMALL_PROGRAMS = 512


def _fp8_band(batch_size: int, num_kv_heads: int, fp8_cache: bool) -> str | None:
    """Which of an fp8 cache's measured bands a call falls in: "small", "large" or None (the bf16 tile and rule)."""
    pairs = batch_size * num_kv_heads
    if not fp8_cache or num_kv_heads < FP8_CACHE_MIN_KV_HEADS or pairs < FP8_SMALL_PAIRS:
        return None
    return "small" if pairs < FP8_CACHE_PAIRS[0] else "large"


def choose_tile(batch_size: int, num_kv_heads: int, fp8_cache: bool = False) -> DecodeTile:
    """The launch shape decode_attention runs: for an fp8 cache with 4+ kv heads ``FP8_SMALL_TILE`` from
    ``FP8_SMALL_PAIRS`` (sequence, kv head) pairs and ``FP8_CACHE_TILE`` from ``FP8_CACHE_PAIRS[0]`` (the comments
    on them say why), else ``DEFAULT_TILE``."""
    band = _fp8_band(batch_size, num_kv_heads, fp8_cache)
    return {"small": FP8_SMALL_TILE, "large": FP8_CACHE_TILE}.get(band, DEFAULT_TILE)


@triton.jit
def _decode_step(
    q, m_i, l_i, acc, n0, end, bt_row, kv_base, scale_log2, stride_kv, stride_blk, stride_off,
    offs_d, d_mask, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE_DOT: tl.constexpr, PREFETCH_V: tl.constexpr,
    q_p, cos, sin, w, w_p, eps, ROTATE: tl.constexpr, HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr,
    Q_DTYPE: tl.constexpr, WIDEN_FP16: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over context tokens [n0, n0 + BLOCK_N) gathered through the block table.

    PREFETCH_V issues the V load with the K load instead of after the scores: one memory round trip
    less per step, for a V tile held in registers meanwhile. Small batches (split contexts, a few
    steps per program, where the step's latency is the kernel's time) take it.
    ROTATE: q comes as the projection wrote it (with its rotate-half partner ``q_p``) and is normed (``HAS_NORM``,
    weights ``w``, ``w_p``) and rotated here, after the K load is issued, so that its waits overlap the block
    table's and K's (a few hundred operations a step, while K is in flight)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < end
    block = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
    row = block * stride_blk + (offs_n % PAGE) * stride_off
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(kv_base + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if PREFETCH_V:
        v = tl.load(kv_base + stride_kv + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if ROTATE:
        q = _rotated(*_normed(q, q_p, w, w_p, eps, HAS_NORM, HEAD_DIM), cos, sin, Q_DTYPE, WIDEN_FP16)
    k = k.to(q.dtype)  # fp8 cache: widen
    if PREFETCH_V:
        v = v.to(q.dtype)
    if IEEE_DOT:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = tl.where(n_mask[None, :], qk * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if not PREFETCH_V:
        v = tl.load(kv_base + stride_kv + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    if IEEE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _normed(x, xp, w, wp, eps, HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Heads of the new token (``x`` [rows, D]) and their rotate-half partners in fp32, per-head RMSNorm'd with
    ``HAS_NORM`` (weights ``w`` and, in partner order, ``wp``: fp32 [1, D]): kernels/qk_rope_kv.py's numerics (the
    norm rounded to the input dtype, times the weight, rounded again)."""
    dtype = x.dtype
    x = x.to(tl.float32)
    xp = xp.to(tl.float32)
    if HAS_NORM:
        rstd = (1.0 / tl.sqrt(tl.sum(x * x, 1) / HEAD_DIM + eps))[:, None]
        x = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        xp = ((xp * rstd).to(dtype).to(tl.float32) * wp).to(dtype).to(tl.float32)
    return x, xp


@triton.jit
def _rotated(x, xp, cos, sin, DTYPE: tl.constexpr, WIDEN_FP16: tl.constexpr):
    """Rotary on fp32 rows (``sin`` signed per half: x1 cos - x2 sin | x2 cos + x1 sin) rounded to ``DTYPE``, then,
    for an fp8 cache's fp16 widening, clamped to fp16's range and rounded to fp16."""
    r = (x * cos + xp * sin).to(DTYPE)
    if WIDEN_FP16:
        r = fp16_saturated(r)
    return r


@triton.jit
def _decode_split_kernel(
    q_ptr, kv_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, out_scale_ptr, mid_o_ptr, mid_lse_ptr, counter_ptr,
    sinks_ptr, window,
    pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, slot_ptr, stride_cos, stride_sin, eps,
    scale_log2,
    num_splits, min_split_len,
    stride_qt, stride_qh,
    stride_kv, stride_blk, stride_off, stride_kvh,
    stride_bt,
    stride_ot, stride_oh, stride_st, stride_sh,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, IEEE_DOT: tl.constexpr, WHILE_LOOP: tl.constexpr, PREFETCH_V: tl.constexpr,
    FUSED_MERGE: tl.constexpr, BLOCK_HM: tl.constexpr, CHUNK_S: tl.constexpr,
    WIDEN_FP16: tl.constexpr, QUANT_OUT: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr,
    NEW_TOKEN: tl.constexpr, HAS_NORM: tl.constexpr, row_ptr, row_counter_ptr, QUANT_ROW: tl.constexpr,
    ROW: tl.constexpr, ROW_CHUNK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_h = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + offs_h
    h_mask = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    qh_mask = h_mask[:, None] & d_mask[None, :]
    if NEW_TOKEN:
        # q is the qkv projection's row; the program whose split holds the last position writes this step's K and
        # V to the cache and attends to them from registers. Every load that needs no length goes out with the
        # length's, and q is normed and rotated inside each step (_decode_step's ROTATE) after its K load, so the
        # block table's and K's waits are the first the program takes
        half: tl.constexpr = HEAD_DIM // 2
        first = offs_d < half
        partner = tl.where(first, offs_d + half, offs_d - half)  # rotate-half: d pairs with d +- D/2
        pos = tl.load(pos_ptr + seq).to(tl.int64)
        row = q_ptr + seq * stride_qt
        q_rows = row + head[:, None] * stride_qh
        q = tl.load(q_rows + offs_d[None, :], mask=qh_mask, other=0.0)
        q_p = tl.load(q_rows + partner[None, :], mask=qh_mask, other=0.0)
        k_row = row + (tl.num_programs(1) * GROUP + kv_head) * HEAD_DIM
        k_new = tl.load(k_row + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        k_p = tl.load(k_row + partner[None, :], mask=d_mask[None, :], other=0.0)
        v_new = tl.load(k_row + tl.num_programs(1) * HEAD_DIM + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        angle = tl.where(first, offs_d, offs_d - half)
        cos = tl.load(cos_ptr + pos * stride_cos + angle, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + pos * stride_sin + angle, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        sin = tl.where(first[None, :], -sin, sin)  # x1 cos - x2 sin | x2 cos + x1 sin
        qw, qw_p, kw, kw_p = cos, cos, cos, cos  # placeholders without norms
        if HAS_NORM:
            qw = tl.load(qw_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
            qw_p = tl.load(qw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :]
            kw = tl.load(kw_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
            kw_p = tl.load(kw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    else:
        q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=qh_mask, other=0.0)
        q_p, cos, sin, qw, qw_p = q, q, q, q, q  # placeholders: the steps do not rotate
        if WIDEN_FP16:  # fp8 cache: the step widens K and V to q's dtype, fp16 here (clamped: q is bf16's range)
            q = fp16_saturated(q)
    # splits are cut from the actual length (read on device), rounded to whole inner steps, no shorter
    # than min_split_len (a multiple of BLOCK_N): a short context leaves the last splits empty. With a window the
    # length is the window's: the splits start at its first key (lo), so no block wholly before it is read (a
    # sequence's blocks there may have gone back to the pool and point at the dummy block)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N, min_split_len)
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    loop_end = end
    if NEW_TOKEN:
        holds_new = (start <= seq_len - 1) & (seq_len - 1 < end)
        loop_end = end - holds_new.to(tl.int32)  # the new token comes from registers after the loop

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_base = kv_ptr + kv_head * stride_kvh
    q_dtype: tl.constexpr = q_ptr.dtype.element_ty
    if WHILE_LOOP:
        n0 = start
        while n0 < loop_end:
            m_i, l_i, acc = _decode_step(
                q, m_i, l_i, acc, n0, loop_end, bt_row, kv_base, scale_log2, stride_kv, stride_blk, stride_off,
                offs_d, d_mask, PAGE, BLOCK_N, IEEE_DOT, PREFETCH_V, q_p, cos, sin, qw, qw_p, eps, NEW_TOKEN, HAS_NORM,
                HEAD_DIM, q_dtype, WIDEN_FP16,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(start, loop_end, BLOCK_N):
            m_i, l_i, acc = _decode_step(
                q, m_i, l_i, acc, n0, loop_end, bt_row, kv_base, scale_log2, stride_kv, stride_blk, stride_off,
                offs_d, d_mask, PAGE, BLOCK_N, IEEE_DOT, PREFETCH_V, q_p, cos, sin, qw, qw_p, eps, NEW_TOKEN, HAS_NORM,
                HEAD_DIM, q_dtype, WIDEN_FP16,
            )  # fmt: skip
    if NEW_TOKEN:
        # the new K rotated and rounded to the projection's dtype (what the separate prologue stores), then to the
        # cache's; K and V stored by the program that holds the position; its score and V taken in one more
        # online-softmax step in fp32 (-inf in every other program)
        k_x, k_p = _normed(k_new, k_p, kw, kw_p, eps, HAS_NORM, HEAD_DIM)
        k_new = cache_value(_rotated(k_x, k_p, cos, sin, q_dtype, False), kv_ptr)
        v_new = cache_value(v_new, kv_ptr)
        dst = kv_ptr + kv_head * stride_kvh + (slot // PAGE) * stride_blk + (slot % PAGE) * stride_off + offs_d[None, :]
        tl.store(dst, k_new, mask=d_mask[None, :] & holds_new)
        tl.store(dst + stride_kv, v_new, mask=d_mask[None, :] & holds_new)
        q_rot = _rotated(*_normed(q, q_p, qw, qw_p, eps, HAS_NORM, HEAD_DIM), cos, sin, q_dtype, WIDEN_FP16)
        s_new = tl.sum(q_rot.to(tl.float32) * k_new.to(tl.float32), 1) * scale_log2
        s_new = tl.where(holds_new, s_new, float("-inf"))
        m_new = tl.maximum(m_i, s_new)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # an empty split stays empty, never -inf - -inf
        alpha = tl.exp2(m_i - m_ref)
        p_new = tl.exp2(s_new - m_ref)
        l_i = l_i * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)
        m_i = m_new
    if HAS_SINKS:
        # the sink joins the denominator once: split 0's (never empty for a real row), whose lse then carries it
        # into the merge, which needs nothing more
        sink = tl.load(sinks_ptr + head, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        sink = tl.where(split == 0, sink, float("-inf"))
        m_new = tl.maximum(m_i, sink)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.exp2(sink - m_ref)
        acc = acc * alpha[:, None]
        m_i = m_new

    # an empty split (short sequence, or a padding row with seq_len 0) leaves l_i == 0
    o = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    # QUANT_ROW: one scale per sequence, so a row's kv heads meet in its scratch row and the last quantizes it
    row_base = row_ptr + seq * ROW
    row_counter = row_counter_ptr + seq
    if DIRECT:
        emit_heads(out_ptr + seq * stride_ot, out_scale_ptr + seq * stride_st, row_base, row_counter,
                   tl.num_programs(1), head, h_mask, offs_d, d_mask, o, stride_oh, stride_sh, QUANT_OUT, QUANT_ROW,
                   q_ptr.dtype.element_ty, ROW, ROW_CHUNK, FP8_MAX_C, MIN_SCALE_C)  # fmt: skip
    else:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        base_o = mid_o_ptr + seq * stride_mo_b + split * stride_mo_s
        tl.store(base_o + head[:, None] * stride_mo_h + offs_d[None, :], o, mask=h_mask[:, None] & d_mask[None, :])
        tl.store(mid_lse_ptr + seq * stride_ml_b + head * stride_ml_h + split, lse, mask=h_mask)
        if FUSED_MERGE:
            tl.debug_barrier()  # every thread's partials are written before the block counts itself done
            counter = counter_ptr + seq * tl.num_programs(1) + kv_head
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == num_splits - 1:
                heads = kv_head * GROUP + tl.arange(0, BLOCK_HM)
                # only the splits the context reaches hold a partial: a short context (min_split_len,
                # or a bs-1 graph captured for a long max context) uses fewer pieces than it launches
                used = tl.minimum(num_splits, tl.cdiv(seq_len - lo, split_len))
                hm_mask = tl.arange(0, BLOCK_HM) < GROUP
                merged = merge_partials(
                    mid_o_ptr + seq * stride_mo_b, mid_lse_ptr + seq * stride_ml_b, heads, hm_mask, offs_d, d_mask,
                    used, stride_mo_h, stride_mo_s, stride_ml_h, BLOCK_HM, BLOCK_D, CHUNK_S,
                )  # fmt: skip
                emit_heads(out_ptr + seq * stride_ot, out_scale_ptr + seq * stride_st, row_base, row_counter,
                           tl.num_programs(1), heads, hm_mask, offs_d, d_mask, merged, stride_oh, stride_sh, QUANT_OUT,
                           QUANT_ROW, q_ptr.dtype.element_ty, ROW, ROW_CHUNK, FP8_MAX_C, MIN_SCALE_C)  # fmt: skip
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def check_window_sinks(window: int | None, sinks: torch.Tensor | None, num_heads: int, device: torch.device) -> None:
    """Refuse a window or sinks the attention kernels cannot take, naming the value and the limit."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or not 1 <= window < 2**31):
        raise ValueError(f"window={window!r} must be an integer in 1 .. 2**31 - 1 (or None)")
    if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (num_heads,)
                              or sinks.stride(0) != 1 or sinks.device != torch.device(device)):  # fmt: skip
        raise ValueError(f"sinks must be contiguous float32 [{num_heads}] on {device} (one per query head), got "
                         f"{sinks.dtype} {tuple(sinks.shape)} stride {sinks.stride()} on {sinks.device}")


def decode_plan(batch_size: int, num_kv_heads: int, max_context: int, num_sms: int,
                fp8_cache: bool = False) -> tuple[DecodeTile, int]:
    """(launch shape, splits) that ``decode_attention`` runs by default: ``choose_tile`` and ``choose_num_splits`` at
    that tile's step. Benchmarks that label their rows with the engine's choice call this too."""
    tile = choose_tile(batch_size, num_kv_heads, fp8_cache)
    return tile, choose_num_splits(batch_size, num_kv_heads, max_context, num_sms, fp8_cache, tile.block_n)


def choose_num_splits(batch_size: int, num_kv_heads: int, max_context: int, num_sms: int,
                      fp8_cache: bool = False, step: int | None = None) -> int:
    """Splits per sequence so that batch * kv_heads * splits programs fill the GPU; never more than the context
    has inner steps of ``step`` tokens (the launch shape's; None: the one ``choose_tile`` picks). An fp8 cache:
    ``FP8_SMALL_PROGRAMS`` programs in its small band, at least ``FP8_CACHE_SPLITS`` in its large one (the
    comments on them say why).

    Uses static sizes only (``max_context`` is the block-table capacity, not a seq_lens value), so
    a captured CUDA graph keeps a fixed grid whatever lengths are replayed through it.
    """
    pairs = max(1, batch_size * num_kv_heads)
    band = _fp8_band(batch_size, num_kv_heads, fp8_cache)
    useful = math.ceil(max_context / (step or choose_tile(batch_size, num_kv_heads, fp8_cache).block_n))
    if band == "small":
        return max(1, min(math.ceil(FP8_SMALL_PROGRAMS / pairs), useful, MAX_SPLITS))
    want = math.ceil(PROGRAMS_PER_SM * num_sms / pairs)
    splits = max(1, min(want, useful, MAX_SPLITS))
    if band == "large" and pairs < FP8_CACHE_PAIRS[1]:
        splits = max(splits, min(FP8_CACHE_SPLITS, useful))
    return splits


def _split_batches(num_kv_heads: int, num_sms: int, fp8_cache: bool):
    """(batch, splits) for every batch size that splits its contexts (at any context length)."""
    last = max(PROGRAMS_PER_SM * num_sms, FP8_CACHE_PAIRS[1] // max(1, num_kv_heads) if fp8_cache else 0)
    for batch in range(1, last + 1):
        splits = choose_num_splits(batch, num_kv_heads, 1 << 30, num_sms, fp8_cache)
        if splits > 1:
            yield batch, splits


def workspace_numel(num_heads: int, num_kv_heads: int, head_dim: int, num_sms: int,
                    kv_dtype: torch.dtype | None = None) -> int:
    """fp32 scratch elements that cover every batch size at any context length, for a cache of ``kv_dtype``
    (the model dtype when None; an fp8 cache may split more, ``choose_num_splits``).

    Only batches with more than one split use scratch, and those are small: splits shrink as the
    batch grows, so batch * splits stays near ``PROGRAMS_PER_SM * num_sms / num_kv_heads`` (an fp8 cache: up to
    ``FP8_CACHE_SPLITS * FP8_CACHE_PAIRS[1] / num_kv_heads``).
    """
    batches = _split_batches(num_kv_heads, num_sms, kv_dtype == FP8_DTYPE)
    rows = max((batch * splits for batch, splits in batches), default=0)
    return rows * num_heads * (head_dim + 1)


def counters_numel(num_kv_heads: int, num_sms: int, kv_dtype: torch.dtype | None = None) -> int:
    """int32 merge counters (one per sequence and kv head) that cover every batch size that splits."""
    batches = _split_batches(num_kv_heads, num_sms, kv_dtype == FP8_DTYPE)
    return max((batch * num_kv_heads for batch, _ in batches), default=0)


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    workspace: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    fused_merge: bool = True,
    fp8_widen: torch.dtype = torch.float16,
    min_split_len: int | None = None,
    out_scale: torch.Tensor | None = None,
    tile: DecodeTile | None = None,
    new_token: NewToken | None = None,
    row_workspace: torch.Tensor | None = None,
    row_counters: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ([B, Hq, D], one token per sequence) over each sequence's paged context.

    ``kv_cache`` is ``[2, num_blocks, block_size, Hkv, D]``; ``block_tables`` ``[B, max_blocks]``
    int32; ``seq_lens`` ``[B]`` int32 context lengths including the token just written.
    ``workspace``: optional flat fp32 scratch (see ``workspace_numel``) so nothing is allocated.
    ``counters``: optional int32 merge counters (see ``counters_numel``), zero before the call and left
    zero by it; without them a zeroed buffer is allocated per call. ``fused_merge=False`` merges the
    splits in a second launch instead (the layout the in-kernel merge is measured against).
    ``fp8_widen``: what an fp8 cache's K and V become for the tensor cores. float16 (default): one
    e4m3x2 -> f16x2 conversion per two elements, exact, with q and the probabilities in fp16 too
    (for 16-bit q; fp32 q keeps fp32); bfloat16: q's dtype, a longer conversion chain per element
    (kept for comparison).
    ``min_split_len``: the fewest context tokens a split takes on device, a positive multiple of the tile's
    block_n (benchmarks.launches sweeps it; None: one inner step).
    ``tile``: the launch shape (``DecodeTile``; None: ``choose_tile``'s; benchmarks.decode_splits --tiles sweeps it).
    ``out_scale``: write the output quantized for an FP8 projection that reads it in 128-column (here:
    one head) groups: ``out`` is then fp8 ``[>= B, Hq, D]`` and ``out_scale`` fp32 ``[>= B, Hq]`` (any strides),
    one scale per sequence and head, the values per_token_group_quant would make from the unquantized
    output (``store_heads`` in kernels/decode_merge.py). Rows past B are left as they are. ``out_scale``
    ``[>= B, 1]`` asks for one scale per sequence (per_token_group_quant's group the whole row, for an o_proj that
    reads its input per token; ``out``'s heads then contiguous in a row): the kv heads' programs meet in
    ``row_workspace`` (q's dtype, >= B * Hq * D elements; allocated when None) and on ``row_counters`` (int32 [>= B],
    zero before the call and left zero; a zeroed buffer is allocated when None), and the last quantizes the row
    (``emit_heads``).
    ``new_token``: ``decode_attention_qkv``'s (q is then the q columns of its qkv rows, not yet normed or rotated).
    ``window``: the token at position p = seq_len - 1 attends keys p - window < j <= p only; the programs' splits
    cover those keys alone and no earlier block is read (layers/attention_backend.py states the contract).
    ``sinks``: float32 [Hq], a logit per query head that joins its softmax denominator only (gpt-oss).
    """
    batch, num_heads, head_dim = q.shape
    _, _, page, num_kv_heads, _ = kv_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if q.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError(f"decode_attention needs head_dim contiguous (stride 1) in q and kv_cache, got strides "
                         f"q {q.stride()}, kv_cache {kv_cache.stride()}")
    fp8_cache = kv_cache.dtype == FP8_DTYPE
    check_window_sinks(window, sinks, num_heads, q.device)
    if tile is None:
        tile = choose_tile(batch, num_kv_heads, fp8_cache)
    else:
        tile.validate()
    min_split_len = tile.block_n if min_split_len is None else min_split_len
    if min_split_len <= 0 or min_split_len % tile.block_n:
        raise ValueError(f"min_split_len={min_split_len} must be a positive multiple of the tile's "
                         f"block_n={tile.block_n}")
    group = num_heads // num_kv_heads
    if fp8_widen not in (torch.float16, torch.bfloat16):
        raise ValueError(f"decode_attention: fp8_widen={fp8_widen} must be torch.float16 or torch.bfloat16")
    # fp32 q asks for fp32 arithmetic (IEEE dots on the widened values); 16-bit q takes the cheap widening
    widen_fp16 = kv_cache.dtype.itemsize == 1 and fp8_widen == torch.float16 and q.dtype != torch.float32
    quant_out = out_scale is not None
    quant_row = quant_out and out_scale.shape[1] == 1 and num_heads > 1
    row = num_heads * head_dim
    if quant_out:
        row_workspace, row_counters = _quant_out_buffers(q, out, out_scale, fused_merge, row_workspace, row_counters)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits is None:  # the split rule at the tile's step (with choose_tile's tile: decode_plan's pair)
        # a window bounds the keys a program reads whatever the table's width: a static size too
        context = block_tables.shape[1] * page if window is None else min(block_tables.shape[1] * page, window)
        num_splits = choose_num_splits(batch, num_kv_heads, context, sm_count(q.device), fp8_cache, tile.block_n)
    direct = num_splits == 1
    fused_merge = fused_merge and not direct
    mid_o, mid_lse, counters = _split_buffers(q, out, num_kv_heads, num_splits, fused_merge, workspace, counters)
    block_d = triton.next_power_of_2(head_dim)
    block_hm, block_s = triton.next_power_of_2(group), triton.next_power_of_2(num_splits)
    chunk_s = max(1, min(block_s, MERGE_TILE_ELEMS // (block_hm * block_d)))
    # the prologue's pointers, strides and eps; without a new token, placeholders the kernel never reads
    prologue = new_token.launch_args() if new_token is not None else (seq_lens,) * 6 + (0, 0, 0.0)
    has_norm = new_token is not None and new_token.q_norm_weight is not None
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, kv_cache, block_tables, seq_lens, out, out_scale if quant_out else mid_lse, mid_o, mid_lse, counters,
        sinks if sinks is not None else seq_lens, window or 0,
        *prologue,
        scale * LOG2E,
        num_splits, min_split_len,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1), out_scale.stride(0) if quant_out else 0, out_scale.stride(1) if quant_out else 0,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2) if not direct else 0,
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE=page, BLOCK_N=tile.block_n,
        DIRECT=direct, IEEE_DOT=q.dtype == torch.float32 and not widen_fp16, WHILE_LOOP=interpreting(), PREFETCH_V=not direct,
        FUSED_MERGE=fused_merge, BLOCK_HM=block_hm, CHUNK_S=chunk_s, WIDEN_FP16=widen_fp16,
        QUANT_OUT=quant_out, FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE, NEW_TOKEN=new_token is not None,
        HAS_NORM=has_norm,
        row_ptr=row_workspace if quant_row else out, row_counter_ptr=row_counters if quant_row else seq_lens,
        QUANT_ROW=quant_row, ROW=row if quant_row else 1, ROW_CHUNK=min(ROW_CHUNK, triton.next_power_of_2(row)),
        HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_args(q.device, "_decode_split_kernel"),
    )  # fmt: skip
    if not direct and not fused_merge:
        _decode_merge_kernel[(batch, num_heads)](
            mid_o, mid_lse, out,
            num_splits,
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
            mid_lse.stride(0), mid_lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4, **pdl_args(mid_o.device, "_decode_merge_kernel"),
        )  # fmt: skip
    return out


def _quant_out_buffers(q: torch.Tensor, out: torch.Tensor | None, out_scale: torch.Tensor, fused_merge: bool,
                       row_workspace: torch.Tensor | None, row_counters: torch.Tensor | None,
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """Check a quantized output's buffers (``decode_attention``'s ``out_scale``); with one scale per sequence, the
    row workspace and counters its programs meet on (allocated when None)."""
    batch, num_heads, head_dim = q.shape
    if out is None or out.dtype != FP8_DTYPE or out.dim() != 3 or out.shape[0] < batch or \
            tuple(out.shape[1:]) != (num_heads, head_dim) or out.stride(2) != 1:
        raise ValueError(f"decode_attention: a quantized output needs out fp8 [>= {batch}, {num_heads}, {head_dim}] "
                         f"with head_dim contiguous, got "
                         f"{None if out is None else (out.dtype, tuple(out.shape), out.stride())}")
    if out_scale.dtype != torch.float32 or out_scale.dim() != 2 or out_scale.shape[0] < batch or \
            out_scale.shape[1] not in (num_heads, 1):
        raise ValueError(f"decode_attention: out_scale must be float32 [>= {batch}, {num_heads}] (one scale per "
                         f"sequence and head) or [>= {batch}, 1] (one per sequence), got {out_scale.dtype} "
                         f"{tuple(out_scale.shape)}")
    if not fused_merge:
        raise ValueError("decode_attention: a quantized output is written by the split kernel itself "
                         "(fused_merge=True)")
    if out_scale.shape[1] != 1 or num_heads == 1:
        return row_workspace, row_counters
    row = num_heads * head_dim
    if out.stride(1) != head_dim:
        raise ValueError(f"decode_attention: one scale per sequence needs out's heads side by side (stride "
                         f"{head_dim} along heads), got strides {out.stride()}")
    if row > MAX_QUANT_ROW:
        raise ValueError(f"decode_attention: one scale per sequence quantizes a row of {num_heads} x {head_dim} = "
                         f"{row} values in one program, at most {MAX_QUANT_ROW}")
    if row_workspace is None:
        row_workspace = torch.empty(batch * row, dtype=q.dtype, device=q.device)
    elif (row_workspace.dtype != q.dtype or row_workspace.numel() < batch * row
          or not row_workspace.is_contiguous() or row_workspace.device != q.device):
        raise ValueError(f"decode_attention: row_workspace holds {row_workspace.numel()} {row_workspace.dtype} on "
                         f"{row_workspace.device}, needs {batch * row} contiguous {q.dtype} on {q.device} for "
                         f"batch={batch}, heads={num_heads}, head_dim={head_dim}")
    if row_counters is None:
        row_counters = torch.zeros(batch, dtype=torch.int32, device=q.device)
    elif (row_counters.dtype != torch.int32 or row_counters.numel() < batch or row_counters.device != q.device
          or not row_counters.is_contiguous()):
        # the kernel finds sequence i's counter at row_counters + i
        raise ValueError(f"decode_attention: row_counters hold {row_counters.numel()} {row_counters.dtype} on "
                         f"{row_counters.device} (stride {row_counters.stride()}), need {batch} contiguous int32 "
                         f"on {q.device}")
    return row_workspace, row_counters


def _split_buffers(q: torch.Tensor, out: torch.Tensor, num_kv_heads: int, num_splits: int, fused_merge: bool,
                   workspace: torch.Tensor | None, counters: torch.Tensor | None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(mid_o, mid_lse, counters) of ``decode_attention``'s splits: views of ``workspace`` (allocated when None) and
    the merge counters (zeroed when None); with one split, placeholders the kernel never reads."""
    batch, num_heads, head_dim = q.shape
    if num_splits == 1:
        return out, out, out  # unused by the kernel when DIRECT
    mid_numel = batch * num_heads * num_splits * (head_dim + 1)
    if workspace is None:
        workspace = torch.empty(mid_numel, dtype=torch.float32, device=q.device)
    elif workspace.numel() < mid_numel or workspace.dtype != torch.float32:
        raise ValueError(
            f"decode workspace holds {workspace.numel()} {workspace.dtype} elements, "
            f"needs {mid_numel} float32 for batch={batch}, heads={num_heads}, splits={num_splits}"
        )
    split_o = batch * num_heads * num_splits * head_dim
    mid_o = workspace[:split_o].view(batch, num_heads, num_splits, head_dim)
    mid_lse = workspace[split_o:mid_numel].view(batch, num_heads, num_splits)
    if not fused_merge:
        return mid_o, mid_lse, mid_lse  # counters unused by the kernel
    if counters is None:
        counters = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=q.device)
    elif counters.dtype != torch.int32 or counters.numel() < batch * num_kv_heads or counters.device != q.device:
        raise ValueError(
            f"decode merge counters hold {counters.numel()} {counters.dtype} on {counters.device}, need "
            f"{batch * num_kv_heads} int32 on {q.device} for batch={batch}, kv_heads={num_kv_heads}"
        )
    return mid_o, mid_lse, counters


@dataclass(frozen=True)
class NewToken:
    """This step's token as the qkv projection leaves it, for ``decode_attention_qkv``: kernels/qk_rope_kv.py's
    inputs (``qkv`` [B, (Hq + 2 Hkv) D] rows of ``num_heads`` = Hq query heads, unit column stride; ``positions``
    and ``slot_mapping`` [B]; ``cos``/``sin`` fp32 [max_position, D / 2]; optional per-head q/k RMSNorm weights
    [D] and their eps)."""

    qkv: torch.Tensor
    num_heads: int
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    eps: float = 0.0

    def launch_args(self) -> tuple:
        """The split kernel's prologue arguments: positions, cos, sin, the q and k norm weights (cos in their place
        without norms: never read), slots, the two tables' row strides, eps."""
        qw, kw = (self.q_norm_weight, self.k_norm_weight) if self.q_norm_weight is not None else (self.cos, self.cos)
        return (self.positions, self.cos, self.sin, qw, kw, self.slot_mapping, self.cos.stride(0), self.sin.stride(0),
                float(self.eps))


def decode_attention_qkv(
    new_token: NewToken, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    **kwargs,
) -> torch.Tensor:  # fmt: skip
    """``decode_attention`` with the attention prologue inside it: the q/k RMSNorm (with weights), rotary and
    K/V cache write of kernels/qk_rope_kv.py, one launch where they were two.

    Every program norms and rotates its q heads from the qkv row; the one whose split holds the last position
    (``seq_lens - 1``) also rotates the new K, writes K and V at ``slot_mapping`` and takes them into its softmax
    from registers, so no program reads what another writes in the same launch. The cache ends as the
    separate prologue leaves it; the output differs from the two launches' by the new token's score, a sum of
    fp32 products where the context's come from a dot. ``kwargs``: ``decode_attention``'s."""
    qkv, num_heads = new_token.qkv, new_token.num_heads
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    check_qkv_args(qkv, new_token.cos, new_token.sin, num_heads, num_kv_heads, head_dim, new_token.q_norm_weight,
                   new_token.k_norm_weight)  # fmt: skip
    check_cache(kv_cache, num_kv_heads, head_dim)
    batch = qkv.shape[0]
    for name, t in (("positions", new_token.positions), ("slot_mapping", new_token.slot_mapping),
                    ("seq_lens", seq_lens)):  # fmt: skip
        if t.dim() != 1 or t.shape[0] != batch:
            raise ValueError(f"decode_attention_qkv: {name} must be [{batch}] (one per qkv row), got {tuple(t.shape)}")
    q = qkv[:, : num_heads * head_dim].unflatten(1, (num_heads, head_dim))
    return decode_attention(q, kv_cache, block_tables, seq_lens, scale, new_token=new_token, **kwargs)


def decode_attention_reference(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    window: int | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 attention over the context gathered from the cache through each block table (the last ``window``
    positions with a window; ``sinks`` [Hq] joining each head's denominator)."""
    num_heads = q.shape[1]
    page = kv_cache.shape[2]
    out = torch.empty_like(q)
    for i, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(0 if window is None else max(0, n - window), n, device=q.device)
        blocks = block_tables[i, pos // page].long()
        k = kv_cache[0, blocks, pos % page].float()  # [n, Hkv, D]
        v = kv_cache[1, blocks, pos % page].float()
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        if sinks is not None:  # one more column that takes its share of the softmax and carries no value
            scores = torch.cat([scores, sinks.float()[:, None]], dim=1)
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1)[:, : pos.shape[0]], v).to(q.dtype)
    return out
