"""Each step's inputs, from the driver rank to the others, without pickling.

The driver builds a step's ForwardBatch as at tp 1; ``StepSender.send`` then ships it in two
broadcasts: a fixed header of host integers over the CPU (gloo) group — the mode and the sizes the
other ranks need to allocate and to pick the same graph — and every index tensor concatenated into one
int64 tensor over the device group, issued on the driver's stream after the batch's own upload (so the
overlap schedule's stand-in tokens, resolved on the device, are already in place). ``StepReceiver``
rebuilds the same ForwardBatch on its rank. A header with op SHUTDOWN ends a rank's loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from graphserve.distributed.comm import broadcast
from graphserve.layers.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from graphserve.layers.attention_backend import AttentionBackend

STEP, SHUTDOWN = 1, 0
_MODES = ("prefill", "decode", "mixed")
_HEADER = 8  # op, mode, tokens, seqs, table width, max_query_len, max_seq_len, latent page map changes


class StepSender:
    """Driver side."""

    def __init__(self) -> None:
        self.header = torch.zeros(_HEADER, dtype=torch.int64)

    def send(self, batch: ForwardBatch, latent_updates: torch.Tensor | None = None) -> None:
        """``latent_updates [n, 2]`` (block, latent page): the changes every rank writes into its latent page map
        before the step (engine/runner.py)."""
        t, b = batch.num_tokens, batch.num_seqs
        w = batch.block_tables.shape[1]
        n = 0 if latent_updates is None else latent_updates.shape[0]
        self.header.copy_(torch.tensor([STEP, _MODES.index(batch.mode), t, b, w, batch.max_query_len,
                                        batch.max_seq_len, n]))
        broadcast(self.header, cpu=True)
        payload = torch.cat([
            batch.input_ids, batch.positions, batch.slot_mapping, batch.logits_indices,
            batch.query_start_loc.long(), batch.seq_lens.long(), batch.block_tables.reshape(-1).long(),
        ] + ([latent_updates.reshape(-1)] if n else []))
        broadcast(payload)

    def shutdown(self) -> None:
        self.header.zero_()
        self.header[0] = SHUTDOWN
        broadcast(self.header, cpu=True)


class StepReceiver:
    """Every other rank: ``recv`` blocks until the driver's next step (None: shut down)."""

    def __init__(self, device: torch.device, kv_caches: list[torch.Tensor], attn_backend: AttentionBackend,
                 latent_map: torch.Tensor | None = None) -> None:  # fmt: skip
        self.device, self.kv_caches, self.attn_backend = device, kv_caches, attn_backend
        self.latent_map = latent_map
        self.header = torch.zeros(_HEADER, dtype=torch.int64)

    def recv(self) -> ForwardBatch | None:
        broadcast(self.header, cpu=True)
        op, mode, t, b, w, max_q, max_s, n = self.header.tolist()
        if op == SHUTDOWN:
            return None
        payload = torch.empty(3 * t + b + (b + 1) + b + b * w + 2 * n, dtype=torch.int64, device=self.device)
        broadcast(payload)
        input_ids, positions, slots, logits_idx, qsl, seq_lens, tables, updates = payload.split(
            [t, t, t, b, b + 1, b, b * w, 2 * n])
        if n:
            apply_latent_updates(self.latent_map, updates.view(n, 2))
        return ForwardBatch(
            mode=_MODES[mode], input_ids=input_ids, positions=positions, slot_mapping=slots,
            query_start_loc=qsl.int(), seq_lens=seq_lens.int(), block_tables=tables.int().view(b, w),
            logits_indices=logits_idx, max_query_len=max_q, max_seq_len=max_s,
            kv_caches=self.kv_caches, attn_backend=self.attn_backend,
        )


def apply_latent_updates(latent_map: torch.Tensor, pairs: torch.Tensor) -> None:
    """``latent_map[block] = page`` for each row of ``pairs [n, 2]``, in place (a captured graph reads this tensor)."""
    latent_map.index_copy_(0, pairs[:, 0], pairs[:, 1].to(latent_map.dtype))
