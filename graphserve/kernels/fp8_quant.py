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

from graphserve.kernels.pdl import pdl_args, pdl_enter

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
MIN_SCALE = 1e-12  # amax below this (an all-zero group) quantizes to zeros, never NaN


@triton.jit(do_not_specialize=["M"])  # batch-sized ints: see server/warmup.py
def _token_group_quant_kernel(
    x_ptr, q_ptr, s_ptr, M, stride_xm, stride_qm, stride_sm, stride_sg, K, GROUPS,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
    FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0)
    groups = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    offs = tl.arange(0, BLOCK)
    cols = groups[:, None] * GROUP + offs[None, :]  # [groups, columns of a group]
    # rows past M (padding the caller asked for) load nothing: zeros with the smallest scale
    mask = (offs[None, :] < GROUP) & (cols < K) & (groups[:, None] < GROUPS) & (row < M)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) / FP8_MAX_C, MIN_SCALE_C)
    q = tl.clamp(x / scale[:, None], -FP8_MAX_C, FP8_MAX_C)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=(offs[None, :] < GROUP) & (cols < K))
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups < GROUPS)


def per_token_group_quant(
    x: torch.Tensor, group_size: int, *, pad_rows_to: int = 1, scales_column_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (fp8 [M', K], fp32 scales [M', ceil(K / group_size)]). ``group_size=K``: per token.

    ``M'`` is M rounded up to ``pad_rows_to`` (padding rows are zeros with the smallest scale), and
    ``scales_column_major`` stores the scales with unit stride along M: cuBLASLt's block-scaled GEMM
    takes both that way, and writing them so here saves a copy of each per call.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"per_token_group_quant takes a row-major [M, K] tensor, got shape {tuple(x.shape)}")
    if group_size < 1:
        raise ValueError(f"per_token_group_quant: group_size={group_size} must be positive")
    m, k = x.shape
    rows = -(-m // pad_rows_to) * pad_rows_to
    groups = triton.cdiv(k, group_size)
    q = torch.empty((rows, k), dtype=FP8_DTYPE, device=x.device)
    if scales_column_major:
        scales = torch.empty((groups, rows), dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows == 0 or k == 0:
        return q, scales
    block = triton.next_power_of_2(group_size)
    # ~2K elements per program: a 128-column group alone is too little work to cover a launch slot
    # (an 8x2048 prefill has half a million of them), a whole-row group (group = K) stays alone
    per_prog = min(triton.next_power_of_2(groups), max(1, 2048 // block))
    elems = block * per_prog
    warps = 1 if elems <= 256 else 4 if elems <= 4096 else 16
    _token_group_quant_kernel[(rows, triton.cdiv(groups, per_prog))](
        x, q, scales, m, x.stride(0), q.stride(0), scales.stride(0), scales.stride(1), k, groups,
        GROUP=group_size, BLOCK=block, GROUPS_PER_PROG=per_prog, FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
        num_warps=warps, **pdl_args(x.device, "_token_group_quant_kernel"),
    )  # fmt: skip
    return q, scales


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
