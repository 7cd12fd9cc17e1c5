"""The Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), framework-independent.

Mounting (the server's routes call these; any HTTP framework will do):

    backend = Backend(engine=host.require_engine, submit=host.submit, model_names=..., ...)
    try:
        out = anthropic.messages(body, backend, disconnected)   # body: the parsed JSON request body
    except APIError as err:                                     # disconnected(): optional, see messages()
        return JSON(anthropic.error_body(err), status=err.status)
    except ClientDisconnected:
        return                                                 # nobody to answer; the generation was cancelled
    if isinstance(out, dict):
        return JSON(out)                                   # 200, application/json
    return SSE(out, media_type="text/event-stream")       # 200, an Iterator[bytes]; close() it if the client leaves

    anthropic.count_tokens(body, backend) -> {"input_tokens": N}    (same error handling)

Auth: Anthropic clients send the key as `x-api-key`; `api_key_from_headers()` reads it (or a Bearer token).

Owns: request validation and translation into the encoder's conversation (system, text, `tool_use` /
`tool_result`, `thinking` blocks, plain-text `document` blocks in a user turn or a `tool_result`, rendered by
`fastar.serve.documents`, tools, `tool_choice`, `stop_sequences`, sampling, the V4 thinking modes), and the reply:
the `message` object, or the SSE event sequence (`message_start`, `ping`, `content_block_start` /
`content_block_delta` (`thinking_delta`, `signature_delta`, `text_delta`, `input_json_delta`) /
`content_block_stop`, `message_delta` with `stop_reason` and usage, `message_stop`; `event: error` if generation
fails mid-stream; `ping` fills a long prefill). Errors use Anthropic's shape `{"type": "error", "error": {"type",
"message"}}`.

`max_tokens` is required (a 400 without it, as Anthropic answers); one beyond the room the prompt leaves runs until
the context is full, with `stop_reason: "model_context_window_exceeded"`. A prompt over the context is a 400 in
Anthropic's words, "prompt is too long: N tokens > M maximum", which clients look for. A conversation must end with a
user message: assistant prefill (a last assistant turn to continue) is a 400, in the words Anthropic uses for its
models without prefill. A stop-sequence hit is `stop_reason: "stop_sequence"` with the matched string in
`stop_sequence`. A thinking block cut off by `max_tokens` is not followed by an empty text block; an empty thinking
block (`</think>` at once) is left out, streamed or not.

Model: any `model` name is accepted and answered by the served model (Claude Code sends its own model ids for
background tasks); replies name the served model.

Thinking: `thinking: {"type": "enabled" | "adaptive" | "between_tools"}` turns V4's thinking mode on, `"disabled"`
off; absent, the server's default applies (as on chat completions). `output_config.effort` "max" (or "xhigh", which
the SDK offers) selects V4's maximum reasoning effort. `budget_tokens` is enforced: after that many thinking tokens
`</think>` is forced and the answer follows (`fastar.engine.thinking_budget`); it must be below `max_tokens` (a 400
otherwise, as Anthropic answers); `output_config.effort` "low"/"medium" set the same budgets as OpenAI's
`reasoning_effort`.
`tool_choice` "none" keeps the tools in the prompt (it renders as under "auto", so the prefix cache keeps it) and
bans the DSML marker every tool call starts with, for the whole reply (`grammar_fields.compiled_sampling`): no call
can be written; "any" and "tool" are enforced with a grammar (`fastar.engine.constraint`): the
reply is one call of the named tool, or one or more calls (one with `disable_parallel_tool_use`), each input valid
against its `input_schema`. Under "auto", `disable_parallel_tool_use` ends the reply once its first tool call is
complete (`stop_reason` "tool_use"). Tool
input streams as `input_json_delta` pieces while the model writes the call (`fastar.serve.toolstream`); their
concatenation is the final input's JSON. A call the reply was cut inside (max_tokens, the context, a stop sequence)
stays the last block, its pieces stopping where the model stopped and its `input` the parameters it completed
(`fastar.serve.cut_calls`); the stop reason is then the cut's, never "tool_use".
Structured outputs (`output_config.format`, or the beta's top-level `output_format`:
`{"type": "json_schema", "schema"}`) are enforced with the same grammars as chat completions' `response_format`:
the text is JSON valid against the schema (with tools left to the model: that JSON or calls).
Tools are custom tools only: a tool of an Anthropic-defined `type` (web
search, bash, text editor: Anthropic runs them or gives the model their schema) is a 400, not a tool the model
would see without parameters.

Does not own: HTTP, the worker, the encoding (`fastar.serve.turn`, `fastar.encoding`). Never imports torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from fastar.serve import documents, fields, grammar_fields, shapes, thinking_mode
from fastar.serve.api_error import APIError, ContextOverflow, bad_request
from fastar.serve.turn import AssistantTurn, Backend, Conversation, GenerationFailed, prompt_ids

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "stop_sequence": "stop_sequence"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
EFFORTS = ("low", "medium", "high", "xhigh", "max")  # "xhigh": V4's "max", as the encoder takes it


def error_body(err: APIError) -> dict:
    """An `APIError` in Anthropic's shape (the HTTP status stays `err.status`). A 4xx of no type of its own (405,
    415, 431) is an `invalid_request_error`, as Anthropic answers them; `api_error` is for the server's own faults."""
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error" if 400 <= err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def api_key_from_headers(headers: Mapping[str, str]) -> str | None:
    """The key an Anthropic client sends (`x-api-key`), else a Bearer token; None when neither is there."""
    lowered = {k.lower(): v for k, v in headers.items()}
    if "x-api-key" in lowered:
        return lowered["x-api-key"]
    scheme, _, token = lowered.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


# ---------------------------------------------------------------------------------------------------------
# Request -> conversation
# ---------------------------------------------------------------------------------------------------------


def _blocks(content: Any, field: str) -> list[dict]:
    """`field` ("system", "messages[0].content", ...) as a list of blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad_request(f"{field} must be a string or a list of content blocks", "messages")
    return content


def _string(block: dict, key: str, at: str) -> str:
    """A block's text field (`text`, `thinking`): a block of a known type without it is malformed."""
    if not isinstance(block.get(key), str):
        raise bad_request(f"{at}: a {block['type']} block needs a string '{key}'", "messages")
    return block[key]


def _text_of(content: Any, field: str, with_documents: bool = False) -> str:
    """Text blocks joined with newlines; `with_documents` (a `tool_result`'s content): plain-text documents too."""
    parts = []
    for j, block in enumerate(_blocks(content, field)):
        at = f"{field}[{j}]" if isinstance(content, list) else field
        if with_documents and block.get("type") == "document":
            parts.append(documents.anthropic_document(block, at))
            continue
        if block.get("type") != "text":
            raise bad_request(
                f"{at}: only text blocks are supported here, got {block.get('type')!r} (the model reads text only)",
                "messages",
            )
        parts.append(_string(block, "text", at))
    return "\n".join(parts)


def _user_messages(content: Any, where: str) -> list[dict]:
    """A user turn: runs of text blocks become user messages, `tool_result` blocks become tool messages."""
    out: list[dict] = []
    texts: list[str] = []
    if content == []:  # no turn at all: the reply would follow the assistant turn before, after its EOS
        raise bad_request(
            f"{where}.content must not be empty (a user turn needs a text or tool_result block)", "messages"
        )
    for j, block in enumerate(_blocks(content, f"{where}.content")):
        kind = block.get("type")
        if kind == "text":
            texts.append(_string(block, "text", f"{where}.content[{j}]"))
        elif kind == "document":  # a plain-text document, rendered into the turn's text
            texts.append(documents.anthropic_document(block, f"{where}.content[{j}]"))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
                raise bad_request(  # as chat completions' tool_call_id: the result must say which call it answers
                    f"{where}.content[{j}]: a tool_result block needs the non-empty string 'tool_use_id' of the "
                    "tool_use it answers",
                    "messages",
                )
            result = block.get("content", "")
            text = result if isinstance(result, str) else _text_of(result, f"{where}.content[{j}].content", True)
            if fields.boolean(block, "is_error", False):
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise bad_request(
                f"{where}.content[{j}]: unsupported block type {kind!r} in a user turn "
                "(text, document and tool_result are supported)",
                "messages",
            )
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_message(content: Any, where: str) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    reasoning, calls = None, []
    for j, block in enumerate(_blocks(content, f"{where}.content")):
        kind = block.get("type")
        if kind == "text":  # our replies carry one text block: joined as generated
            msg["content"] += _string(block, "text", f"{where}.content[{j}]")
        elif kind == "thinking":
            reasoning = (reasoning or "") + _string(block, "thinking", f"{where}.content[{j}]")
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            name, args = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not name:
                raise bad_request(
                    f"{where}.content[{j}]: a tool_use block needs a 'name' and an object 'input'", "messages"
                )
            if not isinstance(args, dict):  # a JSON string too: `input` is the arguments themselves, not their text
                raise bad_request(
                    f"{where}.content[{j}].input must be an object (the call's arguments), got {fields.shown(args)}",
                    "messages",
                )
            calls.append(
                {"id": str(block.get("id") or ""), "type": "function", "function": {"name": name, "arguments": args}}
            )
        else:
            raise bad_request(f"{where}.content[{j}]: unsupported block type {kind!r} in an assistant turn", "messages")
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tools(body: dict) -> list[dict] | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice is not None and not (isinstance(choice, dict) and choice.get("type") in ("auto", "any", "tool", "none")):
        raise bad_request('\'tool_choice\' must be {"type": "auto" | "any" | "tool" | "none"}', "tool_choice")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of tool objects", "tools")
    out = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{j}] must be an object with a 'name'", "tools")
        if '"' in tool["name"]:  # the model writes the name in a DSML attribute: such a tool could never be called
            raise bad_request(f"tools[{j}].name must not hold '\"' (the model writes it in a DSML attribute)", "tools")
        if tool.get("type") not in (None, "custom"):  # web search, bash, text editor...: run or described by Anthropic
            raise bad_request(
                f"tools[{j}]: tool type {fields.shown(tool['type'])} is not supported "
                "(only custom tools, with a 'name' and an 'input_schema')",
                "tools",
            )
        schema, description = tool.get("input_schema"), tool.get("description")
        if schema is not None and not isinstance(schema, dict):
            raise bad_request(f"tools[{j}].input_schema must be a JSON Schema object", "tools")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"tools[{j}].description must be a string", "tools")
        fn: dict[str, Any] = {"name": tool["name"]}
        if description:
            fn["description"] = description
        fn["parameters"] = schema or {"type": "object", "properties": {}}
        out.append(fn)
    return out


def _output_format(body: dict) -> tuple[dict | None, str]:
    """Structured outputs, `{"type": "json_schema", "schema": {...}}` in `output_config.format` (or the beta's
    top-level `output_format`), in the chat completions `response_format` shape the grammar takes; and its field."""
    config = body.get("output_config")
    fmt, where = (config.get("format") if isinstance(config, dict) else None), "output_config.format"
    if fmt is None and body.get("output_format") is not None:
        fmt, where = body["output_format"], "output_format"
    if fmt is None:
        return None, where
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request(f'\'{where}\' must be {{"type": "json_schema", "schema": {{...}}}}', where)
    return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}, where


def _single_call(body: dict) -> bool:
    """`tool_choice.disable_parallel_tool_use` (any choice type): at most one tool call in the reply."""
    choice = body.get("tool_choice")
    return isinstance(choice, dict) and fields.boolean(choice, "disable_parallel_tool_use", False)


def _grammar(body: dict, tools: list[dict] | None, thinking: bool) -> Any:
    """The grammar of a forced tool call (`tool_choice` "any" or "tool") or of a JSON reply (`output_config.format`;
    with tools left to the model: that JSON or calls), None when nothing is enforced."""
    choice = body.get("tool_choice")
    fmt, where = _output_format(body)
    kind, single = None, _single_call(body)
    if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
        if choice["type"] == "tool" and not isinstance(choice.get("name"), str):
            raise bad_request("'tool_choice' {\"type\": \"tool\"} needs the tool's 'name'", "tool_choice")
        if not tools:  # worded in this API's terms (the grammar's own message says "required")
            forced = json.dumps({"type": choice["type"]})
            raise bad_request(f"'tool_choice' {forced} forces a tool call, but the request has no tools", "tool_choice")
        kind = "required" if choice["type"] == "any" else f"function:{choice['name']}"
    if kind is None and fmt is None:
        return None
    return grammar_fields.output_grammar(
        thinking, tools, kind, not single, fmt, where if kind is None else "tool_choice"
    )


def _thinking(body: dict, default: bool, default_effort: str | None = None) -> tuple[bool, str | None]:
    thinking = default
    obj = body.get("thinking")
    if obj is not None:
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind not in ("enabled", "adaptive", "between_tools", "disabled"):
            raise bad_request(
                '\'thinking\' must be {"type": "enabled" | "adaptive" | "between_tools" | "disabled"}', "thinking"
            )
        thinking = kind != "disabled"
    config = body.get("output_config")
    if config is None:
        config = {}
    if not isinstance(config, dict):  # (0, false, "" and [] too: not an absent field)
        raise bad_request("'output_config' must be an object ('effort', 'format')", "output_config")
    effort = config.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise bad_request(
            f"'output_config.effort' must be one of {', '.join(EFFORTS)}, got {fields.shown(effort)}", "output_config"
        )
    return thinking, (effort or default_effort) if thinking else None


def _check_metadata(metadata: Any) -> None:
    """`metadata` is `{"user_id": string}` (Anthropic's only key; null allowed): anything else is a 400, not ignored."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise bad_request(
            f'\'metadata\' must be an object such as {{"user_id": "..."}}, got {fields.shown(metadata)}', "metadata"
        )
    user = metadata.get("user_id")
    if user is not None and not isinstance(user, str):
        raise bad_request(f"'metadata.user_id' must be a string, got {fields.shown(user)}", "metadata")


def parse_request(
    body: Any, backend: Backend, counting: bool = False
) -> tuple[str, Conversation, dict, int | None, bool]:
    """(model, conversation, sampling kwargs, max_tokens, stream) of a Messages request (`counting`: for
    count_tokens, which takes no max_tokens)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if not counting and body.get("max_tokens") is None:  # required by the Messages API; no silent "to the end"
        raise bad_request("'max_tokens' is required (the most tokens to generate, at least 1)", "max_tokens")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {fields.shown(model)}", "model")
    model = backend.model_names[0]  # any name is served: agents send their own ids for side tasks
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise bad_request("'messages' must be a non-empty list of message objects", "messages")
    messages: list[dict] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text_of(system, "system")})
    for i, msg in enumerate(msgs):
        where = f"messages[{i}]"
        if msg.get("role") == "user":
            messages.extend(_user_messages(msg.get("content"), where))
        elif msg.get("role") == "assistant":
            messages.append(_assistant_message(msg.get("content"), where))
        else:
            raise bad_request(
                f"{where}.role must be 'user' or 'assistant', got {fields.shown(msg.get('role'))}", "messages"
            )
    if not counting and msgs[-1].get("role") == "assistant":  # the encoder would close it: a reply after EOS
        raise bad_request(
            "this model does not support assistant message prefill: the conversation must end with a user message",
            "messages",
        )
    tools = _tools(body)
    if tools:
        if not messages or messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": ""})
        messages[0]["tools"] = tools
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
        raise bad_request("'stop_sequences' must be a list of strings", "stop_sequences")
    if stops is not None and len(stops) > fields.MAX_STOP_STRINGS:  # named as this API names it, not 'stop'
        raise bad_request(
            f"'stop_sequences' may hold at most {fields.MAX_STOP_STRINGS} strings, got {len(stops)}", "stop_sequences"
        )
    fields.number(body, "temperature", 0.0, 1.0, None)  # this API's range (OpenAI's is [0, 2])
    sampling, max_tokens = fields.sampling_fields(
        {k: body.get(k) for k in ("temperature", "top_p", "top_k", "max_tokens")} | {"stop": stops}
    )
    thinking, effort = _thinking(body, backend.default_thinking, backend.default_effort)
    _check_metadata(body.get("metadata"))
    no_calls = isinstance(body.get("tool_choice"), dict) and body["tool_choice"]["type"] == "none"
    sampling["grammar"] = _grammar(body, None if no_calls else tools, thinking)
    if no_calls and tools:  # the tools stay in the prompt (as under "auto": the prefix cache keeps it)
        sampling[grammar_fields.NO_TOOL_CALLS] = True  # and the DSML marker every call starts with is banned
    # budget_tokens enforced (below max_tokens, as Anthropic requires); output_config.effort low/medium: a budget too
    sampling["thinking_budget"] = thinking_mode.thinking_budget(body, thinking, effort, max_tokens)
    sampling["thinking"] = thinking  # stop strings match the answer, not the reasoning
    # With tools the encoder keeps earlier reasoning anyway; without, an agent's multi-turn history drops it.
    conv = Conversation(messages, thinking, effort)
    return model, conv, sampling, max_tokens, fields.boolean(body, "stream", False)


# ---------------------------------------------------------------------------------------------------------
# Routes
# ---------------------------------------------------------------------------------------------------------


def count_tokens(body: Any, backend: Backend) -> dict:
    """`POST /v1/messages/count_tokens`: the prompt's token count, as the generation would see it."""
    _, conv, _, _, _ = parse_request(
        {**body, "max_tokens": None} if isinstance(body, dict) else body, backend, counting=True
    )
    return {"input_tokens": len(prompt_ids(backend, conv)[1])}


def messages(body: Any, backend: Backend, disconnected: Callable[[], bool] | None = None) -> dict | Iterator[bytes]:
    """`POST /v1/messages`: a `message` object, or (with `"stream": true`) the SSE byte stream.

    `disconnected` (optional, non-streaming only): says the client has gone; the generation is then cancelled
    and `ClientDisconnected` raised. A stream is cancelled by closing its iterator."""
    model, conv, sampling, max_tokens, stream = parse_request(body, backend)
    try:
        turn = AssistantTurn(
            backend, conv, sampling, max_tokens, fit_context=True, parallel_tool_calls=not _single_call(body)
        )
    except ContextOverflow as err:
        raise _prompt_too_long(err) from None
    mid = "msg_" + shapes.new_id("")[1:]
    if stream:
        return _stream(turn, mid, model)
    try:
        turn.run(disconnected)
    except GenerationFailed as err:
        raise err.api_error() from None
    content: list[dict] = []
    if turn.reasoning:  # an empty one (`</think>` at once) is no block, as the stream sends none
        content.append(_thinking_block(turn.reasoning))
    if turn.content or not (turn.tool_calls or turn.reasoning):  # no empty text after thinking
        content.append({"type": "text", "text": turn.content})
    content.extend(_tool_use(call, turn) for call in turn.tool_calls)
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": _stop_reason(turn),
        "stop_sequence": turn.stop_sequence,
        "usage": _usage(turn),
    }


def _prompt_too_long(err: ContextOverflow) -> APIError:
    """Anthropic's words for a prompt over the context, which clients built for Anthropic look for to recognise a
    full context: "prompt is too long: N tokens > M maximum"."""
    if err.prompt_tokens is None:  # refused by its characters, never tokenized: fastar's own message says how
        head, note = f"over {err.context_length} tokens", f" ({err.message})"
    else:
        head, note = f"{err.prompt_tokens} tokens", f" ({err.note})" if err.note else ""
    return bad_request(f"prompt is too long: {head} > {err.context_length} maximum{note}", err.param, err.code)


def _stop_reason(turn: AssistantTurn) -> str:
    if turn.finish_reason == "length" and turn.cut_to_context:  # the context ended it, not max_tokens
        return "model_context_window_exceeded"
    return STOP_REASONS[turn.finish_reason]


def _signature(thinking: str) -> str:
    # Clients send thinking blocks back with their signature; ours only marks the text as this server's.
    return "fastar-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _thinking_block(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": _signature(text)}


def _tool_use(call: dict, turn: AssistantTurn) -> dict:
    """A call cut off inside (`turn.cut_call_id`) has as `input` the parameters it completed: what a client's
    partial JSON reader makes of the `input_json_delta` pieces the stream sent for it."""
    cut = call["id"] == turn.cut_call_id and turn.cut_input is not None
    return {
        "type": "tool_use",
        "id": call["id"],
        "name": call["function"]["name"],
        "input": turn.cut_input if cut else json.loads(call["function"]["arguments"]),
    }


def _usage(turn: AssistantTurn) -> dict:
    cached = turn.cached_tokens or 0
    # Anthropic counts input_tokens without the cache reads: the three add up to the prompt.
    return {
        "input_tokens": turn.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": turn.completion_tokens,
    }


def event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def _stream(turn: AssistantTurn, mid: str, model: str) -> Iterator[bytes]:
    """The SSE events of one message. Blocks open lazily: thinking, then text, then one per tool call."""
    usage0 = {
        "input_tokens": turn.prompt_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 0,
    }
    open_kind: str | None = None
    index = -1
    reasoning = ""
    tool_blocks: dict[str, int] = {}  # tool call id -> its block index
    events = turn.events()
    try:
        yield event(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": mid,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": usage0,
                },
            },
        )
        yield event("ping", {"type": "ping"})
        try:
            for kind, payload in events:
                if kind == "keepalive":
                    yield event("ping", {"type": "ping"})
                    continue
                if kind == "tool_done":  # its block closes (it is the open one unless content broke in)
                    if open_kind == "tool_use" and tool_blocks.get(payload["id"]) == index:
                        yield event("content_block_stop", {"type": "content_block_stop", "index": index})
                        open_kind = None
                    continue
                if kind == "tool_args":
                    delta = {"type": "input_json_delta", "partial_json": payload[1]}
                    yield event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
                    continue
                want = {"reasoning": "thinking", "content": "text", "tool_start": "tool_use"}[kind]
                if open_kind != want or want == "tool_use":
                    if open_kind == "thinking":
                        yield _signature_delta(index, reasoning)
                    if open_kind is not None:
                        yield event("content_block_stop", {"type": "content_block_stop", "index": index})
                    index += 1
                    open_kind = want
                    start = {
                        "thinking": {"type": "thinking", "thinking": "", "signature": ""},
                        "text": {"type": "text", "text": ""},
                    }.get(want)
                    if want == "tool_use":
                        tool_blocks[payload["id"]] = index
                        start = {"type": "tool_use", "id": payload["id"], "name": payload["name"], "input": {}}
                    yield event(
                        "content_block_start", {"type": "content_block_start", "index": index, "content_block": start}
                    )
                    if want == "tool_use":
                        continue
                if want == "thinking":
                    reasoning += payload
                    delta = {"type": "thinking_delta", "thinking": payload}
                else:
                    delta = {"type": "text_delta", "text": payload}
                yield event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
        except (GenerationFailed, APIError) as err:
            api = err.api_error() if isinstance(err, GenerationFailed) else err
            yield event("error", error_body(api))
            return
        if index < 0:  # an empty reply still has its text block, as Anthropic sends it
            index, open_kind = 0, "text"
            yield event(
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            )
        if open_kind == "thinking":
            yield _signature_delta(index, reasoning)
        if open_kind is not None:
            yield event("content_block_stop", {"type": "content_block_stop", "index": index})
        yield event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": _stop_reason(turn), "stop_sequence": turn.stop_sequence},
                "usage": _usage(turn),
            },
        )
        yield event("message_stop", {"type": "message_stop"})
    finally:
        events.close()  # a client that left cancels its generation
        turn.cancel()


def _signature_delta(index: int, reasoning: str) -> bytes:
    return event(
        "content_block_delta",
        {
            "type": "content_block_delta",
            "index": index,
            "delta": {"type": "signature_delta", "signature": _signature(reasoning)},
        },
    )
