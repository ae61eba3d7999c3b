"""API errors and each protocol's own error JSON shape.

Handlers raise `ApiError`; the app turns it into the shape of the protocol the route speaks, so an
OpenAI SDK sees `{"error": {...}}` and an Anthropic SDK sees `{"type": "error", "error": {...}}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ErrorStyle(Enum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"


@dataclass
class ApiError(Exception):
    """A failed request: an HTTP status and a readable message (never a traceback)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None  # OpenAI `code` (e.g. "model_not_found", "context_length_exceeded")
    retry_after_s: int | None = None  # sent as Retry-After (503)

    def __str__(self) -> str:
        return self.message


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_supported(what: str, param: str | None = None) -> ApiError:
    return ApiError(400, f"{what} is not supported yet", param=param, code="not_supported")


_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_overloaded",
}

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(error: ApiError, style: ErrorStyle) -> dict:
    """The JSON body for `error` in the shape the clients of `style` parse."""
    if style is ErrorStyle.ANTHROPIC:
        kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": error.message}}
    kind = _OPENAI_TYPES.get(error.status, "server_error")
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


def style_for_path(path: str) -> ErrorStyle:
    """Anthropic routes answer in Anthropic's shape; every other route in OpenAI's."""
    return ErrorStyle.ANTHROPIC if path.startswith("/v1/messages") else ErrorStyle.OPENAI
