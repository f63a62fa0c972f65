"""RMSNorm, alone and fused with the residual add.

Both are plain functions so the CUDA path can swap in a Triton kernel with the same signature.
The variance is taken in float32 and the weight is applied after casting back, exactly as
Hugging Face's Llama/Qwen RMSNorm does, so fp32 runs match it bit for bit in order of operations.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        from graphserve.kernels import norm as triton_norm

        return triton_norm.rms_norm(x, weight, eps)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``: the sum becomes the next residual."""
    if x.is_cuda:  # one pass: add, normalise and write the new residual in place of the old
        from graphserve.kernels import norm as triton_norm

        return triton_norm.fused_add_rms_norm(x, residual, weight, eps, residual_out=residual)
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
