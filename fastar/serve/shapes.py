"""The OpenAI response shapes: ids, `usage`, logprob entries (chat and completions), chat messages and choices,
whole responses and stream chunks of both endpoints, and the SSE byte framing (`sse`, `sse_comment`, `SSE_DONE`).

Does not own: what goes in them as a reply streams (`fastar.serve.choice_turn`), the routes that send them
(`fastar.serve.routes`). Pure Python; never imports torch.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastar.contracts import ServedTokenizer


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None, reasoning_tokens: int | None = None
) -> dict:
    """OpenAI's `usage`; `reasoning_tokens` (chat completions: the thinking tokens, `</think>` included, among the
    completion tokens) as `completion_tokens_details`, as OpenAI's and DeepSeek's APIs give it."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def token_text(tokenizer: ServedTokenizer, token: int) -> tuple[str, list[int]]:
    """A token's text and its UTF-8 bytes (a token may hold part of a character, so the bytes matter)."""
    raw = tokenizer.token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprob_entry(tokenizer: Any, token: int, logprob: float | None, top: list[tuple[int, float]], k: int) -> dict:
    text, raw = token_text(tokenizer, token)
    alternatives = []
    for tid, lp in top[:k]:
        t, b = token_text(tokenizer, tid)
        alternatives.append({"token": t, "logprob": lp, "bytes": b})
    return {
        "token": text,
        "logprob": logprob if logprob is not None else 0.0,
        "bytes": raw,
        "top_logprobs": alternatives,
    }


def completion_logprobs(tokenizer: Any, chunks: list[tuple[int, float | None, list]], k: int, offset: int) -> dict:
    """The legacy completions shape: parallel lists plus one {token: logprob} dict per position."""
    tokens, lps, tops, offsets = [], [], [], []
    for token, lp, top in chunks:
        text, _ = token_text(tokenizer, token)
        tokens.append(text)
        lps.append(lp)
        tops.append({token_text(tokenizer, t)[0]: v for t, v in top[:k]})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_message(content: str, reasoning: str | None, tool_calls: list[dict], reasoning_field: str) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not tool_calls else None}
    if reasoning is not None:
        msg[reasoning_field] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def chat_tool_call_start(index: int, call_id: str, name: str) -> dict:
    """The stream delta that opens a tool call: its index, id, type and name, with empty arguments (OpenAI's
    shape: later deltas of the call carry only its index and argument pieces, `chat_tool_call_args`)."""
    call = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
    return {"tool_calls": [call]}


def chat_tool_call_args(index: int, piece: str) -> dict:
    """A stream delta with the next piece of a tool call's `arguments` (clients concatenate them by `index`)."""
    return {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}


def chat_choice(index: int, message: dict, finish_reason: str, logprobs: list[dict] | None) -> dict:
    return {
        "index": index,
        "message": message,
        "finish_reason": finish_reason,
        "logprobs": None if logprobs is None else {"content": logprobs},
    }


def _response(obj: str, rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices, "usage": use}


def chat_response_choices(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return _response("chat.completion", rid, model, choices, use)


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict,
    finish_reason: str | None = None,
    logprobs: list[dict] | None = None,
    index: int = 0,
    null_usage: bool = False,
) -> dict:
    """One streamed chunk; `null_usage` (`stream_options.include_usage` set) adds `"usage": null`, as OpenAI's
    chunks carry it before the last one, which holds the usage."""
    choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish_reason}
    if logprobs is not None:
        choice["logprobs"] = {"content": logprobs}
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    return {**out, "usage": None} if null_usage else out


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict) -> dict:
    """The last event when `stream_options.include_usage` is set: no choices, just the usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def completion_response_choices(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return _response("text_completion", rid, model, choices, use)


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None = None,
    logprobs: dict | None = None,
    index: int = 0,
    null_usage: bool = False,
) -> dict:
    """One streamed chunk; `null_usage` as for `chat_chunk`."""
    out = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [completion_choice(index, text, finish_reason, logprobs)],
    }
    return {**out, "usage": None} if null_usage else out


SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    # ensure_ascii keeps every event on one line whatever the text holds (U+2028 included).
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def sse_comment(text: str = "keep-alive") -> bytes:
    return f": {text}\n\n".encode()
