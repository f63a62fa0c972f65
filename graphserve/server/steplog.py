"""The step log: SGLang's "Decode batch" line every ``--log-interval`` decode steps, and the JSONL sink.

The line keeps SGLang's exact wording so the same log tools (ours: ``graphserve doctor``) read both.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import IO

from graphserve.engine.telemetry import StepRecord

logger = logging.getLogger("graphserve.steplog")


def format_decode_line(
    running: int, kv_tokens: int, usage: float, graph: bool, throughput: float, queued: int
) -> str:
    return (
        f"Decode batch, #running-req: {running}, #token: {kv_tokens}, token usage: {usage:.2f}, "
        f"cuda graph: {graph}, gen throughput (token/s): {throughput:.2f}, #queue-req: {queued}"
    )


def format_page_fields(used: int, idle: int, total: int) -> str:
    """The latent pages' part of the step line (a model that pages its latents apart), after SGLang's fields so its
    tools read the line as theirs: the pages running windows hold, their share, and those idle with cached
    prefixes."""
    return f", #latent-page: {used}, latent page usage: {used / max(total, 1):.2f}, #idle-latent-page: {idle}"


class StepLogger:
    """Telemetry listener: counts decode steps and their generated tokens, logs one line per interval.

    ``kv_capacity`` (tokens in the KV pool) turns the step's usage fraction into "#token", the KV tokens in
    use; throughput is generated tokens over the wall time since the previous line. ``prefix`` names a --dp
    replica as SGLang does ("DP1 "); log tools find the line by its "Decode batch" wording anywhere in it.
    """

    def __init__(self, interval: int, kv_capacity: Callable[[], int], prefix: str = ""):
        self.interval = interval
        self.prefix = prefix
        self.kv_capacity = kv_capacity
        self._steps = 0
        self._tokens = 0
        self._since = time.monotonic()

    def on_step(self, rec: StepRecord) -> None:
        if rec.decode_tokens <= 0:
            return
        self._steps += 1
        self._tokens += rec.decode_tokens
        if self._steps % self.interval:
            return
        now = time.monotonic()
        elapsed = max(now - self._since, 1e-9)
        throughput = self._tokens / elapsed
        self._since, self._tokens = now, 0
        kv_tokens = round(rec.kv_usage * self.kv_capacity())
        line = format_decode_line(rec.running, kv_tokens, rec.kv_usage, rec.graph, throughput, rec.waiting)
        if rec.latent_pages_total:
            line += format_page_fields(rec.latent_pages_used, rec.latent_pages_idle, rec.latent_pages_total)
        logger.info(self.prefix + line)


class JsonlStepSink:
    """Writes every StepRecord as one JSON line (``--step-log FILE``), flushed at once so a reader (or a
    crash) sees every step; past ``max_bytes`` the file moves to FILE.1 (replacing the previous backup)
    and a new one starts, so a long-running server never fills the disk."""

    def __init__(self, path: str, max_bytes: int | None = None):
        self.path = path
        self.max_bytes = max_bytes
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._size = os.path.getsize(path)
        self._lock = threading.Lock()

    def on_step(self, rec: StepRecord) -> None:
        line = rec.to_json() + "\n"
        with self._lock:
            if self._file.closed:
                return
            if self.max_bytes is not None and self._size and self._size + len(line) > self.max_bytes:
                self._rotate()
            self._file.write(line)
            self._file.flush()
            self._size += len(line.encode("utf-8"))

    def _rotate(self) -> None:
        self._file.close()
        os.replace(self.path, self.path + ".1")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._size = 0

    def close(self) -> None:
        with self._lock:
            self._file.close()
