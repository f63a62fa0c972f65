"""DeepSeek-V4's compression as one Triton launch: kernels/v4_reference.compress_groups.

One program per row of the step (decode or an extend chunk). A row acts where its token closes a group (``(p + 1)
% m == 0``: it writes the group's entry) or ends a block or its sequence's step (it writes that block's checkpoint,
the fp32 online-softmax accumulators of the open groups); every other row returns at once. An acting row rebuilds
its accumulators from the sequence's checkpoint before the step (gathered beforehand, kernels/v4_reference.
start_checkpoints, so no row reads a page another row writes) and the step's own projections of its group's tokens
(CSA: also the previous group's), at most ``2m`` of them. The tests are made on the device, so a decode step calls
this with static shapes and no host sync, and a CUDA graph captures it; padding rows (past the batch's last real
row) never act.

Channels are held as their even and odd halves (``c = 2i`` and ``2i + 1``), the pairs the interleaved rope rotates,
so the rope is two multiply-adds on registers after the norm. The softmax over the tokens is online, ``BLOCK_M`` at
a time, so a 128-token HCA group never sits in registers whole.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
BLOCK_M = 8  # tokens a step: 8 x 256 channel pairs x (kv, gate) x (even, odd) = 64 fp32 registers a thread at 4 warps


@triton.jit
def _pool_step(kv_ptr, gate_ptr, t, p, s0, group, j0, stride_t, col, bias_ptr, stride_bias, offs_i, i_mask,
               m_e, m_o, l_e, l_o, a_e, a_o, RATE: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """Folds the tokens ``group * RATE + [j0, j0 + BLOCK_M)`` that this step holds up to ``p`` (their rows sit
    ``p - q`` before row ``t``) into the running per-channel softmax (max, sum, weighted kv) of both halves."""
    j = j0 + tl.arange(0, BLOCK_M)
    q = group * RATE + j
    ok = (j < RATE) & (q >= s0) & (q <= p) & (q >= 0)
    row = (t - (p - q)) * stride_t
    mask = ok[:, None] & i_mask[None, :]
    even = col + 2 * offs_i[None, :]
    kv_e = tl.load(kv_ptr + row[:, None] + even, mask=mask, other=0.0).to(tl.float32)
    kv_o = tl.load(kv_ptr + row[:, None] + even + 1, mask=mask, other=0.0).to(tl.float32)
    g_e = tl.load(gate_ptr + row[:, None] + even, mask=mask, other=0.0).to(tl.float32)
    g_o = tl.load(gate_ptr + row[:, None] + even + 1, mask=mask, other=0.0).to(tl.float32)
    b_rows = bias_ptr + j[:, None] * stride_bias + even
    g_e = tl.where(mask, (g_e + tl.load(b_rows, mask=mask, other=0.0)) * 1.4426950408889634, float("-inf"))
    g_o = tl.where(mask, (g_o + tl.load(b_rows + 1, mask=mask, other=0.0)) * 1.4426950408889634, float("-inf"))
    new_e = tl.maximum(m_e, tl.max(g_e, 0))
    new_o = tl.maximum(m_o, tl.max(g_o, 0))
    safe_e = tl.where(new_e == float("-inf"), 0.0, new_e)
    safe_o = tl.where(new_o == float("-inf"), 0.0, new_o)
    p_e = tl.exp2(g_e - safe_e[None, :])
    p_o = tl.exp2(g_o - safe_o[None, :])
    al_e = tl.exp2(m_e - safe_e)
    al_o = tl.exp2(m_o - safe_o)
    l_e = l_e * al_e + tl.sum(p_e, 0)
    l_o = l_o * al_o + tl.sum(p_o, 0)
    a_e = a_e * al_e + tl.sum(p_e * kv_e, 0)
    a_o = a_o * al_o + tl.sum(p_o * kv_o, 0)
    return new_e, new_o, l_e, l_o, a_e, a_o


@triton.jit
def _load_acc(ptr, use, offs_i, i_mask, DIM: tl.constexpr):
    """An accumulator kept as ``[log-sum-exp, weighted mean]`` of ``DIM`` channels (natural log units) as the kernel
    folds it: even/odd halves of (max in log2 units, sum, weighted sum); the empty one where not ``use``."""
    ok = i_mask & use
    even = 2 * offs_i
    lse_e = tl.load(ptr + even, mask=ok, other=float("-inf"))
    lse_o = tl.load(ptr + even + 1, mask=ok, other=float("-inf"))
    some_e = lse_e > float("-inf")
    some_o = lse_o > float("-inf")
    a_e = tl.where(some_e, tl.load(ptr + DIM + even, mask=ok, other=0.0), 0.0)
    a_o = tl.where(some_o, tl.load(ptr + DIM + even + 1, mask=ok, other=0.0), 0.0)
    return (lse_e * 1.4426950408889634, lse_o * 1.4426950408889634, tl.where(some_e, 1.0, 0.0),
            tl.where(some_o, 1.0, 0.0), a_e, a_o)


@triton.jit
def _store_acc(ptr, offs_i, i_mask, m_e, m_o, l_e, l_o, a_e, a_o, DIM: tl.constexpr):
    """Keeps (max, sum, weighted sum) as (log-sum-exp, weighted mean): two floats a channel, not three."""
    even = 2 * offs_i
    some_e = l_e > 0
    some_o = l_o > 0
    lse_e = tl.where(some_e, (m_e + tl.log2(tl.where(some_e, l_e, 1.0))) * 0.6931471805599453, float("-inf"))
    lse_o = tl.where(some_o, (m_o + tl.log2(tl.where(some_o, l_o, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(ptr + even, lse_e, mask=i_mask)
    tl.store(ptr + even + 1, lse_o, mask=i_mask)
    tl.store(ptr + DIM + even, tl.where(some_e, a_e / tl.where(some_e, l_e, 1.0), 0.0), mask=i_mask)
    tl.store(ptr + DIM + even + 1, tl.where(some_o, a_o / tl.where(some_o, l_o, 1.0), 0.0), mask=i_mask)


# block tables are sliced per step and their width follows the batch: see engine/warmup.py
@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=["bt_ptr", "pos_ptr", "qsl_ptr", "row_seq_ptr"])
def _v4_compress_kernel(
    kv_ptr, gate_ptr, init_ptr, ckpt_ptr, page_ptr, bt_ptr, row_seq_ptr, pos_ptr, qsl_ptr, bias_ptr, norm_ptr,
    inv_freq_ptr, eps, num_seqs,
    stride_t, stride_init, stride_ckpt, stride_page, stride_bt, stride_bias,
    RATE: tl.constexpr, DIM: tl.constexpr, OVERLAP: tl.constexpr, CKPT_AT: tl.constexpr, ENTRY_BASE: tl.constexpr,
    ENTRY_WIDTH: tl.constexpr, ENTRY_AT: tl.constexpr, ROPE_PAIRS: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    seq = tl.load(row_seq_ptr + t).to(tl.int64)
    first_row = tl.load(qsl_ptr + seq).to(tl.int64)
    real = t < tl.load(qsl_ptr + num_seqs).to(tl.int64)
    last = real & (t + 1 == tl.load(qsl_ptr + seq + 1).to(tl.int64))
    closes = real & ((p + 1) % RATE == 0)
    writes = last | (real & (p % PAGE == PAGE - 1))
    if closes | writes:
        s0 = p - (t - first_row)
        g = p // RATE
        # the group of the position before the step (floor division: -1 at a sequence's start)
        big_g = tl.where(s0 > 0, (s0 - 1) // RATE, -1)
        has = s0 > 0
        offs_i = tl.arange(0, BLOCK_I)
        i_mask = offs_i < DIM // 2
        init_row = init_ptr + seq * stride_init + CKPT_AT
        bt_row = bt_ptr + seq * stride_bt
        block = tl.load(bt_row + p // PAGE).to(tl.int64)
        if OVERLAP:
            # cur: entry g's Ca side (group g - 1) then Cb side (group g); starts from the checkpoint's cur (g is the
            # group in progress before the step) or its next (group g - 1 was)
            from_cur = has & (g == big_g)
            at = tl.where(from_cur, 0, 2 * DIM)
            m_e, m_o, l_e, l_o, a_e, a_o = _load_acc(init_row + at, has & (g <= big_g + 1), offs_i, i_mask, DIM)
            for j0 in range(0, RATE, BLOCK_M):
                m_e, m_o, l_e, l_o, a_e, a_o = _pool_step(
                    kv_ptr, gate_ptr, t, p, s0, g - 1, j0, stride_t, 0, bias_ptr, stride_bias, offs_i, i_mask,
                    m_e, m_o, l_e, l_o, a_e, a_o, RATE, BLOCK_M)
            for j0 in range(0, RATE, BLOCK_M):
                m_e, m_o, l_e, l_o, a_e, a_o = _pool_step(
                    kv_ptr, gate_ptr, t, p, s0, g, j0, stride_t, DIM, bias_ptr, stride_bias, offs_i, i_mask,
                    m_e, m_o, l_e, l_o, a_e, a_o, RATE, BLOCK_M)
            if writes:
                # next: entry g + 1's Ca side so far, the group in progress
                n_e, n_o, nl_e, nl_o, na_e, na_o = _load_acc(init_row + 2 * DIM, from_cur, offs_i, i_mask, DIM)
                for j0 in range(0, RATE, BLOCK_M):
                    n_e, n_o, nl_e, nl_o, na_e, na_o = _pool_step(
                        kv_ptr, gate_ptr, t, p, s0, g, j0, stride_t, 0, bias_ptr, stride_bias, offs_i, i_mask,
                        n_e, n_o, nl_e, nl_o, na_e, na_o, RATE, BLOCK_M)
                _store_acc(ckpt_ptr + block * stride_ckpt + CKPT_AT + 2 * DIM, offs_i, i_mask, n_e, n_o, nl_e, nl_o,
                           na_e, na_o, DIM)  # fmt: skip
        else:
            m_e, m_o, l_e, l_o, a_e, a_o = _load_acc(init_row, has & (g == big_g), offs_i, i_mask, DIM)
            for j0 in range(0, RATE, BLOCK_M):
                m_e, m_o, l_e, l_o, a_e, a_o = _pool_step(
                    kv_ptr, gate_ptr, t, p, s0, g, j0, stride_t, 0, bias_ptr, stride_bias, offs_i, i_mask,
                    m_e, m_o, l_e, l_o, a_e, a_o, RATE, BLOCK_M)
        if writes:
            _store_acc(ckpt_ptr + block * stride_ckpt + CKPT_AT, offs_i, i_mask, m_e, m_o, l_e, l_o, a_e, a_o, DIM)
        if closes:
            x_e = tl.where(i_mask, a_e / tl.where(i_mask, l_e, 1.0), 0.0)
            x_o = tl.where(i_mask, a_o / tl.where(i_mask, l_o, 1.0), 0.0)
            r = 1.0 / tl.sqrt((tl.sum(x_e * x_e, 0) + tl.sum(x_o * x_o, 0)) / DIM + eps)
            even = 2 * offs_i
            x_e = x_e * r * tl.load(norm_ptr + even, mask=i_mask, other=0.0).to(tl.float32)
            x_o = x_o * r * tl.load(norm_ptr + even + 1, mask=i_mask, other=0.0).to(tl.float32)
            # the trailing ROPE_PAIRS pairs rotate at the group's first position (transformers' compressor)
            f = offs_i - (DIM // 2 - ROPE_PAIRS)
            rot = (f >= 0) & i_mask
            angle = (g * RATE).to(tl.float32) * tl.load(inv_freq_ptr + f, mask=rot, other=0.0)
            cos = tl.where(rot, tl.cos(angle), 1.0)
            sin = tl.where(rot, tl.sin(angle), 0.0)
            y_e = x_e * cos - x_o * sin
            y_o = x_o * cos + x_e * sin
            out = page_ptr + block * stride_page + ENTRY_BASE + ((p % PAGE) // RATE) * ENTRY_WIDTH + ENTRY_AT + even
            tl.store(out, y_e.to(page_ptr.dtype.element_ty), mask=i_mask)
            tl.store(out + 1, y_o.to(page_ptr.dtype.element_ty), mask=i_mask)


def compress_groups(pages: torch.Tensor, branch, kv: torch.Tensor, gate: torch.Tensor, init: torch.Tensor,
                    block_tables: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor,
                    query_start_loc: torch.Tensor, rate: int, bias: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, inv_freq: torch.Tensor, block_size: int, state_floats: int,
                    entry_width: int) -> None:  # fmt: skip
    """kernels/v4_reference.compress_groups: ``pages [num_blocks, page]`` contiguous, ``branch`` a CompressorBranch,
    ``kv, gate [T, width]`` sharing one row stride, ``init [B, state_floats]`` fp32 (start_checkpoints), ``bias
    [rate, series * dim]`` (fp32), ``inv_freq`` fp32 on the pages' device."""
    from graphserve.kernels.v4_reference import checkpoints

    t = positions.shape[0]
    d = branch.dim
    if not pages.is_contiguous() or bias.stride(-1) != 1 or not norm_weight.is_contiguous():
        raise ValueError("compress_groups needs the pages contiguous, the last dim of bias and the norm weight too")
    if kv.stride(-1) != 1 or gate.stride(-1) != 1 or kv.stride(0) != gate.stride(0) or init.stride(-1) != 1:
        raise ValueError(f"kv {kv.stride()} and gate {gate.stride()} need one row stride and contiguous last dims")
    if d % 2 or 2 * inv_freq.shape[0] > d:
        raise ValueError(f"entry dim {d} with {2 * inv_freq.shape[0]} rotated dims: need an even dim holding them")
    series = 2 if branch.overlap else 1
    if tuple(bias.shape) != (rate, series * d) or branch.width != series * d or kv.shape[-1] != series * d:
        raise ValueError(f"position bias {tuple(bias.shape)}, state width {branch.width} and kv {tuple(kv.shape)} for "
                         f"rate {rate}, dim {d}: expected ({rate}, {series * d}) and {series * d}")  # fmt: skip
    if t == 0:
        return
    ckpt = checkpoints(pages, state_floats)
    _v4_compress_kernel[(t,)](
        kv, gate, init, ckpt, pages, block_tables, row_seq, positions, query_start_loc, bias, norm_weight,
        inv_freq.float().contiguous(), float(eps), query_start_loc.shape[0] - 1,
        kv.stride(0), init.stride(0), ckpt.stride(0), pages.stride(0), block_tables.stride(0), bias.stride(0),
        RATE=rate, DIM=d, OVERLAP=branch.overlap, CKPT_AT=branch.ckpt_at,
        ENTRY_BASE=state_floats * 4 // pages.dtype.itemsize, ENTRY_WIDTH=entry_width, ENTRY_AT=branch.entry_at,
        ROPE_PAIRS=inv_freq.shape[0], PAGE=block_size, BLOCK_I=max(16, triton.next_power_of_2(d // 2)),
        BLOCK_M=min(BLOCK_M, triton.next_power_of_2(rate)), num_warps=4,
    )  # fmt: skip
