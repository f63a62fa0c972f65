"""What an MLA backend reads of its layer (layers/mla.MLAttention): its sizes, its rotary and latent norm, and the
per-head views of ``kv_b_proj``. Declared apart from the layer, which picks its backend (layers/mla.mla_backend),
so that the backends (layers/mla_triton.py, layers/mla_expanded.py) do not import the layer back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from graphserve.layers.mla_rope import DeepseekRotary
    from graphserve.layers.norm import RMSNorm


class LatentAttentionLayer(Protocol):
    layer_idx: int
    num_heads: int  # this rank's
    nope: int
    rope: int
    v_dim: int
    kv_lora_rank: int
    scale: float
    rotary: list[DeepseekRotary]
    kv_a_layernorm: RMSNorm

    def w_kv_b(self) -> torch.Tensor: ...

    def w_uk(self) -> torch.Tensor: ...

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor: ...

    def unabsorb_output(self, o_lat: torch.Tensor) -> torch.Tensor: ...
