"""HTTP error mapping: every failure leaves the server as an OpenAI error body.

The status of each error class lives on the class itself (``graphserve.errors``); this module is the one
place that turns an exception into a response, so no handler builds error JSON by hand.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from graphserve.errors import (
    BadRequestError,
    GraphserveError,
    InternalError,
    NotFoundError,
    OverloadedError,
    ServiceUnavailableError,
)

logger = logging.getLogger("graphserve.server")
T = TypeVar("T")


class ClientDisconnectedError(GraphserveError):
    """The client closed the connection before its request was read: its doing, not the server's (nginx's 499).
    Counted and logged in one line like any 4xx; nobody is left to receive the response."""

    http_status = 499
    error_type = "client_disconnected"


def retry_after_header(exc: GraphserveError) -> dict[str, str]:
    seconds = getattr(exc, "retry_after", None)
    if seconds is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def error_response(exc: GraphserveError) -> JSONResponse:
    headers = retry_after_header(exc)
    if getattr(exc, "close_connection", False):  # the rest of the body was never read: the connection is unusable
        headers["Connection"] = "close"
    return JSONResponse(exc.to_openai(), status_code=exc.http_status, headers=headers)


def request_id_of(request: Request | None) -> str:
    if request is None:
        return "-"
    return getattr(request.state, "request_id", None) or "-"


def record_error(metrics: Any, exc: GraphserveError, request_id: str, path: str) -> None:
    """Count a 4xx/5xx and log one line for it: status, reason, field, request id and route, never the prompt."""
    metrics.request_errors.labels(code=str(exc.http_status), reason=exc.error_type).inc()
    level = logging.ERROR if exc.http_status >= 500 else logging.INFO
    logger.log(level, "request error: status=%d reason=%s field=%s request_id=%s path=%s", exc.http_status,
               exc.error_type, exc.param or "-", request_id, path)


async def recorded_events(request: Request, events: AsyncIterator[T]) -> AsyncIterator[T]:
    """``events`` with a failure after the 200 header (sent as an error event) counted and logged too."""
    try:
        async for event in events:
            yield event
    except GraphserveError as exc:
        record_error(request.app.state.graphserve.metrics, exc, request_id_of(request), request.url.path)
        raise
    except Exception as exc:  # noqa: BLE001 - counted as the 500 the stream reports, then re-raised
        internal = InternalError(f"internal error: {type(exc).__name__}: {exc}")
        record_error(request.app.state.graphserve.metrics, internal, request_id_of(request), request.url.path)
        raise


def as_sent(exc: GraphserveError, names: dict[str, str] | None) -> GraphserveError:
    """``exc`` naming its field as the client sent it: the engine checks max_tokens, the client may have sent
    max_completion_tokens (``names``: engine field -> the request's name for it)."""
    if not names or exc.param not in names:
        return exc
    sent = names[exc.param]
    exc.message = re.sub(rf"(?<![\w.]){re.escape(exc.param)}(?!\w)", sent, exc.message)
    exc.param = sent
    return exc


def recorded_response(request: Request, exc: GraphserveError) -> JSONResponse:
    record_error(request.app.state.graphserve.metrics, exc, request_id_of(request), request.url.path)
    return error_response(exc)


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_error_event(exc: GraphserveError) -> str:
    """The error as one SSE event; a stream that fails after its 200 header can only say it this way."""
    return sse(exc.to_openai())


def _field_path(loc: tuple[Any, ...]) -> str:
    # ("body", "messages", 0, "content") -> "messages[0].content"; the leading "body" says nothing to a client.
    parts = [p for p in loc if p not in ("body", "query", "path")]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def validation_error(exc: RequestValidationError) -> BadRequestError:
    """Pydantic/JSON errors become a 400 naming the first offending field (FastAPI would answer 422)."""
    errors = exc.errors()
    if not errors:
        return BadRequestError("request body is invalid")
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return BadRequestError(f"request body is not valid JSON: {ctx.get('error', first.get('msg'))}", param="body")
    field = _field_path(tuple(first.get("loc", ()))) or "body"
    if field == "body" and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return BadRequestError("request body must be a JSON object (send Content-Type: application/json)",
                               param="body")
    if first.get("type") in ("lone_surrogate", "image_unsupported", "part_unsupported", "too_long"):
        return BadRequestError(f"{field} {first.get('msg')}", param=field)  # the message says it all; no value dump
    if first.get("type") == "missing":
        return BadRequestError(f"{field} is required", param=field)
    value = first.get("input")
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return BadRequestError(f"{field}={shown} is invalid: {first.get('msg')}{more}", param=field)


def _from_http_exception(exc: StarletteHTTPException) -> GraphserveError:
    if exc.status_code == 404:
        return NotFoundError(f"no such route: {exc.detail}")
    if exc.status_code == 503:
        return ServiceUnavailableError(str(exc.detail))
    if exc.status_code == 429:
        return OverloadedError(str(exc.detail))
    if 400 <= exc.status_code < 500:
        err = BadRequestError(str(exc.detail))
        err.http_status = exc.status_code  # e.g. 405 method not allowed keeps its own status
        return err
    return InternalError(str(exc.detail))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GraphserveError)
    async def _graphserve(request: Request, exc: GraphserveError) -> JSONResponse:
        return recorded_response(request, as_sent(exc, getattr(request.state, "field_names", None)))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return recorded_response(request, validation_error(exc))

    @app.exception_handler(ClientDisconnect)
    async def _disconnected(request: Request, exc: ClientDisconnect) -> JSONResponse:
        return recorded_response(request, ClientDisconnectedError(
            "the client closed the connection before the request body was read", param="body"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return recorded_response(request, _from_http_exception(exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return recorded_response(request, InternalError(f"internal error: {type(exc).__name__}: {exc}"))
