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
from graphserve.errors import ConfigError
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
    if config.node_rank != 0:
        raise ConfigError(f"--node-rank={config.node_rank} runs ranks only (node 0 schedules): start it with "
                          f"`graphserve serve {config.model} --nnodes {config.nnodes} --node-rank {config.node_rank} "
                          "...` (graphserve.engine.node.run_node)", param="node_rank")
    check_parallel(config)  # the split and the GPU count, as the server checked before binding its port
    store, ranks, init_method = None, None, None
    if config.nnodes > 1:  # this node's ranks after the driver; the other nodes start their own (engine/node.py)
        from graphserve.distributed.nodes import connect_store, exchange_flags, node_layout

        store = connect_store(config, world, master=True)
        exchange_flags(store, config)
        ranks, init_method = range(1, node_layout(config).per_node), f"tcp://{config.dist_init_addr}"
    threads = torch.get_num_threads()
    if device.type == "cpu":
        cpu_threads_per_rank(world)
    pool = RankPool(config, world, device, ranks, init_method)
    pool.restore_threads = threads
    try:
        if config.nnodes > 1:
            from graphserve.distributed.nodes import NodeWatch

            pool.node_watch = NodeWatch(config, pool.fail)
        parallel = init_parallel(0, config.tp, config.ep, pool.init_method, device, store=store)
        from graphserve.distributed.allreduce_choice import choose_all_reduce

        choose_all_reduce(parallel, config, device, model_dtype(config))
    except BaseException:
        stop_ranks(pool, None)
        raise
    logger.info("%d ranks joined (tp=%d, ep=%d, %s, %d node(s))", world, config.tp, config.ep, parallel.backend,
                config.nnodes)
    return pool


def stop_ranks(pool: RankPool, runner: ModelRunner | None) -> None:
    """Tell the ranks to stop (when they are alive and in the group), release this rank's graphs, wait
    for them, leave the group."""
    if pool.node_watch is not None:  # from here on another node's exit is a departure, not a loss
        pool.node_watch.stop()
    if pool.failure is None and get_parallel().distributed and runner is not None:
        try:
            StepSender().shutdown()
        except Exception:  # noqa: BLE001 - a rank died meanwhile: stop() kills what is left
            logger.exception("sending shutdown to the ranks failed")
        if pool.node_watch is not None:  # the other nodes leave on the header: the store must outlive them
            pool.node_watch.wait_for_others()
    if runner is not None:
        release_runner(runner)
    pool.stop(timeout=20.0 if runner is not None else 0.0)  # no runner: the ranks are mid start-up, kill them
    destroy_parallel()
    torch.set_num_threads(pool.restore_threads)
