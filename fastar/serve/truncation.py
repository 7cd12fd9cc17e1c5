"""The Responses API's `truncation`: a conversation too long for the context, its earliest exchanges dropped.

`truncation: "disabled"` (the default) answers a prompt that does not fit with the usual 400
(`context_length_exceeded`). With `"auto"` the conversation (the stored one of `previous_response_id` and the new
`input`) loses whole exchanges from its start until the prompt fits with room for the reply: `max_output_tokens`
tokens where the request gives it, else at least one. An exchange is a user message and what follows it up to the
next one (the assistant's reasoning, text, function calls and their outputs), so a function call is never kept
without its output nor its output without it, and reasoning stays with its message. Never dropped: the instructions
and every system or developer message, and the last user message with everything after it (the turn being
answered, its calls and outputs so far). If that alone does not fit, the answer is the 400 `"disabled"` gives.

The fewest exchanges are dropped: the whole conversation is tokenized first (a prompt that fits costs nothing more),
then the number to drop is bisected, each try admitted and tokenized as any prompt (`fastar.serve.turn.prompt_ids`,
through the replay cache, so a conversation truncated at the same place as its previous turn reuses its ids).

Does not own: the request's other fields, rendering (`fastar.serve.responses`, `fastar.encoding`), the context
check itself (`fastar.serve.fields.resolve_max_tokens`). Never imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from fastar.serve.api_error import ContextOverflow, bad_request
from fastar.serve.turn import Backend, Conversation, prompt_ids

MODES = ("disabled", "auto")


def mode(body: dict) -> str:
    """The request's `truncation`: "disabled" (also when absent or null) or "auto"; anything else is a 400."""
    value = body.get("truncation")
    if value is None:
        return "disabled"
    if value not in MODES:
        raise bad_request(f'\'truncation\' must be "auto" or "disabled", got {json.dumps(value)[:80]}', "truncation")
    return value


def exchanges(conversation: list[dict]) -> list[list[int]]:
    """The indices of the messages `auto` may drop, one list per exchange, oldest first: each user message with the
    non-system messages after it up to the next user message (messages before the first user message are an
    exchange of their own). System messages and the last user message onwards are in none."""
    users = [i for i, m in enumerate(conversation) if m.get("role") == "user"]
    out: list[list[int]] = []
    for i in range(users[-1] if users else 0):
        role = conversation[i].get("role")
        if role == "system":
            continue
        if role == "user" or not out:
            out.append([i])
        else:
            out[-1].append(i)
    return out


def fit(
    backend: Backend, conversation: list[dict], render: Callable[[list[dict]], Conversation], room: int
) -> tuple[Conversation, tuple[str, list[int]]]:
    """The prompt of `conversation` with the fewest earliest exchanges dropped that leaves `room` tokens of the
    context: the `Conversation` (`render` of the kept messages: instructions and tools put on) and its rendered text
    and ids. Where even dropping all of them leaves no room, the whole conversation's, for the usual 400 (raised
    here where its characters alone refuse it)."""
    context = backend.engine().context_length
    groups = exchanges(conversation)

    def attempt(drop: int) -> tuple[Conversation, tuple[str, list[int]] | ContextOverflow]:
        gone = {i for group in groups[:drop] for i in group}
        conv = render([m for i, m in enumerate(conversation) if i not in gone])
        try:
            return conv, prompt_ids(backend, conv)
        except ContextOverflow as err:  # refused by its characters, before tokenizing
            return conv, err

    def fits(tried: tuple[Conversation, tuple[str, list[int]] | ContextOverflow]) -> bool:
        return isinstance(tried[1], tuple) and len(tried[1][1]) + room <= context

    chosen = whole = attempt(0)
    if not fits(whole) and groups and fits(least := attempt(len(groups))):
        chosen, low, high = least, 0, len(groups)  # dropping `low` exchanges does not fit, dropping `high` does
        while high - low > 1:
            mid = (low + high) // 2
            tried = attempt(mid)
            if fits(tried):
                chosen, high = tried, mid
            else:
                low = mid
    conv, prompt = chosen
    if isinstance(prompt, ContextOverflow):
        raise prompt
    return conv, prompt
