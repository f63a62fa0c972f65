"""DeepSeek-V4's compression and attention maths in plain PyTorch: the reference of kernels/v4_compress.py and
kernels/v4_attention.py, and the path the layer (models/deepseek_v4_attention.py) runs on the CPU.

Compression. A compressed layer pools each group of ``m`` consecutive tokens (``m`` = the layer type's
``compress_rates``) into one entry: ``entry_w = rmsnorm(sum_j softmax_j(gate_j + bias_j) * kv_j)``, rotated at
position ``w * m`` by the compressed branches' rope. CSA's kv and gate carry two series per token (``[Ca | Cb]``):
entry ``w`` pools the ``Ca`` halves of group ``w - 1`` with the ``Cb`` halves of group ``w`` (2m slots; group 0 has
no ``Ca`` side), and its lightning indexer pools its own keys the same way at ``index_head_dim``. This is
transformers' ``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor`` / ``DeepseekV4Indexer``.

Cache: one row cache per compressed layer, ``[num_blocks, block_size, state + entry]`` by the block tables like
every other cache: a token's row holds its compressor state (its kv and gate projections, from which the group it
closes is pooled), and the row of the token that closes group ``w`` (position ``(w + 1) * m - 1``) holds entry
``w`` (and in CSA its indexer key). An entry is written in the step its group completes, the partial group staying
as state until then, so chunked prefill, decode, the prefix cache and preemption see one function of the tokens.

Attention. A query at position ``p`` attends, with its head's sink logit in the denominator, over the latents of
positions ``p - window + 1 .. p`` and the entries of the groups it has seen (``(p + 1) // m`` of them): every one
(HCA) or those its indexer chose (CSA, ``sum_h w_h * relu(q_h . key_w)`` top ``index_topk``). Values are the keys.
"""

from __future__ import annotations

import torch


def rope_trailing(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, sign: float = 1.0
                  ) -> torch.Tensor:  # fmt: skip
    """``x [T, ..., D]`` with its last ``2 * len(inv_freq)`` dims rotated as interleaved pairs at ``positions [T]``
    (transformers' V4 ``apply_rotary_pos_emb``); ``sign=-1`` rotates back (the attention output's rope part)."""
    rd = 2 * inv_freq.shape[0]
    freqs = positions.float()[:, None] * inv_freq.to(x.device)[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    cos, sin = freqs.cos().view(shape), (sign * freqs.sin()).view(shape)
    rope = x[..., -rd:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rotated.to(x.dtype)], dim=-1)


def rms_normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers/norm.rms_norm's CPU maths, kept here so the reference stays plain PyTorch on a GPU too."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def pool_groups(kv: torch.Tensor, gate: torch.Tensor, prev_kv: torch.Tensor | None, prev_gate: torch.Tensor | None,
                has_prev: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                inv_freq: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One compressed entry per group: ``kv, gate [N, m, W]`` (gate with its position bias added) of the group;
    with overlap (CSA, ``W = 2d``) also the previous group's ``prev_kv, prev_gate [N, m, W]``, used where
    ``has_prev [N]``. Returns ``[N, d]`` normed and rotated at ``positions [N]`` (the groups' first tokens)."""
    if prev_kv is not None:
        d = kv.shape[-1] // 2
        gate_a = prev_gate[..., :d].masked_fill(~has_prev[:, None, None], float("-inf"))
        kv = torch.cat([prev_kv[..., :d] * has_prev[:, None, None], kv[..., d:]], dim=1)
        gate = torch.cat([gate_a, gate[..., d:]], dim=1)
    pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
    return rope_trailing(rms_normed(pooled, norm_weight, eps), positions, inv_freq)


def token_slots(block_tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int
                ) -> torch.Tensor:  # fmt: skip
    """Flat cache slots of ``positions [N, K]`` (clamped at 0) of the sequences ``rows [N]`` of the block tables."""
    pos = positions.clamp(min=0)
    return block_tables[rows[:, None], pos // block_size].long() * block_size + pos % block_size


class CompressorBranch:
    """Where one series (the attention's, or CSA's indexer's) sits in a compressed layer's rows, and how its groups
    pool: its state at ``[state_at, state_at + 2w)`` of a token's row (kv then gate, ``w`` wide each), its entry
    at ``[entry_at, entry_at + d)``."""

    def __init__(self, state_at: int, width: int, entry_at: int, dim: int, overlap: bool) -> None:
        self.state_at, self.width, self.entry_at, self.dim, self.overlap = state_at, width, entry_at, dim, overlap

    def write_state(self, rows: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor) -> None:
        rows[slots, self.state_at:self.state_at + 2 * self.width] = torch.cat([kv, gate], dim=-1).to(rows.dtype)

    def close_groups(self, rows: torch.Tensor, group_slots: torch.Tensor, prev_slots: torch.Tensor,
                     has_prev: torch.Tensor, out_slots: torch.Tensor, bias: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:  # fmt: skip
        """Pool the groups whose tokens sit at ``group_slots [N, m]`` (previous group's at ``prev_slots``) and
        write each entry into the row at ``out_slots [N]``."""
        w, at = self.width, self.state_at

        def read(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            state = rows[slots, at:at + 2 * w].float()
            return state[..., :w], state[..., w:] + bias.float()

        kv, gate = read(group_slots)
        prev_kv = prev_gate = None
        if self.overlap:
            prev_kv, prev_gate = read(prev_slots)
        entry = pool_groups(kv, gate, prev_kv, prev_gate, has_prev, norm_weight, eps, positions, inv_freq)
        rows[out_slots, self.entry_at:self.entry_at + self.dim] = entry.to(rows.dtype)

    def entries(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return rows[slots, self.entry_at:self.entry_at + self.dim]


def compress_groups(rows: torch.Tensor, branch: CompressorBranch, block_tables: torch.Tensor, row_seq: torch.Tensor,
                    positions: torch.Tensor, slot_mapping: torch.Tensor, rate: int, bias: torch.Tensor,
                    norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor, block_size: int) -> None:  # fmt: skip
    """Pool every group a row of the step closes (``(position + 1) % rate == 0``) from the state already in
    ``rows [slots, width]`` and write its entry into the closing token's row (``slot_mapping``)."""
    closing = ((positions + 1) % rate == 0).nonzero().flatten()
    if closing.numel() == 0:
        return
    first = positions[closing].long() + 1 - rate  # each closed group's first position
    seq = row_seq[closing].long()
    span = torch.arange(rate, device=rows.device)
    group = token_slots(block_tables, seq, first[:, None] + span, block_size)
    prev = token_slots(block_tables, seq, first[:, None] - rate + span, block_size)
    branch.close_groups(rows, group, prev, first > 0, slot_mapping[closing], bias, norm_weight, eps, first, inv_freq)


def entry_slots(block_tables: torch.Tensor, row_seq: torch.Tensor, rate: int, n: int, block_size: int
                ) -> torch.Tensor:  # fmt: skip
    """``[T, n]`` slots of entries ``0..n-1`` of each row's sequence: entry ``w`` sits in the row of the token that
    closed its group, position ``(w + 1) * rate - 1``."""
    ent_pos = (torch.arange(n, device=row_seq.device) + 1) * rate - 1
    return token_slots(block_tables, row_seq.long(), ent_pos.expand(len(row_seq), -1), block_size)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """``[T, n]`` fp32: ``sum_h weights[t, h] * relu(q[t, h] . keys[t, w])`` for entries ``w < visible[t]``, else
    -inf. ``q [T, Hi, Di]``, ``weights [T, Hi]`` with every scale folded in, ``keys [T, n, Di]``."""
    dots = torch.einsum("thd,tkd->thk", q.float(), keys.float()).relu_()
    scores = torch.einsum("th,thk->tk", weights.float(), dots)
    n = keys.shape[1]
    return scores.masked_fill(torch.arange(n, device=q.device)[None, :] >= visible[:, None], float("-inf"))


def window_keys(latents: torch.Tensor, block_tables: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor,
                window: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(fp32 ``[T, window, D]`` latents of positions ``p - window + 1 .. p``, ``[T, window]`` which exist)."""
    pos = positions.long()
    window_pos = pos[:, None] - torch.arange(window - 1, -1, -1, device=pos.device)
    return latents[token_slots(block_tables, row_seq.long(), window_pos, block_size)].float(), window_pos >= 0


def attend(q: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor, sinks: torch.Tensor, scale: float
           ) -> torch.Tensor:  # fmt: skip
    """fp32 ``[T, H, D]``: each query ``q [T, H, D]`` over its keys ``[T, K, D]`` (values = keys) where ``seen
    [T, K]``, each head's sink logit ``sinks [H]`` in the denominator only (transformers' eager attention with
    sinks: one more column that takes its share of the softmax and carries no value)."""
    scores = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, keys)


def v4_attention(q: torch.Tensor, latents: torch.Tensor, rows: torch.Tensor | None, entry_at: int,
                 block_tables: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor, sinks: torch.Tensor,
                 scale: float, window: int, rate: int, block_size: int, idx: torch.Tensor | None = None
                 ) -> torch.Tensor:  # fmt: skip
    """fp32 ``[T, H, D]``: each row's window over ``latents [slots, D]`` and, with ``rate`` > 0, the compressed
    entries of ``rows [slots, width]`` (at column ``entry_at``): every visible one, or the entry indices ``idx
    [T, K]`` chose (-1: none). Reads the largest visible count back to the host: a reference, not a graph path."""
    keys, seen = window_keys(latents, block_tables, row_seq, positions, window, block_size)
    if rows is not None and rate > 0:
        visible = (positions.long() + 1) // rate
        n = int(visible.max()) if idx is None else 0
        if idx is not None:
            picked = idx.long()
            ent_seen = (picked >= 0) & (picked < visible[:, None])
            ent_slots = token_slots(block_tables, row_seq.long(), (picked.clamp(min=0) + 1) * rate - 1, block_size)
        elif n > 0:
            ent_slots = entry_slots(block_tables, row_seq, rate, n, block_size)
            ent_seen = torch.arange(n, device=q.device)[None, :] < visible[:, None]
        if idx is not None or n > 0:
            d = latents.shape[-1]
            entries = rows[ent_slots, entry_at:entry_at + d].float()
            keys, seen = torch.cat([keys, entries], dim=1), torch.cat([seen, ent_seen], dim=1)
    return attend(q, keys, seen, sinks, scale)
