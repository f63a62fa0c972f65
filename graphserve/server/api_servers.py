"""`graphserve serve --api-server-count N`: N HTTP front-end processes share one engine process.

One front-end process is one event loop and one GIL: at high concurrency with clients that read every event,
its per-token work (detokenization, JSON, SSE) caps the server below the engine. So this process becomes a
supervisor that serves no HTTP itself:

- it starts the engine process (engine/serve_loop.py) with one pipe per front-end and one shared request queue,
  then N front-end processes (spawned: nothing of this process is forked into them);
- each front-end listens on the same host:port with SO_REUSEPORT, so the kernel spreads new connections
  over them by their address hash (one shared socket would let whichever loop wakes first take a whole
  burst); a front-end tokenizes, detokenizes and streams its own requests, and the engine sends it only their
  outputs, one batch per step;
- what must hold for the whole server is shared: the queue bound counts every front-end's sequences
  (engine/serve_loop.py), --max-connections every front-end's connections (guards.py), the metrics are summed over
  the front-ends (metrics.py), a client rid is unique over all of them (engine/output_router.OutputRouter);
- the first SIGTERM/SIGINT asks every front-end to drain (SIGUSR1), a second to stop now (SIGUSR2); once
  they have all exited the engine is told to stop. A front-end that exits alone takes the server down with
  it; an engine that dies is seen by every front-end as the end of its pipe (streams fail, /health 503).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from typing import Any

from graphserve.config import EngineConfig
from graphserve.engine.process_client import EngineChannel, Shutdown, log_setup
from graphserve.engine.serve_loop import engine_main
from graphserve.server.guards import GuardOptions
from graphserve.server.launch import FORCED_EXIT_CODE, LOG_FORMAT, build_state_from_args, serve_http
from graphserve.server.metrics import MULTIPROC_ENV

logger = logging.getLogger("graphserve.server")
ENGINE_STOP_TIMEOUT_S = 10.0


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket on host:port in the SO_REUSEPORT group every front-end joins."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def frontend_main(args: argparse.Namespace, config: EngineConfig, channel: EngineChannel, guards: GuardOptions
                  ) -> None:
    """One front-end process: the whole HTTP server of launch.py, on a link to the shared engine."""
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)
    sock = listening_socket(args.host, args.port)
    sock.listen(2048)
    state, closers = build_state_from_args(args, config, channel)
    server_box: list[Any] = []

    def on_signal(signum: int, _frame: Any) -> None:
        if not server_box:
            return
        if signum == signal.SIGUSR1:
            server_box[0].request_drain()
        else:
            server_box[0].force()

    signal.signal(signal.SIGUSR1, on_signal)  # uvicorn handles SIGINT/SIGTERM itself: the same drain
    signal.signal(signal.SIGUSR2, on_signal)
    parent = multiprocessing.parent_process()
    if parent is not None:  # a supervisor killed outright must not leave its front-ends serving
        threading.Thread(target=_exit_with_parent, args=(parent.sentinel,), daemon=True).start()
    sys.exit(serve_http(args, state, closers, guards, sockets=[sock], on_server=server_box.append))


def _exit_with_parent(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os.kill(os.getpid(), signal.SIGUSR2)


class Supervisor:
    def __init__(self, args: argparse.Namespace, config: EngineConfig, guards: GuardOptions, count: int):
        self.args = args
        self.config = config
        self.count = count
        ctx = multiprocessing.get_context("spawn")
        self.ctx = ctx
        self.inbox = ctx.Queue()
        self.inbox.cancel_join_thread()  # never block the exit on a dead engine's queue
        self.queued = ctx.Value("q", 0)
        self.ready = ctx.Value("i", 0)
        self.guards = dataclasses.replace(guards, open_connections=ctx.Value("q", 0))
        self.engine: Any = None
        self.frontends: list[Any] = []
        self.signals = 0
        self.engine_exit: int | None = None  # set when the engine exited while the front-ends served

    def start(self) -> None:
        pipes = [self.ctx.Pipe(duplex=False) for _ in range(self.count)]
        level, fmt = log_setup()
        self.engine = self.ctx.Process(target=engine_main, name="graphserve-engine", daemon=True,
                                       args=(self.config, self.inbox, [w for _, w in pipes], level, fmt,
                                             self.queued))
        self.engine.start()
        for _, w in pipes:
            w.close()  # the engine holds the write ends: a front-end sees its death as the end of its pipe
        for i, (r, _) in enumerate(pipes):
            channel = EngineChannel(self.inbox, r, i, self.queued, self.ready, self.count)
            proc = self.ctx.Process(target=frontend_main, name=f"graphserve-api-{i}",
                                    args=(self.args, self.config, channel, self.guards), daemon=True)
            proc.start()
            r.close()
            self.frontends.append(proc)
        logger.info("engine process %d; HTTP front-end processes %s", self.engine.pid,
                    " ".join(str(p.pid) for p in self.frontends))

    def on_signal(self, signum: int, _frame: Any) -> None:
        self.signals += 1
        self.tell_frontends(signal.SIGUSR1 if self.signals == 1 else signal.SIGUSR2)

    def tell_frontends(self, sig: int) -> None:
        for proc in self.frontends:
            if proc.exitcode is None:
                os.kill(proc.pid, sig)

    def wait(self) -> int:
        """Until every front-end has exited; returns the server's exit code."""
        running = list(self.frontends)
        engine_seen = False
        code = 0
        while running:
            waits = [p.sentinel for p in running] + ([] if engine_seen else [self.engine.sentinel])
            multiprocessing.connection.wait(waits)
            if not engine_seen and self.engine.exitcode is not None:
                engine_seen = True
                self.engine_exit = self.engine.exitcode
                logger.error("the engine process exited with code %s: the front-ends fail its requests",
                             self.engine.exitcode)
            for proc in [p for p in running if p.exitcode is not None]:
                running.remove(proc)
                exitcode = proc.exitcode if proc.exitcode >= 0 else 1  # killed by a signal
                code = max(code, exitcode)
                if self.signals == 0 and running:  # one front-end left on its own: stop the others
                    logger.error("%s exited with code %s: stopping the server", proc.name, proc.exitcode)
                    self.tell_frontends(signal.SIGUSR1)
        return code

    def stop_engine(self) -> None:
        if self.engine is None or self.engine.exitcode is not None:
            return
        self.inbox.put(Shutdown())
        self.engine.join(ENGINE_STOP_TIMEOUT_S)
        if self.engine.exitcode is None:
            logger.warning("engine process %s did not stop within %.0f s: killing it", self.engine.pid,
                           ENGINE_STOP_TIMEOUT_S)
            self.engine.kill()
            self.engine.join(5)

    def kill_frontends(self) -> None:
        for proc in self.frontends:
            if proc.exitcode is None:
                proc.kill()
                proc.join(5)


def run_api_servers(args: argparse.Namespace, config: EngineConfig, guards: GuardOptions, count: int) -> int:
    # Reserve the port (and resolve port 0) before any front-end starts: a socket bound in the SO_REUSEPORT
    # group that never listens takes no connection.
    holder = listening_socket(args.host, args.port)
    args.port = holder.getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="graphserve-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir  # inherited by the spawned front-ends before they import anything
    sup = Supervisor(args, config, guards, count)
    previous = {s: signal.signal(s, sup.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    logger.info("serving %s on http://%s:%d with %d HTTP front-end processes", config.model, args.host, args.port,
                count)
    try:
        sup.start()
        code = sup.wait()
        forced = sup.signals > 1
    finally:
        sup.kill_frontends()  # only ever needed when the wait itself failed
        sup.stop_engine()
        holder.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if forced and code == 0:  # a forced stop cut streams: never read it as clean
        code = FORCED_EXIT_CODE
    if sup.engine_exit is not None:
        logger.error("exiting with code %d: the engine process exited with code %s; restart the server", code,
                     sup.engine_exit)
    return code
