"""Multi-head latent attention (DeepSeek-V2/V3): the projections, and the backend that caches and attends.

Per token the layer projects the (normed) hidden state once into the q path (``q_proj``, or the
``q_a_proj`` LoRA with its norm and ``q_b_proj``) and ``kv_a_proj_with_mqa`` (the compressed KV and
the shared rope key). Both read the same input, so they are one fused matmul
(``fused_qkv_a_proj``) that the decoder layer also fuses with its input norm at decode sizes.

Only the normed latent and the rotated rope key are cached (layers/kv_layout.py, kind "latent").
The backend is chosen from the step's attention backend: the Torch one (CPU, and the reference on
GPU) gets ``TorchMLABackend``, the Triton one ``TritonMLABackend`` (layers/mla_triton.py).

Tensor parallelism splits the heads: each rank holds its heads' rows of ``q_proj`` / ``q_b_proj`` and
of ``kv_b_proj`` (so the ``W_UK`` / ``W_UV`` views are its heads' up-projections) and their columns
of ``o_proj``, whose output is then a partial sum the caller all-reduces. The latent and the rope key
belong to no head: every rank computes ``kv_a_proj_with_mqa`` (and ``q_a_proj``) whole and writes the
same latent cache: every head reads all of it, so a cache split over ranks would have to be gathered
back inside each attention. The price is that --tp does not shrink the cache per rank (it does shrink
the weights). The backends and kernels see the tp-1 shapes with fewer heads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from graphserve.distributed.state import split_evenly
from graphserve.kernels.mla_prologue import write_latent_cache
from graphserve.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from graphserve.layers.mla_reference import absorbed_decode_batched, expanded_attention
from graphserve.layers.norm import RMSNorm

if TYPE_CHECKING:
    from graphserve.layers.forward_batch import ForwardBatch
    from graphserve.layers.mla_rope import DeepseekRotary

# DeepSeek's q_a_layernorm and kv_a_layernorm are built with the RMSNorm default, not rms_norm_eps
# (transformers and the checkpoints' reference code both do this)
LORA_NORM_EPS = 1e-6


class FusedQKVAProj(MergedColumnParallelLinear):
    """``q_proj`` (or ``q_a_proj``) and ``kv_a_proj_with_mqa`` in one matmul: shard 0 is this rank's
    heads of ``q_proj`` when there is no q LoRA, else the whole ``q_a_proj``; shard 1, the latent and
    rope key, is whole on every rank."""

    def __init__(self, hidden_size: int, q_size: int, split_q: bool, kv_a_size: int, bias: bool, tp_rank: int,
                 tp_size: int) -> None:  # fmt: skip
        # "full" sizes that split to the local ones: a replicated shard is tp copies of itself
        full = [q_size if split_q else q_size * tp_size, kv_a_size * tp_size]
        super().__init__(hidden_size, full, bias, tp_rank, tp_size)
        self.split_q = split_q

    def shard_slice(self, shard: int) -> tuple[int, int]:
        if shard == 0 and self.split_q:
            return super().shard_slice(0)
        return 0, self.output_sizes[shard]


class MLAttention(nn.Module):
    """MLA over this rank's ``num_heads / tp_size`` heads (all of them at tp 1); ``forward`` returns
    ``o_proj``'s partial sum, which the caller all-reduces."""

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, attention_bias: bool,
                 rotary: DeepseekRotary, scale: float, layer_idx: int, tp_rank: int = 0,
                 tp_size: int = 1) -> None:  # fmt: skip
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = split_evenly(num_heads, tp_size, "num_attention_heads")  # this rank's heads
        self.kv_lora_rank, self.q_lora_rank = kv_lora_rank, q_lora_rank
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.scale = scale
        q_out = num_heads * self.qk_dim
        # transformers gives q_proj no bias and q_a_proj / kv_a_proj the attention bias
        bias = attention_bias and q_lora_rank is not None
        if attention_bias and q_lora_rank is None:
            raise ValueError("attention_bias with q_lora_rank=None (a bias on kv_a_proj only) is not supported")
        # shard 0: q_proj (no q LoRA) or q_a_proj; shard 1: kv_a_proj_with_mqa
        self.fused_qkv_a_proj = FusedQKVAProj(hidden_size, q_out if q_lora_rank is None else q_lora_rank,
                                              q_lora_rank is None, kv_lora_rank + qk_rope_head_dim, bias, tp_rank,
                                              tp_size)  # fmt: skip
        if q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, q_out, False, tp_rank, tp_size)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LORA_NORM_EPS)
        # rows are head-major ([H, nope + v]): a rank's contiguous slice is its heads' W_UK and W_UV
        self.kv_b_proj = ColumnParallelLinear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), False,
                                              tp_rank, tp_size)  # fmt: skip
        self.o_proj = RowParallelLinear(num_heads * v_head_dim, hidden_size, attention_bias, tp_rank, tp_size)
        self.rotary = [rotary]  # a list, so the shared module is not registered once per layer

    # ---- views of kv_b_proj: per-head up-projections, no copies --------------------------------
    def w_kv_b(self) -> torch.Tensor:
        """``[H, nope + v, r]``."""
        return self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)

    def w_uk(self) -> torch.Tensor:
        """``[H, nope, r]``: the key up-projection, absorbed into the query."""
        return self.w_kv_b()[:, : self.nope]

    def w_uv(self) -> torch.Tensor:
        """``[H, v, r]``: the value up-projection, applied to the latent-space output."""
        return self.w_kv_b()[:, self.nope :]

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """``q_nope [T, H, nope]`` -> ``q_lat [H, T, r]`` (one batched matmul over heads)."""
        return torch.bmm(q_nope.transpose(0, 1), self.w_uk())

    def unabsorb_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """``o_lat [H, T, r]`` -> ``[T, H, v]``, written token-major so o_proj reads it without a copy."""
        out = o_lat.new_empty(o_lat.shape[1], self.num_heads, self.v_dim)
        torch.bmm(o_lat, self.w_uv().transpose(1, 2), out=out.transpose(0, 1))
        return out

    def warmup_work(self, attn_backend, kv_caches: list[torch.Tensor], max_model_len: int) -> list[tuple]:
        """Launches to run once before serving (engine/warmup.py), as ``(key, run)`` pairs: whatever the MLA
        backend serving ``attn_backend`` asks for, for this layer's shapes; pairs of one key run once."""
        work = getattr(mla_backend(attn_backend), "warmup_work", None)
        return work(self, kv_caches[self.layer_idx], max_model_len) if work is not None else []

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, positions: torch.Tensor, fused: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attention from the fused q/kv-a projection's output ``[T, first + r + d]``; returns ``[T, hidden]``."""
        t = fused.shape[0]
        q_part, kv_a = fused.split(self.fused_qkv_a_proj.output_sizes, dim=-1)
        if self.q_lora_rank is not None:
            q_part = self.q_b_proj(self.q_a_layernorm(q_part))
        q = q_part.view(t, self.num_heads, self.qk_dim)
        out = mla_backend_for(batch).forward(self, q, kv_a, positions, batch)
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))


class TorchMLABackend:
    """CPU path: expanded K/V for prefill and extend (the reference), absorbed batched decode."""

    name = "torch"

    def forward(self, layer: MLAttention, q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:  # fmt: skip
        r, rotary = layer.kv_lora_rank, layer.rotary[0]
        latent = layer.kv_a_layernorm(kv_a[:, :r].contiguous())
        k_rope = rotary(kv_a[:, None, r:], positions)[:, 0]
        q_nope, q_rope = q[..., : layer.nope], rotary(q[..., layer.nope :], positions)
        cache = batch.kv_caches[layer.layer_idx]
        write_latent_cache(latent, k_rope, cache, batch.slot_mapping)
        if batch.mode == "decode":
            q_lat = layer.absorb_query(q_nope).transpose(0, 1)
            o_lat = absorbed_decode_batched(q_lat, q_rope, cache, batch.block_tables, batch.seq_lens, layer.scale)
            return layer.unabsorb_output(o_lat.transpose(0, 1))
        query_lens = batch.query_lens_cpu or torch.diff(batch.query_start_loc).tolist()
        seq_lens = batch.seq_lens_cpu or batch.seq_lens.tolist()
        q_full = torch.cat((q_nope, q_rope), dim=-1)
        return expanded_attention(q_full, cache, layer.w_kv_b(), batch.block_tables, query_lens, seq_lens,
                                  layer.nope, layer.scale)


_TORCH = TorchMLABackend()
_TRITON = None


def mla_backend_for(batch: ForwardBatch):
    """The MLA backend matching the step's attention backend: Triton kernels exactly when the engine
    chose its Triton backend, so a GPU run on the Torch backend stays a pure-PyTorch reference."""
    return mla_backend(batch.attn_backend)


def mla_backend(attn_backend):
    """``mla_backend_for`` from the engine's attention backend itself (the warm-up has no step)."""
    global _TRITON
    explicit = getattr(attn_backend, "mla", None)
    if explicit is not None:
        return explicit
    if getattr(attn_backend, "name", "torch") != "triton":
        return _TORCH
    if _TRITON is None:
        from graphserve.layers.mla_triton import TritonMLABackend

        _TRITON = TritonMLABackend()
    return _TRITON
