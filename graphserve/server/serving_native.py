"""SGLang's native /generate: ``text`` or ``input_ids`` plus ``sampling_params``; cumulative text chunks.

SGLang's stream carries the whole text so far in every chunk; ours does too, joined from the pieces when
an event goes out (one join per event, not per token, since deltas merge while the client is behind).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from graphserve.server.errors import SSE_HEADERS
from graphserve.server.protocol import GenerateRequest
from graphserve.server.state import ServerState
from graphserve.server.streams import (
    CLIENT_CLOSED,
    ChoiceSoFar,
    Job,
    collect,
    merged,
    new_choice_pieces,
    new_id,
    sse,
    sse_stream,
    start_jobs,
    until_disconnect,
)


def _finish_reason(o: ChoiceSoFar) -> dict[str, Any] | None:
    if o.finish_reason is None:
        return None
    if o.finish_reason == "stop":
        return {"type": "stop", "matched": o.stop_reason}
    if o.finish_reason == "length":
        return {"type": "length", "length": len(o.token_ids)}
    return {"type": o.finish_reason, "message": "request aborted"}


def _item(rid: str, job: Job, i: int, batched: bool, n: int) -> dict[str, Any]:
    o = job.choices.get(i) or ChoiceSoFar()
    meta = {
        "id": rid if n == 1 else f"{rid}-{i}",
        "prompt_tokens": job.stream.num_prompt_tokens,
        "completion_tokens": len(o.token_ids),
        "cached_tokens": job.num_cached_tokens,
        "finish_reason": _finish_reason(o),
        "e2e_latency": time.monotonic() - job.timer.arrival,
    }
    text = "".join(o.pieces)
    o.pieces[:] = [text]  # joined once: the next event appends to one piece
    item: dict[str, Any] = {"text": text, "output_ids": list(o.token_ids), "meta_info": meta}
    if batched or n > 1:
        item["index"] = job.index * n + i
    return item


async def generate(req: GenerateRequest, request: Request, state: ServerState) -> Response:
    params = req.to_sampling_params()
    prompts, batched = req.prompts()
    rid = req.rid or new_id("gen")
    jobs = start_jobs(state.engine, state.metrics, rid, prompts, params)
    n = params.n
    if req.stream:
        return StreamingResponse(sse_stream(_chunks(jobs, batched, n)), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    if not await until_disconnect(request, collect(jobs)):
        return Response(status_code=CLIENT_CLOSED)
    items = [_item(j.stream.request_id, j, i, batched, n) for j in jobs for i in range(n)]
    if not batched and n == 1:
        return JSONResponse(items[0])
    return JSONResponse(sorted(items, key=lambda it: it["index"]))


async def _chunks(jobs: list[Job], batched: bool, n: int) -> AsyncIterator[bytes]:
    async for job, d in merged(jobs):
        for c in new_choice_pieces(d):
            yield sse(_item(job.stream.request_id, job, c.index, batched, n))
