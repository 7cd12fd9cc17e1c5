"""The error every client mistake ends in: `APIError` (HTTP status and the OpenAI error fields, rendered as
`{"error": {"message", "type", "param", "code"}}`), `bad_request()`, its 400, and `ContextOverflow`, the 400 of a
prompt that does not fit, with its numbers.

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


class ContextOverflow(APIError):
    """A prompt that does not fit the context: a `400 context_length_exceeded`, with its numbers, for an API that
    words it its own way (Anthropic's "prompt is too long: N tokens > M maximum", which its clients look for).
    `prompt_tokens` is None where the prompt was refused by its length in characters, before tokenizing."""

    def __init__(
        self, message: str, param: str | None, prompt_tokens: int | None, context_length: int, note: str = ""
    ) -> None:
        super().__init__(400, message, "invalid_request_error", param, "context_length_exceeded")
        self.prompt_tokens, self.context_length, self.note = prompt_tokens, context_length, note
