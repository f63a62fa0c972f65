"""SiLU-gated MLP activation, a single function so the CUDA path can fuse it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up`` is ``[..., 2 * d]`` from the merged gate/up projection."""
    if gate_up.is_cuda:
        from graphserve.kernels.activation import silu_and_mul as triton_silu_and_mul

        return triton_silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
