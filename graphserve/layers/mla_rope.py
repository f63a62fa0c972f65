"""DeepSeek's rotary embedding on the rope part of q and k, and the softmax scale it implies.

Only ``qk_rope_head_dim`` of each query head and the one shared rope key are rotated. DeepSeek
checkpoints lay the rotated dimensions out in interleaved pairs ``(x0, x1), (x2, x3), ...``
(DeepSeek-V2's complex multiplication, V3's ``rope_interleave``); V3 configs may also ask for
the rotate-half layout. We de-interleave on the way in and rotate in the rotate-half layout:
scores only see ``q·k``, which a permutation applied to both q and k leaves unchanged, so the cache
stores the rope key de-interleaved.

``rope_type`` ``default`` and ``yarn`` are implemented. YaRN blends interpolated and extrapolated
frequencies, multiplies cos/sin by an attention factor (``mscale / mscale_all_dim``), and DeepSeek
also multiplies the softmax scale by ``mscale_all_dim``'s factor squared. Other types are refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from graphserve.errors import ModelLoadError
from graphserve.kernels.mla_prologue import rotate

SUPPORTED_ROPE_TYPES = ("default", "yarn")


def rope_parameters_of(config: Any) -> dict[str, Any]:
    """The config's rope parameters (transformers 5 ``rope_parameters``, older ``rope_scaling``)."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    if "rope_theta" not in rope:
        rope["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope_scaling.rope_type={rope['rope_type']!r} is not supported for DeepSeek models: choose one of "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}", param="rope_scaling",
        )  # fmt: skip
    if rope["rope_type"] == "yarn":
        rope.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return rope


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(qk_head_dim: int, rope: dict[str, Any]) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale_all_dim`` factor squared when rope is scaled."""
    scale = qk_head_dim**-0.5
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale *= m * m
    return scale


def yarn_inv_freq(dim: int, rope: dict[str, Any], max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2], attention factor) of DeepSeek's YaRN, as transformers computes them."""
    base = float(rope["rope_theta"])
    original = float(rope["original_max_position_embeddings"])
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original
    attention = rope.get("attention_factor")
    if attention is None:
        mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all))
        else:
            attention = yarn_mscale(factor)
    beta_fast, beta_slow = float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # share of the original frequency kept, per dimension pair
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def rope_inv_freq(dim: int, rope: dict[str, Any], max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    if rope["rope_type"] == "yarn":
        return yarn_inv_freq(dim, rope, max_position_embeddings)
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    return 1.0 / (float(rope["rope_theta"]) ** exponents), 1.0


class DeepseekRotary(nn.Module):
    """cos/sin table of the rope dimensions, with YaRN's attention factor folded into it."""

    def __init__(self, rope_dim: int, max_positions: int, rope: dict[str, Any], max_position_embeddings: int,
                 interleaved: bool) -> None:  # fmt: skip
        super().__init__()
        self.rope_dim, self.max_positions, self.interleaved = rope_dim, max_positions, interleaved
        self.inv_freq, self.attention_factor = rope_inv_freq(rope_dim, rope, max_position_embeddings)
        self.register_buffer("cos_sin_cache", self._build(torch.empty(0).device), persistent=False)

    def _build(self, device: torch.device) -> torch.Tensor:
        if device.type == "meta":
            return torch.empty(self.max_positions, self.rope_dim, device=device)
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        angles = torch.outer(t, self.inv_freq.to(device))
        return torch.cat((angles.cos(), angles.sin()), dim=-1) * self.attention_factor

    def rebuild(self, device: torch.device) -> None:
        self.cos_sin_cache = self._build(device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return rotate(x, positions, self.cos_sin_cache, self.interleaved)
