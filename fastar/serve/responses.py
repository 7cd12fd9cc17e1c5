"""The OpenAI Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`), framework-independent.

Mounting (the server's routes call these; any HTTP framework will do):

    backend = Backend(engine=host.require_engine, submit=host.submit, model_names=..., ...)
    store = ResponseStore()                               # one per server: the responses it produced
    try:
        out = responses.create(body, backend, store, disconnected)  # disconnected(): optional, as for Messages
    except APIError as err:
        return JSON(err.to_dict(), status=err.status)     # errors in the OpenAI shape, as chat completions
    except ClientDisconnected:
        return                                            # nobody to answer; the generation was cancelled
    if isinstance(out, dict):
        return JSON(out)                                  # 200, application/json
    return SSE(out, media_type="text/event-stream")      # 200, an Iterator[bytes]; close() it if the client leaves

    responses.retrieve(response_id, store) -> dict       (404 APIError when unknown or evicted)

Owns: request validation and translation (`input` as a string or items: messages, `function_call`,
`function_call_output`, `reasoning`; `input_file` parts holding text, rendered by `fastar.serve.documents`;
`instructions`; function `tools`; `tool_choice`; `reasoning.effort`; `max_output_tokens`; `text.format` (rendered as
chat completions' `response_format`, and enforced: a JSON schema or object, `fastar.engine.constraint`; `tool_choice`
"required" or a named function forces a tool call); sampling; DeepSeek's `thinking` and `chat_template_kwargs` as on
chat completions; `truncation`, whose "auto" drops the conversation's earliest exchanges, then its oldest tool rounds,
until it fits, `fastar.serve.truncation`), the
`response` object, and the SSE events
(`response.created`, `response.in_progress`, `response.output_item.added` / `.done`, `response.reasoning_text.delta`
/ `.done`, `response.content_part.added` / `.done`, `response.output_text.delta` / `.done`,
`response.function_call_arguments.delta` / `.done`, `response.completed` (`response.incomplete` when cut at
`max_output_tokens`); `error` then `response.failed` if generation fails mid-stream). Each event is `event: <type>`
plus one `data:` line with a `sequence_number`; there is no `[DONE]`, as OpenAI sends none.

`previous_response_id` continues a conversation this server produced: `ResponseStore` keeps the last
`MAX_STORED` responses (input conversation and output) in memory; `store: false` keeps one out of it. An
`{"type": "item_reference", "id": ...}` input item stands for that output item of a stored response.
Reasoning items carry the thinking text in `content` (`reasoning_text`); with `include:
["reasoning.encrypted_content"]` it is also put, unencrypted, in `encrypted_content`, and any of the three is
read back when a client resends the item, so the replayed turn renders as the model wrote it.

Does not own: HTTP, the worker, the encoding (`fastar.serve.turn`, `fastar.encoding`). Never imports torch.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastar.serve import documents, fields, grammar_fields, response_items, shapes, thinking_mode, truncation
from fastar.serve.api_error import APIError, bad_request
from fastar.serve.turn import AssistantTurn, Backend, Conversation, GenerationFailed

MAX_STORED = 256


class ResponseStore:
    """The server's own responses by id: the conversation each continued (encoder messages) and the reply; and
    each stored reply's output items by item id, for `item_reference` input items."""

    def __init__(self, size: int = MAX_STORED) -> None:
        self.size = size
        self._items: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()
        self._outputs: dict[str, dict] = {}  # output item id -> the item, while its response is stored
        self._lock = threading.Lock()

    def put(self, rid: str, conversation: list[dict], response: dict) -> None:
        with self._lock:
            self._items[rid] = (conversation, response)
            self._outputs.update({item["id"]: item for item in response.get("output") or [] if "id" in item})
            while len(self._items) > self.size:
                _, (_, gone) = self._items.popitem(last=False)
                for item in gone.get("output") or []:
                    self._outputs.pop(item.get("id"), None)

    def get(self, rid: str) -> tuple[list[dict], dict] | None:
        with self._lock:
            return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        """Forget a stored response and its output items; False when `rid` is not stored."""
        with self._lock:
            found = self._items.pop(rid, None)
            if found is None:
                return False
            for item in found[1].get("output") or []:
                self._outputs.pop(item.get("id"), None)
            return True

    def item(self, item_id: str) -> dict | None:
        """The output item `item_id` of a stored response (a message, reasoning or function_call), or None."""
        with self._lock:
            return self._outputs.get(item_id)


def retrieve(response_id: str, store: ResponseStore) -> dict:
    """`GET /v1/responses/{id}`."""
    found = store.get(response_id)
    if found is None:
        raise response_items.not_found(response_id)
    return public(found[1])


# ---------------------------------------------------------------------------------------------------------
# Request -> conversation
# ---------------------------------------------------------------------------------------------------------


# The content parts OpenAI takes in each place of `input` (its Responses API reference; the API answers another with a
# 400 `invalid_value` naming the part): what the model wrote (an assistant message) is output text or a refusal,
# what it is given (a user, system or developer message, a tool's output) is input text, images and files. A part
# of any other type (Chat Completions' bare `text`, a typo) is answered the same way.
ASSISTANT_PARTS = ("output_text", "refusal")
INPUT_PARTS = ("input_text", "input_image", "input_file")


def _content_text(content: Any, where: str, role: str = "user") -> str:
    """A message's (or a `function_call_output`'s) text; `where` names the list ("input[1].content"). A part whose
    `type` is not one OpenAI takes there is a 400 `invalid_value` naming the part and the types allowed, as OpenAI
    answers it: the other side's kind (`input_text`, `input_image`, `input_file` in an assistant message, which would
    put words in the model's mouth; `output_text` or `refusal` in a user, system or developer message or a tool's
    output), and any other type (Chat Completions' `text`, a typo, none at all)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", "input")
    allowed, other = (ASSISTANT_PARTS, INPUT_PARTS) if role == "assistant" else (INPUT_PARTS, ASSISTANT_PARTS)
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise bad_request(f"{where}[{j}] must be a content part (an object), got {fields.shown(part)}", "input")
        kind = part.get("type")
        if kind not in allowed:
            place = {"assistant": "an assistant message", "tool": "a function_call_output"}.get(
                role, f"a {role} message"
            )
            named = ", ".join(repr(k) for k in allowed[:-1]) + f" and {allowed[-1]!r}"
            if kind in other:
                owner = "user, system and developer messages" if role == "assistant" else "assistant messages"
                why = f" ({kind} parts are for {owner})"
            elif kind == "text":
                why = " ('text' is a Chat Completions part type)"
            else:
                why = ""
            value = repr(kind) if isinstance(kind, str) and len(kind) <= 80 else fields.shown(kind)
            said = "missing" if kind is None else f"invalid value {value}"
            raise APIError(
                400,
                f"{where}[{j}].type: {said} in {place}: supported values are {named}{why}",
                param=f"{where}[{j}]",
                code="invalid_value",
            )
        if kind == "input_file":  # a text file, rendered as a document
            parts.append(documents.openai_file(part, f"{where}[{j}]", "input"))
            continue
        if kind == "input_image":
            raise bad_request(f"{where}[{j}]: unsupported part 'input_image' (the model reads text only)", "input")
        key = "refusal" if kind == "refusal" else "text"  # a refusal: what the model said instead of an answer
        if not isinstance(part.get(key), str):
            raise bad_request(f"{where}[{j}].{key} must be a string, got {fields.shown(part.get(key))}", "input")
        parts.append(part[key])
    return "".join(parts) if content and all(p.get("type") == "output_text" for p in content) else "\n".join(parts)


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its `reasoning_text` parts, else its `summary_text` parts, else its
    `encrypted_content` (ours is the text itself). A part's text that is not a string is a 400 naming it."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is not None and not isinstance(parts, list):
            raise bad_request(f"{where}.{key} must be a list of {kind} parts, got {fields.shown(parts)}", "input")
        for j, part in enumerate(parts or ()):
            if isinstance(part, dict) and part.get("type") == kind and not isinstance(part.get("text", ""), str):
                raise bad_request(
                    f"{where}.{key}[{j}].text must be a string, got {fields.shown(part['text'])}", "input"
                )
        if parts:
            return "".join(p.get("text", "") for p in parts if isinstance(p, dict) and p.get("type") == kind)
    enc = item.get("encrypted_content")
    if enc is not None and not isinstance(enc, str):
        raise bad_request(f"{where}.encrypted_content must be a string, got {fields.shown(enc)}", "input")
    return enc or ""


def input_messages(items: Any, store: ResponseStore | None = None) -> list[dict]:
    """Responses `input` -> encoder messages. Consecutive assistant items (reasoning, message, function calls)
    form one assistant turn, as the model produced them. An `item_reference` stands for the output item of that
    id of a response in `store`, as if it were given in full (OpenAI resolves it from its stored responses)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise bad_request("'input' must be a string or a list of input items", "input")
    out: list[dict] = []

    def assistant() -> dict:
        if out and out[-1]["role"] == "assistant" and not out[-1].get("_closed"):
            return out[-1]
        out.append({"role": "assistant", "content": ""})
        return out[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "item_reference":
            item = _referenced(item, where, store)
            kind = item["type"]
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(
                    f"{where}.role must be user, assistant, system or developer, got {fields.shown(role)}", "input"
                )
            text = _content_text(item.get("content"), f"{where}.content", role)
            if role == "assistant":
                msg = assistant()
                if msg.get("tool_calls"):  # text after a call starts a new turn
                    msg = {"role": "assistant", "content": ""}
                    out.append(msg)
                msg["content"] += text
            else:  # the encoder's "developer" role is a user-side turn; OpenAI's developer is the system's
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "reasoning":
            msg = assistant()
            if msg["content"] or msg.get("tool_calls"):
                msg = {"role": "assistant", "content": ""}
                out.append(msg)
            msg["reasoning_content"] = msg.get("reasoning_content", "") + _reasoning_text(item, where)
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not name:
                raise bad_request(f"{where}: a function_call needs a 'name' and string 'arguments'", "input")
            grammar_fields.check_arguments(args, f"{where}.arguments")  # as on chat completions
            _call_id(item, where)
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output", "")
            text = output if isinstance(output, str) else _content_text(output, f"{where}.output", "tool")
            out.append({"role": "tool", "tool_call_id": _call_id(item, where), "content": text})
        else:
            raise bad_request(f"{where}: unsupported input item type {kind!r}", "input")
    return out


def _call_id(item: dict, where: str) -> str:
    """A function call's or its output's `call_id`: the output must say which call it answers (as chat completions'
    `tool_call_id`), and a call without one could not be answered."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{where}: a {item.get('type')} needs a non-empty string 'call_id'", "input")
    return call_id


MAX_METADATA = 16  # OpenAI's limits on `metadata`: 16 pairs, keys of 64 characters, values of 512


def _check_metadata(metadata: Any) -> None:
    """`metadata` is echoed in the response object, which clients read as string -> string: anything else (or more
    than OpenAI allows) is a 400, not echoed as it came."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad_request("'metadata' must be an object of string keys and string values", "metadata")
    if len(metadata) > MAX_METADATA or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
        raise bad_request(
            f"'metadata' holds at most {MAX_METADATA} pairs, keys of at most 64 characters and values of at most 512",
            "metadata",
        )


def _referenced(ref: dict, where: str, store: ResponseStore | None) -> dict:
    """The stored output item an `item_reference` names, or a 400 naming the item."""
    iid = ref.get("id")
    if not isinstance(iid, str) or not iid:
        raise bad_request(f"{where}: an item_reference needs the string 'id' of an output item", where)
    found = store.item(iid) if store is not None else None
    if found is None:
        size = store.size if store is not None else 0
        raise bad_request(
            f"{where}: no stored output item with id {iid!r}: an item_reference names an item of a response this "
            f"server stored (it keeps its last {size} responses made with 'store' true; resend the item itself)",
            where,
        )
    return found


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of tool objects", "tools")
    out = []
    for j, tool in enumerate(tools):
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(tool.get("name"), str)
            or not tool["name"]
        ):
            raise bad_request(f"tools[{j}]: only function tools with a 'name' are supported", "tools")
        if '"' in tool["name"]:  # the model writes the name in a DSML attribute: such a tool could never be called
            raise bad_request(f"tools[{j}].name must not hold '\"' (the model writes it in a DSML attribute)", "tools")
        schema, description = tool.get("parameters"), tool.get("description")
        if schema is not None and not isinstance(schema, dict):  # as chat completions and Messages refuse it
            raise bad_request(f"tools[{j}].parameters must be a JSON Schema object", "tools")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"tools[{j}].description must be a string", "tools")
        fn: dict[str, Any] = {"name": tool["name"]}
        if description:
            fn["description"] = description
        fn["parameters"] = schema or {"type": "object", "properties": {}}
        out.append(fn)
    return out


@dataclass(slots=True)
class ResponsesRequest:
    model: str
    conversation: list[dict]  # encoder messages without the instructions: what a continuation builds on
    conv: Conversation  # what is rendered: instructions and tools on the system message
    sampling: dict[str, Any]
    max_tokens: int | None
    stream: bool
    store: bool
    effort: str | None
    encrypted: bool  # include the reasoning as `encrypted_content`
    parallel_tool_calls: bool = True  # False: the reply ends after its first tool call
    input_items: list[dict] = field(default_factory=list)  # this request's `input` as items (`response_items`)
    instructions: str | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None  # `text.format` as chat completions' `response_format`
    truncation: str = "disabled"  # or "auto": `fastar.serve.truncation`

    def conv_of(self, conversation: list[dict]) -> Conversation:
        """What `conversation` renders as in this request: its instructions, tools and mode put on."""
        messages = _with_system(conversation, self.instructions, self.tools, self.response_format)
        return Conversation(messages, self.conv.thinking, self.conv.reasoning_effort, self.conv.drop_thinking, "input")


def _with_system(
    conversation: list[dict], instructions: str | None, tools: list[dict] | None, response_format: dict | None
) -> list[dict]:
    """The encoder's messages: the instructions as the first system message, the tools and the response format on
    the first system message (the encoder reads both there, as on chat completions)."""
    messages = list(conversation)
    if instructions is not None:
        messages.insert(0, {"role": "system", "content": instructions})
    if tools or response_format:
        if not messages or messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": ""})
        messages[0] = {
            **messages[0],
            **({"tools": tools} if tools else {}),
            **({"response_format": response_format} if response_format else {}),
        }
    return messages


def _response_format(body: dict) -> dict | None:
    """`text.format` in the chat-completions `response_format` shape (so both APIs render it alike)."""
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise bad_request(f"'text' must be an object, got {json.dumps(text)[:80]}", "text")
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in grammar_fields.RESPONSE_FORMATS:
        raise bad_request(
            f"'text.format' must be an object whose 'type' is one of {', '.join(grammar_fields.RESPONSE_FORMATS)}, "
            f"got {json.dumps(fmt)[:80]}",
            "text.format",
        )
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema", {}), dict):
            got = json.dumps(fmt["schema"])[:80]
            raise bad_request(f"'text.format.schema' must be an object, got {got}", "text.format.schema")
        grammar_fields.check_json_schema_fields(fmt, "text.format")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return dict(fmt)


def parse_request(body: Any, backend: Backend, store: ResponseStore) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = fields.check_model(body, backend.model_names)
    if body.get("conversation") is not None:  # ignored, the reply would be to the new input alone
        raise bad_request(
            "'conversation' is not supported: this server keeps no Conversations; send the earlier items in "
            "'input', or continue a stored response with 'previous_response_id'",
            "conversation",
        )
    history: list[dict] = []
    prev = body.get("previous_response_id")
    if prev is not None:
        if not isinstance(prev, str):  # a client's mistake, not an id the store let go (a 404)
            raise bad_request(
                f"'previous_response_id' must be a string, got {fields.shown(prev)}", "previous_response_id"
            )
        found = store.get(prev)
        if found is None:
            raise APIError(
                404,
                f"Previous response with id {prev[:80]!r} not found (this server keeps its last "
                f"{store.size} stored responses)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = found[0] + [found[1]["_message"]]
    if "input" not in body:
        raise bad_request("'input' is required", "input")
    conversation = history + input_messages(body["input"], store)
    if not conversation:  # (the encoder would say it of "messages", a field this API does not have)
        raise bad_request("'input' is an empty list: send a string or at least one input item", "input")
    grammar_fields.check_last_turn(conversation, "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", "instructions")
    tools, response_format = _tools(body), _response_format(body)
    messages = _with_system(conversation, instructions, tools, response_format)
    reasoning = {} if body.get("reasoning") is None else body["reasoning"]
    if not isinstance(reasoning, dict):  # (0, false, "" and [] too: not an absent field)
        raise bad_request("'reasoning' must be an object", "reasoning")
    thinking, effort, drop = thinking_mode.choose(
        {
            "reasoning_effort": reasoning.get("effort"),
            **{k: body[k] for k in ("thinking", "chat_template_kwargs") if k in body},
        },
        backend.default_thinking,
        backend.default_effort,
        "reasoning.effort",
    )
    sampling, _ = fields.sampling_fields({k: body.get(k) for k in ("temperature", "top_p", "top_k", "seed")})
    max_tokens = fields.integer(body, "max_output_tokens", 1, None, None)
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        choice = f"function:{choice['name']}"
    elif choice not in (None, "none", "auto", "required"):
        raise bad_request(
            '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", "name": ...}', "tool_choice"
        )
    parallel = fields.boolean(body, "parallel_tool_calls", True)
    _check_metadata(body.get("metadata"))
    sampling["grammar"] = grammar_fields.output_grammar(
        thinking, None if choice == "none" else tools, choice, parallel, response_format, "text.format"
    )
    if choice == "none" and tools:  # the tools stay in the prompt (as under "auto": the prefix cache keeps it)
        sampling[grammar_fields.NO_TOOL_CALLS] = True  # and the DSML marker every call starts with is banned
    sampling["thinking_budget"] = thinking_mode.thinking_budget(body, thinking, effort, max_tokens)
    sampling["thinking"] = thinking  # stop strings match the answer, not the reasoning
    include = [] if body.get("include") is None else body["include"]
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise bad_request(f"'include' must be a list of strings, got {fields.shown(include)}", "include")
    stored = fields.boolean(body, "store", True)
    return ResponsesRequest(
        model=model,
        conversation=conversation,
        conv=Conversation(messages, thinking, effort, drop, param="input"),
        sampling=sampling,
        max_tokens=max_tokens,
        stream=fields.boolean(body, "stream", False),
        store=stored,
        effort=reasoning.get("effort"),
        encrypted=isinstance(include, list) and "reasoning.encrypted_content" in include,
        parallel_tool_calls=parallel,
        input_items=response_items.input_items(body["input"], store) if stored else [],
        instructions=instructions,
        tools=tools,
        response_format=response_format,
        truncation=truncation.mode(body),
    )


# ---------------------------------------------------------------------------------------------------------
# Response objects
# ---------------------------------------------------------------------------------------------------------


def _reasoning_item(rid: str, text: str, encrypted: bool) -> dict:
    item = {
        "type": "reasoning",
        "id": rid,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }
    if encrypted:
        item["encrypted_content"] = text
    return item


def _message_item(mid: str, text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": mid,
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _call_item(call: dict, arguments: str | None = None, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": "fc_" + call["id"].removeprefix("call_"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if arguments is None else arguments,
        "status": status,
    }


def _call_status(call: dict, turn: AssistantTurn) -> str:
    """A call the reply's end cut off inside (max_output_tokens, a stop string) is closed with what it had, its
    arguments unfinished: `incomplete` (`fastar.serve.cut_calls`)."""
    return "incomplete" if call["id"] == turn.cut_call_id else "completed"


class _Reply:
    """The response object as it grows."""

    def __init__(self, body: dict, req: ResponsesRequest) -> None:
        self.id = "resp_" + shapes.new_id("")[1:]
        self.obj: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "max_output_tokens": req.max_tokens,
            "model": req.model,
            "output": [],
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": req.effort, "summary": None},
            "store": req.store,
            "temperature": req.sampling["temperature"],
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": req.sampling["top_p"],
            "truncation": req.truncation,
            "usage": None,
            "metadata": body.get("metadata") or {},
        }

    def finish(self, turn: AssistantTurn) -> dict:
        prompt, completion, cached = turn.prompt_tokens, turn.completion_tokens, turn.cached_tokens or 0
        self.obj["usage"] = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": turn.reasoning_tokens},
            "total_tokens": prompt + completion,
        }
        if turn.finish_reason == "length":
            self.obj["status"] = "incomplete"
            self.obj["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            self.obj["status"] = "completed"
        return self.obj


def _store(store: ResponseStore, req: ResponsesRequest, obj: dict, turn: AssistantTurn) -> None:
    if req.store:
        stored = {**obj, "_message": turn.message(), "_input_items": req.input_items}
        store.put(obj["id"], req.conversation, stored)


def public(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if not k.startswith("_")}


def create(
    body: Any, backend: Backend, store: ResponseStore, disconnected: Callable[[], bool] | None = None
) -> dict | Iterator[bytes]:
    """`POST /v1/responses`: a `response` object, or (with `"stream": true`) the SSE byte stream.

    `disconnected` (optional, non-streaming only): says the client has gone; the generation is then cancelled
    and `ClientDisconnected` raised. A stream is cancelled by closing its iterator."""
    req = parse_request(body, backend, store)
    prompt = None
    if req.truncation == "auto":  # the earliest items dropped until the reply has room (the store keeps all)
        req.conv, prompt = truncation.fit(backend, req.conversation, req.conv_of, req.max_tokens or 1)
    turn = AssistantTurn(
        backend,
        req.conv,
        req.sampling,
        req.max_tokens,
        parallel_tool_calls=req.parallel_tool_calls,
        max_tokens_param="max_output_tokens",
        prompt=prompt,
    )
    reply = _Reply(body, req)
    if req.stream:
        return _stream(turn, reply, req, store)
    try:
        turn.run(disconnected)
    except GenerationFailed as err:
        raise err.api_error() from None
    # the items the stream sends: no empty reasoning item, and a message only for text or an otherwise empty reply
    output = []
    if turn.reasoning:
        output.append(_reasoning_item("rs_" + reply.id[5:], turn.reasoning, req.encrypted))
    if turn.content or not (turn.tool_calls or turn.reasoning):
        output.append(_message_item("msg_" + reply.id[5:], turn.content))
    output.extend(_call_item(c, status=_call_status(c, turn)) for c in turn.tool_calls)
    if output and output[-1]["type"] != "function_call" and turn.finish_reason == "length":
        output[-1]["status"] = "incomplete"  # the text max_output_tokens cut says so, as the response does
    reply.obj["output"] = output
    obj = reply.finish(turn)
    _store(store, req, obj, turn)
    return public(obj)


def _stream(turn: AssistantTurn, reply: _Reply, req: ResponsesRequest, store: ResponseStore) -> Iterator[bytes]:
    seq = 0
    output: list[dict] = []
    open_item: dict | None = None
    text = ""
    calls: dict[str, int] = {}  # tool call id -> its output index
    events = turn.events()
    suffix = reply.id[5:]

    def ev(kind: str, **data: Any) -> bytes:
        nonlocal seq
        seq += 1
        payload = {"type": kind, "sequence_number": seq - 1, **data}
        return f"event: {kind}\ndata: ".encode() + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    def close_item(last: bool = False) -> Iterator[bytes]:
        """`last`: the stream's end, where an item max_output_tokens cut is closed `incomplete`."""
        nonlocal open_item, text
        if open_item is None:
            return
        at = len(output) - 1
        if open_item["type"] == "reasoning":
            yield ev(
                "response.reasoning_text.done", item_id=open_item["id"], output_index=at, content_index=0, text=text
            )
            output[at] = _reasoning_item(open_item["id"], text, req.encrypted)
        else:
            yield ev(
                "response.output_text.done",
                item_id=open_item["id"],
                output_index=at,
                content_index=0,
                text=text,
                logprobs=[],
            )
            output[at] = _message_item(open_item["id"], text)
            yield ev(
                "response.content_part.done",
                item_id=open_item["id"],
                output_index=at,
                content_index=0,
                part=output[at]["content"][0],
            )
        if last and turn.finish_reason == "length":
            output[at]["status"] = "incomplete"
        yield ev("response.output_item.done", output_index=at, item=output[at])
        open_item, text = None, ""

    try:
        yield ev("response.created", response=public(reply.obj))
        yield ev("response.in_progress", response=public(reply.obj))
        try:
            for kind, payload in events:
                if kind == "keepalive":
                    yield b": keep-alive\n\n"
                    continue
                if kind == "tool_start":
                    yield from close_item()
                    at = len(output)
                    calls[payload["id"]] = at
                    output.append(
                        _call_item({"id": payload["id"], "function": {"name": payload["name"]}}, "", "in_progress")
                    )
                    yield ev("response.output_item.added", output_index=at, item=output[at])
                    continue
                if kind == "tool_args":
                    item = output[-1]
                    yield ev(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=len(output) - 1,
                        delta=payload[1],
                    )
                    continue
                if kind == "tool_done":
                    at = calls[payload["id"]]
                    output[at] = _call_item(payload, status=_call_status(payload, turn))
                    yield ev(
                        "response.function_call_arguments.done",
                        item_id=output[at]["id"],
                        output_index=at,
                        name=output[at]["name"],
                        arguments=output[at]["arguments"],
                    )
                    yield ev("response.output_item.done", output_index=at, item=output[at])
                    continue
                want = {"reasoning": "reasoning", "content": "message"}[kind]
                if open_item is not None and open_item["type"] != want:
                    yield from close_item()
                at = len(output)
                if open_item is None:
                    if want == "reasoning":
                        open_item = {"type": "reasoning", "id": "rs_" + suffix, "summary": [], "content": []}
                        output.append(open_item)
                        yield ev("response.output_item.added", output_index=at, item=open_item)
                    else:
                        open_item = {
                            "type": "message",
                            "id": "msg_" + suffix,
                            "role": "assistant",
                            "status": "in_progress",
                            "content": [],
                        }
                        output.append(open_item)
                        yield ev("response.output_item.added", output_index=at, item=open_item)
                        yield ev(
                            "response.content_part.added",
                            item_id=open_item["id"],
                            output_index=at,
                            content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []},
                        )
                at = len(output) - 1
                text += payload
                if want == "reasoning":
                    yield ev(
                        "response.reasoning_text.delta",
                        item_id=open_item["id"],
                        output_index=at,
                        content_index=0,
                        delta=payload,
                    )
                else:
                    yield ev(
                        "response.output_text.delta",
                        item_id=open_item["id"],
                        output_index=at,
                        content_index=0,
                        delta=payload,
                        logprobs=[],
                    )
        except (GenerationFailed, APIError) as err:
            api = err.api_error() if isinstance(err, GenerationFailed) else err
            yield ev("error", code=api.code, message=api.message, param=api.param)
            reply.obj.update(status="failed", error={"code": api.code or "server_error", "message": api.message})
            yield ev("response.failed", response=public(reply.obj))
            return
        yield from close_item(last=True)
        if not output:  # an empty reply still has its message
            yield ev(
                "response.output_item.added",
                output_index=0,
                item={
                    "type": "message",
                    "id": "msg_" + suffix,
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [],
                },
            )
            status = "incomplete" if turn.finish_reason == "length" else "completed"  # as create() closes it
            output.append(_message_item("msg_" + suffix, "", status))
            yield ev("response.output_item.done", output_index=0, item=output[0])
        reply.obj["output"] = output
        obj = reply.finish(turn)
        _store(store, req, obj, turn)
        # a reply cut at max_output_tokens ends with `response.incomplete`, as OpenAI's stream does
        yield ev("response.incomplete" if obj["status"] == "incomplete" else "response.completed", response=public(obj))
    finally:
        events.close()  # a client that left cancels its generation
        turn.cancel()
