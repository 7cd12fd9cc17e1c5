"""The OpenAI-compatible wire protocol: request validation, response shapes, SSE framing, stop strings.

Owns:
  * `APIError`: every client mistake ends here, rendered as `{"error": {"message", "type", "param", "code"}}`.
  * `parse_chat_request()` / `parse_completion_request()`: JSON bodies -> validated requests with a
    `SamplingParams`; `n` (both), `best_of` and a list of prompts (completions); choice j of a prompt samples with
    `seed + j` (`choice_sampling`). Unknown fields are ignored (clients send many); known fields of the wrong
    type are a 400 naming the field. Thinking on/off is decided here from DeepSeek's `thinking` object,
    `chat_template_kwargs` and `reasoning_effort`, in that order of precedence, else the server's
    `--reasoning-default` (`REASONING_DEFAULTS`); `thinking_budget()` maps `budget_tokens` and the lower efforts
    (`EFFORT_BUDGETS`) to the sampling's thinking budget.
  * `output_grammar()` / `compiled_sampling()`: the request fields that ask for constrained decoding
    (`response_format`, a forced `tool_choice`) as a grammar (`fastar.engine.constraint`; a 400 naming the field
    when it cannot be enforced), compiled by the engine's `compile_grammar` before the request is queued.
  * `ChatTurn` / `CompletionTurn`: one choice's reply as its chunks arrive (deltas, logprobs, finish reason).
  * `StopFilter`: holds back streamed text that could be the start of a stop string, so a partial stop string
    never reaches the client, and cuts the text at the first complete one.
  * Builders for chat/completion responses, stream chunks, usage and logprobs, and the SSE byte framing.

Does not own: HTTP, threads or the engine (`fastar.serve.server`), the chat encoding itself (`fastar.encoding`).
Pure Python; never imports torch.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastar.encoding import EOS, StreamParser
from fastar.engine import constraint as C
from fastar.engine.stops import StopStrings

# DeepSeek's API folds the OpenAI effort names onto its levels; "none" turns thinking off (Responses API habit).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "max", "xhigh")
# V4 has two thinking levels (high, max); the lower OpenAI efforts think at high within a budget of thinking
# tokens, after which `</think>` is forced (`fastar.engine.thinking_budget`). minimal counts as low.
EFFORT_BUDGETS = {"low": 1024, "medium": 8192}
# `fastar serve --reasoning-default`: the thinking mode of a request that does not choose one -> (thinking, effort)
REASONING_DEFAULTS = {
    "none": (False, None),
    "thinking": (True, None),
    "low": (True, "low"),
    "medium": (True, "medium"),
    "high": (True, "high"),
    "max": (True, "max"),
}
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 128  # choices of one request (n, or best_of, times the prompts), as OpenAI caps n


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


# ---------------------------------------------------------------------------------------------------------
# Field validation. bool is an int subclass in Python, so numbers reject it explicitly: `"temperature": true`
# is a client bug that must not become 1.0.
# ---------------------------------------------------------------------------------------------------------


def _number(body: dict, key: str, lo: float, hi: float, default: float | None) -> float | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{key}' must be a number, got {json.dumps(value)}", key)
    if not lo <= value <= hi:
        raise bad_request(f"'{key}' must be between {lo} and {hi}, got {value}", key)
    return float(value)


def _integer(body: dict, key: str, lo: int, hi: int | None, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer, got {json.dumps(value)}", key)
    if value < lo or (hi is not None and value > hi):
        bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad_request(f"'{key}' must be {bound}, got {value}", key)
    return value


def _boolean(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be true or false, got {json.dumps(value)}", key)
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if len(value) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(value)}", "stop")
    return [s for s in value if s]


def check_model(body: dict, model_names: tuple[str, ...]) -> str:
    """The served model name; a request naming another model is a 404, as OpenAI answers it."""
    model = body.get("model")
    if model is None:
        return model_names[0]
    if not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {json.dumps(model)}", "model")
    if model not in model_names:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves '{model_names[0]}'",
            "invalid_request_error",
            "model",
            "model_not_found",
        )
    return model_names[0]


def _choices(body: dict, prompts: int = 1) -> tuple[int, int]:
    """(n, best_of) of a request: `best_of` (completions only; default n) choices are generated per prompt and the
    `n` with the highest cumulative logprob returned. Choice j of a prompt samples with `seed + j`."""
    n = _integer(body, "n", 1, MAX_CHOICES, 1)
    best_of = _integer(body, "best_of", 1, MAX_CHOICES, None)
    best_of = n if best_of is None else best_of
    if best_of < n:
        raise bad_request(f"'best_of' ({best_of}) must be at least 'n' ({n})", "best_of")
    if best_of * prompts > MAX_CHOICES:
        raise bad_request(
            f"at most {MAX_CHOICES} choices per request, got {best_of} for each of {prompts} prompts", "n"
        )
    seed = body.get("seed")
    if isinstance(seed, int) and seed + best_of - 1 > 2**64 - 1:
        raise bad_request(f"'seed' + {best_of - 1} (the last choice's seed) must be below 2**64", "seed")
    return n, best_of


def choice_sampling(sampling: dict[str, Any], j: int) -> dict[str, Any]:
    """The sampling of choice j of a prompt: seed + j (so choice j equals a request of its own with that seed)."""
    return sampling if sampling.get("seed") is None or j == 0 else {**sampling, "seed": sampling["seed"] + j}


def _sampling(body: dict, min_tokens: int = 1) -> tuple[dict[str, Any], int | None]:
    """Sampling fields shared by both endpoints, as `SamplingParams` keyword arguments; max_tokens is returned
    apart (it needs the prompt length)."""
    max_tokens = _integer(body, "max_completion_tokens", min_tokens, None, None)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", min_tokens, None, None)
    top_k = _integer(body, "top_k", -1, None, 0)
    seed = _integer(body, "seed", -(2**63), 2**64 - 1, None)
    for key in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        _number(body, key, -2.0 if key != "repetition_penalty" else 0.0, 2.0, None)  # accepted, not applied
    params = dict(
        # The model card's defaults (temperature 1.0, top_p 1.0) match OpenAI's when a field is absent.
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=max(_number(body, "top_p", 0.0, 1.0, 1.0), 1e-6),  # top_p 0 means "only the top token"
        top_k=max(top_k, 0),  # vLLM's -1 means "off", as does 0
        min_p=_number(body, "min_p", 0.0, 1.0, 0.0),
        seed=seed,
        stop=_stop(body),
        ignore_eos=_boolean(body, "ignore_eos", False),
    )
    return params, max_tokens


def _prompt_logprobs(body: dict, stream: bool) -> int | None:
    """vLLM's `prompt_logprobs`: every prompt token's logprob and the top N at its position (fastar.serve.scoring).
    They are known once the prompt has run, in the response body, so not with `stream` (vLLM refuses it too)."""
    value = _integer(body, "prompt_logprobs", 0, MAX_TOP_LOGPROBS, None)
    if value is not None and stream:
        raise bad_request("'prompt_logprobs' is not available with 'stream': true", "prompt_logprobs")
    return value


@dataclass(slots=True)
class ChatRequest:
    model: str
    messages: list[dict]  # as the encoder takes them; tools/response_format ride on the system message
    sampling: dict[str, Any]  # SamplingParams keyword arguments, max_tokens aside
    max_tokens: int | None  # None: fill the rest of the context
    stream: bool = False
    include_usage: bool = False
    thinking: bool = True
    reasoning_effort: str | None = None
    drop_thinking: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    has_tools: bool = False
    prompt_logprobs: int | None = None  # vLLM's extension (top-level in the response)
    n: int = 1  # choices


@dataclass(slots=True)
class CompletionRequest:
    model: str
    prompts: list[str | list[int]]  # each a text or token ids; a request may send several
    sampling: dict[str, Any]
    max_tokens: int | None
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's extension (per choice in the response)
    n: int = 1  # choices returned per prompt
    best_of: int = 1  # choices generated per prompt (the n with the highest cumulative logprob are returned)

    @property
    def prompt(self) -> str | list[int]:
        return self.prompts[0]


def _thinking(body: dict, default: bool, default_effort: str | None = None) -> tuple[bool, str | None, bool]:
    """(thinking, reasoning_effort, drop_thinking); precedence: `thinking` object > template kwargs > effort >
    the server's default (`default`, and `default_effort` where thinking is on and no effort is asked)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    effort = body.get("reasoning_effort", kwargs.get("reasoning_effort"))
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad_request(
            f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {json.dumps(effort)}",
            "reasoning_effort",
        )
    thinking = default if effort is None else effort != "none"  # an effort asked for turns thinking on
    if effort == "none":
        effort = None
    elif effort == "minimal":
        effort = "low"
    for key in ("thinking", "enable_thinking"):  # vLLM/SGLang spell it both ways
        if key in kwargs:
            thinking = _boolean(kwargs, key, thinking)
    obj = body.get("thinking")
    if obj is not None:
        kind = obj.get("type") if isinstance(obj, dict) else None
        if isinstance(obj, bool):
            thinking = obj
        elif kind in ("enabled", "disabled"):
            thinking = kind == "enabled"
        else:
            raise bad_request('\'thinking\' must be {"type": "enabled"} or {"type": "disabled"}', "thinking")
    drop = _boolean(kwargs, "drop_thinking", True)
    if effort is None:
        effort = default_effort
    return thinking, effort if thinking else None, drop


def thinking_budget(body: dict, thinking: bool, effort: str | None, max_tokens: int | None) -> int | None:
    """Thinking tokens allowed before `</think>` is forced (None: no limit): `thinking.budget_tokens` (Anthropic's
    and DeepSeek's object; below max_tokens, as Anthropic requires), else the effort's (`EFFORT_BUDGETS`)."""
    if not thinking:
        return None
    obj = body.get("thinking")
    budget = obj.get("budget_tokens") if isinstance(obj, dict) else None
    if budget is None:
        return EFFORT_BUDGETS.get(effort)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise bad_request(
            f"'thinking.budget_tokens' must be a non-negative integer, got {json.dumps(budget)}",
            "thinking.budget_tokens",
        )
    if max_tokens is not None and budget >= max_tokens:
        raise bad_request(
            f"'thinking.budget_tokens' ({budget}) must be less than 'max_tokens' ({max_tokens})",
            "thinking.budget_tokens",
        )
    return budget


def _with_system_extras(messages: list, tools: list | None, response_format: dict | None) -> list:
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


def _check_messages(messages: list[dict]) -> None:
    """What the encoder would take silently but the OpenAI API refuses: a tool result must say which call it
    answers."""
    for i, msg in enumerate(messages):
        if msg.get("role") == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(
                    f"messages[{i}]: a 'tool' message needs a non-empty string 'tool_call_id'",
                    f"messages[{i}].tool_call_id",
                )


def _tools(tools: Any) -> list | None:
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
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(
                f"'{where}.function.parameters' must be a JSON Schema object, got {json.dumps(fn['parameters'])[:80]}",
                f"{where}.function.parameters",
            )
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad_request(f"'{where}.function.description' must be a string", f"{where}.function.description")
    return tools


def _tool_choice(choice: Any) -> Any:
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


def _response_format(fmt: Any) -> dict | None:
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
    return None if fmt["type"] == "text" else fmt


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


def compiled_sampling(engine: Any, sampling: dict[str, Any]) -> dict[str, Any]:
    """`sampling` with its grammar compiled for the engine (`Engine.compile_grammar`; off the event loop: the
    first one builds the tokenizer's tables, ~1 s)."""
    if sampling.get("grammar") is None:
        return sampling
    try:
        return {**sampling, "grammar": engine.compile_grammar(sampling["grammar"])}
    except C.ConstraintError as err:
        raise bad_request(str(err), err.param) from None


def parse_chat_request(
    body: Any, model_names: tuple[str, ...], default_thinking: bool = True, default_effort: str | None = None
) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = check_model(body, model_names)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of message objects", "messages")
    if not all(isinstance(m, dict) for m in messages):
        raise bad_request("every entry of 'messages' must be an object", "messages")
    params, max_tokens = _sampling(body)
    n, _ = _choices({k: body.get(k) for k in ("n", "seed")})
    logprobs = _boolean(body, "logprobs", False)
    top_logprobs = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0)
    params["logprobs"] = top_logprobs if logprobs else None
    stream = _boolean(body, "stream", False)
    params["prompt_logprobs"] = _prompt_logprobs(body, stream)
    thinking, effort, drop = _thinking(body, default_thinking, default_effort)
    params["thinking_budget"] = thinking_budget(body, thinking, effort, max_tokens)

    _check_messages(messages)
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"))
    if tool_choice == "none":
        tools = None  # the model is told of no tools, so it cannot call one
    response_format = _response_format(body.get("response_format"))
    choice = f"function:{tool_choice['function']['name']}" if isinstance(tool_choice, dict) else tool_choice
    functions = [t["function"] for t in tools or []]
    parallel = _boolean(body, "parallel_tool_calls", True)
    params["grammar"] = output_grammar(thinking, functions, choice, parallel, response_format, "response_format")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    return ChatRequest(
        model=model,
        messages=_with_system_extras(messages, tools, response_format),
        sampling=params,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=_boolean(stream_options, "include_usage", False),
        thinking=thinking,
        reasoning_effort=effort,
        drop_thinking=drop,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        has_tools=bool(tools),
        prompt_logprobs=params["prompt_logprobs"],
        n=n,
    )


def parse_completion_request(body: Any, model_names: tuple[str, ...]) -> CompletionRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = check_model(body, model_names)
    prompts = _prompts(body.get("prompt"))
    n, best_of = _choices(body, len(prompts))
    echo, stream = _boolean(body, "echo", False), _boolean(body, "stream", False)
    if stream and best_of > n:
        raise bad_request(f"'best_of' ({best_of}) greater than 'n' ({n}) cannot be streamed", "best_of")
    if body.get("suffix") not in (None, ""):
        raise bad_request("'suffix' (fill-in-the-middle) is not supported by this model", "suffix")
    params, max_tokens = _sampling(body, min_tokens=0 if echo else 1)  # echo with max_tokens 0: the prompt only
    params["logprobs"] = _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS, None)
    prompt_logprobs = _prompt_logprobs(body, stream)
    # echo + logprobs: the prompt's tokens lead the logprobs (scored as vLLM's prompt_logprobs are)
    asked = [n for n in (prompt_logprobs, params["logprobs"] if echo else None) if n is not None]
    params["prompt_logprobs"] = max(asked) if asked else None
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    return CompletionRequest(
        model=model,
        prompts=prompts,
        sampling=params,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=_boolean(stream_options, "include_usage", False),
        echo=echo,
        logprobs=params["logprobs"],
        prompt_logprobs=prompt_logprobs,
        n=n,
        best_of=best_of,
    )


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(prompt: Any) -> list[str | list[int]]:
    """`prompt` as OpenAI takes it: a string, token ids, or a list of either (one choice group per prompt)."""
    if isinstance(prompt, str) or (_is_ids(prompt) and prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise bad_request(
            "'prompt' must be a non-empty string, a list of token ids, or a list of those (one per prompt)", "prompt"
        )
    for i, p in enumerate(prompts):
        if not p:
            raise bad_request(f"'prompt[{i}]' is empty", "prompt")
    return prompts


def resolve_max_tokens(
    prompt_tokens: int, max_tokens: int | None, context_length: int, note: str | None = None, param: str = "messages"
) -> int:
    """Never truncate silently: a prompt that does not fit, or a budget that overflows the context, is a 400.
    `note` says why the context is shorter than asked (e.g. a model file without lightning-indexer weights)."""
    why = f" ({note})" if note else ""
    if prompt_tokens >= context_length:
        raise bad_request(
            f"This model's maximum context length is {context_length} tokens{why}, but the prompt is "
            f"{prompt_tokens} tokens. Please shorten the prompt.",
            param,
            "context_length_exceeded",
        )
    if max_tokens is None:
        return context_length - prompt_tokens
    if prompt_tokens + max_tokens > context_length:
        raise bad_request(
            f"This model's maximum context length is {context_length} tokens{why}. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the "
            f"completion). Please reduce the prompt or max_tokens.",
            "max_tokens",
            "context_length_exceeded",
        )
    return max_tokens


def check_token_ids(ids: list[int], vocab_size: int | None, param: str) -> None:
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise bad_request(f"token id {bad[0]} is out of range [0, {vocab_size})", param)


def make_sampling_params(sampling: dict[str, Any], max_tokens: int) -> Any:
    """The engine's `SamplingParams`. Imported here, not at module level, because `fastar.engine.sampling`
    imports torch, which the server must not load at import time (the engine loads it when it loads)."""
    from fastar.engine.sampling import SamplingParams

    try:
        return SamplingParams(max_tokens=max_tokens, **sampling)
    except ValueError as err:  # SamplingError: a value this request validation let through
        raise bad_request(str(err)) from None


# ---------------------------------------------------------------------------------------------------------
# Stop strings
# ---------------------------------------------------------------------------------------------------------


class StopFilter(StopStrings):
    """`StopStrings` for the response builders: `feed` returns just the text now safe to emit (the stop string is
    never shown, and after a hit everything is swallowed); `hit` says whether one was found."""

    def feed(self, text: str) -> str:
        return super().feed(text)[0]


# ---------------------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def token_text(tokenizer: Any, token: int) -> tuple[str, list[int]]:
    """A token's text and its UTF-8 bytes (a token may hold part of a character, so the bytes matter)."""
    raw = tokenizer.token_bytes(token) if hasattr(tokenizer, "token_bytes") else None
    if raw is None:
        text = tokenizer.decode([token])
        return text, list(text.encode("utf-8"))
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


def chat_choice(index: int, message: dict, finish_reason: str, logprobs: list[dict] | None) -> dict:
    return {
        "index": index,
        "message": message,
        "finish_reason": finish_reason,
        "logprobs": None if logprobs is None else {"content": logprobs},
    }


def chat_response(
    rid: str, model: str, message: dict, finish_reason: str, use: dict, logprobs: list[dict] | None
) -> dict:
    return chat_response_choices(rid, model, [chat_choice(0, message, finish_reason, logprobs)], use)


def chat_response_choices(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict,
    finish_reason: str | None = None,
    logprobs: list[dict] | None = None,
    index: int = 0,
) -> dict:
    choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish_reason}
    if logprobs is not None:
        choice["logprobs"] = {"content": logprobs}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict) -> dict:
    """The last event when `stream_options.include_usage` is set: no choices, just the usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def completion_choice(index: int, text: str, finish_reason: str, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def completion_response(rid: str, model: str, text: str, finish_reason: str, use: dict, logprobs: dict | None) -> dict:
    return completion_response_choices(rid, model, [completion_choice(0, text, finish_reason, logprobs)], use)


def completion_response_choices(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None = None,
    logprobs: dict | None = None,
    index: int = 0,
) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}],
    }


# ---------------------------------------------------------------------------------------------------------
# SSE framing: one `data:` line of compact JSON per event; comments keep idle connections alive.
# ---------------------------------------------------------------------------------------------------------

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    # ensure_ascii keeps every event on one line whatever the text holds (U+2028 included).
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def sse_comment(text: str = "keep-alive") -> bytes:
    return f": {text}\n\n".encode()


@dataclass(slots=True)
class PendingLogprobs:
    """Logprob entries of tokens whose text is still held back; they ride on the next emitted delta."""

    entries: list[dict] = field(default_factory=list)

    def take(self) -> list[dict] | None:
        out, self.entries = self.entries, []
        return out or None


# ---------------------------------------------------------------------------------------------------------
# One generated turn: engine chunks in, OpenAI deltas out
# ---------------------------------------------------------------------------------------------------------


def _finish_reason(engine_finish: str | None, stopped: bool, tokens: int, max_tokens: int) -> str:
    if stopped:
        return "stop"
    if engine_finish == "length" or (engine_finish != "stop" and tokens >= max_tokens):
        return "length"
    return "stop"


class ChatTurn:
    """An assistant turn as it streams: stop strings first, then the DSV4 parser that splits reasoning from
    content and collects DSML tool calls. `feed()`/`finish()` return `[(delta, logprobs | None)]`."""

    def __init__(self, req: ChatRequest, tokenizer: Any, reasoning_field: str) -> None:
        self.req, self.tokenizer, self.reasoning_field = req, tokenizer, reasoning_field
        self.stops = StopFilter(req.sampling["stop"])
        self.parser = StreamParser(req.thinking)
        self.pending = PendingLogprobs()
        self.logprobs: list[dict] = []
        self.prompt_scores: Any = None  # `PromptLogprobs` from the first chunk, when asked for
        self.completion_tokens = 0
        self.engine_finish: str | None = None
        self.content = ""
        self.reasoning: str | None = None
        self.tool_calls: list[dict] = []

    @property
    def stopped(self) -> bool:
        return self.stops.hit

    def feed(self, chunk: Any) -> list[tuple[dict, list[dict] | None]]:
        if chunk.prompt_logprobs is not None:
            self.prompt_scores = chunk.prompt_logprobs
        if self.stops.hit:
            return []  # the engine may run a token past the stop string before it sees the cancel
        if chunk.token is not None:
            self.completion_tokens += 1
            if self.req.logprobs:
                entry = chat_logprob_entry(
                    self.tokenizer, chunk.token, chunk.logprob, chunk.top_logprobs, self.req.top_logprobs
                )
                self.pending.entries.append(entry)
                self.logprobs.append(entry)
        if chunk.finish_reason:
            self.engine_finish = chunk.finish_reason
        return self._deltas(self.parser.feed(self.stops.feed(chunk.text)))

    def _deltas(self, events: list[tuple[str, str]]) -> list[tuple[dict, list[dict] | None]]:
        return [
            ({self.reasoning_field if kind == "reasoning" else "content": text}, self.pending.take())
            for kind, text in events
        ]

    def finish(self, max_tokens: int) -> tuple[list[tuple[dict, list[dict] | None]], str]:
        """The deltas still held back, the tool calls, and the finish reason."""
        deltas = self._deltas(self.parser.feed(self.stops.flush()) + self.parser.flush())
        result = self.parser.finish()
        self.content, self.reasoning, self.tool_calls = result.content, result.reasoning, result.tool_calls
        for i, call in enumerate(self.tool_calls):
            deltas.append(({"tool_calls": [{"index": i, **call}]}, None))
        if self.tool_calls:
            return deltas, "tool_calls"
        return deltas, _finish_reason(self.engine_finish, self.stops.hit, self.completion_tokens, max_tokens)

    def message(self) -> dict:
        return chat_message(self.content, self.reasoning, self.tool_calls, self.reasoning_field)


class CompletionTurn:
    """A raw completion as it streams: stop strings (EOS among them, so its text never shows) and logprobs."""

    def __init__(self, req: CompletionRequest, tokenizer: Any, offset: int) -> None:
        self.req, self.tokenizer = req, tokenizer
        self.stops = StopFilter([*req.sampling["stop"], EOS])
        self.offset = offset
        self._pending: list[tuple[int, float | None, list]] = []
        self.logprobs: dict | None = (
            None
            if req.logprobs is None
            else {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        )
        self.prompt_scores: Any = None  # `PromptLogprobs` from the first chunk, when asked for
        self.completion_tokens = 0
        self.cumulative_logprob = 0.0  # of the generated tokens: what best_of ranks choices by
        self.engine_finish: str | None = None
        self.text = ""

    @property
    def stopped(self) -> bool:
        return self.stops.hit

    def _emit(self, text: str) -> list[tuple[str, dict | None]]:
        lp = None
        if self.req.logprobs is not None and self._pending:
            lp = completion_logprobs(self.tokenizer, self._pending, self.req.logprobs, self.offset)
            self._pending = []
            for key, values in lp.items():
                self.logprobs[key].extend(values)
        if not text and lp is None:
            return []
        self.text += text
        self.offset += len(text)
        return [(text, lp)]

    def feed(self, chunk: Any) -> list[tuple[str, dict | None]]:
        if chunk.prompt_logprobs is not None:
            self.prompt_scores = chunk.prompt_logprobs
        if self.stops.hit:
            return []
        if chunk.token is not None:
            self.completion_tokens += 1
            self.cumulative_logprob += chunk.logprob or 0.0
            self._pending.append((chunk.token, chunk.logprob, chunk.top_logprobs))
        if chunk.finish_reason:
            self.engine_finish = chunk.finish_reason
        text = self.stops.feed(chunk.text)
        return self._emit(text) if text else []

    def finish(self, max_tokens: int) -> tuple[list[tuple[str, dict | None]], str]:
        out = self._emit(self.stops.flush())
        return out, _finish_reason(self.engine_finish, self.stops.hit, self.completion_tokens, max_tokens)
