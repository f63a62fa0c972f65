"""The attention backend interface. The model's attention layer calls exactly this.

Backends: ``TorchAttentionBackend`` (CPU and reference, layers/attention.py) and the Triton
backend (GPU, layers/attention_triton.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from graphserve.layers.forward_batch import ForwardBatch


class AttentionBackend:
    """Writes the step's K/V into the paged cache, then attends.

    Shapes: q ``[T, num_heads, head_dim]``; k, v ``[T, num_kv_heads, head_dim]``;
    ``batch.kv_caches[layer_idx]`` is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
    Sequence i owns new tokens ``q[qs[i]:qs[i+1]]`` (qs = batch.query_start_loc) at absolute
    positions ``seq_lens[i] - qlen_i + j``; token j attends causally to cache positions
    ``0 .. seq_lens[i] - qlen_i + j`` of its block table (cached prefix + new tokens).
    Returns ``[T, num_heads, head_dim]`` in q's dtype.

    Every attending method takes two keywords, the layer's kind of attention:
    - ``window``: the query at absolute position p sees keys p - window < j <= p, the window counting the query
      itself (transformers' sliding_window_overlay, ``kv_idx > q_idx - sliding_window``, as Mistral, Qwen2 and
      gpt-oss train). None: full causal.
    - ``sinks``: float32 ``[num_heads of this rank]``, a learned per-head logit that joins the softmax denominator
      only: p_j = exp(s_j - m) / (exp(sink - m) + sum_i exp(s_i - m)), m the max over the scores and the sink
      (gpt-oss). None: no sink.
    A backend that cannot honour one raises, naming it; it never attends as if it were absent.
    """

    name = "abstract"
    # True when the model may hand ``attend`` its qkv projection's output (kernels/decode_attention.NewToken)
    # instead of calling ``forward``: the backend norms and rotates q/k and writes K/V itself.
    fused_prologue = False

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_idx: int,
        batch: ForwardBatch,
        scale: float,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def attend(
        self, q, layer_idx: int, batch: ForwardBatch, scale: float, *, window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Attention from the qkv projection's output (kernels/decode_attention.NewToken), K/V written here
        (backends with ``fused_prologue``)."""
        raise NotImplementedError(f"the {self.name} attention backend has no fused prologue; call forward()")

    def leaves_room(self, batch: ForwardBatch, layer_idx: int) -> bool:
        """Whether this step's attention kernel runs all its programs in one wave with room beside them (a decode
        step at small batch), so that the launch after it may place its programs next to them without delaying
        any of attention's (kernels/pdl.pdl_joined)."""
        return False

    def quantizes_output(self, batch: ForwardBatch) -> bool:
        """Whether ``attend_quantized`` may write this step's output quantized: a model asks before it works
        out the layout its projection wants, so steps no kernel writes so cost nothing."""
        return False

    def attend_quantized(
        self, q, layer_idx: int, batch: ForwardBatch, scale: float, group_size: int, pad_rows_to: int,
        scales_column_major: bool, *, window: int | None = None, sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """``attend``'s output [T, H * D] quantized per token and ``group_size`` columns as
        kernels/fp8_quant.per_token_group_quant lays it out (``(fp8 [T', H * D], fp32 scales [T', groups])``),
        written by the attention kernel itself; None where this backend or this step cannot (the caller
        then attends and quantizes separately)."""
        return None
