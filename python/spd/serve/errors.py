"""Errors a request gets back, in OpenAI's shape:
{"error": {"message": ..., "type": ..., "param": ..., "code": ...}} with a 4xx or 5xx status."""
from __future__ import annotations

# the error type OpenAI gives for each status we use
_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}


class APIError(Exception):
    """A request that ends with an error response (status, message, the offending parameter)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
