"""The Responses API's `truncation`: a conversation too long for the context, its earliest items dropped.

`truncation: "disabled"` (the default) answers a prompt that does not fit with the usual 400
(`context_length_exceeded`). With `"auto"` the conversation (the stored one of `previous_response_id` and the new
`input`) loses items from its start until the prompt fits with room for the reply: `max_output_tokens` tokens where
the request gives it, else at least one. First whole exchanges go, oldest first: an exchange is a user message and
what follows it up to the next one (the assistant's reasoning, text, function calls and their outputs). Once only
the last exchange is left (an agent run: one user message, then round after round of calls), its oldest tool
rounds go: a round is one turn of the model (its reasoning, text and function calls) with the function call
outputs after it. So a function call is never kept without its output nor its output without it, and reasoning
stays with its turn. Never dropped: the instructions and every system or developer message, the last user
message, and the latest round (the calls and outputs the reply continues from). If those alone do not fit, the
answer is the 400 `"disabled"` gives.

The kept items render as they did in the whole conversation: the V4 format opens an assistant turn after a user or
tool turn, so the user message followed by a later round opens it as it was opened after the dropped round's
outputs, and whether earlier turns' reasoning is rendered depends only on the last user or tool turn, which is
kept. The prompt is the rendering of the shortened conversation itself (what the model would see had it been sent).

Where the cut falls: at one of a few cut points fixed by the conversation's own beginning, so that it stays put
for many turns. In a long agent run near the context each turn adds a round; dropping the fewest steps that fit
would move the cut by about a round every turn, every kept item would then shift in the prompt, and the prefix
reuse (the KV state of the previous prompt, in RAM or on disk) would cover only the instructions: everything kept
prefilled again, minutes a turn on a CPU near a long context. So the droppable steps, in the order they go, are
sized by their own tokens (`sizes`: each message rendered as a conversation of its own and tokenized), and the
candidate cuts (`grid`) are the first step boundary at or after each multiple of a quarter of the context in those
sizes, counted from the start. A cut depends only on what it drops, so items added at the end never move it. The
cut is the smallest candidate that fits; it stays the same from turn to turn while it still fits (a smaller one did
not fit, and each turn only adds), then moves by about a quarter of the context at once, after which the prompt
again grows by what each turn adds. Where no candidate fits but dropping more does (what must stay is within a
quarter of the context of the limit), the fewest steps that fit are dropped, as before.

The whole conversation is tokenized first (a prompt that fits costs nothing more); then each droppable message
once for the sizes, and the candidates are bisected (a cut that drops more never lengthens the prompt), each try
admitted and tokenized as any prompt (`fastar.serve.turn.prompt_ids`, through the replay cache, so a
conversation truncated at the same place as its previous turn reuses its ids), then the finer cuts past the last
candidate where none fits. The tokenizer keeps the ids of the runs it tokenized (`fastar.engine.tokenizer.RunCache`),
so of a resent history only its new messages are tokenized again, whichever of these asks.

Does not own: the request's other fields, rendering (`fastar.serve.responses`, `fastar.encoding`), the context
check itself (`fastar.serve.fields.resolve_max_tokens`). Never imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from fastar.serve.api_error import ContextOverflow, bad_request
from fastar.serve.turn import Backend, Conversation, prompt_ids

MODES = ("disabled", "auto")
GRID_PARTS = 4  # the candidate cuts are about a quarter of the context apart (the step of `grid`)


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


def rounds(conversation: list[dict]) -> list[list[int]]:
    """The indices of the messages after the last user message (all of them where there is none), one list per tool
    round, oldest first: a run of assistant messages (one turn of the model: its reasoning, text and function calls)
    with the tool messages after it up to the next assistant message. System messages are in none, nor tool
    messages before the first assistant message (the encoder folds them into the user turn)."""
    users = [i for i, m in enumerate(conversation) if m.get("role") == "user"]
    out: list[list[int]] = []
    previous = "user"
    for i in range(users[-1] + 1 if users else 0, len(conversation)):
        role = conversation[i].get("role")
        if role == "system":
            continue
        if role == "assistant" and previous != "assistant":
            out.append([i])
        elif out:
            out[-1].append(i)
        previous = role
    return out


def droppable(conversation: list[dict]) -> list[list[int]]:
    """What `auto` may drop, one list of message indices per step, in the order it drops them: the exchanges
    before the last user message, then the tool rounds after it but the latest. Where a tool message answers a call
    of an earlier step (a conversation the API's items can spell, not one the model wrote), the steps from the
    call's to the output's go as one; where the output is never dropped, neither is anything from the call's step
    on, so no output is kept whose call is gone."""
    groups = exchanges(conversation) + rounds(conversation)[:-1]
    owner = {i: g for g, group in enumerate(groups) for i in group}
    kept = len(groups)  # the step of what is never dropped
    forbidden = [0] * (kept + 2)  # forbidden[n] > 0 (as a running sum): dropping exactly n steps would part a pair
    calls: dict[str, int] = {}
    for i, msg in enumerate(conversation):
        step = owner.get(i, kept)
        if msg.get("role") == "assistant":
            calls.update((call.get("id"), step) for call in msg.get("tool_calls") or [])
        elif msg.get("role") == "tool":
            call = calls.get(msg.get("tool_call_id"), step)
            if call < step:  # dropping n steps with call < n <= step keeps the output without its call
                forbidden[call + 1] += 1
                forbidden[step + 1] -= 1
    out: list[list[int]] = []
    parting, pending = 0, []
    for n in range(1, kept + 1):  # may `n` steps be dropped?
        pending += groups[n - 1]
        parting += forbidden[n]
        if not parting:
            out.append(pending)
            pending = []
    return out


def grid(sizes: list[int], step: int) -> list[int]:
    """The candidate cuts, as numbers of steps to drop (increasing, each at least 1): for each multiple of `step` up
    to the sizes' total, the fewest steps from the start whose sizes add up to at least it. A cut depends only on the
    sizes up to it, so steps added at the end never move one."""
    if step < 1:
        raise ValueError(f"grid step must be at least 1, got {step}")
    cuts, total, target = [], 0, step
    for n, size in enumerate(sizes, 1):
        total += size
        if total >= target:
            cuts.append(n)
            target = (total // step + 1) * step
    return cuts


def sizes(backend: Backend, conv: Conversation, conversation: list[dict], groups: list[list[int]]) -> list[int]:
    """Each step's size for `grid`: the tokens of its messages, each rendered as a conversation of its own (in
    `conv`'s mode) and tokenized as any prompt (a message of more characters than the context could hold counts as
    the context), so a step's size depends on nothing around it. Every message is tokenized once."""
    context = backend.engine().context_length
    assert backend.admission is not None  # set in __post_init__

    def tokens(message: dict) -> int:
        alone = Conversation([message], conv.thinking, None, conv.drop_thinking, conv.param).render()
        try:
            return len(backend.admission.encode(alone, conv.param))
        except ContextOverflow:
            return context

    return [sum(tokens(conversation[i]) for i in group) for group in groups]


def fit(
    backend: Backend, conversation: list[dict], render: Callable[[list[dict]], Conversation], room: int
) -> tuple[Conversation, tuple[str, list[int]]]:
    """The prompt of `conversation` with its earliest `droppable` steps dropped that leaves `room` tokens of the
    context: the smallest of the `grid` cuts (a `GRID_PARTS`th of the context apart in `sizes`) that does, else the
    fewest steps that do. The `Conversation` (`render` of the kept messages: instructions and tools put on) and its
    rendered text and ids. Where even dropping all of them leaves no room, the whole conversation's, for the usual
    400 (raised here where its characters alone refuse it)."""
    context = backend.engine().context_length
    groups = droppable(conversation)

    def attempt(drop: int) -> tuple[Conversation, tuple[str, list[int]] | ContextOverflow]:
        gone = {i for group in groups[:drop] for i in group}
        conv = render([m for i, m in enumerate(conversation) if i not in gone])
        try:
            return conv, prompt_ids(backend, conv)
        except ContextOverflow as err:  # refused by its characters, before tokenizing
            return conv, err

    def fits(tried: tuple[Conversation, tuple[str, list[int]] | ContextOverflow]) -> bool:
        return isinstance(tried[1], tuple) and len(tried[1][1]) + room <= context

    def first_fitting(cuts: Sequence[int]) -> tuple[Conversation, tuple[str, list[int]] | ContextOverflow] | None:
        """The try of the first of `cuts` (increasing) that fits, bisected; None where the last does not."""
        if not cuts or not fits(last := attempt(cuts[-1])):
            return None
        chosen, low, high = last, -1, len(cuts) - 1  # cuts[low] does not fit (-1: none dropped), cuts[high] does
        while high - low > 1:
            mid = (low + high) // 2
            tried = attempt(cuts[mid])
            if fits(tried):
                chosen, high = tried, mid
            else:
                low = mid
        return chosen

    chosen = whole = attempt(0)
    if not fits(whole) and groups:
        cuts = grid(sizes(backend, whole[0], conversation, groups), max(context // GRID_PARTS, 1))
        finer = range(cuts[-1] + 1 if cuts else 1, len(groups) + 1)  # past the last candidate, which did not fit
        chosen = first_fitting(cuts) or first_fitting(finer) or whole
    conv, prompt = chosen
    if isinstance(prompt, ContextOverflow):
        raise prompt
    return conv, prompt
