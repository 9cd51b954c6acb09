"""The one kind of mistake an API request can make: an ApiError, which serve answers with OpenAI's error JSON
({"error": {"message", "type", "param", "code"}}) and its status (a 4xx for the request's own mistakes)."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, kind=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        default = "authentication_error" if status == 401 else "server_error" if status >= 500 else None
        self.kind = kind or default or "invalid_request_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
