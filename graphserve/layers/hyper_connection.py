"""Manifold-constrained hyper-connections (DeepSeek-V4): ``hc_mult`` residual streams per token instead of one.

Before each sublayer, a projection of the RMS-normalised streams gives three mixes (transformers'
``DeepseekV4HyperConnection``): ``pre`` collapses the streams into the sublayer's input, ``post`` places its output
back on each stream, and ``comb``, an ``hc x hc`` matrix made doubly stochastic by ``hc_sinkhorn_iters`` Sinkhorn
steps, mixes the streams themselves: ``streams' = post * out + comb^T @ streams``. ``HyperHead`` collapses the
streams once more before the final norm. The mixes are computed in fp32, as transformers keeps these modules: in PyTorch
(kernels/hyper_connection_reference.py), or with ``kernels=True`` (the model's Triton path) as one fp32 matmul of the
streams and the Triton kernels of kernels/hyper_connection.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphserve.kernels import hyper_connection_reference as ref


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


class HyperConnection(Float32Params):
    float32_params = ("fn", "base", "scale")

    def __init__(self, hc: int, hidden: int, iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, iters, hc_eps, norm_eps
        mix = (2 + hc) * hc
        self.fn = nn.Parameter(torch.zeros(mix, hc * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor, kernels: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, hc, D]`` -> (post [T, hc], comb [T, hc, hc] fp32, the collapsed input [T, D])."""
        if not kernels:
            return ref.hyper_connection(streams, self.fn, self.base, self.scale, self.iters, self.hc_eps,
                                        self.norm_eps)  # fmt: skip
        from graphserve.kernels import hyper_connection as hck

        mixes = F.linear(streams.flatten(1).float(), self.fn.float())  # the RMS factor is the kernel's
        return hck.hc_pre(streams, mixes, self.base, self.scale, self.iters, self.hc_eps, self.norm_eps)

    @staticmethod
    def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
              kernels: bool = False) -> torch.Tensor:  # fmt: skip
        """``post * out + comb^T @ streams``: the sublayer's output placed on the mixed streams."""
        if not kernels:
            return ref.merge(streams, out, post, comb)
        from graphserve.kernels import hyper_connection as hck

        return hck.hc_merge(streams, out, post, comb)


class HyperHead(Float32Params):
    float32_params = ("hc_fn", "hc_base", "hc_scale")

    def __init__(self, hc: int, hidden: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc, hc * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor, kernels: bool = False) -> torch.Tensor:
        if not kernels:
            return ref.hyper_head(streams, self.hc_fn, self.hc_base, self.hc_scale, self.hc_eps, self.norm_eps)
        from graphserve.kernels import hyper_connection as hck

        mixes = F.linear(streams.flatten(1).float(), self.hc_fn.float())
        return hck.hc_head(streams, mixes, self.hc_base, self.hc_scale, self.hc_eps, self.norm_eps)
