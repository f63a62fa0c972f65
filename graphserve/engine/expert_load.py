"""Per-step expert load of a mixture-of-experts model: how many (token, slot) pairs each expert of
each layer received, read back without a host sync.

Every ``FusedMoE`` layer writes its step's per-expert counts into a device buffer (valid under
CUDA-graph replay, padding rows not counted). After the forward the runner stacks them and queues
one copy to pinned host memory; the engine reads it once the step's sampled ids have arrived
(the copy is ordered before them on the stream), so telemetry never waits on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from graphserve.layers.moe import FusedMoE

_RING = 4  # pinned buffers in rotation: more than the steps that can be in flight at once


@dataclass(frozen=True)
class ExpertLoad:
    """One step's routing, summarised for the step record."""

    experts_touched: int  # distinct (layer, expert) pairs that received a token
    max_expert_load: int  # most pairs any one expert received
    layer_max: list[int]  # per MoE layer, the most pairs one of its experts received
    layer_pairs: list[int]  # per MoE layer, (token, slot) pairs routed

    @classmethod
    def from_counts(cls, counts: np.ndarray) -> ExpertLoad:
        return cls(int((counts > 0).sum()), int(counts.max(initial=0)), counts.max(axis=1).tolist(),
                   counts.sum(axis=1).tolist())


class ExpertLoadProbe:
    def __init__(self, model: nn.Module, device: torch.device):
        self.layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
        self.device = device
        self._host: list[torch.Tensor] = []
        self._next = 0
        if self.layers and device.type == "cuda":
            shape = (len(self.layers), self.layers[0].num_experts)
            self._host = [torch.empty(shape, dtype=torch.int32, pin_memory=True) for _ in range(_RING)]

    def __bool__(self) -> bool:
        return bool(self.layers)

    def snapshot(self) -> torch.Tensor | None:
        """Queue the copy of this step's counts; the returned host tensor is valid once the step's
        sampled ids have reached the host."""
        if not self.layers:
            return None
        counts = torch.stack([m.expert_counts for m in self.layers])
        if not self._host:
            return counts.clone()
        host = self._host[self._next]
        self._next = (self._next + 1) % _RING
        host.copy_(counts, non_blocking=True)
        return host

    @staticmethod
    def read(host: torch.Tensor | None) -> ExpertLoad | None:
        return None if host is None else ExpertLoad.from_counts(host.numpy())
