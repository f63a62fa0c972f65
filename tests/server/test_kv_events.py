"""`--kv-events`: the prefix cache's events are recorded and served only where a router reads them.

A real server on loopback started without the flag answers /v1/cache_events with 404 naming it, and a
`graphserve router` in front of it refuses to start, naming its URL and the flag. Without processes: the engine
loop records nothing unless asked, and a router takes a worker that joins late without events in only once it
serves them. The events a request leaves on a worker with the flag are checked on the router's workers
(test_router.py), `--dp` turning it on on the --dp server (test_dp_replicas.py).
"""

from __future__ import annotations

import asyncio
import queue
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest
from server_utils import ServerProcess, free_port

from graphserve.config import EngineConfig
from graphserve.engine import serve_loop
from graphserve.engine.kv_cache import STORED, BlockManager
from graphserve.engine.messages import Shutdown
from graphserve.engine.request import Sequence
from graphserve.engine.routing_policy import RoutingPolicy
from graphserve.router import workers
from graphserve.sampling_params import SamplingParams
from graphserve.server.cache_events import HASH_PROBE

BLOCK = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("kv_events"), "--engine-in-process")  # no --kv-events
    yield srv.start()
    srv.stop()


def test_without_the_flag_the_route_answers_404_naming_it(server):
    resp = httpx.get(server.base_url + "/v1/cache_events", params={"since": -1, "timeout": 5}, timeout=30)
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert "started without --kv-events" in error["message"]
    assert (error["type"], error["param"], error["code"]) == ("not_found_error", "kv_events", "kv_events_disabled")


def test_router_refuses_a_worker_started_without_the_flag(server):
    """Exit 2 at start, before the router loads a tokenizer or binds its port, naming the worker and the flag."""
    args = [sys.executable, "-m", "graphserve.cli", "router", "--port", str(free_port()), "--startup-timeout", "60",
            "--worker", server.base_url]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    refusal = [line for line in proc.stderr.splitlines() if line.startswith("graphserve router:")]
    assert len(refusal) == 1, proc.stderr
    assert f"--worker {server.base_url} was started without --kv-events" in refusal[0]
    assert "graphserve serve MODEL --kv-events" in refusal[0]


class _FakeCore:
    """What run_engine reads of an EngineCore; its block pool is real, with one prompt cached by the warm-up."""

    def __init__(self, config: EngineConfig):
        self.block_manager = BlockManager(num_blocks=16, block_size=4)
        _prefill(self.block_manager, list(range(9)))
        self.info, self.chat_template, self.max_model_len = None, None, 64
        self.telemetry = SimpleNamespace(add_listener=lambda fn: None)
        self.device = SimpleNamespace(type="cpu")

    def has_unfinished_requests(self) -> bool:
        return False

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(waiting=0)


def _prefill(bm: BlockManager, tokens: list[int]) -> None:
    seq = Sequence("r", 0, tokens, SamplingParams(), seed=0, arrival_time=0.0)
    bm.match_prefix(seq)
    assert bm.allocate_slots(seq, seq.num_pending_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


@pytest.mark.parametrize("kv_events", [False, True])
def test_the_engine_records_cache_events_only_with_the_flag(kv_events, monkeypatch):
    import graphserve.engine.core
    import graphserve.engine.warmup

    cores: list[_FakeCore] = []

    def make_core(config: EngineConfig) -> _FakeCore:
        cores.append(_FakeCore(config))
        return cores[-1]

    monkeypatch.setattr(graphserve.engine.core, "EngineCore", make_core)
    monkeypatch.setattr(graphserve.engine.warmup, "warm_up", lambda core: dict.fromkeys(
        ("requests", "steps", "prefill_lengths", "decode_sizes", "seconds"), 0))
    sent: list = []
    sender = SimpleNamespace(send_message=sent.append, put=sent.append, broken=False)
    inbox: queue.Queue = queue.Queue()
    inbox.put(Shutdown())
    serve_loop.run_engine(EngineConfig(device="cpu", kv_events=kv_events), inbox, [sender], None, own_process=False)
    assert type(sent[0]).__name__ == "EngineReady"
    bm = cores[0].block_manager
    warm = set(bm.cached)
    _prefill(bm, [5] * 9)
    events = bm.take_events()
    if kv_events:  # what the warm-up cached, then what the new prompt stored
        assert {e[1] for e in events} == set(bm.cached) and {e[1] for e in events[:len(warm)]} == warm
    else:  # nothing logged, nothing kept between steps
        assert events == [] and bm.events is None


def test_a_worker_joining_without_events_is_used_once_it_serves_them(monkeypatch):
    url = "http://late-worker:1"
    answers = [httpx.Response(404, json={"error": {"message": "off", "code": "kv_events_disabled"}}),
               httpx.Response(200, json={"snapshot": [11], "events": [[STORED, 12, 11]], "next": 1, "epoch": "e",
                                         "hash_probe": HASH_PROBE, "block_size": BLOCK})]
    polled = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/cache_events"
        if answers:
            return answers.pop(0)
        polled.set()
        await asyncio.sleep(60)  # the long poll of a worker with nothing new
        raise AssertionError("unreachable")

    make_client = httpx.AsyncClient
    monkeypatch.setattr(workers.httpx, "AsyncClient",
                        lambda **kw: make_client(transport=httpx.MockTransport(handler), **kw))
    monkeypatch.setattr(workers, "NO_EVENTS_RETRY_S", 0.0)

    async def go() -> list[tuple[str | None, bool]]:
        pool = workers.WorkerPool([url], "m", httpx.AsyncClient(), RoutingPolicy(), health_interval=0.01)
        worker = pool.workers[0]
        worker.healthy = True
        seen = []
        task = asyncio.ensure_future(pool._events_loop(worker))
        while not polled.is_set():
            seen.append((worker.refused, bool(pool.available())))
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        seen.append((worker.refused, bool(pool.available())))
        assert pool.policy.indexes[url].hashes == {11, 12}
        return seen

    seen = asyncio.run(go())
    refused = [why for why, usable in seen if why is not None and not usable]
    assert refused and f"--worker {url} was started without --kv-events" in refused[0]
    assert seen[-1] == (None, True)
