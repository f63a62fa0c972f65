"""`graphserve serve MODEL`: the flags (serve_args.py), the checks made before anything binds a port or spawns
a process, then one HTTP server (launch.py) or several front-ends sharing one engine (api_servers.py)."""

from __future__ import annotations

import argparse
import logging
import sys

from graphserve.config import EngineConfig, config_from_args
from graphserve.engine.cpu_affinity import keep_server_off_engine_cpus
from graphserve.errors import ConfigError, GraphserveError
from graphserve.models.parallel_check import check_parallel
from graphserve.server.api_servers import run_api_servers
from graphserve.server.launch import LOG_FORMAT, build_state_from_args, serve_http
from graphserve.server.serve_args import add_arguments, api_server_count, guard_options

__all__ = ["add_arguments", "run"]
logger = logging.getLogger("graphserve.server")


def _check_host_memory(config: EngineConfig) -> None:
    """Before the engine process spawns: a CPU model too large for this machine is refused within a second."""
    from graphserve.engine.core import resolve_device
    from graphserve.models.host_memory import check_host_memory

    check_host_memory(config, resolve_device(config.device))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)
    try:
        config = config_from_args(args, args.model)
        check_parallel(config)  # the split and the GPU count, before a port binds or a rank spawns
        if config.node_rank > 0:  # ranks only: node 0 serves HTTP and schedules (engine/node.py)
            from graphserve.engine.node import run_node  # torch and the engine load here, never in a front-end

            return run_node(config)
        guards = guard_options(args)
        _check_host_memory(config)
        if not args.engine_in_process:  # before any thread or process starts: they inherit this process's CPUs
            keep_server_off_engine_cpus()
        count = api_server_count(args.api_server_count, args.engine_in_process)
        if count > 1 and config.dp > 1:
            # every front-end would need a channel to every replica and the routing state shared among them
            raise ConfigError(f"--api-server-count={count} with --dp={config.dp} is not supported: run --dp "
                              "replicas behind one front-end, or one server per replica behind `graphserve router`",
                              param="api_server_count")
        if count > 1:
            return run_api_servers(args, config, guards, count)
        state, closers = build_state_from_args(args, config)
    except GraphserveError as exc:
        print(f"graphserve serve: {exc.message}", file=sys.stderr)
        return 2
    logger.info("serving %s on http://%s:%d", config.model, args.host, args.port)
    return serve_http(args, state, closers, guards)
