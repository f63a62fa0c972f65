"""RMSNorm and fused residual-add + RMSNorm, one program per token row.

Numerics follow the Hugging Face Llama layer: the sum ``x + residual`` is rounded to the input
dtype (it becomes the next residual), normalised in fp32, rounded to the input dtype, then scaled
by the weight. Fusing the add saves one full read and write of the hidden states per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphserve.kernels.pdl import pdl_args, pdl_enter


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    hidden, eps,
    ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
):
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"norm weight shape {tuple(weight.shape)} does not match hidden size {hidden}")
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty_like(x2) if out is None else out.view(x2.shape)
    res2 = res_out = x2  # placeholders, unused without a residual
    if residual is not None:
        res2 = residual.reshape(-1, hidden)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        res_out = torch.empty_like(x2) if residual_out is None else residual_out.view(x2.shape)
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2, res2, weight, out, res_out,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps,
            ADD_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 512)), **pdl_args(x2.device, "_rms_norm_kernel"),
        )  # fmt: skip
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any leading shape); ``out`` may be preallocated."""
    return _launch(x, None, weight, eps, out, None)[0]


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``; the second is the next layer's residual.

    ``residual_out`` may be ``residual`` itself (each row is read before it is written).
    """
    return _launch(x, residual, weight, eps, out, residual_out)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed.to(x.dtype).float()).to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed
