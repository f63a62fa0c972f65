"""Sweeps over server configurations: start the server command with each combination of the grid
on a free loopback port, wait for /health, sweep, stop it (SIGTERM, then SIGKILL). A server that
dies mid-sweep leaves the concurrency that killed it and its last log lines, every configuration
keeps the doctor's reading of its log, and the next configuration still runs."""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import shlex
import signal
import socket
import string
import subprocess
import threading
import time
from typing import Any

from graphserve.bench.levels import sweep_levels
from graphserve.bench.scrape import healthy
from graphserve.errors import bad_field

LOG_TAIL_LINES = 100
STOP_GRACE_S = 10.0


def parse_grid(items: list[str]) -> list[dict[str, str]]:
    """["a=1,2", "b=x"] -> [{"a": "1", "b": "x"}, {"a": "2", "b": "x"}] (every combination)."""
    keys, values = [], []
    for item in items:
        key, sep, vals = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier() or not vals.strip():
            raise bad_field("server_grid", item, "must look like KEY=V1,V2 with KEY a placeholder name")
        if key in keys:
            raise bad_field("server_grid", item, f"repeats the key {key!r}")
        keys.append(key)
        values.append([v.strip() for v in vals.split(",") if v.strip()])
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)] if keys else [{}]


def render_command(template: str, params: dict[str, str], host: str, port: int) -> list[str]:
    fields = {name for _, name, _, _ in string.Formatter().parse(template) if name}
    values = {"host": host, "port": str(port), **params}
    missing = sorted(fields - set(values))
    if missing:
        raise bad_field("server_cmd", template, f"placeholder {{{missing[0]}}} has no --server-grid value")
    return shlex.split(template.format(**values))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server subprocess in its own process group, its output teed to a log file and a tail."""

    def __init__(self, argv: list[str], log_path: str, host: str, port: int):
        self.argv, self.log_path, self.host, self.port = argv, log_path, host, port
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self._log = open(self.log_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1, start_new_session=True)
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            self._log.write(line)
            self._log.flush()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                return False
            if healthy(self.base_url, timeout_s=2.0):
                return True
            time.sleep(0.1)
        return False

    def stop(self) -> int | None:
        """SIGTERM to the process group, SIGKILL after a grace period; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._log.close()
        return self.proc.returncode

    def log_text(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


def diagnose_log(text: str) -> list[dict]:
    from dataclasses import asdict

    from graphserve.analysis.doctor import diagnose_lines

    return [asdict(f) for f in diagnose_lines(text.splitlines())]


def run_configurations(args: argparse.Namespace, levels: list[int], output_dir: str, tokenizer: Any = None) -> list[dict]:
    host = "127.0.0.1"
    os.makedirs(output_dir, exist_ok=True)
    configs = []
    for i, params in enumerate(parse_grid(args.server_grid)):
        port = free_port(host)
        argv = render_command(args.server_cmd, params, host, port)
        label = f"cfg{i}-"
        server = ServerProcess(argv, os.path.join(output_dir, f"{label}server.log"), host, port)
        entry: dict[str, Any] = {"params": params, "command": shlex.join(argv), "points": [], "fit": None,
                                 "telemetry_fit": None, "failed_at": None, "log_tail": [], "diagnosis": []}
        print(f"== configuration {i}: {params}: {entry['command']}", flush=True)
        server.start()
        try:
            if not server.wait_healthy(args.server_timeout):
                entry["status"] = "startup_failed" if not server.alive() else "startup_timeout"
            else:
                entry.update(sweep_levels(args, server.base_url, levels, output_dir, alive=server.alive,
                                          tokenizer=tokenizer, label=label))
                entry["status"] = "died" if entry["failed_at"] else "ok"
        finally:
            died = not server.alive()
            entry["exit_code"] = server.stop()
        if died and entry.get("status") == "ok":
            entry["status"] = "died_after_sweep"
        if died or entry["status"] != "ok":
            entry["log_tail"] = list(server.tail)
        # Every configuration's log is read, not only a dead one's: a slow configuration says why in it too.
        entry["diagnosis"] = diagnose_log(server.log_text())
        entry["log_file"] = os.path.basename(server.log_path)
        entry["fit"] = entry.get("fit") or {}  # {}: no fit for this configuration (it died or never started)
        entry["asymptote_tok_s"] = entry["fit"].get("asymptote_tok_s")
        configs.append(entry)
    return configs
