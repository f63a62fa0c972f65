"""PyTorch references for kernels/fp8_gemv.py: dequantize the fp8 weight to fp32 and multiply, after the
same prologue (SiLU·mul, (residual add +) RMSNorm) computed in fp32 and rounded where the separate kernels
round."""

from __future__ import annotations

import torch

from graphserve.kernels.fp8_quant import dequantize_blocks
from graphserve.kernels.norm import fused_add_rms_norm_reference, rms_norm_reference


def fp8_gemv_reference(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_n: int, group_k: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Dequantize the weight to fp32 and multiply; x's dtype out."""
    out = x.float() @ dequantize_blocks(w, w_scale, group_n, group_k).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fp8_silu_mul_gemv_reference(gate_up: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, group_n: int,
                                group_k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded to the input dtype (as the separate kernel writes it), then the reference."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    x = (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)
    return fp8_gemv_reference(x, w, w_scale, group_n, group_k, bias)


def fp8_norm_gemv_reference(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor, w_scale: torch.Tensor,
    group_n: int, group_k: int, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    if residual is None:
        return fp8_gemv_reference(rms_norm_reference(x, norm_weight, eps), w, w_scale, group_n, group_k, bias), None
    h, summed = fused_add_rms_norm_reference(x, residual, norm_weight, eps)
    return fp8_gemv_reference(h, w, w_scale, group_n, group_k, bias), summed
