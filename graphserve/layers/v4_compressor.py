"""DeepSeek-V4's KV compression on the paged cache, in plain PyTorch (the reference path; no Triton kernel yet).

A compressed layer pools each group of ``m`` consecutive tokens (``m`` = the layer type's ``compress_rates``) into
one entry: ``entry_w = rmsnorm(sum_j softmax_j(gate_j + bias_j) * kv_j)``, rotated at position ``w * m`` by the
compressed branches' rope. CSA's kv and gate carry two series per token (``[Ca | Cb]``): entry ``w`` pools the
``Ca`` halves of group ``w - 1`` with the ``Cb`` halves of group ``w`` (2m slots; group 0 has no ``Ca`` side), and
its lightning indexer pools its own keys the same way at ``index_head_dim``. This is transformers'
``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor`` / ``DeepseekV4Indexer``.

Cache: one row cache per compressed layer, ``[num_blocks, block_size, state + entry]`` by the block tables like
every other cache: a token's row holds its compressor state (its kv and gate projections, from which the group it
closes is pooled), and the row of the token that closes group ``w`` (position ``(w + 1) * m - 1``) holds entry
``w`` (and in CSA its indexer key). An entry is written in the step its group completes, the partial group staying
as state until then, so chunked prefill, decode, the prefix cache and preemption see one function of the tokens.
"""

from __future__ import annotations

import torch

from graphserve.layers.norm import rms_norm


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
    return rope_trailing(rms_norm(pooled, norm_weight, eps), positions, inv_freq)


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
