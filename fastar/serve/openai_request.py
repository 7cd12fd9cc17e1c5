"""The OpenAI request bodies: `parse_chat_request()` / `parse_completion_request()` turn JSON into a validated
`ChatRequest` / `CompletionRequest` (sampling as `SamplingParams` keyword arguments, `n` for both, `best_of` and a
list of prompts for completions, thinking, tools and the grammar; a user message's `file` parts holding text
become text parts, `fastar.serve.documents`). Unknown fields are ignored (clients send many);
known fields of the wrong type are a 400 naming the field.

Does not own: the field validators (`fastar.serve.fields`), thinking (`fastar.serve.thinking_mode`), tools and
formats (`fastar.serve.grammar_fields`), running them (`fastar.serve.routes`). Pure Python; never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastar.serve import documents, fields, grammar_fields, thinking_mode
from fastar.serve.api_error import bad_request

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (vLLM's too); chat fills the context


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
    parallel_tool_calls: bool = True  # False: the reply ends after its first tool call
    # a system message was put first to carry the tools or the format: `messages[i + 1]` is the client's i
    added_system: bool = False


@dataclass(slots=True)
class CompletionRequest:
    model: str
    prompts: list[str | list[int]]  # each a text or token ids; a request may send several
    sampling: dict[str, Any]
    max_tokens: int | None  # None: COMPLETION_DEFAULT_MAX_TOKENS, or the room left in the context if less
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


def _stream_options(body: dict, stream: bool) -> dict:
    """`stream_options` (`include_usage`): only with `stream` true, as OpenAI and vLLM answer (otherwise it would
    silently do nothing)."""
    value = body.get("stream_options")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    if not stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true", "stream_options")
    return value


def parse_chat_request(
    body: Any, model_names: tuple[str, ...], default_thinking: bool = True, default_effort: str | None = None
) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = fields.check_model(body, model_names)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of message objects", "messages")
    if not all(isinstance(m, dict) for m in messages):
        raise bad_request("every entry of 'messages' must be an object", "messages")
    params, max_tokens = fields.sampling_fields(body)
    n, _ = fields.choice_counts({k: body.get(k) for k in ("n", "seed")})
    logprobs = fields.boolean(body, "logprobs", False)
    top_logprobs = fields.integer(body, "top_logprobs", 0, fields.MAX_TOP_LOGPROBS, 0)
    if top_logprobs and not logprobs:  # as OpenAI and vLLM answer: asked for, it would silently not come
        raise bad_request(
            f"'top_logprobs' ({top_logprobs}) needs 'logprobs': true; set it, or leave 'top_logprobs' out",
            "top_logprobs",
        )
    params["logprobs"] = top_logprobs if logprobs else None
    params["min_tokens"] = fields.min_tokens(body, max_tokens)
    stream = fields.boolean(body, "stream", False)
    params["prompt_logprobs"] = fields.prompt_logprobs(body, stream)
    thinking, effort, drop = thinking_mode.choose(body, default_thinking, default_effort)
    params["thinking_budget"] = thinking_mode.thinking_budget(body, thinking, effort, max_tokens)
    params["thinking"] = thinking  # stop strings match the answer, not the reasoning

    messages = documents.inline_chat_files(messages)  # a user's text `file` parts, rendered as documents
    grammar_fields.check_messages(messages)
    tools = grammar_fields.check_tools(body.get("tools"))
    tool_choice = grammar_fields.check_tool_choice(body.get("tool_choice"))
    if tool_choice == "none" and tools:  # the tools stay in the prompt (as under "auto": the prefix cache keeps it)
        params[grammar_fields.NO_TOOL_CALLS] = True  # and the DSML marker every call starts with is banned
    response_format = grammar_fields.check_response_format(body.get("response_format"))
    choice = f"function:{tool_choice['function']['name']}" if isinstance(tool_choice, dict) else tool_choice
    functions = [t["function"] for t in tools or []] if tool_choice != "none" else []
    parallel = fields.boolean(body, "parallel_tool_calls", True)
    params["grammar"] = grammar_fields.output_grammar(
        thinking, functions, choice, parallel, response_format, "response_format"
    )
    stream_options = _stream_options(body, stream)
    rendered = grammar_fields.with_system_extras(messages, tools, response_format)
    return ChatRequest(
        model=model,
        messages=rendered,
        sampling=params,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=fields.boolean(stream_options, "include_usage", False),
        thinking=thinking,
        reasoning_effort=effort,
        drop_thinking=drop,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        has_tools=bool(tools),
        prompt_logprobs=params["prompt_logprobs"],
        n=n,
        parallel_tool_calls=parallel,
        added_system=len(rendered) > len(messages),
    )


def parse_completion_request(body: Any, model_names: tuple[str, ...]) -> CompletionRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = fields.check_model(body, model_names)
    prompts = fields.prompt_list(body.get("prompt"))
    n, best_of = fields.choice_counts(body, len(prompts))
    echo, stream = fields.boolean(body, "echo", False), fields.boolean(body, "stream", False)
    if stream and best_of > n:
        raise bad_request(f"'best_of' ({best_of}) greater than 'n' ({n}) cannot be streamed", "best_of")
    if body.get("suffix") not in (None, ""):
        raise bad_request("'suffix' (fill-in-the-middle) is not supported by this model", "suffix")
    # echo with max_tokens 0: the prompt only
    params, max_tokens = fields.sampling_fields(body, min_tokens=0 if echo else 1)
    params["logprobs"] = fields.integer(body, "logprobs", 0, fields.MAX_TOP_LOGPROBS, None)
    params["min_tokens"] = fields.min_tokens(body, max_tokens)
    prompt_logprobs = fields.prompt_logprobs(body, stream)
    # echo + logprobs: the prompt's tokens lead the logprobs (scored as vLLM's prompt_logprobs are)
    asked = [n for n in (prompt_logprobs, params["logprobs"] if echo else None) if n is not None]
    params["prompt_logprobs"] = max(asked) if asked else None
    stream_options = _stream_options(body, stream)
    return CompletionRequest(
        model=model,
        prompts=prompts,
        sampling=params,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=fields.boolean(stream_options, "include_usage", False),
        echo=echo,
        logprobs=params["logprobs"],
        prompt_logprobs=prompt_logprobs,
        n=n,
        best_of=best_of,
    )
