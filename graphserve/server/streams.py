"""Plumbing shared by the endpoints: starting a request per prompt, merging their streams, watching for a
client that went away, SSE framing and the deltas between cumulative outputs."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from graphserve.errors import BadRequestError, GraphserveError, InternalError
from graphserve.outputs import CompletionOutput, RequestOutput
from graphserve.sampling_params import SamplingParams
from graphserve.server.async_engine import AsyncEngine, RequestStream
from graphserve.server.errors import sse, sse_error_event
from graphserve.server.metrics import RequestTimer, ServerMetrics

T = TypeVar("T")
DONE = "data: [DONE]\n\n"
DISCONNECT_POLL_S = 0.25
# Status for a client that left before its response: nobody reads it, but access logs show why.
CLIENT_CLOSED = 499


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Job:
    """One prompt's request: its stream, latency timer and the latest output."""

    index: int
    stream: RequestStream
    timer: RequestTimer
    last: RequestOutput | None = None


def start_jobs(
    engine: AsyncEngine, metrics: ServerMetrics, base_id: str, prompts: list[Any], params: SamplingParams
) -> list[Job]:
    """Add one request per prompt; if any is refused, abort the ones already added and re-raise."""
    limit = engine.config.max_queued_requests
    if len(prompts) > limit:  # they enter the waiting queue together: more than its bound is never admitted
        raise BadRequestError(f"prompt holds {len(prompts)} prompts, above --max-queued-requests={limit}; "
                              "send them in smaller batches", param="prompt")
    jobs: list[Job] = []
    arrival = time.monotonic()
    try:
        for i, prompt in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            stream = engine.add_request(rid, prompt, params, arrival)
            jobs.append(Job(i, stream, RequestTimer(metrics, arrival)))
    except BaseException:
        for job in jobs:
            engine.abort(job.stream.request_id)
        raise
    return jobs


async def merged(jobs: list[Job]) -> AsyncIterator[tuple[Job, RequestOutput]]:
    """Outputs of all jobs as they arrive. Leaving early cancels the pumps, which aborts the requests."""
    if len(jobs) == 1:
        job = jobs[0]
        async for out in job.stream:
            job.last = out
            job.timer.observe(out)
            yield job, out
        return
    queue: asyncio.Queue[tuple[Job, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async for out in job.stream:
                await queue.put((job, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((job, exc))
            return
        await queue.put((job, None))

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    try:
        remaining = len(jobs)
        while remaining:
            job, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            job.last = item
            job.timer.observe(item)
            yield job, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(jobs: list[Job]) -> bool:
    async for _ in merged(jobs):
        pass
    return True


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run ``work``; if the client disconnects first, cancel it (aborting its requests) and return None."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None


async def sse_stream(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Frame events as SSE; a failure after the 200 header becomes an error event, then [DONE]."""
    try:
        async for payload in events:
            yield sse(payload)
    except GraphserveError as exc:
        yield sse_error_event(exc)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the stream has started; the status line cannot change now
        yield sse_error_event(InternalError(f"internal error: {type(exc).__name__}: {exc}"))
    yield DONE


@dataclass
class DeltaTracker:
    """Turns cumulative CompletionOutputs into what is new since the last chunk, per choice."""

    text_len: dict[int, int] = field(default_factory=dict)
    token_len: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    def delta(self, o: CompletionOutput) -> tuple[str, int, bool] | None:
        """(new text, index of the first new token, just finished) or None when nothing changed."""
        t0, k0 = self.text_len.get(o.index, 0), self.token_len.get(o.index, 0)
        just_finished = o.finish_reason is not None and o.index not in self.finished
        if len(o.text) == t0 and len(o.token_ids) == k0 and not just_finished:
            return None
        self.text_len[o.index], self.token_len[o.index] = len(o.text), len(o.token_ids)
        if just_finished:
            self.finished.add(o.index)
        return o.text[t0:], k0, just_finished


def usage(jobs: list[Job]) -> dict[str, Any]:
    prompt = sum(j.stream.num_prompt_tokens for j in jobs)
    completion = sum(len(o.token_ids) for j in jobs if j.last for o in j.last.outputs)
    cached = sum(j.last.metrics.num_cached_tokens for j in jobs if j.last and j.last.metrics)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
