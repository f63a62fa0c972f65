"""Prometheus metrics under the ``graphserve:`` prefix, in a registry of the server's own.

Gauges and totals are read from the engine's last stats snapshot at scrape time (the core is never touched
from the HTTP thread); latency histograms are observed on the loop as outputs arrive; step histograms and
the decode-step counter are fed by the telemetry listener on the engine thread.

With several HTTP front-end processes (``--api-server-count``) every front-end answers /metrics for the whole
server: counters and histograms live in prometheus_client's multiprocess files (the supervisor sets
``PROMETHEUS_MULTIPROC_DIR`` before any front-end starts) and each scrape sums them over the front-ends, so
no scrape depends on another process answering. The engine gauges come once, from the answering front-end's
latest stats: every front-end receives the engine's stats after every iteration. Only front-end 0 feeds the
step metrics, so a step is counted once.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import multiprocess as prometheus_multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from graphserve.engine.output_processor import RequestDelta
from graphserve.engine.telemetry import StepRecord

PREFIX = "graphserve:"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)


# (replica label or None, the engine's last stats or None, whether it serves): one row per --dp replica
ReplicaView = tuple[str | None, Any, bool]
GAUGES = (
    ("num_requests_running", "Requests in the running batch.", "running", True),
    ("num_requests_waiting", "Requests waiting to be scheduled.", "waiting", True),
    ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", "kv_usage", True),
    ("prefix_cache_hit_rate", "Fraction of prompt tokens served from the prefix cache.", "prefix_cache_hit_rate",
     False),
)
COUNTERS = (
    ("num_preemptions", "Sequences preempted to free KV blocks.", "num_preemptions"),
    ("prompt_tokens", "Prompt tokens processed.", "prompt_tokens_total"),
    ("generation_tokens", "Tokens generated.", "generation_tokens_total"),
)
# Latents paged apart from the blocks (DeepSeek-V4, engine/latent_pages.py): a second resource a request can run out
# of. Exported only by a model that has them.
PAGE_GAUGES = (
    ("latent_pages_used", "Latent pages held by running requests' windows.", "latent_pages_used", True),
    ("latent_pages_idle", "Latent pages held by cached prefixes no running window covers (taken back first).",
     "latent_pages_idle", True),
    ("latent_pages_total", "Usable latent pages (beside the KV blocks).", "latent_pages_total", False),
)
PAGE_COUNTERS = (
    ("num_preemptions_latent_pages", "Of num_preemptions, those for want of latent pages rather than KV blocks.",
     "num_preemptions_for_pages"),
)


class _EngineStatsCollector(Collector):
    """The engine gauges; with --dp replicas, one sample per replica under a ``replica`` label."""

    def __init__(self, snapshot: Callable[[], Any], alive: Callable[[], bool] | None,
                 views: Callable[[], list[ReplicaView]] | None = None):
        self._snapshot = snapshot
        self._alive = alive
        self._views = views

    def _rows(self) -> list[ReplicaView]:
        if self._views is not None:
            return self._views()
        return [(None, self._snapshot(), self._alive() if self._alive is not None else True)]

    def collect(self) -> Iterator[Any]:
        rows = self._rows()
        labels = ["replica"] if self._views is not None else None

        def family(cls: Any, name: str, doc: str, samples: list[tuple[str | None, float]]) -> Any:
            if labels is None:
                return cls(PREFIX + name, doc, value=samples[0][1])
            fam = cls(PREFIX + name, doc, labels=labels)
            for label, value in samples:
                fam.add_metric([label], value)
            return fam

        yield family(GaugeMetricFamily, "engine_alive", "1 while the engine serves; 0 loading, dead or stopped.",
                     [(label, 1.0 if alive else 0.0) for label, _, alive in rows])
        rows = [row for row in rows if row[1] is not None]
        if not rows:
            return
        # A dead engine runs nothing and holds nothing: its last snapshot must not read as 20 running forever.
        paged = any(getattr(s, "latent_pages_total", 0) for _, s, _ in rows)
        for name, doc, field, zero_when_dead in GAUGES + (PAGE_GAUGES if paged else ()):
            yield family(GaugeMetricFamily, name, doc, [
                (label, float(getattr(s, field)) if alive or not zero_when_dead else 0.0) for label, s, alive in rows])
        for name, doc, field in COUNTERS + (PAGE_COUNTERS if paged else ()):
            yield family(CounterMetricFamily, name, doc, [(label, float(getattr(s, field))) for label, s, _ in rows])


class ServerMetrics:
    def __init__(self, stats_snapshot: Callable[[], Any], engine_alive: Callable[[], bool] | None = None,
                 api_server: int = 0, multiprocess: bool = False,
                 replica_views: Callable[[], list[ReplicaView]] | None = None):
        engine_stats = _EngineStatsCollector(stats_snapshot, engine_alive, replica_views)
        # --dp replicas: the engine gauges and the step metrics carry a `replica` label
        self.replica_label = replica_views is not None
        step_labels = ["replica"] if self.replica_label else []
        r = CollectorRegistry()
        if multiprocess:  # our metrics write to the shared files; scrapes read them all (see above)
            if not os.environ.get(MULTIPROC_ENV):
                raise RuntimeError(f"{MULTIPROC_ENV} must be set before prometheus_client is imported")
            self.registry = CollectorRegistry()
            prometheus_multiprocess.MultiProcessCollector(self.registry)
        else:
            self.registry = r
        self.registry.register(engine_stats)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between streamed tokens.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to first scheduled.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.step_duration = Histogram(PREFIX + "step_duration_seconds", "Wall time of one engine step.",
                                       ["kind", *step_labels], buckets=STEP_BUCKETS, registry=r)
        self.decode_steps = Counter(PREFIX + "decode_steps", "Decode steps, by whether a CUDA graph ran.",
                                    ["graph", *step_labels], registry=r)
        self.requests = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                ["finish_reason"], registry=r)
        self.request_errors = Counter(PREFIX + "request_errors", "Responses with a 4xx/5xx status, or an error "
                                      "event in a stream, by status code and error type.", ["code", "reason"],
                                      registry=r)
        self.request_aborted = Counter(PREFIX + "request_aborted", "Requests stopped before they finished: "
                                       "cancelled (client gone), or failed by a shutdown or an engine fault.",
                                       ["reason"], registry=r)
        # MoE routing balance per layer: pairs routed, and the busiest expert's pairs, summed over steps;
        # their ratio against pairs / experts is how unevenly the router loads that layer
        self.moe_routed_pairs = Counter(PREFIX + "moe_routed_pairs", "(token, slot) pairs routed, by MoE layer.",
                                        ["layer"], registry=r)
        self.moe_busiest_expert = Counter(PREFIX + "moe_busiest_expert_pairs", "Pairs the busiest expert of "
                                          "each step received, summed over steps, by MoE layer.", ["layer"],
                                          registry=r)
        self.api_server_requests = Counter(PREFIX + "api_server_requests", "Generation requests taken, by the "
                                           "HTTP front-end process that took them (--api-server-count).",
                                           ["api_server"], registry=r).labels(api_server=str(api_server))
        self.replica_requests: Counter | None = None
        if self.replica_label:
            self.replica_requests = Counter(PREFIX + "replica_requests", "Requests routed to each --dp replica, by "
                                            "why: prefix (it held the longest cached prefix) or load (least "
                                            "loaded, no replica held one).", ["replica", "route"], registry=r)
            for label, _, _ in replica_views():
                for route in ("prefix", "load"):
                    self.replica_requests.labels(replica=label, route=route)
                for graph in ("true", "false"):
                    self.decode_steps.labels(graph=graph, replica=label)
        else:
            for graph in ("true", "false"):
                self.decode_steps.labels(graph=graph)

    def on_abort(self, request_id: str, error: Any) -> None:
        """Frontend hook (loop thread): a request stopped before it finished."""
        self.request_aborted.labels(reason="cancelled" if error is None else error.error_type).inc()

    def on_route(self, choice: Any) -> None:
        """ReplicaSet hook (loop thread): a request went to ``choice.replica`` (engine/routing_policy.Choice)."""
        if self.replica_requests is not None:
            route = "prefix" if choice.by_prefix else "load"
            self.replica_requests.labels(replica=str(choice.replica), route=route).inc()

    def on_step(self, rec: StepRecord) -> None:
        """Telemetry listener (engine thread)."""
        replica = {"replica": str(rec.replica)} if self.replica_label else {}
        self.step_duration.labels(kind=rec.kind, **replica).observe(rec.step_ms / 1000.0)
        if rec.decode_tokens > 0:
            self.decode_steps.labels(graph="true" if rec.graph else "false", **replica).inc()
        if rec.layer_routed_pairs:
            for layer, (pairs, busiest) in enumerate(zip(rec.layer_routed_pairs, rec.layer_max_expert_load)):
                self.moe_routed_pairs.labels(layer=str(layer)).inc(pairs)
                self.moe_busiest_expert.labels(layer=str(layer)).inc(busiest)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Per-request latency bookkeeping on the loop: feed it every RequestDelta of one request."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.m = metrics
        self.arrival = arrival
        self.last_token_time: float | None = None
        self.queue_observed = False
        self.finish_reasons: dict[int, str] = {}

    def observe(self, delta: RequestDelta) -> None:
        now = time.monotonic()
        # n > 1 choices advance together: one step's gap is one inter-token latency, not n
        new = delta.num_tokens
        if new > 0:
            if self.last_token_time is None:
                self.m.ttft.observe(now - self.arrival)
            else:
                per_token = (now - self.last_token_time) / new
                for _ in range(new):
                    self.m.itl.observe(per_token)
            self.last_token_time = now
        if delta.first_scheduled_time is not None and not self.queue_observed:
            self.m.queue_time.observe(max(0.0, delta.first_scheduled_time - self.arrival))
            self.queue_observed = True
        for i, c in delta.choices.items():
            if c.finish_reason is not None:
                self.finish_reasons[i] = c.finish_reason
        if delta.finished:
            self.m.e2e.observe(now - self.arrival)
            for reason in self.finish_reasons.values():
                self.m.requests.labels(finish_reason=reason).inc()
