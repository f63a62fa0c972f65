"""Linear layers whose weights are concatenations of several checkpoint tensors.

q/k/v and gate/up are fused into one matmul each (few large GEMMs are what the GPU path
wants); the checkpoint stores them apart, so each fused layer knows where every shard goes.
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """``nn.Linear`` whose output rows are ``output_sizes`` stacked in order."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard_rows(self, shard: int) -> slice:
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    @torch.no_grad()
    def load_shard(self, param: nn.Parameter, shard: int, loaded: torch.Tensor) -> None:
        target = param.data[self.shard_rows(shard)]
        if target.shape != loaded.shape:
            raise ValueError(f"shard {shard} has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
        target.copy_(loaded)
