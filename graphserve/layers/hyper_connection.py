"""Manifold-constrained hyper-connections (DeepSeek-V4): ``hc_mult`` residual streams per token instead of one.

Before each sublayer, a projection of the RMS-normalised streams gives three mixes (transformers'
``DeepseekV4HyperConnection``): ``pre`` collapses the streams into the sublayer's input, ``post`` places its output
back on each stream, and ``comb``, an ``hc x hc`` matrix made doubly stochastic by ``hc_sinkhorn_iters`` Sinkhorn
steps, mixes the streams themselves: ``streams' = post * out + comb^T @ streams``. ``HyperHead`` collapses the
streams once more before the final norm. The mixes are computed in fp32, as transformers keeps these modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Float32Params(nn.Module):
    """A module whose parameters named in ``float32_params`` stay float32 when the model is cast to its dtype as a
    whole (models/loader.py), as transformers keeps them (``_keep_in_fp32_modules_strict``) and the description
    prices them (``ModelDescription.float32_params``)."""

    float32_params: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name in self.float32_params:
            p = getattr(self, name)
            if p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
        return self


def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(Float32Params):
    float32_params = ("fn", "base", "scale")

    def __init__(self, hc: int, hidden: int, iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, iters, hc_eps, norm_eps
        mix = (2 + hc) * hc
        self.fn = nn.Parameter(torch.zeros(mix, hc * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, hc, D]`` -> (post [T, hc], comb [T, hc, hc] fp32, the collapsed input [T, D])."""
        hc, eps = self.hc, self.hc_eps
        flat = _unweighted_rms(streams.flatten(1).float(), self.norm_eps)
        pre_w, post_w, comb_w = F.linear(flat, self.fn.float()).split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * self.scale[2] + comb_b.view(hc, hc), dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """``post * out + comb^T @ streams``: the sublayer's output placed on the mixed streams."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                              streams)


class HyperHead(Float32Params):
    float32_params = ("hc_fn", "hc_base", "hc_scale")

    def __init__(self, hc: int, hidden: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc, hc * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = _unweighted_rms(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float())
        return ((pre + self.hc_eps).unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
