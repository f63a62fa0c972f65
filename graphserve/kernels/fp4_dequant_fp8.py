"""The dense FP4 GEMM's "dequant_fp8" variant: per call, the packed FP4 weight converted to e4m3 [N, K] by one launch,
then the FP8 tensor cores' matmul the FP8 linear runs at prefill rows (x quantized per token, ``torch._scaled_mm``
rowwise; the Triton W8A8 kernel where cuBLASLt's FP8 does not take the shape).

Numerics equal ``--fp4-load-as fp8``'s (layers/quant/fp4_to_fp8.py): each output row's FP8 scale is the smallest power
of two that keeps the row's FP4 values (codes times group scales) within e4m3's 448 (``pow2_scale``, the rule
``pow2_fp8`` applies), times the NVFP4 global; dividing by a power of two only shifts exponents, so the conversion
rounds only where that module's note says (a few NVFP4 codes times odd-mantissa group scales; groups more than 14
binades under the row's largest). The row scales are [N] fp32, made once per loaded weight (``fp8_row_scales``, pure
torch without a host sync: a caller that holds none gets them computed in the call, a pass over the weight).

Why: at prefill rows the "dequant" variant's bf16 matmul is the call's cost (H100, llama3-8b at 4,096 rows: qkv 0.282
ms, about 730 TFLOP/s); e4m3 halves both the transient weight's bytes and the tensor cores' time a FLOP.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.fp4_gemm_config import Fp4GemmConfig
from graphserve.kernels.fp4_layout import GROUP
from graphserve.kernels.fp4_moe_gemm import _dense_weight_tile
from graphserve.kernels.fp4_reference import e8m0_to_float, fp4_dequantize
from graphserve.kernels.fp8_gemm import scaled_mm_rowwise, scaled_mm_supported, w8a8_matmul, w8a8_matmul_reference
from graphserve.kernels.fp8_quant import FP8_DTYPE, FP8_MAX, per_token_group_quant, per_token_group_quant_reference
from graphserve.kernels.pdl import pdl_args, pdl_enter


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``s`` with ``amax / s <= 448`` (fp32, amax's shape); 1 where amax is 0. Exponents by
    frexp, exact integer work on every device (a log2 may differ by an ulp between CPU and CUDA and round to another
    power)."""
    # amax / 448 = m * 2^e with m in [0.5, 1): the power is 2^e, or 2^(e-1) at m = 0.5
    mantissa, exponent = torch.frexp(amax / FP8_MAX)
    scale = torch.ldexp(torch.ones_like(amax), torch.where(mantissa == 0.5, exponent - 1, exponent))
    return torch.where(amax / scale > FP8_MAX, scale * 2, scale)  # amax / 448 rounded down onto a power of two


def _code_value(c: torch.Tensor) -> torch.Tensor:
    """E2M1 magnitude codes (0..7) -> 0, 0.5, 1, 1.5, 2, 3, 4, 6 (fp32) by arithmetic: no table copied to the device,
    so the call stays inside a CUDA-graph capture."""
    c = c.to(torch.int32)
    e, m = c >> 1, (c & 1).float()
    normal = torch.ldexp(1.0 + 0.5 * m, (e - 1).float())
    return torch.where(e == 0, 0.5 * m, normal)


def fp8_row_scales(packed: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 [N]: each row's ``pow2_scale`` of its largest FP4 magnitude (code times group scale, the NVFP4 global left
    out): E2M1 magnitudes rise with their 3-bit code, so a group's largest is its largest code's. Torch only, no host
    sync."""
    n, half = packed.shape
    group = GROUP[fmt]
    b = packed.view(n, half * 2 // group, group // 2)
    codes = torch.maximum(b & 0x7, (b >> 4) & 0x7).amax(dim=2)
    groups = scale.float() if fmt == "nvfp4" else e8m0_to_float(scale)
    return pow2_scale((_code_value(codes) * groups).amax(dim=1))


@triton.jit
def e4m3_bits(v):
    """fp32 values within +-448 -> their e4m3 bytes (int32), rounded to nearest even as torch's cast and the GPU's
    ``cvt.rn`` round, subnormals included. By integer and exact float steps rather than ``.to(tl.float8e4nv)``: the
    interpreter's cast rounds ties away from zero, so a CPU test could not check the GPU's bytes."""
    u = v.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    # normal e4m3 (from 2^-6): drop 20 of fp32's 23 mantissa bits to nearest even; a carry steps the exponent
    r = a + 0x7FFFF + ((a >> 20) & 1)
    normal = (r >> 20) - (120 << 3)  # the exponent re-biased from 127 to 7
    # subnormal e4m3: multiples of 2^-9 (8 of them is 2^-6, the smallest normal's byte), rounded to nearest even
    t = a.to(tl.float32, bitcast=True) * 512.0
    q = tl.floor(t)
    frac = t - q
    qi = q.to(tl.int32)
    qi += ((frac > 0.5) | ((frac == 0.5) & ((qi & 1) == 1))).to(tl.int32)
    return tl.where(a >= 0x3C800000, normal, qi) | sign


@triton.jit
def _fp4_to_fp8_kernel(
    w_ptr, s_ptr, rs_ptr, out_ptr, N, stride_wn, stride_sn, stride_on, K: tl.constexpr, GROUP_K: tl.constexpr,
    MX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A [BLOCK_N, BLOCK_K] tile of the weight as fp32 codes times group scales (exact), divided by its rows' power of
    two (IEEE division, as torch's), rounded once to e4m3 (``e4m3_bits``) and stored as bytes."""
    pdl_enter(PDL)
    w, offs_n, rows, k0 = _dense_weight_tile(w_ptr, s_ptr, N, stride_wn, stride_sn, K, GROUP_K, MX, BLOCK_N, BLOCK_K)
    q = tl.div_rn(w, tl.load(rs_ptr + rows)[:, None])
    offs_k = k0 + tl.arange(0, BLOCK_K)
    out_ptrs = out_ptr + offs_n.to(tl.int64)[:, None] * stride_on + offs_k[None, :]
    tl.store(out_ptrs, e4m3_bits(q).to(tl.uint8), mask=(offs_n < N)[:, None] & (offs_k < K)[None, :])


def fp4_to_fp8_weight(packed: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor, fmt: str,
                      config: Fp4GemmConfig) -> torch.Tensor:  # fmt: skip
    """The packed FP4 weight [N, K/2] with its group scales as e4m3 [N, K] over ``row_scale`` (fp32 [N], powers of two
    from ``fp8_row_scales``): one launch of ``config``'s block_n x block_k tiles."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if row_scale.shape != (n,) or row_scale.dtype != torch.float32 or not row_scale.is_contiguous():
        raise ValueError(f"fp4_to_fp8_weight: row_scale must be contiguous fp32 ({n},), got {row_scale.dtype} "
                         f"{tuple(row_scale.shape)}")
    w = torch.empty(n, k, dtype=FP8_DTYPE, device=packed.device)
    if n == 0:
        return w
    _fp4_to_fp8_kernel[(triton.cdiv(n, config.block_n), triton.cdiv(k, config.block_k))](
        packed, scale.view(torch.uint8), row_scale, w.view(torch.uint8), n, packed.stride(0), scale.stride(0), w.stride(0), K=k,
        GROUP_K=GROUP[fmt], MX=fmt == "mxfp4", BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, **pdl_args(packed.device, "_fp4_to_fp8_kernel"),
    )  # fmt: skip
    return w


def fp4_to_fp8_weight_reference(packed: torch.Tensor, scale: torch.Tensor, fmt: str) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """(e4m3 [N, K], fp32 [N]) as ``--fp4-load-as fp8`` converts the weight (globals left out): its dequantized fp32
    values over each row's ``pow2_scale``, clamped to 448 and rounded by torch."""
    unit = torch.ones((), device=packed.device) if fmt == "nvfp4" else None
    v = fp4_dequantize(packed, scale, unit, fmt)
    rs = pow2_scale(v.abs().amax(dim=1))
    return (v / rs[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), rs


def weight_scales(row_scale: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    """The FP8 weight's per-channel scales: the row's power of two times its NVFP4 global (one, or one per row), as
    fp4_to_fp8.convert_linear folds them."""
    return row_scale if global_scale is None else row_scale * global_scale.float()


def dequant_fp8_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
                     fmt: str, bias: torch.Tensor | None, config: Fp4GemmConfig,
                     row_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``x`` [M, K] times the FP4 weight through the FP8 tensor cores, x's dtype [M, N] out: the weight converted to a
    transient e4m3 [N, K] (``config``: the conversion's tile), x quantized per token, then the FP8 linear's prefill
    matmul with the global scale and bias. The caller has checked the operands (kernels/fp4_gemm.fp4_gemm)."""
    if row_scale is None:
        row_scale = fp8_row_scales(packed, scale, fmt)
    n, k = packed.shape[0], x.shape[1]
    w = fp4_to_fp8_weight(packed, scale, row_scale, fmt, config)
    w_scale = weight_scales(row_scale, global_scale)
    xq, xs = per_token_group_quant(x, k)
    if x.dtype == torch.bfloat16 and scaled_mm_supported(x.shape[0], n, k, x.device):
        return scaled_mm_rowwise(xq, xs, w, w_scale, x.dtype, bias)
    return w8a8_matmul(xq, xs, w, w_scale.view(n, 1), 1, k, x.dtype, bias)


def dequant_fp8_gemm_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                               global_scale: torch.Tensor | None, fmt: str,
                               bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """fp32: the ``--fp4-load-as fp8`` conversion, then the FP8 reference matmul on x quantized per token."""
    q, rs = fp4_to_fp8_weight_reference(packed, scale, fmt)
    xq, xs = per_token_group_quant_reference(x, x.shape[1])
    w_scale = weight_scales(rs, global_scale).reshape(-1, 1)
    return w8a8_matmul_reference(xq, xs, q, w_scale, 1, x.shape[1], torch.float32, bias)
