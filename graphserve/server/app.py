"""The FastAPI application: routes only; the work lives in serving_openai / serving_native."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from graphserve.errors import ServiceUnavailableError
from graphserve.server import serving_native, serving_openai
from graphserve.server.errors import error_response, install_error_handlers
from graphserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from graphserve.server.state import ServerState


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            state.engine.shutdown()

    app = FastAPI(title="graphserve", summary="OpenAI-compatible and SGLang-native LLM serving",
                  lifespan=lifespan)
    app.state.graphserve = state
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        state.check_ready()
        return await serving_openai.create_completion(req, request, state)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        state.check_ready()
        return await serving_openai.create_chat_completion(req, request, state)

    @app.post("/generate")
    async def generate(req: GenerateRequest, request: Request) -> Response:
        state.check_ready()
        return await serving_native.generate(req, request, state)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": state.served_models()})

    @app.get("/health")
    async def health() -> Response:
        try:
            state.check_ready()
        except ServiceUnavailableError as exc:  # the body says why: loading or draining
            return error_response(exc)
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

    @app.get("/v1/telemetry")
    async def telemetry(since: int = Query(-1, description="return records with step > since")) -> JSONResponse:
        state.check_ready()
        records = state.engine.core.telemetry.records()
        return JSONResponse({"records": [dataclasses.asdict(r) for r in records if r.step > since]})

    return app
