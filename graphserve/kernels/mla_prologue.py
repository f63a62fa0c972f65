"""MLA's prologue in one launch: kv-a RMSNorm, rotary on the rope key and on every head's rope query,
and the latent + rope key written into the paged cache.

Unfused it is five launches per layer (norm, two rotaries with their de-interleave copies, the
cache write), which at decode batch sizes take longer than their few kilobytes of work. One
program per token: it reads the token's ``kv_a`` row (latent then rope key), writes
``cache[slot] = [rms_norm(latent) * w, rope(k_rope)]`` and rotates ``q[t, :, nope:]`` in place.
Rotated dims come out in the rotate-half layout whatever the input layout (layers/mla_rope.py).

Both cached parts are rounded to the model dtype (``kv_a``'s) as the PyTorch path computes them, then to
the cache's: a no-op for a cache in the model dtype; for an fp8 cache (scale 1.0) clamped to +-448 first,
as the PyTorch write saturates (layers/kv_layout.py), where Triton's interpreter would give NaN or wrap.

The PyTorch reference is made of the CPU backend's own steps, kept here beside the kernel: ``rotate`` (the rope
rotation, layers/mla_rope.py and the DSA indexer use it too) and ``write_latent_cache``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.kv_write import cache_value
from graphserve.kernels.paged_kv import to_cache_dtype
from graphserve.kernels.pdl import pdl_args, pdl_enter


@triton.jit
def _rope_pairs(ptr, offs, INTERLEAVED: tl.constexpr, HALF: tl.constexpr, mask):
    if INTERLEAVED:
        x1 = tl.load(ptr + 2 * offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + 2 * offs + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _to_cache(y, kv_a_ptr, cache_ptr):
    """fp32 ``y`` rounded to the model dtype (``kv_a``'s), then stored as the cache stores it (kv_write.cache_value:
    an fp8 cache's values clamped first)."""
    return cache_value(y.to(kv_a_ptr.dtype.element_ty), cache_ptr)


@triton.jit
def _mla_prologue_kernel(
    q_ptr, kv_a_ptr, positions_ptr, cos_sin_ptr, norm_w_ptr, cache_ptr, slots_ptr,
    eps, num_heads,
    stride_qt, stride_qh, stride_kvt, stride_cs, stride_cache_slot,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    dst = cache_ptr + slot * stride_cache_slot

    # latent: RMS-normed in fp32, cast to the model dtype, then scaled by the weight (transformers' order)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < RANK
    x = tl.load(kv_a_ptr + t * stride_kvt + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / RANK + eps)
    w = tl.load(norm_w_ptr + offs_r, mask=r_mask, other=0.0)
    y = (x * rstd).to(kv_a_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(dst + offs_r, _to_cache(y, kv_a_ptr, cache_ptr), mask=r_mask)

    offs_i = tl.arange(0, BLOCK_HALF)
    i_mask = offs_i < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_i, mask=i_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_i, mask=i_mask, other=0.0)
    k1, k2 = _rope_pairs(kv_a_ptr + t * stride_kvt + RANK, offs_i, INTERLEAVED, HALF, i_mask)
    k_out1 = _to_cache(k1 * cos - k2 * sin, kv_a_ptr, cache_ptr)
    k_out2 = _to_cache(k2 * cos + k1 * sin, kv_a_ptr, cache_ptr)
    tl.store(dst + RANK + offs_i, k_out1, mask=i_mask)
    tl.store(dst + RANK + HALF + offs_i, k_out2, mask=i_mask)

    # every head's rope query, in place (each program owns its token's heads)
    offs_h = tl.arange(0, BLOCK_H)
    hm = (offs_h < num_heads)[:, None] & i_mask[None, :]
    q_rope = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + NOPE
    if INTERLEAVED:
        q1 = tl.load(q_rope + 2 * offs_i[None, :], mask=hm, other=0.0).to(tl.float32)
        q2 = tl.load(q_rope + 2 * offs_i[None, :] + 1, mask=hm, other=0.0).to(tl.float32)
    else:
        q1 = tl.load(q_rope + offs_i[None, :], mask=hm, other=0.0).to(tl.float32)
        q2 = tl.load(q_rope + HALF + offs_i[None, :], mask=hm, other=0.0).to(tl.float32)
    # the rotated halves overwrite the pairs just read: every warp must have loaded before any stores
    tl.debug_barrier()
    out1 = q1 * cos[None, :] - q2 * sin[None, :]
    out2 = q2 * cos[None, :] + q1 * sin[None, :]
    tl.store(q_rope + offs_i[None, :], out1.to(q_ptr.dtype.element_ty), mask=hm)
    tl.store(q_rope + HALF + offs_i[None, :], out2.to(q_ptr.dtype.element_ty), mask=hm)


def mla_prologue(
    q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    norm_weight: torch.Tensor, eps: float, cache: torch.Tensor, slot_mapping: torch.Tensor, nope: int,
    interleaved: bool,
) -> None:  # fmt: skip
    """``q [T, H, nope + d]`` (rope part rotated in place), ``kv_a [T, r + d]`` (strided rows allowed),
    ``cos_sin_cache [max_positions, d]`` float32, ``cache [num_blocks, page, 1, r + d]`` in kv_a's dtype or
    float8_e4m3fn."""
    tokens, num_heads, qk = q.shape
    rope = qk - nope
    rank = kv_a.shape[1] - rope
    if cache.shape[-1] != rank + rope or cache.shape[2] != 1 or not cache.is_contiguous():
        raise ValueError(f"cache must be contiguous [blocks, page, 1, {rank + rope}], got {tuple(cache.shape)}")
    if q.stride(2) != 1 or kv_a.stride(1) != 1:
        raise ValueError(f"mla_prologue needs the last dim of q and kv_a contiguous (stride 1), got {q.stride(2)}, "
                         f"{kv_a.stride(1)}")
    if rope % 2:
        raise ValueError(f"mla_prologue: rope dim = q's {qk} - nope {nope} = {rope} must be even (rotated in pairs)")
    if tokens == 0:
        return
    _mla_prologue_kernel[(tokens,)](
        q, kv_a, positions, cos_sin_cache, norm_weight, cache, slot_mapping,
        eps, num_heads,
        q.stride(0), q.stride(1), kv_a.stride(0), cos_sin_cache.stride(0), cache.shape[-1],
        RANK=rank, BLOCK_R=triton.next_power_of_2(rank), NOPE=nope, HALF=rope // 2,
        BLOCK_HALF=triton.next_power_of_2(rope // 2), BLOCK_H=triton.next_power_of_2(num_heads),
        INTERLEAVED=interleaved, num_warps=4, **pdl_args(q.device, "_mla_prologue_kernel"),
    )  # fmt: skip


def rotate(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate ``x [T, n, D]`` by ``positions [T]`` (PyTorch, float32 math); returns the rotate-half layout.

    ``cos_sin_cache`` ``[max_positions, D]``: cos of the D/2 angles then their sin, attention factor included.
    """
    half = x.shape[-1] // 2
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf[..., :half], xf[..., half:]
    cs = cos_sin_cache.index_select(0, positions)
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def write_latent_cache(latent: torch.Tensor, k_rope: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Store ``latent [T, r]`` and ``k_rope [T, d]`` at flat ``slots [T]`` of ``cache [blocks, page, 1, r + d]``."""
    flat = cache.view(-1, cache.shape[-1])
    rows = to_cache_dtype(torch.cat((latent, k_rope), dim=-1), cache.dtype)  # fp8: scale 1.0, saturating
    if cache.dtype.itemsize == 1:
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slots, rows)


def mla_prologue_reference(
    q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    norm_weight: torch.Tensor, eps: float, cache: torch.Tensor, slot_mapping: torch.Tensor, nope: int,
    interleaved: bool,
) -> None:  # fmt: skip
    """The same in PyTorch (the CPU backend's own steps), in place on ``q`` and ``cache``."""
    rope = q.shape[-1] - nope
    rank = kv_a.shape[1] - rope
    x = kv_a[:, :rank].float()
    latent = norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(kv_a.dtype)
    k_rope = rotate(kv_a[:, None, rank:], positions, cos_sin_cache, interleaved)[:, 0]
    q[..., nope:] = rotate(q[..., nope:], positions, cos_sin_cache, interleaved)
    write_latent_cache(latent, k_rope, cache, slot_mapping)
