"""--api-server-count 2: two HTTP front-end processes share one engine process. Real HTTP against a real
server on loopback: traffic reaches both front-ends, /metrics counts the whole server, the queue bound is
global, an engine death fails every front-end's streams, SIGTERM drains both."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time

import httpx
import pytest
from server_utils import ServerProcess, metrics, wait_for
from test_server_lifecycle import stream_events

from graphserve.errors import ConfigError
from graphserve.server.launch import ENGINE_DIED_EXIT_CODE
from graphserve.server.serve_args import api_server_count

RUNNING, QUEUED = 2, 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("api-servers"), "--api-server-count", "2",
                        "--max-running-requests", str(RUNNING), "--max-queued-requests", str(QUEUED)).start()
    yield srv
    srv.stop()


def per_frontend(base_url: str) -> dict[str, float]:
    m = metrics(base_url)
    return {k: v for k, v in m.items() if k.startswith("graphserve:api_server_requests_total{")}


def test_api_server_count_refuses_bad_values():
    cpus = os.cpu_count() or 1
    for bad in ("0", "-1", str(cpus + 1), "two"):
        with pytest.raises(ConfigError, match="--api-server-count"):
            api_server_count(bad)
    with pytest.raises(ConfigError, match="--engine-in-process"):
        api_server_count("2", engine_in_process=True)
    assert api_server_count("1") == 1 and 1 <= api_server_count("auto") <= min(4, cpus)


def test_traffic_reaches_both_front_ends_and_metrics_count_the_whole_server(server):
    base = server.base_url
    before = metrics(base)
    body = {"prompt": "spread", "max_tokens": 6, "ignore_eos": True}

    def one(i: int) -> int:
        if i % 2:
            status, events, _ = stream_events(base, body)
            assert status == 200 and events[-1] == "[DONE]", events
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
            return sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in events[:-1])
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)  # a new connection each time
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        return 1

    sent = 32
    # at most QUEUED in flight: no request meets the queue bound, even when one arrives in the step between
    # another's finish and the engine scheduling a waiting one in its place
    with concurrent.futures.ThreadPoolExecutor(QUEUED) as pool:
        list(pool.map(one, range(sent)))
    after = metrics(base)
    counts = per_frontend(base)
    assert set(counts) == {'graphserve:api_server_requests_total{api_server=0}',
                           'graphserve:api_server_requests_total{api_server=1}'}, counts
    taken = {k: v - before.get(k, 0) for k, v in counts.items()}
    assert all(v > 0 for v in taken.values()), taken  # the kernel spread the connections over both
    assert sum(taken.values()) == sent
    done = "graphserve:request_success_total{finish_reason=length}"
    assert after[done] - before.get(done, 0) == sent  # summed over the front-ends, each request once
    assert after["graphserve:generation_tokens_total"] - before["graphserve:generation_tokens_total"] == 6 * sent
    assert after["graphserve:e2e_request_latency_seconds_count"] - \
        before.get("graphserve:e2e_request_latency_seconds_count", 0) == sent
    assert after["graphserve:engine_alive"] == 1


def test_queue_bound_counts_every_front_ends_sequences(server):
    base = server.base_url
    body = {"prompt": "hold", "max_tokens": 400, "ignore_eos": True, "stream": True}
    burst = 16
    with concurrent.futures.ThreadPoolExecutor(burst) as pool:
        def start(_: int) -> tuple[int, httpx.Client, httpx.Response]:
            client = httpx.Client(base_url=base, timeout=60)  # its own connection: either front-end
            resp = client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)
            return resp.status_code, client, resp

        started = list(pool.map(start, range(burst)))
        try:
            statuses = [s for s, _, _ in started]
            # The long requests hold the running batch for the whole burst: only RUNNING run and QUEUED wait,
            # over both front-ends together (a bound per front-end would let twice as many in).
            assert statuses.count(200) <= RUNNING + QUEUED, statuses
            assert statuses.count(429) >= burst - RUNNING - QUEUED, statuses
            assert set(statuses) <= {200, 429}
        finally:
            for _, client, resp in started:
                resp.close()
                client.close()
    assert wait_for(lambda: metrics(base)["graphserve:num_requests_running"] == 0, timeout=60)


def pids(srv: ServerProcess) -> tuple[int, list[int]]:
    line = re.search(r"engine process (\d+); HTTP front-end processes ([\d ]+)", srv.log())
    assert line, srv.log()
    return int(line.group(1)), [int(p) for p in line.group(2).split()]


def test_engine_death_fails_every_front_ends_streams(tmp_path):
    srv = ServerProcess(tmp_path, "--api-server-count", "2", "--max-running-requests", "8",
                        "--engine-death-grace", "10").start()
    long = {"prompt": "long", "max_tokens": 480, "ignore_eos": True}
    try:
        engine, frontends = pids(srv)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            started = [concurrent.futures.Future() for _ in range(8)]
            streams = [pool.submit(stream_events, srv.base_url, long, f) for f in started]
            concurrent.futures.wait(started, timeout=60)
            assert sum(per_frontend(srv.base_url).values()) == 8
            os.kill(engine, signal.SIGKILL)
            for f in streams:
                status, events, _ = f.result(timeout=30)
                assert status == 200 and events[-1] == "[DONE]"
                error = json.loads(events[-2])["error"]
                assert error["code"] == 500 and "engine process died" in error["message"], error
        # every front-end says so: fresh connections land on both
        for _ in range(8):
            r = httpx.get(srv.base_url + "/health", timeout=10)
            assert r.status_code == 503 and "engine process died" in r.json()["error"]["message"]
        m = metrics(srv.base_url)
        assert m["graphserve:engine_alive"] == 0 and m["graphserve:num_requests_running"] == 0
        # then the whole server exits non-zero, so that its supervisor restarts it
        assert srv.wait(30) == ENGINE_DIED_EXIT_CODE
        assert not any(_alive(p) for p in frontends)
        assert "exiting with code 3: the engine process exited with code -9" in srv.log().strip().splitlines()[-1]
    finally:
        srv.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_drains_both_front_ends_and_exits_0(tmp_path):
    srv = ServerProcess(tmp_path, "--api-server-count", "2", "--shutdown-timeout", "60",
                        "--max-running-requests", "8").start()
    short = {"prompt": "short", "max_tokens": 160, "ignore_eos": True}  # still running at the signal
    try:
        engine, frontends = pids(srv)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            started = [concurrent.futures.Future() for _ in range(8)]
            streams = [pool.submit(stream_events, srv.base_url, short, f) for f in started]
            concurrent.futures.wait(started, timeout=60)
            taken = per_frontend(srv.base_url)
            srv.signal(signal.SIGTERM)
            time.sleep(0.3)
            for _ in range(4):  # new requests on either front-end: 503 with Retry-After while draining
                refused = httpx.post(srv.base_url + "/v1/completions", json=short, timeout=10)
                assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
            for f in streams:  # in flight at SIGTERM: they finish normally
                status, events, _ = f.result(timeout=60)
                assert status == 200 and events[-1] == "[DONE]"
                assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert sum(taken.values()) == 8
        assert srv.wait(timeout=30) == 0
        assert not any(_alive(p) for p in [engine, *frontends])
    finally:
        srv.stop()
