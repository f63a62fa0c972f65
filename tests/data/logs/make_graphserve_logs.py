"""Regenerate the graphserve doctor fixtures from real server runs on CPU.

Each fixture is the stderr of ``graphserve serve builtin:tiny-llama`` (step line every few decode
steps) while ``graphserve bench`` loads it, stopped with SIGTERM; nothing is edited afterwards:

- graphserve_clean.log: a light load the server keeps up with;
- graphserve_problems.log: a KV pool of a few requests, a small running cap and arrivals faster than
  the server finishes them, stopped while still overloaded: the pool fills and the waiting queue grows.

Run from the repository root (a minute or two on CPU):
    PYTHONPATH=$PWD python tests/data/logs/make_graphserve_logs.py
It prints what `graphserve doctor` finds in each log, which tests/lab/test_doctor.py then asserts.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name: (serve flags, bench flags, seconds of load before the server is stopped; None: until bench ends)
RUNS = {
    "graphserve_clean.log": (
        ["--log-interval", "8"],
        ["--num-prompts", "16", "--max-concurrency", "4", "--random-input-len", "48", "--random-output-len", "48"],
        None,
    ),
    # 120-token prompts take 8 blocks of 16 with their first output token: four fill the 32-block pool.
    # Arrivals at 30/s outpace the server on any CPU, so the queue grows until the run is stopped.
    "graphserve_problems.log": (
        ["--log-interval", "4", "--num-kv-tokens", "512", "--max-running-requests", "6", "--max-model-len", "256"],
        ["--num-prompts", "900", "--request-rate", "30", "--random-input-len", "120", "--random-output-len", "64",
         "--random-range-ratio", "1"],
        30.0,
    ),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy within {timeout:.0f} s")


def wait_engine_ready(log: Path, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    """/health answers before the engine process has loaded; load only once it says it is ready."""
    deadline = time.monotonic() + timeout
    while "engine ready:" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"engine not ready (server exit code {proc.poll()})")
        time.sleep(0.5)


def record(name: str, serve_args: list[str], bench_args: list[str], stop_after: float | None) -> Path:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    path = HERE / name
    cli = [sys.executable, "-m", "graphserve.cli"]
    with path.open("w") as log:
        server = subprocess.Popen([*cli, "serve", "builtin:tiny-llama", "--port", str(port), *serve_args],
                                  stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        try:
            wait_healthy(url, server)
            wait_engine_ready(path, server)
            bench = subprocess.Popen([*cli, "bench", "--base-url", url, "--backend", "openai", "--dataset-name",
                                      "random", "--ignore-eos", "--disable-tqdm", "--seed", "0", *bench_args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                rc = bench.wait(stop_after)
                if rc != 0:
                    raise RuntimeError(f"bench exited with {rc}")
            except subprocess.TimeoutExpired:  # still overloaded: stop here, as an operator would
                pass
            finally:
                if bench.poll() is None:
                    bench.terminate()
                    bench.wait(30)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    return path


def main() -> None:
    from graphserve.analysis.doctor import diagnose

    for name, (serve_args, bench_args, stop_after) in RUNS.items():
        if sys.argv[1:] and name not in sys.argv[1:]:  # e.g. make_graphserve_logs.py graphserve_problems.log
            continue
        path = record(name, serve_args, bench_args, stop_after)
        rep = diagnose(str(path))
        print(f"{name}: {rep['format']} log, {rep['lines']} lines; findings: "
              f"{[(f['kind'], f['title']) for f in rep['findings']] or 'none'}")


if __name__ == "__main__":
    main()
