"""Rotary position embedding applied in place to q and k ("rotate_half" / NeoX / HF Llama style).

For each head, the first ``rot_dim`` dims are split into halves x1, x2 and become
``(x1*cos - x2*sin, x2*cos + x1*sin)``; dims past ``rot_dim`` (partial rotary) are left alone.
``cos`` and ``sin`` are caches ``[max_position, rot_dim / 2]`` indexed by each token's position,
so the kernel needs no trigonometry and the same cache serves every layer.
One program per token rotates all of its q and k heads in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.pdl import pdl_args, pdl_enter


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, cos, sin, offs_half, half_mask, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr):  # fmt: skip
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < num_heads)[:, None] & half_mask[None, :]
    p1 = x_ptr + offs_h[:, None] * stride_h + offs_half[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_half = tl.arange(0, BLOCK_HALF)
    half_mask = offs_half < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + offs_half, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sin + offs_half, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, offs_half, half_mask, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, cos, sin, offs_half, half_mask, HALF, BLOCK_HK)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotate ``q`` ([T, Hq, D]) and ``k`` ([T, Hk, D]) in place at ``positions`` ([T] int)."""
    num_tokens = q.shape[0]
    half = cos.shape[-1]
    if cos.shape != sin.shape or 2 * half > q.shape[-1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"rotary cache cos {tuple(cos.shape)} / sin {tuple(sin.shape)} does not fit head_dim "
            f"q {q.shape[-1]}, k {k.shape[-1]} (need 2 * cache width <= head_dim)"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(
            f"apply_rotary needs the last dim contiguous (stride 1) in q, k, cos and sin, got {q.stride(-1)}, "
            f"{k.stride(-1)}, {cos.stride(-1)}, {sin.stride(-1)}"
        )
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        q.shape[1], k.shape[1],
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(q.shape[1]), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        num_warps=4, **pdl_args(q.device, "_rotary_kernel"),
    )  # fmt: skip


def rotary_cos_sin(
    max_position: int, rot_dim: int, base: float = 10000.0, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` caches ``[max_position, rot_dim / 2]`` for the default (unscaled) RoPE."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim))
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place, HF's ``x * cos + rotate_half(x) * sin`` on the first ``rot_dim`` dims, in fp32."""
    c = torch.cat([cos[positions], cos[positions]], dim=-1)[:, None, :].float()
    s = torch.cat([sin[positions], sin[positions]], dim=-1)[:, None, :].float()
    rot = c.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xr = x[..., :rot].float()
        x1, x2 = xr.chunk(2, dim=-1)
        turned = xr * c + torch.cat([-x2, x1], dim=-1) * s
        return torch.cat([turned.to(x.dtype), x[..., rot:]], dim=-1)

    return rotate(q), rotate(k)
