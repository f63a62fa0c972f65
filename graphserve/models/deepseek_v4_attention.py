"""DeepSeek-V4 attention: one shared K=V latent head, a sliding window with sinks, and compressed entries.

As transformers' ``DeepseekV4Attention`` computes it: q through a LoRA (``q_a_proj``, ``q_a_norm``, ``q_b_proj``)
and a per-head unweighted RMSNorm; the latent ``kv_norm(kv_proj(x))``; both rotated on their trailing ``rope_dim``
dims as interleaved pairs. Each query attends, with its head's sink logit in the denominator, over the last
``sliding_window`` latents (itself included) and, per layer type, the compressed entries of groups it has seen
(kernels/v4_reference.py): every one (HCA) or the ``index_topk`` its lightning indexer scores highest (CSA). Values
are the keys, so the output's rope part is rotated back at the query's position before the grouped low-rank output
projection (``o_groups`` blocks of ``o_a_proj``, then ``o_b_proj``). Sliding-only layers rotate with the "main" rope,
compressed ones with the "compress" rope.

Two paths, chosen as layers/dsa_indexer.dsa_ops chooses: the Triton kernels exactly when the step's attention
backend is the Triton one, else kernels/v4_reference.py. The kernel path reads nothing back to the host and has
static shapes (the block tables' width bounds every list), so a decode step captures in a CUDA graph: each
sequence's compressor checkpoint is gathered by index, kernels/v4_compress.py folds the step's projections into it,
closes the groups and writes the blocks' checkpoints on the device, CSA's indexer scores
every compressed key (kernels/dsa_indexer.compressed_indexer_scores) and keeps ``index_topk`` by kernels/dsa.py's
top-k, and kernels/v4_attention.py attends over window + entries + sinks, split and merged. It serves decode and
extend alike: each row gathers its own keys (a batched gather, one program per row and head block), so an extend
chunk is the same launch with more rows. Padding rows of a graph batch sit at position 0 on the dummy block: they
write only the dummy block's first latent slot, and, lying past the batch's last real row, no entry or checkpoint.
It is built from the family's V4Shape (deepseek_v4_shape.py), so it sits beside the family rather than among
the shared layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from graphserve.distributed.state import get_parallel, split_evenly
from graphserve.kernels import v4_reference as ref
from graphserve.kernels.dsa_reference import token_rows, topk_indices
from graphserve.kernels.paged_kv import to_cache_dtype
from graphserve.kernels.v4_reference import CompressorBranch, rope_trailing
from graphserve.kernels.v4_rope import v4_rope, v4_rope_reference
from graphserve.layers.hyper_connection import Float32Params
from graphserve.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from graphserve.layers.norm import RMSNorm
from graphserve.layers.rotary import rope_tables
from graphserve.models.deepseek_v4_shape import CSA, SLIDING, V4Shape

if TYPE_CHECKING:
    from graphserve.layers.forward_batch import ForwardBatch

QUERY_ROWS = 256  # query rows scored at once: bounds the gathered [rows, window + entries, head_dim] keys
# the indexer's gathered keys [rows, entries, index_head_dim] and dots [rows, heads, entries] (fp32) at once: 256 MiB
SCORE_ELEMENTS = 1 << 26
# kernel path: rows whose [rows, entries] fp32 scores exist at once (at 512k tokens, 128k entries: 128 MiB)
INDEXER_ROWS = 256


def use_kernels(batch: ForwardBatch) -> bool:
    """The Triton kernels exactly when the engine chose its Triton backend (layers/dsa_indexer.dsa_ops's rule)."""
    return getattr(batch.attn_backend, "name", "torch") == "triton"


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
        self.map_index = s.num_layers + len(s.compressed_layers)  # the latent page map (KVLayout.latent_map_index)
        # --tp splits whole output groups (and so their heads); the latent, the compressor and the indexer are
        # replicated, so every rank's kernels see the tp-1 cache and choose the same entries
        tp_rank, tp = get_parallel().tp_rank, get_parallel().tp_size
        groups = split_evenly(s.o_groups, tp, "o_groups")
        self.tp_rank, self.heads, self.groups = tp_rank, s.num_heads // tp, groups
        self.head_dim, self.window = s.head_dim, s.sliding_window
        self.eps, self.scale = s.rms_norm_eps, s.head_dim**-0.5
        h = s.hidden_size
        self.q_a_proj = Linear(h, s.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(s.q_lora_rank, s.rms_norm_eps)
        self.q_b_proj = ColumnParallelLinear(s.q_lora_rank, s.num_heads * s.head_dim, False, tp_rank, tp)
        self.kv_proj = Linear(h, s.head_dim, bias=False)
        self.kv_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        # the grouped projection's weight: group g's rows [g * o_lora, (g + 1) * o_lora) read its heads' outputs;
        # a rank holds its groups' rows of o_a_proj and their columns of o_b_proj, whose sum the layer all-reduces
        in_per_group = s.num_heads * s.head_dim // s.o_groups
        self.o_a_proj = ColumnParallelLinear(in_per_group, s.o_groups * s.o_lora_rank, False, tp_rank, tp)
        self.o_b_proj = RowParallelLinear(s.o_groups * s.o_lora_rank, h, False, tp_rank, tp)
        self.sinks = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))
        rope = s.rope_main if self.layer_type == SLIDING else s.rope_compress
        # V4 leaves yarn's attention factor at 1 (transformers' config sets it): only the frequencies are used
        self._rope = (s.rope_dim, rope)
        self.register_buffer("inv_freq", rope_tables(*self._rope)[0], persistent=False)
        self.compressor = self.branches = None
        if self.layer_type != SLIDING:
            csa = self.layer_type == CSA
            d, di = s.head_dim, s.index_head_dim
            self.compressor = V4Compressor(s, layer, 2 * d if csa else d, d, overlap=csa)
            # the compact page's layout (layers/kv_layout.CompactCache): checkpoint, then entry rows [latent | key]
            self.state_floats, self.entry_width = s.state_floats(layer), s.entry_width(layer)
            self.branches = [CompressorBranch(self.compressor.width, d, csa, 0, 0)]
            if csa:
                self.compressor.indexer = V4Indexer(s, layer)
                self.branches.append(CompressorBranch(2 * di, di, True, d, 4 * d))

    @torch.no_grad()
    def load_weight(self, param_name: str, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        """``sinks``: this rank's heads' slice of the checkpoint's one logit per head."""
        whole = self.heads * get_parallel().tp_size
        if param_name != "sinks" or shard is not None or tuple(loaded.shape) != (whole,):
            raise ValueError(f"shape {tuple(loaded.shape)}, expected ({whole},)")
        param.data.copy_(loaded[self.tp_rank * self.heads : (self.tp_rank + 1) * self.heads])

    def rebuild(self, device: torch.device) -> None:
        """After the loader's ``to_empty``: the frequencies are not a parameter, so they are computed again."""
        self.inv_freq = rope_tables(*self._rope)[0].to(device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch,
                latent_slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """``latent_slots [T]``: where each new token's latent goes in the latent pages (V4Model maps the slots)."""
        t = x.shape[0]
        kernels = use_kernels(batch)
        rope = v4_rope if kernels else v4_rope_reference  # one launch a rotation, or the PyTorch specification
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = rope(self.q_b_proj(q_res).view(t, self.heads, self.head_dim), positions, self.inv_freq,
                 norm_eps=self.eps)  # fmt: skip
        kv = rope(self.kv_norm(self.kv_proj(x)), positions, self.inv_freq)
        latents = batch.kv_caches[self.layer]
        block_size = latents.shape[1]
        flat = latents.view(-1, self.head_dim)
        flat[latent_slots] = to_cache_dtype(kv, flat.dtype)
        if kernels:
            out = self._forward_kernels(q, q_res, x, positions, batch, flat, block_size)
            out = v4_rope(out, positions, self.inv_freq, sign=-1.0, out=out)  # written fresh: rotated in place
        else:
            out = self._forward_reference(q, q_res, x, positions, batch, flat, block_size)
            out = rope_trailing(out.to(x.dtype), positions, self.inv_freq, sign=-1.0)
        grouped = out.view(t, self.groups, -1).transpose(0, 1)  # [groups, T, heads * head_dim / groups]
        return self.o_b_proj(self._grouped_o_a(grouped).transpose(0, 1).reshape(t, -1))

    def check_quantized(self) -> None:
        """At load, once the projections are quantized: each group's rows of ``o_a_proj`` must be a row range its
        method runs alone (``apply_rows``; fp8 blocks: whole scale blocks), refused naming o_lora_rank."""
        proj = self.o_a_proj
        check = getattr(proj.quant_method, "check_rows", None)
        if check is None:
            return
        rank = proj.out_features // self.groups
        try:
            for g in range(self.groups):
                check(proj, g * rank, (g + 1) * rank)
        except ValueError as e:
            raise ValueError(f"o_lora_rank={rank}: each of o_a_proj's {self.groups} output groups runs on its own "
                             f"rows, which must be whole scale blocks ({e})") from e

    def _grouped_o_a(self, grouped: torch.Tensor) -> torch.Tensor:
        """The block-diagonal ``o_a_proj``: group g's rows of the weight times group g's slice of the heads,
        ``[groups, T, o_lora_rank]``. FP4 and FP8 weights run one call per group on that group's quantized rows and
        their scales (``apply_rows``: no dequantized copy of the weight a step); the model dtype one ``bmm``."""
        proj, g = self.o_a_proj, self.groups
        method = proj.quant_method
        if method is not None:
            rank = proj.out_features // g
            return torch.stack([method.apply_rows(proj, grouped[i], i * rank, (i + 1) * rank) for i in range(g)])
        return torch.bmm(grouped, proj.weight.view(g, -1, grouped.shape[-1]).transpose(1, 2))

    def _forward_kernels(self, q: torch.Tensor, q_res: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                         batch: ForwardBatch, flat: torch.Tensor, block_size: int) -> torch.Tensor:  # fmt: skip
        """``[T, heads, head_dim]`` in the model dtype on the Triton kernels: no host sync, static shapes."""
        from graphserve.kernels import dsa, v4_attention, v4_compress
        from graphserve.kernels.dsa_indexer import compressed_indexer_scores

        row_seq, _ = token_rows(batch.query_start_loc, batch.seq_lens, x.shape[0])
        pages, rate, sf, ew, idx = None, 0, 0, 0, None
        if self.compressor is not None:
            c = self.compressor
            pages, rate, sf, ew = batch.kv_caches[self.cache_index], c.rate, self.state_floats, self.entry_width
            init = ref.start_checkpoints(ref.checkpoints(pages, sf), batch.block_tables, positions,
                                         batch.query_start_loc, block_size)  # fmt: skip
            modules = [c] + ([c.indexer] if len(self.branches) > 1 else [])
            for branch, m in zip(self.branches, modules):
                v4_compress.compress_groups(pages, branch, m.kv_proj(x), m.gate_proj(x), init, batch.block_tables,
                                            row_seq, positions, batch.query_start_loc, rate, m.position_bias,
                                            m.kv_norm.weight, self.eps, self.inv_freq, block_size, sf, ew)  # fmt: skip
            if len(self.branches) > 1:
                ix = c.indexer
                qi = v4_rope(ix.q_b_proj(q_res).view(-1, ix.heads, ix.dim), positions, self.inv_freq)
                # relu(s) * c == relu(s * c) for c > 0: the key-dim scale joins the head weights
                weights = (ix.scorer.weights_proj(x).float() * (ix.heads**-0.5 * ix.dim**-0.5)).contiguous()
                last = ((positions + 1) // rate - 1).to(torch.int32)
                keys = batch.block_tables.shape[1] * block_size // rate  # static: every entry a table can hold
                parts = []
                for lo in range(0, x.shape[0], INDEXER_ROWS):
                    part = slice(lo, lo + INDEXER_ROWS)
                    scores = compressed_indexer_scores(qi[part], weights[part], pages, self.branches[1].entry_at, rate,
                                                       block_size, batch.block_tables, row_seq[part], last[part],
                                                       keys, state_floats=sf, entry_width=ew)  # fmt: skip
                    parts.append(dsa.topk_indices(scores, last[part], ix.topk))
                idx = parts[0] if len(parts) == 1 else torch.cat(parts)
        # written in the model dtype, the rounding the reference applies before rotating back: a prefill chunk's
        # fp32 output would be twice the bytes (1 GiB at 8k rows) and one more pass
        out = torch.empty(q.shape, dtype=x.dtype, device=x.device)
        return v4_attention.v4_attention(q.contiguous(), flat, pages, 0, batch.block_tables, row_seq, positions,
                                         self.sinks, self.scale, self.window, rate, block_size, idx, sf, ew, out=out,
                                         latent_page=batch.kv_caches[self.map_index])  # fmt: skip

    def _forward_reference(self, q: torch.Tensor, q_res: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                           batch: ForwardBatch, flat: torch.Tensor, block_size: int) -> torch.Tensor:  # fmt: skip
        """fp32 ``[T, heads, head_dim]`` on kernels/v4_reference.py, in slices of rows that bound the gathers."""
        t = x.shape[0]
        row_seq = torch.repeat_interleave(torch.arange(batch.num_seqs, device=x.device),
                                          torch.diff(batch.query_start_loc.long()), output_size=t)  # fmt: skip
        rows = None
        if self.compressor is not None:
            rows = batch.kv_caches[self.cache_index]
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
        return out

    def _compress(self, x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, row_seq: torch.Tensor,
                  rows: torch.Tensor, block_size: int) -> None:  # fmt: skip
        """Fold the new tokens into the sequences' compressor checkpoints: the entry of every group one of them
        completes, the checkpoint of every block one ends or the step ends in."""
        c = self.compressor
        init = ref.start_checkpoints(ref.checkpoints(rows, self.state_floats), batch.block_tables, positions,
                                     batch.query_start_loc, block_size)  # fmt: skip
        modules = [c] + ([c.indexer] if len(self.branches) > 1 else [])
        for branch, m in zip(self.branches, modules):
            ref.compress_groups(rows, branch, m.kv_proj(x), m.gate_proj(x), init, batch.block_tables, row_seq,
                                positions, batch.query_start_loc, c.rate, m.position_bias, m.kv_norm.weight, self.eps,
                                self.inv_freq, block_size, self.state_floats, self.entry_width)  # fmt: skip

    def _attend(self, q: torch.Tensor, q_res: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                row_seq: torch.Tensor, batch: ForwardBatch, latents: torch.Tensor, rows: torch.Tensor | None,
                block_size: int) -> torch.Tensor:  # fmt: skip
        """fp32 ``[rows, heads, head_dim]``: each query over its window's latents and its compressed entries."""
        rate = self.compressor.rate if rows is not None else 0
        idx = None
        if len(self.branches or ()) > 1:  # CSA: the indexer keeps the index_topk best-scored entries
            visible = (positions.long() + 1) // rate
            n = int(visible.max())
            if n > 0:
                idx = self._select(q_res, x, positions, rows, batch.block_tables, row_seq, n, block_size, visible)
        sf, ew = (self.state_floats, self.entry_width) if rows is not None else (0, 0)
        return ref.v4_attention(q, latents, rows, 0, batch.block_tables, row_seq, positions, self.sinks,
                                self.scale, self.window, rate, block_size, idx, sf, ew, batch.kv_caches[self.map_index])

    def _select(self, q_res: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, pages: torch.Tensor,
                block_tables: torch.Tensor, row_seq: torch.Tensor, n: int, block_size: int,
                visible: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The lightning indexer's choice ``[rows, k]`` (indices into the entries, -1 where fewer are visible):
        ``sum_h w_h * relu(q_h . key) / sqrt(index_head_dim)`` with ``w = weights_proj(x) / sqrt(index_n_heads)``,
        the top ``index_topk`` among the visible ones (kernels/dsa_reference.topk_indices)."""
        ix = self.compressor.indexer
        q = ix.q_b_proj(q_res).view(-1, ix.heads, ix.dim)
        q = rope_trailing(q, positions, self.inv_freq).float()
        weights = ix.scorer.weights_proj(x).float() * ix.heads**-0.5
        scores = torch.empty(q.shape[0], n, dtype=torch.float32, device=q.device)
        step = max(1, SCORE_ELEMENTS // (n * max(ix.heads, ix.dim)))  # rows whose keys and dots fit the bound
        every = torch.arange(n, device=q.device)
        for lo in range(0, q.shape[0], step):
            part = slice(lo, lo + step)
            seqs = row_seq[part]
            keys = ref.entries(pages, block_tables, seqs, every.expand(len(seqs), -1), self.compressor.rate,
                               block_size, self.state_floats, self.entry_width, self.branches[1].entry_at, ix.dim)  # fmt: skip
            scores[part] = ref.indexer_scores(q[part], weights[part], keys, visible[part])
        return topk_indices(scores, visible - 1, min(ix.topk, n))
