"""/v1/completions and /v1/chat/completions: requests in, OpenAI-shaped responses and SSE chunks out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from graphserve.outputs import CompletionOutput, TokenLogprob
from graphserve.server.errors import SSE_HEADERS, recorded_events
from graphserve.server.prompts import chat_engine_prompt, engine_prompts, token_table
from graphserve.server.protocol import ChatCompletionRequest, CompletionRequest
from graphserve.server.state import ServerState
from graphserve.server.streams import (
    CLIENT_CLOSED,
    DeltaTracker,
    Job,
    collect,
    merged,
    new_id,
    sse_stream,
    start_jobs,
    until_disconnect,
    usage,
)
from graphserve.structured.tool_calls import chat_message
from graphserve.structured.tool_stream import tool_call_chunks


def _completion_logprobs(state: ServerState, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    tokens = [state.token_text(lp.token_id) for lp in lps]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{state.token_text(t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def _chat_logprobs(state: ServerState, lps: list[TokenLogprob]) -> dict[str, Any]:
    table = token_table(state)

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": state.token_text(token_id), "logprob": logprob,
                "bytes": list(table.token_bytes(token_id))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}


def _new_logprobs(o: CompletionOutput, first_new: int) -> list[TokenLogprob] | None:
    return None if o.logprobs is None else o.logprobs[first_new:]


async def create_completion(req: CompletionRequest, request: Request, state: ServerState) -> Response:
    state.check_model(req.model)
    params = req.to_sampling_params()
    prompts = await engine_prompts(state, "prompt", req.prompts())
    rid = new_id("cmpl")
    jobs = start_jobs(state.engine, state.metrics, rid, prompts, params)
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name}
    n = params.n
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = _completion_chunks(state, jobs, head, n, include_usage)
        return StreamingResponse(sse_stream(recorded_events(request, chunks)), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    if not await until_disconnect(request, collect(jobs)):
        return Response(status_code=CLIENT_CLOSED)
    choices = []
    for job in jobs:
        for o in job.last.outputs if job.last else []:
            lps = (_completion_logprobs(state, o.logprobs, 0)
                   if o.logprobs is not None and req.logprobs is not None else None)
            choices.append({"index": job.index * n + o.index, "text": o.text, "logprobs": lps,
                            "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
    choices.sort(key=lambda c: c["index"])
    return JSONResponse({**head, "choices": choices, "usage": usage(jobs)})


async def _new_pieces(
    jobs: list[Job],
) -> AsyncIterator[tuple[Job, CompletionOutput, str, list[TokenLogprob] | None, bool]]:
    """(job, choice, new text, new logprobs, just finished) for every choice that has something to send."""
    trackers = {job.index: DeltaTracker() for job in jobs}
    async for job, out in merged(jobs):
        for o in out.outputs:
            d = trackers[job.index].delta(o)
            if d is None:
                continue
            text, first_new, finished = d
            new_lps = _new_logprobs(o, first_new)
            if not text and not finished and not new_lps:
                continue  # tokens whose text is held back (partial character, possible stop string)
            yield job, o, text, new_lps, finished


async def _completion_chunks(
    state: ServerState, jobs: list[Job], head: dict[str, Any], n: int, include_usage: bool
) -> AsyncIterator[dict[str, Any]]:
    async for job, o, text, new_lps, finished in _new_pieces(jobs):
        offset = len(o.text) - len(text)
        yield {**head, "choices": [{
            "index": job.index * n + o.index, "text": text,
            "logprobs": _completion_logprobs(state, new_lps, offset) if new_lps is not None else None,
            "finish_reason": o.finish_reason if finished else None,
            "stop_reason": o.stop_reason if finished else None,
        }]}
    if include_usage:
        yield {**head, "choices": [], "usage": usage(jobs)}


async def create_chat_completion(req: ChatCompletionRequest, request: Request, state: ServerState) -> Response:
    state.check_model(req.model)
    params = req.to_sampling_params()
    tools = req.tool_choice_mode()
    prompt = await chat_engine_prompt(state, req.template_messages(), req.add_generation_prompt, req.tools)
    rid = new_id("chatcmpl")
    jobs = start_jobs(state.engine, state.metrics, rid, [prompt], params)
    head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunk_head = {**head, "object": "chat.completion.chunk"}
        chunks = tool_call_chunks(_chat_chunks(state, jobs, chunk_head, include_usage), tools)
        return StreamingResponse(sse_stream(recorded_events(request, chunks)), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    if not await until_disconnect(request, collect(jobs)):
        return Response(status_code=CLIENT_CLOSED)
    job = jobs[0]
    choices = []
    for o in job.last.outputs if job.last else []:
        message, finish_reason = chat_message(o.text, o.finish_reason, tools)  # tool calls parsed out
        choices.append({
            "index": o.index, "message": message,
            "logprobs": _chat_logprobs(state, o.logprobs) if o.logprobs is not None else None,
            "finish_reason": finish_reason, "stop_reason": o.stop_reason,
        })
    choices.sort(key=lambda c: c["index"])
    return JSONResponse({**head, "choices": choices, "usage": usage(jobs)})


async def _chat_chunks(
    state: ServerState, jobs: list[Job], head: dict[str, Any], include_usage: bool
) -> AsyncIterator[dict[str, Any]]:
    # The role rides on each choice's first chunk, with its first content: a role-only chunk sent before the
    # engine produced anything would make clients that time TTFT from the first chunk read it too short.
    started: set[int] = set()
    async for _, o, text, new_lps, finished in _new_pieces(jobs):
        delta: dict[str, Any] = {"content": text} if text else {}
        if o.index not in started:
            started.add(o.index)
            delta = {"role": "assistant", "content": text}
        yield {**head, "choices": [{
            "index": o.index, "delta": delta,
            "logprobs": _chat_logprobs(state, new_lps) if new_lps is not None else None,
            "finish_reason": o.finish_reason if finished else None,
            "stop_reason": o.stop_reason if finished else None,
        }]}
    if include_usage:
        yield {**head, "choices": [], "usage": usage(jobs)}
