"""Token embedding and the LM head (which may share the embedding's weight), split by vocabulary.

With tensor parallelism each rank holds ``ceil(V / tp)`` consecutive vocabulary rows (the last rank's
tail past V is padding that no id reaches). The embedding looks up the ids in its range, zeroes the
others and all-reduces; the head computes its slice of the logits and all-gathers them, padding
dropped, so the sampler on rank 0 sees the whole vocabulary. At tp 1 both are the plain layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphserve.distributed.comm import all_gather_last_dim, all_reduce


def vocab_range(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(first id, rows) of rank ``tp_rank``'s slice of the vocabulary, padding included."""
    per_rank = -(-vocab_size // tp_size)
    return tp_rank * per_rank, per_rank


class _VocabSlice:
    vocab_size: int
    vocab_start: int
    tp_rank: int
    tp_size: int

    @torch.no_grad()
    def load_weight(self, param_name: str, param: nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape {tuple(loaded.shape)}, expected ({self.vocab_size}, {param.shape[1]})")
        rows = min(param.shape[0], self.vocab_size - self.vocab_start)
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()


class VocabEmbedding(_VocabSlice, nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.vocab_start, rows = vocab_range(vocab_size, tp_rank, tp_size)
        nn.Embedding.__init__(self, rows, hidden_size)
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, tp_rank, tp_size

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class LMHead(_VocabSlice, nn.Module):
    """Projects final hidden states to vocabulary logits, in the model's dtype: the sampler works in
    float32 where it needs to, and greedy decoding takes the argmax of the logits as they are (exact:
    every bf16/fp16 value is a float32 value), which spares a conversion kernel per decode step."""

    def __init__(self, hidden_size: int, vocab_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        nn.Module.__init__(self)
        self.vocab_start, rows = vocab_range(vocab_size, tp_rank, tp_size)
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        logits = all_gather_last_dim(logits)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]
