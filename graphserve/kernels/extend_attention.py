"""Prefill / extend attention: new tokens of a varlen batch attend causally over their paged KV.

Sequence i owns query rows ``query_start_loc[i] .. query_start_loc[i+1]``; its new tokens sit at
positions ``seq_len - qlen .. seq_len - 1`` and were already written to the cache, so K/V of the
cached prefix and of the new tokens are read the same way, through the block table. Grid:
(query tile, sequence, query head), flash-attention style online softmax in fp32 with bf16/fp16
tensor-core dots. The grid's first axis comes from ``max_query_len``; tiles past a sequence's own
length exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.common import interpreting
from graphserve.kernels.decode_attention import check_window_sinks
from graphserve.kernels.pdl import pdl_args, pdl_enter

LOG2E = 1.4426950408889634


@triton.jit
def _extend_step(
    q, m_i, l_i, acc, n0, key_end, q_pos, bt_row, kv_base, scale_log2, stride_kv, stride_blk, stride_off,
    offs_d, d_mask, window, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE_DOT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    """One online-softmax step of a query tile over keys [n0, n0 + BLOCK_N), causal by position (and within
    ``window`` of it with HAS_WINDOW)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < key_end
    block = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
    row = block * stride_blk + (offs_n % PAGE) * stride_off
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(kv_base + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # fp8 cache: widen
    if IEEE_DOT:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
    qk = tl.where(visible, qk * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if HAS_WINDOW:
        # a row may see none of the tile's first keys (its window starts later): keep its reference at 0 until it
        # does, so no -inf - -inf appears
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        # key 0 is visible to every row and comes first, so m_new is finite from the first step on
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(kv_base + stride_kv + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    if IEEE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit(do_not_specialize=["stride_bt"])  # batch-sized ints: see engine/warmup.py
def _extend_kernel(
    q_ptr, kv_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, sinks_ptr,
    scale_log2, window,
    stride_qt, stride_qh,
    stride_kv, stride_blk, stride_off, stride_kvh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE_DOT: tl.constexpr, WHILE_LOOP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    q_pos = prefix + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    tok = (q_start + offs_m).to(tl.int64)
    io_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=io_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # the tile's last row sees keys up to its own position; nothing later is read
    key_end = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)
    # with a window the tile's first row sees nothing before its window: no block wholly before it is read
    key_start = 0
    if HAS_WINDOW:
        key_start = tl.maximum(prefix + tile * BLOCK_M - window + 1, 0)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_base = kv_ptr + (head // GROUP) * stride_kvh
    if WHILE_LOOP:
        n0 = key_start
        while n0 < key_end:
            m_i, l_i, acc = _extend_step(
                q, m_i, l_i, acc, n0, key_end, q_pos, bt_row, kv_base, scale_log2, stride_kv, stride_blk,
                stride_off, offs_d, d_mask, window, PAGE, BLOCK_N, IEEE_DOT, HAS_WINDOW,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(key_start, key_end, BLOCK_N):
            m_i, l_i, acc = _extend_step(
                q, m_i, l_i, acc, n0, key_end, q_pos, bt_row, kv_base, scale_log2, stride_kv, stride_blk,
                stride_off, offs_d, d_mask, window, PAGE, BLOCK_N, IEEE_DOT, HAS_WINDOW,
            )  # fmt: skip
    if HAS_SINKS:  # the head's sink joins each row's denominator, with no value
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    if HAS_WINDOW and not HAS_SINKS:  # rows past the sequence's tokens may have seen no key; they are not stored
        l_i = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_i[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head * stride_oh + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=io_mask)  # fmt: skip


def extend_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens ``q`` ([T, Hq, D]) over cached prefix + new K/V in ``kv_cache``; the
    token at position p sees p - ``window`` < j <= p only with a window (no block wholly before a query tile's
    windows is read); ``sinks`` float32 [Hq] join each head's softmax denominator."""
    num_tokens, num_heads, head_dim = q.shape
    check_window_sinks(window, sinks, num_heads, q.device)
    _, _, page, num_kv_heads, _ = kv_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if q.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError(f"extend_attention needs head_dim contiguous (stride 1) in q and kv_cache, got strides "
                         f"q {q.stride()}, kv_cache {kv_cache.stride()}")
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    # 64x64 tiles keep a D=128 tile's fp32 accumulator in registers with 4 warps; 16 is tl.dot's minimum
    block_m = 64 if max_query_len > 32 else (32 if max_query_len > 16 else 16)
    block_n = 64 if block_d <= 128 else 32
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _extend_kernel[grid](
        q, kv_cache, out, block_tables, seq_lens, query_start_loc, sinks if sinks is not None else seq_lens,
        scale * LOG2E, window or 0,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE_DOT=q.dtype == torch.float32, WHILE_LOOP=interpreting(),
        HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
        num_warps=4, num_stages=2, **pdl_args(q.device, "_extend_kernel"),
    )  # fmt: skip
    return out


def extend_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 causal attention per sequence over K/V gathered from the cache through its block table (within
    ``window`` with a window; ``sinks`` [Hq] joining each head's denominator)."""
    page = kv_cache.shape[2]
    num_heads = q.shape[1]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for i, n in enumerate(seq_lens.tolist()):
        qs, qe = starts[i], starts[i + 1]
        if qe == qs:
            continue
        pos = torch.arange(n, device=q.device)
        blocks = block_tables[i, pos // page].long()
        k = kv_cache[0, blocks, pos % page].float()
        v = kv_cache[1, blocks, pos % page].float()
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q_pos = torch.arange(n - (qe - qs), n, device=q.device)
        scores = torch.einsum("thd,nhd->htn", q[qs:qe].float(), k) * scale
        hidden = pos[None, None, :] > q_pos[None, :, None]
        if window is not None:
            hidden |= pos[None, None, :] <= q_pos[None, :, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:  # one more column that takes its share of the softmax and carries no value
            scores = torch.cat([scores, sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)], dim=-1)
        out[qs:qe] = torch.einsum("htn,nhd->thd", scores.softmax(-1)[..., :n], v).to(q.dtype)
    return out
