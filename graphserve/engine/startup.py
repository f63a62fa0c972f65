"""GPU start-up: measure, plan, allocate, capture — in that order.

1. weights: bytes allocated once the model is loaded;
2. activations: the peak of the worst mixed step (a full prefill chunk plus every running
   request decoding, sampled with every knob on) and of the largest eager decode batch, run on a
   small profiling KV pool;
3. the CUDA-graph pool: a trial capture of every size on the profiling pool;
4. only then the KV pool, from ``total × --mem-fraction-static`` minus all of the above minus a
   stated reserve (engine/memory.py, the same arithmetic `graphserve plan` uses);
5. the real capture, checked against the plan.

The running batch is derived from the captured sizes: by default it never exceeds the largest
one. When --max-running-requests is set above it, a short calibration picks how oversize decode
batches run (captured pieces replayed in turn, or eagerly with activation memory the plan
already reserved), so no step ever allocates memory the plan did not count.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from graphserve.config import EngineConfig
from graphserve.distributed.comm import agree
from graphserve.engine.gpu_share import device_memory
from graphserve.engine.graphs import GiB, GraphRunner
from graphserve.engine.latent_pages import latent_page_count
from graphserve.engine.memory import RESERVE_BYTES, MemoryPlan, plan_memory, split_layout_bytes, wanted_latent_pages
from graphserve.engine.runner import ModelRunner
from graphserve.errors import ConfigError
from graphserve.layers.forward_batch import ForwardBatch, contiguous_batch
from graphserve.layers.sampler import SamplingTensors
from graphserve.models.loader import LoadedModel

if TYPE_CHECKING:
    from graphserve.layers.kv_layout import KVLayout

logger = logging.getLogger("graphserve.startup")


@dataclass(frozen=True)
class OversizeCalibration:
    """A decode batch of ``rows`` (above the largest captured size) timed three ways at start-up."""

    rows: int
    split_ms: float
    eager_ms: float
    full_graph_ms: float | None  # a graph captured at ``rows``; None when memory did not allow the trial
    mode: str  # the faster of split-graph and eager: what the engine runs

    @property
    def full_graph_speedup(self) -> float | None:
        """How much faster a graph captured at the running size is than the chosen mode."""
        if self.full_graph_ms is None or self.full_graph_ms <= 0:
            return None
        return min(self.split_ms, self.eager_ms) / self.full_graph_ms

    def log_line(self, largest: int) -> str:
        full = (f", full graph {self.full_graph_ms:.2f} ms at batch {self.rows}: a graph captured at {self.rows} "
                f"is {self.full_graph_speedup:.2f}x faster (--cuda-graph-max-bs {self.rows})"
                if self.full_graph_ms is not None else f" at batch {self.rows} (full graph not timed: too little free memory)")
        return (f"decode batches above {largest} (up to --max-running-requests {self.rows}) run as {self.mode}: "
                f"split-graph {self.split_ms:.2f} ms, eager {self.eager_ms:.2f} ms{full}")


@dataclass
class GpuStartup:
    runner: ModelRunner
    plan: MemoryPlan
    max_running_requests: int
    graph_sizes: list[int]
    oversize_mode: str  # how decode batches above the largest captured size run
    oversize: OversizeCalibration | None = None  # the measured costs behind oversize_mode


def resolve_batch_limits(config: EngineConfig) -> tuple[list[int], int]:
    """(captured sizes, max running requests), derived together so they cannot disagree."""
    sizes = config.graph_sizes()
    if config.max_running_requests is None:
        if not sizes:
            return [], 256
        return sizes, sizes[-1]
    limit = config.max_running_requests
    if sizes and sizes[-1] > limit:  # capturing sizes no batch can reach only wastes memory
        sizes = [s for s in sizes if s < limit] + [limit]
    return sizes, limit


def requested_kv_tokens(config: EngineConfig, layout: KVLayout, max_running: int) -> int | None:
    """An explicit KV size from --num-kv-tokens or --kv-cache-gb: on GPU, an upper bound on the plan. The bytes of
    --kv-cache-gb are split as the plan splits its pool (engine/memory.split_kv_bytes): a layout that pages its
    latents apart gives the pages of ``max_running`` windows first and its blocks the rest."""
    if config.num_kv_tokens is not None:
        return config.num_kv_tokens
    if config.kv_cache_gb is not None:
        pool = split_layout_bytes(int(config.kv_cache_gb * (1 << 30)), layout, config.block_size, max_running,
                                  config.chunked_prefill_size)  # fmt: skip
        return pool.num_blocks * config.block_size
    return None


def mixed_step_lens(chunk: int, max_running: int, max_model_len: int) -> list[int]:
    """Query lengths of the worst mixed step: ``chunk`` prefill tokens plus every other running request decoding.

    The prefill is cut into prompts of at most ``max_model_len`` tokens, as the scheduler's would be:
    one prompt of a 2048-token chunk under --max-model-len 1024 has positions past the model's rotary
    table (it holds ``max_model_len`` rows), and the fused prologue read them past its end - an illegal
    memory access on the GPU, or garbage, depending on what the allocator had put after the table."""
    prefill = [max_model_len] * (chunk // max_model_len) + ([chunk % max_model_len] if chunk % max_model_len else [])
    return prefill + [1] * (max_running - 1)


def synthetic_batch(runner: ModelRunner, query_lens: list[int], first_block: int = 1) -> ForwardBatch:
    """Fresh sequences (no cached prefix) on consecutive blocks of ``runner``'s pool, each block with a latent page
    where the latents are paged apart; none may be longer than the runner's max_model_len (the model's rotary table
    ends there)."""
    limit = runner.config.max_model_len
    if limit is not None and max(query_lens) > limit:
        raise ValueError(f"synthetic batch: a sequence of {max(query_lens)} tokens is longer than max_model_len={limit}")
    return contiguous_batch(query_lens, query_lens, runner.kv_caches, runner.attn_backend, runner.info.vocab_size,
                            first_block, num_blocks=runner.num_blocks, latent_pages=runner.latent_pages)


def worst_case_sampling(rows: int, vocab: int, device: torch.device) -> SamplingTensors:
    """Every sampling knob on for every row: the sampler's largest temporaries."""

    def full(v, dtype):
        return torch.full((rows,), v, dtype=dtype, device=device)

    return SamplingTensors(
        temperature=full(0.7, torch.float32), top_k=full(50, torch.int64), top_p=full(0.9, torch.float32),
        min_p=full(0.05, torch.float32), seeds=torch.arange(rows, device=device), steps=full(0, torch.int64),
        presence=full(0.5, torch.float32), frequency=full(0.5, torch.float32), repetition=full(1.1, torch.float32),
        output_counts=torch.zeros(rows, vocab, device=device), prompt_mask=torch.zeros(rows, vocab, dtype=torch.bool, device=device),
        banned=torch.zeros(rows, vocab, dtype=torch.bool, device=device), max_logprobs=20, all_greedy=False,
        any_top_k=True, any_top_p=True, any_min_p=True,
    )


@torch.inference_mode()
def step_peak_bytes(runner: ModelRunner, batch: ForwardBatch) -> int:
    """Extra bytes a step (forward, logits, sampling with every knob on) allocates at its peak."""
    dev = runner.device
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    logits = runner.forward_logits(batch)
    runner.sampler(logits, worst_case_sampling(batch.num_seqs, logits.shape[-1], dev))
    del logits
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev) - base


def _time_ms(fn, iters: int = 5) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def calibrate_oversize(runner: ModelRunner, rows: int) -> OversizeCalibration:
    """Time an oversize decode batch on the dummy block only: split-graph and eager (the faster one is
    chosen), and a graph captured at ``rows`` for a moment, what raising --cuda-graph-max-bs would buy."""
    batch = synthetic_batch(runner, [1] * rows, first_block=0)
    batch.slot_mapping.zero_()
    batch.block_tables.zero_()
    runner.oversize_mode = "split-graph"
    split_ms = _time_ms(lambda: runner.forward_logits(batch))
    runner.oversize_mode = "eager"
    dev = runner.device
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    eager_ms = _time_ms(lambda: runner.forward_logits(batch))
    eager_peak = torch.cuda.max_memory_allocated(dev) - base
    full_ms = _full_graph_ms(runner, batch, eager_peak)
    modes = ("split-graph", "eager")  # every rank must replay the same way (--tp/--ep): rank 0's timing decides
    mode = modes[agree(0 if split_ms <= eager_ms else 1, op="first")]
    return OversizeCalibration(rows, split_ms, eager_ms, full_ms, mode)


def _full_graph_ms(runner: ModelRunner, batch: ForwardBatch, eager_peak: int) -> float | None:
    """Replay time of a temporary graph captured at the batch's size, freed afterwards; None when free
    memory cannot hold its warm-up and its pool (about two eager peaks) beside everything planned."""
    graphs = runner.graphs
    torch.cuda.empty_cache()
    free, _ = device_memory(runner.device)
    # with --tp/--ep the trial captures collectives: every rank takes it, or none does
    if not agree(int(graphs is not None and free >= 2 * eager_peak + (256 << 20))):
        return None
    trial = GraphRunner(runner.model, runner.attn_backend, runner.kv_caches, [batch.num_seqs],
                        graphs.block_tables.shape[1], graphs.max_model_len, runner.device)
    quiet = logging.getLogger("graphserve.graphs")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # its capture line would read, to `graphserve doctor`, as a captured size
    ms = None
    try:
        trial.capture()
        ms = _time_ms(functools.partial(trial.replay, batch))
    except torch.OutOfMemoryError:  # only a measurement: the engine serves without it
        logger.warning("full-graph trial at batch %d ran out of memory; not timed", batch.num_seqs)
    finally:
        quiet.setLevel(level)
    trial = None  # its pool goes back before serving starts
    torch.cuda.empty_cache()
    return ms


def log_tables(device: torch.device, model: str | None) -> None:
    """One line: which measured tables serve this card and which fell back to the defaults (a warning, with the
    command that measures them)."""
    from graphserve.kernels import tables

    line = tables.startup_line(torch.cuda.get_device_name(device), model)
    if line:
        (logger.warning if "; defaults:" in line else logger.info)(line)


def start_gpu(config: EngineConfig, loaded: LoadedModel, device: torch.device, max_model_len: int) -> GpuStartup:
    sizes, max_running = resolve_batch_limits(config)
    cfg = config.replace(max_model_len=max_model_len, max_running_requests=max_running)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    _, total = device_memory(device)
    chunk = cfg.chunked_prefill_size

    # 2-3. activations and the graph pool, on a profiling pool just large enough for the synthetic steps
    mixed_lens = mixed_step_lens(chunk, max_running, max_model_len)
    prof_blocks = 2 + sum(-(-n // cfg.block_size) for n in mixed_lens)
    prof = ModelRunner(cfg, loaded, prof_blocks, device)
    mixed = step_peak_bytes(prof, synthetic_batch(prof, mixed_lens))
    decode = step_peak_bytes(prof, synthetic_batch(prof, [1] * max_running))
    pool = 0
    if sizes:
        pool = prof.capture_graphs(sizes, max_model_len).pool_bytes
    workspace = prof.attn_backend.workspace_bytes() if hasattr(prof.attn_backend, "workspace_bytes") else 0
    del prof
    log_tables(device, config.model)  # the profiling steps ran every kernel the model takes, so each read its table
    torch.cuda.empty_cache()

    # 4. the plan (one request holds its window's blocks where every layer is windowed)
    held = loaded.info.kv.held_tokens(max_model_len, cfg.block_size, chunk)
    moe = loaded.model.moe_layers()  # the layer's own figure; `graphserve plan` estimates it from the description
    parts = [("MoE workspace", moe[0].workspace_bytes(chunk + max_running - 1))] if moe else []
    # the profile's synthetic prefill had short contexts; a chunk's indexer at --max-model-len holds more
    index_scores = loaded.info.description.index_scores_bytes(chunk, max_model_len)
    if index_scores:
        mixed += index_scores
        parts.append(("indexer scores", index_scores))
    kv = loaded.info.kv
    pages = wanted_latent_pages(kv, cfg.block_size, max_running, chunk)
    plan = plan_memory(total, cfg.mem_fraction_static, weights, [mixed, decode], pool, RESERVE_BYTES + workspace,
                       loaded.info.kv_bytes_per_token, cfg.block_size, max_model_len, max_running,
                       activation_parts=parts, request_tokens=held, kv_parts=kv.parts(),
                       latent_bytes_per_token=kv.latent_bytes_per_token, latent_pages=pages,
                       latent_window=kv.latent_window or 0)  # fmt: skip
    for line in plan.table().splitlines():
        logger.info(line)
    if not plan.fits:
        raise ConfigError(f"not enough GPU memory for one request of --max-model-len {max_model_len}: {plan.refusal}",
                          param="mem_fraction_static")
    free, _ = device_memory(device)
    headroom = free - max(mixed, decode) - pool - RESERVE_BYTES
    num_blocks = min(plan.num_blocks, split_layout_bytes(headroom, kv, cfg.block_size, max_running, chunk).num_blocks)
    if num_blocks < plan.num_blocks:
        logger.warning("KV pool cut from %d to %d blocks: only %.2f GiB free on the device (another process?)",
                       plan.num_blocks, num_blocks, free / GiB)
        if num_blocks * cfg.block_size < held:
            raise ConfigError(
                f"only {free / GiB:.2f} GiB of GPU memory is free, which holds {num_blocks * cfg.block_size} KV tokens: "
                f"less than one request of --max-model-len {max_model_len}; free the GPU or lower --max-model-len",
                param="max_model_len")

    cap = requested_kv_tokens(cfg, kv, max_running)
    if cap is not None and cap // cfg.block_size < num_blocks:
        logger.info("KV pool capped by --num-kv-tokens/--kv-cache-gb at %d tokens (the plan allows %d)",
                    cap, num_blocks * cfg.block_size)
        num_blocks = cap // cfg.block_size
        if num_blocks * cfg.block_size < held:
            raise ConfigError(f"--num-kv-tokens/--kv-cache-gb give {num_blocks * cfg.block_size} KV tokens, less than "
                              f"one request of --max-model-len {max_model_len}", param="num_kv_tokens")

    # 5. allocate and capture for real. With --tp/--ep every rank holds the same number of blocks (the
    # scheduler's one block table addresses them all): the smallest any rank can afford.
    num_blocks = agree(num_blocks)
    runner = ModelRunner(cfg, loaded, num_blocks + 1, device,  # + the dummy block
                         latent_page_count(kv, num_blocks + 1, cfg.block_size, max_running, chunk))
    oversize, calibration = "none", None
    if sizes:
        bar = tqdm(total=len(sizes), desc="Capturing CUDA graphs", disable=None)
        graphs = runner.capture_graphs(sizes, max_model_len, progress=lambda _bs: bar.update(1))
        bar.close()
        if graphs.pool_bytes > pool * 1.1 + (64 << 20):
            logger.warning("graph pool %.2f GiB exceeds the planned %.2f GiB", graphs.pool_bytes / GiB, pool / GiB)
        if max_running > sizes[-1]:
            calibration = calibrate_oversize(runner, max_running)
            oversize = runner.oversize_mode = calibration.mode
            logger.info(calibration.log_line(sizes[-1]))
        else:
            logger.info("max_running_requests=%d: the running batch never exceeds the largest captured CUDA-graph "
                        "size (raise it with --cuda-graph-max-bs or --max-running-requests)", max_running)
    return GpuStartup(runner, plan, max_running, sizes, oversize, calibration)
