"""The router's HTTP front: the OpenAI and SGLang generation routes, proxied to the worker the policy picks.

A request goes to the worker holding the longest cached prefix of it (engine/routing_policy.py), else to the least
loaded. Nothing reaches the client before the worker has answered with a status and, for a stream, its first
bytes: until then a worker that fails (connection refused or dropped, or a 503) is dropped and the request goes
to another. Once a stream has started, a worker that dies ends it: its tokens cannot be taken back. Each response
names its worker in ``X-Graphserve-Worker``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from graphserve.engine.routing_policy import Choice
from graphserve.errors import ServiceUnavailableError
from graphserve.router.tokens import CHAT, COMPLETIONS, GENERATE, PromptTokens
from graphserve.router.workers import Worker, WorkerPool

logger = logging.getLogger("graphserve.router")

WORKER_HEADER = "X-Graphserve-Worker"
PREFIX = "graphserve:router_"
# Prompts longer than this are tokenized on a thread: a long one would hold every stream on the loop.
INLINE_TOKENIZE_CHARS = 4096
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there
# Not forwarded: they describe one hop (or a body length that httpx and the ASGI server set themselves).
HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
               "proxy-authorization", "proxy-connection", "accept-encoding", "content-encoding"}


class _PoolCollector(Collector):
    def __init__(self, pool: WorkerPool):
        self.pool = pool

    def collect(self) -> Iterator[Any]:
        families = [
            (CounterMetricFamily, "requests", "Requests routed to the worker (answered by it).", "routed"),
            (CounterMetricFamily, "prefix_hits", "Requests routed to the worker for a prefix it caches.",
             "prefix_hits"),
            (CounterMetricFamily, "prefix_hit_blocks", "Leading prompt blocks the worker cached when chosen.",
             "hit_blocks"),
            (CounterMetricFamily, "retries", "Requests moved to another worker after this one failed them.",
             "retried"),
            (CounterMetricFamily, "cache_events", "Cache events applied to the worker's prefix index.", "events"),
            (GaugeMetricFamily, "requests_in_flight", "Requests the worker is serving for this router.", "inflight"),
        ]
        for kind, name, doc, attr in families:
            fam = kind(PREFIX + name, doc, labels=["worker"])
            for w in self.pool.workers:
                fam.add_metric([w.url], float(getattr(w, attr)))
            yield fam
        healthy = GaugeMetricFamily(PREFIX + "worker_healthy", "1 while the worker can serve.", labels=["worker"])
        blocks = GaugeMetricFamily(PREFIX + "cached_blocks", "Block hashes in the worker's prefix index.",
                                   labels=["worker"])
        for w in self.pool.workers:
            healthy.add_metric([w.url], 1.0 if w.healthy and w.refused is None else 0.0)
            blocks.add_metric([w.url], float(len(self.pool.policy.indexes[w.url])))
        yield healthy
        yield blocks


def _unavailable(message: str) -> JSONResponse:
    exc = ServiceUnavailableError(message, retry_after=1)
    return JSONResponse(exc.to_openai(), status_code=503, headers={"Retry-After": "1"})


class _Proxy:
    """A generation request sent on to the worker the policy chooses: a worker that answers 503 (loading, draining)
    or fails before any byte reached the client is passed over for the next candidate; a stream, once its first
    bytes came, stays with its worker."""

    def __init__(self, pool: WorkerPool, tokens: PromptTokens) -> None:
        self.pool, self.tokens = pool, tokens

    async def prompt_ids(self, path: str, raw: bytes) -> list[list[int]]:
        try:
            body = json.loads(raw)
        except ValueError:
            return []  # the worker answers the malformed body with its own 400
        if len(raw) <= INLINE_TOKENIZE_CHARS:
            return self.tokens.prompts(path, body)
        return await asyncio.to_thread(self.tokens.prompts, path, body)

    async def stream_from(self, worker: Worker, upstream: httpx.Response, first: bytes,
                          rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:  # fmt: skip
        try:
            if first:
                yield first
            async for chunk in rest:
                yield chunk
        except httpx.HTTPError as exc:  # the client saw tokens already: its stream ends here
            self.pool.mark_dead(worker, f"the stream broke mid-response ({type(exc).__name__}: {exc})")
        finally:
            await upstream.aclose()
            worker.inflight -= 1

    async def __call__(self, request: Request, path: str) -> Response:
        pool = self.pool
        raw = await request.body()
        prompts = await self.prompt_ids(path, raw)
        try:
            stream = bool(json.loads(raw).get("stream"))
        except (ValueError, AttributeError):
            stream = False
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        tried: list[str] = []
        last_503: httpx.Response | None = None
        while True:
            candidates = [w for w in pool.available() if w.url not in tried]
            if not candidates:
                if last_503 is not None:  # every worker said why it cannot serve: pass the last one on
                    return Response(last_503.content, status_code=503, headers=_response_headers(last_503))
                tried_text = f" (tried {', '.join(tried)})" if tried else ""
                return _unavailable(f"no worker can serve this request{tried_text}: "
                                    f"{len(pool.workers)} configured, {len(pool.available())} healthy")
            choice = pool.policy.choose(prompts, [w.url for w in candidates], {w.url: w.inflight for w in candidates})
            worker = next(w for w in candidates if w.url == choice.replica)
            tried.append(worker.url)
            answer = await self._attempt(request, path, raw, headers, stream, worker, choice)
            if isinstance(answer, Response):
                return answer
            if answer is not None:
                last_503 = answer

    async def _attempt(self, request: Request, path: str, raw: bytes, headers: dict[str, str], stream: bool,
                       worker: Worker, choice: Choice) -> Response | httpx.Response | None:  # fmt: skip
        """One worker's try: the client's response, or the worker's 503 / None (failed before any byte) to go on."""
        pool = self.pool
        worker.inflight += 1
        upstream: httpx.Response | None = None
        owned = True  # this attempt closes the upstream and counts the request out; a started stream takes over
        try:
            # a worker answers a plain request only when it is done: until its headers come, the client may leave
            sent = await _unless_gone(request, pool.client.send(
                pool.client.build_request("POST", worker.url + path, content=raw, headers=headers), stream=True))
            if sent is _GONE:  # the send cancelled, its connection closed: the worker aborts the request
                return Response(status_code=499)
            upstream = sent
            if upstream.status_code == 503:  # loading or draining: another worker may serve it now
                await upstream.aread()
                worker.retried += 1
                return upstream
            if stream and upstream.status_code == 200:
                rest = upstream.aiter_bytes()  # decoded: content-encoding is not forwarded
                # the first bytes (until they come the request can move to another worker) wait on the queue and
                # the prefill: a client that leaves meanwhile ends the request there
                first = await _unless_gone(request, _first_bytes(rest))
                if first is _GONE:
                    return Response(status_code=499)
                _count(worker, choice)
                owned = False
                return StreamingResponse(self.stream_from(worker, upstream, first, rest), status_code=200,
                                         headers={**_response_headers(upstream), WORKER_HEADER: worker.url})
            if await _unless_gone(request, upstream.aread()) is _GONE:
                # closing the connection makes the worker abort the request and free its KV blocks
                return Response(status_code=499)
            _count(worker, choice)
            return Response(upstream.content, status_code=upstream.status_code,
                            headers={**_response_headers(upstream), WORKER_HEADER: worker.url})
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
                # slow, not dead: running the request again elsewhere would double its work
                return _gateway_timeout(f"worker {worker.url} sent nothing for --request-timeout "
                                        f"({type(exc).__name__}); the request was not retried")
            worker.retried += 1
            pool.mark_dead(worker, f"{path} failed before any byte reached the client "
                                   f"({type(exc).__name__}: {exc}); retrying on another worker")
            return None
        finally:
            if owned:
                worker.inflight -= 1
                if upstream is not None:
                    await upstream.aclose()


def create_app(pool: WorkerPool, tokens: PromptTokens) -> FastAPI:
    app = FastAPI(title="graphserve router", summary="cache-aware routing over graphserve workers")
    registry = CollectorRegistry()
    registry.register(_PoolCollector(pool))
    proxy = _Proxy(pool, tokens)

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await proxy(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, CHAT)

    @app.post(GENERATE)
    async def generate(request: Request) -> Response:
        return await proxy(request, GENERATE)

    async def from_any_worker(request: Request, path: str) -> Response:
        """A question every worker answers alike (the model they serve): asked of the first healthy one."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        for worker in pool.available():
            try:
                resp = await pool.client.get(worker.url + path, timeout=10.0, headers=headers)
            except httpx.HTTPError as exc:
                pool.mark_dead(worker, f"{path} failed ({type(exc).__name__}: {exc})")
                continue
            return Response(resp.content, status_code=resp.status_code,
                            headers={**_response_headers(resp), WORKER_HEADER: worker.url})
        return _unavailable(f"no worker can serve: 0 of {len(pool.workers)} healthy")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await from_any_worker(request, "/v1/models")

    @app.get("/get_model_info")
    async def get_model_info(request: Request) -> Response:
        return await from_any_worker(request, "/get_model_info")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        """Every healthy worker drops its prefix cache (benchmarks call this between runs)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        workers = pool.available()
        if not workers:
            return _unavailable(f"no worker can serve: 0 of {len(pool.workers)} healthy")
        answers = await asyncio.gather(*(pool.client.post(w.url + "/flush_cache", timeout=10.0, headers=headers)
                                         for w in workers), return_exceptions=True)
        failed = {w.url: (a if isinstance(a, Exception) else a.status_code) for w, a in zip(workers, answers)
                  if isinstance(a, Exception) or a.status_code != 200}
        if failed:
            return _unavailable(f"/flush_cache failed on {len(failed)} of {len(workers)} worker(s): "
                                + ", ".join(f"{url} ({why})" for url, why in failed.items()))
        return JSONResponse({"status": "ok", "message": f"prefix cache flushed on {len(workers)} worker(s)"})

    @app.get("/health")
    async def health() -> Response:
        available = pool.available()
        if not available:
            return _unavailable(f"no worker can serve: 0 of {len(pool.workers)} healthy")
        return JSONResponse({"status": "ok", "workers": len(pool.workers), "healthy": len(available)})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _count(worker: Worker, choice: Choice) -> None:
    worker.routed += 1
    if choice.by_prefix:
        worker.prefix_hits += 1
        worker.hit_blocks += choice.hit_blocks


async def _first_bytes(rest: AsyncIterator[bytes]) -> bytes:
    try:
        return await rest.__anext__()
    except StopAsyncIteration:
        return b""


T = TypeVar("T")
_GONE = object()  # what _unless_gone returns when the client left first


async def _unless_gone(request: Request, work: Awaitable[T]) -> T | object:
    """``work``'s result (or what it raised); ``_GONE``, having cancelled it, if the client leaves first (checked
    every ``DISCONNECT_POLL_S``)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return _GONE


def _gateway_timeout(message: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "gateway_timeout", "param": None, "code": None}}
    return JSONResponse(body, status_code=504)


def _response_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
