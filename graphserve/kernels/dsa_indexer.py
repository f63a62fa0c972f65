"""The DSA indexer's Triton kernels: the index key cache write and the head-weighted ReLU scores.

``write_index_cache`` stores one key row a token, in the model dtype or in the FP8 form (D e4m3 bytes, then
the token's fp32 scale amax / 448, kernels/dsa_reference.py): the uint8 cache is read through two views of
the same bytes, e4m3 for the values and fp32 for the scales (D + 4 is a multiple of 4, so each slot's scale
is the fp32 element ``D / 4`` of its row).

``indexer_scores``: a program owns one query row and ``BLOCK_N`` key positions. The row's queries
``[heads, D]`` stay in registers, the key tile ``[BLOCK_N, D]`` is gathered through the block table, one
``[heads, BLOCK_N]`` product gives every head's logits, and the head-weighted ReLU sum folds them to one
score per key before anything is written, so only ``[T, max_len]`` fp32 leaves the kernel. An FP8 key is
widened to the queries' dtype (exact) and its scale multiplies the product (the scale is positive, so it
passes through the ReLU). Tiles past the row's position write ``-inf`` without loading anything: the
static ``max_len`` a CUDA graph needs costs stores, not reads or products. An FP8 row starts every D + 4
bytes, so its keys load 4 bytes at a time (the alignment every row has): left to itself, Triton's alignment
analysis took every row for 16-byte aligned (16-byte loads in the PTX) and the loads faulted on the GPU.

``compressed_indexer_scores`` runs the same kernel over DeepSeek-V4's compressed keys (``RATE``: key ``n`` sits in
the entry row of group ``n``'s last token in that block's compact page; ``KEY_AT``: its column in the page); DSA's own call compiles
with ``RATE`` 1 and ``KEY_AT`` 0 to what it was.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.dsa_reference import FP8_MAX, MIN_SCALE, SCALE_BYTES, index_head_dim, is_fp8_index_cache
from graphserve.kernels.fp8_quant import quantize_rows

# 64 keys x 128 dims is 16 KiB of bf16 a tile. Not tuned: at bs 64 the bf16 form read at 73-92% of the H100's read
# bandwidth (GLM-5, 4k-128k) and the FP8 form at 42-51% (benchmarks/results/dsa_kernels.json)
SCORE_BLOCK_N = 64


def _cache_views(index_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(values, scales, values' slot stride, scales' slot stride); scales is values for the plain form."""
    if not index_cache.is_contiguous():
        raise ValueError(f"the index cache must be contiguous, got strides {index_cache.stride()}")
    width = index_cache.shape[-1]
    if not is_fp8_index_cache(index_cache):
        return index_cache, index_cache, width, 0
    if width % 4:
        raise ValueError(f"FP8 index cache rows of {width} bytes: D + {SCALE_BYTES} must be a multiple of 4 "
                         "for the fp32 scale to be aligned")  # fmt: skip
    return index_cache.view(torch.float8_e4m3fn), index_cache.view(torch.float32), width, width // 4


@triton.jit
def _write_index_kernel(
    k_ptr, slot_ptr, val_ptr, scale_ptr, stride_kt, stride_vslot, stride_sslot,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
    FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    if FP8:
        q, scale = quantize_rows(k[None, :], val_ptr.dtype.element_ty, FP8_MAX_C, MIN_SCALE_C)
        tl.store(val_ptr + slot * stride_vslot + offs_d[None, :], q, mask=d_mask[None, :])
        tl.store(scale_ptr + slot * stride_sslot + HEAD_DIM // 4 + tl.arange(0, 1), scale)
    else:
        tl.store(val_ptr + slot * stride_vslot + offs_d, k.to(val_ptr.dtype.element_ty), mask=d_mask)


def write_index_cache(k: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k [T, D]`` at ``slot_mapping`` (quantized for the FP8 form); see kernels/dsa_reference.py."""
    d = index_head_dim(index_cache)
    if k.shape[-1] != d or k.stride(-1) != 1:
        raise ValueError(f"keys {tuple(k.shape)} (last stride {k.stride(-1)}) for an index cache of D={d}: "
                         "the last dim must be D and contiguous")  # fmt: skip
    vals, scales, stride_v, stride_s = _cache_views(index_cache)
    if k.shape[0] == 0:
        return
    fp8 = is_fp8_index_cache(index_cache)
    _write_index_kernel[(k.shape[0],)](
        k, slot_mapping, vals, scales, k.stride(0), stride_v, stride_s,
        HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), FP8=fp8, FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
        num_warps=1 if d <= 256 else 4,
    )  # fmt: skip


# block tables are sliced per step and their width follows the batch: see engine/warmup.py
@triton.jit(do_not_specialize=["stride_bt", "max_len", "max_blocks"],
            do_not_specialize_on_alignment=["bt_ptr", "row_seq_ptr", "row_pos_ptr"])
def _indexer_scores_kernel(
    q_ptr, w_ptr, val_ptr, scale_ptr, bt_ptr, row_seq_ptr, row_pos_ptr, out_ptr,
    max_len, num_heads, max_blocks,
    stride_qt, stride_qh, stride_wt, stride_vslot, stride_sslot, stride_bt, stride_ot,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, FP8: tl.constexpr, DOT_PRECISION: tl.constexpr, RATE: tl.constexpr, KEY_AT: tl.constexpr,
    ENTRY_WIDTH: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(1)
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    pos = tl.load(row_pos_ptr + t)
    out_row = out_ptr + t.to(tl.int64) * stride_ot
    if n0 <= pos:
        seq = tl.load(row_seq_ptr + t).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        h_mask = offs_h < num_heads
        d_mask = offs_d < HEAD_DIM
        q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + offs_h, mask=h_mask, other=0.0)
        if RATE == 1:
            # DSA's own cache, compiled exactly as before the compressed form existed: the FP8 rows' alignment
            # below was measured on this form (an H100 faulted with a misaligned address on the general one)
            visible = (offs_n <= pos) & (offs_n // PAGE < max_blocks)
            block = tl.load(bt_ptr + seq * stride_bt + offs_n // PAGE, mask=visible, other=0).to(tl.int64)
            slot = block * PAGE + offs_n % PAGE
            row = slot * stride_vslot
        else:
            # key n of a compressed cache sits in the entry row of its group's last token, in that block's page
            # (stride_vslot: the page; KEY_AT: past the page's checkpoint; kernels/v4_reference.entry_index)
            tok = offs_n * RATE + RATE - 1
            visible = (offs_n <= pos) & (tok // PAGE < max_blocks)
            block = tl.load(bt_ptr + seq * stride_bt + tok // PAGE, mask=visible, other=0).to(tl.int64)
            slot = block
            row = block * stride_vslot + ((tok % PAGE) // RATE) * ENTRY_WIDTH + KEY_AT
        if FP8:
            # an FP8 row starts every D + 4 bytes, 4-aligned only; without the hint Triton took every row for 16-byte
            # aligned (the slots of a page count up from a multiple of 16) and loaded 16 bytes at a time, a misaligned
            # address on the GPU
            row = tl.multiple_of(row, 4)
        k = tl.load(val_ptr + row[:, None] + offs_d[None, :], mask=visible[:, None] & d_mask[None, :],
                    other=0.0).to(q.dtype)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        if FP8:
            s = s * tl.load(scale_ptr + slot * stride_sslot + HEAD_DIM // 4, mask=visible, other=0.0)[None, :]
        score = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0)
        tl.store(out_row + offs_n, tl.where(offs_n <= pos, score, float("-inf")), mask=offs_n < max_len)
    else:
        tl.store(out_row + offs_n, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=offs_n < max_len)


def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_tables: torch.Tensor,
    row_seq: torch.Tensor, row_pos: torch.Tensor, max_len: int, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``[T, max_len]`` fp32: ``sum_h weights[t, h] * relu(q[t, h] . k_j)`` for ``j <= row_pos[t]``, else -inf."""
    tokens, heads, d = q.shape
    if d != index_head_dim(index_cache) or q.stride(-1) != 1:
        raise ValueError(f"queries {tuple(q.shape)} (last stride {q.stride(-1)}) against an index cache of "
                         f"D={index_head_dim(index_cache)}: the last dim must match and be contiguous")  # fmt: skip
    if weights.shape != (tokens, heads) or weights.dtype != torch.float32 or weights.stride(-1) != 1:
        raise ValueError(f"weights {tuple(weights.shape)} {weights.dtype}: expected ({tokens}, {heads}) float32, "
                         "last dim contiguous")  # fmt: skip
    fp8 = is_fp8_index_cache(index_cache)
    if not fp8 and index_cache.dtype != q.dtype:
        raise ValueError(f"index cache {index_cache.dtype} with queries in {q.dtype}: the plain form is in the "
                         "queries' dtype")  # fmt: skip
    vals, scales, stride_v, stride_s = _cache_views(index_cache)
    if out is None:
        out = torch.empty(tokens, max_len, dtype=torch.float32, device=q.device)
    if tokens == 0 or max_len == 0:
        return out
    grid = (triton.cdiv(max_len, SCORE_BLOCK_N), tokens)
    _indexer_scores_kernel[grid](
        q, weights, vals, scales, block_tables, row_seq, row_pos, out,
        max_len, heads, block_tables.shape[1],
        q.stride(0), q.stride(1), weights.stride(0), stride_v, stride_s, block_tables.stride(0), out.stride(0),
        HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_H=max(16, triton.next_power_of_2(heads)),
        BLOCK_N=SCORE_BLOCK_N, PAGE=index_cache.shape[1], FP8=fp8,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, RATE=1, KEY_AT=0, ENTRY_WIDTH=0,
    )  # fmt: skip
    return out


def compressed_indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, key_at: int, rate: int, block_size: int,
    block_tables: torch.Tensor, row_seq: torch.Tensor, last: torch.Tensor, num_keys: int,
    out: torch.Tensor | None = None, state_floats: int = 0, entry_width: int = 0,
) -> torch.Tensor:  # fmt: skip
    """``indexer_scores`` over a compressed cache (DeepSeek-V4's CSA): key ``n`` is the ``q.shape[-1]`` columns from
    ``key_at`` of the ``entry_width``-wide entry row of group ``n`` in the compact pages ``rows [num_blocks, page]``
    (after ``state_floats`` of checkpoint; kernels/v4_reference.entry_index); ``last [T]`` is each row's last
    visible key (-1: none). ``[T, num_keys]`` fp32, -inf past ``last``."""
    tokens, heads, d = q.shape
    base = state_floats * 4 // rows.element_size()
    if q.stride(-1) != 1 or rows.stride(-1) != 1 or rows.dtype != q.dtype or key_at + d > entry_width or \
            base + entry_width > rows.shape[-1]:  # fmt: skip
        raise ValueError(f"queries {tuple(q.shape)} {q.dtype} against pages {tuple(rows.shape)} {rows.dtype} at "
                         f"column {key_at} of {entry_width}-wide rows after {base}: same dtype, last dims "
                         "contiguous, the key inside the row")  # fmt: skip
    if weights.shape != (tokens, heads) or weights.dtype != torch.float32 or weights.stride(-1) != 1:
        raise ValueError(f"weights {tuple(weights.shape)} {weights.dtype}: expected ({tokens}, {heads}) float32, "
                         "last dim contiguous")  # fmt: skip
    if out is None:
        out = torch.empty(tokens, num_keys, dtype=torch.float32, device=q.device)
    if tokens == 0 or num_keys == 0:
        return out
    _indexer_scores_kernel[(triton.cdiv(num_keys, SCORE_BLOCK_N), tokens)](
        q, weights, rows, rows, block_tables, row_seq, last, out,
        num_keys, heads, block_tables.shape[1],
        q.stride(0), q.stride(1), weights.stride(0), rows.stride(0), 0, block_tables.stride(0), out.stride(0),
        HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_H=max(16, triton.next_power_of_2(heads)),
        BLOCK_N=SCORE_BLOCK_N, PAGE=block_size, FP8=False,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, RATE=rate, KEY_AT=base + key_at,
        ENTRY_WIDTH=entry_width,
    )  # fmt: skip
    return out
