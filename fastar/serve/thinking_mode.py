"""Thinking as a request chooses it: on/off and the effort from DeepSeek's `thinking` object,
`chat_template_kwargs` and `reasoning_effort`, in that order of precedence, else the server's `--reasoning-default`
(`REASONING_DEFAULTS`; `choose`); and the thinking budget (`thinking_budget`): `budget_tokens`, or the lower
efforts' (`EFFORT_BUDGETS`), after which `</think>` is forced.

Does not own: forcing `</think>` (`fastar.engine.thinking_budget`), the template's thinking modes
(`fastar.encoding`). Pure Python; never imports torch.
"""

from __future__ import annotations

from fastar.serve import fields
from fastar.serve.api_error import bad_request

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


def choose(
    body: dict, default: bool, default_effort: str | None = None, effort_param: str = "reasoning_effort"
) -> tuple[bool, str | None, bool]:
    """(thinking, reasoning_effort, drop_thinking); precedence: `thinking` object > template kwargs > effort >
    the server's default (`default`, and `default_effort` where thinking is on and no effort is asked).
    `effort_param`: the field a bad effort is blamed on, as the client sent it (Responses: `reasoning.effort`)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    effort = body.get("reasoning_effort", kwargs.get("reasoning_effort"))
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad_request(
            f"'{effort_param}' must be one of {', '.join(REASONING_EFFORTS)}, got {fields.shown(effort)}",
            effort_param,
        )
    thinking = default if effort is None else effort != "none"  # an effort asked for turns thinking on
    if effort == "none":
        effort = None
    elif effort == "minimal":
        effort = "low"
    for key in ("thinking", "enable_thinking"):  # vLLM/SGLang spell it both ways
        thinking = _template_flag(kwargs, key, thinking)
    obj = body.get("thinking")
    if obj is not None:
        kind = obj.get("type") if isinstance(obj, dict) else None
        if isinstance(obj, bool):
            thinking = obj
        elif kind in ("enabled", "disabled"):
            thinking = kind == "enabled"
        else:
            raise bad_request('\'thinking\' must be {"type": "enabled"} or {"type": "disabled"}', "thinking")
    drop = _template_flag(kwargs, "drop_thinking", True)
    if effort is None:
        effort = default_effort
    return thinking, effort if thinking else None, drop


def _template_flag(kwargs: dict, key: str, default: bool) -> bool:
    """A boolean of `chat_template_kwargs`, named in full when it is not one (not as a top-level `key`)."""
    value = kwargs.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        name = f"chat_template_kwargs.{key}"
        raise bad_request(f"'{name}' must be true or false, got {fields.shown(value)}", name)
    return value


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
            f"'thinking.budget_tokens' must be a non-negative integer, got {fields.shown(budget)}",
            "thinking.budget_tokens",
        )
    if max_tokens is not None and budget >= max_tokens:
        raise bad_request(
            f"'thinking.budget_tokens' ({budget}) must be less than 'max_tokens' ({max_tokens})",
            "thinking.budget_tokens",
        )
    return budget
