"""Per-step telemetry: one record per engine step, kept in a ring buffer, and the engine's gauges and
counters (EngineStats).

Listeners (the server's metrics, step log and JSONL sink) see every record; the analyzer reads it.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass


@dataclass
class StepRecord:
    step: int  # monotonically increasing step id
    time: float  # wall clock (time.time()) at the end of the step
    kind: str  # "prefill" | "decode" | "mixed"
    batch_size: int  # sequences in the step
    padded_size: int  # batch size after CUDA-graph padding (== batch_size when eager)
    graph: bool  # whether a captured CUDA graph ran
    mode: str  # "eager" | "graph" | "split-graph" (oversize batch replayed as captured pieces)
    num_tokens: int  # new tokens processed
    prefill_tokens: int
    decode_tokens: int
    step_ms: float  # wall time of the step, scheduling to sampled tokens on the host
    running: int  # running requests after the step
    waiting: int  # waiting requests after the step
    kv_usage: float  # fraction of KV blocks in use
    context_tokens: int = 0  # KV tokens attended over by the step
    preempted: int = 0  # requests preempted during this step's scheduling
    comm_ops: int = 0  # collectives of the forward on each rank (tp/ep > 1): all-reduces, the logits gather
    comm_bytes: int = 0  # bytes those collectives reduced or gathered (each rank's contribution)
    gc_ms: float = 0.0  # time Python's garbage collector ran in this step's interval (engine/gc_clock.py)
    # The host's share: from the step's start to its launch (scheduling, and where penalties need the ids of
    # the step in flight, waiting for them), then enqueueing its forward and sampling on the device. A
    # launch_ms close to step_ms means the device waited on the host (an eager prefill's launches); far
    # below it, the host waited on the device.
    schedule_ms: float = 0.0
    launch_ms: float = 0.0
    # mixture-of-experts models only: routing as the router decided it in this step
    experts_touched: int = 0  # distinct (layer, expert) pairs that received a token
    max_expert_load: int = 0  # most (token, slot) pairs any one expert received
    layer_max_expert_load: list[int] | None = None  # per MoE layer, its busiest expert's pairs
    layer_routed_pairs: list[int] | None = None  # per MoE layer, the (token, slot) pairs routed
    replica: int = 0  # which --dp replica ran the step (the server sets it as the record arrives)
    # latents paged apart (DeepSeek-V4, engine/latent_pages.py), after the step; all 0 for other models
    latent_pages_used: int = 0  # held by running sequences' windows
    latent_pages_idle: int = 0  # held by cached prefixes no window covers (taken back first when short)
    latent_pages_total: int = 0  # usable pages (the dummy page not counted)
    preempted_for_pages: int = 0  # of ``preempted``, those for want of latent pages rather than KV blocks

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


@dataclass
class EngineStats:
    running: int
    waiting: int  # includes constrained requests waiting for their grammar
    kv_usage: float
    prefix_cache_hit_rate: float
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # latents paged apart (StepRecord's fields of the same names); 0 for other models
    latent_pages_used: int = 0
    latent_pages_idle: int = 0
    latent_pages_total: int = 0
    num_preemptions_for_pages: int = 0


class Telemetry:
    """A bounded ring buffer of StepRecords with listeners. Thread-safe."""

    def __init__(self, capacity: int = 10000):
        self._buf: collections.deque[StepRecord] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._listeners: list = []

    def record(self, rec: StepRecord) -> None:
        with self._lock:
            self._buf.append(rec)
            listeners = list(self._listeners)
        for fn in listeners:
            fn(rec)

    def add_listener(self, fn) -> None:
        """Call ``fn(record)`` after every step (e.g. Prometheus metrics, the step log)."""
        with self._lock:
            self._listeners.append(fn)

    def records(self) -> list[StepRecord]:
        with self._lock:
            return list(self._buf)

    def last_step(self) -> int:
        """The newest record's step id (0 before the first): where a caller's own window of steps begins."""
        with self._lock:
            return self._buf[-1].step if self._buf else 0

    def extend(self, recs: Iterable[StepRecord]) -> None:
        for r in recs:
            self.record(r)

    def __len__(self) -> int:
        with self._lock:
            return len(self._buf)
