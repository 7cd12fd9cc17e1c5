"""The request fields every API shares, validated: numbers, integers, booleans and stop strings (a wrong type
or an out-of-range value is a 400 naming the field), the model name, `n`/`best_of` (`choice_counts`; choice j of
a prompt samples with `seed + j`, `choice_sampling`), the sampling fields as `SamplingParams` keyword arguments
(`sampling_fields`), `prompt_logprobs`, a completion's `prompt` list, `max_tokens` against the context
(`resolve_max_tokens`), token ids against the vocabulary, and the engine's `SamplingParams` from all of it.

Does not own: the thinking fields (`fastar.serve.thinking_mode`), tools and reply formats
(`fastar.serve.grammar_fields`), the OpenAI request bodies as a whole (`fastar.serve.openai_request`); the Anthropic
and Responses routes call these validators for their own bodies. Pure Python; never imports torch.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastar.serve.api_error import APIError, ContextOverflow, bad_request

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 128  # choices of one request (n, or best_of, times the prompts), as OpenAI caps n


def shown(value: Any) -> str:
    """A client's value as an error message quotes it: its JSON, cut at 80 characters (a value can be megabytes)."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


# bool is an int subclass in Python, so numbers reject it explicitly: `"temperature": true` is a client bug that
# must not become 1.0.


def number(body: dict, key: str, lo: float, hi: float, default: float | None) -> float | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{key}' must be a number, got {shown(value)}", key)
    if not lo <= value <= hi:
        raise bad_request(f"'{key}' must be between {lo} and {hi}, got {value}", key)
    return float(value)


def integer(body: dict, key: str, lo: int, hi: int | None, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer, got {shown(value)}", key)
    if value < lo or (hi is not None and value > hi):
        bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad_request(f"'{key}' must be {bound}, got {value}", key)
    return value


def boolean(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be true or false, got {shown(value)}", key)
    return value


def stop_strings(body: dict) -> list[str]:
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


def logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's `logit_bias`: an object mapping token ids (as strings, JSON keys) to a bias in [-100, 100] added to
    that token's logit before the draw. The ids are checked against the vocabulary where the engine is known
    (`check_token_ids`)."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(
            f"'logit_bias' must be an object of token id -> bias, got {json.dumps(value)[:80]}", "logit_bias"
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        # (no vocabulary has ids of 20 digits; thousands of them would not even convert to an int)
        if not (key.isascii() and key.isdigit()) or len(key) > 19:
            raise bad_request(f"'logit_bias' keys must be token ids, got {json.dumps(key)[:80]}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_request(
                f"'logit_bias[{key}]' must be a number between -100 and 100, got {json.dumps(bias)[:80]}", "logit_bias"
            )
        out[int(key)] = float(bias)
    return out


def check_model(body: dict, model_names: tuple[str, ...]) -> str:
    """The served model name; a request naming another model is a 404, as OpenAI answers it."""
    model = body.get("model")
    if model is None:
        return model_names[0]
    if not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {shown(model)}", "model")
    if model not in model_names:
        raise APIError(
            404,
            f"The model {model[:80]!r} does not exist; this server serves '{model_names[0]}'",
            "invalid_request_error",
            "model",
            "model_not_found",
        )
    return model_names[0]


def choice_counts(body: dict, prompts: int = 1) -> tuple[int, int]:
    """(n, best_of) of a request: `best_of` (completions only; default n) choices are generated per prompt and the
    `n` with the highest cumulative logprob returned. Choice j of a prompt samples with `seed + j`."""
    n = integer(body, "n", 1, MAX_CHOICES, 1)
    best_of = integer(body, "best_of", 1, MAX_CHOICES, None)
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


def sampling_fields(body: dict, min_tokens: int = 1) -> tuple[dict[str, Any], int | None]:
    """Sampling fields shared by both endpoints, as `SamplingParams` keyword arguments; max_tokens is returned
    apart (it needs the prompt length)."""
    max_tokens = integer(body, "max_completion_tokens", min_tokens, None, None)
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens", min_tokens, None, None)
    top_k = integer(body, "top_k", -1, None, 0)
    seed = integer(body, "seed", -(2**63), 2**64 - 1, None)
    repetition = number(body, "repetition_penalty", 0.0, 2.0, 1.0)
    if repetition == 0.0:
        raise bad_request("'repetition_penalty' must be above 0 (1 is off), got 0", "repetition_penalty")
    params = dict(
        # The model card's defaults (temperature 1.0, top_p 1.0) match OpenAI's when a field is absent.
        temperature=number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=max(number(body, "top_p", 0.0, 1.0, 1.0), 1e-6),  # top_p 0 means "only the top token"
        top_k=max(top_k, 0),  # vLLM's -1 means "off", as does 0
        min_p=number(body, "min_p", 0.0, 1.0, 0.0),
        seed=seed,
        stop=stop_strings(body),
        ignore_eos=boolean(body, "ignore_eos", False),
        logit_bias=logit_bias(body),
        presence_penalty=number(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=number(body, "frequency_penalty", -2.0, 2.0, 0.0),
        repetition_penalty=repetition,
        # vLLM's: the special tokens (BOS, EOS, pad, ...) a reply holds give no text unless this is false
        skip_special_tokens=boolean(body, "skip_special_tokens", True),
    )
    return params, max_tokens


def min_tokens(body: dict, max_tokens: int | None) -> int:
    """vLLM's `min_tokens`: until that many tokens are generated, EOS and the stop token ids are not drawn and stop
    strings do not end the reply. At most `max_tokens` when the request gives one; with none it counts up to the
    limit the request gets (`make_sampling_params`)."""
    value = integer(body, "min_tokens", 0, None, 0)
    if max_tokens is not None and value > max_tokens:
        raise bad_request(f"'min_tokens' ({value}) must not exceed 'max_tokens' ({max_tokens})", "min_tokens")
    return value


def prompt_logprobs(body: dict, stream: bool) -> int | None:
    """vLLM's `prompt_logprobs`: every prompt token's logprob and the top N at its position (fastar.serve.scoring).
    They are known once the prompt has run, in the response body, so not with `stream` (vLLM refuses it too)."""
    value = integer(body, "prompt_logprobs", 0, MAX_TOP_LOGPROBS, None)
    if value is not None and stream:
        raise bad_request("'prompt_logprobs' is not available with 'stream': true", "prompt_logprobs")
    return value


def is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def prompt_list(prompt: Any) -> list[str | list[int]]:
    """`prompt` as OpenAI takes it: a string, token ids, or a list of either (one choice group per prompt)."""
    if isinstance(prompt, str) or (is_ids(prompt) and prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
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
    prompt_tokens: int,
    max_tokens: int | None,
    context_length: int,
    note: str | None = None,
    param: str = "messages",
    default: int | None = None,
    budget_param: str = "max_tokens",
) -> int:
    """Never truncate silently: a prompt that does not fit, or a budget that overflows the context, is a 400.
    `note` says why the context is shorter than asked (e.g. a model file without lightning-indexer weights). With no
    `max_tokens`, the route's `default` (completions: 16, as OpenAI's) capped at the room left, or all the room.
    `param` and `budget_param` are the request's names of the prompt and the budget (Responses: `input` and
    `max_output_tokens`), for the error."""
    why = f" ({note})" if note else ""
    if prompt_tokens >= context_length:
        raise ContextOverflow(
            f"This model's maximum context length is {context_length} tokens{why}, but the prompt is "
            f"{prompt_tokens} tokens. Please shorten the prompt.",
            param,
            prompt_tokens,
            context_length,
            note or "",
        )
    if max_tokens is None:
        room = context_length - prompt_tokens
        return room if default is None else min(default, room)
    if prompt_tokens + max_tokens > context_length:
        raise bad_request(
            f"This model's maximum context length is {context_length} tokens{why}. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the "
            f"completion). Please reduce the prompt or {budget_param}.",
            budget_param,
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

    if sampling.get("min_tokens", 0) > max_tokens:  # no max_tokens given: the limit is the room left, or the default
        sampling = {**sampling, "min_tokens": max_tokens}
    try:
        return SamplingParams(max_tokens=max_tokens, **sampling)
    except ValueError as err:  # SamplingError: a value this request validation let through
        raise bad_request(str(err)) from None
