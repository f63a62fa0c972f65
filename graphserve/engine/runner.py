"""ModelRunner: owns the KV cache tensors, turns a scheduled step into a ForwardBatch, runs the
model and the sampler, and hands the sampled ids back on the host.

``prepare_inputs`` is kept apart from ``execute`` so the decode path can be wrapped (CUDA-graph
capture and replay) without touching how a batch is built.

``launch`` queues a step and returns before its ids reach the host, so the engine can schedule and
prepare the next step while the GPU runs this one. A token that step N samples and step N+1 consumes
is then not known on the host when N+1 is built: the engine stands it in as ``future_token(row)``
(engine/request.py), a negative id naming the row of step N, and the runner swaps in step N's
sampled id on the device.

A layout whose latents are paged apart (layers/kv_layout.py, ``latent_window``) gets ``latent_pages`` pages and a
device map from block to page, which ``launch`` brings up to date in place, before the step's forward, from the
block manager's changes (``page_source``, engine/latent_pages.py). Without ``latent_pages`` every block keeps its
own page (the identity map): what benchmarks and profiling steps on their own block tables read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import psutil
import torch

from graphserve.distributed.comm import TALLY
from graphserve.engine.expert_load import ExpertLoadProbe
from graphserve.engine.graphs import GraphRunner, split_sizes
from graphserve.engine.memory import split_layout_bytes
from graphserve.engine.sampling_inputs import tensors_from_rows
from graphserve.engine.seq_rows import BatchRows, SequenceRows
from graphserve.engine.staging import HostStaging
from graphserve.engine.step_sync import StepSender, apply_latent_updates
from graphserve.kernels.paged_kv import DUMMY_BLOCK
from graphserve.layers.attention import TorchAttentionBackend
from graphserve.layers.forward_batch import ForwardBatch
from graphserve.layers.sampler import PendingSample, Sampler, SamplerOutput, SamplingTensors

if TYPE_CHECKING:
    from graphserve.config import EngineConfig
    from graphserve.engine.latent_pages import LatentPages
    from graphserve.engine.request import Sequence
    from graphserve.engine.scheduler import SchedulerOutput
    from graphserve.layers.attention_backend import AttentionBackend
    from graphserve.models.loader import LoadedModel, ModelInfo

# Structured output's per-step callback: (ascending batch rows [R] int64, bitmasks [R, ceil(V/32)] int32) or None.
TokenMaskFn = Callable[[], "tuple[np.ndarray, np.ndarray] | None"]

CPU_DEFAULT_KV_TOKENS = 64 * 1024
# The default CPU pool never takes more than this share of the memory available at start-up.
CPU_KV_MEMORY_SHARE = 0.25


def cpu_kv_tokens(config: EngineConfig, info: ModelInfo, max_running: int) -> int:
    """KV capacity in tokens on CPU: --num-kv-tokens, else --kv-cache-gb, else 64k capped by memory. Bytes become
    blocks as the GPU plan makes them (engine/memory.split_kv_bytes): where the latents are paged apart, the pages of
    ``max_running`` windows come out of the bytes first."""
    if config.num_kv_tokens is not None:
        return config.num_kv_tokens

    def tokens(pool_bytes: int) -> int:
        return split_layout_bytes(pool_bytes, info.kv, config.block_size, max_running,
                                  config.chunked_prefill_size).num_blocks * config.block_size  # fmt: skip

    if config.kv_cache_gb is not None:
        return max(config.block_size, tokens(int(config.kv_cache_gb * 1024**3)))
    affordable = tokens(int(psutil.virtual_memory().available * CPU_KV_MEMORY_SHARE))
    return max(config.block_size, min(CPU_DEFAULT_KV_TOKENS, affordable))


def make_attention_backend(device: torch.device) -> AttentionBackend:
    if device.type == "cuda":
        from graphserve.layers.attention_triton import TritonAttentionBackend

        return TritonAttentionBackend()
    return TorchAttentionBackend()


@dataclass
class StepShape:
    """How the last step ran: what telemetry and the step log report."""

    padded_size: int
    graph: bool
    mode: str  # "eager" | "graph" | "split-graph"


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, num_blocks: int, device: torch.device | None = None,
                 latent_pages: int | None = None):  # fmt: skip
        self.config = config
        self.model = loaded.model
        self.info = loaded.info
        self.device = device if device is not None else next(self.model.parameters()).device
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        # Block 0 (the dummy block) is part of every layer's tensor; padding rows write there.
        kv = self.info.kv
        self.latent_pages = latent_pages if kv.latent_window is not None else None
        self.kv_caches = kv.allocate(num_blocks, self.block_size, self.device, latent_pages=self.latent_pages)
        self.latent_map = self.kv_caches[kv.latent_map_index] if self.latent_pages is not None else None
        self.page_source: LatentPages | None = None  # the block manager's latent pages (set by the engine)
        self.attn_backend = make_attention_backend(self.device)
        self.sampler = Sampler()
        self.graphs: GraphRunner | None = None
        # How a decode batch above the largest captured size runs: "split-graph" (captured pieces
        # replayed one after another) or "eager" (activation memory reserved by the plan).
        self.oversize_mode = "split-graph"
        self.last_shape = StepShape(0, False, "eager")
        self.last_context_tokens = 0  # KV positions the last step attended over (telemetry)
        self.seq_rows = SequenceRows()
        self.staging = HostStaging(self.device)
        self._last_ids: torch.Tensor | None = None  # the previous step's sampled ids, on the device
        # --tp/--ep on the driver rank: ships each step's inputs to the other ranks (engine/step_sync.py)
        self.peers: StepSender | None = None
        self.graph_comm: dict[int, tuple[int, int]] = {}  # captured size -> (collectives, bytes) per replay
        self.last_comm = (0, 0)  # collectives and their bytes in the last step (telemetry)
        self.expert_probe = ExpertLoadProbe(self.model, self.device) if self.model is not None else None
        self.last_expert_load: torch.Tensor | None = None  # the last step's per-expert counts (host, MoE only)

    def capture_graphs(self, sizes: list[int], max_model_len: int, progress=None) -> GraphRunner:
        """Capture the decode step for ``sizes`` (largest first, one pool); replaces earlier graphs."""
        self.graphs = None
        torch.cuda.empty_cache()
        graphs = GraphRunner(self.model, self.attn_backend, self.kv_caches, sizes,
                             -(-max_model_len // self.block_size), max_model_len, self.device)
        # A replay runs no Python, so the collectives a graph holds are tallied while it is captured: each
        # size runs one warm-up forward and one captured forward before ``progress`` hears of it.
        self.graph_comm = {}
        last = [TALLY.snapshot()]

        def tally(ps: int) -> None:
            count, nbytes = TALLY.snapshot()
            self.graph_comm[ps] = ((count - last[0][0]) // 2, (nbytes - last[0][1]) // 2)
            last[0] = (count, nbytes)
            if progress is not None:
                progress(ps)

        with torch.inference_mode():
            graphs.capture(tally)
        self.graphs = graphs
        return graphs

    def prepare_inputs(self, out: SchedulerOutput, rows: BatchRows | None = None) -> ForwardBatch:
        """Flatten the step's new tokens and describe where each one's KV lives.

        ``rows``: the step's per-sequence rows, when the caller already gathered them."""
        if rows is None:
            rows = self.seq_rows.gather([s.seq for s in out.scheduled])
        if out.num_tokens == len(rows.rows):  # one new token per sequence: a decode batch
            return self._decode_batch(rows)
        return self._general_batch(out)

    def _decode_batch(self, r: BatchRows) -> ForwardBatch:
        """The decode fast path: every field computed with numpy on the batch's rows and sent with
        a single host->device copy (through pinned memory on CUDA)."""
        b, w, bs = len(r.rows), r.width, self.block_size
        tables = self.seq_rows.block_tables[r.rows, :w]
        blocks = tables[np.arange(b), r.positions // bs]
        assert blocks.all(), "block table too short for the new token (it would land in the dummy block)"
        i64 = np.empty(4 * b, dtype=np.int64)
        i32 = np.empty(2 * b + 1 + b * w, dtype=np.int32)
        i64[:b] = r.tokens
        i64[b : 2 * b] = r.positions
        i64[2 * b : 3 * b] = blocks.astype(np.int64) * bs + r.positions % bs
        i64[3 * b :] = np.arange(b)  # logits_indices: each sequence's only token
        seq_lens = r.positions + 1
        i32[:b] = seq_lens
        i32[b : 2 * b + 1] = np.arange(b + 1)
        i32[2 * b + 1 :] = tables.reshape(-1)
        d64, d32 = self.staging.upload(i64, i32)
        seq_lens_cpu = seq_lens.tolist()
        input_ids = d64[:b]
        if r.tokens.min() < 0:
            input_ids = self._fill_future_tokens(input_ids)
        return ForwardBatch(
            mode="decode",
            input_ids=input_ids,
            positions=d64[b : 2 * b],
            slot_mapping=d64[2 * b : 3 * b],
            query_start_loc=d32[b : 2 * b + 1],
            seq_lens=d32[:b],
            block_tables=d32[2 * b + 1 :].view(b, w),
            logits_indices=d64[3 * b :],
            max_query_len=1,
            max_seq_len=max(seq_lens_cpu),
            kv_caches=self.kv_caches,
            attn_backend=self.attn_backend,
            query_lens_cpu=[1] * b,
            seq_lens_cpu=seq_lens_cpu,
        )

    def _fill_future_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Replace each ``future_token(row)`` stand-in with what the previous step sampled at ``row``."""
        assert self._last_ids is not None, "a future token with no step in flight"
        rows = (-1 - input_ids).clamp_(min=0)
        return torch.where(input_ids >= 0, input_ids, self._last_ids[rows])

    def _general_batch(self, out: SchedulerOutput) -> ForwardBatch:
        """Prefill and mixed steps: per-token Python lists (these steps are few and GPU-heavy)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        tables: list[list[int]] = []
        for sched in out.scheduled:
            seq, n = sched.seq, sched.num_new_tokens
            start = seq.num_computed_tokens
            table = seq.block_table
            assert len(table) * bs >= start + n, f"{seq}: block table too short for {n} new tokens"
            input_ids.extend(seq.tokens_slice(start, start + n))
            for pos in range(start, start + n):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            query_start.append(query_start[-1] + n)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(table)
        width = max(len(t) for t in tables)
        padded = [t + [DUMMY_BLOCK] * (width - len(t)) for t in tables]
        dev = self.device
        mode = "decode" if all(q == 1 for q in query_lens) else ("mixed" if 1 in query_lens else "prefill")
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        if min(input_ids) < 0:
            ids = self._fill_future_tokens(ids)
        return ForwardBatch(
            mode=mode,
            input_ids=ids,
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            logits_indices=torch.tensor(query_start[1:], dtype=torch.int64, device=dev) - 1,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            kv_caches=self.kv_caches,
            attn_backend=self.attn_backend,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )

    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """[num_seqs, vocab] logits in the model dtype: graph replay for decode batches when captured, else eager."""
        bs = batch.num_seqs
        graphs = self.graphs
        if graphs is not None and batch.mode == "decode":
            if graphs.can_use_cuda_graph(bs):
                self.last_shape = StepShape(graphs.padded_size(bs), True, "graph")
                self.last_comm = self.graph_comm.get(self.last_shape.padded_size, (0, 0))
                return graphs.replay(batch)
            if self.oversize_mode == "split-graph":
                pieces = [graphs.padded_size(p) for p in split_sizes(bs, graphs.sizes)]
                self.last_shape = StepShape(sum(pieces), True, "split-graph")
                tallies = [self.graph_comm.get(p, (0, 0)) for p in pieces]
                self.last_comm = (sum(c for c, _ in tallies), sum(b for _, b in tallies))
                return graphs.replay_split(batch)
        self.last_shape = StepShape(bs, False, "eager")
        before = TALLY.snapshot()
        hidden = self.model(batch.input_ids, batch.positions, batch)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        after = TALLY.snapshot()
        self.last_comm = (after[0] - before[0], after[1] - before[1])
        return logits

    def execute(self, out: SchedulerOutput) -> SamplerOutput:
        """Run one step to the end: its sampled ids on the host."""
        return self.launch(out).result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, token_mask: TokenMaskFn | None = None) -> PendingSample:
        """Queue one step (inputs, forward, sampling, the copy of its ids to the host) and return
        without waiting for it.

        ``token_mask``: structured output's host work, called once the forward is queued (so it runs
        while the device computes): returns (batch rows, their packed bitmasks) or None."""
        seqs = [s.seq for s in out.scheduled]
        rows = self.seq_rows.gather(seqs)  # one gather serves the inputs, the sampling knobs and telemetry
        self.last_context_tokens = int(rows.positions.sum()) + out.num_tokens
        updates = self.update_latent_map()
        batch = self.prepare_inputs(out, rows)
        if self.peers is not None:
            self.peers.send(batch, updates)
        logits = self.forward_logits(batch)
        self.last_expert_load = self.expert_probe.snapshot() if self.expert_probe else None
        tensors = self.sampling_tensors(seqs, rows, logits.shape[-1])
        masked = token_mask() if token_mask is not None else None
        if masked is not None:
            mask_rows, mask = masked
            tensors.token_mask, dev_rows = self.staging.upload(mask, mask_rows)
            tensors.mask_rows = None if len(mask_rows) == len(seqs) else dev_rows  # rows ascend: all = in order
        pending = self.sampler.sample(logits, tensors)
        self._last_ids = pending.ids
        return pending

    def update_latent_map(self) -> torch.Tensor | None:
        """Write the block manager's latent page changes since the last step into the device map: ``[n, 2]`` int64
        (block, page) on the device, for the other ranks; None when nothing changed."""
        if self.page_source is None:
            return None
        updates = self.page_source.take_updates()
        if not updates:
            return None
        # through the pinned ring as every per-step input: a pageable copy may wait on the stream
        (pairs,) = self.staging.upload(np.asarray(updates, dtype=np.int64))
        apply_latent_updates(self.latent_map, pairs)
        return pairs

    def sampling_tensors(self, seqs: list[Sequence], rows: BatchRows, vocab_size: int) -> SamplingTensors:
        """The step's sampling knobs, read from the per-sequence rows."""
        sr = self.seq_rows
        return tensors_from_rows(sr.floats[rows.rows], sr.ints[rows.rows], rows.num_outputs, seqs,
                                         vocab_size, self.info.eos_token_ids, self.device, self.staging.upload)

