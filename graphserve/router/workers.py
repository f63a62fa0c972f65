"""The workers behind the router: their health, their load and their prefix indexes.

Each worker has two tasks: a health check (``GET /health`` every ``health_interval`` s) and a long poll of its
cache events (``GET /v1/cache_events``, server/cache_events.py) that keeps its index in the routing policy. A
worker is dropped at once when a request to it fails at the connection, and taken back when its /health answers
200 again; a worker serving another model than the router's is never used, one serving no cache events (started
without --kv-events) not until it serves them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

from graphserve.engine.routing_policy import RoutingPolicy
from graphserve.server.cache_events import HASH_PROBE

logger = logging.getLogger("graphserve.router")

EVENTS_WAIT_S = 10.0  # long-poll wait per /v1/cache_events call
NO_EVENTS_RETRY_S = 5.0  # how often a worker refused for serving no cache events is asked again


def no_events_reason(url: str, resp: httpx.Response) -> str:
    """Why a worker whose /v1/cache_events answered 404 cannot be routed to by prefix, naming it and the flag."""
    try:
        code = resp.json()["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        code = None
    why = "was started without --kv-events" if code == "kv_events_disabled" else \
        "has no GET /v1/cache_events (an older graphserve?)"
    return (f"--worker {url} {why}, so the router cannot know which prefixes it caches: start that worker with "
            "`graphserve serve MODEL --kv-events`")


@dataclass
class Worker:
    url: str
    healthy: bool = False
    refused: str | None = None  # why this worker is never used (another model, another hash, no cache events)
    no_events: bool = False  # refused for serving no cache events: taken in once it serves them
    model: str | None = None
    inflight: int = 0
    epoch: str | None = None  # its cache-event log's, changes when the worker restarts
    since: int = -1  # serial of the last cache event applied; -1 asks for a snapshot
    events: int = 0  # cache events applied
    routed: int = 0
    prefix_hits: int = 0
    hit_blocks: int = 0
    retried: int = 0  # requests moved to another worker after this one failed them


class WorkerPool:
    def __init__(self, urls: list[str], model: str, client: httpx.AsyncClient, policy: RoutingPolicy,
                 health_interval: float = 1.0, headers: dict[str, str] | None = None):
        self.workers = [Worker(url) for url in urls]
        self.model = model  # the model source every worker must serve
        self.client = client
        self.policy = policy
        self.health_interval = health_interval
        self.headers = headers or {}  # on the router's own calls (the workers' --api-key)
        for w in self.workers:
            policy.add(w.url)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for w in self.workers:
            self._tasks.append(asyncio.ensure_future(self._health_loop(w)))
            self._tasks.append(asyncio.ensure_future(self._events_loop(w)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def available(self) -> list[Worker]:
        return [w for w in self.workers if w.healthy and w.refused is None]

    def mark_dead(self, worker: Worker, reason: str) -> None:
        if worker.healthy:
            logger.warning("worker %s dropped: %s", worker.url, reason)
        worker.healthy = False
        # what comes back may have restarted with an empty cache: its index waits for a fresh snapshot (an
        # answer of the old epoch still in flight is dropped, see _apply)
        self.policy.reset(worker.url)
        worker.epoch = None
        worker.since = -1

    async def _check_model(self, worker: Worker) -> None:
        resp = await self.client.get(worker.url + "/get_model_info", timeout=5.0, headers=self.headers)
        resp.raise_for_status()
        worker.model = resp.json().get("model_path")
        if worker.model != self.model:
            worker.refused = f"serves model={worker.model!r}, the router routes for model={self.model!r}"
            worker.no_events = False  # a refusal that serving cache events does not lift
            logger.error("worker %s is not used: it %s", worker.url, worker.refused)

    async def _health_loop(self, worker: Worker) -> None:
        while True:
            try:
                resp = await self.client.get(worker.url + "/health", timeout=max(2.0, self.health_interval))
                ok = resp.status_code == 200
                if ok and worker.model is None:
                    await self._check_model(worker)
                reason = f"/health answered {resp.status_code}"
            except (httpx.HTTPError, ValueError, KeyError) as exc:  # down, or not a graphserve worker
                ok, reason = False, f"{type(exc).__name__}: {exc}"
            if ok and not worker.healthy and worker.refused is None:
                logger.info("worker %s is healthy", worker.url)
            if not ok:
                self.mark_dead(worker, reason)
                worker.model = None  # what comes back up may serve another model: asked again
            worker.healthy = ok
            await asyncio.sleep(self.health_interval)

    async def _events_loop(self, worker: Worker) -> None:
        # One connection of its own: behind several HTTP front-ends on one port (--api-server-count), each with
        # its own event log and epoch, polls that landed on alternate front-ends would take a snapshot each.
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1), headers=self.headers) as client:
            while worker.refused is None or worker.no_events:
                try:
                    resp = await client.get(worker.url + "/v1/cache_events",
                                            params={"since": worker.since, "timeout": EVENTS_WAIT_S},
                                            timeout=EVENTS_WAIT_S + 10.0)
                except httpx.HTTPError:
                    await asyncio.sleep(self.health_interval)
                    continue
                if resp.status_code == 404:
                    self._refuse_without_events(worker, resp)
                    await asyncio.sleep(max(self.health_interval, NO_EVENTS_RETRY_S))
                    continue
                if resp.status_code not in (200, 401, 403):  # loading or draining
                    await asyncio.sleep(self.health_interval)
                    continue
                if not self._take(worker, resp):
                    return

    def _refuse_without_events(self, worker: Worker, resp: httpx.Response) -> None:
        """A worker that joined after the start-up check (launch.check_kv_events) without cache events: unused
        until it serves them, as the start-up check would have refused it."""
        if worker.no_events:
            return
        worker.no_events = True
        worker.refused = no_events_reason(worker.url, resp)
        logger.error("worker %s is not used: %s", worker.url, worker.refused)

    def _take(self, worker: Worker, resp: httpx.Response) -> bool:
        """Apply one /v1/cache_events answer; False when this worker's events cannot be used at all."""
        if resp.status_code != 200:
            logger.error("worker %s refused the router's key (%d: set --api-key); requests go to it by load alone",
                         worker.url, resp.status_code)
            return False
        if worker.no_events:  # restarted with --kv-events
            worker.no_events = False
            worker.refused = None
            logger.info("worker %s serves its cache events now: taken in", worker.url)
        body = resp.json()
        if body.get("hash_probe") != HASH_PROBE:
            logger.error("worker %s hashes blocks unlike this router (probe %s, here %s: another Python "
                         "version?): its prefixes are not indexed, requests go to it by load alone",
                         worker.url, body.get("hash_probe"), HASH_PROBE)
            self.policy.reset(worker.url)
            return False
        self._apply(worker, body)
        return True

    def _apply(self, worker: Worker, body: dict) -> None:
        if body.get("epoch") != worker.epoch:
            if worker.epoch is not None:
                logger.info("worker %s restarted: its prefix index starts over from a snapshot", worker.url)
            worker.epoch = body.get("epoch")
            if "snapshot" not in body:  # serials of the old epoch mean nothing to the new one
                worker.since = -1
                return
        if "snapshot" in body:
            self.policy.reset(worker.url, body["snapshot"], body.get("block_size"))
        self.policy.apply(worker.url, body.get("events", ()))
        worker.events += len(body.get("events", ()))
        worker.since = body.get("next", -1)
