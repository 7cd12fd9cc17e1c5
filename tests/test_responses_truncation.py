"""The Responses API's `truncation` (fastar/serve/truncation.py) over the FakeEngine of test_server.py, through the
real worker: with "auto" a conversation too long for the context loses its earliest exchanges, and no more of them
than it must, until the reply has room (the prompt the engine receives is the kept conversation's rendering); a
function call and its output go together; the instructions, developer messages and the last user turn stay; with
"disabled" (the default), or where the last turn alone does not fit, the 400 context error; a bad value is a 400."""

from __future__ import annotations

import pytest
from test_agents_api import make_backend, sse_events
from test_server import WEATHER_TOOL, FakeEngine

from fastar.serve import responses as R
from fastar.serve.api_error import APIError
from fastar.serve.truncation import exchanges

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


def prompt_of(backend, items: list[dict], tools: list[dict] | None = None) -> tuple[str, int]:
    """The rendering and token count of a request of these items (as the engine would receive it)."""
    body = {"input": items, "instructions": INSTRUCTIONS, "tools": tools, **NO_THINK}
    text = R.parse_request(body, backend, R.ResponseStore()).conv.render()
    return text, len(backend.engine().tokenizer.encode(text))


def ask(**kw) -> dict:
    return {"instructions": INSTRUCTIONS, **NO_THINK, **kw}


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
    assert exchanges(conversation) == [[1], [2, 3, 5], [6, 7]]
    assert exchanges(conversation[8:]) == [] and exchanges([{"role": "tool", "content": "x"}]) == []


def test_when_the_last_turn_alone_does_not_fit_it_is_the_usual_400(setup):
    engine, backend = setup
    tokens = prompt_of(backend, CONVERSATION[:1] + CONVERSATION[-1:])[1]
    engine.context_length = tokens + 19
    body = ask(input=CONVERSATION, max_output_tokens=20)
    with pytest.raises(APIError) as disabled:
        R.create(body, backend, R.ResponseStore())
    with pytest.raises(APIError) as auto:
        R.create({**body, "truncation": "auto"}, backend, R.ResponseStore())
    assert auto.value.status == 400 and auto.value.code == "context_length_exceeded"
    assert auto.value.message == disabled.value.message


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
