"""`graphserve serve --tp 2` on CPU: it answers and streams; a rank that dies fails the in-flight requests
within seconds, /health turns 503, and no rank process outlives the engine."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import httpx
from server_utils import ServerProcess, engine_child, stream_until_first_event, wait_for

from graphserve.server.launch import ENGINE_DIED_EXIT_CODE


def test_serve_tp2_answers_streams_and_fails_cleanly_when_a_rank_dies(tmp_path):
    srv = ServerProcess(tmp_path, "--tp", "2", "--max-running-requests", "2",
                        "--engine-death-grace", "10").start(timeout=300)
    try:
        engine = engine_child(srv)
        ranks = [p for p in engine.children() if "graphserve.engine.rank_main" in " ".join(p.cmdline())]
        assert len(ranks) == 1, "--tp 2: the engine process is rank 0 and starts one more"
        body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        ok = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=120)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
        started: concurrent.futures.Future = concurrent.futures.Future()
        events = stream_until_first_event(srv.base_url, body, started)
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == ok.json()["choices"][0]["text"]

        long = {"prompt": "long", "max_tokens": 400, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            started = concurrent.futures.Future()
            streamed = pool.submit(stream_until_first_event, srv.base_url, long, started)
            started.result(timeout=60)
            killed_at = time.monotonic()
            ranks[0].send_signal(signal.SIGKILL)
            events = streamed.result(timeout=30)
        assert time.monotonic() - killed_at < 15, "the in-flight request must fail within seconds"
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == 500 and "engine process died" in err["message"]
        health = httpx.get(srv.base_url + "/health", timeout=10)
        assert health.status_code == 503
        assert wait_for(lambda: not engine.is_running(), timeout=10), "the engine process must exit"
        assert "rank 1 (pid" in srv.log() and "exited with code -9" in srv.log()
        assert srv.wait(30) == ENGINE_DIED_EXIT_CODE  # and the server with it: a supervisor restarts it
        assert "engine process died" in srv.log().strip().splitlines()[-1]
    finally:
        srv.stop()
    assert not any(p.is_running() for p in ranks)
