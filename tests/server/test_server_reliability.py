"""The server under abuse: reused rids, clients that never read, requests of many sequences, shutdown races;
and /health that turns 200 only once the engine has warmed up. Real HTTP against a real server process."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import multiprocessing.popen_fork
import os
import re
import socket
import subprocess
import time

import httpx
import pytest
from engine_stub import idle_engine
from server_utils import ServerProcess, metrics, wait_for

from graphserve.config import EngineConfig
from graphserve.engine.process_client import ProcessClient

STALL_S = 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A longer context than the other server tests: the never-reading client needs ~500 tokens to fill the
    # loopback buffers (their autotuning grows the server's send buffer past 1 MB).
    srv = ServerProcess(tmp_path_factory.mktemp("reliability"), "--max-queued-requests", "32",
                        "--max-running-requests", "2", "--stream-stall-timeout", str(STALL_S),
                        "--max-model-len", "2048")
    log = open(srv.log_path, "wb")  # noqa: SIM115 - the child holds it; closed with the process
    srv.proc = subprocess.Popen(srv.args, stdout=log, stderr=subprocess.STDOUT, env=srv.env)
    # Watch /health from the first moment, to check when it turns 200 against the warm-up's log line.
    statuses: list[tuple[float, int]] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and srv.proc.poll() is None:
        try:
            code = httpx.get(srv.base_url + "/health", timeout=2).status_code
            statuses.append((time.time(), code))
            if code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    assert statuses and statuses[-1][1] == 200, srv.log()
    srv.health_statuses = statuses
    yield srv
    srv.stop()


def post(srv, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=timeout)


def idle(srv) -> bool:
    m = metrics(srv.base_url)
    return m["graphserve:num_requests_running"] == 0 and m["graphserve:num_requests_waiting"] == 0 \
        and m["graphserve:kv_cache_usage_perc"] == 0


def test_health_turns_200_only_after_the_warm_up(server):
    line = re.search(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] warm-up finished: (\d+) requests, (\d+) steps",
                     server.log())
    assert line, server.log()
    finished = datetime.datetime.strptime(line.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert int(line.group(2)) >= 6 and int(line.group(3)) >= 6  # every sampler variant ran, over several steps
    first_ok = next(t for t, code in server.health_statuses if code == 200)
    assert first_ok >= finished  # never ready before the warm-up is over
    before = [code for t, code in server.health_statuses if t < finished - 0.05]
    assert before and set(before) == {503}
    # The warm-up is not traffic: counters start from zero.
    m = metrics(server.base_url)
    assert m["graphserve:generation_tokens_total"] == 0 and m["graphserve:prompt_tokens_total"] == 0


def test_reused_rid_never_mixes_requests(server):
    greedy = {"temperature": 0.0}
    first = post(server, "/generate", {"text": "the quick brown fox", "sampling_params": {**greedy,
                                                                                          "max_new_tokens": 12}})
    stop = first.json()["text"][:3]
    assert len(stop) == 3, first.json()
    expected = post(server, "/generate", {"text": "a different prompt",
                                          "sampling_params": {**greedy, "max_new_tokens": 8}}).json()["text"]
    for i in range(8):
        # Stops on its stop string at once; the engine still holds the request until the abort reaches it.
        stopped = post(server, "/generate", {"text": "the quick brown fox", "rid": "reused",
                                             "sampling_params": {**greedy, "max_new_tokens": 200, "stop": [stop]}})
        assert stopped.status_code == 200, stopped.text
        assert stopped.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        again = post(server, "/generate", {"text": "a different prompt", "rid": "reused",
                                           "sampling_params": {**greedy, "max_new_tokens": 8}})
        assert again.status_code == 200, (i, again.text)
        assert again.json()["text"] == expected and again.json()["meta_info"]["id"] == "reused"
    assert wait_for(lambda: idle(server))


def test_sequences_count_against_the_queue_and_the_kv_pool(server):
    # n above the queue bound can never be admitted: 400 naming n, not a 429 to retry forever
    r = post(server, "/v1/completions", {"prompt": "x", "n": 33, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "33" in r.json()["error"]["message"]
    # 24 sequences of up to 401 tokens need 24 x 26 blocks: more than the pool of 8192 tokens holds at once
    r = post(server, "/v1/completions", {"prompt": "x", "n": 24, "max_tokens": 400})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "KV" in r.json()["error"]["message"]
    # a batch whose second prompt is refused leaves nothing of its first behind: 1900 ids pass validation
    # (within max_model_len), so the refusal comes from the engine once the first prompt was already added
    generated = metrics(server.base_url)["graphserve:generation_tokens_total"]
    r = post(server, "/v1/completions", {"prompt": [[7, 8, 9], [5] * 1900], "max_tokens": 400, "ignore_eos": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens" and "1900" in r.json()["error"]["message"]
    assert wait_for(lambda: idle(server))
    assert metrics(server.base_url)["graphserve:generation_tokens_total"] - generated < 400  # aborted, not run
    body = {"prompt": "y", "max_tokens": 1, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as client, contextlib.ExitStack() as streams:
        def start(n: int, max_tokens: int = 1) -> httpx.Response:  # the status line: accepted or refused
            return streams.enter_context(client.stream("POST", "/v1/completions",
                                                       json={**body, "n": n, "max_tokens": max_tokens}))

        # Two sequences fill the running batch (--max-running-requests 2) for a long while.
        assert start(2, 480).status_code == 200
        assert wait_for(lambda: metrics(server.base_url)["graphserve:num_requests_running"] == 2)
        assert start(20).status_code == 200
        assert wait_for(lambda: metrics(server.base_url)["graphserve:num_requests_waiting"] == 20)
        refused = start(16)  # 20 + 16 sequences > 32
        assert refused.status_code == 429 and "sequences" in refused.read().decode()
        assert start(12).status_code == 200  # 20 + 12 = 32
        assert wait_for(lambda: metrics(server.base_url)["graphserve:num_requests_waiting"] == 32)
    # closing the streams aborted them all
    assert wait_for(lambda: idle(server), timeout=60)


def test_a_client_that_never_reads_is_aborted_and_its_kv_freed(server):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a tiny window: the server's writes back up soon
    sock.connect(("127.0.0.1", server.port))
    # SGLang's stream repeats the whole output in every event, so the bytes waiting grow fast per token.
    body = json.dumps({"text": "never read", "stream": True,
                       "sampling_params": {"n": 2, "max_new_tokens": 2000, "ignore_eos": True}}).encode()
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        assert wait_for(lambda: metrics(server.base_url)["graphserve:num_requests_running"] > 0, timeout=60)
        # Without reading a byte, the request is aborted after --stream-stall-timeout and its blocks come back.
        assert wait_for(lambda: "has not read" in server.log() and idle(server), timeout=300), server.log()[-2000:]
        healthy = post(server, "/v1/completions", {"prompt": "z", "max_tokens": 2})
        assert healthy.status_code == 200
    finally:
        sock.close()


def test_one_owner_reaps_the_engine_process(monkeypatch, caplog):
    # Widen the window between reaping the child and recording its exit: two threads that both wait for
    # the process then race, and the loser takes the reaped child for alive and kills its pid.
    real_waitpid = os.waitpid

    def slow_waitpid(pid: int, options: int):
        got = real_waitpid(pid, options)
        if got[0] == pid:
            time.sleep(0.3)
        return got

    monkeypatch.setattr(multiprocessing.popen_fork.os, "waitpid", slow_waitpid)
    exits = []
    for _ in range(2):
        proc = ProcessClient(EngineConfig(model="builtin:tiny-llama"), lambda msg: None, exits.append,
                             target=idle_engine)
        proc.start()
        with caplog.at_level(logging.WARNING, logger="graphserve.engine"):
            proc.shutdown(timeout=10)
        assert not proc.killed and proc.exitcode == 0 and not proc.alive
        assert "killing it" not in caplog.text
    assert exits == []  # an exit the server asked for is not reported as a death
