"""Store the step's new K and V into the paged KV cache (one launch writes both).

Cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, K at [0], V at [1];
token t goes to slot ``slot_mapping[t] = block_id * block_size + offset``. CUDA-graph padding rows
carry slot 0 (the dummy block), so they are written like any other row and never touch real KV.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.fp8_quant import FP8_MAX
from graphserve.kernels.paged_kv import to_cache_dtype
from graphserve.kernels.pdl import pdl_args, pdl_enter

E4M3_MAX: tl.constexpr = tl.constexpr(FP8_MAX)  # e4m3's largest finite value, 448


@triton.jit
def cache_value(x, cache_ptr):
    """``x`` as the cache at ``cache_ptr`` stores it: cast to its dtype, an fp8 one (scale 1.0) clamped to +-448
    first, so that it saturates as the PyTorch writes do (paged_kv.to_cache_dtype) whether compiled or
    interpreted (Triton's interpreter wraps out-of-range values)."""
    ty: tl.constexpr = cache_ptr.dtype.element_ty
    if ty.primitive_bitwidth == 8:
        x = tl.clamp(x.to(tl.float32), -E4M3_MAX, E4M3_MAX)
    return x.to(ty)


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kv,  # distance from the K half to the V half of the cache
    stride_slot,  # distance between consecutive slots (block_size * heads * dim for a contiguous cache)
    HEAD_DIM: tl.constexpr,
    NUM_ELEMS: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < NUM_ELEMS
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    k = tl.load(k_ptr + t * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + head * stride_vh + dim, mask=mask)
    # the cache's (head, dim) dims are contiguous, so a slot's row is NUM_ELEMS consecutive elements
    dst = cache_ptr + slot * stride_slot + offs
    tl.store(dst, cache_value(k, cache_ptr), mask=mask)
    tl.store(dst + stride_kv, cache_value(v, cache_ptr), mask=mask)


def kv_write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``k``, ``v`` ([T, num_kv_heads, head_dim]) into ``kv_cache`` at ``slot_mapping`` ([T] int64)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    check_cache(kv_cache, num_kv_heads, head_dim)
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"kv_write needs head_dim contiguous in k and v, got strides {k.stride()} {v.stride()}")
    if num_tokens == 0:
        return
    num_elems = num_kv_heads * head_dim
    _kv_write_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        HEAD_DIM=head_dim,
        NUM_ELEMS=num_elems,
        BLOCK=triton.next_power_of_2(num_elems),
        num_warps=4 if num_elems >= 1024 else 2, **pdl_args(k.device, "_kv_write_kernel"),
    )


def check_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not match "
            f"[2, num_blocks, block_size, {num_kv_heads}, {head_dim}]"
        )
    # slots are addressed as block * block_size + offset, which needs (block, offset, head, dim) packed
    if not kv_cache[0].is_contiguous():
        raise ValueError(f"kv_cache must be contiguous within each half, got strides {kv_cache.stride()}")


def kv_write_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Plain PyTorch: the same writes through index_copy_ on a flat slot view."""
    _, num_kv_heads, head_dim = k.shape
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    k, v = to_cache_dtype(k, kv_cache.dtype), to_cache_dtype(v, kv_cache.dtype)
    if kv_cache.dtype.itemsize == 1:  # index_copy_ has no fp8 kernel: move the bytes
        flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)
