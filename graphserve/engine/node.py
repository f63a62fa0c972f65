"""A node other than node 0 (``--nnodes N --node-rank R``, R > 0): its ranks only, no scheduler and no HTTP.

Its leader (this process) joins the rendezvous at ``--dist-init-addr``, refuses flags that differ from the
other nodes', starts the node's other ranks as node 0's driver does (engine/ranks.py) and runs the first
rank itself: every step comes from node 0's driver. It ends with node 0: on the shutdown header it exits 0;
when node 0 is lost (its store stops answering, or a collective fails) or one of this node's ranks dies, it
kills its ranks and exits ``RANK_FAILURE_EXIT``, which the lost rank's peers on node 0 see as a lost node.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from graphserve.distributed.nodes import NodeWatch, connect_store, exchange_flags, node_layout
from graphserve.engine.ranks import RANK_FAILURE_EXIT, RankPool, cpu_threads_per_rank, rank_device
from graphserve.models.parallel_check import check_parallel

if TYPE_CHECKING:
    from graphserve.config import EngineConfig

logger = logging.getLogger("graphserve.nodes")


def run_node(config: EngineConfig) -> int:
    """Run this node's ranks until node 0 stops them; returns the process's exit code."""
    from graphserve.engine.core import resolve_device
    from graphserve.engine.rank_worker import RankWorker

    layout = node_layout(config)
    device = resolve_device(config.device)
    check_parallel(config)
    if device.type == "cpu":
        cpu_threads_per_rank(layout.world)
    store = connect_store(config, layout.world, master=False)
    exchange_flags(store, config)
    init_method = f"tcp://{config.dist_init_addr}"
    pool = RankPool(config, layout.world, device, range(layout.first_rank + 1, layout.first_rank + layout.per_node),
                    init_method)
    pool.exit_on_failure = True  # nothing here to mark dead: the process ends, and node 0 sees the node lost
    pool.node_watch = NodeWatch(config, pool.fail)
    logger.info("node %d of %d: ranks %d..%d on %s, steps from node 0 at %s", config.node_rank, config.nnodes,
                layout.first_rank, layout.local_ranks[-1], device, config.dist_init_addr)
    try:
        worker = RankWorker(layout.first_rank, config, init_method, rank_device(device, 0), store=store)
        worker.serve(on_shutdown=lambda: (pool.node_watch.stop(), pool.expect_exit()))
    except BaseException:  # noqa: BLE001 - node 0 or a peer is gone mid-collective: this node ends too
        logger.exception("node %d: rank %d failed", config.node_rank, layout.first_rank)
        pool.node_watch.stop()
        pool.fail(f"node {config.node_rank}'s leader rank {layout.first_rank} failed")
        return RANK_FAILURE_EXIT
    pool.stop()
    pool.node_watch.mark_left()
    logger.info("node %d: node 0 stopped the engine; exiting", config.node_rank)
    return 0
