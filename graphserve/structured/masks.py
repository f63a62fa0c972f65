"""The token bitmask of a step's constrained rows, filled on the host.

One row per constrained sequence that samples a token this step, in xgrammar's packed layout
([R, ceil(V/32)] int32); the runner sends it to the device with the step's other inputs and the
sampler unpacks it there (layers/sampler.py ``apply_token_mask``). Rows of a batch that no
constraint touches get no mask row at all.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from graphserve.structured.compiler import GrammarState

# Below this many rows one thread fills the masks (a row costs a few microseconds); above it
# xgrammar's batch matcher spreads them over threads.
BATCH_FILL_MIN_ROWS = 16


class TokenMaskBuilder:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.width = math.ceil(vocab_size / 32)
        self._host = torch.empty((0, self.width), dtype=torch.int32)
        self._batch: Any = None

    def fill(self, states: list[GrammarState]) -> np.ndarray:
        """[len(states), width] int32: each state's allowed next tokens. The array is a view of a
        buffer reused by the next call; the caller copies it before then."""
        n = len(states)
        if self._host.shape[0] < n:
            self._host = torch.empty((max(n, 2 * self._host.shape[0]), self.width), dtype=torch.int32)
        host = self._host[:n]
        if n >= BATCH_FILL_MIN_ROWS:
            import xgrammar as xgr

            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask([s.matcher for s in states], host)
        else:
            for i, s in enumerate(states):
                s.matcher.fill_next_token_bitmask(host, i)
        return host.numpy()
