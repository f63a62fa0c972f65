"""`graphserve serve MODEL`: build the app, run it under uvicorn, drain on SIGTERM/SIGINT.

Draining keeps the socket open so new requests get a 503 with Retry-After (a closed port looks like a
crash to a load balancer), lets in-flight requests finish within ``--shutdown-timeout``, then fails the
rest with an error event and exits 0; a second signal skips the drain and exits 1. The engine core runs in a
process of its own (``--engine-in-process`` keeps it on a thread). ``ServerThread`` runs the same server,
engine included, in-process on a thread.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from graphserve.config import EngineConfig, add_engine_args, config_from_args
from graphserve.errors import ConfigError, GraphserveError, ServiceUnavailableError, bad_field
from graphserve.server.app import create_app
from graphserve.server.async_engine import AsyncEngine
from graphserve.server.guards import MAX_HEAD_BYTES, GuardOptions, guarded_protocol
from graphserve.server.metrics import ServerMetrics
from graphserve.server.state import ServerState
from graphserve.server.steplog import JsonlStepSink, StepLogger

logger = logging.getLogger("graphserve.server")
API_KEY_ENVS = ("VLLM_API_KEY", "GRAPHSERVE_API_KEY")
# A forced stop (second SIGTERM/SIGINT) cut streams mid-body: a service manager must not read it as clean.
FORCED_EXIT_CODE = 1
LOG_FORMAT = "[%(asctime)s] %(message)s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="HF folder, builtin:NAME or dummy:PRESET")
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="names clients use in the model field (default: MODEL)")
    parser.add_argument("--step-log", default=None, metavar="FILE", help="append every step record as JSONL")
    parser.add_argument("--step-log-max-mb", type=float, default=100.0,
                        help="rotate --step-log to FILE.1 (one backup kept) when it grows past this size")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on every route but /health and /metrics "
                             f"(default: ${API_KEY_ENVS[0]} or ${API_KEY_ENVS[1]})")
    parser.add_argument("--max-request-body-mb", type=float, default=32.0,
                        help="bodies above this size get 413 before they are read")
    parser.add_argument("--request-read-timeout", type=float, default=30.0,
                        help="seconds a request head, and then its body, may take to arrive (else 408 and close)")
    parser.add_argument("--max-connections", type=int, default=4096,
                        help="open connections past this bound get 503 and are closed")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM/SIGINT")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--stream-interval", type=int, default=1, metavar="TOKENS",
                        help="stream an event every TOKENS tokens per request (a client that falls behind gets "
                             "several tokens per event anyway)")
    parser.add_argument("--stream-stall-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="abort a request whose client has not read its output for SECONDS, freeing its KV")
    parser.add_argument("--enable-profile-endpoint", action="store_true",
                        help="serve POST /v1/profile, which profiles the next decode steps (graphserve profile)")
    parser.add_argument("--engine-in-process", action="store_true",
                        help="run the engine on a thread of the server process instead of its own process")
    parser.add_argument("--api-server-count", default="1", metavar="N",
                        help="HTTP front-end processes sharing the one engine process (each its own event loop "
                             "and GIL; the kernel spreads connections over them); 'auto' takes a quarter of the "
                             "CPU cores, at most 4")


def guard_options(args: argparse.Namespace) -> GuardOptions:
    bounds = (("--max-request-body-mb", args.max_request_body_mb),
              ("--request-read-timeout", args.request_read_timeout), ("--max-connections", args.max_connections))
    for flag, value in bounds:
        if not value > 0:
            raise ConfigError(f"{flag}={value} is invalid: must be > 0", param=flag)
    key = args.api_key or next((os.environ[e] for e in API_KEY_ENVS if os.environ.get(e)), None)
    return GuardOptions(api_key=key, max_body_bytes=int(args.max_request_body_mb * 1024 * 1024),
                        read_timeout_s=args.request_read_timeout, max_connections=args.max_connections)


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
    engine = AsyncEngine(config, on_step=on_step, separate_process=separate_process, stream_interval=stream_interval,
                         stream_stall_timeout=stream_stall_timeout, channel=channel)
    index = 0 if channel is None else channel.index
    metrics = ServerMetrics(lambda: engine.stats, lambda: engine.alive, api_server=index,
                            multiprocess=channel is not None)
    engine.on_abort = metrics.on_abort
    if index == 0:
        listeners += [metrics.on_step, StepLogger(config.log_interval, engine.kv_capacity_tokens).on_step]
    if step_log and index == 0:
        sink = JsonlStepSink(step_log, max_bytes=step_log_max_bytes)
        listeners.append(sink.on_step)
        closers.append(sink)
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = names or [config.model]
    state = ServerState(engine, metrics, model_name=names[0], accepted_names={*names, config.model},
                        profile_endpoint=profile_endpoint)
    return state, closers


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float):
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
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
        if not self.forced:
            logger.warning("second signal: exiting now, cutting %d request(s)", self.state.engine.num_inflight)
        self.force_exit = self.should_exit = self.forced = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_requested and self._drain is None:
            self._drain = asyncio.ensure_future(self.drain())
        if self.state.engine.load_error is not None and not self.failed:
            self.failed = self.should_exit = True
        return await super().on_tick(counter)

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


def api_server_count(value: str, engine_in_process: bool = False) -> int:
    """--api-server-count: a positive integer up to the CPU count, or 'auto'."""
    cpus = os.cpu_count() or 1
    if value == "auto":
        # each front-end is a busy core under load; the rest stay for the engine's threads and the OS
        return max(1, min(4, cpus // 4))
    try:
        count = int(value)
    except ValueError:
        raise ConfigError(f"--api-server-count={value!r} is invalid: must be an integer or 'auto'",
                          param="api_server_count") from None
    if not 1 <= count <= cpus:
        raise ConfigError(f"--api-server-count={count} is invalid: must be between 1 and the {cpus} CPU cores "
                          "of this machine", param="api_server_count")
    if count > 1 and engine_in_process:
        raise ConfigError(f"--api-server-count={count} is invalid with --engine-in-process: several front-ends "
                          "share an engine process, not a thread of one of them", param="api_server_count")
    return count


def build_state_from_args(args: argparse.Namespace, config: EngineConfig, channel: Any = None
                          ) -> tuple[ServerState, list[Any]]:
    if args.step_log_max_mb <= 0:
        raise ConfigError(f"--step-log-max-mb={args.step_log_max_mb} is invalid: must be > 0")
    return build_state(config, args.served_model_name, args.step_log, separate_process=not args.engine_in_process,
                       stream_interval=args.stream_interval, stream_stall_timeout=args.stream_stall_timeout,
                       profile_endpoint=args.enable_profile_endpoint,
                       step_log_max_bytes=int(args.step_log_max_mb * 1024 * 1024), channel=channel)


def serve_http(args: argparse.Namespace, state: ServerState, closers: list[Any], guards: GuardOptions,
               sockets: list[socket.socket] | None = None,
               on_server: Any = None) -> int:
    """Run the HTTP server until it exits; returns the process's exit code."""
    app = create_app(state, guards)
    server = GracefulServer(uvicorn_config(app, args.host, args.port, args.log_level, guards, state.metrics), state,
                            args.shutdown_timeout)
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
    if server.forced:
        return FORCED_EXIT_CODE
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)
    try:
        config = config_from_args(args, args.model)
        guards = guard_options(args)
        count = api_server_count(args.api_server_count, args.engine_in_process)
        if count > 1:
            from graphserve.server.api_servers import run_api_servers

            return run_api_servers(args, config, guards, count)
        state, closers = build_state_from_args(args, config)
    except GraphserveError as exc:
        print(f"graphserve serve: {exc.message}", file=sys.stderr)
        return 2
    logger.info("serving %s on http://%s:%d", config.model, args.host, args.port)
    return serve_http(args, state, closers, guards)


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
