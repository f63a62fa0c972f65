"""Guards at the edge of the HTTP server: API key, body size and read time, head size and connection count.

``GuardMiddleware`` (ASGI) gives every request an id, checks the API key, refuses a body above
``--max-request-body-mb`` with 413 and one that has not fully arrived within ``--request-read-timeout`` with
408. ``guarded_protocol`` wraps uvicorn's HTTP protocol for what happens before the app sees a request: a
head that has not arrived within the same timeout (a slowloris), a head over MAX_HEAD_BYTES (431), and a
connection past ``--max-connections`` (503). Every refusal is counted and logged like any other error.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from graphserve.errors import BadRequestError, GraphserveError, ServiceUnavailableError
from graphserve.server.errors import error_response, record_error
from graphserve.server.grammar_work import MAX_GRAMMAR_BUILDS_PER_CLIENT
from graphserve.structured.constraint import MAX_SCHEMA_DEPTH, MAX_SPEC_CHARS

MAX_HEAD_BYTES = 100 * 1024  # request line + headers; real clients send a few hundred bytes
OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers never carry the key


class AuthenticationError(GraphserveError):
    http_status = 401
    error_type = "authentication_error"


class RequestTooLargeError(BadRequestError):
    http_status = 413
    error_type = "request_too_large"
    close_connection = True


class RequestTimeoutError(BadRequestError):
    http_status = 408
    error_type = "request_timeout"
    close_connection = True


class HeadTooLargeError(BadRequestError):
    http_status = 431
    error_type = "request_header_fields_too_large"


@dataclass(frozen=True)
class GuardOptions:
    api_key: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    read_timeout_s: float = 30.0
    max_connections: int | None = None
    # With several front-end processes, a shared count (multiprocessing.Value) of the connections all of them
    # hold: --max-connections bounds the server, not each front-end.
    open_connections: Any = None
    # A request's grammar (graphserve/server/grammar_work.py): its bounds and the builds a client may run at once.
    max_schema_depth: int = MAX_SCHEMA_DEPTH
    max_schema_chars: int = MAX_SPEC_CHARS
    max_grammar_builds_per_client: int = MAX_GRAMMAR_BUILDS_PER_CLIENT


class GuardMiddleware:
    def __init__(self, app: Any, options: GuardOptions, metrics: Any):
        self.app = app
        self.options = options
        self.metrics = metrics
        self._key = options.api_key.encode() if options.api_key else None

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        path = scope.get("path", "")

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        refusal = self._refusal(path, headers)
        if refusal is not None:
            record_error(self.metrics, refusal, request_id, path)
            await error_response(refusal)(scope, receive, send_with_id)
            return
        await self.app(scope, self._guarded_receive(receive), send_with_id)

    def _refusal(self, path: str, headers: dict[bytes, bytes]) -> GraphserveError | None:
        if self._key is not None and path not in OPEN_PATHS:
            auth = headers.get(b"authorization", b"")
            given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            # compare_digest: the time taken does not tell an attacker how many leading bytes matched
            if not hmac.compare_digest(given, self._key):
                said = "invalid API key" if given else "missing API key"
                return AuthenticationError(f"{said}: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        length = headers.get(b"content-length")
        limit = self.options.max_body_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            return RequestTooLargeError(f"request body is {int(length)} bytes, more than the bound of {limit} "
                                        "bytes (raise it with --max-request-body-mb)", param="body")
        return None

    def _guarded_receive(self, receive: Callable[..., Any]) -> Callable[..., Any]:
        """``receive`` that fails a body arriving too slowly or growing past the bound (chunked bodies carry
        no Content-Length). Once the body is complete it is plain ``receive`` (disconnect polling)."""
        deadline = time.monotonic() + self.options.read_timeout_s
        limit = self.options.max_body_bytes
        received = 0
        done = False

        async def guarded() -> dict[str, Any]:
            nonlocal received, done
            if done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise RequestTimeoutError(
                    f"the request body did not arrive within {self.options.read_timeout_s:g} s "
                    f"({received} bytes read; raise it with --request-read-timeout)", param="body") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise RequestTooLargeError(f"request body is more than the bound of {limit} bytes "
                                               "(raise it with --max-request-body-mb)", param="body")
                done = not message.get("more_body", False)
            else:
                done = True
            return message

        return guarded


def _raw_response(exc: GraphserveError) -> bytes:
    body = json.dumps(exc.to_openai()).encode()
    reason = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}
    extra = b"Retry-After: 1\r\n" if exc.http_status == 503 else b""
    return (f"HTTP/1.1 {exc.http_status} {reason.get(exc.http_status, 'Error')}\r\n".encode()
            + b"Content-Type: application/json\r\nConnection: close\r\n" + extra
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


def guarded_protocol(base: type, options: GuardOptions, metrics: Any) -> type:
    """uvicorn's HTTP protocol class ``base`` (h11 or httptools) with the connection-level guards."""

    class GuardedHTTPProtocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._head_bytes = 0
            self._tail = b""
            self._in_head = True
            self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(
                options.read_timeout_s, self._head_timed_out)
            shared = options.open_connections
            self._counted = shared is not None
            if shared is not None:
                with shared.get_lock():
                    shared.value += 1
                    open_now = shared.value
            else:
                open_now = len(self.connections)
            limit = options.max_connections
            if limit is not None and open_now > limit:
                self._refuse(ServiceUnavailableError(
                    f"{open_now - 1} connections are open, the bound is --max-connections={limit}"))

        def _refuse(self, exc: GraphserveError) -> None:
            record_error(metrics, exc, "-", "(connection)")
            self._cancel_head_timer()
            if not self.transport.is_closing():
                self.transport.write(_raw_response(exc))
                self.transport.close()

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._in_head:
                self._refuse(RequestTimeoutError(
                    f"the request head did not arrive within {options.read_timeout_s:g} s "
                    "(raise it with --request-read-timeout)"))

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return
            if self._in_head:
                if self._head_timer is None:  # the first byte of a kept-alive connection's next request
                    self._head_timer = self.loop.call_later(options.read_timeout_s, self._head_timed_out)
                end = (self._tail + data).find(b"\r\n\r\n")
                if end < 0:
                    self._head_bytes += len(data)
                    self._tail = (self._tail + data)[-3:]
                else:
                    self._head_bytes += end + 4 - len(self._tail)
                    self._in_head = False
                    self._cancel_head_timer()
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._refuse(HeadTooLargeError(
                        f"the request head is more than {MAX_HEAD_BYTES} bytes (request line and headers)"))
                    return
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._in_head, self._head_bytes, self._tail = True, 0, b""

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            if getattr(self, "_counted", False):
                self._counted = False
                with options.open_connections.get_lock():
                    options.open_connections.value -= 1
            super().connection_lost(exc)

    return GuardedHTTPProtocol
