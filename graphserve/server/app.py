"""The FastAPI application: routes only; the work lives in serving_openai / serving_native.

Request bodies are parsed by ``prompts.parse_body`` rather than by FastAPI (see there why); /openapi.json
still shows each body's schema, declared below.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Query, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from graphserve.errors import NotFoundError, ServiceUnavailableError
from graphserve.sampling_params import SamplingParams
from graphserve.server import serving_native, serving_openai
from graphserve.server.cache_events import HASH_PROBE, MAX_WAIT_S
from graphserve.server.errors import error_response, install_error_handlers
from graphserve.server.grammar_work import GrammarWork
from graphserve.server.guards import GuardMiddleware, GuardOptions
from graphserve.server.model_info import model_cards, model_info, server_info, tokenizer_path
from graphserve.server.prompts import IGNORED_FIELDS_HEADER, parse_body
from graphserve.server.protocol import ChatCompletionRequest, CompletionRequest
from graphserve.server.protocol_native import GenerateRequest
from graphserve.server.state import ServerState
from graphserve.server.streams import collect, new_id, start_jobs

TELEMETRY_PAGE = 1000  # records per /v1/telemetry call: serializing the whole 10k ring held the loop ~0.5 s
HEALTH_GENERATE_TIMEOUT_S = 30.0
KV_EVENTS_OFF = ("GET /v1/cache_events is off: this server was started without --kv-events, so its engine records "
                 "no prefix-cache events (start `graphserve serve` with --kv-events to serve them to a router)")


def _body(model: type[BaseModel]) -> dict[str, Any]:
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in models],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _save_tokenizer(state: ServerState) -> None:
    """Once the engine is up, put a dummy: model's tokenizer where its served name (the folder) points."""
    while not state.engine.ready.is_set():
        await asyncio.sleep(0.1)
    if state.engine.load_error is None and state.engine.config.model.startswith("dummy:"):
        await asyncio.to_thread(tokenizer_path, state)


def _with_ignored(request: Request, response: Response) -> Response:
    ignored = getattr(request.state, "ignored_fields", None)
    if ignored:
        # a header value is visible ASCII and may not start or end with white space, and any JSON key may arrive
        # (control characters, spaces, the empty name): each name is percent-encoded, the empty one shown as ""
        shown = [quote(name[:64], safe="") or '""' for name in ignored[:32]]
        response.headers[IGNORED_FIELDS_HEADER] = ", ".join(shown)
    return response


def create_app(state: ServerState, guards: GuardOptions | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start(asyncio.get_running_loop())
        saver = asyncio.ensure_future(_save_tokenizer(state))
        try:
            yield
        finally:
            saver.cancel()
            state.grammar.close()
            state.engine.shutdown()

    app = FastAPI(title="graphserve", summary="OpenAI-compatible and SGLang-native LLM serving",
                  lifespan=lifespan)
    app.state.graphserve = state
    guards = guards or GuardOptions()
    state.grammar = GrammarWork(guards.max_schema_depth, guards.max_schema_chars, guards.max_grammar_builds_per_client)
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, options=guards, metrics=state.metrics)
    _install_openapi(app, [CompletionRequest, ChatCompletionRequest, GenerateRequest])

    @app.post("/v1/completions", openapi_extra=_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest, state, openai_route=True)
        state.check_ready()
        return _with_ignored(request, await serving_openai.create_completion(req, request, state))

    @app.post("/v1/chat/completions", openapi_extra=_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest, state, openai_route=True)
        request.state.field_names = req.field_names()
        state.check_ready()
        return _with_ignored(request, await serving_openai.create_chat_completion(req, request, state))

    @app.post("/generate", openapi_extra=_body(GenerateRequest))
    async def generate(request: Request) -> Response:
        req = await parse_body(request, GenerateRequest, state)
        request.state.field_names = req.field_names()
        state.check_ready()
        return await serving_native.generate(req, request, state)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": model_cards(state)})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        for card in model_cards(state):
            if card["id"] == model_id:
                return JSONResponse(card)
        raise NotFoundError(f"model={model_id!r} is not served here: this server serves "
                            f"{sorted(state.accepted_names)}", param="model", code="model_not_found")

    @app.get("/get_model_info")
    async def get_model_info() -> JSONResponse:
        state.check_ready()
        return JSONResponse(await asyncio.to_thread(model_info, state))  # may write a dummy's tokenizer

    @app.get("/get_server_info")
    async def get_server_info() -> JSONResponse:
        state.check_ready()
        return JSONResponse(await asyncio.to_thread(server_info, state))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> JSONResponse:
        """Drop the prefix cache (SGLang's route; benchmarks call it between runs so none reuses another's)."""
        state.check_ready()
        state.engine.flush_prefix_cache()
        return JSONResponse({"status": "ok", "message": "prefix cache flushed before the engine's next step"})

    @app.get("/health")
    async def health() -> Response:
        try:
            state.check_ready()
        except ServiceUnavailableError as exc:  # the body says why: loading or draining
            return error_response(exc)
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Healthy only if the engine completes a one-token generation now (SGLang's deep health check)."""
        state.check_ready()
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        jobs = start_jobs(state.engine, state.metrics, new_id("health"), [[0]], params)
        try:
            await asyncio.wait_for(collect(jobs), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ServiceUnavailableError(f"the engine did not generate one token within "
                                          f"{HEALTH_GENERATE_TIMEOUT_S:g} s", retry_after=5) from None
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    if state.profile_endpoint:  # off by default: a profile slows the steps it measures
        @app.post("/v1/profile")
        async def profile(steps: int = Query(20, description="decode steps to profile per phase"),
                          timeout: float = Query(120.0, description="seconds to wait for them")) -> JSONResponse:
            state.check_ready()
            return JSONResponse(await state.engine.profiles.profile(steps, timeout))

    add_cache_event_route(app, state)

    @app.get("/v1/telemetry")
    async def telemetry(
        since: int = Query(-1, description="return records with step > since"),
        limit: int = Query(TELEMETRY_PAGE, ge=1, le=TELEMETRY_PAGE, description="at most this many records"),
        replica: int | None = Query(None, ge=0, description="with --dp: this replica's records (default: the "
                                    "first serving one's; each replica numbers its own steps)"),
    ) -> JSONResponse:
        """Step records oldest first, a page at a time: call again with ``since=next_since`` while ``more``."""
        state.check_ready()
        core = state.engine.core
        if replica is not None:
            replicas = getattr(state.engine, "replicas", [state.engine])
            if replica >= len(replicas) or replicas[replica].core is None:
                raise NotFoundError(f"replica={replica} is not served here: this server runs {len(replicas)} "
                                    "replica(s) (--dp)", param="replica")
            core = replicas[replica].core
        records = core.telemetry.records()
        start = bisect.bisect_right(records, since, key=lambda r: r.step)  # steps only grow
        page = records[start:start + limit]
        return JSONResponse({"records": [dataclasses.asdict(r) for r in page],
                             "next_since": page[-1].step if page else since,
                             "more": start + limit < len(records)})

    return app


def add_cache_event_route(app: FastAPI, state: ServerState) -> None:
    """``GET /v1/cache_events``: a router's long poll of the prefix cache's events (server/cache_events.py)."""

    @app.get("/v1/cache_events")
    async def cache_events(
        since: int = Query(-1, description="serial of the last event seen; -1 asks for a snapshot"),
        timeout: float = Query(10.0, ge=0.0, le=MAX_WAIT_S, description="seconds to wait for a new event"),
    ) -> JSONResponse:
        engine = state.engine
        if not engine.config.kv_events:  # answered while loading too: a router learns it at once
            raise NotFoundError(KV_EVENTS_OFF, param="kv_events", code="kv_events_disabled")
        state.check_ready()
        body = await engine.cache_events.wait(since, timeout)
        stats = engine.stats
        body.update({
            "epoch": engine.cache_events.epoch, "block_size": engine.config.block_size, "hash_probe": HASH_PROBE,
            "prefix_caching": engine.config.enable_prefix_caching, "num_inflight": engine.num_inflight,
            "num_running": int(getattr(stats, "running", 0)), "num_waiting": int(getattr(stats, "waiting", 0)),
        })
        return JSONResponse(body)
