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

from graphserve.outputs import TokenLogprob
from graphserve.server.errors import SSE_HEADERS, recorded_events
from graphserve.server.prompts import engine_prompts
from graphserve.server.protocol_native import GenerateRequest
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


def _finish_reason(o: ChoiceSoFar, prefill_only: bool) -> dict[str, Any] | None:
    if o.finish_reason is None:
        return None
    if prefill_only:
        return {"type": "length", "length": 0}
    if o.finish_reason == "stop":
        return {"type": "stop", "matched": o.stop_reason}
    if o.finish_reason == "length":
        return {"type": "length", "length": len(o.token_ids)}
    return {"type": o.finish_reason, "message": "request aborted"}


class _Renderer:
    """One response item per choice, in SGLang's shape (meta_info, logprobs as [logprob, id, text])."""

    def __init__(self, req: GenerateRequest, state: ServerState, batched: bool, n: int):
        self.req = req
        self.state = state
        self.batched = batched
        self.n = n

    def _entry(self, token_id: int, logprob: float) -> list[Any]:
        text = self.state.token_text(token_id) if self.req.return_text_in_logprobs else None
        return [logprob, token_id, text]

    def _logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        return {
            "input_token_logprobs": [], "input_top_logprobs": [],
            "output_token_logprobs": [self._entry(lp.token_id, lp.logprob) for lp in lps],
            "output_top_logprobs": [[self._entry(t, v) for t, v in lp.top] for lp in lps],
        }

    def item(self, job: Job, i: int) -> dict[str, Any]:
        o = job.choices.get(i) or ChoiceSoFar()
        prefill_only = self.req.prefill_only
        if prefill_only:  # the one token the engine sampled to end the prefill is not part of the answer
            text, ids = "", []
        else:
            text = "".join(o.pieces)
            o.pieces[:] = [text]  # joined once: the next event appends to one piece
            ids = list(o.token_ids)
        rid = job.stream.request_id
        meta: dict[str, Any] = {
            "id": rid if self.n == 1 else f"{rid}-{i}",
            "prompt_tokens": job.stream.num_prompt_tokens,
            "completion_tokens": len(ids),
            "cached_tokens": job.num_cached_tokens,
            "finish_reason": _finish_reason(o, prefill_only),
            "e2e_latency": time.monotonic() - job.timer.arrival,
        }
        if self.req.return_logprob:
            meta.update(self._logprobs([] if prefill_only else (o.logprobs or [])))
        item: dict[str, Any] = {"text": text, "output_ids": ids, "meta_info": meta}
        if self.batched or self.n > 1:
            item["index"] = job.index * self.n + i
        return item


async def generate(req: GenerateRequest, request: Request, state: ServerState) -> Response:
    params = await state.grammar.run(request, req.to_sampling_params)
    prompts, batched = req.prompts()
    prompts = await engine_prompts(state, "text" if req.text is not None else "input_ids", prompts)
    req.check_logprob_start([len(p["prompt_token_ids"]) if isinstance(p, dict) else len(p) for p in prompts])
    rid = req.rid or new_id("gen")
    jobs = start_jobs(state.engine, state.metrics, rid, prompts, params)
    render = _Renderer(req, state, batched, params.n)
    if req.stream:
        return StreamingResponse(sse_stream(recorded_events(request, _chunks(jobs, render))),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    if not await until_disconnect(request, collect(jobs)):
        return Response(status_code=CLIENT_CLOSED)
    items = [render.item(j, i) for j in jobs for i in range(params.n)]
    if not batched and params.n == 1:
        return JSONResponse(items[0])
    return JSONResponse(sorted(items, key=lambda it: it["index"]))


async def _chunks(jobs: list[Job], render: _Renderer) -> AsyncIterator[bytes]:
    prefill_only = render.req.prefill_only
    async for job, d in merged(jobs):
        for c in new_choice_pieces(d):
            if c.finish_reason is not None or not prefill_only:
                yield sse(render.item(job, c.index))
