"""DeepSeek-V4 attention: one shared K=V latent head, a sliding window with sinks, and compressed entries.

As transformers' ``DeepseekV4Attention`` computes it: q through a LoRA (``q_a_proj``, ``q_a_norm``, ``q_b_proj``)
and a per-head unweighted RMSNorm; the latent ``kv_norm(kv_proj(x))``; both rotated on their trailing ``rope_dim``
dims as interleaved pairs. Each query attends, with its head's sink logit in the denominator, over the last
``sliding_window`` latents (itself included) and, per layer type, the compressed entries of groups it has seen
(layers/v4_compressor.py): every one (HCA) or the ``index_topk`` its lightning indexer scores highest (CSA). Values
are the keys, so the output's rope part is rotated back at the query's position before the grouped low-rank output
projection (``o_groups`` blocks of ``o_a_proj``, then ``o_b_proj``). Sliding-only layers rotate with the "main" rope,
compressed ones with the "compress" rope.

This runs on the PyTorch reference path only: the Triton kernels for compression and for CSA/HCA decode and extend
do not exist yet, and the layer refuses CUDA inputs by name rather than run this path there. It is built from the
family's V4Shape (deepseek_v4_shape.py), so it sits beside the family rather than among the shared layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from graphserve.errors import ConfigError
from graphserve.kernels.dsa_reference import topk_indices
from graphserve.kernels.paged_kv import to_cache_dtype
from graphserve.layers.attention import softmax_with_sinks
from graphserve.layers.hyper_connection import Float32Params
from graphserve.layers.linear import Linear
from graphserve.layers.norm import RMSNorm
from graphserve.layers.rotary import rope_tables
from graphserve.layers.v4_compressor import CompressorBranch, rope_trailing, token_slots
from graphserve.models.deepseek_v4_shape import CSA, SLIDING, V4Shape

if TYPE_CHECKING:
    from graphserve.layers.forward_batch import ForwardBatch

QUERY_ROWS = 256  # query rows scored at once: bounds the gathered [rows, window + entries, head_dim] keys
# the indexer's gathered keys [rows, entries, index_head_dim] and dots [rows, heads, entries] (fp32) at once: 256 MiB
SCORE_ELEMENTS = 1 << 26


class V4Compressor(Float32Params):
    """A compressed layer's learned pooling (``compressor.*``; in CSA also ``compressor.indexer.*``)."""

    float32_params = ("position_bias",)

    def __init__(self, s: V4Shape, layer: int, width: int, dim: int, overlap: bool) -> None:
        super().__init__()
        series = 2 if overlap else 1
        self.rate = s.rate(layer)
        self.kv_proj = Linear(s.hidden_size, series * dim, bias=False)
        self.gate_proj = Linear(s.hidden_size, series * dim, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(self.rate, series * dim, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, s.rms_norm_eps)
        self.width = width


class V4Indexer(V4Compressor):
    def __init__(self, s: V4Shape, layer: int) -> None:
        super().__init__(s, layer, 2 * s.index_head_dim, s.index_head_dim, overlap=True)
        self.heads, self.dim, self.topk = s.index_n_heads, s.index_head_dim, s.index_topk
        self.q_b_proj = Linear(s.q_lora_rank, s.index_n_heads * s.index_head_dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = Linear(s.hidden_size, s.index_n_heads, bias=False)


class V4Attention(Float32Params):
    float32_params = ("sinks",)

    def __init__(self, s: V4Shape, layer: int, cache_index: int | None) -> None:
        super().__init__()
        self.layer, self.layer_type, self.cache_index = layer, s.layer_types[layer], cache_index
        self.heads, self.head_dim, self.window, self.groups = s.num_heads, s.head_dim, s.sliding_window, s.o_groups
        self.eps, self.scale = s.rms_norm_eps, s.head_dim**-0.5
        h = s.hidden_size
        self.q_a_proj = Linear(h, s.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(s.q_lora_rank, s.rms_norm_eps)
        self.q_b_proj = Linear(s.q_lora_rank, s.num_heads * s.head_dim, bias=False)
        self.kv_proj = Linear(h, s.head_dim, bias=False)
        self.kv_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        # the grouped projection's weight: group g's rows [g * o_lora, (g + 1) * o_lora) read its heads' outputs
        self.o_a_proj = Linear(s.num_heads * s.head_dim // s.o_groups, s.o_groups * s.o_lora_rank, bias=False)
        self.o_b_proj = Linear(s.o_groups * s.o_lora_rank, h, bias=False)
        self.sinks = nn.Parameter(torch.zeros(s.num_heads, dtype=torch.float32))
        rope = s.rope_main if self.layer_type == SLIDING else s.rope_compress
        # V4 leaves yarn's attention factor at 1 (transformers' config sets it): only the frequencies are used
        self._rope = (s.rope_dim, rope)
        self.register_buffer("inv_freq", rope_tables(*self._rope)[0], persistent=False)
        self.compressor = self.branches = None
        if self.layer_type != SLIDING:
            csa = self.layer_type == CSA
            d, di = s.head_dim, s.index_head_dim
            self.compressor = V4Compressor(s, layer, 2 * d if csa else d, d, overlap=csa)
            state = s.state_width(layer)
            self.branches = [CompressorBranch(0, self.compressor.width, state, d, csa)]
            if csa:
                self.compressor.indexer = V4Indexer(s, layer)
                self.branches.append(CompressorBranch(4 * d, 2 * di, state + d, di, True))

    def rebuild(self, device: torch.device) -> None:
        """After the loader's ``to_empty``: the frequencies are not a parameter, so they are computed again."""
        self.inv_freq = rope_tables(*self._rope)[0].to(device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if x.is_cuda:
            raise ConfigError(f"DeepseekV4 layer {self.layer} ({self.layer_type}): the compressed and windowed "
                              "latent attention has no CUDA kernel yet; it runs on the CPU reference path only",
                              param="device")  # fmt: skip
        t = x.shape[0]
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_res).view(t, self.heads, self.head_dim)
        q = rope_trailing(q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype),
                          positions, self.inv_freq)  # fmt: skip
        kv = rope_trailing(self.kv_norm(self.kv_proj(x)), positions, self.inv_freq)
        latents = batch.kv_caches[self.layer]
        block_size = latents.shape[1]
        flat = latents.view(-1, self.head_dim)
        flat[batch.slot_mapping] = to_cache_dtype(kv, flat.dtype)
        row_seq = torch.repeat_interleave(torch.arange(batch.num_seqs, device=x.device),
                                          torch.diff(batch.query_start_loc.long()), output_size=t)  # fmt: skip
        rows = None
        if self.compressor is not None:
            rows = batch.kv_caches[self.cache_index].view(-1, batch.kv_caches[self.cache_index].shape[-1])
            self._compress(x, positions, batch, row_seq, rows, block_size)
        out = torch.empty(t, self.heads, self.head_dim, dtype=torch.float32, device=x.device)
        width = self.window
        if self.compressor is not None:
            entries = batch.max_seq_len // self.compressor.rate
            width += min(entries, self.compressor.indexer.topk) if len(self.branches) > 1 else entries
        step = max(1, min(QUERY_ROWS, SCORE_ELEMENTS // (width * max(self.head_dim, self.heads))))
        for lo in range(0, t, step):
            part = slice(lo, min(t, lo + step))
            out[part] = self._attend(q[part], q_res[part], x[part], positions[part], row_seq[part], batch, flat,
                                     rows, block_size)  # fmt: skip
        out = rope_trailing(out.to(x.dtype), positions, self.inv_freq, sign=-1.0)
        grouped = out.view(t, self.groups, -1).transpose(0, 1)  # [groups, T, heads * head_dim / groups]
        w = self.o_a_proj.weight
        if self.o_a_proj.quant_method is not None:  # FP4/FP8: the block-diagonal product reads its dequantized rows
            w = self.o_a_proj.quant_method.dequantized_weight(self.o_a_proj, x.dtype)
        w = w.view(self.groups, -1, grouped.shape[-1])
        mixed = torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(t, -1)
        return self.o_b_proj(mixed)

    def _compress(self, x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, row_seq: torch.Tensor,
                  rows: torch.Tensor, block_size: int) -> None:  # fmt: skip
        """Write the new tokens' compressor state, then pool every group one of them completes."""
        c = self.compressor
        modules = [c] + ([c.indexer] if len(self.branches) > 1 else [])
        for branch, m in zip(self.branches, modules):
            branch.write_state(rows, batch.slot_mapping, m.kv_proj(x), m.gate_proj(x))
        m_rate = c.rate
        closing = ((positions + 1) % m_rate == 0).nonzero().flatten()
        if closing.numel() == 0:
            return
        first = positions[closing] + 1 - m_rate  # each closed group's first position
        seq = row_seq[closing]
        span = torch.arange(m_rate, device=x.device)
        group = token_slots(batch.block_tables, seq, first[:, None] + span, block_size)
        prev = token_slots(batch.block_tables, seq, first[:, None] - m_rate + span, block_size)
        for branch, m in zip(self.branches, modules):
            branch.close_groups(rows, group, prev, first > 0, batch.slot_mapping[closing], m.position_bias,
                                m.kv_norm.weight, self.eps, first, self.inv_freq)  # fmt: skip

    def _attend(self, q: torch.Tensor, q_res: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                row_seq: torch.Tensor, batch: ForwardBatch, latents: torch.Tensor, rows: torch.Tensor | None,
                block_size: int) -> torch.Tensor:  # fmt: skip
        """fp32 ``[rows, heads, head_dim]``: each query over its window's latents and its compressed entries."""
        pos = positions.long()
        window_pos = pos[:, None] - torch.arange(self.window - 1, -1, -1, device=q.device)
        keys = latents[token_slots(batch.block_tables, row_seq, window_pos, block_size)].float()
        seen = window_pos >= 0
        if rows is not None:
            rate = self.compressor.rate
            visible = (pos + 1) // rate  # entries of the groups this query has seen
            n = int(visible.max())
            if n > 0:
                ent_pos = (torch.arange(n, device=q.device) + 1) * rate - 1
                ent_slots = token_slots(batch.block_tables, row_seq, ent_pos.expand(len(pos), -1), block_size)
                ent_seen = torch.arange(n, device=q.device)[None, :] < visible[:, None]
                if len(self.branches) > 1:  # CSA: the indexer keeps the index_topk best-scored entries
                    picked = self._select(q_res, x, positions, rows, ent_slots, visible)
                    ent_seen = picked >= 0
                    ent_slots = ent_slots.gather(1, picked.long().clamp(min=0))
                entries = self.branches[0].entries(rows, ent_slots).float()
                keys, seen = torch.cat([keys, entries], dim=1), torch.cat([seen, ent_seen], dim=1)
        scores = torch.einsum("thd,tkd->thk", q.float(), keys) * self.scale
        scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
        probs = softmax_with_sinks(scores, self.sinks.view(1, -1, 1))
        return torch.einsum("thk,tkd->thd", probs, keys)

    def _select(self, q_res: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                ent_slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The lightning indexer's choice ``[rows, k]`` (indices into the entries, -1 where fewer are visible):
        ``sum_h w_h * relu(q_h . key) / sqrt(index_head_dim)`` with ``w = weights_proj(x) / sqrt(index_n_heads)``,
        the top ``index_topk`` among the visible ones (kernels/dsa_reference.topk_indices)."""
        ix = self.compressor.indexer
        q = ix.q_b_proj(q_res).view(-1, ix.heads, ix.dim)
        q = rope_trailing(q, positions, self.inv_freq).float()
        weights = ix.scorer.weights_proj(x).float() * ix.heads**-0.5
        n = ent_slots.shape[1]
        scores = torch.empty(q.shape[0], n, dtype=torch.float32, device=q.device)
        step = max(1, SCORE_ELEMENTS // (n * max(ix.heads, ix.dim)))  # rows whose keys and dots fit the bound
        for lo in range(0, q.shape[0], step):
            part = slice(lo, lo + step)
            keys = self.branches[1].entries(rows, ent_slots[part]).float()
            dots = torch.einsum("thd,tkd->thk", q[part], keys).relu_() * ix.dim**-0.5
            scores[part] = torch.einsum("th,thk->tk", weights[part], dots)
        return topk_indices(scores, visible - 1, min(ix.topk, n))
