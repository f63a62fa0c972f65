"""SGLang's native /generate: ``text`` or ``input_ids`` plus ``sampling_params``; cumulative text chunks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from graphserve.outputs import CompletionOutput, RequestOutput
from graphserve.server.errors import SSE_HEADERS
from graphserve.server.protocol import GenerateRequest
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
)


def _finish_reason(o: CompletionOutput) -> dict[str, Any] | None:
    if o.finish_reason is None:
        return None
    if o.finish_reason == "stop":
        return {"type": "stop", "matched": o.stop_reason}
    if o.finish_reason == "length":
        return {"type": "length", "length": len(o.token_ids)}
    return {"type": o.finish_reason, "message": "request aborted"}


def _item(rid: str, out: RequestOutput, o: CompletionOutput, arrival: float, batched: bool, n: int,
          index: int) -> dict[str, Any]:
    meta = {
        "id": rid if n == 1 else f"{rid}-{o.index}",
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(o.token_ids),
        "cached_tokens": out.metrics.num_cached_tokens if out.metrics else 0,
        "finish_reason": _finish_reason(o),
        "e2e_latency": time.monotonic() - arrival,
    }
    item: dict[str, Any] = {"text": o.text, "output_ids": list(o.token_ids), "meta_info": meta}
    if batched or n > 1:
        item["index"] = index * n + o.index
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
    items = [_item(j.stream.request_id, j.last, o, j.timer.arrival, batched, n, j.index)
             for j in jobs if j.last for o in j.last.outputs]
    if not batched and n == 1:
        return JSONResponse(items[0])
    return JSONResponse(sorted(items, key=lambda it: it["index"]))


async def _chunks(jobs: list[Job], batched: bool, n: int) -> AsyncIterator[dict[str, Any]]:
    trackers = {job.index: DeltaTracker() for job in jobs}
    async for job, out in merged(jobs):
        for o in out.outputs:
            if trackers[job.index].delta(o) is not None:
                yield _item(job.stream.request_id, out, o, job.timer.arrival, batched, n, job.index)
