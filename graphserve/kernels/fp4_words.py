"""The streaming FP4 matmul's word widenings (``Fp4StreamConfig.widen``, ``fp4_fused_experts(widen=)``): one K step
of kernels/fp4_gemv.py's main loop, and of the experts' streaming kernels, with the packed weight read as int32
words, eight nibbles a word, widened by ``fp4_layout.widen8``:

- "word": four mask-and-shift passes a word, each placing two nibbles as the two fp16 halves of a 32-bit value (the
  fp16 placement, unit 2^-14), where the byte widening takes two passes a byte;
- "e4m3": the e4m3 placement on a word's four bytes at once (low nibbles, then high), each byte converted to fp16
  (``cvt.rn.f16x2.e4m3x2`` on sm_89+; unit 2^-6);
- "e4m3_ptx": the same values by inline PTX, without the byte extraction (CUDA sm_89+ only; its twin is "e4m3").

Against the byte widening (the default, in fp4_gemv.py), which the H100 showed bound by the widening's integer and
conversion work rather than by memory (benchmarks/results/fp4_kernels.json: 0.85-1.18 TB/s at one row):
- x is loaded once per step as [.., words, 8] contiguous columns and taken apart in registers (``split8``) instead
  of as even and odd columns in two strided loads;
- FMA path (up to fp4_gemv.FMA_MAX_ROWS rows): the tile is [BLOCK_N, groups, words a group] of words, each group's
  partial dot in fp32 times its scale once;
- dot path: a 2-D [BLOCK_N, words] tile (no per-group 3-D tile and no reshape before the dot), each word's group
  scale loaded beside it (repeated addresses, served by L1), and the eight values of a word as eight dots of
  K = words against x's matching columns: the dot's sum over K does not depend on the order of K.
Compiled for sm_90 (benchmarks/fp4_sass.py, results/fp4_sass.json) they take up to 38% fewer SASS instructions and
25-74% fewer integer ones than the byte widening ("e4m3_ptx" fewest); their times on the GPU come from
``python3 -m benchmarks.fp4_variants``. The numbers are the byte widening's: the same exact values, the same
scales, fp32 accumulation (the order of the additions differs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.fp4_layout import block_scale, split8, widen8
from graphserve.kernels.gemv import _x_tile


@triton.jit
def word_fma_step(
    acc, x_ptr, res_ptr, nw_ptr, w_ptr, s_ptr, w_rows, offs_m, rstd, M, k0, stride_xm, stride_rm, stride_wn,
    stride_sn, K: tl.constexpr, GROUP_K: tl.constexpr, MX: tl.constexpr, SILU_MUL: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, WIDEN: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """acc [BLOCK_N, BLOCK_M] plus one K step from column ``k0`` of up to BLOCK_M rows, on the CUDA cores."""
    KB: tl.constexpr = BLOCK_K // GROUP_K  # scale groups a step
    WPG: tl.constexpr = GROUP_K // 8  # words a group: 2 (NVFP4), 4 (MXFP4)
    offs_g = tl.arange(0, KB)
    word = offs_g[:, None] * WPG + tl.arange(0, WPG)[None, :]  # [KB, WPG] words within the step
    groups = k0 // GROUP_K + offs_g
    g_mask = groups < K // GROUP_K  # K is whole groups: a tail is masked by group
    w_ptrs = w_ptr + w_rows[:, None, None] * stride_wn + (k0 // 8 + word)[None, :, :]
    s_ptrs = s_ptr + w_rows[:, None] * stride_sn + groups[None, :]
    if EVEN_K:
        w = tl.load(w_ptrs)
        s = tl.load(s_ptrs)
    else:
        w = tl.load(w_ptrs, mask=g_mask[None, :, None], other=0)
        s = tl.load(s_ptrs, mask=g_mask[None, :], other=0)
    sf = block_scale(s, MX, UNIT)  # [BLOCK_N, KB], the widening's unit folded in
    v0, v1, v2, v3, v4, v5, v6, v7 = widen8(w, WIDEN)
    f0, f1, f2, f3 = v0.to(tl.float32), v1.to(tl.float32), v2.to(tl.float32), v3.to(tl.float32)
    f4, f5, f6, f7 = v4.to(tl.float32), v5.to(tl.float32), v6.to(tl.float32), v7.to(tl.float32)
    offs_e = tl.arange(0, 8)
    cols = k0 + 8 * word[:, :, None] + offs_e[None, None, :]  # [KB, WPG, 8] each word's eight columns
    x_mask = g_mask[:, None, None] & (offs_e[None, None, :] < 8)
    for m in tl.static_range(BLOCK_M):
        rstd_m = tl.sum(tl.where(offs_m == m, rstd, 0.0), axis=0)
        xm = _x_tile(x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, m, cols, x_mask & (m < M), rstd_m, K, SILU_MUL,
                     ADD_RESIDUAL, NORM, x_ptr.dtype.element_ty).to(tl.float32)  # fmt: skip
        x0, x1, x2, x3, x4, x5, x6, x7 = split8(xm, KB, WPG)
        p = f0 * x0[None, :, :] + f4 * x4[None, :, :] + f1 * x1[None, :, :] + f5 * x5[None, :, :]
        p += f2 * x2[None, :, :] + f6 * x6[None, :, :] + f3 * x3[None, :, :] + f7 * x7[None, :, :]
        part = tl.sum(tl.sum(p, axis=2) * sf, axis=1)
        acc += tl.where(offs_m[None, :] == m, part[:, None], 0.0)
    return acc


@triton.jit
def _scaled(v, sf, DT: tl.constexpr):
    """Widened values times their group's scale, in the dot's dtype (exact: fp4_layout)."""
    return (v.to(tl.float32) * sf).to(DT)


@triton.jit
def word_dot_step(
    acc, x_ptr, res_ptr, nw_ptr, w_ptr, s_ptr, w_rows, offs_m, rstd, M, k0, stride_xm, stride_rm, stride_wn,
    stride_sn, K: tl.constexpr, GROUP_K: tl.constexpr, MX: tl.constexpr, SILU_MUL: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, WIDEN: tl.constexpr, UNIT: tl.constexpr,
):  # fmt: skip
    """acc [BLOCK_N, BLOCK_M] plus one K step from column ``k0`` on the tensor cores (x's dtype, fp32 sums)."""
    W: tl.constexpr = BLOCK_K // 8  # words a step
    WPG: tl.constexpr = GROUP_K // 8
    DT: tl.constexpr = x_ptr.dtype.element_ty
    words = k0 // 8 + tl.arange(0, W)
    w_mask = words < K // 8
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + words[None, :]
    s_ptrs = s_ptr + w_rows[:, None] * stride_sn + (words // WPG)[None, :]  # each word's group scale
    if EVEN_K:
        w = tl.load(w_ptrs)
        s = tl.load(s_ptrs)
    else:
        w = tl.load(w_ptrs, mask=w_mask[None, :], other=0)
        s = tl.load(s_ptrs, mask=w_mask[None, :], other=0)
    sf = block_scale(s, MX, UNIT)  # [BLOCK_N, W]
    offs_e = tl.arange(0, 8)
    cols = 8 * words[None, :, None] + offs_e[None, None, :]  # [1, W, 8]
    x_mask = (offs_m[:, None, None] < M) & w_mask[None, :, None] & (offs_e[None, None, :] < 8)
    xm = _x_tile(x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, offs_m[:, None, None], cols, x_mask,
                 rstd[:, None, None], K, SILU_MUL, ADD_RESIDUAL, NORM, DT)  # fmt: skip
    x0, x1, x2, x3, x4, x5, x6, x7 = split8(xm, BLOCK_M, W)
    v0, v1, v2, v3, v4, v5, v6, v7 = widen8(w, WIDEN)
    acc = tl.dot(_scaled(v0, sf, DT), tl.trans(x0), acc)
    acc = tl.dot(_scaled(v4, sf, DT), tl.trans(x4), acc)
    acc = tl.dot(_scaled(v1, sf, DT), tl.trans(x1), acc)
    acc = tl.dot(_scaled(v5, sf, DT), tl.trans(x5), acc)
    acc = tl.dot(_scaled(v2, sf, DT), tl.trans(x2), acc)
    acc = tl.dot(_scaled(v6, sf, DT), tl.trans(x6), acc)
    acc = tl.dot(_scaled(v3, sf, DT), tl.trans(x3), acc)
    acc = tl.dot(_scaled(v7, sf, DT), tl.trans(x7), acc)
    return acc


def words_of(packed: torch.Tensor, name: str) -> torch.Tensor:
    """The packed weight [.., N, K/2] uint8 as int32 words [.., N, K/8] (the same memory); ValueError naming the
    tensor where its rows do not start on 4-byte boundaries."""
    if packed.storage_offset() % 4 or packed.shape[-1] % 4:
        raise ValueError(f"{name}: widen='word' reads the packed weight as int32 words: its storage offset "
                         f"({packed.storage_offset()}) and row length ({packed.shape[-1]} bytes) must be multiples of 4")
    return packed.view(torch.int32)


@triton.jit
def word_row_sums(w_rows, s_ptrs, x_row, k0, ok, K: tl.constexpr, GROUP_K: tl.constexpr, MX: tl.constexpr,
                  BLOCK_K: tl.constexpr, WIDEN: tl.constexpr, UNIT: tl.constexpr):  # fmt: skip
    """One K step's [BLOCK_N] sums of FP4 rows against one x row, for the routed experts' streaming kernels
    (kernels/fp4_moe.py): ``w_rows`` [BLOCK_N] pointers to each row's int32 words, ``s_ptrs`` [BLOCK_N, groups a
    step] to its scales at column 0, ``x_row`` to the x row; ``ok`` False reads nothing."""
    KB: tl.constexpr = BLOCK_K // GROUP_K
    WPG: tl.constexpr = GROUP_K // 8
    offs_g = tl.arange(0, KB)
    word = offs_g[:, None] * WPG + tl.arange(0, WPG)[None, :]
    g_mask = (k0 // GROUP_K + offs_g) < K // GROUP_K
    w = tl.load(w_rows[:, None, None] + (k0 // 8 + word)[None, :, :], mask=g_mask[None, :, None] & ok, other=0)
    s = tl.load(s_ptrs + k0 // GROUP_K, mask=g_mask[None, :] & ok, other=0)
    offs_e = tl.arange(0, 8)
    cols = k0 + 8 * word[:, :, None] + offs_e[None, None, :]
    xm = tl.load(x_row + cols, mask=g_mask[:, None, None] & (offs_e[None, None, :] < 8) & ok, other=0.0)
    x0, x1, x2, x3, x4, x5, x6, x7 = split8(xm.to(tl.float32), KB, WPG)
    v0, v1, v2, v3, v4, v5, v6, v7 = widen8(w, WIDEN)
    p = v0.to(tl.float32) * x0[None, :, :] + v4.to(tl.float32) * x4[None, :, :]
    p += v1.to(tl.float32) * x1[None, :, :] + v5.to(tl.float32) * x5[None, :, :]
    p += v2.to(tl.float32) * x2[None, :, :] + v6.to(tl.float32) * x6[None, :, :]
    p += v3.to(tl.float32) * x3[None, :, :] + v7.to(tl.float32) * x7[None, :, :]
    return tl.sum(tl.sum(p, axis=2) * block_scale(s, MX, UNIT), axis=1)
