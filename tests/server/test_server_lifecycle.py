"""Start, overload and stop: 503 before ready, 429 past the queue bound, SIGTERM drains and exits 0."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import shutil
import signal
import time

import httpx
import pytest
from server_utils import ServerProcess, metrics, wait_for

from graphserve.config import EngineConfig
from graphserve.server.app import create_app
from graphserve.server.launch import ServerThread, build_state


def stream_events(base_url: str, body: dict, started: concurrent.futures.Future | None = None
                  ) -> tuple[int, list, dict]:
    """(status, data payloads, headers) of one streamed completion; sets ``started`` at the first event."""
    with httpx.stream("POST", base_url + "/v1/completions", json={**body, "stream": True}, timeout=120) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp.status_code, [resp.json()], dict(resp.headers)
        events = []
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if started is not None and not started.done():
                    started.set_result(True)
        return 200, events, dict(resp.headers)


def test_health_and_requests_are_503_before_the_engine_is_ready():
    state, _ = build_state(EngineConfig(max_model_len=512, num_kv_tokens=8192))

    async def probe() -> list[httpx.Response]:
        # ASGITransport runs no lifespan, so the engine never starts: the window a load balancer sees at boot.
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.get("/health"),
                    await client.post("/v1/completions", json={"prompt": "x"}),
                    await client.post("/v1/completions", json={"prompt": "x", "n": 0})]

    health, post, bad = asyncio.run(probe())
    assert health.status_code == 503 and "loading" in health.json()["error"]["message"]
    assert post.status_code == 503 and int(post.headers["Retry-After"]) >= 1
    assert bad.status_code == 400  # validation does not need the engine


def test_server_thread_serves_in_process():
    with ServerThread(EngineConfig(max_model_len=512, num_kv_tokens=8192), served_model_name="t") as srv:
        r = httpx.post(srv.base_url + "/v1/completions", json={"model": "t", "prompt": "x", "max_tokens": 3,
                                                              "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.fixture(scope="module")
def small_queue_server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("overload"), "--max-queued-requests", "2",
                        "--max-running-requests", "2").start()
    yield srv
    srv.stop()


def test_overload_burst_gets_full_responses_or_429(small_queue_server):
    base = small_queue_server.base_url
    body = {"prompt": "burst", "max_tokens": 24, "ignore_eos": True}

    def one(i: int) -> tuple[int, dict, dict]:
        if i % 3 == 0:
            status, events, headers = stream_events(base, body)
            return status, (events[-2] if status == 200 else events[0]), headers
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        return r.status_code, r.json(), dict(r.headers)

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))  # 10x the queue bound, all at once
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses, statuses
    for status, payload, headers in results:
        if status == 429:
            assert payload["error"]["type"] == "overloaded_error" and "--max-queued-requests=2" in \
                payload["error"]["message"]
            assert int(headers["retry-after"]) >= 1
        elif "usage" in payload:
            assert payload["usage"]["completion_tokens"] == 24
        else:
            assert json.loads(payload)["choices"][0]["finish_reason"] == "length"
    after = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert after.status_code == 200  # still serving
    m = metrics(base)
    assert m["graphserve:num_requests_running"] == 0 and m["graphserve:num_requests_waiting"] == 0


def test_sigterm_drains_in_flight_refuses_new_and_exits_0(tmp_path):
    # One request at a time: the shorts (16 steps each) finish well inside the 6 s drain on a loaded 2-core
    # machine, while the eight queued longs need 3840 decode steps, far past it on any CPU.
    srv = ServerProcess(tmp_path, "--shutdown-timeout", "6", "--max-running-requests", "1").start()
    short = {"prompt": "short", "max_tokens": 16, "ignore_eos": True}
    long = {"prompt": "long", "max_tokens": 480, "ignore_eos": True}
    try:
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            started = [concurrent.futures.Future() for _ in range(2)]
            shorts = [pool.submit(stream_events, srv.base_url, short, f) for f in started]
            concurrent.futures.wait(started, timeout=30)
            longs = [pool.submit(stream_events, srv.base_url, long) for _ in range(8)]
            # all eight in the engine before the signal (a fixed sleep lost the race on a loaded machine)
            assert wait_for(lambda: (lambda m: m["graphserve:num_requests_running"]
                                     + m["graphserve:num_requests_waiting"] >= 8)(metrics(srv.base_url)), timeout=30)
            srv.signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(srv.base_url + "/v1/completions", json=short, timeout=10)
            assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
            assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 503
            for f in shorts:  # in flight at SIGTERM and short enough: they finish normally
                status, events, _ = f.result(timeout=60)
                assert status == 200 and events[-1] == "[DONE]"
                assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
            errored = 0
            for f in longs:  # past --shutdown-timeout: complete, or an error event; never silence
                status, events, _ = f.result(timeout=60)
                assert status == 200 and events[-1] == "[DONE]"
                last = json.loads(events[-2])
                if "error" in last:
                    errored += 1
                    assert last["error"]["code"] == 503 and "shut down" in last["error"]["message"]
                else:
                    assert last["choices"][0]["finish_reason"] == "length"
            assert errored >= 1
        assert srv.wait(timeout=30) == 0
    finally:
        srv.stop()


def test_model_that_fails_to_load_exits_1(tmp_path):
    # An unknown name is refused by the launcher, before an engine process starts (the exit code of a bad flag)
    srv = ServerProcess(tmp_path, model="builtin:no-such-model")
    with pytest.raises(RuntimeError, match="exited with 2"):
        srv.start(timeout=60)
    assert "no-such-model" in srv.log()
    # A folder whose config reads but whose weights are missing fails in the engine process: exit 1
    from graphserve.models.builtin import ensure_builtin

    folder = tmp_path / "no-weights"
    folder.mkdir()
    for f in ensure_builtin("tiny-llama").iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    srv = ServerProcess(tmp_path, model=str(folder))
    with pytest.raises(RuntimeError, match="exited with 1"):
        srv.start(timeout=60)
    assert "safetensors" in srv.log()


def test_second_sigterm_answers_in_flight_requests_then_exits_non_zero(tmp_path):
    # The drain would wait 60 s; a second signal ends the in-flight requests at once, each answered in the
    # OpenAI error shape (a JSON 503; an error event before the stream closes), and the exit code says so.
    srv = ServerProcess(tmp_path, "--shutdown-timeout", "60", "--max-running-requests", "2").start()
    long = {"prompt": "long", "max_tokens": 480, "ignore_eos": True}
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            started = concurrent.futures.Future()
            stream = pool.submit(stream_events, srv.base_url, long, started)
            started.result(timeout=30)
            unary = pool.submit(httpx.post, srv.base_url + "/v1/completions", json=long, timeout=60)
            assert wait_for(lambda: metrics(srv.base_url)["graphserve:num_requests_running"] == 2, timeout=20)
            srv.signal(signal.SIGTERM)
            time.sleep(0.5)
            srv.signal(signal.SIGTERM)
            assert srv.wait(timeout=30) != 0
            status, events, _ = stream.result(timeout=30)
            resp = unary.result(timeout=30)
        assert status == 200 and events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == 503 and "second SIGTERM" in err["message"], err
        assert resp.status_code == 503 and resp.headers["content-type"] == "application/json", resp.text
        assert "second SIGTERM" in resp.json()["error"]["message"]
    finally:
        srv.stop()


def test_step_log_flushes_every_record_and_rotates(tmp_path):
    from graphserve.engine.telemetry import StepRecord
    from graphserve.server.steplog import JsonlStepSink

    path = tmp_path / "steps.jsonl"
    sink = JsonlStepSink(str(path), max_bytes=2000)
    try:
        for step in range(40):
            sink.on_step(StepRecord(step, time.time(), "decode", 4, 4, False, "eager", 4, 0, 4, 1.5, 4, 0, 0.25))
            lines = path.read_text().splitlines()
            assert json.loads(lines[-1])["step"] == step  # on disk before the next step, not at close
            assert path.stat().st_size <= 2000
    finally:
        sink.close()
    backup = [json.loads(ln)["step"] for ln in (tmp_path / "steps.jsonl.1").read_text().splitlines()]
    current = [json.loads(ln)["step"] for ln in path.read_text().splitlines()]
    assert backup and backup + current == list(range(backup[0], 40))  # rotated, nothing lost in between
