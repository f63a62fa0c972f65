"""Host rows that follow each scheduled sequence from step to step.

A decode step touches every running sequence, yet little about a sequence changes between two
steps: its sampling knobs never do, and its block table only grows at the end (or is dropped
whole on preemption). So each sequence gets one row in preallocated numpy tables, filled once
(knobs) or as the table grows (block ids), and a step gathers its batch's rows with one fancy
index instead of rebuilding and re-padding Python lists for every sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from graphserve.engine.sampling_inputs import knob_row
from graphserve.kernels.paged_kv import DUMMY_BLOCK
from graphserve.layers.sampler import NUM_FLOAT_KNOBS, NUM_INT_KNOBS

if TYPE_CHECKING:
    from graphserve.engine.request import Sequence


@dataclass
class BatchRows:
    """One step's view of its sequences, in batch order."""

    rows: np.ndarray  # [B] int64, each sequence's row in the tables
    positions: np.ndarray  # [B] int64, num_computed_tokens: where the next new token goes
    tokens: np.ndarray  # [B] int64, the token at that position (the decode step's input)
    num_outputs: np.ndarray  # [B] int64, output tokens so far (the sampler's step index)
    width: int  # longest block table in the batch


class SequenceRows:
    def __init__(self, capacity: int = 64, width: int = 16):
        self.block_tables = np.full((capacity, width), DUMMY_BLOCK, dtype=np.int32)
        self.floats = np.zeros((capacity, NUM_FLOAT_KNOBS), dtype=np.float32)
        self.ints = np.zeros((capacity, NUM_INT_KNOBS), dtype=np.int64)
        self._row_of: dict[int, int] = {}  # seq_id -> row
        self._free = list(range(capacity - 1, -1, -1))
        # The block_table list each row mirrors and how many of its ids are copied; a sequence
        # whose list object changed (freed, then allocated again) is copied afresh.
        self._table_ref: list[list[int] | None] = [None] * capacity
        self._table_len = [0] * capacity

    @property
    def capacity(self) -> int:
        return len(self._table_ref)

    def __len__(self) -> int:
        return len(self._row_of)

    def gather(self, seqs: list[Sequence]) -> BatchRows:
        """Give every sequence a row (evicting rows of sequences not in ``seqs`` when full), bring
        the block-table rows up to date and read what the step needs from each sequence."""
        if len(self._row_of) + len(seqs) > self.capacity:
            self._make_room(seqs)
        row_of, refs, lens = self._row_of, self._table_ref, self._table_len
        rows: list[int] = []
        positions: list[int] = []
        tokens: list[int] = []
        num_outputs: list[int] = []
        width = 1
        for seq in seqs:
            row = row_of.get(seq.seq_id)
            if row is None:
                row = self._assign(seq)
            table = seq.block_table
            if table is not refs[row] or len(table) != lens[row]:
                self._copy_table(row, table)
            if len(table) > width:
                width = len(table)
            pos = seq.num_computed_tokens
            out = seq.output_token_ids
            p = len(seq.prompt_token_ids)
            tokens.append(out[pos - p] if pos >= p else seq.prompt_token_ids[pos])
            rows.append(row)
            positions.append(pos)
            num_outputs.append(len(out))
        return BatchRows(
            rows=np.array(rows, dtype=np.int64),
            positions=np.array(positions, dtype=np.int64),
            tokens=np.array(tokens, dtype=np.int64),
            num_outputs=np.array(num_outputs, dtype=np.int64),
            width=width,
        )

    def _assign(self, seq: Sequence) -> int:
        row = self._free.pop()
        self._row_of[seq.seq_id] = row
        floats, ints = knob_row(seq)
        self.floats[row] = floats
        self.ints[row] = ints
        return row

    def _copy_table(self, row: int, table: list[int]) -> None:
        n = len(table)
        if n > self.block_tables.shape[1]:
            grown = np.full((self.capacity, max(n, 2 * self.block_tables.shape[1])), DUMMY_BLOCK, dtype=np.int32)
            grown[:, : self.block_tables.shape[1]] = self.block_tables
            self.block_tables = grown
        if table is self._table_ref[row] and n > self._table_len[row]:
            done = self._table_len[row]
            self.block_tables[row, done:n] = table[done:]  # grown at the end: copy the new ids only
        else:
            self.block_tables[row] = DUMMY_BLOCK
            self.block_tables[row, :n] = table
        self._table_ref[row] = table
        self._table_len[row] = n

    def _make_room(self, seqs: list[Sequence]) -> None:
        """Drop the rows of sequences outside this batch (finished, preempted), then grow if needed.

        Growing leaves room for a second batch as large, so a steady batch does not come back here
        every step."""
        live = {s.seq_id for s in seqs}
        missing = len(live) - sum(1 for k in live if k in self._row_of)
        if len(self._row_of) + missing <= self.capacity:
            return
        for seq_id in [k for k in self._row_of if k not in live]:
            row = self._row_of.pop(seq_id)
            self._table_ref[row] = None
            self._table_len[row] = 0
            self._free.append(row)
        needed = len(self._row_of) + missing
        if needed <= self.capacity:
            return
        old = self.capacity
        new = max(2 * needed, 2 * old)
        self.block_tables = np.concatenate(
            [self.block_tables, np.full((new - old, self.block_tables.shape[1]), DUMMY_BLOCK, dtype=np.int32)]
        )
        self.floats = np.concatenate([self.floats, np.zeros((new - old, NUM_FLOAT_KNOBS), dtype=np.float32)])
        self.ints = np.concatenate([self.ints, np.zeros((new - old, NUM_INT_KNOBS), dtype=np.int64)])
        self._table_ref += [None] * (new - old)
        self._table_len += [0] * (new - old)
        self._free = list(range(new - 1, old - 1, -1)) + self._free
