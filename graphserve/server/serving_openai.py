"""/v1/completions and /v1/chat/completions: requests in, OpenAI-shaped responses and SSE chunks out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from graphserve.engine.output_processor import ChoiceDelta
from graphserve.outputs import TokenLogprob
from graphserve.server.errors import SSE_HEADERS, recorded_events
from graphserve.server.prompts import chat_engine_prompt, engine_prompts, token_table
from graphserve.server.protocol import ChatCompletionRequest, CompletionRequest
from graphserve.server.state import ServerState
from graphserve.server.streams import (
    CLIENT_CLOSED,
    ChunkFrame,
    Job,
    collect,
    merged,
    new_choice_pieces,
    new_id,
    sse_stream,
    start_jobs,
    until_disconnect,
    usage,
)
from graphserve.structured.tool_calls import chat_message


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


async def create_completion(req: CompletionRequest, request: Request, state: ServerState) -> Response:
    state.check_model(req.model)
    params = await state.grammar.run(request, req.to_sampling_params)
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
        for o in job.outputs():
            lps = (_completion_logprobs(state, o.logprobs, 0)
                   if o.logprobs is not None and req.logprobs is not None else None)
            choices.append({"index": job.index * n + o.index, "text": o.text, "logprobs": lps,
                            "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
    choices.sort(key=lambda c: c["index"])
    return JSONResponse({**head, "choices": choices, "usage": usage(jobs)})


async def _new_pieces(jobs: list[Job]) -> AsyncIterator[tuple[Job, ChoiceDelta, int]]:
    """(job, choice delta, text offset of the delta) for every choice that has something to send."""
    async for job, d in merged(jobs):
        for c in new_choice_pieces(d):
            so = job.choices[c.index]
            yield job, c, so.text_len - len(c.text)


async def _completion_chunks(
    state: ServerState, jobs: list[Job], head: dict[str, Any], n: int, include_usage: bool
) -> AsyncIterator[bytes]:
    frame = ChunkFrame(head)
    async for job, c, offset in _new_pieces(jobs):
        index = job.index * n + c.index
        if c.logprobs is None and c.finish_reason is None:
            yield frame.text_choice(index, c.text, chat=False)
            continue
        yield frame.choice({
            "index": index, "text": c.text,
            "logprobs": _completion_logprobs(state, c.logprobs, offset) if c.logprobs is not None else None,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
        })
    if include_usage:
        yield frame.tail({"usage": usage(jobs)})


async def create_chat_completion(req: ChatCompletionRequest, request: Request, state: ServerState) -> Response:
    state.check_model(req.model)
    params, tools = await state.grammar.run(request, lambda: (req.to_sampling_params(), req.tool_choice_mode()))
    prompt = await chat_engine_prompt(state, req.template_messages(), req.add_generation_prompt, req.tools)
    rid = new_id("chatcmpl")
    with_tools = tools is not None and tools.mode != "none"
    # A stream with tools gets its tool-call pieces from the output processor; a whole response parses its text.
    jobs = start_jobs(state.engine, state.metrics, rid, [prompt], params, tools if req.stream else None)
    head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunk_head = {**head, "object": "chat.completion.chunk"}
        chunks = (_tool_chat_chunks(state, jobs, chunk_head, include_usage) if with_tools
                  else _chat_chunks(state, jobs, chunk_head, include_usage))
        return StreamingResponse(sse_stream(recorded_events(request, chunks)), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    if not await until_disconnect(request, collect(jobs)):
        return Response(status_code=CLIENT_CLOSED)
    job = jobs[0]
    choices = []
    for o in job.outputs():
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
) -> AsyncIterator[bytes]:
    # The role rides on each choice's first chunk, with its first content: a role-only chunk sent before the
    # engine produced anything would make clients that time TTFT from the first chunk read it too short.
    frame = ChunkFrame(head)
    started: set[int] = set()
    async for _, c, _ in _new_pieces(jobs):
        if c.index in started and c.logprobs is None and c.finish_reason is None:
            yield frame.text_choice(c.index, c.text, chat=True)
            continue
        yield frame.choice(_chat_choice(state, c, first=c.index not in started))
        started.add(c.index)
    if include_usage:
        yield frame.tail({"usage": usage(jobs)})


def _chat_choice(state: ServerState, c: ChoiceDelta, first: bool) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant", "content": c.text} if first else (
        {"content": c.text} if c.text else {})
    return {
        "index": c.index, "delta": delta,
        "logprobs": _chat_logprobs(state, c.logprobs) if c.logprobs is not None else None,
        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
    }


async def _tool_chat_chunks(
    state: ServerState, jobs: list[Job], head: dict[str, Any], include_usage: bool
) -> AsyncIterator[bytes]:
    """A stream with tools: the output processor turned each choice's text into message pieces (content or
    tool-call deltas, ChoiceDelta.tool_deltas); each piece is one chunk. The role rides on a choice's first
    chunk, a delta's logprobs on its first piece, the finish on its last; text held back (it may open a call)
    sends nothing yet."""
    frame = ChunkFrame(head)
    started: set[int] = set()
    async for _, c, _ in _new_pieces(jobs):
        pieces = c.tool_deltas or ([{}] if c.finish_reason is not None else [])
        for k, piece in enumerate(pieces):
            if c.index not in started:
                started.add(c.index)
                piece = {"role": "assistant", **piece}
            last = c.finish_reason is not None and k == len(pieces) - 1
            yield frame.choice({
                "index": c.index, "delta": piece,
                "logprobs": _chat_logprobs(state, c.logprobs) if k == 0 and c.logprobs is not None else None,
                "finish_reason": c.tool_finish_reason if last else None,
                "stop_reason": c.stop_reason if last else None,
            })
    if include_usage:
        yield frame.tail({"usage": usage(jobs)})
