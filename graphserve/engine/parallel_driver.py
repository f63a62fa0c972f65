"""The driver rank's side of ``--tp``/``--ep``: check the split, start the other ranks, join their group;
and at the end, stop them in the order that cannot hang (graphs, then ranks, then the group)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from graphserve.distributed.state import destroy_parallel, get_parallel, init_parallel, world_size_of
from graphserve.engine.rank_worker import release_runner
from graphserve.engine.ranks import RankPool, cpu_threads_per_rank
from graphserve.engine.step_sync import StepSender
from graphserve.models.parallel_check import check_parallel, model_dtype

if TYPE_CHECKING:
    from graphserve.config import EngineConfig
    from graphserve.engine.runner import ModelRunner

logger = logging.getLogger("graphserve.ranks")


def start_ranks(config: EngineConfig, device: torch.device) -> RankPool | None:
    """Start ranks 1..world-1 and join them as rank 0; None when the engine runs on one rank."""
    world = world_size_of(config.tp, config.ep)
    if world == 1:
        return None
    check_parallel(config)  # the split and the GPU count, as the server checked before binding its port
    threads = torch.get_num_threads()
    if device.type == "cpu":
        cpu_threads_per_rank(world)
    pool = RankPool(config, world, device)
    pool.restore_threads = threads
    try:
        parallel = init_parallel(0, config.tp, config.ep, pool.init_method, device)
        if device.type == "cuda":
            from graphserve.distributed.custom_all_reduce import maybe_enable_custom_all_reduce

            maybe_enable_custom_all_reduce(parallel, config, device, model_dtype(config))
    except BaseException:
        stop_ranks(pool, None)
        raise
    logger.info("%d ranks joined (tp=%d, ep=%d, %s)", world, config.tp, config.ep, parallel.backend)
    return pool


def stop_ranks(pool: RankPool, runner: ModelRunner | None) -> None:
    """Tell the ranks to stop (when they are alive and in the group), release this rank's graphs, wait
    for them, leave the group."""
    if pool.failure is None and get_parallel().distributed and runner is not None:
        try:
            StepSender().shutdown()
        except Exception:  # noqa: BLE001 - a rank died meanwhile: stop() kills what is left
            logger.exception("sending shutdown to the ranks failed")
    if runner is not None:
        release_runner(runner)
    pool.stop(timeout=20.0 if runner is not None else 0.0)  # no runner: the ranks are mid start-up, kill them
    destroy_parallel()
    torch.set_num_threads(pool.restore_threads)
