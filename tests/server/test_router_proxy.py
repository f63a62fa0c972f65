"""The router's proxy against fake workers (httpx mock transports), no processes: which failures move a request to
another worker, which end it, and what the client sees when no worker can serve."""

from __future__ import annotations

import asyncio
import json

import httpx

from graphserve.engine.routing_policy import RoutingPolicy
from graphserve.router.app import WORKER_HEADER, create_app
from graphserve.router.tokens import PromptTokens
from graphserve.router.workers import WorkerPool


class _Tokenizer:
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def _run(handler, urls: list[str], requests: list[tuple[str, dict]]) -> tuple[list[httpx.Response], WorkerPool]:
    async def go() -> tuple[list[httpx.Response], WorkerPool]:
        upstream = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        pool = WorkerPool(urls, "m", upstream, RoutingPolicy())
        for w in pool.workers:
            w.healthy = True  # the health loop is not started: the proxy's own failures drop workers here
        app = create_app(pool, PromptTokens(_Tokenizer()))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            out = []
            for path, body in requests:
                if path == "GET":
                    out.append(await client.get(body["url"]))
                elif path == "POST":
                    out.append(await client.post(body["url"]))
                else:
                    out.append(await client.post(path, json=body))
        await upstream.aclose()
        return out, pool

    return asyncio.run(go())


def test_refused_connections_and_503s_move_the_request_and_name_the_worker():
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        calls.append(host)
        if host == "dead":
            raise httpx.ConnectError("connection refused", request=request)
        if host == "loading":
            return httpx.Response(503, json={"error": {"message": "the engine is still loading the model"}})
        body = json.loads(request.content)
        return httpx.Response(200, json={"echo": body["prompt"], "by": host})

    urls = ["http://dead", "http://loading", "http://ok"]
    (first, second), pool = _run(handler, urls, [("/v1/completions", {"prompt": "hi"}),
                                                 ("/v1/completions", {"prompt": "again"})])
    assert first.status_code == 200 and first.json() == {"echo": "hi", "by": "ok"}
    assert first.headers[WORKER_HEADER] == "http://ok"
    assert second.headers[WORKER_HEADER] == "http://ok"
    dead, loading, ok = pool.workers
    assert not dead.healthy and dead.retried == 1  # dropped at its first failure, never tried again
    assert loading.healthy and loading.retried >= 1  # a 503 is no death: the health check decides
    assert ok.routed == 2 and all(w.inflight == 0 for w in pool.workers)
    assert calls.count("dead") == 1


def test_no_worker_left_is_a_503_with_the_openai_body_and_health_follows():
    answered: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "busy" and not answered:  # drains, then is gone
            answered.append(request.url.host)
            return httpx.Response(503, json={"error": {"message": "the server is shutting down"}},
                                  headers={"Retry-After": "5"})
        raise httpx.ConnectError("connection refused", request=request)

    (all_503, none, health), _ = _run(handler, ["http://busy", "http://gone"], [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/generate", {"text": "x"}),
        ("GET", {"url": "/health"})])
    # the last worker's own reason goes back when one answered 503
    assert all_503.status_code == 503 and "shutting down" in all_503.json()["error"]["message"]
    assert all_503.headers["retry-after"] == "5"
    assert none.status_code == 503 and none.headers["retry-after"] == "1"
    assert "no worker can serve this request (tried http://busy)" in none.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["error"]["type"] == "service_unavailable"


def test_a_stream_that_started_is_not_retried_and_a_worker_400_passes_through():
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if "prompt" not in body:
            return httpx.Response(400, json={"error": {"message": "prompt is required", "param": "prompt"}})
        events = b"".join(b'data: {"n": %d}\n\n' % i for i in range(3)) + b"data: [DONE]\n\n"
        return httpx.Response(200, content=events, headers={"content-type": "text/event-stream"})

    (stream, bad), pool = _run(handler, ["http://a"], [("/v1/completions", {"prompt": "p", "stream": True}),
                                                      ("/v1/completions", {"max_tokens": 1})])
    assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
    assert stream.text.count("data: ") == 4 and stream.text.endswith("data: [DONE]\n\n")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    assert pool.workers[0].retried == 0 and pool.workers[0].inflight == 0


def test_flush_cache_reaches_every_worker_and_model_questions_one():
    seen: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.url.path))
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "m"})
        return httpx.Response(200, json={"status": "ok"})

    (flush, info), _ = _run(handler, ["http://a", "http://b"], [("POST", {"url": "/flush_cache"}),
                                                                ("GET", {"url": "/get_model_info"})])
    assert flush.status_code == 200 and "2 worker(s)" in flush.json()["message"]
    assert sorted(h for h, p in seen if p == "/flush_cache") == ["a", "b"]
    assert info.json() == {"model_path": "m"} and [p for _, p in seen].count("/get_model_info") == 1


def test_a_wait_on_the_worker_ends_when_the_client_leaves(monkeypatch):
    """The proxy's waits on a worker (its headers, a stream's first bytes, a whole response) end, cancelled, once the
    client is gone, and otherwise give what the work gave or raised."""
    from graphserve.router import app as router_app

    monkeypatch.setattr(router_app, "DISCONNECT_POLL_S", 0.01)

    class Client:  # the request's side of the connection: gone after ``checks`` questions
        def __init__(self, checks: int):
            self.checks = checks

        async def is_disconnected(self) -> bool:
            self.checks -= 1
            return self.checks < 0

    cancelled = []

    async def worker_busy() -> bytes:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return b"never"

    async def worker_fails() -> bytes:
        raise httpx.ReadError("connection reset")

    async def go() -> None:
        assert await router_app._unless_gone(Client(3), worker_busy()) is router_app._GONE
        assert cancelled == [True]  # the wait is cancelled: its connection closes and the worker aborts
        assert await router_app._unless_gone(Client(10**6), asyncio.sleep(0.05, result=b"done")) == b"done"
        try:
            await router_app._unless_gone(Client(10**6), worker_fails())
        except httpx.ReadError as e:
            assert "connection reset" in str(e)
        else:
            raise AssertionError("the worker's error was swallowed")

    asyncio.run(go())
