"""The attention prologue in one launch: per-head q/k RMSNorm, rotary, and the K/V cache write.

It reads the fused qkv projection output once per token and writes q (contiguous, for attention)
plus the step's K and V into the paged cache. Unfused, the same work is four launches per layer
(q norm, k norm, rotary, KV write: ~5 us of kernels plus ~2 us of gaps, measured on an H200 for
Qwen3-0.6B at batch 1, whose 28 layers make ~0.2 ms of a 1.48 ms decode step).
Rounding follows the unfused kernels step by step, so the two paths agree: RMSNorm in fp32,
rounded to the input dtype, times the weight, rounded (kernels/norm.py); then rotary in fp32 on
those rounded values, rounded (kernels/rotary.py); then the cast to the cache dtype
(kernels/kv_write.py). Every size is static, so it captures in a CUDA graph, and padding rows
(slot 0, the dummy block) are written like any other row. Each token gets two programs, one for
its q heads and one for its k and v, so at batch 1, where the kernel is one token's work, the two
halves run side by side.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.kv_write import cache_value, check_cache, kv_write_reference
from graphserve.kernels.norm import rms_norm_reference
from graphserve.kernels.pdl import pdl_args, pdl_enter
from graphserve.kernels.rotary import apply_rotary_reference


@triton.jit
def _norm_rope_heads(
    x_ptr, w_ptr, num_heads, cos, sin, offs_half, eps,
    HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Load ``num_heads`` consecutive heads at ``x_ptr``; return their two rotated halves in fp32."""
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < num_heads)[:, None] & (offs_half < HALF)[None, :]
    p1 = x_ptr + offs_h[:, None] * HEAD_DIM + offs_half[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        dtype = x_ptr.dtype.element_ty
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)
        half_mask = offs_half < HALF
        w1 = tl.load(w_ptr + offs_half, mask=half_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_half, mask=half_mask, other=0.0).to(tl.float32)[None, :]
        # two roundings, as the unfused norm does: the normalised value, then its product with the weight
        x1 = ((x1 * rstd[:, None]).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd[:, None]).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin, offs_h, mask


@triton.jit
def _qk_norm_rope_kv_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_out_ptr, cache_ptr, slot_ptr,
    stride_qkv, stride_cos, stride_sin, stride_kv, stride_slot,
    num_q_heads, num_kv_heads, eps,
    HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_KV: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_half = tl.arange(0, BLOCK_HALF)
    half_mask = offs_half < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + offs_half, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sin + offs_half, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    row = qkv_ptr + t * stride_qkv

    if tl.program_id(1) == 0:  # the token's q heads
        q1, q2, offs_h, mask = _norm_rope_heads(
            row, qw_ptr, num_q_heads, cos, sin, offs_half, eps, HAS_NORM, HEAD_DIM, HALF, BLOCK_HQ
        )
        dst = q_out_ptr + t * num_q_heads * HEAD_DIM + offs_h[:, None] * HEAD_DIM + offs_half[None, :]
        tl.store(dst, q1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:  # its k and v heads, into the cache
        _k_v_to_cache(row, kw_ptr, cache_ptr, slot, stride_kv, stride_slot, num_q_heads, num_kv_heads, cos, sin,
                      offs_half, eps, HAS_NORM, HEAD_DIM, HALF, BLOCK_HK, BLOCK_KV)


@triton.jit
def _k_v_to_cache(
    row, kw_ptr, cache_ptr, slot, stride_kv, stride_slot, num_q_heads, num_kv_heads, cos, sin, offs_half, eps,
    HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_KV: tl.constexpr,
):  # fmt: skip
    dtype = row.dtype.element_ty
    kv_elems = num_kv_heads * HEAD_DIM
    k_row = row + num_q_heads * HEAD_DIM
    k1, k2, offs_h, mask = _norm_rope_heads(
        k_row, kw_ptr, num_kv_heads, cos, sin, offs_half, eps, HAS_NORM, HEAD_DIM, HALF, BLOCK_HK
    )
    # rounded to the input dtype first (what the unfused rotary stores), then to the cache's dtype;
    # a slot's (head, dim) are contiguous in the cache, as in the qkv row
    dst = cache_ptr + slot * stride_slot + offs_h[:, None] * HEAD_DIM + offs_half[None, :]
    tl.store(dst, cache_value(k1.to(dtype), cache_ptr), mask=mask)
    tl.store(dst + HALF, cache_value(k2.to(dtype), cache_ptr), mask=mask)

    offs_v = tl.arange(0, BLOCK_KV)
    v_mask = offs_v < kv_elems
    v = tl.load(k_row + kv_elems + offs_v, mask=v_mask)
    tl.store(cache_ptr + stride_kv + slot * stride_slot + offs_v, cache_value(v, cache_ptr), mask=v_mask)


def qk_norm_rope_kv_write(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return q ``[T, num_heads, head_dim]`` (normed if weights are given, rotated) from ``qkv``.

    ``qkv`` is ``[T, (num_heads + 2 * num_kv_heads) * head_dim]`` (rows may be strided), ``positions``
    and ``slot_mapping`` are ``[T]`` ints, ``cos``/``sin`` the fp32 caches ``[max_position, head_dim / 2]``
    and ``kv_cache`` ``[2, num_blocks, block_size, num_kv_heads, head_dim]``. The normed, rotated K and
    the raw V are written at ``slot_mapping``. ``q_out`` may be preallocated (contiguous).
    """
    check_qkv_args(qkv, cos, sin, num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight)
    check_cache(kv_cache, num_kv_heads, head_dim)
    num_tokens = qkv.shape[0]
    if q_out is None:
        q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    elif q_out.shape != (num_tokens, num_heads, head_dim) or not q_out.is_contiguous():
        raise ValueError(
            f"q_out must be a contiguous [{num_tokens}, {num_heads}, {head_dim}] tensor, got shape "
            f"{tuple(q_out.shape)} strides {q_out.stride()}"
        )
    if num_tokens == 0:
        return q_out
    has_norm = q_norm_weight is not None
    half = head_dim // 2
    _qk_norm_rope_kv_kernel[(num_tokens, 2)](
        qkv, positions, cos, sin,
        q_norm_weight if has_norm else qkv, k_norm_weight if has_norm else qkv,  # placeholders without norms
        q_out, kv_cache, slot_mapping,
        qkv.stride(0), cos.stride(0), sin.stride(0), kv_cache.stride(0), kv_cache.stride(2),
        num_heads, num_kv_heads, eps,
        HAS_NORM=has_norm, HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads * head_dim),
        num_warps=4, **pdl_args(qkv.device, "_qk_norm_rope_kv_kernel"),
    )  # fmt: skip
    return q_out


def check_qkv_args(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
) -> None:
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be [T, {width}] = [T, ({num_heads} + 2 * {num_kv_heads}) * {head_dim}] with unit column "
            f"stride, got shape {tuple(qkv.shape)} strides {qkv.stride()}"
        )
    # a partial rotary (cache narrower than head_dim / 2) would leave the tail unrotated here: refuse it
    if head_dim % 2 or cos.shape != sin.shape or cos.dim() != 2 or 2 * cos.shape[1] != head_dim:
        raise ValueError(
            f"rotary cache cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be [max_position, {head_dim // 2}] "
            f"for head_dim {head_dim}: the fused prologue rotates whole heads only"
        )
    if cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError(f"rotary cos/sin need a contiguous last dim, got strides {cos.stride()} {sin.stride()}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight must be given together (per-head q/k RMSNorm)")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None and (w.shape != (head_dim,) or not w.is_contiguous()):
            raise ValueError(f"{name} shape {tuple(w.shape)} must be a contiguous [{head_dim}] (head_dim)")


def qk_norm_rope_kv_write_reference(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Plain PyTorch, composed from the unfused references: split, norm, rotate, write; returns q."""
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(t, num_heads, head_dim)
    k = k.reshape(t, num_kv_heads, head_dim)
    v = v.reshape(t, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q, k = rms_norm_reference(q, q_norm_weight, eps), rms_norm_reference(k, k_norm_weight, eps)
    q, k = apply_rotary_reference(q, k, positions, cos, sin)
    kv_write_reference(k, v, kv_cache, slot_mapping)
    return q.contiguous()
