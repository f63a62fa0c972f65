"""FP8 (e4m3) quantization of activations and weights, with the scale conventions the checkpoints use.

A quantized tensor is ``(q, scale)`` with ``x ~= q.float() * scale`` (the scale multiplies on the way
back, which is what DeepSeek-V3 and Qwen3-FP8 store under the misleading name ``weight_scale_inv``).

- Activations, per token group: each row's K columns split into groups of ``group_size`` (128, the
  weight block's K), one scale per (row, group) = amax / 448. Computed on the fly each forward
  ("dynamic" activation scheme); the Triton kernel takes several groups of one row per program.
- Weights, per block: one scale per ``[block_n, block_k]`` tile; or per output channel (one per row).
  Done once at load, so they are plain PyTorch.

e4m3's largest finite value is 448; scales are clamped from below so an all-zero group gives zeros
rather than 0/0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.gemv import _x_tile
from graphserve.kernels.pdl import pdl_args, pdl_enter

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
FP16_MAX: tl.constexpr = tl.constexpr(torch.finfo(torch.float16).max)  # 65504
MIN_SCALE = 1e-12  # amax below this (an all-zero group) quantizes to zeros, never NaN
# the activation dtypes as Triton names them, for epilogues that round to the model's dtype while writing fp8
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def fp16_saturated(x):
    """``x`` in fp16, clamped to its range first: the operand an fp8 cache's fp16 widening meets (decode attention,
    MLA), from bf16 values whose range is fp32's."""
    return tl.minimum(tl.maximum(x.to(tl.float32), -FP16_MAX), FP16_MAX).to(tl.float16)


@triton.jit
def quantize_rows(xf, OUT_DTYPE: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr):
    """Each row of the fp32 tile ``xf`` [R, G] as one group: (q [R, G] in ``OUT_DTYPE``, fp32 scale [R]), scale
    amax / 448 clamped from below. The one rounding every fp8 activation path shares: this module's launches,
    kernels/fp8_gemv.py's FP8 dot and kernels/moe_gemm.py's A_QUANT quantize in registers with it."""
    scale = scale_of(tl.max(tl.abs(xf), axis=1), FP8_MAX_C, MIN_SCALE_C)
    return quantized(xf, scale[:, None], OUT_DTYPE, FP8_MAX_C), scale


@triton.jit
def scale_of(amax, FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr):
    """A group's scale from its amax (``quantize_rows``'s, for callers that take the amax in pieces)."""
    return tl.maximum(amax / FP8_MAX_C, MIN_SCALE_C)


@triton.jit
def quantized(xf, scale, OUT_DTYPE: tl.constexpr, FP8_MAX_C: tl.constexpr):
    """fp32 values divided by their group's ``scale`` (broadcast to them) and saturated to fp8 (``quantize_rows``'s)."""
    return tl.clamp(xf / scale, -FP8_MAX_C, FP8_MAX_C).to(OUT_DTYPE)


@triton.jit(do_not_specialize=["M"])  # batch-sized ints: see engine/warmup.py
def _token_group_quant_kernel(
    x_ptr, res_ptr, nw_ptr, res_out_ptr, q_ptr, s_ptr, made_ptr, M, stride_xm, stride_rm, stride_rom, stride_qm,
    stride_sm, stride_sg, stride_mm, eps, K: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, SILU_MUL: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    NORM: tl.constexpr, KEEP_MADE: tl.constexpr, STAT_BLOCK: tl.constexpr, FP8_MAX_C: tl.constexpr,
    MIN_SCALE_C: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0)
    groups = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    offs = tl.arange(0, BLOCK)
    cols = groups[:, None] * GROUP + offs[None, :]  # [groups, columns of a group]
    # rows past M (padding the caller asked for) load nothing: zeros with the smallest scale
    in_row = (offs[None, :] < GROUP) & (cols < K) & (groups[:, None] < GROUPS)
    mask = in_row & (row < M)
    rstd = 0.0
    if NORM:  # the row's statistics: the whole row (a few KB from L2), in every program of the row
        offs_s = tl.arange(0, STAT_BLOCK)
        sum_sq = tl.zeros((STAT_BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, STAT_BLOCK):
            h = _x_tile(x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, row, k0 + offs_s, (k0 + offs_s < K) & (row < M),
                        0.0, K, False, ADD_RESIDUAL, False, x_ptr.dtype.element_ty).to(tl.float32)  # fmt: skip
            sum_sq += h * h
        rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / K + eps)
    if ADD_RESIDUAL:  # x + residual, the next residual: each program writes its own columns
        h = _x_tile(x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, row, cols, mask, 0.0, K, False, True, False,
                    x_ptr.dtype.element_ty)  # fmt: skip
        tl.store(res_out_ptr + row * stride_rom + cols, h, mask=mask)
    x = _x_tile(x_ptr, res_ptr, nw_ptr, stride_xm, stride_rm, row, cols, mask, rstd, K, SILU_MUL, ADD_RESIDUAL,
                NORM, x_ptr.dtype.element_ty)  # fmt: skip
    if KEEP_MADE:  # the unquantized input too (the prologue's output, already in x's dtype), for another reader
        tl.store(made_ptr + row * stride_mm + cols, x, mask=mask)
    x = x.to(tl.float32)
    q, scale = quantize_rows(x, q_ptr.dtype.element_ty, FP8_MAX_C, MIN_SCALE_C)
    tl.store(q_ptr + row * stride_qm + cols, q, mask=in_row)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups < GROUPS)


def _quant_launch(
    x: torch.Tensor, k: int, group_size: int, pad_rows_to: int, scales_column_major: bool, silu_mul: bool = False,
    norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
    made: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The launch behind this module's activation quantizers; ``made`` [M, k] in x's dtype, where given, receives
    the quantized input unquantized (the prologue's output)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"per_token_group_quant takes a row-major [M, K] tensor, got shape {tuple(x.shape)}")
    if group_size < 1:
        raise ValueError(f"per_token_group_quant: group_size={group_size} must be positive")
    m = x.shape[0]
    rows = -(-m // pad_rows_to) * pad_rows_to
    groups = triton.cdiv(k, group_size)
    q = torch.empty((rows, k), dtype=FP8_DTYPE, device=x.device)
    if scales_column_major:
        scales = torch.empty((groups, rows), dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else None
    if rows == 0 or k == 0:
        return q, scales, residual_out
    block = triton.next_power_of_2(group_size)
    # ~2K elements per program: a 128-column group alone is too little work to cover a launch slot
    # (an 8x2048 prefill has half a million of them), a whole-row group (group = K) stays alone
    per_prog = min(triton.next_power_of_2(groups), max(1, 2048 // block))
    elems = block * per_prog
    warps = 1 if elems <= 256 else 4 if elems <= 4096 else 16
    placeholder = x  # pointers a disabled prologue never dereferences
    _token_group_quant_kernel[(rows, triton.cdiv(groups, per_prog))](
        x, residual if residual is not None else placeholder, norm_weight if norm_weight is not None else placeholder,
        residual_out if residual_out is not None else placeholder, q, scales, made if made is not None else placeholder,
        m, x.stride(0), residual.stride(0) if residual is not None else 0,
        residual_out.stride(0) if residual_out is not None else 0, q.stride(0), scales.stride(0), scales.stride(1),
        made.stride(0) if made is not None else 0, float(eps), K=k, GROUPS=groups, GROUP=group_size, BLOCK=block,
        GROUPS_PER_PROG=per_prog, SILU_MUL=silu_mul, ADD_RESIDUAL=residual is not None, NORM=norm_weight is not None,
        KEEP_MADE=made is not None, STAT_BLOCK=min(2048, triton.next_power_of_2(k)), FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE, num_warps=warps,
        **pdl_args(x.device, "_token_group_quant_kernel"),
    )  # fmt: skip
    return q, scales, residual_out


def per_token_group_quant(
    x: torch.Tensor, group_size: int, *, pad_rows_to: int = 1, scales_column_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (fp8 [M', K], fp32 scales [M', ceil(K / group_size)]). ``group_size=K``: per token.

    ``M'`` is M rounded up to ``pad_rows_to`` (padding rows are zeros with the smallest scale), and
    ``scales_column_major`` stores the scales with unit stride along M: cuBLASLt's block-scaled GEMM
    takes both that way, and writing them so here saves a copy of each per call.
    """
    q, scales, _ = _quant_launch(x, x.shape[-1], group_size, pad_rows_to, scales_column_major)
    return q, scales


@triton.jit(do_not_specialize=["M"])  # batch-sized ints: see engine/warmup.py
def _static_quant_kernel(x_ptr, s_ptr, q_ptr, M, stride_xm, stride_qm, K: tl.constexpr, BLOCK: tl.constexpr,
                         FP8_MAX_C: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + row * stride_qm + cols, quantized(x, tl.load(s_ptr), q_ptr.dtype.element_ty, FP8_MAX_C),
             mask=mask)  # fmt: skip


def static_quant(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] quantized with a checkpoint's static per-tensor activation scale (``scale``: one fp32 value on
    x's device) -> (fp8 [M, K], the scale as per-row scales [M, 1], every row the same element): what the W8A8
    kernels read as one scale per row of x. On the GPU one launch, which holds nothing beside the fp8 copy (the
    memory plan counts that); elsewhere ``static_quant_reference``."""
    if x.dim() != 2 or x.stride(-1) != 1 or scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"static_quant takes a row-major [M, K] x and one fp32 scale, got x {tuple(x.shape)} "
                         f"strides {x.stride()}, scale {scale.dtype} {tuple(scale.shape)}")
    scales = scale.reshape(1, 1).expand(x.shape[0], 1)
    if not x.is_cuda:
        return static_quant_reference(x, scale), scales
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    if m and k:
        block = min(2048, triton.next_power_of_2(k))
        _static_quant_kernel[(m, triton.cdiv(k, block))](
            x, scale, q, m, x.stride(0), q.stride(0), K=k, BLOCK=block, FP8_MAX_C=FP8_MAX,
            num_warps=4 if block >= 1024 else 1, **pdl_args(x.device, "_static_quant_kernel"),
        )  # fmt: skip
    return q, scales


def static_quant_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 ``x / scale`` saturated at ±448: what ``static_quant`` stores."""
    return (x.float() / scale.reshape(())).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def silu_mul_group_quant(
    gate_up: torch.Tensor, group_size: int, *, pad_rows_to: int = 1, scales_column_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_token_group_quant(silu_and_mul(gate_up), ...)`` in one launch, for gate_up [M, 2K] = [gate | up]:
    the activation rounded to gate_up's dtype as the separate kernel writes it, then quantized."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul_group_quant takes gate_up [M, 2K], got {tuple(gate_up.shape)}")
    q, scales, _ = _quant_launch(gate_up, gate_up.shape[-1] // 2, group_size, pad_rows_to, scales_column_major,
                                 silu_mul=True)
    return q, scales


def norm_group_quant(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, group_size: int, residual: torch.Tensor | None = None,
    *, pad_rows_to: int = 1, scales_column_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``(q, scales, x + residual or None)``: (residual add +) RMSNorm with kernels/norm.py's numerics, then
    ``per_token_group_quant``, in one launch (the normed rows are never written)."""
    _check_norm_args(x, norm_weight, residual)
    k = x.shape[-1]
    return _quant_launch(x, k, group_size, pad_rows_to, scales_column_major, norm_weight=norm_weight, eps=eps,
                         residual=residual)


def norm_group_quant_keep(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, group_size: int, residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``(normed, q, scales, x + residual or None)``: ``norm_group_quant`` that also writes the normed rows
    (x's dtype), for a layer with two readers of them, one quantized (a routed block's experts) and one not
    (its router): one launch where a norm and a quantization launch ran."""
    _check_norm_args(x, norm_weight, residual)
    normed = torch.empty_like(x)
    q, scales, summed = _quant_launch(x, x.shape[-1], group_size, 1, False, norm_weight=norm_weight, eps=eps,
                                      residual=residual, made=normed)  # fmt: skip
    return normed, q, scales, summed


def _check_norm_args(x: torch.Tensor, norm_weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"norm_group_quant takes x [M, K], got {tuple(x.shape)}")
    k = x.shape[-1]
    if norm_weight.shape != (k,) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_group_quant: norm weight must be contiguous with shape ({k},), got "
                         f"{tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"norm_group_quant: residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}, row-major")


def per_token_group_quant_reference(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    groups = -(-k // group_size)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group_size - k)).view(m, groups, group_size)
    scales = (padded.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (padded / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, -1)[:, :k]
    return q.to(FP8_DTYPE), scales


def quantize_weight_blocks(w: torch.Tensor, block_n: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] -> (fp8 [N, K], fp32 scales [ceil(N / block_n), ceil(K / block_k)]), the HF block layout."""
    n, k = w.shape
    bn, bk = -(-n // block_n), -(-k // block_k)
    padded = torch.nn.functional.pad(w.float(), (0, bk * block_k - k, 0, bn * block_n - n))
    tiles = padded.view(bn, block_n, bk, block_k)
    scales = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (tiles / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(bn * block_n, bk * block_k)
    return q[:n, :k].to(FP8_DTYPE).contiguous(), scales


def quantize_weight_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] -> (fp8 [N, K], fp32 scales [N]): one scale per output channel."""
    scales = (w.float().abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    return (w.float() / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """fp32 ``q * scale`` of each ``[block_n, block_k]`` tile (tiles at the edges may be partial)."""
    n, k = q.shape
    expanded = scales.repeat_interleave(block_n, dim=0)[:n].repeat_interleave(block_k, dim=1)[:, :k]
    return q.float() * expanded
