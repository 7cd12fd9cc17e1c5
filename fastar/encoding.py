"""DeepSeek-V4 chat encoding: conversation -> prompt text, and generated text -> assistant message.

Owns:
  * `encode_messages()`: renders an OpenAI-style conversation byte for byte as DeepSeek's reference encoder
    (`encoding/encoding_dsv4.py` of the V4 release) does: BOS as text, system / developer / user / assistant /
    latest_reminder turns, tool schemas, assistant tool calls in DSML, `tool` messages folded into user turns
    as `<tool_result>` blocks, `<think>`/`</think>` placement, dropping of earlier reasoning, and the
    `reasoning_effort="max"` paragraph. DeepSeek's golden cases are in `tests/data/dsv4-encoding/`.
  * `ChatPrompt`: what `encode_messages()` returns, the prompt text (a `str`, byte for byte the reference's)
    that also knows which of its characters came from the conversation's content (message text, reasoning,
    tool results, tool schemas and calls, the response format) and which from the template. The tokenizer
    turns special-token strings into control tokens only in the template's parts, so no text a client sends
    can fake a turn or end the prompt. A slice of it (`prompt[n:]`) keeps that knowledge.
  * `parse_completion()` and `StreamParser`: the reverse for what the model generates after the prompt
    (reasoning, content, DSML tool calls), whole or incrementally while streaming. `parse_completion` is the
    stream parser fed in one piece, so the two cannot disagree.

Does not own: token ids (`fastar.engine.tokenizer`), HTTP request/response shapes (`fastar.serve`).
Pure Python; no torch.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastar.errors import FastarError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}
ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
THINKING_MODES = ("thinking", "chat")

# The reference starts the block with "\n\n<｜DSML｜tool_calls>"; parsing looks for it without the ">".
TOOL_CALLS_START = f"\n\n<{DSML}tool_calls"
TOOL_CALLS_END = f"</{DSML}tool_calls>"
INVOKE_END = f"</{DSML}invoke>"
# What follows a call's `</｜DSML｜invoke>` where the block ends there, as the encoder renders it (and as the
# parser closes a block cut after its first call)
BLOCK_CLOSE = f"\n{TOOL_CALLS_END}"

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
# DeepSeek's API maps "low"/"medium" to "high"; OpenAI's top level "xhigh" is taken as "max".
_EFFORT_ALIASES = {None: None, "low": "high", "medium": "high", "high": "high", "max": "max", "xhigh": "max"}

RESPONSE_FORMAT_HEADER = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

TOOLS_HEADER = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

"""
# the header above is DeepSeek's text verbatim: its long lines stay as they are (E501 is ignored for this file)
TOOLS_FOOTER = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"


class EncodingError(FastarError, ValueError):
    """A conversation cannot be rendered: unknown role, missing content, malformed tool or tool call."""


Segment = tuple[str, bool]  # (text, True when it is content: tokenized as plain text)


class ChatPrompt(str):
    """A rendered prompt: the text itself, and `segments`, the same text cut into template and content parts.

    Every `str` operation sees the text; a slice with no step (`prompt[n:]`, `prompt[a:b]`) is a `ChatPrompt`
    of the matching parts, anything else a plain `str` (which the tokenizer reads as all template)."""

    segments: tuple[Segment, ...]

    def __new__(cls, segments: list[Segment] | tuple[Segment, ...]) -> ChatPrompt:
        merged: list[Segment] = []
        for text, content in segments:
            if not text:
                continue
            if merged and merged[-1][1] == content:
                merged[-1] = (merged[-1][0] + text, content)
            else:
                merged.append((text, content))
        self = super().__new__(cls, "".join(text for text, _ in merged))
        self.segments = tuple(merged)
        return self

    def __getitem__(self, key):  # type: ignore[override]
        if not isinstance(key, slice) or key.step not in (None, 1):
            return str(self)[key]
        start, stop, _ = key.indices(len(self))
        out, pos = [], 0
        for text, content in self.segments:
            end = pos + len(text)
            if end > start and pos < stop:
                out.append((text[max(start - pos, 0) : stop - pos], content))
            pos = end
        return ChatPrompt(out)

    def __reduce__(self):
        return ChatPrompt, (self.segments,)


def _t(text: str) -> list[Segment]:
    """Template text: its special-token strings are control tokens."""
    return [(text, False)]


def _c(text: str) -> list[Segment]:
    """Content: tokenized as the plain text it is."""
    return [(text, True)]


def _joined(segments: list[Segment]) -> str:
    return "".join(text for text, _ in segments)


def _json(value: Any) -> str:
    # The reference's json.dumps(ensure_ascii=False): ", "/": " separators, key order kept, non-ASCII literal.
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as err:
        raise EncodingError(f"value is not JSON-serializable: {err}") from None


# ---------------------------------------------------------------------------------------------------------
# Validation: OpenAI-style message dicts -> internal dicts with checked fields
# ---------------------------------------------------------------------------------------------------------


def _text(value: Any, where: str, required: bool) -> str | None:
    """Plain string content; OpenAI content-part lists of text parts are joined with newlines (as vLLM does)."""
    if value is None:
        if required:
            raise EncodingError(f"{where}: 'content' is required")
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") == "text":  # the kind is right, the part malformed
                raise EncodingError(f"{where}: a 'text' content part needs a string 'text'")
            elif isinstance(part, dict) and "type" not in part:
                raise EncodingError(f"{where}: a content part needs a 'type' ('text')")
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise EncodingError(f"{where}: unsupported content part {kind!r} (the model reads text only)")
        return "\n".join(texts)
    raise EncodingError(f"{where}: 'content' must be a string or a list of text parts, got {type(value).__name__}")


def _tools(value: Any, where: str) -> list[dict] | None:
    if not value:
        return None
    if not isinstance(value, list):
        raise EncodingError(f"{where}: 'tools' must be a list")
    functions = []
    for j, tool in enumerate(value):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise EncodingError(f"{where}: tools[{j}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        functions.append(fn)
    return functions


def _tool_calls(value: Any, where: str) -> list[dict]:
    if not value:
        return []
    if not isinstance(value, list):
        raise EncodingError(f"{where}: 'tool_calls' must be a list")
    calls = []
    for j, call in enumerate(value):
        here = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise EncodingError(f"{here}: expected {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
        name, arguments = fn.get("name"), fn.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            raise EncodingError(f"{here}: function 'name' must be a non-empty string")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None  # the reference keeps unparseable arguments as one raw string parameter
            except RecursionError:  # a string, so no bound on the request's nesting saw inside it
                raise EncodingError(f"{here}: 'arguments' nests deeper than a JSON reader goes") from None
            else:
                if not isinstance(parsed, dict):
                    raise EncodingError(f"{here}: 'arguments' must encode a JSON object, got {arguments!r}")
        elif isinstance(arguments, dict):
            parsed = arguments
        else:
            raise EncodingError(f"{here}: 'arguments' must be a JSON string, got {type(arguments).__name__}")
        call_id = call.get("id") or fn.get("id") or ""
        calls.append({"id": call_id, "name": name, "arguments": parsed, "raw": arguments})
    return calls


def _check(where: str, msg: Any) -> dict:
    if not isinstance(msg, dict):
        raise EncodingError(f"{where}: expected a dict, got {type(msg).__name__}")
    role = msg.get("role")
    if role not in ROLES:
        raise EncodingError(f"{where}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
    task = msg.get("task")
    if task is not None and task not in TASK_TOKENS:
        raise EncodingError(f"{where}: unknown task {task!r}; expected one of {', '.join(TASK_TOKENS)}")
    out: dict[str, Any] = {"role": role, "task": task}
    if role in ("system", "developer"):
        out["content"] = _text(msg.get("content"), where, required=role == "developer")
        if role == "developer" and not out["content"]:
            raise EncodingError(f"{where}: a developer message needs non-empty 'content'")
        out["tools"] = _tools(msg.get("tools"), where)
        out["response_format"] = msg.get("response_format")
    elif role == "user" or role == "latest_reminder":
        out["content"] = _text(msg.get("content"), where, required=True)
    elif role == "tool":
        content = msg.get("content")
        if content is None:
            raise EncodingError(f"{where}: a tool message needs 'content'")
        if isinstance(content, list):
            if not all(isinstance(p, dict) for p in content):
                raise EncodingError(f"{where}: tool content parts must be dicts")
        elif not isinstance(content, str):
            raise EncodingError(f"{where}: tool 'content' must be a string or a list of parts")
        out["content"] = content
        out["tool_call_id"] = msg.get("tool_call_id") or ""
    else:  # assistant
        out["content"] = _text(msg.get("content"), where, required=False)
        reasoning = msg.get("reasoning_content")
        if reasoning is None:
            reasoning = msg.get("reasoning")  # vLLM/Ollama name; clients send either back
        out["reasoning"] = _text(reasoning, where + ".reasoning_content", required=False)
        out["tool_calls"] = _tool_calls(msg.get("tool_calls"), where)
        out["wo_eos"] = bool(msg.get("wo_eos") or msg.get("prefix"))  # "prefix": DeepSeek's prefix completion
    return out


# ---------------------------------------------------------------------------------------------------------
# Preprocessing: fold tool messages into user turns, order tool results, drop earlier reasoning
# ---------------------------------------------------------------------------------------------------------


def _fold_tool_messages(messages: list[dict]) -> list[dict]:
    """Every user message becomes a turn made of blocks; tool results join the user turn before them."""
    folded: list[dict] = []
    for msg in messages:
        last = folded[-1] if folded else None
        if msg["role"] == "tool":
            block = ("tool", msg["tool_call_id"], msg["content"])
            if last is not None and last["role"] == "user":
                last["blocks"].append(block)
            else:
                folded.append({"role": "user", "task": None, "blocks": [block]})
        elif msg["role"] == "user":
            block = ("text", "", msg["content"])
            if last is not None and last["role"] == "user" and last["task"] is None:
                last["blocks"].append(block)
            else:
                folded.append({"role": "user", "task": msg["task"], "blocks": [block]})
        else:
            folded.append(dict(msg))
    return folded


def _order_tool_results(messages: list[dict]) -> None:
    """Sort each user turn's tool results by the position of their call in the latest assistant tool_calls."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg["role"] == "assistant" and msg["tool_calls"]:
            order = {c["id"]: j for j, c in enumerate(msg["tool_calls"]) if c["id"]}
        elif msg["role"] == "user" and order:
            results = [b for b in msg["blocks"] if b[0] == "tool"]
            if len(results) < 2:
                continue
            results.sort(key=lambda b: order.get(b[1], 0))  # unknown ids count as position 0, as upstream
            it = iter(results)
            msg["blocks"] = [next(it) if b[0] == "tool" else b for b in msg["blocks"]]


def _last_user_index(messages: list[dict]) -> int:
    for idx in range(len(messages) - 1, -1, -1):
        if messages[idx]["role"] in ("user", "developer"):
            return idx
    return -1


def _drop_thinking(messages: list[dict]) -> list[dict]:
    """Before the last user turn: assistants lose their reasoning, developer messages go away."""
    last_user = _last_user_index(messages)
    kept = []
    for idx, msg in enumerate(messages):
        if idx >= last_user or msg["role"] in ("user", "system", "latest_reminder"):
            kept.append(msg)
        elif msg["role"] == "assistant":
            kept.append({**msg, "reasoning": None})
    return kept


# ---------------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------------


def render_tools(functions: list[dict]) -> str:
    """The system-prompt "## Tools" section for a list of function schemas (the inner `function` objects)."""
    return _joined(_tools_section(functions))


def _tools_section(functions: list[dict]) -> list[Segment]:
    return _t(TOOLS_HEADER) + _c("\n".join(_json(fn) for fn in functions)) + _t(TOOLS_FOOTER)


def render_tool_calls(calls: list[dict]) -> str:
    """The DSML block for checked tool calls ({"name", "arguments": dict | None, "raw": str})."""
    return _joined(_tool_calls_block(calls))


def _tool_calls_block(calls: list[dict]) -> list[Segment]:
    out = _t(f"\n\n<{DSML}tool_calls>\n")
    for k, call in enumerate(calls):
        args = call["arguments"] if call["arguments"] is not None else {"arguments": call["raw"]}
        out += _t("\n" if k else "") + _t(f'<{DSML}invoke name="') + _c(call["name"]) + _t('">\n')
        for j, (key, value) in enumerate(args.items()):
            kind = "true" if isinstance(value, str) else "false"
            out += _t("\n" if j else "") + _t(f'<{DSML}parameter name="') + _c(key) + _t(f'" string="{kind}">')
            out += _c(value if isinstance(value, str) else _json(value)) + _t(f"</{DSML}parameter>")
        out += _t(f"\n{INVOKE_END}")
    return out + _t(BLOCK_CLOSE)


def _tool_result(content: str | list[dict]) -> list[Segment]:
    if isinstance(content, list):
        content = "\n\n".join(
            p.get("text", "") if p.get("type") == "text" else f"[Unsupported {p.get('type')}]" for p in content
        )
    return _t("<tool_result>") + _c(content) + _t("</tool_result>")


def _system_extras(msg: dict) -> list[Segment]:
    out: list[Segment] = []
    if msg["tools"]:
        out += _t("\n\n") + _tools_section(msg["tools"])
    if msg["response_format"]:
        out += _t("\n\n" + RESPONSE_FORMAT_HEADER) + _c(_json(msg["response_format"]))
    return out


def _render(
    idx: int,
    messages: list[dict],
    last_user: int,
    thinking: bool,
    drop: bool,
    effort: str | None,
    generation_prompt: bool = True,
) -> list[Segment]:
    msg, role = messages[idx], messages[idx]["role"]
    out = _t(REASONING_EFFORT_MAX if idx == 0 and thinking and effort == "max" else "")

    if role == "system":
        out += _c(msg["content"] or "") + _system_extras(msg)
    elif role == "developer":
        out += _t(USER) + _c(msg["content"]) + _system_extras(msg)
    elif role == "user":
        out += _t(USER)
        for k, (kind, _, content) in enumerate(msg["blocks"]):
            out += _t("\n\n" if k else "") + (_c(content) if kind == "text" else _tool_result(content))
    elif role == "latest_reminder":
        out += _t(LATEST_REMINDER) + _c(msg["content"])
    else:  # assistant; the opening <think> belongs to the previous turn's suffix
        prev_has_task = idx > 0 and messages[idx - 1]["task"] is not None
        if thinking and not prev_has_task and (not drop or idx > last_user):
            out += _c(msg["reasoning"] or "") + _t(THINK_END)
        out += _c(msg["content"] or "")
        if msg["tool_calls"]:
            out += _tool_calls_block(msg["tool_calls"])
        if not msg["wo_eos"]:
            out += _t(EOS)

    # The suffix opens the assistant turn only where one follows (or the conversation ends, when asked to).
    if idx + 1 < len(messages) and messages[idx + 1]["role"] not in ("assistant", "latest_reminder"):
        return out
    if idx + 1 == len(messages) and not generation_prompt:
        return out
    task = msg["task"]
    if task == "action":
        out += _t(ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task])
    elif task is not None:
        out += _t(TASK_TOKENS[task])
    elif role in ("user", "developer"):
        out += _t(ASSISTANT + (THINK_START if thinking and (not drop or idx >= last_user) else THINK_END))
    return out


def encode_messages(
    messages: list[dict],
    thinking_mode: str = "thinking",
    drop_thinking: bool = True,
    reasoning_effort: str | None = None,
    *,
    context: list[dict] | None = None,
    add_bos: bool = True,
    add_generation_prompt: bool = True,
) -> ChatPrompt:
    """Render a conversation as the DeepSeek-V4 prompt string (special tokens as text, BOS included): a
    `ChatPrompt`, whose content parts the tokenizer reads as plain text.

    Args:
        messages: OpenAI-style dicts with roles system, developer, user, assistant, tool, latest_reminder.
            Tool schemas ride on a system or developer message under "tools". Assistant reasoning may be
            given as "reasoning_content" or "reasoning".
        thinking_mode: "thinking" or "chat". A conversation ending in a user turn ends with the generation
            prompt `<｜Assistant｜><think>` (thinking) or `<｜Assistant｜></think>` (chat).
        drop_thinking: drop reasoning of turns before the last user turn (ignored when any message has tools).
        reasoning_effort: None, "high" or "max" ("low"/"medium" fold to "high", "xhigh" to "max").
        context: earlier messages already in the KV cache; rules see context + messages, only the new part
            is returned, without BOS.
        add_bos: start with the BOS text (when there is no context).
        add_generation_prompt: end a conversation whose last turn is the user's (or a tool's) with the tokens that
            open the reply (`<｜Assistant｜>` and `<think>` or `</think>`); False ends it with that turn's own text.

    Raises:
        EncodingError (a ValueError) on malformed messages or options.
    """
    if thinking_mode not in THINKING_MODES:
        raise EncodingError(f"thinking_mode must be 'thinking' or 'chat', got {thinking_mode!r}")
    if not isinstance(reasoning_effort, (str, type(None))) or reasoning_effort not in _EFFORT_ALIASES:
        raise EncodingError(f"reasoning_effort must be None, 'high' or 'max', got {reasoning_effort!r}")
    effort = _EFFORT_ALIASES[reasoning_effort]
    if not isinstance(messages, list) or not messages:
        raise EncodingError("messages must be a non-empty list of dicts")
    context = list(context or [])
    checked = [_check(f"context[{i}]", m) for i, m in enumerate(context)]
    checked += [_check(f"messages[{i}]", m) for i, m in enumerate(messages)]
    ctx = _fold_tool_messages(checked[: len(context)])
    full = ctx + _fold_tool_messages(checked[len(context) :])
    _order_tool_results(full)

    thinking = thinking_mode == "thinking"
    drop = drop_thinking and not any(m.get("tools") for m in full)
    if thinking and drop:
        full = _drop_thinking(full)
        ctx = _drop_thinking(ctx)  # upstream measures the context on its own, with its own last user turn
    start = len(ctx)
    last_user = _last_user_index(full)
    out = _t(BOS if add_bos and not context else "")
    for idx in range(start, len(full)):
        out += _render(idx, full, last_user, thinking, drop, effort, add_generation_prompt)
    return ChatPrompt(out)


# ---------------------------------------------------------------------------------------------------------
# Parsing what the model generated
# ---------------------------------------------------------------------------------------------------------


@dataclass
class ParsedCompletion:
    """One generated assistant turn. `reasoning` is None in chat mode."""

    content: str
    reasoning: str | None = None
    tool_calls: list[dict] = field(default_factory=list)

    def to_message(self) -> dict:
        """The OpenAI-style assistant message (feeds back into encode_messages on the next turn)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


_WS = re.compile(r"\s*")
_INVOKE = re.compile(rf'<{DSML}invoke\s+name="([^"]*)"\s*>(.*?)</{DSML}invoke>', re.S)
_PARAM = re.compile(rf'<{DSML}parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)</{DSML}parameter>', re.S)


def _not_json(word: str) -> Any:
    raise ValueError(f"{word} is not JSON")


def _finite(number: str) -> float:
    value = float(number)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{number} is beyond a double")
    return value


def json_value(text: str) -> Any:
    """A non-string DSML parameter value, read as standard JSON: `NaN`, `Infinity` and numbers beyond a double
    (which Python's `json` would take, and write back as `NaN` / `Infinity`, making replies that are not JSON)
    and nesting deeper than the reader recurses raise ValueError like any other malformed value."""
    try:
        return json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except RecursionError:  # nested deeper than the reader recurses: not a value it can give back
        raise ValueError("nested too deep to read") from None


def _parse_params(body: str) -> dict[str, Any] | None:
    args: dict[str, Any] = {}
    pos = _WS.match(body).end()
    while pos < len(body):
        m = _PARAM.match(body, pos)
        if m is None or m.group(1) in args:
            return None
        name, is_string, value = m.groups()
        if is_string == "true":
            args[name] = value
        else:
            try:
                args[name] = json_value(value)
            except ValueError:
                args[name] = value  # the model broke its own JSON; keep the text rather than lose it
        pos = _WS.match(body, m.end()).end()
    return args


def parse_tool_block(body: str) -> list[dict] | None:
    """Parse the text after `\\n\\n<｜DSML｜tool_calls` into OpenAI tool calls; None if incomplete or malformed."""
    end = body.find(TOOL_CALLS_END)
    if not body.startswith(">") or end < 0:
        return None
    inner, calls = body[1:end], []
    pos = _WS.match(inner).end()
    while pos < len(inner):
        m = _INVOKE.match(inner, pos)
        args = _parse_params(m.group(2)) if m else None
        if args is None:
            return None
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": m.group(1), "arguments": json.dumps(args, ensure_ascii=False)},
            }
        )
        pos = _WS.match(inner, m.end()).end()
    return calls


_STOPS = {"reasoning": (THINK_END, TOOL_CALLS_START, EOS), "content": (EOS, TOOL_CALLS_START)}


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that could still grow into one of `stops`."""
    for k in range(min(len(text), max(map(len, stops)) - 1), 0, -1):
        tail = text[-k:]
        if any(stop.startswith(tail) for stop in stops):
            return k
    return 0


class StreamParser:
    """Splits generated text into reasoning and content as it streams; tool calls come out at the end.

    `feed(delta)` returns `[(kind, text), ...]` with kind "reasoning" or "content". Text that might be the
    start of a marker (`</think>`, EOS, the DSML tool-call opener) is held back until decided, so a partial
    marker never reaches the client. Everything after the tool-call opener is held until `finish()`; if it
    does not parse as a complete DSML block (cut off, malformed), it is released as content by `flush()`.
    Text after EOS is ignored.

    `single_call` (parallel tool calls disabled): the block ends after its first `</｜DSML｜invoke>`, closed as
    if the model had written `</｜DSML｜tool_calls>` there; `cut` then says so (the caller stops generating), and
    whatever else is fed is ignored.
    """

    def __init__(self, thinking: bool, single_call: bool = False) -> None:
        self.thinking = thinking
        self.single_call = single_call
        self.cut = False
        self._state = "reasoning" if thinking else "content"  # then "tool" or "done"
        self._pending = ""
        self._tool_body = ""
        self._parts: dict[str, list[str]] = {"reasoning": [], "content": []}
        self._tool_calls: list[dict] = []
        self._flushed = False

    @property
    def in_tool_calls(self) -> bool:
        """True once the tool-call opener was seen (the server may announce a pending tool call)."""
        return self._state == "tool"

    @property
    def tool_body(self) -> str:
        """The text after the tool-call opener so far (with `cut`, the closed block)."""
        return self._tool_body

    def _emit(self, events: list[tuple[str, str]], kind: str, text: str) -> None:
        if text:
            self._parts[kind].append(text)
            events.append((kind, text))

    def feed(self, delta: str) -> list[tuple[str, str]]:
        if self._flushed:
            raise RuntimeError("StreamParser.feed() after flush()/finish()")
        events: list[tuple[str, str]] = []
        if self.cut:
            return events
        self._pending += delta
        while self._state in _STOPS:
            stops = _STOPS[self._state]
            hits = [(pos, stop) for stop in stops if (pos := self._pending.find(stop)) >= 0]
            if not hits:
                keep = _held_back(self._pending, stops)
                cut = len(self._pending) - keep
                self._emit(events, self._state, self._pending[:cut])
                self._pending = self._pending[cut:]
                return events
            pos, stop = min(hits)
            self._emit(events, self._state, self._pending[:pos])
            self._pending = self._pending[pos + len(stop) :]
            self._state = {THINK_END: "content", EOS: "done", TOOL_CALLS_START: "tool"}[stop]
        if self._state == "tool":
            start = max(0, len(self._tool_body) - len(INVOKE_END))
            self._tool_body += self._pending
            end = self._tool_body.find(INVOKE_END, start) if self.single_call else -1
            if end >= 0:
                self._tool_body = self._tool_body[: end + len(INVOKE_END)] + BLOCK_CLOSE
                self.cut = True
        self._pending = ""
        return events

    def flush(self) -> list[tuple[str, str]]:
        """Release everything still held back; call once when generation stops."""
        events: list[tuple[str, str]] = []
        if self._flushed:
            return events
        self._flushed = True
        if self._state in _STOPS:
            self._emit(events, self._state, self._pending)
        elif self._state == "tool":
            body = self._tool_body.split(EOS, 1)[0]
            calls = parse_tool_block(body)
            if calls is None:
                self._emit(events, "content", TOOL_CALLS_START + body)
            else:
                self._tool_calls = calls
        self._pending = ""
        return events

    def finish(self) -> ParsedCompletion:
        """The whole turn (flushes first if needed; anything it released is part of the result)."""
        self.flush()
        return ParsedCompletion(
            content="".join(self._parts["content"]),
            reasoning="".join(self._parts["reasoning"]) if self.thinking else None,
            tool_calls=list(self._tool_calls),
        )


def parse_completion(text: str, thinking: bool) -> ParsedCompletion:
    """Parse generated text (what follows the prompt's `<think>` / `</think>`) into an assistant turn.

    Thinking mode: reasoning runs to `</think>` (all of it, if the generation stopped before `</think>`),
    then content runs to EOS or the DSML tool-call block. Chat mode: content only. String parameters
    (`string="true"`) become JSON strings; the others are JSON values (kept as strings if not valid JSON).
    """
    parser = StreamParser(thinking)
    parser.feed(text)
    return parser.finish()
