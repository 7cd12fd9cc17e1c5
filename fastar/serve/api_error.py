"""The error every client mistake ends in: `APIError` (HTTP status and the OpenAI error fields, rendered as
`{"error": {"message", "type", "param", "code"}}`) and `bad_request()`, its 400.

Does not own: rendering it in the Anthropic or Responses shapes (`fastar.serve.anthropic`, `fastar.serve.responses`),
the handlers that turn it into a response (`fastar.serve.app`). Pure Python; never imports torch.
"""

from __future__ import annotations


class APIError(Exception):
    """A request the server refuses, with the HTTP status and the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}  # extra response headers (Retry-After on a full queue)

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)
