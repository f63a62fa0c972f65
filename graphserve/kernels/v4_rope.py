"""DeepSeek-V4's interleaved partial rope (and the query's unweighted per-head RMS) as one Triton launch.

kernels/v4_reference.rope_trailing rotates the trailing ``2 * len(inv_freq)`` dims of each head as interleaved
pairs; in PyTorch that is about a dozen launches (the angles, cos, sin, the sign, two strided halves, four products,
a stack and a cat), and a V4 layer rotates three to four tensors a step (the query, the latent, the output rotated
back, CSA's indexer query), plus five more launches for the query's RMS. Here one program reads one head's row
once, optionally scales it by ``rsqrt(mean(x²) + eps)`` (rounded to the row's dtype first, as the reference
multiplies), and writes the row with its rope pairs rotated at the row's position: angles, cos and sin in fp32 in
registers, as kernels/v4_compress.py rotates the compressed entries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.v4_reference import rope_trailing


@triton.jit
def _v4_rope_kernel(x_ptr, out_ptr, pos_ptr, inv_freq_ptr, stride_xt, stride_xh, stride_ot, stride_oh, eps, sign,
                    D: tl.constexpr, PAIRS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
                    NORM: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    src = x_ptr + t * stride_xt + h * stride_xh
    dst = out_ptr + t * stride_ot + h * stride_oh
    dtype = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_D)
    in_row = cols < D
    x = tl.load(src + cols, mask=in_row, other=0.0).to(tl.float32)
    r = 1.0
    if NORM:
        # the reference rounds the factor, then the product, to the row's dtype
        r = (1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)).to(dtype).to(tl.float32)
    head = D - 2 * PAIRS
    tl.store(dst + cols, (x * r).to(dtype), mask=cols < head)
    j = tl.arange(0, BLOCK_P)
    ok = j < PAIRS
    even = head + 2 * j
    x_e = (tl.load(src + even, mask=ok, other=0.0).to(tl.float32) * r).to(dtype).to(tl.float32)
    x_o = (tl.load(src + even + 1, mask=ok, other=0.0).to(tl.float32) * r).to(dtype).to(tl.float32)
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + j, mask=ok, other=0.0)
    cos = tl.cos(angle)
    sin = sign * tl.sin(angle)
    tl.store(dst + even, (x_e * cos - x_o * sin).to(dtype), mask=ok)
    tl.store(dst + even + 1, (x_o * cos + x_e * sin).to(dtype), mask=ok)


def v4_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, sign: float = 1.0,
            norm_eps: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``rope_trailing(x, positions, inv_freq, sign)`` for ``x [T, D]`` or ``[T, heads, D]`` (last dim contiguous),
    each head first scaled by its unweighted RMS where ``norm_eps`` is given (the V4 query's
    ``x * rsqrt(mean(x²) + eps)``). ``out`` may be ``x`` itself (each program reads its row before writing it)."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"v4_rope: x must be [T, D] or [T, heads, D] with its last dim contiguous, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    pairs = inv_freq.shape[0]
    d = x.shape[-1]
    if 2 * pairs > d or inv_freq.dtype != torch.float32:
        raise ValueError(f"v4_rope: inv_freq {tuple(inv_freq.shape)} {inv_freq.dtype} must be fp32 with at most "
                         f"{d // 2} pairs")
    if positions.shape != (x.shape[0],):
        raise ValueError(f"v4_rope: positions {tuple(positions.shape)} must be [{x.shape[0]}]")
    out = torch.empty_like(x) if out is None else out
    if out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"v4_rope: out {tuple(out.shape)} must match x {tuple(x.shape)}, last dim contiguous")
    if x.shape[0] == 0:
        return out
    x3 = x if x.dim() == 3 else x[:, None]
    o3 = out if out.dim() == 3 else out[:, None]
    _v4_rope_kernel[(x3.shape[0], x3.shape[1])](
        x3, o3, positions, inv_freq, x3.stride(0), x3.stride(1), o3.stride(0), o3.stride(1),
        float(norm_eps or 0.0), float(sign), D=d, PAIRS=pairs, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_P=triton.next_power_of_2(pairs), NORM=norm_eps is not None, num_warps=4 if d >= 512 else 2,
    )  # fmt: skip
    return out


def v4_rope_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, sign: float = 1.0,
                      norm_eps: float | None = None) -> torch.Tensor:  # fmt: skip
    """What ``v4_rope`` computes, in PyTorch (models/deepseek_v4_attention.py's reference path)."""
    if norm_eps is not None:
        x = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + norm_eps).to(x.dtype)
    return rope_trailing(x, positions, inv_freq, sign)
