"""Rotary position embedding (the rotate-half layout Llama, Qwen and Mistral checkpoints use).

Supported ``rope_type``s: ``default``, ``linear``, ``llama3`` (Llama 3.1+ frequency
smoothing) and ``yarn`` (gpt-oss: blended frequencies and an attention factor that multiplies cos and
sin, folded into the cache, so every path that reads the cache applies it; the frequencies are
layers/mla_rope.yarn_inv_freq's, transformers' ``_compute_yarn_parameters``, ``truncate`` honoured).
Others (dynamic, longrope...) depend on the sequence length; they are refused at load time rather
than silently computed wrong.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from graphserve.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(head_dim: int, rope_parameters: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32, CPU) for a HF ``rope_parameters`` dict."""
    return rope_tables(head_dim, rope_parameters)[0]


def rope_tables(head_dim: int, rope_parameters: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(inverse frequencies ``[head_dim // 2]`` float32 on CPU, the factor cos and sin are multiplied by)."""
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if rope_type == "yarn":
        return _yarn(head_dim, rope_parameters)
    return _inv_freq(head_dim, rope_parameters, rope_type), 1.0


def _yarn(head_dim: int, p: dict[str, Any]) -> tuple[torch.Tensor, float]:
    from graphserve.layers.mla_rope import yarn_inv_freq

    for field in ("factor", "original_max_position_embeddings", "rope_theta"):
        if p.get(field) is None:
            raise ModelLoadError(f"rope_scaling.rope_type='yarn' needs rope_scaling.{field}", param="rope_scaling")
    if float(p["factor"]) < 1:
        raise ModelLoadError(f"rope_scaling.factor={p['factor']} must be at least 1 for yarn", param="rope_scaling")
    return yarn_inv_freq(head_dim, p, int(p["original_max_position_embeddings"]))


def _inv_freq(head_dim: int, rope_parameters: dict[str, Any], rope_type: str) -> torch.Tensor:
    base = float(rope_parameters["rope_theta"])
    # always on CPU: the model may be assembled under a meta-device context
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_parameters["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_parameters)
    raise ModelLoadError(
        f"rope_scaling.rope_type={rope_type!r} is not supported: choose one of {', '.join(SUPPORTED_ROPE_TYPES)}",
        param="rope_scaling",
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths (beyond the original context) are slowed by `factor`, short ones kept,
    # and the band between is blended linearly in 1/wavelength.
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    original_len = float(p["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = original_len / low, original_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, H, D]`` and ``k [T, Hkv, D]`` by ``positions [T]``.

    ``cos_sin_cache`` is ``[max_positions, D]`` float32: cos of the D/2 angles, then their sin.
    cos/sin are cast to q's dtype before use, as the Hugging Face reference does.
    """
    half = q.shape[-1] // 2
    if q.is_cuda:  # in place, one launch for q and k (angles in float32)
        from graphserve.kernels.rotary import apply_rotary as triton_apply_rotary

        triton_apply_rotary(q, k, positions, cos_sin_cache[:, :half], cos_sin_cache[:, half:])
        return q, k
    cos_sin = cos_sin_cache.index_select(0, positions).to(q.dtype)
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, rope_parameters: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.inv_freq, self.attention_factor = rope_tables(head_dim, rope_parameters)
        # Built on the ambient default device: meta when the model is assembled shape-only first.
        self.register_buffer("cos_sin_cache", self._build_cache(torch.empty(0).device), persistent=False)

    def _build_cache(self, device: torch.device) -> torch.Tensor:
        if device.type == "meta":
            return torch.empty(self.max_positions, self.head_dim, device=device)
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        angles = torch.outer(t, self.inv_freq.to(device))
        cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
        return cos_sin * self.attention_factor if self.attention_factor != 1.0 else cos_sin

    def rebuild(self, device: torch.device) -> None:
        """Recompute the cache on ``device`` (after the model was materialised with ``to_empty``)."""
        self.cos_sin_cache = self._build_cache(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, k, positions, self.cos_sin_cache)
