"""A streaming read of a whole buffer: the bandwidth probe behind the benchmarks' floors.

A decode step is a read of weights and KV, so its floor is bytes / the best read rate this card
shows. ``torch.sum`` is one way to read a buffer, but the decode-attention kernel read faster
than it (ratios 0.94-0.98 "of the floor"), so a floor built on it alone can be beaten. This kernel
reads with the widest loads Triton emits (each thread owns ``BLOCK / (32 * num_warps)``
contiguous elements: 16-32 bytes in bf16), from the grid the caller picks (a persistent one of a few programs
per SM that stride over the buffer, or one program a block, each a single pass: benchmarks/roofline.py tries
both), and reduces in fp32 so the compiler cannot drop a load. Each program
writes one partial sum; their total equals the buffer's sum, which is what its test checks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _stream_read_kernel(x_ptr, partial_ptr, n, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    # the trip count is a compile-time constant (the same for every program; the last pass is
    # masked): one compile per buffer size, which a probe that reads one size many times can afford
    for _ in range(ITERS):
        # evict_first: each byte is read once, so it should not push anything useful out of L2
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
        offs += step
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


def stream_read(x: torch.Tensor, programs: int, block: int = 4096, num_warps: int = 8,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Read every element of contiguous ``x`` once; returns ``[programs]`` fp32 partial sums.

    ``programs`` is the grid (a few per SM keeps enough loads in flight); ``block`` elements are
    loaded per program and iteration. ``out`` reuses a partials buffer, so repeated calls allocate
    nothing (they may then be captured in a CUDA graph).
    """
    if not x.is_contiguous():
        raise ValueError(f"stream_read needs a contiguous buffer, got strides {x.stride()}")
    if programs < 1 or block < 1 or block & (block - 1):
        raise ValueError(f"stream_read needs programs >= 1 and a power-of-two block, got {programs}, {block}")
    if out is None:
        out = torch.empty(programs, dtype=torch.float32, device=x.device)
    elif out.shape != (programs,) or out.dtype != torch.float32:
        raise ValueError(f"out must be [{programs}] float32, got {list(out.shape)} {out.dtype}")
    iters = triton.cdiv(x.numel(), programs * block)
    _stream_read_kernel[(programs,)](x.view(-1), out, x.numel(), ITERS=iters, BLOCK=block, num_warps=num_warps)
    return out


def stream_read_reference(x: torch.Tensor) -> torch.Tensor:
    """What the partial sums add up to: the buffer's sum in fp32."""
    return x.float().sum()
