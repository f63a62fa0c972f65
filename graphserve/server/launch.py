"""The server of `graphserve serve MODEL`: build the app, run it under uvicorn, drain on SIGTERM/SIGINT.

Draining keeps the socket open so new requests get a 503 with Retry-After (a closed port looks like a
crash to a load balancer), lets in-flight requests finish within ``--shutdown-timeout``, then fails the
rest with an error event and exits 0; a second signal skips the drain and exits 1. The engine core runs in a
process of its own (``--engine-in-process`` keeps it on a thread). ``ServerThread`` runs the same server,
engine included, in-process on a thread. The flags and their checks are in serve_args.py, the command in
serve_command.py.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import threading
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from graphserve.config import EngineConfig
from graphserve.errors import ConfigError, ServiceUnavailableError, bad_field
from graphserve.models.parallel_check import check_parallel
from graphserve.server.app import create_app
from graphserve.server.frontend import Frontend
from graphserve.server.guards import MAX_HEAD_BYTES, GuardOptions, guarded_protocol
from graphserve.server.metrics import ServerMetrics
from graphserve.server.model_info import default_served_name
from graphserve.server.replicas import ReplicaSet
from graphserve.server.state import ServerState
from graphserve.server.steplog import JsonlStepSink, StepLogger

logger = logging.getLogger("graphserve.server")
# A forced stop (second SIGTERM/SIGINT) cut streams mid-body: a service manager must not read it as clean.
FORCED_EXIT_CODE = 1
# The engine process died while serving: the HTTP process exits too, so that a supervisor restarts the server.
ENGINE_DIED_EXIT_CODE = 3
# After a forced stop fails the in-flight requests, the time their error responses get to leave before exit.
FORCED_FLUSH_S = 0.3
LOG_FORMAT = "[%(asctime)s] %(message)s"


def build_state(
    config: EngineConfig, served_model_name: list[str] | str | None = None, step_log: str | None = None,
    separate_process: bool = False, stream_interval: int = 1, stream_stall_timeout: float = 30.0,
    profile_endpoint: bool = False, step_log_max_bytes: int | None = None, channel: Any = None,
) -> tuple[ServerState, list[Any]]:
    """The server state with its telemetry listeners wired; returns (state, things to close).

    ``separate_process`` runs the engine core in a process of its own, else on a thread of this one. With
    ``channel`` (an EngineChannel) this is front-end ``channel.index`` of several sharing one engine process:
    its metrics go to the shared multiprocess files, and only front-end 0 feeds the step metrics and logs (every
    front-end receives every step record, for /v1/telemetry).
    """
    listeners: list[Any] = []
    closers: list[Any] = []

    def on_step(rec: Any) -> None:
        for fn in listeners:
            try:
                fn(rec)
            except Exception:  # noqa: BLE001 - a broken listener must never fail an engine step
                logger.exception("step listener %r failed", fn)

    if stream_interval < 1:
        raise bad_field("stream_interval", stream_interval, "must be >= 1 token")
    if not stream_stall_timeout > 0:
        raise bad_field("stream_stall_timeout", stream_stall_timeout, "must be > 0 seconds")
    index = 0 if channel is None else channel.index
    if config.dp > 1:
        return _build_replica_state(config, served_model_name, step_log, separate_process, stream_interval,
                                    stream_stall_timeout, profile_endpoint, step_log_max_bytes)
    engine = Frontend(config, on_step=on_step, separate_process=separate_process, stream_interval=stream_interval,
                      stream_stall_timeout=stream_stall_timeout, channel=channel)
    metrics = ServerMetrics(lambda: engine.stats, lambda: engine.alive, api_server=index,
                            multiprocess=channel is not None)
    engine.on_abort = metrics.on_abort
    if index == 0:
        listeners += [metrics.on_step, StepLogger(config.log_interval, engine.kv_capacity_tokens).on_step]
    if step_log and index == 0:
        sink = JsonlStepSink(step_log, max_bytes=step_log_max_bytes)
        listeners.append(sink.on_step)
        closers.append(sink)
    return _state(config, engine, metrics, served_model_name, profile_endpoint), closers


def _state(config: EngineConfig, engine: Any, metrics: ServerMetrics, served_model_name: list[str] | str | None,
           profile_endpoint: bool) -> ServerState:
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = names or [default_served_name(config.model)]
    return ServerState(engine, metrics, model_name=names[0], accepted_names={*names, config.model},
                       profile_endpoint=profile_endpoint)


def _build_replica_state(
    config: EngineConfig, served_model_name: list[str] | str | None, step_log: str | None, separate_process: bool,
    stream_interval: int, stream_stall_timeout: float, profile_endpoint: bool, step_log_max_bytes: int | None,
) -> tuple[ServerState, list[Any]]:
    """``build_state`` for --dp replicas (server/replicas.py): every step record is stamped with its replica, the
    step log keeps a line per replica, the engine metrics carry a ``replica`` label."""
    listeners: list[Any] = []
    closers: list[Any] = []

    def on_step(replica: int, rec: Any) -> None:
        rec.replica = replica
        for fn in listeners:
            try:
                fn(rec)
            except Exception:  # noqa: BLE001 - a broken listener must never fail an engine step
                logger.exception("step listener %r failed", fn)

    engine = ReplicaSet(config, on_step=on_step, separate_process=separate_process, stream_interval=stream_interval,
                        stream_stall_timeout=stream_stall_timeout)
    metrics = ServerMetrics(lambda: engine.stats, lambda: engine.alive, replica_views=lambda: [
        (str(r), f.stats, f.alive) for r, f in enumerate(engine.replicas)])
    engine.on_abort = metrics.on_abort
    engine.on_route = metrics.on_route
    step_loggers = [StepLogger(config.log_interval, f.kv_capacity_tokens, prefix=f"DP{r} ")
                    for r, f in enumerate(engine.replicas)]
    listeners += [metrics.on_step, lambda rec: step_loggers[rec.replica].on_step(rec)]
    if step_log:
        sink = JsonlStepSink(step_log, max_bytes=step_log_max_bytes)
        listeners.append(sink.on_step)
        closers.append(sink)
    return _state(config, engine, metrics, served_model_name, profile_endpoint), closers


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float,
                 engine_death_grace: float = 5.0):
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.engine_death_grace = engine_death_grace
        self.engine_died_at: float | None = None
        self.drain_requested = False
        self.failed = False
        self.forced = False
        self._drain: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Not uvicorn's: it would close the socket at once and re-raise the signal at exit (exit code != 0).
        if self.drain_requested:  # a second signal skips the drain
            self.force()
        self.drain_requested = True

    def request_drain(self) -> None:
        """Drain as for a first signal; a repeat is a no-op (the supervisor of several front-ends asks so)."""
        self.drain_requested = True

    def force(self) -> None:
        """Exit now, but first answer every in-flight request in the OpenAI error shape: a JSON 503 for a
        unary one, an error event for a stream (uvicorn alone would send a plain-text 500 or cut the body)."""
        if self.forced:
            self.force_exit = self.should_exit = True  # a third signal: no more waiting
            return
        self.forced = True
        logger.warning("second signal: exiting now, failing %d request(s)", self.state.engine.num_inflight)
        try:
            loop = asyncio.get_running_loop()  # a signal handler runs on the loop's thread
        except RuntimeError:
            loop = None
        if loop is None or not loop.is_running():
            self.force_exit = self.should_exit = True
            return
        loop.call_soon_threadsafe(self._fail_inflight_then_exit, loop)

    def _fail_inflight_then_exit(self, loop: asyncio.AbstractEventLoop) -> None:
        self.state.draining = True
        failed = self.state.engine.abort_all(ServiceUnavailableError(
            "the server was stopped (a second SIGTERM/SIGINT) before this request finished", retry_after=1))

        def exit_now() -> None:
            self.force_exit = self.should_exit = True

        loop.call_later(FORCED_FLUSH_S if failed else 0.0, exit_now)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_requested and self._drain is None:
            self._drain = asyncio.ensure_future(self.drain())
        if self.state.engine.load_error is not None and not self.failed:
            self.failed = self.should_exit = True
        self._check_engine_death()
        return await super().on_tick(counter)

    def _check_engine_death(self) -> None:
        """A dead engine ends the server: its in-flight requests have their error events (engine_events.py)
        and /health says 503 meanwhile; after ``engine_death_grace`` seconds for those to reach the clients,
        the process exits non-zero instead of answering 503 forever."""
        error = self.state.engine.engine_error
        if error is None or self.should_exit:
            return
        now = time.monotonic()
        if self.engine_died_at is None:
            self.engine_died_at = now
            logger.error("the engine is gone: exiting within %.1f s (--engine-death-grace)", self.engine_death_grace)
        if now - self.engine_died_at >= self.engine_death_grace:
            self.should_exit = True

    async def drain(self) -> None:
        state = self.state
        state.draining = True
        deadline = time.monotonic() + self.shutdown_timeout
        logger.info("draining: %d request(s) in flight, up to %.1f s", state.engine.num_inflight, self.shutdown_timeout)
        while state.engine.num_inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = state.engine.abort_all(ServiceUnavailableError(
            f"the server shut down before this request finished (--shutdown-timeout={self.shutdown_timeout})"))
        if left:
            logger.warning("drain timed out: aborted %d request(s)", left)
            await asyncio.sleep(0.5)  # let their error responses reach the clients
        self.should_exit = True


def uvicorn_config(app: Any, host: str, port: int, log_level: str, guards: GuardOptions, metrics: Any
                   ) -> uvicorn.Config:
    # log_config=None: uvicorn's loggers go through ours, one format for every line.
    return uvicorn.Config(app, host=host, port=port, log_config=None, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=5, timeout_keep_alive=30,
                          http=guarded_protocol(AutoHTTPProtocol, guards, metrics),
                          # h11 would refuse a head over 16 KiB that arrives in pieces with a bare 400; the
                          # guard decides instead (431 past MAX_HEAD_BYTES)
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES + 1024)


def build_state_from_args(args: argparse.Namespace, config: EngineConfig, channel: Any = None
                          ) -> tuple[ServerState, list[Any]]:
    if args.step_log_max_mb <= 0:
        raise ConfigError(f"--step-log-max-mb={args.step_log_max_mb} is invalid: must be > 0")
    if not args.engine_death_grace >= 0:
        raise ConfigError(f"--engine-death-grace={args.engine_death_grace} is invalid: must be >= 0",
                          param="--engine-death-grace")
    state, closers = build_state(config, args.served_model_name, args.step_log,
                                 separate_process=not args.engine_in_process, stream_interval=args.stream_interval,
                                 stream_stall_timeout=args.stream_stall_timeout,
                                 profile_endpoint=args.enable_profile_endpoint,
                                 step_log_max_bytes=int(args.step_log_max_mb * 1024 * 1024), channel=channel)
    state.strict_api = args.strict_api
    return state, closers


def serve_http(args: argparse.Namespace, state: ServerState, closers: list[Any], guards: GuardOptions,
               sockets: list[socket.socket] | None = None,
               on_server: Any = None) -> int:
    """Run the HTTP server until it exits; returns the process's exit code."""
    app = create_app(state, guards)
    server = GracefulServer(uvicorn_config(app, args.host, args.port, args.log_level, guards, state.metrics), state,
                            args.shutdown_timeout, args.engine_death_grace)
    if on_server is not None:
        on_server(server)
    try:
        server.run(sockets=sockets)
    finally:
        for c in closers:
            c.close()
    if server.failed or state.engine.load_error is not None:
        logger.error("engine failed to start: %s", state.engine.load_error)
        return 1
    if state.engine.engine_error is not None:
        logger.error("exiting with code %d: %s", ENGINE_DIED_EXIT_CODE, state.engine.engine_error)
        return ENGINE_DIED_EXIT_CODE
    if server.forced:
        return FORCED_EXIT_CODE
    return 0


class ServerThread:
    """The whole server in-process on a background thread: ``with ServerThread(cfg) as s: s.base_url``."""

    def __init__(self, config: EngineConfig, host: str = "127.0.0.1", port: int = 0, **opts: Any):
        self.config = config
        self.host = host
        self.port = port
        self.opts = opts
        self.state: ServerState | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._closers: list[Any] = []

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 600.0) -> ServerThread:
        check_parallel(self.config)  # as `graphserve serve` does: a split that cannot run never takes a port
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        self.state, self._closers = build_state(self.config, self.opts.get("served_model_name"),
                                                self.opts.get("step_log"),
                                                stream_interval=self.opts.get("stream_interval", 1),
                                                stream_stall_timeout=self.opts.get("stream_stall_timeout", 30.0),
                                                profile_endpoint=self.opts.get("enable_profile_endpoint", False))
        guards = self.opts.get("guards") or GuardOptions()
        config = uvicorn_config(create_app(self.state, guards), self.host, self.port,
                                self.opts.get("log_level", "warning"), guards, self.state.metrics)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="graphserve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not (self._server.started and self.state.engine.ready.is_set()):
            if time.monotonic() > deadline or not self._thread.is_alive():
                self.stop()
                raise RuntimeError(f"server did not start within {timeout:.0f} s")
            time.sleep(0.02)
        if self.state.engine.load_error is not None:
            err = self.state.engine.load_error
            self.stop()
            raise err
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(30)
        for c in self._closers:
            c.close()
        self._closers = []

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
