"""Plumbing shared by the endpoints: starting a request per prompt, merging their streams, watching for a
client that went away, and SSE framing.

Streams carry deltas (request_stream.py): an event is built from what is new, never by diffing cumulative
copies. Events are bytes built from pre-encoded fragments, with orjson for the variable parts when it is
installed (several times faster than json.dumps for the small dicts of a chunk).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from graphserve.engine.output_processor import ChoiceDelta, RequestDelta
from graphserve.errors import BadRequestError, GraphserveError, InternalError
from graphserve.outputs import CompletionOutput, TokenLogprob
from graphserve.sampling_params import SamplingParams
from graphserve.server.errors import sse_error_event
from graphserve.server.frontend import Frontend
from graphserve.server.metrics import RequestTimer, ServerMetrics
from graphserve.server.request_stream import RequestStream
from graphserve.structured.tool_calls import ToolChoice

try:
    import orjson

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # optional: the standard encoder gives the same JSON, slower
    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
DISCONNECT_POLL_S = 0.25
# Status for a client that left before its response: nobody reads it, but access logs show why.
CLIENT_CLOSED = 499


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ChoiceSoFar:
    """One choice's output accumulated from its deltas (text as pieces: joined once, at the end)."""

    pieces: list[str] = field(default_factory=list)
    text_len: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class Job:
    """One prompt's request: its stream, latency timer and its output so far."""

    index: int
    stream: RequestStream
    timer: RequestTimer
    choices: dict[int, ChoiceSoFar] = field(default_factory=dict)
    num_cached_tokens: int = 0
    finished: bool = False

    def apply(self, d: RequestDelta) -> None:
        self.timer.observe(d)
        if d.num_cached_tokens is not None:
            self.num_cached_tokens = d.num_cached_tokens
        for i, c in d.choices.items():
            so = self.choices.get(i)
            if so is None:
                so = self.choices[i] = ChoiceSoFar()
            if c.text:
                so.pieces.append(c.text)
                so.text_len += len(c.text)
            so.token_ids += c.token_ids
            if c.logprobs is not None:
                if so.logprobs is None:
                    so.logprobs = list(c.logprobs)
                else:
                    so.logprobs.extend(c.logprobs)
            if c.finish_reason is not None:
                so.finish_reason, so.stop_reason = c.finish_reason, c.stop_reason
        self.finished = self.finished or d.finished

    def outputs(self) -> list[CompletionOutput]:
        """The final outputs, by choice index."""
        return [CompletionOutput(i, "".join(c.pieces), c.token_ids, c.finish_reason, c.stop_reason, c.logprobs)
                for i, c in sorted(self.choices.items())]


def start_jobs(
    engine: Frontend, metrics: ServerMetrics, base_id: str, prompts: list[Any], params: SamplingParams,
    tools: ToolChoice | None = None,
) -> list[Job]:
    """Add one request per prompt; if any is refused, abort the ones already added and re-raise. ``tools``: a
    chat stream with tools (its deltas carry tool-call pieces)."""
    limit = engine.config.max_queued_requests
    if len(prompts) * params.n > limit:  # they enter the waiting queue together: past its bound, never admitted
        if params.n > 1 and len(prompts) > 1:
            raise BadRequestError(f"n={params.n} is invalid: {len(prompts)} prompts x n={params.n} = "
                                  f"{len(prompts) * params.n} sequences, above --max-queued-requests={limit}",
                                  param="n")
        if len(prompts) > 1:
            raise BadRequestError(f"prompt holds {len(prompts)} prompts, above --max-queued-requests={limit}; "
                                  "send them in smaller batches", param="prompt")
    jobs: list[Job] = []
    arrival = time.monotonic()
    try:
        for i, prompt in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            stream = engine.add_request(rid, prompt, params, arrival, tools=tools)
            jobs.append(Job(i, stream, RequestTimer(metrics, arrival)))
    except BaseException:
        for job in jobs:
            engine.abort(job.stream.engine_id)
        raise
    metrics.api_server_requests.inc()
    return jobs


async def merged(jobs: list[Job]) -> AsyncIterator[tuple[Job, RequestDelta]]:
    """Deltas of all jobs as they arrive. Leaving early cancels the pumps, which aborts the requests."""
    if len(jobs) == 1:
        job = jobs[0]
        async for d in job.stream:
            job.apply(d)
            yield job, d
        return
    # Bounded: a consumer that stops reading stops the pumps, so output waits (merging) in the streams,
    # where the stall watchdog sees it.
    queue: asyncio.Queue[tuple[Job, RequestDelta | BaseException | None]] = asyncio.Queue(maxsize=len(jobs))

    async def pump(job: Job) -> None:
        try:
            async for d in job.stream:
                await queue.put((job, d))
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
            job.apply(item)
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


async def sse_stream(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Frame events as SSE; a failure after the 200 header becomes an error event, then [DONE]."""
    try:
        async for event in events:
            yield event
    except GraphserveError as exc:
        yield sse_error_event(exc).encode()
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the stream has started; the status line cannot change now
        yield sse_error_event(InternalError(f"internal error: {type(exc).__name__}: {exc}")).encode()
    yield DONE


def sse(payload: Any) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


class ChunkFrame:
    """SSE events of one response: the constant head (id, object, created, model) is encoded once."""

    def __init__(self, head: dict[str, Any]):
        self._prefix = b"data: " + dumps(head)[:-1] + b',"choices":['
        self._suffix = b"]}\n\n"

    def choice(self, choice: dict[str, Any]) -> bytes:
        return self._prefix + dumps(choice) + self._suffix

    def text_choice(self, index: int, text: str, chat: bool) -> bytes:
        """The hot path: new text for one choice, nothing else (no logprobs, not finished)."""
        if chat:
            body = (b'{"index":', str(index).encode(), b',"delta":{"content":', dumps(text),
                    b'},"logprobs":null,"finish_reason":null,"stop_reason":null}')
        else:
            body = (b'{"index":', str(index).encode(), b',"text":', dumps(text),
                    b',"logprobs":null,"finish_reason":null,"stop_reason":null}')
        return b"".join((self._prefix, *body, self._suffix))

    def tail(self, extra: dict[str, Any]) -> bytes:
        """An event with no choices (the usage chunk): the head plus ``extra``."""
        return self._prefix + b"]," + dumps(extra)[1:] + b"\n\n"


def usage(jobs: list[Job]) -> dict[str, Any]:
    prompt = sum(j.stream.num_prompt_tokens for j in jobs)
    completion = sum(len(c.token_ids) for j in jobs for c in j.choices.values())
    cached = sum(j.num_cached_tokens for j in jobs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def new_choice_pieces(d: RequestDelta) -> list[ChoiceDelta]:
    """The choices of a delta that have something to send, by index."""
    return [c for _, c in sorted(d.choices.items())
            if c.text or c.finish_reason is not None or c.logprobs or c.tool_deltas]
