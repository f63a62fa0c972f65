"""One small exception hierarchy; the server maps each class to an HTTP status in one place."""

from __future__ import annotations

from typing import Any


class GraphserveError(Exception):
    """Base class. ``http_status`` and ``error_type`` drive the OpenAI error body."""

    http_status = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_openai(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code if self.code is not None else self.http_status,
            }
        }


class BadRequestError(GraphserveError):
    """Invalid input: the message names the field, the value and the limit."""

    http_status = 400
    error_type = "invalid_request_error"


class ConfigError(BadRequestError):
    """An invalid engine or server setting; the message names the flag."""

    error_type = "invalid_config"


class ModelLoadError(ConfigError):
    """A model source that cannot be loaded (missing folder or file, unknown architecture)."""

    error_type = "model_load_error"


class NotFoundError(GraphserveError):
    http_status = 404
    error_type = "not_found_error"


class OverloadedError(GraphserveError):
    """The waiting queue is full; the caller should retry after ``retry_after`` seconds."""

    http_status = 429
    error_type = "overloaded_error"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kw: Any):
        super().__init__(message, **kw)
        self.retry_after = retry_after


class ServiceUnavailableError(GraphserveError):
    http_status = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kw: Any):
        super().__init__(message, **kw)
        self.retry_after = retry_after


class InternalError(GraphserveError):
    http_status = 500
    error_type = "internal_error"


def bad_field(field: str, value: Any, limit: str, flag: str | None = None) -> BadRequestError:
    """Build the standard 'field=value violates limit' error."""
    msg = f"{field}={value!r} is invalid: {limit}"
    if flag:
        msg += f" (raise it with {flag})"
    return BadRequestError(msg, param=field)
