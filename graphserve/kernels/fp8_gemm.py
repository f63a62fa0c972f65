"""W8A8 FP8 matmul ``y = dequant(a) @ dequant(w).T`` on the FP8 tensor cores.

``a`` [M, K] fp8 with fp32 scales ``a_scale`` [M, ceil(K / group_k)] (per token group, or [M, 1]
per token); ``w`` [N, K] fp8 with fp32 scales ``w_scale`` [ceil(N / group_n), ceil(K / group_k)]
(128x128 blocks as DeepSeek-V3 / Qwen3-FP8 ship them, or [N, 1] per channel with group_n=1,
group_k=K). Each program owns a ``[BLOCK_M, BLOCK_N]`` output tile and walks K in steps of
``BLOCK_K = group_k`` (or a divisor of K when the scales are per channel): within one step every
product shares one activation scale per row and one weight scale per column, so the fp32
accumulator takes ``tl.dot(a, w) * a_s[:, None] * w_s[None, :]`` — the block scales never leave
registers and no dequantized copy of either operand is written.

Per-token x per-channel scales are what ``torch._scaled_mm``'s rowwise mode computes with cuBLASLt
(sm89+); ``scaled_mm_rowwise`` calls it, and layers/quant/fp8.py routes per-channel layers there.
Tile sizes are a pure function of M, N and the SM count (no autotuning: unsafe inside CUDA-graph
capture).
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from graphserve.kernels.common import sm_count
from graphserve.kernels.fp8_quant import dequantize_blocks
from graphserve.kernels.pdl import pdl_args, pdl_enter
from graphserve.kernels.tile_order import grouped_tile_ids

logger = logging.getLogger("graphserve.fp8")


@triton.jit(do_not_specialize=["M"])  # batch-sized ints: see engine/warmup.py
def _w8a8_kernel(
    a_ptr, w_ptr, c_ptr, as_ptr, ws_ptr, bias_ptr, M, N,
    stride_am, stride_wn, stride_cm, stride_asm, stride_ask, stride_wsn,
    K: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    pid_m, pid_n = grouped_tile_ids(N, tl.cdiv(M, BLOCK_M), BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]: w transposed
    as_ptrs = as_ptr + offs_m * stride_asm
    ws_ptrs = ws_ptr + (offs_n // GROUP_N) * stride_wsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K is a compile-time constant (a model has a handful): the loop bound stays a Python int
    for k0 in range(0, K, BLOCK_K):
        k_left = K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < k_left), other=0.0)
        scale_col = k0 // GROUP_K
        a_s = tl.load(as_ptrs + scale_col * stride_ask, mask=mask_m, other=0.0)
        w_s = tl.load(ws_ptrs + scale_col, mask=mask_n, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _tiles(m: int, n: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Row tiles as thin as M allows (padding rows cost
    tensor-core work and register space); then, while there are fewer than two programs per SM, the
    tiles narrow: at decode batch sizes (M <= 256) the GEMM streams its weight, and one program per
    SM cannot keep enough loads in flight to reach the card's bandwidth."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_n, target = 128, 2 * sm_count(device)
    while triton.cdiv(m, block_m) * triton.cdiv(n, block_n) < target:
        if block_n > 32:
            block_n //= 2
        elif block_m > 64:
            block_m //= 2
        elif block_n > 16:
            block_n //= 2
        else:
            break
    big = block_m * block_n >= 128 * 128
    return block_m, block_n, 8 if big else 4, 3 if big else 4


def w8a8_matmul(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
    group_n: int, group_k: int, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``(a * a_scale) @ (w * w_scale).T (+ bias)`` in ``out_dtype``; layouts in the module docstring."""
    m, k = a.shape
    n = w.shape[0]
    if w.shape[1] != k or a.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"w8a8_matmul: a {tuple(a.shape)} and w {tuple(w.shape)} must be row-major with one K")
    block_k = group_k if group_k < k else max(32, min(128, triton.next_power_of_2(k)))  # fp8 wgmma: K >= 32
    if group_k < k and group_k & (group_k - 1):
        raise ValueError(f"w8a8_matmul: block size {group_k} along K must be a power of two")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    block_m, block_n, warps, stages = _tiles(m, n, a.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _w8a8_kernel[grid](
        a, w, out, a_scale, w_scale, bias if bias is not None else out, m, n,
        a.stride(0), w.stride(0), out.stride(0), a_scale.stride(0), a_scale.stride(1), w_scale.stride(0),
        K=k, GROUP_N=group_n, GROUP_K=max(group_k, block_k), HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=stages, **pdl_args(a.device, "_w8a8_kernel"),
    )  # fmt: skip
    return out


def w8a8_matmul_reference(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
    group_n: int, group_k: int, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Dequantize both operands to fp32 and multiply."""
    a_full = dequantize_blocks(a, a_scale, 1, group_k)
    w_full = dequantize_blocks(w, w_scale, group_n, group_k)
    out = a_full @ w_full.T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def scaled_mm_supported(m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether ``torch._scaled_mm``'s rowwise mode takes this shape: cuBLASLt FP8 needs sm89+ and
    K, N multiples of 16."""
    if device.type != "cuda" or n % 16 or k % 16:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_rowwise(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
    out_dtype: torch.dtype, bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Per-token ``a_scale`` [M, 1] x per-channel ``w_scale`` [N, 1] through ``torch._scaled_mm``.

    ``w.t()`` of a row-major [N, K] weight is the column-major second operand cuBLASLt wants, so no
    copy is made. Rowwise scaling takes bf16 output only; the bias is added outside (rowwise mode
    does not take one on every torch version we support).
    """
    out = torch._scaled_mm(a, w.t(), scale_a=a_scale.reshape(-1, 1), scale_b=w_scale.reshape(1, -1),
                           out_dtype=torch.bfloat16)
    if bias is not None:
        out = out + bias
    return out.to(out_dtype)


def blockwise_scale_layout(w_scale: torch.Tensor) -> torch.Tensor:
    """128x128 weight scales [N/128, K/128] as cuBLASLt's block-scaled GEMM takes them: K blocks padded
    to a multiple of 4, transposed to [L4, N/128] with unit stride along it. Done once per weight."""
    kb = w_scale.shape[1]
    padded = torch.nn.functional.pad(w_scale, (0, (-kb) % 4), value=1.0)  # past K: never multiplied
    return padded.t()


def scaled_mm_blockwise(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale_layout: torch.Tensor,
                        out_dtype: torch.dtype = torch.bfloat16, rows: int | None = None) -> torch.Tensor:
    """1x128 activation x 128x128 weight scales through ``torch._scaled_mm`` (cuBLASLt on sm90, CUDA >= 12.9;
    the scaling mode is read from the scale shapes). cuBLASLt wants M a multiple of 4 and the activation
    scales outer-dim-major: ``per_token_group_quant(x, 128, pad_rows_to=4, scales_column_major=True)``
    writes them so; anything else is padded and copied here. Returns the first ``rows`` rows (default: all
    rows of ``a`` given; a caller whose ``a`` came padded passes its own row count)."""
    m = a.shape[0] if rows is None else rows
    pad = (-a.shape[0]) % 4
    if pad:
        a = torch.cat([a, torch.zeros(pad, a.shape[1], dtype=a.dtype, device=a.device)])
        a_scale = torch.cat([a_scale, torch.ones(pad, a_scale.shape[1], dtype=a_scale.dtype, device=a.device)])
    if a_scale.stride(0) != 1:
        a_scale = a_scale.t().contiguous().t()
    return torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=w_scale_layout, out_dtype=out_dtype)[:m]


@functools.lru_cache(maxsize=8)
def blockwise_scaled_mm_available(device: torch.device) -> bool:
    """Whether this torch/CUDA build runs the block-scaled ``torch._scaled_mm`` on ``device``, and gets
    the Triton kernel's answer on a small product. Probed once per device, outside any graph capture
    (callers check ``torch.cuda.is_current_stream_capturing()`` first: the probe syncs)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    from graphserve.kernels.fp8_quant import per_token_group_quant, quantize_weight_blocks

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(8, 512, device=device, generator=gen, dtype=torch.bfloat16)
    wq, ws = quantize_weight_blocks(torch.randn(256, 512, device=device, generator=gen) * 0.05, 128, 128)
    a, a_s = per_token_group_quant(x, 128, pad_rows_to=4, scales_column_major=True)
    try:
        out = scaled_mm_blockwise(a, a_s, wq, blockwise_scale_layout(ws))
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
        logger.info("torch._scaled_mm block-scaled mode unavailable (%s): 128x128-block layers use the Triton "
                    "GEMM", str(e).splitlines()[0][:120])
        return False
    ref = w8a8_matmul_reference(a, a_s, wq, ws, 128, 128, torch.float32)
    err = float((out.float() - ref).norm() / ref.norm())
    if err > 1e-2:
        logger.warning("torch._scaled_mm block-scaled mode gives relative error %.2e on a probe: not used", err)
        return False
    return True
