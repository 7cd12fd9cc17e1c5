"""The request fields that shape the reply: `tools`, `tool_choice`, `response_format` (each validated, a 400
naming the field), the tool result's `tool_call_id`, where the encoder reads tools and the format (the system
message: `with_system_extras`), and the grammar they ask for (`output_grammar`: a forced tool call or a JSON reply,
as `fastar.engine.constraint` builds it; a 400 naming the field when it cannot be enforced), compiled by the
engine's `compile_grammar` before the request is queued (`compiled_sampling`).

Does not own: the grammars themselves and the mask (`fastar.engine.constraint`). Pure Python; never imports torch.
"""

from __future__ import annotations

import json
from typing import Any

from fastar.encoding import DSML
from fastar.engine import constraint as C
from fastar.serve.api_error import bad_request


def with_system_extras(messages: list, tools: list | None, response_format: dict | None) -> list:
    """The encoder reads tool schemas and the response format from the system message; put them there."""
    if not tools and not response_format:
        return messages
    messages = list(messages)
    if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
        system = dict(messages[0])
        messages[0] = system
    else:
        system = {"role": "system", "content": ""}
        messages.insert(0, system)
    if tools:
        system["tools"] = tools
    if response_format:
        system["response_format"] = response_format
    return messages


TOOL_CHOICES = ("none", "auto", "required")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


JSON_TYPES = {dict: "an object", list: "an array", bool: "a boolean", int: "an integer", float: "a number"}


def check_arguments(arguments: Any, where: str) -> None:
    """A past call's `arguments` (`where` names them) must be a string, as OpenAI requires on chat completions and
    Responses alike: anything else is a 400 `invalid_type`. A string that is not JSON is taken (the encoder renders
    it as DeepSeek's does)."""
    if not isinstance(arguments, str):
        got = "null" if arguments is None else JSON_TYPES.get(type(arguments), "another type")
        raise bad_request(
            f"{where}: expected a string (the call's arguments as JSON text), but got {got} instead",
            where,
            "invalid_type",
        )


def check_messages(messages: list[dict]) -> None:
    """What the encoder would take silently but the OpenAI API refuses: a tool result must say which call it
    answers, and a past call's `function.arguments` is a string (the encoder renders an object too, as the Python
    API passes it; OpenAI answers one with a 400 `invalid_type`: "expected a string, but got an object instead").
    A string that is not JSON is taken, as OpenAI takes it (a model's arguments are not always valid JSON): the
    encoder renders it as DeepSeek's does, one string parameter `arguments` holding it (`fastar.encoding`)."""
    for i, msg in enumerate(messages):
        calls = msg.get("tool_calls") if msg.get("role") == "assistant" else None
        for j, call in enumerate(calls if isinstance(calls, list) else ()):
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and "arguments" in fn:
                check_arguments(fn["arguments"], f"messages[{i}].tool_calls[{j}].function.arguments")
        if msg.get("role") == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(
                    f"messages[{i}]: a 'tool' message needs a non-empty string 'tool_call_id'",
                    f"messages[{i}].tool_call_id",
                )


def check_last_turn(messages: list[dict], param: str = "messages") -> None:
    """A conversation to reply to must end with a user (or tool, developer) turn: the V4 chat format opens the
    assistant's reply (`<｜Assistant｜>`) only after one, so after an assistant or system message the prompt would end
    without it and the model would write on after its own EOS. OpenAI's API answers such a conversation with a new
    assistant turn, which V4 cannot render, so it is a 400, as assistant prefill is on /v1/messages."""
    role = messages[-1].get("role") if messages else None
    if role in ("assistant", "system"):
        raise bad_request(
            f"the conversation must end with a user or tool message, not {role!r}: this model's chat format has no "
            f"reply after {'an' if role == 'assistant' else 'a'} {role} message (assistant prefill is not supported)",
            param,
        )


def check_tools(tools: Any) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of tool objects", "tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"'{where}' must be an object with type 'function'", where)
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(
                f"'{where}.function' must be an object with a non-empty string 'name'", f"{where}.function"
            )
        if '"' in fn["name"]:  # the model writes the name in a DSML attribute: such a tool could never be called
            raise bad_request(
                f"'{where}.function.name' must not hold '\"' (the model writes it in a DSML attribute)",
                f"{where}.function",
            )
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(
                f"'{where}.function.parameters' must be a JSON Schema object, got {json.dumps(fn['parameters'])[:80]}",
                f"{where}.function.parameters",
            )
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad_request(f"'{where}.function.description' must be a string", f"{where}.function.description")
    return tools


def check_tool_choice(choice: Any) -> Any:
    if choice is None or choice in TOOL_CHOICES:
        return choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") == "function" and isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return choice
    raise bad_request(
        f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or "
        f'{{"type": "function", "function": {{"name": ...}}}}, got {json.dumps(choice)[:80]}',
        "tool_choice",
    )


def check_response_format(fmt: Any) -> dict | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in RESPONSE_FORMATS:
        raise bad_request(
            f"'response_format' must be an object whose 'type' is one of {', '.join(RESPONSE_FORMATS)}",
            "response_format",
        )
    if fmt["type"] == "json_schema":
        schema = fmt.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("schema", {}), dict):
            raise bad_request(
                "'response_format.json_schema' must be an object (with 'name' and a 'schema' object)",
                "response_format.json_schema",
            )
        check_json_schema_fields(schema, "response_format.json_schema")
    return None if fmt["type"] == "text" else fmt


JSON_SCHEMA_FIELDS = {"name": str, "description": str, "strict": bool}


def check_json_schema_fields(fmt: dict, param: str) -> None:
    """A JSON schema format's `name`, `description` and `strict` (chat completions' `response_format.json_schema`,
    Responses' `text.format`): of the wrong type, a 400 naming it, as OpenAI answers (`strict: "yes"` passed as
    if it were true). The schema is enforced either way."""
    for key, kind in JSON_SCHEMA_FIELDS.items():
        value = fmt.get(key)
        if value is not None and not isinstance(value, kind):
            what = "true or false" if kind is bool else "a string"
            raise bad_request(f"'{param}.{key}' must be {what}, got {json.dumps(value)[:80]}", f"{param}.{key}")


def output_grammar(
    thinking: bool, tools: list[dict] | None, choice: str | None, parallel: bool, fmt: dict | None, fmt_param: str
) -> C.Grammar | None:
    """The grammar enforcing a forced tool call (`choice` "required" or "function:NAME") or a JSON reply (`fmt`:
    `response_format` in the chat completions shape), for the sampling dict's "grammar"; `tools`: function
    objects. A tool choice naming no tool, or a schema that cannot be enforced, is a 400 naming it."""
    fmt = fmt or {}
    schema = (fmt.get("json_schema") or {}).get("schema", {}) if fmt.get("type") == "json_schema" else None
    try:
        return C.output_grammar(
            thinking=thinking,
            functions=tools,
            choice=choice,
            parallel=parallel,
            schema=schema,
            json_object=fmt.get("type") == "json_object",
            schema_param=fmt_param,
        )
    except C.ConstraintError as err:
        raise bad_request(str(err), err.param) from None


NO_TOOL_CALLS = "no_tool_calls"  # a sampling dict's key for `tool_choice` "none", until `compiled_sampling`


def compiled_sampling(engine: Any, sampling: dict[str, Any]) -> dict[str, Any]:
    """`sampling` with its grammar compiled for the engine (`Engine.compile_grammar`; off the event loop: the
    first one builds the tokenizer's tables, ~1 s), and `tool_choice` "none" (`NO_TOOL_CALLS`, set by the request
    parsers) made a ban of the DSML marker, the one token every tool-call block starts with: the tools stay in the
    prompt (which renders as under "auto", so the prefix cache keeps it) and no call can be written."""
    if NO_TOOL_CALLS in sampling:
        banned = set(sampling.get("banned_token_ids", ()))
        if sampling[NO_TOOL_CALLS]:
            dsml = engine.tokenizer.token_to_id(DSML)
            if dsml is None:  # every DeepSeek-V4 tokenizer has it, as one token
                raise bad_request(
                    f"this model's tokenizer has no {DSML} token to ban for tool_choice none", "tool_choice"
                )
            banned.add(dsml)
        sampling = {k: v for k, v in sampling.items() if k != NO_TOOL_CALLS} | {"banned_token_ids": sorted(banned)}
    if sampling.get("grammar") is None:
        return sampling
    try:
        return {**sampling, "grammar": engine.compile_grammar(sampling["grammar"])}
    except C.ConstraintError as err:
        raise bad_request(str(err), err.param) from None
