"""DeepSeek-V4's compression of completed groups as one Triton launch: kernels/v4_reference.compress_groups.

One program per row of the step (decode or an extend chunk): a row whose token closes a group (``(p + 1) % m ==
0``) pools that group's state, already in the row cache, into the group's entry and writes it into its own row;
every other row returns at once. That test is made on the device, so a decode step calls this with static shapes
and no host sync, and a CUDA graph captures it; a padding row (position 0, the dummy block) closes a group only
at ``m == 1``, which no V4 config has (kernels/v4_reference.py; models/deepseek_v4_shape.py refuses it).

Channels are held as their even and odd halves (``c = 2i`` and ``2i + 1``), the pairs the interleaved rope rotates,
so the rope is two multiply-adds on registers after the norm. The softmax over the group's ``m`` (CSA: ``2m``) tokens
is online along the tokens, ``BLOCK_M`` at a time, so a 128-token HCA group never sits in registers whole.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.common import interpreting

LOG2E = 1.4426950408889634
BLOCK_M = 8  # tokens a step: 8 x 256 channel pairs x (kv, gate) x (even, odd) = 64 fp32 registers a thread at 4 warps


@triton.jit
def _pool_step(rows_ptr, bt_row, first, j0, lo, stride_row, kv_at, gate_at, bias_ptr, bias_at, stride_bias, offs_i,
               i_mask, m_e, m_o, l_e, l_o, a_e, a_o, RATE: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr):
    """Folds the group tokens ``[j0, j0 + BLOCK_M)`` (positions ``first + j``, those from ``lo`` on) into the running
    per-channel softmax (max, sum, weighted kv) of both channel halves."""
    j = j0 + tl.arange(0, BLOCK_M)
    ok = (j < RATE) & (j >= lo)
    pos = first + j
    block = tl.load(bt_row + pos // PAGE, mask=ok, other=0).to(tl.int64)
    base = (block * PAGE + pos % PAGE) * stride_row
    mask = ok[:, None] & i_mask[None, :]
    even = 2 * offs_i[None, :]
    kv_e = tl.load(rows_ptr + base[:, None] + kv_at + even, mask=mask, other=0.0).to(tl.float32)
    kv_o = tl.load(rows_ptr + base[:, None] + kv_at + even + 1, mask=mask, other=0.0).to(tl.float32)
    g_e = tl.load(rows_ptr + base[:, None] + gate_at + even, mask=mask, other=0.0).to(tl.float32)
    g_o = tl.load(rows_ptr + base[:, None] + gate_at + even + 1, mask=mask, other=0.0).to(tl.float32)
    b_rows = bias_ptr + j[:, None] * stride_bias + bias_at + even
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
def _v4_compress_kernel(
    rows_ptr, bt_ptr, row_seq_ptr, pos_ptr, slot_ptr, bias_ptr, norm_ptr, inv_freq_ptr, eps,
    stride_row, stride_bt, stride_bias,
    RATE: tl.constexpr, STATE_AT: tl.constexpr, WIDTH: tl.constexpr, ENTRY_AT: tl.constexpr, DIM: tl.constexpr,
    ROPE_PAIRS: tl.constexpr, OVERLAP: tl.constexpr, OWN_AT: tl.constexpr, PAGE: tl.constexpr, BLOCK_I: tl.constexpr,
    BLOCK_M: tl.constexpr, WHILE_LOOP: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    if (pos + 1) % RATE == 0:
        first = pos + 1 - RATE
        seq = tl.load(row_seq_ptr + t).to(tl.int64)
        bt_row = bt_ptr + seq * stride_bt
        offs_i = tl.arange(0, BLOCK_I)
        i_mask = offs_i < DIM // 2
        m_e = tl.full([BLOCK_I], float("-inf"), tl.float32)
        m_o = tl.full([BLOCK_I], float("-inf"), tl.float32)
        l_e = tl.zeros([BLOCK_I], tl.float32)
        l_o = tl.zeros([BLOCK_I], tl.float32)
        a_e = tl.zeros([BLOCK_I], tl.float32)
        a_o = tl.zeros([BLOCK_I], tl.float32)
        if OVERLAP:
            # the previous group's first halves (Ca, their gates and biases); none before group 0
            lo = tl.where(first > 0, 0, RATE)
            if WHILE_LOOP:
                j0 = 0
                while j0 < RATE:
                    m_e, m_o, l_e, l_o, a_e, a_o = _pool_step(
                        rows_ptr, bt_row, first - RATE, j0, lo, stride_row, STATE_AT, STATE_AT + WIDTH, bias_ptr, 0,
                        stride_bias, offs_i, i_mask, m_e, m_o, l_e, l_o, a_e, a_o, RATE, PAGE, BLOCK_M)
                    j0 += BLOCK_M
            else:
                for j0 in range(0, RATE, BLOCK_M):
                    m_e, m_o, l_e, l_o, a_e, a_o = _pool_step(
                        rows_ptr, bt_row, first - RATE, j0, lo, stride_row, STATE_AT, STATE_AT + WIDTH, bias_ptr, 0,
                        stride_bias, offs_i, i_mask, m_e, m_o, l_e, l_o, a_e, a_o, RATE, PAGE, BLOCK_M)
        if WHILE_LOOP:
            j0 = 0
            while j0 < RATE:
                m_e, m_o, l_e, l_o, a_e, a_o = _pool_step(
                    rows_ptr, bt_row, first, j0, 0, stride_row, STATE_AT + OWN_AT, STATE_AT + WIDTH + OWN_AT, bias_ptr,
                    OWN_AT, stride_bias, offs_i, i_mask, m_e, m_o, l_e, l_o, a_e, a_o, RATE, PAGE, BLOCK_M)
                j0 += BLOCK_M
        else:
            for j0 in range(0, RATE, BLOCK_M):
                m_e, m_o, l_e, l_o, a_e, a_o = _pool_step(
                    rows_ptr, bt_row, first, j0, 0, stride_row, STATE_AT + OWN_AT, STATE_AT + WIDTH + OWN_AT, bias_ptr,
                    OWN_AT, stride_bias, offs_i, i_mask, m_e, m_o, l_e, l_o, a_e, a_o, RATE, PAGE, BLOCK_M)
        x_e = tl.where(i_mask, a_e / tl.where(i_mask, l_e, 1.0), 0.0)
        x_o = tl.where(i_mask, a_o / tl.where(i_mask, l_o, 1.0), 0.0)
        r = 1.0 / tl.sqrt((tl.sum(x_e * x_e, 0) + tl.sum(x_o * x_o, 0)) / DIM + eps)
        even = 2 * offs_i
        x_e = x_e * r * tl.load(norm_ptr + even, mask=i_mask, other=0.0).to(tl.float32)
        x_o = x_o * r * tl.load(norm_ptr + even + 1, mask=i_mask, other=0.0).to(tl.float32)
        # the trailing ROPE_PAIRS pairs rotate at the group's first position (transformers' compressor)
        f = offs_i - (DIM // 2 - ROPE_PAIRS)
        rot = (f >= 0) & i_mask
        angle = first.to(tl.float32) * tl.load(inv_freq_ptr + f, mask=rot, other=0.0)
        cos = tl.where(rot, tl.cos(angle), 1.0)
        sin = tl.where(rot, tl.sin(angle), 0.0)
        y_e = x_e * cos - x_o * sin
        y_o = x_o * cos + x_e * sin
        out = rows_ptr + tl.load(slot_ptr + t).to(tl.int64) * stride_row + ENTRY_AT + even
        tl.store(out, y_e.to(rows_ptr.dtype.element_ty), mask=i_mask)
        tl.store(out + 1, y_o.to(rows_ptr.dtype.element_ty), mask=i_mask)


def compress_groups(rows: torch.Tensor, branch, block_tables: torch.Tensor, row_seq: torch.Tensor,
                    positions: torch.Tensor, slot_mapping: torch.Tensor, rate: int, bias: torch.Tensor,
                    norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor, block_size: int) -> None:  # fmt: skip
    """kernels/v4_reference.compress_groups: ``rows [slots, width]`` contiguous, ``branch`` a CompressorBranch,
    ``bias [rate, series * dim]`` (fp32), ``inv_freq`` fp32 on the rows' device."""
    t = positions.shape[0]
    d = branch.dim
    if rows.stride(-1) != 1 or bias.stride(-1) != 1 or not norm_weight.is_contiguous():
        raise ValueError("compress_groups needs the last dim of rows and bias, and the norm weight, contiguous")
    if d % 2 or 2 * inv_freq.shape[0] > d:
        raise ValueError(f"entry dim {d} with {2 * inv_freq.shape[0]} rotated dims: need an even dim holding them")
    series = 2 if branch.overlap else 1
    if tuple(bias.shape) != (rate, series * d) or branch.width != series * d:
        raise ValueError(f"position bias {tuple(bias.shape)} and state width {branch.width} for rate {rate}, dim {d}: "
                         f"expected ({rate}, {series * d}) and {series * d}")  # fmt: skip
    if t == 0:
        return
    _v4_compress_kernel[(t,)](
        rows, block_tables, row_seq, positions, slot_mapping, bias, norm_weight, inv_freq.float().contiguous(),
        float(eps), rows.stride(0), block_tables.stride(0), bias.stride(0),
        RATE=rate, STATE_AT=branch.state_at, WIDTH=branch.width, ENTRY_AT=branch.entry_at, DIM=d,
        # the group's own series: the second halves (Cb) of each token's kv and gate in CSA, the only one in HCA
        ROPE_PAIRS=inv_freq.shape[0], OVERLAP=branch.overlap, OWN_AT=d if branch.overlap else 0, PAGE=block_size,
        BLOCK_I=max(16, triton.next_power_of_2(d // 2)), BLOCK_M=min(BLOCK_M, triton.next_power_of_2(rate)),
        WHILE_LOOP=interpreting(), num_warps=4,
    )  # fmt: skip
