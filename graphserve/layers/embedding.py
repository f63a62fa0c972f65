"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
from torch import nn


class VocabEmbedding(nn.Embedding):
    pass


class LMHead(nn.Module):
    """Projects final hidden states to vocabulary logits, in the model's dtype: the sampler works in
    float32 where it needs to, and greedy decoding takes the argmax of the logits as they are (exact:
    every bf16/fp16 value is a float32 value), which spares a conversion kernel per decode step."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight)
