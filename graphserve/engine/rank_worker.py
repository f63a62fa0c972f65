"""One rank's model and runner, built the same way on every rank, and the loop of the ranks that do not
schedule.

``start_runner`` is what the driver's EngineCore and every other rank call to size and build their runner:
on GPU the measured start-up (engine/startup.py), whose forwards run their collectives in the same order on
every rank and whose per-rank decisions are agreed (distributed/comm.py ``agree``); on CPU a pool of the
size every rank can hold. A ``RankWorker`` then runs each step the driver broadcasts (engine/step_sync.py)
through the same ``forward_logits`` as the driver — graph replay or eager — and leaves sampling to it.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from graphserve.distributed.comm import agree
from graphserve.distributed.state import destroy_parallel, init_parallel
from graphserve.engine.gpu_share import apply_memory_share
from graphserve.engine.latent_pages import latent_page_count
from graphserve.engine.ranks import cpu_threads_per_rank
from graphserve.engine.runner import ModelRunner, cpu_kv_tokens
from graphserve.engine.scheduler import CPU_MAX_RUNNING_REQUESTS
from graphserve.layers.warmup_work import run_warmup_work
from graphserve.models.parallel_check import model_dtype

if TYPE_CHECKING:
    from graphserve.config import EngineConfig
    from graphserve.models.loader import LoadedModel

logger = logging.getLogger("graphserve.ranks")


@dataclass
class RunnerStart:
    runner: ModelRunner
    plan: Any  # MemoryPlan on GPU, None on CPU
    max_running_requests: int | None


def start_runner(config: EngineConfig, loaded: LoadedModel, device: torch.device, max_model_len: int) -> RunnerStart:
    if device.type == "cuda":
        from graphserve.engine.startup import start_gpu

        if config.tp > 1 or config.ep > 1:
            logger.info("memory plan per GPU: every rank measures and plans its own device (tp=%d, ep=%d); "
                        "the KV pool is the smallest any rank affords", config.tp, config.ep)
        gpu = start_gpu(config, loaded, device, max_model_len)
        return RunnerStart(gpu.runner, gpu.plan, gpu.max_running_requests)
    max_running = config.max_running_requests or CPU_MAX_RUNNING_REQUESTS
    num_blocks = agree(cpu_kv_tokens(config, loaded.info, max_running) // config.block_size + 1)  # + the dummy block
    pages = latent_page_count(loaded.info.kv, num_blocks, config.block_size, max_running, config.chunked_prefill_size)
    return RunnerStart(ModelRunner(config, loaded, num_blocks, device, pages), None, None)


def release_runner(runner: ModelRunner) -> None:
    """Drop the captured graphs (and their NCCL work) before the process group goes."""
    runner.graphs = None
    gc.collect()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
        torch.cuda.empty_cache()


class RankWorker:
    def __init__(self, rank: int, config: EngineConfig, init_method: str, device: torch.device,
                 store: Any = None) -> None:
        from graphserve.engine.input_processor import resolve_max_model_len
        from graphserve.models.loader import load_model

        self.rank = rank
        if device.type == "cpu":
            cpu_threads_per_rank(max(config.tp, config.ep))
        parallel = init_parallel(rank, config.tp, config.ep, init_method, device, store=store)
        from graphserve.distributed.allreduce_choice import choose_all_reduce

        choose_all_reduce(parallel, config, device, model_dtype(config))
        apply_memory_share(device)
        loaded = load_model(config, device)
        max_model_len = resolve_max_model_len(config, loaded.info)
        self.runner = start_runner(config, loaded, device, max_model_len).runner
        # rank 0's warm-up (engine/warmup.py) runs these on its own device only
        run_warmup_work(self.runner.model, self.runner.attn_backend, self.runner.kv_caches, max_model_len)
        from graphserve.engine.step_sync import StepReceiver

        self.receiver = StepReceiver(device, self.runner.kv_caches, self.runner.attn_backend, self.runner.latent_map)
        logger.info("rank %d ready on %s", rank, device)

    @torch.inference_mode()
    def serve(self, on_shutdown: Callable[[], None] | None = None) -> None:
        while True:
            batch = self.receiver.recv()
            if batch is None:
                if on_shutdown is not None:  # a node leader: its own ranks got the same header
                    on_shutdown()
                break
            self.runner.forward_logits(batch)
        release_runner(self.runner)
        destroy_parallel()
