"""``--dp N``: N engine replicas behind the one HTTP front-end, each request sent to the replica that holds the
longest cached prefix of it, else to the least loaded (engine/routing_policy.py, the policy `graphserve router`
applies over HTTP).

A replica is a whole ``Frontend`` (frontend.py): its engine process with its own ``--tp`` ranks (replica r on the
GPUs from cuda:r*max(tp, ep)), its output thread, its streams, its queue bound. ``ReplicaSet`` wears the
Frontend's face, so the routes, the metrics and the launcher see one engine:

- a request is tokenized once, routed, then handed to its replica whole: its n sequences run there together
  and share its cached prompt blocks;
- an abort goes to the replica named in the engine id; a cache flush to every replica; a profile to every
  replica at once;
- each replica's prefix index is fed with that replica's own cache events, on the thread that receives its
  step outputs and before those outputs reach their clients (engine_events.py), so the router never guesses;
- a replica that dies fails its own requests only (its Frontend aborts them) and is routed around; the engine
  counts as dead, /health 503 and the server exiting, only once no replica serves.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from graphserve.config import EngineConfig
from graphserve.engine.kv_cache import CLEARED, REMOVED, STORED
from graphserve.engine.routing_policy import Choice, RoutingPolicy
from graphserve.errors import BadRequestError, GraphserveError, ServiceUnavailableError
from graphserve.sampling_params import SamplingParams
from graphserve.server.cache_events import CacheEventLog
from graphserve.server.frontend import Frontend
from graphserve.server.request_stream import RequestStream
from graphserve.structured.tool_calls import ToolChoice


def replica_configs(config: EngineConfig) -> list[EngineConfig]:
    """One config per replica: on CUDA replica r's ranks start at GPU first + r*max(tp, ep); CPU replicas share
    the host. Each is a single replica (dp=1), so the engine's own GPU check looks at its GPUs only."""
    world = max(config.tp, config.ep)
    on_cuda = config.device.startswith("cuda")
    if config.device == "auto":
        import torch  # only to resolve "auto"; the engine processes initialise CUDA, never this one

        on_cuda = torch.cuda.is_available()
    if not on_cuda:
        return [config.replace(dp=1) for _ in range(config.dp)]
    first = int(config.device.split(":")[1]) if config.device.startswith("cuda:") else 0
    return [config.replace(dp=1, device=f"cuda:{first + r * world}") for r in range(config.dp)]


def replica_of(engine_id: str) -> int | None:
    """The replica an engine id (Frontend.next_engine_id: ``rid#r<replica>.<serial>``) was given to."""
    tail = engine_id.rpartition("#")[2]
    head = tail.partition(".")[0]
    return int(head[1:]) if head[:1] == "r" and head[1:].isdigit() else None


class _AllReady:
    """The set's ``ready``: set once every replica has loaded or failed to."""

    def __init__(self, replicas: list[Frontend]):
        self._replicas = replicas

    def is_set(self) -> bool:
        return all(f.ready.is_set() for f in self._replicas)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in self._replicas:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not f.ready.wait(left):
                return False
        return True


class ReplicaSet:
    """N Frontends as one. ``on_step(replica, record)`` runs for every replica's step records; ``on_route(choice)``
    (set by the metrics) for every request routed."""

    def __init__(self, config: EngineConfig, *, on_step: Callable[[int, Any], None] | None = None,
                 separate_process: bool = False, stream_interval: int = 1, stream_stall_timeout: float = 30.0):
        if config.dp < 2:
            raise ValueError(f"a ReplicaSet is for --dp >= 2, got dp={config.dp}")
        # each replica's own cache events feed its prefix index here, so every replica records them (--kv-events),
        # and GET /v1/cache_events serves their union
        config = config.replace(kv_events=True)
        self.config = config
        self.separate_process = separate_process
        self.channel = None  # --api-server-count with --dp is refused (serve_command.py)
        self.policy = RoutingPolicy(range(config.dp), config.block_size)
        self._lock = threading.Lock()  # the policy: fed on each replica's reader thread, read on the loop
        self.cache_events = CacheEventLog()  # the union over the replicas, for GET /v1/cache_events
        self.on_route: Callable[[Choice], None] | None = None
        self.replicas: list[Frontend] = []
        for r, rc in enumerate(replica_configs(config)):
            step = None if on_step is None else (lambda rec, r=r: on_step(r, rec))
            self.replicas.append(Frontend(
                rc, on_step=step, separate_process=separate_process, stream_interval=stream_interval,
                stream_stall_timeout=stream_stall_timeout, replica=r,
                on_cache_events=lambda events, r=r: self._on_cache_events(r, events)))
        self.ready = _AllReady(self.replicas)
        self.profiles = ReplicaProfiles(self)
        self._stopped = False

    # -- lifecycle ---------------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        for f in self.replicas:
            f.start(loop)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped = True
        for f in self.replicas:
            f.shutdown(timeout)

    @property
    def on_abort(self) -> Callable[[str, GraphserveError | None], None] | None:
        return self.replicas[0].on_abort

    @on_abort.setter
    def on_abort(self, fn: Callable[[str, GraphserveError | None], None] | None) -> None:
        for f in self.replicas:
            f.on_abort = fn

    # -- the one engine's face ---------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Some replica serves."""
        return not self._stopped and any(f.alive for f in self.replicas)

    @property
    def load_error(self) -> BaseException | None:
        """A replica that failed to load fails the server's start: it would serve at 1/N of what was asked."""
        return next((f.load_error for f in self.replicas if f.load_error is not None), None)

    @property
    def engine_error(self) -> str | None:
        """Set once every replica has died; until then the others serve."""
        errors = [f.engine_error for f in self.replicas]
        if any(e is None for e in errors):
            return None
        return "every replica's engine died (" + "; ".join(e for e in errors if e) + "); restart the server"

    @property
    def core(self) -> Any:
        """The first serving replica's view (tokenizer, chat template, telemetry): the replicas run one model."""
        return self._first().core

    @property
    def tokenizer(self) -> Any:
        return self._first().tokenizer

    @property
    def input_processor(self) -> Any:
        return self._first().input_processor

    @property
    def stats(self) -> Any:
        return self._first().stats

    @property
    def warmup(self) -> dict[str, float]:
        return self._first().warmup

    def _first(self) -> Frontend:
        return next((f for f in self.replicas if f.alive), self.replicas[0])

    def kv_capacity_tokens(self) -> int:
        return sum(f.kv_capacity_tokens() for f in self.replicas)

    @property
    def num_inflight(self) -> int:
        return sum(f.num_inflight for f in self.replicas)

    def queued_sequences(self) -> int:
        return sum(f.queued_sequences() for f in self.replicas if f.alive)

    def check_serving(self) -> None:
        """Raise ServiceUnavailableError unless some replica can take requests now."""
        if self.load_error is not None:
            raise ServiceUnavailableError(f"a replica failed to load: {self.load_error}", retry_after=60)
        if not self.ready.is_set():
            loading = sum(not f.ready.is_set() for f in self.replicas)
            raise ServiceUnavailableError(f"{loading} of {len(self.replicas)} replicas are still loading the model",
                                          retry_after=5)
        if self._stopped:
            raise ServiceUnavailableError("the engine is shutting down", retry_after=5)
        error = self.engine_error
        if error is not None:
            raise ServiceUnavailableError(error, retry_after=60)

    # -- requests ----------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, arrival_time: float | None = None,
                    tools: ToolChoice | None = None) -> RequestStream:
        """Tokenize once, route by the prompt's cached blocks, then validate and enqueue on the chosen replica."""
        self.check_serving()
        if any(request_id in f._client_ids for f in self.replicas):
            raise BadRequestError(f"rid={request_id!r} is invalid: a request with this id is in flight", param="rid")
        live = [r for r, f in enumerate(self.replicas) if f.alive]
        if not live:
            raise ServiceUnavailableError("no replica can serve now", retry_after=5)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        # a placeholder id: the chosen replica gives the request its own before it is sent
        req = self.replicas[live[0]].input_processor.process(request_id, prompt, params, arrival)
        load = {r: self.replicas[r].num_inflight for r in live}
        with self._lock:
            choice = self.policy.choose([req.prompt_token_ids], live, load)
        target = self.replicas[choice.replica]
        target.admit(request_id, params)
        req.request_id = target.next_engine_id(request_id)
        stream = target.submit(req, prompt, request_id, tools)
        if self.on_route is not None:
            self.on_route(choice)
        return stream

    def abort(self, engine_id: str, error: GraphserveError | None = None) -> None:
        r = replica_of(engine_id)
        for i, f in enumerate(self.replicas):
            if r is None or r == i:
                f.abort(engine_id, error)

    def abort_all(self, error: GraphserveError) -> int:
        return sum(f.abort_all(error) for f in self.replicas)

    def flush_prefix_cache(self) -> None:
        for f in self.replicas:
            if f.alive:
                f.flush_prefix_cache()

    # -- cache events ------------------------------------------------------------------------------------

    def _on_cache_events(self, replica: int, events: list[tuple]) -> None:
        """A replica's reader thread: its index takes the events as they are; the union log takes a hash in
        when the first replica stores it and out when the last one drops it."""
        union: list[tuple] = []
        with self._lock:
            mine = self.policy.indexes[replica].hashes
            others = [ix.hashes for r, ix in self.policy.indexes.items() if r != replica]
            for ev in events:
                kind = ev[0]
                if kind == STORED and ev[1] not in mine and not any(ev[1] in o for o in others):
                    union.append(ev)
                elif kind == REMOVED and ev[1] in mine and not any(ev[1] in o for o in others):
                    union.append(ev)
                elif kind == CLEARED:
                    union += [(REMOVED, h) for h in mine if not any(h in o for o in others)]
                self.policy.apply(replica, [ev])
                mine = self.policy.indexes[replica].hashes
        self.cache_events.extend(union)


class ReplicaProfiles:
    """POST /v1/profile with replicas: every serving replica with requests in flight profiles its next steps at
    once, each under the load routed to it (an idle one would only run out the timeout: an engine steps only
    with requests); the answer is the first one's profile, with each one's under ``replicas``."""

    def __init__(self, replicas: ReplicaSet):
        self.set = replicas

    async def profile(self, steps: int, timeout_s: float) -> dict:
        live = [(r, f) for r, f in enumerate(self.set.replicas) if f.alive]
        live = [(r, f) for r, f in live if f.num_inflight] or live
        results = await asyncio.gather(*(f.profiles.profile(steps, timeout_s) for _, f in live),
                                       return_exceptions=True)
        by_replica: dict[str, Any] = {}
        first: dict | None = None
        for (r, _), res in zip(live, results):
            if isinstance(res, BaseException):
                if not isinstance(res, GraphserveError):
                    raise res
                by_replica[str(r)] = {"error": res.message}
                continue
            by_replica[str(r)] = res
            if first is None:
                first = {**res, "replica": r}
        if first is None:
            errors = [res for res in results if isinstance(res, GraphserveError)]
            if errors:
                raise errors[0]
            raise ServiceUnavailableError("no replica can serve now", retry_after=5)
        first["replicas"] = by_replica
        return first
