"""Small-batch FP8-weight matmul for decode: ``x @ dequant(w).T`` with x in bf16 and w streamed as fp8.

At 1-8 rows a projection is a weight stream; the W8A8 path would first quantize x (one more launch
and a round trip) for tensor-core work that is not the bottleneck. Here each program owns
``BLOCK_N`` weight rows for all M rows of x, reads its ``[BLOCK_N, K]`` fp8 slab once (one byte per
weight: half of bf16's traffic), widens each tile to x's dtype in registers (exact: every e4m3 value
is a bf16 value) and multiplies on the tensor cores with x padded to 16 rows as the second operand
("swap AB", as kernels/gemv.py does), accumulating in fp32. Block scales are applied per
``[BLOCK_N, BLOCK_K]`` step (``BLOCK_K`` = the scale block's K), per-channel scales once at the end.

Grid and tiles are a pure function of shapes (no autotuning: the kernel runs inside CUDA graphs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.common import sm_count
from graphserve.kernels.fp8_quant import dequantize_blocks

MAX_ROWS = 16  # x is padded to one 16-row tensor-core tile


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_wsn, stride_om,
    K: tl.constexpr, GROUP_N: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    # rows past N re-read row N-1: unmasked, vectorised weight loads; those columns are never stored
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + offs_k[None, :]
    ws_ptrs = ws_ptr + (w_rows // GROUP_N) * stride_wsn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        if K % BLOCK_K == 0:
            w = tl.load(w_ptrs + k0)
        else:
            w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k0 + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & k_mask[None, :], other=0.0)
        part = tl.dot(w.to(x.dtype), tl.trans(x))
        if PER_CHANNEL:
            acc += part
        else:
            acc += part * tl.load(ws_ptrs + k0 // BLOCK_K)[:, None]
    if PER_CHANNEL:
        acc *= tl.load(ws_ptrs)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (offs_m[None, :] < M))


def _block_n(n: int, device: torch.device) -> int:
    """The widest slab that still gives every SM two programs (16 at least: one tensor-core tile)."""
    for block_n in (64, 32):
        if triton.cdiv(n, block_n) >= 2 * sm_count(device):
            return block_n
    return 16


def fp8_gemv(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_n: int, group_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``x`` [M <= 16, K] (bf16/fp16) times fp8 ``w`` [N, K] with scales as in kernels/fp8_gemm.py.

    Per-channel scales: ``group_n=1, group_k=K``.
    """
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS or w.shape[1] != k or x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"fp8_gemv takes row-major x [M <= {MAX_ROWS}, K] and w [N, K]: got "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")
    per_channel = group_k >= k
    block_k = 128 if per_channel else group_k
    if block_k & (block_k - 1) or block_k < 16:
        raise ValueError(f"fp8_gemv: block size {group_k} along K must be a power of two >= 16")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n = _block_n(n, x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, w_scale, bias if bias is not None else out, out, m, n, x.stride(0), w.stride(0), w_scale.stride(0),
        out.stride(0), K=k, GROUP_N=group_n, PER_CHANNEL=per_channel, HAS_BIAS=bias is not None,
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4,
    )  # fmt: skip
    return out


def fp8_gemv_reference(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_n: int, group_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    out = x.float() @ dequantize_blocks(w, w_scale, group_n, group_k).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
