"""GRAPHSERVE_ENGINE_CPUS through a real server: every thread of the engine process runs on the CPUs it names and
every thread of the HTTP process off them, and the server serves; a value it cannot honour stops `graphserve serve`
before it loads anything, naming the switch."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import psutil
from server_utils import MODEL, ServerProcess, engine_child

ENV = "GRAPHSERVE_ENGINE_CPUS"


def _thread_cpus(proc: psutil.Process) -> list[set[int]]:
    return [os.sched_getaffinity(t.id) for t in proc.threads()]


def test_the_engine_runs_on_its_cpus_and_the_front_end_off_them(tmp_path):
    allowed = os.sched_getaffinity(0)
    assert len(allowed) >= 2, f"this test needs 2 CPUs to split, the process may use {sorted(allowed)}"
    engine_cpu = max(allowed)
    srv = ServerProcess(tmp_path, env={ENV: str(engine_cpu)}).start()
    try:
        for stream in (False, True):
            r = httpx.post(srv.base_url + "/v1/completions", timeout=60, json={
                "prompt": "hello", "max_tokens": 4, "ignore_eos": True, "stream": stream})
            assert r.status_code == 200
        assert r.text.rstrip().endswith("data: [DONE]")
        engine = engine_child(srv)
        front = psutil.Process(srv.proc.pid)
        assert _thread_cpus(engine) and all(c == {engine_cpu} for c in _thread_cpus(engine))
        assert all(c == allowed - {engine_cpu} for c in _thread_cpus(front))
        assert f"engine process on CPU(s) {engine_cpu}" in srv.log()
    finally:
        srv.stop()


def test_a_value_it_cannot_honour_stops_the_server_naming_the_switch():
    allowed = os.sched_getaffinity(0)
    every = ",".join(str(c) for c in sorted(allowed))
    out = subprocess.run([sys.executable, "-m", "graphserve.cli", "serve", MODEL, "--port", "0"],
                         env={**os.environ, ENV: every}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"{ENV}={every!r} is invalid: it takes all {len(allowed)} CPUs" in out.stderr


def test_with_two_front_ends_the_engine_alone_runs_on_its_cpus(tmp_path):
    allowed = os.sched_getaffinity(0)
    assert len(allowed) >= 2, f"this test needs 2 CPUs to split, the process may use {sorted(allowed)}"
    engine_cpu = min(allowed)
    srv = ServerProcess(tmp_path, "--api-server-count", "2", env={ENV: str(engine_cpu)}).start()
    try:
        for _ in range(2):  # the kernel hands the connections to either front-end
            r = httpx.post(srv.base_url + "/v1/completions", timeout=60, json={
                "prompt": "hello", "max_tokens": 3, "ignore_eos": True, "stream": True})
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        line = re.search(r"engine process (\d+); HTTP front-end processes ([\d ]+)", srv.log())
        assert line, srv.log()
        engine, frontends = int(line.group(1)), [int(p) for p in line.group(2).split()]
        assert len(frontends) == 2
        assert all(c == {engine_cpu} for c in _thread_cpus(psutil.Process(engine)))
        for pid in (srv.proc.pid, *frontends):  # the supervisor and each front-end
            assert all(c == allowed - {engine_cpu} for c in _thread_cpus(psutil.Process(pid)))
    finally:
        srv.stop()
