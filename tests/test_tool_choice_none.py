"""`tool_choice` "none" (Anthropic `{"type": "none"}`) in the three API shapes, over the FakeEngine of
test_server.py: the tools stay in the prompt, which renders exactly as under "auto" (a turn with "none" after one
with "auto", and back, reuses the whole previous prompt: the reported cached tokens), and the DSML marker every
tool call starts with is banned (`banned_token_ids`, looked up in the tokenizer), so where the scripted model would
call a tool it writes text instead; streamed, with n > 1 and under a response_format grammar too."""

from __future__ import annotations

import pytest
from test_agents_api import API_KEY, WEATHER, App, make_backend
from test_server import BANNED_ALTERNATIVE, NO_THINK, WEATHER_TOOL, FakeEngine, FakeTokenizer, client, start_server

from fastar.encoding import DSML
from fastar.serve import anthropic as A
from fastar.serve import grammar_fields, openai_request
from fastar.serve import responses as R
from fastar.serve.api_error import APIError

anthropic = pytest.importorskip("anthropic", reason="the anthropic client is a test dependency")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency")

DSML_ID = FakeTokenizer().token_to_id(DSML)
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    **{k: WEATHER_TOOL["function"][k] for k in ("description", "parameters")},
}


@pytest.fixture
def app():
    backend, host = make_backend(FakeEngine())
    app = App(backend)
    yield app
    app.close()
    host.shutdown()


def test_none_renders_the_prompt_auto_does_and_bans_the_dsml_marker():
    """The parsed request under "none" carries the same rendered prompt as under "auto" (tools included), no tool
    grammar (a response_format still gets its JSON grammar, without calls), and the marker that becomes the DSML
    token's ban for the engine; without tools there is nothing to ban."""
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER_TOOL]}
    auto = openai_request.parse_chat_request(base, ("m",))
    none = openai_request.parse_chat_request({**base, "tool_choice": "none"}, ("m",))
    assert none.messages == auto.messages and none.messages[0]["tools"] and none.has_tools
    assert none.sampling[grammar_fields.NO_TOOL_CALLS] and grammar_fields.NO_TOOL_CALLS not in auto.sampling
    engine = FakeEngine()
    assert grammar_fields.compiled_sampling(engine, none.sampling)["banned_token_ids"] == [DSML_ID]
    fmt = {"response_format": {"type": "json_object"}}
    strict = openai_request.parse_chat_request({**base, "tool_choice": "none", **fmt}, ("m",))
    alone = openai_request.parse_chat_request({**base, "tools": None, **fmt}, ("m",))
    assert strict.sampling["grammar"] == alone.sampling["grammar"] != auto.sampling["grammar"]  # JSON, no calls
    assert grammar_fields.compiled_sampling(engine, strict.sampling)["banned_token_ids"] == [DSML_ID]
    bare = openai_request.parse_chat_request({**base, "tools": None, "tool_choice": "none"}, ("m",))
    assert grammar_fields.NO_TOOL_CALLS not in bare.sampling

    backend, host = make_backend(FakeEngine())
    try:
        body = {"max_tokens": 9, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
        a = A.parse_request({**body, "tool_choice": {"type": "auto"}}, backend)
        n = A.parse_request({**body, "tool_choice": {"type": "none"}}, backend)
        assert n[1].messages == a[1].messages and n[1].messages[0]["tools"]
        assert n[2][grammar_fields.NO_TOOL_CALLS] and n[2]["grammar"] is None
        body = {"input": "hi", "tools": [RESPONSES_TOOL]}
        a, n = (R.parse_request(b, backend, R.ResponseStore()) for b in (body, {**body, "tool_choice": "none"}))
        assert n.conv.messages == a.conv.messages and n.conv.messages[0]["tools"]
        assert n.sampling[grammar_fields.NO_TOOL_CALLS] and n.sampling["grammar"] is None
    finally:
        host.shutdown()


class NoDsml(FakeTokenizer):
    def token_to_id(self, token: str) -> int | None:
        return None if token == DSML else super().token_to_id(token)


def test_a_tokenizer_without_the_dsml_token_is_a_400_naming_tool_choice():
    engine = FakeEngine()
    engine.tokenizer = NoDsml()
    with pytest.raises(APIError) as err:
        grammar_fields.compiled_sampling(engine, {grammar_fields.NO_TOOL_CALLS: True})
    assert (err.value.status, err.value.param) == (400, "tool_choice") and DSML in err.value.message


def test_chat_none_after_auto_and_back_reuses_the_whole_prompt_and_never_calls():
    engine = FakeEngine()
    srv = start_server(engine)
    try:
        cl = client(srv)

        def turn(msgs, choice, **kw):
            return cl.chat.completions.create(
                model="deepseek-v4-flash",
                messages=msgs,
                tools=[WEATHER_TOOL],
                tool_choice=choice,
                temperature=0,
                extra_body=NO_THINK,
                **kw,
            )

        msgs = [{"role": "user", "content": "hello"}]
        r1 = turn(msgs, "auto")
        msgs += [
            {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": "weather in Paris?"},
        ]
        r2 = turn(msgs, "none")  # the script calls get_weather here: the ban makes it write text
        assert r2.choices[0].message.tool_calls is None and r2.choices[0].finish_reason == "stop"
        assert BANNED_ALTERNATIVE in r2.choices[0].message.content
        assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens + r1.usage.completion_tokens
        msgs += [
            {"role": "assistant", "content": r2.choices[0].message.content},
            {"role": "user", "content": "weather in Rome?"},
        ]
        r3 = turn(msgs, "auto")  # back to auto: the model calls, and the "none" turn's prompt is reused whole
        assert r3.choices[0].finish_reason == "tool_calls" and r3.choices[0].message.tool_calls
        assert r3.usage.prompt_tokens_details.cached_tokens == r2.usage.prompt_tokens + r2.usage.completion_tokens

        ask = [{"role": "user", "content": "weather in Paris?"}]
        chunks = list(turn(ask, "none", stream=True))
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert BANNED_ALTERNATIVE in text and chunks[-1].choices[0].finish_reason == "stop"
        two = turn(ask, "none", n=2)
        assert [c.message.tool_calls for c in two.choices] == [None, None]
        assert all(BANNED_ALTERNATIVE in c.message.content for c in two.choices)
        strict = turn(ask, "none", response_format={"type": "json_object"})  # (the fake ignores the grammar)
        assert strict.choices[0].message.tool_calls is None
    finally:
        srv.shutdown()


def test_anthropic_none_after_auto_and_back_reuses_the_whole_prompt_and_never_calls(app):
    cl = anthropic.Anthropic(base_url=app.url, api_key=API_KEY, max_retries=0)

    def turn(msgs, choice):
        return cl.messages.create(
            model="x",
            max_tokens=300,
            tools=[WEATHER],
            tool_choice={"type": choice},
            messages=msgs,
            thinking={"type": "disabled"},
            extra_body={"temperature": 0},
        )

    msgs = [{"role": "user", "content": "hello"}]
    first = turn(msgs, "auto")
    msgs += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "weather in Paris?"}]
    second = turn(msgs, "none")
    assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["text"]
    assert BANNED_ALTERNATIVE in second.content[0].text
    prior = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens
    assert second.usage.cache_read_input_tokens == prior
    msgs += [{"role": "assistant", "content": second.content[0].text}, {"role": "user", "content": "weather in Rome?"}]
    third = turn(msgs, "auto")
    assert third.stop_reason == "tool_use"
    prior = second.usage.input_tokens + second.usage.cache_read_input_tokens + second.usage.output_tokens
    assert third.usage.cache_read_input_tokens == prior


def test_responses_none_after_auto_and_back_reuses_the_whole_prompt_and_never_calls(app):
    cl = openai.OpenAI(base_url=app.url + "/v1", api_key=API_KEY, max_retries=0)

    def turn(choice, text, previous=None):
        return cl.responses.create(
            model="deepseek-v4-flash",
            input=text,
            tools=[RESPONSES_TOOL],
            tool_choice=choice,
            temperature=0,
            reasoning={"effort": "none"},
            previous_response_id=previous,
        )

    first = turn("auto", "hello")
    second = turn("none", "weather in Paris?", first.id)
    assert [o.type for o in second.output] == ["message"] and BANNED_ALTERNATIVE in second.output_text
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + first.usage.output_tokens
    third = turn("auto", "weather in Rome?", second.id)
    assert third.output[-1].type == "function_call"
    assert third.usage.input_tokens_details.cached_tokens == second.usage.input_tokens + second.usage.output_tokens
