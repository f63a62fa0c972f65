"""CUDA-graph decode: capture a list of batch sizes into one shared pool, pad, replay.

A decode batch of size ``bs`` is padded to the next captured size; padding rows read and write
only the reserved dummy block (block 0), so they can never touch a real request's KV. A batch
larger than the largest captured size is replayed piecewise in captured sizes (``replay_split``);
the runner decides between that and eager execution from a start-up calibration. A batch on the
runner's device reaches the graph's static buffers in one launch (kernels/graph_inputs.py).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from graphserve.kernels.graph_inputs import DecodeInputs, check_buffers, pad_decode_rows, stage_checked
from graphserve.kernels.paged_kv import DUMMY_BLOCK
from graphserve.layers.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from graphserve.layers.attention_backend import AttentionBackend

logger = logging.getLogger("graphserve.graphs")

GiB = 1 << 30


def split_sizes(bs: int, sizes: list[int]) -> list[int]:
    """Cut ``bs`` rows into pieces of captured sizes: largest first; the last piece is padded."""
    pieces = []
    largest = sizes[-1]
    while bs > largest:
        pieces.append(largest)
        bs -= largest
    pieces.append(bs)
    return pieces


class GraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        sizes: list[int],
        max_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
    ):
        if not sizes:
            raise ValueError("GraphRunner needs at least one batch size to capture")
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.sizes = sorted(set(sizes))
        self.max_bs = self.sizes[-1]
        self.max_model_len = max_model_len
        self.device = device
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, max_blocks_per_seq), DUMMY_BLOCK, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        self.num_valid = torch.zeros((), dtype=torch.int64, device=device)  # real rows of the padded batch
        self.static = DecodeInputs(self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables)
        check_buffers(self.static, self.num_valid)  # once: a step then checks only its batch (stage_checked)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self.pool_bytes = 0

    # -- batch shape helpers -------------------------------------------------------------
    def can_use_cuda_graph(self, bs: int) -> bool:
        return 0 < bs <= self.max_bs

    def padded_size(self, bs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, bs)]

    def _static_batch(self, ps: int) -> ForwardBatch:
        return ForwardBatch(
            mode="decode",
            input_ids=self.input_ids[:ps],
            positions=self.positions[:ps],
            slot_mapping=self.slot_mapping[:ps],
            query_start_loc=self.query_start_loc[: ps + 1],
            seq_lens=self.seq_lens[:ps],
            block_tables=self.block_tables[:ps],
            logits_indices=self.logits_indices[:ps],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            kv_caches=self.kv_caches,
            attn_backend=self.attn_backend,
            num_valid_tokens=self.num_valid,
        )

    def _forward(self, ps: int) -> torch.Tensor:
        batch = self._static_batch(ps)
        hidden = self.model.forward(batch.input_ids, batch.positions, batch)
        return self.model.compute_logits(hidden)

    # -- capture ---------------------------------------------------------------------------
    def capture(self, progress: Callable[[int], None] | None = None) -> None:
        """Capture every size, largest first, into one shared memory pool."""
        free_before, _ = torch.cuda.mem_get_info(self.device)
        reserved_before = torch.cuda.memory_reserved(self.device)
        t0 = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for ps in reversed(self.sizes):
            pad_decode_rows(self.static, 0, ps)
            self.num_valid.fill_(ps)
            # The side stream must see the static buffers and the KV pool initialised on the
            # current stream; without this wait it can read a block table still being filled.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            # one eager run compiles Triton kernels and settles lazy allocations outside the graph
            with torch.cuda.stream(stream):
                self._forward(ps)
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool, stream=stream):
                self.logits[ps] = self._forward(ps)
            self.graphs[ps] = g
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if progress is not None:
                progress(ps)
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        self.pool_bytes = max(0, torch.cuda.memory_reserved(self.device) - reserved_before)
        logger.info(
            "Capture cuda graph end. bs %s, time %.2f s, free memory before %.2f GiB, after %.2f GiB, pool %.2f GiB",
            self.sizes, time.perf_counter() - t0, free_before / GiB, free_after / GiB, self.pool_bytes / GiB,
        )

    # -- replay ------------------------------------------------------------------------------
    def stage(self, batch: ForwardBatch, ps: int) -> None:
        """Put the batch's rows and ``ps - bs`` padding rows into the static buffers, and bs into num_valid: one
        launch where the inputs are on the runner's device (kernels/graph_inputs.py), where 6-11 copy_/fill_
        launches issued one by one cost 50-190 us per step on an H200."""
        src = DecodeInputs(batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens, batch.block_tables)
        stage_checked(self.static, self.num_valid, src, batch.num_seqs, ps)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Run a decode batch of at most ``max_bs`` rows through its padded graph; returns [bs, V] logits."""
        bs = batch.num_seqs
        ps = self.padded_size(bs)
        self.stage(batch, ps)
        self.graphs[ps].replay()
        return self.logits[ps][:bs]

    def _rows(self, batch: ForwardBatch, start: int, stop: int) -> ForwardBatch:
        """Rows [start, stop) of a decode batch (one token per sequence, so rows and tokens coincide);
        the row-index fields come from the static aranges, so slicing allocates nothing on the device."""
        n = stop - start
        return ForwardBatch(
            mode="decode",
            input_ids=batch.input_ids[start:stop],
            positions=batch.positions[start:stop],
            slot_mapping=batch.slot_mapping[start:stop],
            query_start_loc=self.query_start_loc[: n + 1],
            seq_lens=batch.seq_lens[start:stop],
            block_tables=batch.block_tables[start:stop],
            logits_indices=self.logits_indices[:n],
            max_query_len=1,
            max_seq_len=batch.max_seq_len,
            kv_caches=batch.kv_caches,
            attn_backend=batch.attn_backend,
            query_lens_cpu=batch.query_lens_cpu[start:stop],
            seq_lens_cpu=batch.seq_lens_cpu[start:stop],
        )

    def replay_split(self, batch: ForwardBatch) -> torch.Tensor:
        """An oversize decode batch as captured pieces replayed one after another."""
        out = []
        start = 0
        for piece in split_sizes(batch.num_seqs, self.sizes):
            out.append(self.replay(self._rows(batch, start, start + piece)).clone())
            start += piece
        return torch.cat(out)
