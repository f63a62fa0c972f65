"""`graphserve router` in front of two real `graphserve serve` workers on loopback: same tokens as one worker,
repeated prefixes to the worker holding them, streaming through, and workers killed mid-run.

Worker A runs its engine on a thread (--engine-in-process) and worker B in an engine process, so the cache events
(--kv-events) reach /v1/cache_events through both paths. The tests share the processes and run in file order: the last one kills
the workers.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_utils import ServerProcess, engine_processes, free_port, metrics, wait_for

from graphserve.engine.kv_cache import CLEARED, ROOT_HASH, STORED
from graphserve.engine.routing_policy import block_hashes
from graphserve.server.cache_events import HASH_PROBE

WORKER_HEADER = "x-graphserve-worker"
# ~100 tokens of the tiny model's tokenizer: 6 full blocks of 16
PREFIX = ("A serving engine keeps the keys and values of every prompt it has seen in blocks of sixteen tokens, so "
          "that a later request which starts with the same words can skip their prefill entirely and go on ")


class RouterProcess:
    def __init__(self, log_dir: Path, workers: list[str]):
        self.port = free_port()
        self.log_path = log_dir / f"router-{self.port}.log"
        self.args = [sys.executable, "-m", "graphserve.cli", "router", "--port", str(self.port),
                     "--health-interval", "0.3", "--startup-timeout", "170"]
        for url in workers:
            self.args += ["--worker", url]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> RouterProcess:
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child holds it; closed with the process
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        ok = wait_for(lambda: self.proc.poll() is not None or _status(self.base_url + "/health") == 200, timeout)
        if not ok or self.proc.poll() is not None:
            raise RuntimeError(f"router not healthy within {timeout} s:\n{self.log_path.read_text()}")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2.0).status_code
    except httpx.TransportError:
        return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("router")
    a = ServerProcess(log_dir, "--engine-in-process", "--kv-events")
    b = ServerProcess(log_dir, "--kv-events")
    # the router starts beside the workers (its imports and tokenizer overlap their warm-up) and waits for them
    router = RouterProcess(log_dir, [a.base_url, b.base_url])
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda s: s.start(), [router, a, b]))
        assert wait_for(lambda: all(_metric(router, "worker_healthy", w.base_url) == 1 for w in (a, b)), 30)
        yield a, b, router
    finally:
        router.stop()
        for srv in (a, b):
            srv.stop()


def _generate(base_url: str, text: str, max_new_tokens: int = 8) -> tuple[list[int], str]:
    resp = httpx.post(base_url + "/generate", timeout=120, json={
        "text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}})
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"], resp.headers.get(WORKER_HEADER, "")


def _metric(router: RouterProcess, name: str, worker: str) -> float:
    return metrics(router.base_url).get(f"graphserve:router_{name}{{worker={worker}}}", 0.0)


def test_two_workers_behind_the_router_give_the_tokens_of_one(cluster):
    a, b, router = cluster
    prompts = [f"Request {i}: the {w} of a serving engine is" for i, w in enumerate(["speed", "cost", "memory",
                                                                                        "cache"])]
    routed = [_generate(router.base_url, p) for p in prompts]
    assert {w for _, w in routed} == {a.base_url, b.base_url}  # no prefix anywhere: spread by load
    for srv in (a, b):  # the direct run sees an empty cache too, as the routed one did
        assert httpx.post(srv.base_url + "/flush_cache", timeout=10).status_code == 200
    direct = [_generate(a.base_url, p)[0] for p in prompts]
    assert [ids for ids, _ in routed] == direct
    # a stream goes through event by event and says what the plain response says
    body = {"prompt": prompts[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(router.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    with httpx.stream("POST", router.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers[WORKER_HEADER] in (a.base_url, b.base_url)
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and len(data) >= 3
    assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) == plain


def test_repeated_prefixes_go_to_the_worker_holding_them(cluster):
    a, b, router = cluster
    for stem in (PREFIX * 2, (PREFIX * 2).upper()):
        blocks = {w.base_url: _metric(router, "cached_blocks", w.base_url) for w in (a, b)}
        _, holder = _generate(router.base_url, stem + "first", max_new_tokens=2)
        # the router learns of the blocks from the worker's events, not from having sent the request
        assert wait_for(lambda h=holder, n=blocks[holder] + 6: _metric(router, "cached_blocks", h) >= n, timeout=20)
        for tail in ("second", "third", "fourth"):
            hits = _metric(router, "prefix_hits_total", holder)
            hit_blocks = _metric(router, "prefix_hit_blocks_total", holder)
            resp = httpx.post(router.base_url + "/v1/completions", timeout=60, json={
                "prompt": stem + tail, "max_tokens": 2, "temperature": 0})
            assert resp.status_code == 200 and resp.headers[WORKER_HEADER] == holder, tail
            cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 6 * 16
            # the router foresaw exactly the worker's hit: it hashes prompts as the worker's cache does
            assert _metric(router, "prefix_hit_blocks_total", holder) - hit_blocks == cached // 16
            assert _metric(router, "prefix_hits_total", holder) == hits + 1
    # chat: the router renders the messages with the worker's template, so its hashes match the worker's
    chat = {"messages": [{"role": "user", "content": PREFIX + "What next?"}], "max_tokens": 2, "temperature": 0}
    first = httpx.post(router.base_url + "/v1/chat/completions", json=chat, timeout=60)
    holder = first.headers[WORKER_HEADER]
    assert wait_for(lambda: _metric(router, "cache_events_total", holder) > 0)
    hits = _metric(router, "prefix_hits_total", holder)
    time.sleep(0.5)  # the chat's own blocks reach the router's index
    again = httpx.post(router.base_url + "/v1/chat/completions", json=chat, timeout=60)
    assert again.headers[WORKER_HEADER] == holder
    assert _metric(router, "prefix_hits_total", holder) == hits + 1


def test_a_worker_serves_the_events_of_the_blocks_a_request_leaves(cluster):
    """--kv-events, read as the router reads it, from the engine thread (a) and the engine process (b)."""
    rng = random.Random(7)
    for srv in cluster[:2]:
        start = _cache_events(srv, -1)
        assert start["hash_probe"] == HASH_PROBE and start["block_size"] == 16
        ids = [rng.randrange(5, 1300) for _ in range(3 * 16 + 5)]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
        assert httpx.post(srv.base_url + "/generate", json=body, timeout=60).status_code == 200
        got = _cache_events(srv, start["next"], wait=10)
        want = block_hashes(ids, 16)[:3]  # the router's own hashing of the prompt
        # the warm-up's blocks may come first, unchained (they reach the log with the first step after it)
        stored = [e for e in got["events"] if e[0] == STORED and e[1] in want]
        assert [e[1] for e in stored] == want and [e[2] for e in stored] == [ROOT_HASH, *want[:2]], got
        assert got["epoch"] == start["epoch"] and set(want) <= set(_cache_events(srv, -1)["snapshot"])
        assert httpx.post(srv.base_url + "/flush_cache", timeout=10).status_code == 200
        assert [CLEARED] in _cache_events(srv, got["next"], wait=10)["events"]
        assert _cache_events(srv, -1)["snapshot"] == []


def _cache_events(srv: ServerProcess, since: int, wait: float = 0.0) -> dict:
    resp = httpx.get(srv.base_url + "/v1/cache_events", params={"since": since, "timeout": wait}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_client_that_leaves_aborts_its_request_on_the_worker(cluster):
    a, b, router = cluster

    def running() -> float:
        return sum(metrics(w.base_url).get("graphserve:num_requests_running", 0.0) for w in (a, b))

    def aborted() -> float:  # the workers' aborts: a request that ran to its end on its own is not one
        return sum(v for w in (a, b) for k, v in metrics(w.base_url).items()
                   if k.startswith("graphserve:request_aborted_total"))  # fmt: skip

    before = aborted()
    body = {"prompt": "Leaving early", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # plain: the worker sends nothing until it is done, and the client goes
        httpx.post(router.base_url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    assert wait_for(lambda: aborted() == before + 1, timeout=10), "the worker still runs a request nobody waits for"
    assert wait_for(lambda: running() == 0, timeout=10)
    with httpx.stream("POST", router.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        next(r.iter_lines())  # streaming: leave after the first event
    assert wait_for(lambda: aborted() == before + 2, timeout=10)
    assert wait_for(lambda: running() == 0, timeout=10)
    assert wait_for(lambda: sum(_metric(router, "requests_in_flight", w.base_url) for w in (a, b)) == 0, 10)


def test_killed_workers_requests_not_yet_streamed_move_and_health_follows(cluster):
    a, b, router = cluster
    body = {"sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(httpx.post, router.base_url + "/generate", json={**body, "text": f"Long run {i}"},
                               timeout=180) for i in range(2)]
        # one request on each worker, mid-generation: nothing of either has reached its client
        assert wait_for(lambda: all(_metric(router, "requests_in_flight", w.base_url) == 1 for w in (a, b)), 30)
        a.proc.send_signal(signal.SIGKILL)
        results = [f.result() for f in futures]
    assert [r.status_code for r in results] == [200, 200], [r.text for r in results]
    assert all(r.headers[WORKER_HEADER] == b.base_url for r in results)
    assert all(len(r.json()["output_ids"]) == 200 for r in results)
    assert _metric(router, "retries_total", a.base_url) >= 1
    assert _status(router.base_url + "/health") == 200
    assert _metric(router, "worker_healthy", a.base_url) == 0
    assert _generate(router.base_url, "after the first loss", 2)[1] == b.base_url
    children = engine_processes(b)
    b.proc.send_signal(signal.SIGKILL)
    for child in children:
        child.kill()
    assert wait_for(lambda: _status(router.base_url + "/health") == 503, timeout=10)
    resp = httpx.post(router.base_url + "/v1/completions", json={"prompt": "anyone?", "max_tokens": 2}, timeout=30)
    assert resp.status_code == 503 and resp.headers.get("retry-after")
    assert "no worker can serve" in resp.json()["error"]["message"]
