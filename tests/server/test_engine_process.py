"""The engine core in its own process: it serves, and when it dies the server says so instead of hanging."""

from __future__ import annotations

import concurrent.futures
import json
import signal

import httpx
from server_utils import ServerProcess, engine_child, engine_processes, metrics, stream_until_first_event, wait_for

from graphserve.server.launch import ENGINE_DIED_EXIT_CODE


def test_engine_process_death_fails_in_flight_requests_and_health(tmp_path):
    srv = ServerProcess(tmp_path, "--max-running-requests", "1").start()
    try:
        engine = engine_child(srv)
        assert engine.pid != srv.proc.pid  # the core does not run in the server process
        assert metrics(srv.base_url)["graphserve:engine_alive"] == 1
        ok = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "ignore_eos": True},
                        timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        long = {"prompt": "long", "max_tokens": 480, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            started: concurrent.futures.Future = concurrent.futures.Future()
            streamed = pool.submit(stream_until_first_event, srv.base_url, long, started)
            started.result(timeout=30)
            queued = pool.submit(httpx.post, srv.base_url + "/v1/completions", json=long, timeout=60)
            assert wait_for(lambda: metrics(srv.base_url)["graphserve:num_requests_waiting"] == 1, timeout=10)
            engine.send_signal(signal.SIGKILL)
            events = streamed.result(timeout=30)
            full = queued.result(timeout=30)
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == 500 and "engine process died" in err["message"]
        assert full.status_code == 500 and "engine process died" in full.json()["error"]["message"]
        health = httpx.get(srv.base_url + "/health", timeout=10)
        assert health.status_code == 503 and "engine process died" in health.json()["error"]["message"]
        refused = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert refused.status_code == 503
        assert "engine process died" in srv.log()
        # /metrics says the engine is gone instead of freezing at its last values (one running, one waiting)
        m = metrics(srv.base_url)
        assert m["graphserve:engine_alive"] == 0
        assert m["graphserve:num_requests_running"] == 0 and m["graphserve:num_requests_waiting"] == 0
        assert m["graphserve:kv_cache_usage_perc"] == 0
    finally:
        srv.stop()
    assert srv.wait(10) == ENGINE_DIED_EXIT_CODE  # a dead engine is never a clean exit


def test_engine_in_process_flag_keeps_the_core_in_the_server(tmp_path):
    srv = ServerProcess(tmp_path, "--engine-in-process").start()
    try:
        assert not engine_processes(srv)
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        assert srv.stop() == 0
