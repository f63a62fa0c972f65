"""The messages between the HTTP front-end(s) and the engine's serve loop, and what a front-end keeps of the
core. Small dataclasses: pickled through a queue (front-ends -> engine) and pipes (engine -> each front-end)
when the engine has a process of its own, handed over as they are when it runs on a thread (client.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from graphserve.engine.step_outputs import StepOutputs
from graphserve.engine.telemetry import Telemetry

# -- server -> engine ----------------------------------------------------------------------------------------

@dataclass
class AddRequests:
    requests: list[Any]  # EngineRequests, validated and tokenized by the server
    faulty: set[str] = field(default_factory=set)  # test-only fault injection: these ids fail their next step
    frontend: int = 0  # the HTTP front-end process that owns them: their outputs go back to it alone


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class FlushPrefixCache:
    """Drop the prefix cache before the next step (/flush_cache)."""


@dataclass
class Shutdown:
    pass


@dataclass
class ProfileSteps:
    """Both ways (graphserve profile): the server asks the engine to profile its next ``steps`` decode steps
    (0 cancels the one running); the engine answers with the same message, ``result`` filled."""

    token: int
    steps: int
    result: dict | None = None
    frontend: int = 0  # who asked: the answer goes back to that front-end


# -- engine -> server ----------------------------------------------------------------------------------------

@dataclass
class EngineReady:
    info: Any  # ModelInfo
    chat_template: str | None
    max_model_len: int
    num_usable_blocks: int
    block_size: int
    stats: Any  # EngineStats
    warmup: dict[str, float] = field(default_factory=dict)  # what the warm-up ran (warmup.py)


@dataclass
class EngineLoadFailed:
    message: str


@dataclass
class StepBatch:
    outputs: StepOutputs  # new tokens of the iterations since the previous batch
    failed: dict[str, str]  # request id -> why it failed
    stats: Any  # EngineStats after the latest iteration
    records: list[Any]  # StepRecords of the steps since the previous batch
    cache_events: list[Any] = field(default_factory=list)  # the prefix cache's changes (engine/kv_cache.py)

    def merge(self, later: StepBatch) -> None:
        self.outputs.extend(later.outputs)
        self.failed.update(later.failed)
        self.stats = later.stats
        self.records += later.records
        self.cache_events += later.cache_events


@dataclass
class CoreView:
    """What the server keeps of the core, wherever it runs; the routes read it as ``engine.core``."""

    tokenizer: Any
    info: Any  # ModelInfo
    chat_template: str | None
    max_model_len: int
    telemetry: Telemetry = field(default_factory=Telemetry)  # fed with the engine's StepRecords
