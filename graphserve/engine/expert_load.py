"""Per-step expert load of a mixture-of-experts model: how many (token, slot) pairs each expert of
each layer received, read back without a host sync.

Every ``FusedMoE`` layer writes its step's per-expert counts into a device buffer (valid under
CUDA-graph replay, padding rows not counted). The probe makes those buffers rows of one
[layers, experts] tensor, so after the forward the runner queues a single copy of it to pinned host
memory (no stack, no per-layer work); the engine reads it once the step's sampled ids have arrived
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
    """One step's routing, summarised for the step record (the fields are the record's own names)."""

    experts_touched: int  # distinct (layer, expert) pairs that received a token
    max_expert_load: int  # most pairs any one expert received
    layer_max_expert_load: list[int]  # per MoE layer, the most pairs one of its experts received
    layer_routed_pairs: list[int]  # per MoE layer, (token, slot) pairs routed

    @classmethod
    def from_counts(cls, counts: np.ndarray) -> ExpertLoad:
        return cls(int((counts > 0).sum()), int(counts.max(initial=0)), counts.max(axis=1).tolist(),
                   counts.sum(axis=1).tolist())


class ExpertLoadProbe:
    """Built after the model is loaded and before graphs are captured: the layers' count buffers are
    re-pointed at rows of ``counts`` here (once per model: a later probe keeps them), and a captured
    graph writes whatever buffer it saw."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
        self.device = device
        self.counts: torch.Tensor | None = None
        self._host: list[torch.Tensor] = []
        self._next = 0
        if not self.layers:
            return
        widths = {m.expert_counts.numel() for m in self.layers}
        if len(widths) != 1:
            raise ValueError(f"expert_counts: every MoE layer must count the same number of experts, got {sorted(widths)}")
        shape = (len(self.layers), widths.pop())
        shared = self.layers[0].expert_counts._base
        if shared is not None and shared.shape == shape and all(
                m.expert_counts._base is shared and m.expert_counts.data_ptr() == row.data_ptr()
                for row, m in zip(shared, self.layers)):
            # an earlier runner on this model (start-up's profiling one) already shares them: keep its
            # tensor, so graphs either runner captured still write where this probe reads
            self.counts = shared
        else:
            self.counts = torch.zeros(shape, dtype=torch.int32, device=device)
            for row, m in zip(self.counts, self.layers):
                m.expert_counts = row  # the kernels write it in place, so the shared tensor sees every layer
        if device.type == "cuda":
            self._host = [torch.empty(self.counts.shape, dtype=torch.int32, pin_memory=True) for _ in range(_RING)]

    def __bool__(self) -> bool:
        return bool(self.layers)

    def snapshot(self) -> torch.Tensor | None:
        """Queue the copy of this step's counts; the returned host tensor is valid once the step's
        sampled ids have reached the host."""
        if self.counts is None:
            return None
        if not self._host:
            return self.counts.clone()
        host = self._host[self._next]
        self._next = (self._next + 1) % _RING
        host.copy_(self.counts, non_blocking=True)
        return host

    @staticmethod
    def read(host: torch.Tensor | None) -> ExpertLoad | None:
        return None if host is None else ExpertLoad.from_counts(host.numpy())
