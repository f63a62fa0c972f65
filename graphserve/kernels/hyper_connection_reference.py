"""DeepSeek-V4's hyper-connection math in plain PyTorch (transformers' ``DeepseekV4HyperConnection`` and
``DeepseekV4HyperHead``): the CPU path of layers/hyper_connection.py and the reference of
kernels/hyper_connection.py.

The mixes are computed in fp32. ``hc_mixes`` takes the projection of the RMS-normalised streams; the kernels take
the projection of the streams as they are and apply the per-token ``rsqrt(mean x^2 + eps)`` after it (the RMS
factor is a scalar per token, so ``RMS(x) @ W = rsqrt(mean x^2 + eps) * (x @ W)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def hc_mixes(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int,
             eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``mixes [T, (2 + hc) * hc]`` (fp32, the normalised streams' projection) -> (pre [T, hc], post [T, hc],
    comb [T, hc, hc]): ``comb`` is a softmax made doubly stochastic by ``iters`` Sinkhorn normalisations."""
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_h pre[:, h] * streams[:, h]`` in fp32, rounded to the streams' dtype: the sublayer's input."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def hyper_connection(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                     hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``streams [T, hc, D]`` -> (post [T, hc] fp32, comb [T, hc, hc] fp32, the collapsed input [T, D])."""
    flat = unweighted_rms(streams.flatten(1).float(), norm_eps)
    pre, post, comb = hc_mixes(F.linear(flat, fn.float()), base, scale, streams.shape[1], iters, hc_eps)
    return post, comb, collapse(streams, pre)


def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``post * out + comb^T @ streams`` in the streams' dtype: the sublayer's output placed on the mixed streams."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def hyper_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
               norm_eps: float) -> torch.Tensor:  # fmt: skip
    """The final collapse of ``streams [T, hc, D]`` before the model's last norm."""
    flat = unweighted_rms(streams.flatten(1).float(), norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float())
    return collapse(streams, pre + hc_eps)
