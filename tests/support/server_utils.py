"""A real `graphserve serve` process on a free loopback port, for the server tests."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

MODEL = "builtin:tiny-llama"
# Small and fast on 2 CPU cores; the tests never need long contexts.
SMALL_ENGINE = ["--max-model-len", "512", "--num-kv-tokens", "8192", "--log-interval", "4"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, log_dir: Path, *args: str, env: dict[str, str] | None = None, model: str = MODEL):
        self.port = free_port()
        self.log_path = Path(log_dir) / f"server-{self.port}.log"
        self.args = [sys.executable, "-m", "graphserve.cli", "serve", model, "--port", str(self.port),
                     *SMALL_ENGINE, *args]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> ServerProcess:
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child holds it; closed with the process
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not healthy within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def metrics(base_url: str) -> dict[str, float]:
    """Every sample of /metrics as {"name{label=value,...}": value}; parsing is the format check."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.1):  # noqa: ANN001
    """Poll until ``predicate()`` is truthy; returns its last value."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


def engine_processes(srv: ServerProcess) -> list[psutil.Process]:
    """The server's spawned engine processes (not multiprocessing's resource tracker): one, or none with
    --engine-in-process."""
    assert srv.proc is not None
    return [p for p in psutil.Process(srv.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]


def engine_child(srv: ServerProcess) -> psutil.Process:
    """The server's engine process."""
    children = engine_processes(srv)
    assert len(children) == 1, [p.cmdline() for p in psutil.Process(srv.proc.pid).children()]
    return children[0]


def stream_until_first_event(base_url: str, body: dict, started: concurrent.futures.Future) -> list[str]:
    """The data of every event of a streamed completion; ``started`` is set when the first one arrives."""
    events = []
    with httpx.stream("POST", base_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if not started.done():
                    started.set_result(True)
    return events
