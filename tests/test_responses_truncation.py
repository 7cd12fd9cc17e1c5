"""The Responses API's `truncation` (fastar/serve/truncation.py) over the FakeEngine of test_server.py, through the
real worker: with "auto" a conversation too long for the context loses its earliest exchanges, then (an agent run:
one user message and many call rounds) the oldest tool rounds after its last user message, and no more of them
than it must, until the reply has room (the prompt the engine receives is the kept conversation's rendering, and
the kept items render as they did in the whole one); a function call and its output go together, reasoning with
its turn; the instructions, developer messages, the last user message and the latest round stay; with "disabled"
(the default), or where what stays does not fit, the 400 context error; a bad value is a 400."""

from __future__ import annotations

import json

import pytest
from test_agents_api import make_backend, sse_events
from test_server import WEATHER_TOOL, FakeEngine

from fastar.serve import responses as R
from fastar.serve import truncation
from fastar.serve.api_error import APIError

NO_THINK = {"reasoning": {"effort": "none"}, "temperature": 0}  # no thinking; the reply "Echo: <question>"
INSTRUCTIONS = "Answer briefly."


class PromptsEngine(FakeEngine):
    """FakeEngine that keeps the prompts it was asked to reply to."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.prompts: list[str] = []

    def reply(self, prompt: str, params) -> str:
        self.prompts.append(prompt)
        return super().reply(prompt, params)


@pytest.fixture
def setup():
    engine = PromptsEngine()
    backend, host = make_backend(engine)
    yield engine, backend
    host.shutdown()


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def said(text: str) -> dict:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


CONVERSATION = [
    {"type": "message", "role": "developer", "content": "Use metric units."},
    user("first question " * 20),
    {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "thought one"}]},
    said("first answer"),
    user("second question " * 20),
    said("second answer"),
    user("third question " * 20),
    said("third answer"),
    user("what now?"),
]


def prompt_of(backend, items: list[dict], tools: list[dict] | None = None, mode: dict = NO_THINK) -> tuple[str, int]:
    """The rendering and token count of a request of these items (as the engine would receive it)."""
    body = {"input": items, "instructions": INSTRUCTIONS, "tools": tools, **mode}
    text = R.parse_request(body, backend, R.ResponseStore()).conv.render()
    return text, len(backend.engine().tokenizer.encode(text))


def ask(**kw) -> dict:
    return {"instructions": INSTRUCTIONS, **NO_THINK, **kw}


def refused_as_when_disabled(body: dict, backend) -> None:
    """`truncation: "auto"` on `body` is the 400 the request gets without it, word for word."""
    with pytest.raises(APIError) as disabled:
        R.create(body, backend, R.ResponseStore())
    with pytest.raises(APIError) as auto:
        R.create({**body, "truncation": "auto"}, backend, R.ResponseStore())
    assert auto.value.status == 400 and auto.value.code == "context_length_exceeded"
    assert auto.value.message == disabled.value.message


@pytest.mark.parametrize("dropped", [1, 2, 3])
def test_auto_drops_the_fewest_earliest_exchanges_that_leave_room_for_the_reply(setup, dropped):
    engine, backend = setup
    first_kept = {1: 4, 2: 6, 3: 8}[dropped]  # exchanges: items 1-3 (with reasoning), 4-5, 6-7
    text, tokens = prompt_of(backend, CONVERSATION[:1] + CONVERSATION[first_kept:])
    longer = prompt_of(backend, CONVERSATION[:1] + CONVERSATION[{1: 1, 2: 4, 3: 6}[dropped] :])[1]
    engine.context_length = tokens + 20  # room for max_output_tokens, and one exchange fewer would not leave it
    assert longer + 20 > engine.context_length
    body = ask(input=CONVERSATION, max_output_tokens=20)
    for disabled in (body, {**body, "truncation": "disabled"}):
        with pytest.raises(APIError) as err:
            R.create(disabled, backend, R.ResponseStore())
        assert err.value.status == 400 and err.value.code == "context_length_exceeded"
    out = R.create({**body, "truncation": "auto"}, backend, R.ResponseStore())
    assert out["status"] == "completed" and out["truncation"] == "auto"
    assert out["output"][-1]["content"][0]["text"] == "Echo: what now?"
    assert engine.prompts[-1] == text and out["usage"]["input_tokens"] == tokens
    assert "Use metric units." in text and "first question" not in text  # the developer message stays
    events = sse_events(R.create({**body, "truncation": "auto", "stream": True}, backend, R.ResponseStore()))
    assert events[-1][1]["response"]["truncation"] == "auto" and engine.prompts[-1] == text


def test_without_max_output_tokens_the_reply_needs_one_token_of_room(setup):
    engine, backend = setup
    text, tokens = prompt_of(backend, CONVERSATION[:1] + CONVERSATION[4:])
    engine.context_length = tokens + 1
    out = R.create(ask(input=CONVERSATION, truncation="auto"), backend, R.ResponseStore())
    assert engine.prompts[-1] == text and out["status"] == "incomplete"  # one token, then the context is full


def test_a_function_call_and_its_output_are_dropped_or_kept_together(setup):
    engine, backend = setup
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"location": "Oslo"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "cold"}
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}]
    # A long first question and a short call pair: dropping items one by one would leave an orphan call or output.
    earlier = [user("first question " * 30), call, output, said("It is cold."), user("and tomorrow?")]
    text, tokens = prompt_of(backend, earlier[-1:], tools)
    engine.context_length = prompt_of(backend, earlier[1:], tools)[1] + 20  # would fit without the question
    out = R.create(ask(input=earlier, tools=tools, max_output_tokens=20, truncation="auto"), backend, R.ResponseStore())
    assert out["status"] == "completed" and engine.prompts[-1] == text and out["usage"]["input_tokens"] == tokens
    assert "Oslo" not in text and "cold" not in text
    # The turn being answered keeps its call and output, whatever is dropped before it.
    current = [user("first question " * 30), said("noted"), user("what about Oslo?"), call, output]
    text, tokens = prompt_of(backend, current[2:], tools)
    engine.context_length = tokens + 200
    out = R.create(
        ask(input=current, tools=tools, max_output_tokens=200, truncation="auto"), backend, R.ResponseStore()
    )
    assert engine.prompts[-1] == text and "Oslo" in text and "cold" in text and "first question" not in text


def test_exchanges_group_calls_with_their_outputs_and_skip_system_messages():
    conversation = [
        {"role": "system", "content": "s"},
        {"role": "assistant", "content": "hello"},  # before any user message: an exchange of its own
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [{"id": "c"}]},
        {"role": "system", "content": "mid"},
        {"role": "tool", "tool_call_id": "c", "content": "out"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "u3"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "d"}]},
        {"role": "tool", "tool_call_id": "d", "content": "out"},
    ]
    assert truncation.exchanges(conversation) == [[1], [2, 3, 5], [6, 7]]
    assert truncation.exchanges(conversation[8:]) == []
    assert truncation.exchanges([{"role": "tool", "content": "x"}]) == []


def test_when_the_last_turn_alone_does_not_fit_it_is_the_usual_400(setup):
    engine, backend = setup
    tokens = prompt_of(backend, CONVERSATION[:1] + CONVERSATION[-1:])[1]
    engine.context_length = tokens + 19
    body = ask(input=CONVERSATION, max_output_tokens=20)
    refused_as_when_disabled(body, backend)


def test_a_conversation_refused_by_its_characters_is_truncated_too(setup):
    """Before tokenizing, a prompt of more characters than the context could hold is refused (admission); with
    "auto" that is one more conversation that does not fit: its first exchange goes."""
    engine, backend = setup
    huge = [user("x" * (engine.context_length * 40)), said("ok"), user("what now?")]
    with pytest.raises(APIError) as err:
        R.create(ask(input=huge), backend, R.ResponseStore())
    assert err.value.code == "context_length_exceeded" and "characters" in err.value.message
    out = R.create(ask(input=huge, truncation="auto"), backend, R.ResponseStore())
    assert engine.prompts[-1] == prompt_of(backend, huge[-1:])[0] and out["status"] == "completed"


def test_a_previous_response_s_conversation_is_truncated_as_given_items_are(setup):
    engine, backend = setup
    store = R.ResponseStore()
    first = R.create(ask(input="first question " * 20), backend, store)
    text, tokens = prompt_of(backend, [user("what now?")])
    engine.context_length = tokens + 20
    body = ask(input="what now?", previous_response_id=first["id"], max_output_tokens=20, truncation="auto")
    out = R.create(body, backend, store)
    assert engine.prompts[-1] == text and R.retrieve(out["id"], store)["truncation"] == "auto"
    engine.context_length = 4096  # the store keeps the whole conversation: a larger context sees all of it
    R.create({**body, "previous_response_id": out["id"], "input": "and then?"}, backend, store)
    assert "first question" in engine.prompts[-1]


@pytest.mark.parametrize("value", ["always", "", 1, True, {"type": "auto"}, ["auto"]])
def test_a_bad_truncation_is_a_400_naming_it(setup, value):
    _, backend = setup
    with pytest.raises(APIError) as err:
        R.create(ask(input="hi", truncation=value), backend, R.ResponseStore())
    assert err.value.status == 400 and err.value.param == "truncation" and "'truncation'" in err.value.message


def test_truncation_is_echoed_as_given(setup):
    _, backend = setup
    for given, echoed in ((None, "disabled"), ("disabled", "disabled"), ("auto", "auto")):
        assert R.create(ask(input="hi", truncation=given), backend, R.ResponseStore())["truncation"] == echoed
    assert R.create(ask(input="hi"), backend, R.ResponseStore())["truncation"] == "disabled"


# ---------------------------------------------------------------------------------------------------------
# An agent run: one user message, then round after round of function calls
# ---------------------------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}]
MODES = {"chat": NO_THINK, "thinking": {"reasoning": {"effort": "high"}, "temperature": 0}}
ROOM = 200  # max_output_tokens: the reply echoes the last tool outputs (and thinks first) without being cut


def round_of(n: int, calls: int = 1, text: str = "") -> list[dict]:
    """One turn of the model (its reasoning, any text, `calls` function calls) and the outputs of its calls."""
    ids = [f"call_{n}_{k}" for k in range(calls)]
    turn = [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": f"thought {n}"}]}]
    turn += [said(text)] if text else []
    turn += [
        {
            "type": "function_call",
            "call_id": i,
            "name": "get_weather",
            "arguments": json.dumps({"location": f"city {n}.{k}"}),
        }
        for k, i in enumerate(ids)
    ]
    return turn + [
        {"type": "function_call_output", "call_id": i, "output": f"report {n}.{k}: " + "mild " * 15}
        for k, i in enumerate(ids)
    ]


TASK = [{"type": "message", "role": "developer", "content": "Use metric units."}, user("Plan a trip. " * 8)]
ROUNDS = [round_of(1), round_of(2, text="Checking the next city."), round_of(3, calls=2), round_of(4), round_of(5)]


def agent_run(dropped: int, rounds: list[list[dict]] = ROUNDS) -> list[dict]:
    """The task and its rounds less the `dropped` oldest."""
    return TASK + [item for r in rounds[dropped:] for item in r]


def agent_body(items: list[dict], tools: list[dict] | None, mode: dict, **kw) -> dict:
    return {"input": items, "instructions": INSTRUCTIONS, "tools": tools, **mode, "max_output_tokens": ROOM, **kw}


def assert_cut_from(whole: str, kept: str) -> None:
    """`kept` is `whole` with one stretch taken out: the items kept render as they did in the whole conversation."""

    def common(a: str, b: str) -> int:  # the length of their common start
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    head, tail = common(whole, kept), common(whole[::-1], kept[::-1])
    assert len(kept) < len(whole) and head + tail >= len(kept), (whole, kept)


def candidates(backend, items: list[dict], tools: list[dict] | None, mode: dict) -> list[int]:
    """The cuts "auto" may choose for these items (numbers of droppable steps), at the engine's context now."""
    req = R.parse_request(agent_body(items, tools, mode), backend, R.ResponseStore())
    groups = truncation.droppable(req.conversation)
    step = backend.engine().context_length // truncation.GRID_PARTS
    return truncation.grid(truncation.sizes(backend, req.conv, req.conversation, groups), step)


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("fewest", [1, 2, 4])
def test_an_agent_run_drops_its_oldest_tool_rounds_at_the_first_cut_that_leaves_room(setup, fewest, mode, tools):
    """The context leaves room once `fewest` rounds are dropped; the prompt drops the rounds up to the first
    candidate cut at or after that (a quarter of the context apart, so the cut stays put over turns)."""
    engine, backend = setup
    tokens = prompt_of(backend, agent_run(fewest), tools, mode)[1]
    engine.context_length = tokens + ROOM  # one round fewer dropped would not leave it
    assert prompt_of(backend, agent_run(fewest - 1), tools, mode)[1] + ROOM > engine.context_length
    cut = next(c for c in candidates(backend, agent_run(0), tools, mode) if c >= fewest)
    text, tokens = prompt_of(backend, agent_run(cut), tools, mode)
    body = agent_body(agent_run(0), tools, mode)
    with pytest.raises(APIError) as err:
        R.create(body, backend, R.ResponseStore())
    assert err.value.code == "context_length_exceeded"
    out = R.create({**body, "truncation": "auto"}, backend, R.ResponseStore())
    assert out["status"] == "completed" and engine.prompts[-1] == text and out["usage"]["input_tokens"] == tokens
    assert_cut_from(prompt_of(backend, agent_run(0), tools, mode)[0], text)
    assert "Use metric units." in text and "Plan a trip." in text and "city 5.0" in text and "report 5.0" in text
    assert all(f"city {n}." not in text and f"report {n}." not in text for n in range(1, cut + 1))
    assert all(f"city {n}." in text for n in range(cut + 1, len(ROUNDS) + 1))
    assert ("thought 5" in text) == (mode is MODES["thinking"] and tools is not None)  # the encoder's rule, kept
    events = sse_events(R.create({**body, "truncation": "auto", "stream": True}, backend, R.ResponseStore()))
    assert events[-1][0] == "response.completed" and engine.prompts[-1] == text


# encoder messages: an exchange, then the last user message, an orphan tool output and three rounds
MESSAGES = [
    {"role": "user", "content": "u1"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "a"}]},
    {"role": "tool", "tool_call_id": "a", "content": "out"},
    {"role": "user", "content": "u2"},
    {"role": "tool", "tool_call_id": "x", "content": "out"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "b"}]},
    {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [{"id": "c"}]},
    {"role": "tool", "tool_call_id": "b", "content": "out"},
    {"role": "system", "content": "mid"},
    {"role": "tool", "tool_call_id": "c", "content": "out"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "d"}]},
    {"role": "tool", "tool_call_id": "d", "content": "out"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "e"}]},
    {"role": "tool", "tool_call_id": "e", "content": "out"},
]


def test_a_turn_s_reasoning_calls_and_outputs_are_one_round():
    conversation = R.input_messages(agent_run(0))  # system, user, then rounds of 2, 2, 3, 2 and 2 messages
    assert [m["role"] for m in conversation[:2]] == ["system", "user"]
    assert truncation.rounds(conversation) == [[2, 3], [4, 5], [6, 7, 8], [9, 10], [11, 12]]
    assert truncation.droppable(conversation) == [[2, 3], [4, 5], [6, 7, 8], [9, 10]]  # the latest round stays
    assert conversation[4]["reasoning_content"] == "thought 2" and conversation[4]["content"]  # reasoning, text, call
    # Calls the model interleaved with reasoning (two assistant messages in a row) and a system message among the
    # outputs: still one round; a tool output right after the user message joins the user turn, in no round.
    assert truncation.rounds(MESSAGES) == [[5, 6, 7, 9], [10, 11], [12, 13]]
    assert truncation.droppable(MESSAGES) == [[0, 1, 2], [5, 6, 7, 9], [10, 11]]
    assert truncation.rounds(MESSAGES[:4]) == [] and truncation.droppable(MESSAGES[:4]) == [[0, 1, 2]]


@pytest.mark.parametrize(
    ("where", "answers", "expected"),
    [
        (11, "b", [[0, 1, 2], [5, 6, 7, 9, 10, 11]]),  # round 2 answers round 1: the two go together
        (13, "d", [[0, 1, 2], [5, 6, 7, 9]]),  # the latest round answers round 2: round 2 stays with it
        (13, "a", []),  # the latest round answers the first exchange: nothing before it may go
        (4, "a", []),  # so does the tool output joined to the last user turn
    ],
)
def test_no_output_is_kept_whose_call_is_dropped(where, answers, expected):
    messages = [dict(m) for m in MESSAGES]
    messages[where] = {**messages[where], "tool_call_id": answers}
    assert truncation.droppable(messages) == expected


def test_an_output_of_an_earlier_round_s_call_keeps_that_round(setup):
    """An output in the latest round answering round 2's call: round 1 may go, round 2 may not."""
    engine, backend = setup
    late = {"type": "function_call_output", "call_id": "call_2_0", "output": "late report"}
    rounds = [*ROUNDS[:2], [*ROUNDS[2], late]]
    text, tokens = prompt_of(backend, agent_run(1, rounds), TOOLS)
    engine.context_length = tokens + ROOM
    out = R.create(agent_body(agent_run(0, rounds), TOOLS, NO_THINK, truncation="auto"), backend, R.ResponseStore())
    assert engine.prompts[-1] == text and out["usage"]["input_tokens"] == tokens and "city 2.0" in text
    engine.context_length = prompt_of(backend, agent_run(2, rounds), TOOLS)[1] + ROOM  # fits only without round 2
    with pytest.raises(APIError) as err:
        R.create(agent_body(agent_run(0, rounds), TOOLS, NO_THINK, truncation="auto"), backend, R.ResponseStore())
    assert err.value.code == "context_length_exceeded"


@pytest.mark.parametrize("stream", [False, True])
def test_the_user_message_and_the_latest_round_always_stay(setup, stream):
    """Where the user message and the latest round fit with the reply's room, that is the prompt; one token less of
    context and it is the 400 "disabled" gives, streaming or not."""
    engine, backend = setup
    text, tokens = prompt_of(backend, agent_run(len(ROUNDS) - 1), TOOLS)
    body = agent_body(agent_run(0), TOOLS, NO_THINK, stream=stream)
    engine.context_length = tokens + ROOM - 1
    refused_as_when_disabled(body, backend)
    engine.context_length = tokens + ROOM
    out = R.create({**body, "truncation": "auto"}, backend, R.ResponseStore())
    final = sse_events(out)[-1][1]["response"] if stream else out
    assert final["status"] == "completed" and engine.prompts[-1] == text
    assert "Plan a trip." in text and "report 5.0" in text and "city 4." not in text


def test_an_agent_loop_over_previous_response_id_drops_its_oldest_rounds(setup):
    """The model calls a tool, the client answers it, round after round (each reply's reasoning and call stored):
    a conversation grown too long keeps the task and the rounds that fit, rendered as the model saw them."""
    engine, backend = setup
    store, mode = R.ResponseStore(), MODES["thinking"]
    items = [user("What is the weather like?")]
    out = R.create(agent_body(items, TOOLS, mode), backend, store)
    rounds = []
    for n in range(4):
        call = out["output"][-1]
        assert call["type"] == "function_call"
        answer = {"type": "function_call_output", "call_id": call["call_id"], "output": f"weather {n}: " + "fair " * 9}
        rounds.append([*out["output"], answer])
        last = out
        out = R.create(agent_body([answer], TOOLS, mode, previous_response_id=out["id"]), backend, store)
    assert out["output"][-1]["type"] == "function_call" and "weather 3" in engine.prompts[-1]
    text, tokens = prompt_of(backend, items + rounds[2] + rounds[3], TOOLS, mode)
    assert "Thinking about" in text  # the kept rounds' reasoning is rendered (tools: earlier thinking is kept)
    engine.context_length = tokens + ROOM
    body = agent_body([rounds[3][-1]], TOOLS, mode, previous_response_id=last["id"], truncation="auto")
    R.create(body, backend, store)
    assert engine.prompts[-1] == text and "What is the weather like?" in text
    assert "weather 1: fair fair" not in text and "weather 2: fair fair" in text


# ---------------------------------------------------------------------------------------------------------
# Where the cut falls: candidate cuts fixed by the conversation's beginning, so it stays put over turns
# ---------------------------------------------------------------------------------------------------------


def test_grid_cuts_at_the_first_step_reaching_each_multiple_of_the_step():
    assert truncation.grid([3, 3, 3, 3, 3, 3], 5) == [2, 4, 5]  # totals 6 >= 5, 12 >= 10, 15 >= 15
    assert truncation.grid([1, 12, 1, 1, 9], 5) == [2, 4, 5]  # 13 passes 5 and 10 at once; then 15, then 24 >= 20
    assert truncation.grid([4, 4], 10) == [] and truncation.grid([], 3) == []
    sizes = [7, 1, 30, 2, 2, 9, 14, 3, 3, 3, 40, 1]
    for n in range(len(sizes)):  # steps added at the end never move a cut: a prefix's cuts start the whole's
        cuts = truncation.grid(sizes[:n], 10)
        assert truncation.grid(sizes, 10)[: len(cuts)] == cuts
    with pytest.raises(ValueError, match="at least 1"):
        truncation.grid([1], 0)


def test_a_step_s_size_is_its_own_tokens_whatever_follows(setup):
    """A round's size is about what dropping it takes off the prompt, and neither later rounds nor a later user
    message change it; a message of more characters than the context could hold counts as the context."""
    engine, backend = setup

    def sizes(items: list[dict]) -> list[int]:
        req = R.parse_request(agent_body(items, TOOLS, NO_THINK), backend, R.ResponseStore())
        return truncation.sizes(backend, req.conv, req.conversation, truncation.droppable(req.conversation))

    first = sizes(agent_run(0))
    groups = truncation.droppable(R.input_messages(agent_run(0)))
    assert len(first) == len(groups) == len(ROUNDS) - 1
    for dropped, (size, group) in enumerate(zip(first, groups)):  # each message alone: its BOS, a turn's opening
        shrinks = (
            prompt_of(backend, agent_run(dropped), TOOLS)[1] - prompt_of(backend, agent_run(dropped + 1), TOOLS)[1]
        )
        assert 0 <= size - shrinks <= 2 * len(group), (dropped, size, shrinks)
    later = [*ROUNDS, round_of(6), round_of(7, calls=3)]
    assert sizes(agent_run(0, later))[: len(first)] == first
    # A new user message: the task and all its rounds become one exchange, whose size is theirs added up.
    step = sizes([*TASK, user("next task")]) + sizes(agent_run(0, [*later, round_of(8)]))
    assert sizes([*agent_run(0, later), user("next task")]) == [sum(step)]
    huge = [user("x" * engine.context_length * 40), said("ok"), *agent_run(0)]
    assert sizes(huge)[0] == engine.context_length + sizes([said("ok"), user("q")])[0]


def test_where_no_candidate_cut_fits_the_fewest_rounds_that_do_are_dropped(setup):
    """What must stay is within a quarter of the context of the limit: the candidate cuts all stop short of the
    fewest rounds that leave room, and those are dropped (the kept minimum fitting is enough to be answered)."""
    engine, backend = setup
    last = len(ROUNDS) - 1
    engine.context_length = prompt_of(backend, agent_run(last - 1), TOOLS)[1] + ROOM - 1  # one round too many
    assert candidates(backend, agent_run(0), TOOLS, NO_THINK)[-1] < last  # no candidate cut drops enough
    text, tokens = prompt_of(backend, agent_run(last), TOOLS)
    out = R.create(agent_body(agent_run(0), TOOLS, NO_THINK, truncation="auto"), backend, R.ResponseStore())
    assert out["status"] == "completed" and engine.prompts[-1] == text and out["usage"]["input_tokens"] == tokens


def fewest_fitting(backend, turns: list[list[dict]], tools, mode) -> list[int]:
    """Per turn (its items, then the task and rounds), the fewest leading rounds whose dropping leaves the reply its
    room: what "auto" dropped before its cuts were fixed (a round at a time, nearly every turn)."""
    out, drop, context = [], 0, backend.engine().context_length
    for rounds in turns:
        while prompt_of(backend, agent_run(drop, rounds), tools, mode)[1] + ROOM > context:
            drop += 1
        out.append(drop)
    return out


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_a_long_agent_run_keeps_its_prompt_s_prefix_for_many_turns(setup, mode):
    """Each turn resends the conversation with one more round (one to three calls each). Once it no longer fits,
    the prompt drops its oldest rounds at a cut that stays put while it fits: each turn's prompt is the previous
    one with the model's turn and the new outputs appended (so the previous prompt's state covers all of it), and
    only a few turns cut again, each dropping about a quarter of the context at once. Dropping the fewest rounds
    instead would cut anew nearly every turn, and every kept round would be prefilled again."""
    engine, backend = setup
    engine.context_length = 6000  # the task and tools ~1,150 tokens, a round ~250-480: a quarter is 3-6 rounds
    rounds = [round_of(n, calls=1 + (n % 4 == 0) + (n % 7 == 0)) for n in range(1, 41)]
    turns = [rounds[:n] for n in range(1, len(rounds) + 1)]
    prompts, first_kept = [], []
    for n, kept in enumerate(turns):
        out = R.create(agent_body(agent_run(0, kept), TOOLS, mode, truncation="auto"), backend, R.ResponseStore())
        prompt = engine.prompts[-1]
        assert out["usage"]["input_tokens"] + ROOM <= engine.context_length  # (a long echo may be cut: "incomplete")
        assert "Plan a trip." in prompt and f"report {n + 1}.0" in prompt  # the task and the latest round stay
        whole = prompt_of(backend, agent_run(0, kept), TOOLS, mode)[0]
        assert prompt == whole or assert_cut_from(whole, prompt) is None
        first_kept.append(next(m for m in range(1, n + 2) if f"city {m}.0" in prompt))
        prompts.append(prompt)
    cut_turns = [n for n in range(1, len(turns)) if first_kept[n] != first_kept[n - 1]]
    truncated = [n for n in range(len(turns)) if first_kept[n] > 1]
    assert len(truncated) >= 20  # the run went on long past the limit
    for n in range(1, len(turns)):  # between cuts each prompt starts with the whole previous one
        assert prompts[n].startswith(prompts[n - 1]) == (n not in cut_turns), n
    assert 2 <= len(cut_turns) <= len(truncated) // 3, (cut_turns, truncated)  # each cut drops 3 rounds or more
    assert all(first_kept[n] - first_kept[n - 1] >= 3 for n in cut_turns)  # a quarter of the context at once
    fewest = fewest_fitting(backend, turns, TOOLS, mode)
    assert all(f + 1 <= first for f, first in zip(fewest, first_kept))  # never fewer dropped than must be
    moves = [n for n in range(1, len(turns)) if fewest[n] != fewest[n - 1]]
    assert len(moves) >= 3 * len(truncated) // 4  # where dropping the fewest would cut anew on most turns


def test_auto_s_cut_and_counts_are_the_same_with_and_without_the_tokenizer_s_run_cache():
    """The real tokenizer keeps the ids of the runs it tokenized (`fastar.engine.tokenizer.RunCache`), so an agent's
    resent history costs only its new messages: over an agent's turns (a reply and a question added each), `auto`
    keeps the same messages, the steps have the same sizes and the prompt the same ids as with the uncached
    tokenizer, whether or not the cache already holds the history (each turn asked twice)."""
    import random
    from types import SimpleNamespace

    import tokenizers

    from fastar.engine.tokenizer import Tokenizer, default_tokenizer_path
    from fastar.serve.turn import Backend, Conversation

    hf = tokenizers.Tokenizer.from_file(str(default_tokenizer_path()))
    rng = random.Random(2)
    words = ["the", " value", " of", "\n", "def f(x):", " 42", "日本語", "<｜User｜>", " kernel", " buffer"]
    say = lambda n: "".join(rng.choice(words) for _ in range(n))  # noqa: E731
    conversation = [{"role": "system", "content": "Be brief."}]
    for i in range(30):
        conversation.append({"role": "user" if i % 2 == 0 else "assistant", "content": say(rng.randrange(40, 120))})
    conversation.append({"role": "user", "content": "and now?"})

    def backend_of(tok: Tokenizer) -> Backend:
        eng = SimpleNamespace(tokenizer=tok, context_length=900, context_note=None)
        return Backend(engine=lambda: eng, submit=lambda job: None)

    cached, uncached = backend_of(Tokenizer(hf)), backend_of(Tokenizer(hf, run_cache_chars=0))
    render = lambda messages: Conversation(list(messages), True, None, True, "input")  # noqa: E731
    cuts = set()
    for _ in range(4):
        seen = []
        for backend in (cached, uncached, cached):
            conv, (_, ids) = truncation.fit(backend, conversation, render, 64)
            groups = truncation.droppable(conversation)
            seen.append((conv.messages, ids, truncation.sizes(backend, render(conversation), conversation, groups)))
        assert seen[0] == seen[1] == seen[2]
        assert len(seen[0][1]) + 64 <= 900 and len(seen[0][0]) < len(conversation)  # it was cut, and fits
        cuts.add(len(conversation) - len(seen[0][0]))
        conversation = [*conversation, {"role": "assistant", "content": say(60)}, {"role": "user", "content": say(9)}]
    assert cached.engine().tokenizer.runs and len(cuts) > 1  # runs were kept; the cut moved over the turns
