"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse


class APIError(Exception):
    """Raised anywhere in a handler; the app turns it into the OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _DEFAULT_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_DEFAULT_TYPES = {401: "authentication_error", 404: "invalid_request_error", 413: "invalid_request_error",
                  503: "service_unavailable_error"}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(error: ValueError) -> APIError:
    """A ValueError from SamplingParams or the engine: its messages start 'field=value: accepted ...'."""
    message = str(error)
    match = re.match(r"(?:request '[^']*': )?(\w+)=", message)
    param = match.group(1) if match else None
    if "max_model_len" in message or "KV blocks" in message:
        return APIError(400, message, param="max_tokens", code="context_length_exceeded")
    return APIError(400, message, param=param)


def overloaded(message: str, code: str, retry_after_s: int = 1) -> APIError:
    return APIError(503, message, code=code, headers={"Retry-After": str(retry_after_s)})
