"""The HTTP side of the server benchmarks: a `graphserve serve` subprocess and the every-event client.

The client opens a connection per request and parses every SSE event as its bytes arrive (as SGLang's
bench_serving reads), so a server that keeps up only because slow readers let it merge tokens is not
flattered. ``client_worker`` runs in a process of its own (several share the streams at high concurrency).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

try:
    from orjson import loads
except ImportError:
    loads = json.loads


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server(model: str, engine_args: str, extra: tuple[str, ...] = (), env: dict[str, str] | None = None
           ) -> Iterator[str]:
    """The base URL of a `graphserve serve` subprocess, once /health says 200 (``env``: its environment, where not
    this process's)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "graphserve.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *shlex.split(engine_args), *extra]
    proc = subprocess.Popen(cmd, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy in 900 s")
            time.sleep(0.05)
        yield base_url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


async def one_request(session: Any, base_url: str, prompt: str | list[int], output_len: int, stream: bool,
                      knobs: dict[str, Any]) -> tuple[float, int, int]:
    """(TTFT s, output tokens, events) of one /v1/completions request; TTFT is the first event with text."""
    from graphserve.bench.backends import iter_sse_data

    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True, "stream": stream,
            **knobs}
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    ttft = None
    tokens = events = 0
    async with session.post(base_url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        if not stream:
            data = loads(await resp.read())
            return time.perf_counter() - t0, data["usage"]["completion_tokens"], 1
        async for data in iter_sse_data(resp.content):
            if data == b"[DONE]":
                break
            event = loads(data)
            events += 1
            if "error" in event:
                raise RuntimeError(f"stream failed: {event['error']}")
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - t0), tokens, events


_START: Any = None  # the barrier every client process of a run waits at (set by set_start_barrier)


def set_start_barrier(barrier: Any) -> None:
    """A client process's initializer: the run's start barrier, handed over when the process is created."""
    global _START
    _START = barrier


def client_worker(base_url: str, prompts: list[str] | list[list[int]], output_len: int, concurrency: int,
                  stream: bool) -> tuple[float, float, int, int]:
    """One client process: ``concurrency`` streams over ``prompts``, sent once every client process has warmed
    its connection path and passed the start barrier (shared by them all: a process that took longer to spawn
    and import must not start its streams late, with the others' already running); returns (wall time it
    started, wall time the last finished, tokens, events)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def run() -> tuple[float, float, int, int]:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a connection per request
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
            await one_request(session, base_url, prompts[0], 4, stream, {})  # connect path warm
            await asyncio.to_thread(_START.wait)
            started = time.time()
            sem = asyncio.Semaphore(max(1, concurrency))

            async def bounded(p: list[int]) -> tuple[float, int, int]:
                async with sem:
                    return await one_request(session, base_url, p, output_len, stream, {})

            results = await asyncio.gather(*(bounded(p) for p in prompts))
        return started, time.time(), sum(r[1] for r in results), sum(r[2] for r in results)

    return asyncio.run(run())
