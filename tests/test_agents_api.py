"""The Anthropic Messages and OpenAI Responses front-ends (fastar.serve.anthropic / .responses) over the
FakeEngine of test_server.py, through the real worker (EngineHost).

* Event sequences and shapes checked on the raw SSE bytes, for a scripted tool call with thinking.
* The official `anthropic` client (create, stream, tools, count_tokens, errors, x-api-key) and the `openai`
  client's `responses` API (create, stream, function calls, previous_response_id, retrieve) against a throw-away
  Starlette app that mounts the module functions as the server will.
* Exact replay: a conversation carried through a tool call, in each of the three API shapes, tokenizes to the
  previous prompt ids + the generated ids, even when the model wrote its tool call in a form the encoder
  renders differently (`[1,2]` vs `[1, 2]`); and the follow-up's reported cached tokens equal that whole prefix.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import socket
import threading
import time

import pytest
from test_server import (
    ONE_CALL_TOKENS,
    USER,
    WEATHER_TOOL,
    FakeEngine,
    FakeTokenizer,
    accumulate_chat,
    client,
    data_url,
    raw,
    start_server,
)

from fastar.encoding import EOS, ChatPrompt, encode_messages
from fastar.serve import anthropic as A
from fastar.serve import openai_request, response_items
from fastar.serve import responses as R
from fastar.serve.api_error import APIError
from fastar.serve.metrics import Metrics
from fastar.serve.turn import Backend, ClientDisconnected, Conversation, ReplayCache, prompt_ids, record_reply
from fastar.serve.worker import Batching, EngineHost

anthropic = pytest.importorskip("anthropic", reason="the anthropic client is a test dependency")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency")
starlette = pytest.importorskip("starlette", reason="starlette is a test dependency")
uvicorn = pytest.importorskip("uvicorn", reason="uvicorn is a test dependency")

API_KEY = "sk-test"
WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
SUM = {
    "name": "sum",
    "description": "Add numbers",
    "input_schema": {"type": "object", "properties": {"xs": {"type": "array"}}},
}
# The model writes its JSON compactly; the encoder re-renders a resent call with ", " separators.
RAW_SUM_CALL = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="sum">\n'
    '<｜DSML｜parameter name="xs" string="false">[1,2]</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    "</｜DSML｜tool_calls>"
)


# Two such calls in one block ("add 1 and 2, then 3 and 4"): with parallel tool calls disabled the reply is cut
# after the first `</｜DSML｜invoke>`.
RAW_TWO_SUMS = RAW_SUM_CALL.replace(
    "</｜DSML｜invoke>\n",
    '</｜DSML｜invoke>\n<｜DSML｜invoke name="sum">\n'
    '<｜DSML｜parameter name="xs" string="false">[3,4]</｜DSML｜parameter>\n</｜DSML｜invoke>\n',
)
FIRST_SUM_END = RAW_TWO_SUMS.index("</｜DSML｜invoke>") + len("</｜DSML｜invoke>")


class AgentEngine(FakeEngine):
    """FakeEngine plus tool calls whose DSML differs from the encoder's canonical rendering."""

    def reply(self, prompt: str, params) -> str:
        user = prompt.rsplit(USER, 1)[-1]
        if "add" in user and "## Tools" in prompt:
            body = RAW_TWO_SUMS if "3 and 4" in user else RAW_SUM_CALL
            return f"Thinking about sums.</think>{body}" if prompt.endswith("<think>") else body
        return super().reply(prompt, params)


def make_backend(engine: FakeEngine | None = None, **kw) -> tuple[Backend, EngineHost]:
    engine = engine or AgentEngine()
    metrics = Metrics()
    host = EngineHost(lambda: engine, Batching(max_queue=8, keep_states=4), metrics=metrics)
    host.start(on_ready=lambda e: None)
    assert host.wait_ready(10)
    backend = Backend(engine=host.require_engine, submit=host.submit, metrics=metrics, **kw)
    return backend, host


@pytest.fixture
def backend():
    backend, host = make_backend()
    yield backend
    host.shutdown()


def sse_events(chunks) -> list[tuple[str, dict]]:
    """(event name, data) of an SSE byte stream; comments skipped."""
    out = []
    for block in b"".join(chunks).decode().split("\n\n"):
        lines = [ln for ln in block.split("\n") if ln and not ln.startswith(":")]
        if not lines:
            continue
        name = next(ln[7:] for ln in lines if ln.startswith("event: "))
        data = json.loads(next(ln[6:] for ln in lines if ln.startswith("data: ")))
        out.append((name, data))
    return out


# ---------------------------------------------------------------------------------------------------------
# Raw event sequences
# ---------------------------------------------------------------------------------------------------------


def test_anthropic_stream_event_sequence_for_a_tool_call(backend):
    body = {
        "model": "anything",
        "max_tokens": 200,
        "stream": True,
        "tools": [WEATHER],
        "thinking": {"type": "enabled", "budget_tokens": 150},
        "messages": [{"role": "user", "content": "weather in Paris?"}],
    }
    events = sse_events(A.messages(body, backend))
    names = [n for n, _ in events]
    assert all(n == d["type"] for n, d in events)
    # thinking block, then the tool_use block; deltas collapsed for the comparison
    collapsed = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    assert collapsed == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert starts[0] == {"type": "thinking", "thinking": "", "signature": ""}
    assert starts[1]["type"] == "tool_use" and starts[1]["name"] == "get_weather" and starts[1]["input"] == {}
    deltas = [d for n, d in events if n == "content_block_delta"]
    thinking = "".join(d["delta"].get("thinking", "") for d in deltas if d["index"] == 0)
    assert thinking == "Thinking about weather in Paris?."
    assert [d["delta"]["type"] for d in deltas if d["index"] == 0][-1] == "signature_delta"
    pieces = [d["delta"]["partial_json"] for d in deltas if d["index"] == 1]
    assert all(d["delta"]["type"] == "input_json_delta" for d in deltas if d["index"] == 1)
    assert "".join(pieces) == '{"location": "Paris"}' and len(pieces) > 3  # streamed as the model writes it
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] > 0 and delta["usage"]["cache_read_input_tokens"] == 0
    assert events[0][1]["message"]["model"] == "deepseek-v4-flash"


def test_responses_stream_event_sequence_for_a_tool_call(backend):
    store = R.ResponseStore()
    body = {
        "model": "deepseek-v4-flash",
        "input": "weather in Paris?",
        "stream": True,
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER["input_schema"]}],
    }
    events = sse_events(R.create(body, backend, store))
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    names = [n for n, _ in events]
    collapsed = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    assert collapsed == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1][1]["response"]
    assert final["status"] == "completed"
    assert [o["type"] for o in final["output"]] == ["reasoning", "function_call"]
    call = final["output"][1]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"location": "Paris"}
    thought = backend.engine().tokenizer.encode("Thinking about weather in Paris?.</think>")
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == len(thought)
    assert R.retrieve(final["id"], store) == final


def test_errors_in_each_api_shape(backend):
    with pytest.raises(APIError) as err:
        A.messages({"max_tokens": 10, "messages": []}, backend)
    assert err.value.status == 400
    assert A.error_body(err.value) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "'messages' must be a non-empty list of message objects"},
    }
    with pytest.raises(APIError) as err:
        A.messages(
            {"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, backend
        )
    assert "unsupported block type 'image'" in err.value.message
    with pytest.raises(APIError) as err:
        R.create({"input": "hi", "previous_response_id": "resp_nope"}, backend, R.ResponseStore())
    assert err.value.status == 404 and err.value.to_dict()["error"]["code"] == "previous_response_not_found"
    with pytest.raises(APIError) as err:
        R.create({"input": [{"type": "computer_call"}]}, backend, R.ResponseStore())
    assert err.value.status == 400 and "computer_call" in err.value.message
    # the engine failing mid-stream: Anthropic's error event, Responses' error + response.failed
    events = sse_events(
        A.messages({"max_tokens": 10, "messages": [{"role": "user", "content": "explode"}], "stream": True}, backend)
    )
    assert events[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "generation failed: the fake engine exploded"}},
    )
    events = sse_events(R.create({"input": "explode", "stream": True}, backend, R.ResponseStore()))
    assert [n for n, _ in events[-2:]] == ["error", "response.failed"]
    assert events[-1][1]["response"]["status"] == "failed"


def test_responses_text_format_renders_as_chat_completions_response_format(backend):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = R.parse_request(
        {
            "input": "hi",
            "instructions": "be brief",
            "text": {"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
        },
        backend,
        R.ResponseStore(),
    )
    chat = openai_request.parse_chat_request(
        {
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "out", "schema": schema, "strict": True},
            },
        },
        ("deepseek-v4-flash",),
    )
    assert req.conv.render() == Conversation(chat.messages, chat.thinking).render()
    assert '"schema": {"type": "object"' in req.conv.render()
    with pytest.raises(APIError, match=r"text\.format"):
        R.parse_request({"input": "hi", "text": {"format": "json"}}, backend, R.ResponseStore())


def test_closing_a_stream_cancels_the_generation():
    engine = AgentEngine(token_delay=0.01)
    backend, host = make_backend(engine)
    try:
        stream = A.messages(
            {
                "max_tokens": 4000,
                "messages": [{"role": "user", "content": "count"}],
                "stream": True,
                "thinking": {"type": "disabled"},
            },
            backend,
        )
        got = [next(stream) for _ in range(6)]
        assert b"text_delta" in got[-1]
        stream.close()
        deadline = time.monotonic() + 5
        while host.num_running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not host.num_running()
        assert engine.stats()["generated_tokens"] < 200  # "count" would run to ~8000 tokens
    finally:
        host.shutdown()


def test_a_non_streaming_client_that_leaves_cancels_its_generation():
    engine = AgentEngine(token_delay=0.01)
    backend, host = make_backend(engine)
    try:
        start = time.monotonic()
        with pytest.raises(ClientDisconnected):
            R.create(
                {"input": "count", "reasoning": {"effort": "none"}},
                backend,
                R.ResponseStore(),
                disconnected=lambda: time.monotonic() - start > 0.5,
            )
        deadline = time.monotonic() + 5
        while host.num_running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not host.num_running() and engine.stats()["generated_tokens"] < 200
    finally:
        host.shutdown()


def test_keepalive_pings_during_a_long_prefill():
    engine = AgentEngine(prefill_delay=0.3)
    backend, host = make_backend(engine, keepalive_interval=0.05)
    try:
        events = sse_events(
            A.messages({"max_tokens": 100, "messages": [{"role": "user", "content": "hi"}], "stream": True}, backend)
        )
        assert [n for n, _ in events].count("ping") >= 3
        chunks = list(R.create({"input": "a different prompt", "stream": True}, backend, R.ResponseStore()))
        assert b": keep-alive\n\n" in chunks
    finally:
        host.shutdown()


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/messages", {"max_tokens": 50, "messages": [{"role": "user", "content": "hi " * 300}]}),
        ("/v1/responses", {"max_output_tokens": 50, "input": "hi " * 300}),
    ],
)
def test_a_stream_left_during_a_long_prefill_is_cancelled_at_once(path, body):
    """A client (Claude Code's Esc) that closes its stream while the prompt is still prefilling: the generation is
    cancelled when the server hears of it, not when the next keep-alive (5 s) or the first token comes back."""
    srv = start_server(AgentEngine(prefill_delay=6.0))  # ~0.4 s per 64 tokens
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        conn.request(
            "POST",
            path,
            json.dumps({"model": "deepseek-v4-flash", "stream": True, **body}),
            {"Content-Type": "application/json", "X-Api-Key": "unused"},
        )
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline()  # the stream has started; the prompt is prefilling
        assert srv.host.num_running() == 1
        left = time.monotonic()
        conn.close()
        while srv.host.num_running() and time.monotonic() - left < 10:
            time.sleep(0.02)
        assert time.monotonic() - left < 2.5, "the prefill ran on after the client left"
    finally:
        srv.shutdown()


# ---------------------------------------------------------------------------------------------------------
# Exact replay at the rendering level, in all three API shapes
# ---------------------------------------------------------------------------------------------------------


def _run_first_turn(backend: Backend, thinking: bool) -> tuple[list[int], list[int], dict]:
    """Anthropic request whose reply is RAW_SUM_CALL; returns (prompt ids, generated ids, the message)."""
    body = {
        "max_tokens": 300,
        "messages": [{"role": "user", "content": "please add 1 and 2"}],
        "tools": [SUM],
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    ids = prompt_ids(backend, A.parse_request(body, backend)[1])[1]
    msg = A.messages(body, backend)
    engine = backend.engine()
    generated = engine.tokenizer.encode(("Thinking about sums.</think>" if thinking else "") + RAW_SUM_CALL + EOS)
    return ids, generated, msg


@pytest.mark.parametrize("thinking", [True, False])
def test_replay_renders_the_tokens_the_model_produced_in_every_api_shape(backend, thinking):
    prompt, generated, msg = _run_first_turn(backend, thinking)
    assert msg["stop_reason"] == "tool_use"
    use = next(b for b in msg["content"] if b["type"] == "tool_use")
    assert use["input"] == {"xs": [1, 2]}
    prefix = prompt + generated
    tool_fn = {"name": "sum", "description": "Add numbers", "parameters": SUM["input_schema"]}

    # Anthropic: the assistant turn resent as blocks, then the tool result
    follow = {
        "max_tokens": 300,
        "tools": [SUM],
        "thinking": {"type": "enabled" if thinking else "disabled"},
        "messages": [
            {"role": "user", "content": "please add 1 and 2"},
            {"role": "assistant", "content": msg["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "3"}]},
        ],
    }
    anth_ids = prompt_ids(backend, A.parse_request(follow, backend)[1])[1]

    # OpenAI chat completions: the message the server returns, resent
    call = {"id": use["id"], "type": "function", "function": {"name": "sum", "arguments": '{"xs": [1, 2]}'}}
    assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
    if thinking:
        assistant["reasoning_content"] = "Thinking about sums."
    chat = [
        {"role": "system", "content": "", "tools": [tool_fn]},
        {"role": "user", "content": "please add 1 and 2"},
        assistant,
        {"role": "tool", "tool_call_id": use["id"], "content": "3"},
    ]
    chat_ids = prompt_ids(backend, Conversation(chat, thinking))[1]

    # OpenAI Responses: items resent without previous_response_id
    items = [{"role": "user", "content": "please add 1 and 2"}]
    if thinking:
        items.append(
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Thinking about sums."}],
            }
        )
    items += [
        {"type": "function_call", "call_id": use["id"], "name": "sum", "arguments": '{"xs": [1, 2]}'},
        {"type": "function_call_output", "call_id": use["id"], "output": "3"},
    ]
    resp = {
        "input": items,
        "tools": [{"type": "function", "name": "sum", "description": "Add numbers", "parameters": SUM["input_schema"]}],
        "reasoning": {"effort": "high" if thinking else "none"},
    }
    resp_ids = prompt_ids(backend, R.parse_request(resp, backend, R.ResponseStore()).conv)[1]

    for ids in (anth_ids, chat_ids, resp_ids):
        assert ids[: len(prefix)] == prefix
        assert len(ids) > len(prefix)
    # Without the replay cache the canonical rendering ("[1, 2]") parts from what the model holds.
    fresh = Backend(engine=backend.engine, submit=backend.submit, replay=ReplayCache())
    canonical = prompt_ids(fresh, A.parse_request(follow, fresh)[1])[1]
    assert canonical[: len(prefix)] != prefix


def test_a_chat_completions_route_takes_part_through_prompt_ids_and_record_reply(backend):
    """The wiring the chat route needs: tokenize through `prompt_ids`, then `record_reply` with the sampled ids."""
    from fastar.encoding import parse_completion
    from fastar.engine.sampling import SamplingParams

    body = {
        "messages": [{"role": "user", "content": "please add 1 and 2"}],
        "thinking": {"type": "disabled"},
        "tools": [{"type": "function", "function": {"name": "sum", "parameters": SUM["input_schema"]}}],
    }
    req = openai_request.parse_chat_request(body, ("deepseek-v4-flash",))
    conv = Conversation(req.messages, req.thinking, req.reasoning_effort, req.drop_thinking)
    text, ids = prompt_ids(backend, conv)
    engine = backend.engine()
    generated = [c.token for c in engine.stream(ids, SamplingParams(max_tokens=500)) if c.token is not None]
    message = parse_completion(engine.tokenizer.decode(generated), thinking=False).to_message()
    assert message["tool_calls"][0]["function"]["arguments"] == '{"xs": [1, 2]}'  # the model wrote [1,2]
    record_reply(backend.replay, engine.tokenizer, conv, text, ids, generated, message)
    follow = {**body, "messages": body["messages"] + [message, {"role": "tool", "tool_call_id": "x", "content": "3"}]}
    req2 = openai_request.parse_chat_request(follow, ("deepseek-v4-flash",))
    ids2 = prompt_ids(backend, Conversation(req2.messages, req2.thinking, req2.reasoning_effort, req2.drop_thinking))[1]
    assert ids2[: len(ids) + len(generated)] == ids + generated


@pytest.mark.parametrize("streamed", [False, True])
def test_a_chat_completions_agent_loop_reuses_the_whole_previous_turn_when_the_model_wrote_its_call_compactly(
    streamed,
):
    """Through the `openai` client: the model writes its call `[1,2]`, the client sends back the parsed call
    (re-rendered `[1, 2]`) with its result, and the follow-up reuses the previous prompt and the whole reply."""
    srv = start_server(AgentEngine())
    try:
        cl = client(srv)
        tools = [{"type": "function", "function": {"name": "sum", "parameters": SUM["input_schema"]}}]
        messages = [{"role": "user", "content": "please add 1 and 2"}]
        kw = {
            "model": "deepseek-v4-flash",
            "tools": tools,
            "temperature": 0,
            "extra_body": {"thinking": {"type": "disabled"}},
        }
        if streamed:
            chunks = list(
                cl.chat.completions.create(messages=messages, stream=True, stream_options={"include_usage": True}, **kw)
            )
            streamed_call = accumulate_chat(chunks)[0].choices[0].message.tool_calls[0]  # (pieces, as OpenAI's)
            call = {"id": streamed_call.id, "type": "function", "function": {"name": streamed_call.function.name}}
            call["function"]["arguments"] = streamed_call.function.arguments
            usage = chunks[-1].usage
        else:
            first = cl.chat.completions.create(messages=messages, **kw)
            call, usage = first.choices[0].message.tool_calls[0].model_dump(), first.usage
        assert call["function"]["arguments"] == '{"xs": [1, 2]}'  # the model wrote [1,2]
        follow = messages + [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "3"},
        ]
        second = cl.chat.completions.create(messages=follow, **kw)
        assert second.usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens + usage.completion_tokens
        status, _, body = raw(srv, "POST", "/tokenize", {"messages": follow, "tools": tools, **kw["extra_body"]})
        assert status == 200 and json.loads(body)["count"] == second.usage.prompt_tokens  # the same ids
        kept = len(srv.replay)
        cl.chat.completions.create(messages=messages, n=3, **kw)  # which choice comes back is unknown
        assert len(srv.replay) == kept
    finally:
        srv.shutdown()


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_a_reply_cut_after_its_first_call_replays_exactly(api):
    """A reply that `parallel_tool_calls: false` (Messages: `disable_parallel_tool_use`) ended after its first call
    is recorded like any other: the model wrote two calls compactly (`[1,2]`, `[3,4]`) and was cut after the first;
    the client resends the parsed call (re-rendered `[1, 2]`) with its result, and the follow-up's ids start with
    the first prompt's and the ids generated up to the cut, so the whole prefix is reused (re-tokenized, the
    canonical rendering parts from them at the call's arguments)."""
    ask = "please add 1 and 2, then 3 and 4"
    generated = FakeTokenizer().encode(RAW_TWO_SUMS[:FIRST_SUM_END])
    srv = start_server(AgentEngine())
    backend = Backend(engine=srv.host.require_engine, submit=srv.host.submit, replay=srv.replay)
    try:
        if api == "chat":
            tools = [{"type": "function", "function": {"name": "sum", "parameters": SUM["input_schema"]}}]
            first = {"messages": [{"role": "user", "content": ask}], "tools": tools, "thinking": {"type": "disabled"}}
            prompt = json.loads(raw(srv, "POST", "/tokenize", first)[2])["tokens"]
            status, _, body = raw(srv, "POST", "/v1/chat/completions", {**first, "parallel_tool_calls": False})
            reply = json.loads(body)
            calls = reply["choices"][0]["message"]["tool_calls"]
            usage = (reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"])
            follow = {
                **first,
                "messages": first["messages"]
                + [
                    {"role": "assistant", "content": None, "tool_calls": calls},
                    {"role": "tool", "tool_call_id": calls[0]["id"], "content": "3"},
                ],
            }
            ids = json.loads(raw(srv, "POST", "/tokenize", follow)[2])["tokens"]
        elif api == "responses":
            store = R.ResponseStore()
            tool = {"type": "function", "name": "sum", "parameters": SUM["input_schema"]}
            first = {"input": ask, "tools": [tool], "reasoning": {"effort": "none"}, "parallel_tool_calls": False}
            prompt = prompt_ids(backend, R.parse_request(first, backend, store).conv)[1]
            out = R.create(first, backend, store)
            calls = [o for o in out["output"] if o["type"] == "function_call"]
            usage = (out["usage"]["input_tokens"], out["usage"]["output_tokens"])
            follow = {
                **first,
                "previous_response_id": out["id"],
                "input": [{"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "3"}],
            }
            ids = prompt_ids(backend, R.parse_request(follow, backend, store).conv)[1]
        else:
            first = {
                "max_tokens": 300,
                "messages": [{"role": "user", "content": ask}],
                "tools": [SUM],
                "thinking": {"type": "disabled"},
                "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
            }
            prompt = prompt_ids(backend, A.parse_request(first, backend)[1])[1]
            msg = A.messages(first, backend)
            calls = [b for b in msg["content"] if b["type"] == "tool_use"]
            usage = (msg["usage"]["input_tokens"], msg["usage"]["output_tokens"])
            result = {"type": "tool_result", "tool_use_id": calls[0]["id"], "content": "3"}
            follow = {
                **first,
                "messages": first["messages"]
                + [{"role": "assistant", "content": msg["content"]}, {"role": "user", "content": [result]}],
            }
            ids = prompt_ids(backend, A.parse_request(follow, backend)[1])[1]
        assert len(calls) == 1 and usage == (len(prompt), len(generated))  # cut after the first call
        assert ids[: len(prompt) + len(generated)] == prompt + generated
        assert len(ids) > len(prompt) + len(generated)
    finally:
        srv.shutdown()


@pytest.mark.parametrize("past, stored", [("", True), ("\n", True), ("\n</", True), ("\n\n", False)])
def test_a_reply_cut_after_a_call_records_the_closing_markup_the_model_did_not_write(backend, past, stored):
    """The token that ended the first call may hold more (`>\n`, say): what it holds of the block's closing markup
    is the model's, the rest of it is added; a token holding anything else is not recorded."""
    tok = backend.engine().tokenizer
    tool_fn = {"name": "sum", "parameters": SUM["input_schema"]}
    ask = [{"role": "system", "content": "", "tools": [tool_fn]}, {"role": "user", "content": "add 1 and 2, 3 and 4"}]
    conv, fresh = Conversation(ask, thinking=False), Backend(engine=backend.engine, submit=backend.submit)
    text, ids = prompt_ids(fresh, conv)
    call = {"id": "call_1", "type": "function", "function": {"name": "sum", "arguments": '{"xs": [1, 2]}'}}
    message = {"role": "assistant", "content": "", "tool_calls": [call]}
    generated = tok.encode(RAW_TWO_SUMS[:FIRST_SUM_END] + past)
    record_reply(fresh.replay, tok, conv, text, ids, generated, message, cut_after_call=True)
    follow = Conversation([*ask, message, {"role": "tool", "tool_call_id": "call_1", "content": "3"}], thinking=False)
    got = prompt_ids(fresh, follow)[1]
    assert (got[: len(ids) + len(generated)] == ids + generated) is stored
    if stored:  # then the rest of the canonical rendering: the call's end is one character on (`[1, 2]`)
        assert got == ids + generated + tok.encode(follow.render()[len(text) + FIRST_SUM_END + 1 + len(past) :])


def test_replay_cache_is_bounded_and_only_cuts_at_eos():
    cache = ReplayCache(size=2)

    class Tok:
        def encode(self, text):
            return [ord(c) for c in text]

    cache.record("abc", [1])  # no EOS at the cut: usable only where the new text continues with EOS
    assert cache.encode(Tok(), "abcd") == [ord(c) for c in "abcd"]
    assert cache.encode(Tok(), f"abc{EOS}d") == [1] + Tok().encode(f"{EOS}d")
    for i in range(3):
        cache.record(f"x{i}{EOS}", [100 + i])
    assert len(cache) == 2
    assert cache.encode(Tok(), f"x0{EOS}y") == [ord(c) for c in f"x0{EOS}y"]  # evicted
    assert cache.encode(Tok(), f"x2{EOS}y") == [102, ord("y")]


def test_replay_never_gives_content_the_template_tokens_its_text_spells():
    """A stored turn is reused only where the new prompt has the same template and content parts there, not merely
    the same text: a message that spells a recorded conversation (`<｜Assistant｜>`, EOS ... as its own words)
    must tokenize as the plain text it is, never as the control tokens the model held for that text."""
    tok = FakeTokenizer()
    turn = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Echo: hello"}]
    recorded = encode_messages(turn, "chat")
    held = tok.encode(recorded)
    cache = ReplayCache()
    cache.record(recorded, held)
    follow = encode_messages([*turn, {"role": "user", "content": "next"}], "chat")
    assert cache.encode(tok, follow)[: len(held)] == held  # the conversation itself reuses it
    start = recorded.index("hello")
    spelled = encode_messages([{"role": "user", "content": recorded[start:] + "more"}], "chat")
    assert spelled.startswith(recorded)  # the same text up to the stored EOS, but all of it content
    assert cache.encode(tok, spelled) == tok.encode(spelled)
    # the same text recorded again with other parts replaces the entry, parts and ids together
    cache.record(ChatPrompt([(str(recorded), True)]), tok.encode(ChatPrompt([(str(recorded), True)])))
    assert cache.encode(tok, follow) == tok.encode(follow)


# ---------------------------------------------------------------------------------------------------------
# The official clients against a throw-away Starlette app that mounts the module functions
# ---------------------------------------------------------------------------------------------------------


class App:
    def __init__(self, backend: Backend) -> None:
        from starlette.applications import Starlette
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        self.backend, self.store = backend, R.ResponseStore()

        def reply(out, err_shape):
            if isinstance(out, APIError):
                return JSONResponse(err_shape(out), status_code=out.status)
            if isinstance(out, dict):
                return JSONResponse(out)
            return StreamingResponse(out, media_type="text/event-stream")

        async def call(request, fn, err_shape):
            if A.api_key_from_headers(request.headers) != API_KEY:
                return reply(APIError(401, "invalid x-api-key"), err_shape)
            try:
                body = await request.json()
                return reply(await run_in_threadpool(fn, body), err_shape)
            except APIError as err:
                return reply(err, err_shape)

        async def messages(request):
            return await call(request, lambda b: A.messages(b, backend), A.error_body)

        async def count(request):
            return await call(request, lambda b: A.count_tokens(b, backend), A.error_body)

        async def create(request):
            return await call(request, lambda b: R.create(b, backend, self.store), APIError.to_dict)

        async def get(request):
            try:
                return JSONResponse(R.retrieve(request.path_params["rid"], self.store))
            except APIError as err:
                return reply(err, APIError.to_dict)

        app = Starlette(
            routes=[
                Route("/v1/messages", messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", count, methods=["POST"]),
                Route("/v1/responses", create, methods=["POST"]),
                Route("/v1/responses/{rid}", get, methods=["GET"]),
            ]
        )
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.started

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def app():
    backend, host = make_backend()
    app = App(backend)
    yield app
    app.close()
    host.shutdown()


def test_anthropic_client_create_stream_tools_and_count_tokens(app):
    cl = anthropic.Anthropic(base_url=app.url, api_key=API_KEY, max_retries=0)
    msg = cl.messages.create(
        model="deepseek-v4-flash",
        max_tokens=100,
        extra_body={"temperature": 0},
        thinking={"type": "disabled"},
        messages=[{"role": "user", "content": "hello"}],
    )
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Echo: hello"
    assert msg.stop_reason == "end_turn" and msg.usage.output_tokens == len("Echo: hello") + 1

    with cl.messages.stream(
        model="claude-sonnet-4-5",
        max_tokens=100,
        system="be brief",
        thinking={"type": "enabled", "budget_tokens": 64},
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "hi there"}],
    ) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == "Echo: hi there"
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Thinking about hi there." and final.content[0].signature

    # stop_sequences: cut before the stop string, and the hit one reported
    msg = cl.messages.create(
        model="x",
        max_tokens=100,
        stop_sequences=["3 4"],
        thinking={"type": "disabled"},
        messages=[{"role": "user", "content": "count"}],
    )
    assert msg.content[0].text == "1 2 " and msg.stop_reason == "stop_sequence" and msg.stop_sequence == "3 4"
    msg = cl.messages.create(
        model="x", max_tokens=5, thinking={"type": "disabled"}, messages=[{"role": "user", "content": "count"}]
    )
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 5

    # tools: stream a tool call, answer it, and the follow-up reuses the whole previous conversation
    first_messages = [{"role": "user", "content": "weather in Paris?"}]
    with cl.messages.stream(model="x", max_tokens=300, tools=[WEATHER], messages=first_messages) as stream:
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    use = first.content[-1]
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"location": "Paris"}
    prior = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens
    follow = first_messages + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]},
    ]
    count = cl.messages.count_tokens(model="x", tools=[WEATHER], messages=follow)
    second = cl.messages.create(
        model="x", max_tokens=300, tools=[WEATHER], messages=follow, extra_body={"temperature": 0}
    )
    assert second.usage.cache_read_input_tokens == prior
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == count.input_tokens
    assert second.content[-1].text.startswith("Echo: <tool_result>sunny, 21 C")

    with pytest.raises(anthropic.BadRequestError) as err:
        cl.messages.create(
            model="x", max_tokens=10, messages=[{"role": "user", "content": "hi"}], extra_body={"temperature": "hot"}
        )
    assert err.value.body["error"]["type"] == "invalid_request_error" and "temperature" in err.value.message
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=app.url, api_key="wrong", max_retries=0).messages.create(
            model="x", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
        )
    stream = cl.messages.stream(model="x", max_tokens=10, messages=[{"role": "user", "content": "explode"}])
    with pytest.raises(anthropic.APIStatusError) as err, stream as s:  # an error event mid-stream
        s.get_final_message()
    assert "exploded" in str(err.value)


def test_openai_responses_create_stream_function_calls_and_previous_response(app):
    cl = openai.OpenAI(base_url=app.url + "/v1", api_key=API_KEY, max_retries=0)
    r = cl.responses.create(model="deepseek-v4-flash", input="hello", temperature=0, reasoning={"effort": "none"})
    assert r.output_text == "Echo: hello" and r.status == "completed"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens == len("Echo: hello") + 1

    with cl.responses.stream(
        model="deepseek-v4-flash", input="hi there", instructions="be brief", temperature=0
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "Echo: hi there" == final.output_text
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == "Thinking about hi there."

    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": WEATHER["input_schema"],
        }
    ]
    with cl.responses.stream(model="deepseek-v4-flash", input="weather in Paris?", tools=tools) as stream:
        args = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        first = stream.get_final_response()
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads("".join(args)) == json.loads(call.arguments) == {"location": "Paris"}
    prior = first.usage.input_tokens + first.usage.output_tokens
    second = cl.responses.create(
        model="deepseek-v4-flash",
        previous_response_id=first.id,
        tools=tools,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        temperature=0,
    )
    assert second.usage.input_tokens_details.cached_tokens == prior
    assert second.output_text.startswith("Echo: <tool_result>sunny</tool_result>")
    assert cl.responses.retrieve(second.id).output_text == second.output_text

    with pytest.raises(openai.NotFoundError):
        cl.responses.create(model="deepseek-v4-flash", input="x", previous_response_id="resp_missing")
    with pytest.raises(openai.BadRequestError):
        cl.responses.create(model="deepseek-v4-flash", input="x", max_output_tokens=0)


def test_a_tool_block_cut_off_by_max_tokens(backend):
    """The call the limit cut is the reply's last block, streamed or not, with the parameters it completed (none
    here); its raw DSML is not repeated as text. Responses closes it `incomplete` (tests/test_cut_calls.py has
    every cut in every shape)."""
    body = {
        "max_tokens": 60,
        "tools": [WEATHER],
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "weather in Paris?"}],
    }
    msg = A.messages(body, backend)
    assert msg["stop_reason"] == "max_tokens" and [b["type"] for b in msg["content"]] == ["tool_use"]
    assert msg["content"][0]["input"] == {} and msg["content"][0]["name"] == "get_weather"
    events = sse_events(A.messages({**body, "stream": True}, backend))
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["tool_use"] and [n for n, _ in events].count("content_block_stop") == 1
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    final = sse_events(
        R.create(
            {
                "input": "weather in Paris?",
                "max_output_tokens": 60,
                "stream": True,
                "reasoning": {"effort": "none"},
                "tools": [{"type": "function", "name": "get_weather"}],
            },
            backend,
            R.ResponseStore(),
        )
    )[-1][1]["response"]
    assert final["status"] == "incomplete" and [o["type"] for o in final["output"]] == ["function_call"]
    # the call's arguments stop mid-way, and it says so
    assert [o["status"] for o in final["output"]] == ["incomplete"], final["output"]


def test_parallel_tool_use_disabled_under_auto_ends_the_reply_after_its_first_call(backend):
    """Anthropic's `disable_parallel_tool_use` and Responses' `parallel_tool_calls: false` with tools left to the
    model: one tool call, then the reply ends (stop_reason "tool_use"; the generation stopped there), streamed or
    not; without them the model's two calls both come back."""
    ask = "weather in Paris and Rome"
    body = {"max_tokens": 400, "tools": [WEATHER], "thinking": {"type": "disabled"}}
    body["messages"] = [{"role": "user", "content": ask}]
    assert [b["input"]["location"] for b in A.messages(body, backend)["content"]] == ["Paris", "Rome"]
    single = {**body, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}
    msg = A.messages(single, backend)
    assert [(b["type"], b["input"]) for b in msg["content"]] == [("tool_use", {"location": "Paris"})]
    assert msg["stop_reason"] == "tool_use" and msg["usage"]["output_tokens"] == ONE_CALL_TOKENS
    events = sse_events(A.messages({**single, "stream": True}, backend))
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [(b["type"], b["name"]) for b in starts] == [("tool_use", "get_weather")]
    pieces = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
    assert json.loads(pieces) == {"location": "Paris"} and events[-2][1]["delta"]["stop_reason"] == "tool_use"
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["input_schema"]}
    req = {"input": ask, "reasoning": {"effort": "none"}, "tools": [tool], "parallel_tool_calls": False}
    for stream in (False, True):
        out = R.create({**req, "stream": stream}, backend, R.ResponseStore())
        final = sse_events(out)[-1][1]["response"] if stream else out
        calls = [json.loads(o["arguments"]) for o in final["output"] if o["type"] == "function_call"]
        assert calls == [{"location": "Paris"}] and [o["type"] for o in final["output"]] == ["function_call"]
        assert final["status"] == "completed" and final["parallel_tool_calls"] is False
        assert final["usage"]["output_tokens"] == ONE_CALL_TOKENS


def test_messages_without_max_tokens_is_a_400(backend):
    """The Messages API requires max_tokens; without it the server would generate to the end of the context."""
    with pytest.raises(APIError) as err:
        A.messages({"messages": [{"role": "user", "content": "hi"}]}, backend)
    assert err.value.status == 400 and err.value.param == "max_tokens" and "required" in err.value.message
    assert A.count_tokens({"messages": [{"role": "user", "content": "hi"}]}, backend)["input_tokens"] > 0


def test_a_thinking_block_cut_by_max_tokens_has_no_empty_text_block_after_it(backend):
    body = {
        "max_tokens": 5,
        "thinking": {"type": "enabled"},
        "messages": [{"role": "user", "content": "hi there"}],
    }
    msg = A.messages(body, backend)
    assert msg["stop_reason"] == "max_tokens"
    assert [b["type"] for b in msg["content"]] == ["thinking"] and msg["content"][0]["thinking"] == "Think"
    events = sse_events(A.messages({**body, "stream": True}, backend))
    assert [d["content_block"]["type"] for n, d in events if n == "content_block_start"] == ["thinking"]


def test_a_responses_stream_cut_at_max_output_tokens_ends_with_response_incomplete(backend):
    body = {"input": "count", "max_output_tokens": 6, "reasoning": {"effort": "none"}, "stream": True}
    events = sse_events(R.create(body, backend, R.ResponseStore()))
    assert events[-1][0] == "response.incomplete" and "response.completed" not in [n for n, _ in events]
    assert events[-1][1]["response"]["status"] == "incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    # the message the limit cut is `incomplete` too, in its output_item.done and in the response, streamed or not
    items = [d["item"] for n, d in events if n == "response.output_item.done"]
    assert [i["status"] for i in items] == ["incomplete"] and events[-1][1]["response"]["output"] == items
    whole = R.create({**body, "stream": False}, backend, R.ResponseStore())
    assert whole["status"] == "incomplete" and [o["status"] for o in whole["output"]] == ["incomplete"]
    done = sse_events(R.create({**body, "input": "hi", "max_output_tokens": 100}, backend, R.ResponseStore()))
    assert done[-1][0] == "response.completed" and done[-1][1]["response"]["status"] == "completed"
    assert [o["status"] for o in done[-1][1]["response"]["output"]] == ["completed"]


def test_anthropic_budget_tokens_must_be_below_max_tokens_and_reaches_the_engine(backend):
    body = {
        "max_tokens": 100,
        "thinking": {"type": "enabled", "budget_tokens": 100},
        "messages": [{"role": "user", "content": "hi"}],
    }
    with pytest.raises(APIError) as err:
        A.messages(body, backend)
    assert err.value.status == 400 and "budget_tokens" in err.value.message
    sampling = A.parse_request({**body, "thinking": {"type": "enabled", "budget_tokens": 99}}, backend)[2]
    assert sampling["thinking_budget"] == 99
    assert A.parse_request({**body, "thinking": {"type": "disabled"}}, backend)[2]["thinking_budget"] is None
    low = {**body, "thinking": {"type": "adaptive"}, "output_config": {"effort": "low"}}
    assert A.parse_request(low, backend)[2]["thinking_budget"] == 1024
    req = R.parse_request({"input": "hi", "reasoning": {"effort": "medium"}}, backend, R.ResponseStore())
    assert req.sampling["thinking_budget"] == 8192


def test_a_conversation_ending_with_an_assistant_turn_is_a_400_not_a_reply_after_eos(backend):
    """Assistant prefill: the encoder renders a last assistant turn closed with EOS, so the model would answer
    after the end of the text. A 400 that says so, as Anthropic answers for its models without prefill."""
    for last in ("Sure, here", [{"type": "tool_use", "id": "t1", "name": "sum", "input": {"xs": [1]}}]):
        body = {
            "max_tokens": 20,
            "tools": [SUM],
            "messages": [{"role": "user", "content": "please add"}, {"role": "assistant", "content": last}],
        }
        with pytest.raises(APIError) as err:
            A.messages(body, backend)
        assert err.value.status == 400 and err.value.param == "messages"
        assert "assistant message prefill" in err.value.message
        assert A.count_tokens(body, backend)["input_tokens"] > 0  # counting renders what it is given
    # a last user turn with no blocks left the assistant turn before it last: the same reply after EOS
    body["messages"].append({"role": "user", "content": []})
    with pytest.raises(APIError) as err:
        A.messages(body, backend)
    assert err.value.status == 400 and "messages[2].content must not be empty" in err.value.message


def test_anthropic_defined_tool_types_and_malformed_tools_are_a_400(backend):
    """A server tool (web search) or an Anthropic-schema tool (bash) would reach the model as a tool without
    parameters, which it cannot honour: a 400 naming the type. A custom tool (`type` absent or "custom") runs."""
    msgs = [{"role": "user", "content": "hello"}]
    bad = {
        '"web_search_20250305"': {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        '"bash_20250124"': {"type": "bash_20250124", "name": "bash"},
        "input_schema must be a JSON Schema object": {"name": "f", "input_schema": "x"},
        "description must be a string": {"name": "f", "description": {"x": 1}, "input_schema": {"type": "object"}},
        "name must not hold": {"name": 'say"hi', "input_schema": {"type": "object"}},
    }
    for words, tool in bad.items():
        with pytest.raises(APIError) as err:
            A.messages({"max_tokens": 5, "messages": msgs, "tools": [SUM, tool]}, backend)
        assert err.value.status == 400 and err.value.param == "tools" and words in err.value.message
        assert "tools[1]" in err.value.message
    ok = A.messages({"max_tokens": 5, "messages": msgs, "tools": [SUM, {**WEATHER, "type": "custom"}]}, backend)
    assert ok["type"] == "message"


def test_anthropic_temperature_above_one_is_a_400(backend):
    """The Messages API takes `temperature` in [0, 1] (the OpenAI routes' 2 is out of its range): above it, a 400
    naming `temperature`, where it used to sample at it; 0 and 1 run."""
    msgs = [{"role": "user", "content": "hello"}]
    for bad in (1.5, 2, -0.1):
        with pytest.raises(APIError) as err:
            A.messages({"max_tokens": 5, "messages": msgs, "temperature": bad}, backend)
        assert (err.value.status, err.value.param) == (400, "temperature")
        assert "between 0.0 and 1.0" in err.value.message
    for ok in (0, 1):
        assert A.messages({"max_tokens": 5, "messages": msgs, "temperature": ok}, backend)["type"] == "message"


def test_responses_text_format_and_max_output_tokens_are_checked_under_their_own_names(backend):
    """A `text.format` of another type (or a `text` that is not an object) is a 400, not an unconstrained reply
    echoing the format; a bad `max_output_tokens` or `reasoning.effort` is a 400 naming the field the client sent."""
    for text, param in ((5, "text"), ({"format": {"type": "xml"}}, "text.format"), ({"format": "json"}, "text.format")):
        with pytest.raises(APIError) as err:
            R.parse_request({"input": "hi", "text": text}, backend, R.ResponseStore())
        assert (err.value.status, err.value.param) == (400, param)
    schema = {"type": "json_schema", "name": "r", "schema": {"type": "object"}}
    for bad, param in (({"strict": "yes"}, "strict"), ({"name": 5}, "name"), ({"schema": [1]}, "schema")):
        with pytest.raises(APIError) as err:
            R.parse_request({"input": "hi", "text": {"format": {**schema, **bad}}}, backend, R.ResponseStore())
        assert (err.value.status, err.value.param) == (400, f"text.format.{param}"), err.value.message
        assert f"'text.format.{param}'" in err.value.message
    R.parse_request({"input": "hi", "text": {"format": {**schema, "strict": True}}}, backend, R.ResponseStore())
    for value in (0, -1, "8", 1.5):
        with pytest.raises(APIError) as err:
            R.parse_request({"input": "hi", "max_output_tokens": value}, backend, R.ResponseStore())
        assert (err.value.status, err.value.param) == (400, "max_output_tokens")
        assert "'max_output_tokens'" in err.value.message
    assert R.parse_request({"input": "hi", "max_output_tokens": 7.0}, backend, R.ResponseStore()).max_tokens == 7
    with pytest.raises(APIError) as err:
        R.parse_request({"input": "hi", "reasoning": {"effort": "extreme"}}, backend, R.ResponseStore())
    assert (err.value.status, err.value.param) == (
        400,
        "reasoning.effort",
    ) and "'reasoning.effort'" in err.value.message


def test_malformed_blocks_get_an_error_naming_the_problem(backend):
    """A text block without a string `text` is malformed, not of an "unsupported type"; `system` is named as
    itself; a non-boolean `is_error` is refused rather than read as true; a forced tool call with no tools is
    worded in this API's terms, and so is the limit on stop sequences."""
    call = {"type": "tool_use", "id": "t1", "name": "sum", "input": {}}

    def refused(**body) -> str:
        with pytest.raises(APIError) as err:
            A.messages({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **body}, backend)
        assert err.value.status == 400
        return err.value.message

    def turns(*blocks) -> list[dict]:
        return [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": list(blocks)},
        ]

    no_text = {"type": "text", "text": 5}
    msg = refused(messages=[{"role": "user", "content": [no_text]}])
    assert msg == "messages[0].content[0]: a text block needs a string 'text'"
    msg = refused(
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "thinking"}]}]
    )
    assert msg.startswith("messages[1].content[0]: a thinking block needs a string 'thinking'")
    assert refused(system=[{"type": "text", "text": "a"}, no_text]) == "system[1]: a text block needs a string 'text'"
    assert refused(system=5) == "system must be a string or a list of content blocks"
    msg = refused(messages=turns({"type": "tool_result", "tool_use_id": "t1", "content": [no_text]}))
    assert msg == "messages[2].content[0].content[0]: a text block needs a string 'text'"
    msg = refused(messages=turns({"type": "tool_result", "tool_use_id": "t1", "content": "3", "is_error": "no"}))
    assert msg == "'is_error' must be true or false, got \"no\""
    assert refused(stop_sequences=["a"] * 17) == "'stop_sequences' may hold at most 16 strings, got 17"
    msg = refused(tool_choice={"type": "any"})
    assert msg == '\'tool_choice\' {"type": "any"} forces a tool call, but the request has no tools'


def test_a_4xx_of_no_anthropic_type_of_its_own_is_an_invalid_request_error():
    """405 and 415 on the Messages routes: `invalid_request_error` (Anthropic's type for its other 4xx), not
    `api_error`, which says the server failed; a server fault keeps `api_error`."""
    srv = start_server(AgentEngine())
    try:
        for method, path, body, headers in (
            ("GET", "/v1/messages", None, {}),
            ("POST", "/v1/messages", "{}", {"Content-Type": "text/plain"}),
            ("POST", "/v1/messages/count_tokens", "{}", {"Content-Type": "text/plain"}),
        ):
            status, _, data = raw(srv, method, path, body, headers)
            assert status in (405, 415) and json.loads(data)["error"]["type"] == "invalid_request_error", data
    finally:
        srv.shutdown()
    assert A.error_body(APIError(500, "boom", "server_error"))["error"]["type"] == "api_error"


def test_max_tokens_beyond_the_context_runs_to_the_context_and_says_so():
    """Coding agents send a fixed `max_tokens` whatever the prompt: the reply runs until the
    context is full and ends with `stop_reason: "model_context_window_exceeded"`, as the Messages API answers,
    instead of a 400 on every request once prompt + max_tokens passes the context. A prompt that does not fit
    stays a 400."""
    backend, host = make_backend(AgentEngine(context_length=64))
    try:
        body = {
            "max_tokens": 32000,
            "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": "count"}],
        }
        msg = A.messages(body, backend)
        assert msg["stop_reason"] == "model_context_window_exceeded"
        usage = msg["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["output_tokens"] == 64
        events = sse_events(A.messages({**body, "stream": True}, backend))
        assert events[-2][1]["delta"]["stop_reason"] == "model_context_window_exceeded"
        assert A.messages({**body, "max_tokens": 20}, backend)["stop_reason"] == "max_tokens"  # its own limit
        with pytest.raises(APIError) as err:
            A.messages({**body, "messages": [{"role": "user", "content": "count " * 40}]}, backend)
        assert err.value.status == 400 and err.value.message.startswith("prompt is too long: ")
    finally:
        host.shutdown()


def test_a_refused_key_on_the_messages_route_names_the_header_anthropic_clients_send():
    srv = start_server(AgentEngine(), api_key="k")
    try:
        body = {"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        with pytest.raises(anthropic.AuthenticationError) as err:
            anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(**body)
        assert err.value.body["error"]["type"] == "authentication_error" and "x-api-key" in err.value.message
        ok = anthropic.Anthropic(base_url=srv.url, api_key="k", max_retries=0).messages.create(**body)
        assert ok.type == "message"
    finally:
        srv.shutdown()


def _strict_json(text: str):
    def refuse(word):
        raise ValueError(f"{word} in a reply")

    return json.loads(text, parse_constant=refuse)


def test_a_tool_call_with_nan_or_infinity_arguments_still_answers_standard_json():
    """The model may write `NaN`, `Infinity` or `1e400` as a non-string parameter. Read by Python's lenient
    `json`, they came back as `NaN` / `Infinity` in the reply, which is not JSON (a JavaScript client, Claude
    Code, cannot parse it). They are kept as the text the model wrote, like any other malformed value."""
    values = ("NaN", "-Infinity", "1e400")
    params = "".join(
        f'<｜DSML｜parameter name="p{i}" string="false">{v}</｜DSML｜parameter>\n' for i, v in enumerate(values)
    )
    block = f'\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="sum">\n{params}</｜DSML｜invoke>\n</｜DSML｜tool_calls>'

    class Odd(AgentEngine):
        def reply(self, prompt: str, params) -> str:
            return block

    srv = start_server(Odd())
    body = {"model": "m", "max_tokens": 500, "thinking": {"type": "disabled"}, "tools": [SUM]}
    body["messages"] = [{"role": "user", "content": "please add"}]
    try:
        status, _, data = raw(srv, "POST", "/v1/messages", body)
        assert status == 200
        use = _strict_json(data)["content"][0]
        assert use["type"] == "tool_use" and use["input"] == {f"p{i}": v for i, v in enumerate(values)}
        _, _, data = raw(srv, "POST", "/v1/messages", {**body, "stream": True})
        pieces = [d["delta"]["partial_json"] for _, d in sse_events([data]) if d.get("delta", {}).get("partial_json")]
        assert _strict_json("".join(pieces)) == use["input"]
    finally:
        srv.shutdown()


def test_a_responses_input_ending_with_an_assistant_item_is_a_400(backend):
    """As on chat completions: the V4 prompt has no reply to open after an assistant turn (a last message, function
    call or reasoning item, or a continuation that adds nothing), so it is a 400 naming `input`."""
    store = R.ResponseStore()
    assistant = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hel"}]}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    for items in ([{"role": "user", "content": "hi"}, assistant], [{"role": "user", "content": "hi"}, call]):
        with pytest.raises(APIError) as err:
            R.create({"input": items, "max_output_tokens": 4}, backend, store)
        assert (err.value.status, err.value.param) == (400, "input") and "must end with a user" in err.value.message
    first = R.create({"input": "hi", "max_output_tokens": 4}, backend, store)
    with pytest.raises(APIError) as err:
        R.create({"input": [], "previous_response_id": first["id"], "max_output_tokens": 4}, backend, store)
    assert (err.value.status, err.value.param) == (400, "input")
    follow = R.create({"input": "again", "previous_response_id": first["id"], "max_output_tokens": 4}, backend, store)
    assert follow["status"] in ("completed", "incomplete")


def test_anthropic_output_config_format_reaches_the_grammar_and_bad_shapes_are_a_400(backend):
    """Structured outputs (`output_config.format`, the SDK's `messages.parse()`; the beta's top-level
    `output_format`) were ignored: the reply was free text. Now the schema is the reply's grammar."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    assert A.parse_request(body, backend)[2]["grammar"] is None
    for extra in (
        {"output_config": {"format": {"type": "json_schema", "schema": schema}}},
        {"output_format": {"type": "json_schema", "schema": schema}},
    ):
        assert A.parse_request({**body, **extra}, backend)[2]["grammar"] is not None
    for extra, param in (
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
        ({"output_config": {"format": {"type": "xml", "schema": schema}}}, "output_config.format"),
        ({"output_format": "json"}, "output_format"),
        ({"output_config": "max"}, "output_config"),
    ):
        with pytest.raises(APIError) as err:
            A.messages({**body, **extra}, backend)
        assert (err.value.status, err.value.param) == (400, param), err.value.message


def test_anthropic_effort_xhigh_is_v4s_max(backend):
    """The SDK offers `output_config.effort` "xhigh"; it was a 400. V4 has "high" and "max": it renders as "max"."""
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "adaptive"}}
    conv = {e: A.parse_request({**body, "output_config": {"effort": e}}, backend)[1] for e in ("xhigh", "max", "high")}
    assert conv["xhigh"].render() == conv["max"].render() != conv["high"].render()
    assert A.messages({**body, "output_config": {"effort": "xhigh"}}, backend)["type"] == "message"


def test_a_non_streaming_client_that_leaves_the_server_cancels_its_generation():
    """Through the server's own routes (the test above calls the module): a client of /v1/messages or
    /v1/responses that hangs up before its reply frees the worker instead of leaving it to run to max_tokens."""
    engine = AgentEngine(token_delay=0.01)
    srv = start_server(engine)
    bodies = {
        "/v1/messages": {
            "model": "m",
            "max_tokens": 4000,
            "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": "count"}],
        },
        "/v1/responses": {"input": "count", "max_output_tokens": 4000, "reasoning": {"effort": "none"}},
    }
    try:
        for path, body in bodies.items():
            before = engine.stats()["generated_tokens"]
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            deadline = time.monotonic() + 5
            while engine.stats()["generated_tokens"] == before and time.monotonic() < deadline:
                time.sleep(0.01)
            conn.sock.close()  # the client leaves while its reply is being generated
            deadline = time.monotonic() + 5
            while srv.host.num_running() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not srv.host.num_running(), path
            assert engine.stats()["generated_tokens"] - before < 1000, path  # "count" runs to ~8000 tokens
    finally:
        srv.shutdown()


def _blocks_of_stream(events: list[tuple[str, dict]]) -> list[tuple[str, str]]:
    """(type, text) of each content block a stream builds."""
    blocks: list[list[str]] = []
    for name, data in events:
        if name == "content_block_start":
            blocks.append([data["content_block"]["type"], ""])
        elif name == "content_block_delta":
            delta = data["delta"]
            blocks[data["index"]][1] += delta.get("text", delta.get("thinking", delta.get("partial_json", "")))
    return [tuple(b) for b in blocks]


def test_an_empty_thinking_block_is_left_out_streamed_or_not():
    """The model may close `</think>` at once. The stream sent no thinking block for it while the whole reply had
    an empty one (and no text block when the answer was empty too): the SDK's streamed message differed from
    `create()`'s. Both now leave it out."""

    class Scripted(AgentEngine):
        script = ""

        def reply(self, prompt: str, params) -> str:
            return self.script

    engine = Scripted()
    backend, host = make_backend(engine)
    call = RAW_SUM_CALL
    try:
        for script, kinds in (
            ("</think>answer", ["text"]),
            ("</think>", ["text"]),
            ("</think>" + call, ["tool_use"]),
            ("thought</think>answer", ["thinking", "text"]),
        ):
            engine.script = script
            body = {"max_tokens": 300, "messages": [{"role": "user", "content": "add"}], "tools": [SUM]}
            msg = A.messages({**body, "thinking": {"type": "enabled"}}, backend)
            streamed = _blocks_of_stream(sse_events(A.messages({**body, "stream": True}, backend)))
            assert [b["type"] for b in msg["content"]] == [t for t, _ in streamed] == kinds, script
    finally:
        host.shutdown()


def test_a_prompt_over_the_context_is_refused_in_anthropics_words():
    """Anthropic answers "prompt is too long: N tokens > M maximum", the words clients built for it look for to
    recognise a full context (proxies rewrite other servers' errors into them); fastar's own message ("This
    model's maximum context length is ...") is not recognised."""
    srv = start_server(AgentEngine(context_length=64))
    try:
        body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "word " * 40}]}
        status, _, data = raw(srv, "POST", "/v1/messages", body)
        assert status == 400
        error = json.loads(data)["error"]
        assert error["type"] == "invalid_request_error"
        assert re.fullmatch(r"prompt is too long: (\d+) tokens > 64 maximum", error["message"]), error
        tokens = int(error["message"].split()[4])
        counted = json.loads(raw(srv, "POST", "/v1/messages/count_tokens", body)[2])["input_tokens"]
        assert tokens == counted > 64
    finally:
        srv.shutdown()


def test_a_responses_reply_has_the_same_output_items_streamed_or_not():
    """A reply cut by max_output_tokens inside its reasoning, or whose answer is empty, came back from `create()`
    with an empty message item after the reasoning that the stream's final response (and so the SDK's streamed
    response) did not have; an empty reasoning (`</think>` at once) was an empty reasoning item only there."""

    class Scripted(AgentEngine):
        script = ""

        def reply(self, prompt: str, params) -> str:
            return self.script

    def strip(items: list[dict]) -> list[dict]:  # the ids differ from response to response
        return [{k: v for k, v in o.items() if k != "id"} for o in items]

    engine = Scripted()
    backend, host = make_backend(engine)
    try:
        for script, limit, kinds in (
            ("a long chain of thought</think>answer", 3, ["reasoning"]),
            ("thought</think>", 100, ["reasoning"]),
            ("</think>answer", 100, ["message"]),
            ("</think>", 100, ["message"]),
            ("thought</think>answer", 100, ["reasoning", "message"]),
        ):
            engine.script = script
            body = {"input": "hi", "max_output_tokens": limit, "reasoning": {"effort": "high"}}
            whole = R.create(body, backend, R.ResponseStore())
            streamed = sse_events(R.create({**body, "stream": True}, backend, R.ResponseStore()))[-1][1]["response"]
            assert [o["type"] for o in whole["output"]] == [o["type"] for o in streamed["output"]] == kinds, script
            assert strip(whole["output"]) == strip(streamed["output"]) and whole["status"] == streamed["status"]
    finally:
        host.shutdown()


def test_a_responses_prompt_or_budget_over_the_context_names_the_responses_fields():
    """The Responses request has `input` and `max_output_tokens`; its context errors named chat completions'
    `messages` and `max_tokens` (param and message), fields the client never sent."""
    backend, host = make_backend(AgentEngine(context_length=64))
    try:
        for body, param in (
            ({"input": "count " * 80}, "input"),
            ({"input": "count", "max_output_tokens": 500}, "max_output_tokens"),
        ):
            for stream in (False, True):
                with pytest.raises(APIError) as err:
                    R.create({**body, "stream": stream}, backend, R.ResponseStore())
                assert (err.value.status, err.value.param, err.value.code) == (400, param, "context_length_exceeded")
                assert "max_tokens" not in err.value.message and "messages" not in err.value.message
        assert "max_output_tokens" in err.value.message
    finally:
        host.shutdown()


def test_a_tool_name_holding_a_quote_is_a_400_on_every_route(backend):
    """The model writes a tool's name in a DSML attribute (`invoke name="..."`): a name holding `"` could never be
    called. /v1/messages refused it and so did a forced call; with tools left to the model, chat completions and
    Responses took it without a word."""
    tools = [{"type": "function", "function": {"name": 'a"b'}}]
    with pytest.raises(APIError) as err:
        openai_request.parse_chat_request({"messages": [{"role": "user", "content": "x"}], "tools": tools}, ("m",))
    assert (err.value.status, err.value.param) == (400, "tools[0].function") and "'\"'" in err.value.message
    with pytest.raises(APIError) as err:
        R.parse_request({"input": "x", "tools": [{"type": "function", "name": 'a"b'}]}, backend, R.ResponseStore())
    assert (err.value.status, err.value.param) == (400, "tools") and "'\"'" in err.value.message


def test_an_item_reference_resolves_to_a_stored_output_item(backend):
    """`{"type": "item_reference", "id": ...}` input items (how OpenAI's clients resend an item the server already
    holds) were a 400. They stand for the output item of that id of a stored response: the prompt is the one the
    item itself, resent, gives. An id this server does not hold (unknown, from a `store: false` response, or
    evicted) is a 400 naming the item."""
    store = R.ResponseStore(size=2)
    tools = [{"type": "function", "name": "sum", "description": "Add numbers", "parameters": SUM["input_schema"]}]
    ask = {"role": "user", "content": "please add 1 and 2"}
    first = R.create({"input": [ask], "tools": tools, "reasoning": {"effort": "none"}}, backend, store)
    (call,) = [item for item in first["output"] if item["type"] == "function_call"]
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "3"}

    def prompt(items: list[dict], in_store: R.ResponseStore = store) -> list[int]:
        body = {"input": items, "tools": tools, "reasoning": {"effort": "none"}}
        return prompt_ids(backend, R.parse_request(body, backend, in_store).conv)[1]

    inline = prompt([ask, call, result])
    assert prompt([ask, {"type": "item_reference", "id": call["id"]}, result]) == inline
    assert prompt([ask, {"id": call["id"], "type": "item_reference"}, result]) != prompt([ask, result])
    unstored = R.create({"input": "hi", "store": False, "max_output_tokens": 4}, backend, store)
    for ref in (
        {"type": "item_reference", "id": "fc_nope"},
        {"type": "item_reference", "id": unstored["output"][0]["id"]},
        {"type": "item_reference"},
    ):
        with pytest.raises(APIError) as err:
            prompt([ask, ref, result])
        assert (err.value.status, err.value.param) == (400, "input[1]") and "item_reference" in err.value.message
    for _ in range(2):  # two more stored responses: the first one, and its items, are evicted
        R.create({"input": "hi", "max_output_tokens": 4}, backend, store)
    with pytest.raises(APIError) as err:
        prompt([ask, {"type": "item_reference", "id": call["id"]}, result])
    assert err.value.param == "input[1]" and "no stored output item" in err.value.message


def test_anthropic_tool_choice_and_tool_results_are_checked_without_tools_too(backend):
    """`tool_choice` of an unknown type was checked only when the request had tools (without, it was taken), and a
    `tool_result` without a `tool_use_id` (or with a number) was rendered as the result of no call, where chat
    completions refuses a tool message without its `tool_call_id`. Both are a 400 naming the field now."""
    base = {"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for body, param, words in (
        ({**base, "tool_choice": {"type": "bogus"}}, "tool_choice", "'tool_choice' must be"),
        ({**base, "tool_choice": "auto"}, "tool_choice", "'tool_choice' must be"),
        (
            {**base, "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "3"}]}]},
            "messages",
            "messages[0].content[0]: a tool_result block needs the non-empty string 'tool_use_id'",
        ),
        (
            {**base, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 5}]}]},
            "messages",
            "needs the non-empty string 'tool_use_id'",
        ),
    ):
        with pytest.raises(APIError) as err:
            A.parse_request(body, backend)
        assert (err.value.status, err.value.param) == (400, param) and words in err.value.message, err.value.message
    ok = {**base, "tool_choice": {"type": "none"}}
    assert A.parse_request(ok, backend)[2]["grammar"] is None


def test_an_empty_responses_input_is_a_400_naming_input(backend):
    """`input: []` said "messages must be a non-empty list of dicts", the encoder's words for a field the Responses
    API does not have."""
    with pytest.raises(APIError) as err:
        R.create({"input": [], "max_output_tokens": 4}, backend, R.ResponseStore())
    assert err.value.status == 400 and err.value.param == "input"
    assert "'input'" in err.value.message and "messages" not in err.value.message


def test_responses_function_calls_and_outputs_need_their_call_id(backend):
    """A `function_call_output` without `call_id` (or with a number) was rendered as the result of no call, and a
    `function_call` without one as a call no output could answer; chat completions refuses a tool message without
    its `tool_call_id`. Both are a 400 naming the item now."""
    ask = {"role": "user", "content": "please add 1 and 2"}
    call = {"type": "function_call", "call_id": "c1", "name": "sum", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "3"}
    assert R.input_messages([ask, call, output])[-1] == {"role": "tool", "tool_call_id": "c1", "content": "3"}
    for items, at in (
        ([ask, call, {**output, "call_id": None}], 2),
        ([ask, call, {k: v for k, v in output.items() if k != "call_id"}], 2),
        ([ask, {**call, "call_id": 7}, output], 1),
        ([ask, {**call, "call_id": ""}, output], 1),
    ):
        with pytest.raises(APIError) as err:
            R.input_messages(items)
        assert (err.value.status, err.value.param) == (400, "input") and f"input[{at}]: a " in err.value.message
        assert "non-empty string 'call_id'" in err.value.message


def test_responses_tool_parameters_and_description_are_checked_as_on_the_other_apis(backend):
    """A Responses function tool whose `parameters` is not an object (or whose `description` is not a string) was
    put in the prompt as it came (`5`, a list), where chat completions and Messages refuse it. A 400 now."""
    for tool, words in (
        ({"type": "function", "name": "f", "parameters": 5}, "tools[0].parameters must be a JSON Schema object"),
        ({"type": "function", "name": "f", "parameters": ["x"]}, "tools[0].parameters must be a JSON Schema object"),
        ({"type": "function", "name": "f", "description": {"a": 1}}, "tools[0].description must be a string"),
    ):
        with pytest.raises(APIError) as err:
            R.parse_request({"input": "hi", "tools": [tool]}, backend, R.ResponseStore())
        assert (err.value.status, err.value.param) == (400, "tools") and words in err.value.message
    ok = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}
    R.parse_request({"input": "hi", "tools": [ok]}, backend, R.ResponseStore())


def test_responses_metadata_is_string_pairs_or_a_400(backend):
    """`metadata` is echoed in the response object, which clients type as string -> string: `"x"` or `{"a": 5}` was
    echoed as it came. A 400 naming `metadata` now, as are more pairs or longer strings than OpenAI allows."""
    for metadata in ("x", ["a"], {"a": 5}, {f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}):
        with pytest.raises(APIError) as err:
            R.parse_request({"input": "hi", "metadata": metadata}, backend, R.ResponseStore())
        assert (err.value.status, err.value.param) == (400, "metadata")
    out = R.create({"input": "hi", "max_output_tokens": 2, "metadata": {"run": "7"}}, backend, R.ResponseStore())
    assert out["metadata"] == {"run": "7"}


def test_a_responses_conversation_is_a_400_not_ignored(backend):
    """`conversation` asks the server to prepend a stored Conversation's items; this server keeps none, and
    ignoring the field answered the new input alone as if it were the whole conversation."""
    for conversation in ("conv_123", {"id": "conv_123"}):
        with pytest.raises(APIError) as err:
            R.parse_request({"input": "and then?", "conversation": conversation}, backend, R.ResponseStore())
        assert (err.value.status, err.value.param) == (400, "conversation")
        assert "previous_response_id" in err.value.message
    assert R.parse_request({"input": "hi", "conversation": None}, backend, R.ResponseStore())


def test_responses_delete_and_input_items_on_the_server():
    """`GET /v1/responses/{id}/input_items` lists a stored response's own input items (ids given to those without,
    a string input as one user message, an item_reference as the item it names) as OpenAI's list object, newest first
    by default, paged by `limit` and `after` (the `openai` client's pager walks them all); `DELETE` removes the
    response (OpenAI's deletion object), after which retrieving, listing, continuing or deleting it again is a 404;
    a bad `order` or `limit` is a 400 naming it."""
    server = start_server()
    try:
        cl = client(server)
        first = cl.responses.create(model="deepseek-v4-flash", input="hello", temperature=0, max_output_tokens=8)
        status, _, data = raw(server, "GET", f"/v1/responses/{first.id}/input_items")
        listed = json.loads(data)
        assert status == 200 and listed["object"] == "list" and listed["has_more"] is False
        (item,) = listed["data"]
        assert item["type"] == "message" and item["role"] == "user" and item["id"].startswith("msg_")
        assert item["content"] == [{"type": "input_text", "text": "hello"}]
        assert listed["first_id"] == listed["last_id"] == item["id"]

        given = [
            {"type": "message", "role": "user", "content": f"turn {i}", **({"id": "msg_mine"} if i == 2 else {})}
            for i in range(5)
        ]
        reference = {"type": "item_reference", "id": first.output[-1].id}
        second = cl.responses.create(
            model="deepseek-v4-flash", input=[*given[:4], reference, given[4]], temperature=0, max_output_tokens=8
        )
        ids = [i.id for i in cl.responses.input_items.list(second.id, order="asc", limit=2)]  # three pages
        assert len(ids) == 6 and ids[2] == "msg_mine" and ids[4] == first.output[-1].id and len(set(ids)) == 6
        status, _, data = raw(server, "GET", f"/v1/responses/{second.id}/input_items?limit=2&after={ids[3]}")
        page = json.loads(data)  # newest first: after the 4th comes the 3rd and the 2nd, and the 1st is left
        assert [i["id"] for i in page["data"]] == [ids[2], ids[1]] and page["has_more"] is True
        assert (page["first_id"], page["last_id"]) == (ids[2], ids[1])
        assert (
            json.loads(raw(server, "GET", f"/v1/responses/{second.id}/input_items")[2])["data"][0]["id"] == ids[5]
        )  # desc
        for query, param in (("order=up", "order"), ("limit=0", "limit"), ("limit=101", "limit"), ("limit=x", "limit")):
            status, _, data = raw(server, "GET", f"/v1/responses/{second.id}/input_items?{query}")
            assert status == 400 and json.loads(data)["error"]["param"] == param, query

        status, _, data = raw(server, "DELETE", f"/v1/responses/{first.id}")
        assert status == 200 and json.loads(data) == {"id": first.id, "object": "response", "deleted": True}
        for method, path in (
            ("GET", f"/v1/responses/{first.id}"),
            ("GET", f"/v1/responses/{first.id}/input_items"),
            ("DELETE", f"/v1/responses/{first.id}"),
        ):
            status, _, data = raw(server, method, path)
            err = json.loads(data)["error"]
            assert status == 404 and err["code"] == "response_not_found" and first.id in err["message"], path
        with pytest.raises(openai.NotFoundError):
            cl.responses.create(model="deepseek-v4-flash", input="x", previous_response_id=first.id)
        with pytest.raises(openai.BadRequestError):  # its output items went with it
            cl.responses.create(model="deepseek-v4-flash", input=[reference, given[0]], max_output_tokens=4)
        cl.responses.delete(second.id)  # the client's own call
        assert raw(server, "GET", f"/v1/responses/{second.id}")[0] == 404
    finally:
        server.shutdown()


# ---------------------------------------------------------------------------------------------------------
# Found by tests/test_fuzz_server.py's long runs
# ---------------------------------------------------------------------------------------------------------


def test_anthropic_metadata_of_the_wrong_shape_is_a_400(backend):
    """`metadata` is `{"user_id": string}`: `0`, `"x"`, `[]` or a numeric `user_id` were answered 200, ignored."""
    msgs = [{"role": "user", "content": "hello"}]
    for metadata in (0, "x", [], True, {"user_id": 5}, {"user_id": ["u"]}):
        with pytest.raises(APIError) as err:
            A.messages({"max_tokens": 5, "messages": msgs, "metadata": metadata}, backend)
        assert (err.value.status, err.value.param) == (400, "metadata") and "'metadata" in err.value.message
    for metadata in ({"user_id": "u-1"}, {}, {"user_id": None}, None):
        assert A.messages({"max_tokens": 5, "messages": msgs, "metadata": metadata}, backend)["type"] == "message"


def test_a_falsy_output_config_or_reasoning_of_the_wrong_type_is_a_400(backend):
    """`0`, `false`, `""` and `[]` are not objects: they were taken for an absent `output_config` (Messages) or
    `reasoning` (Responses) and answered 200; only `null` means absent."""
    msgs = [{"role": "user", "content": "hello"}]
    for value in (0, False, "", []):
        with pytest.raises(APIError) as err:
            A.messages({"max_tokens": 5, "messages": msgs, "output_config": value}, backend)
        assert (err.value.status, err.value.param) == (400, "output_config")
        with pytest.raises(APIError) as err:
            R.parse_request({"input": "hi", "reasoning": value}, backend, R.ResponseStore())
        assert (err.value.status, err.value.param) == (400, "reasoning")
    assert A.messages({"max_tokens": 5, "messages": msgs, "output_config": None}, backend)["type"] == "message"
    assert R.parse_request({"input": "hi", "reasoning": None}, backend, R.ResponseStore())


def test_responses_include_must_be_a_list_of_strings(backend):
    """`include` of another type (`"reasoning.encrypted_content"` as a bare string, `{}`, `[1]`) was ignored and
    answered 200, the encrypted reasoning silently left out; now a 400 naming `include`."""
    for include in ("reasoning.encrypted_content", {}, [1], 0, "", True):
        with pytest.raises(APIError) as err:
            R.parse_request({"input": "hi", "include": include}, backend, R.ResponseStore())
        assert (err.value.status, err.value.param) == (400, "include") and "'include'" in err.value.message
    req = R.parse_request({"input": "hi", "include": ["reasoning.encrypted_content"]}, backend, R.ResponseStore())
    assert req.encrypted


def test_a_previous_response_id_that_is_not_a_string_is_a_400_not_a_404(backend):
    """`previous_response_id: 141` is the client's mistake, not an id the store let go: it was a 404
    `previous_response_not_found` saying "id '141' not found"."""
    for prev in (141, ["resp_1"], {"id": "resp_1"}, True):
        with pytest.raises(APIError) as err:
            R.parse_request({"input": "hi", "previous_response_id": prev}, backend, R.ResponseStore())
        assert (err.value.status, err.value.param) == (400, "previous_response_id")


def test_a_reasoning_item_whose_text_is_not_a_string_is_a_400_naming_it(backend):
    """A reasoning item's `reasoning_text` part with a numeric `text` raised a TypeError joining the parts: a 500.
    Now a 400 naming the part, as are `content` / `summary` that are not lists and a non-string
    `encrypted_content`."""
    cases = (
        ({"content": [{"type": "reasoning_text", "text": 5}]}, "input[0].content[0].text"),
        ({"summary": [{"type": "summary_text", "text": "ok"}, {"type": "summary_text", "text": None}]}, "summary[1]"),
        ({"content": "thought"}, "input[0].content must be a list"),
        ({"summary": 3}, "input[0].summary must be a list"),
        ({"encrypted_content": 7}, "input[0].encrypted_content"),
    )
    for fields_, words in cases:
        item = {"type": "reasoning", **fields_}
        with pytest.raises(APIError) as err:
            R.parse_request({"input": [item, {"role": "user", "content": "hi"}]}, backend, R.ResponseStore())
        assert (err.value.status, err.value.param) == (400, "input") and words in err.value.message, err.value.message
    ok = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "thought"}]}
    req = R.parse_request({"input": [ok, {"role": "user", "content": "hi"}]}, backend, R.ResponseStore())
    assert req.conversation[0]["reasoning_content"] == "thought"


def test_ids_a_client_sent_are_quoted_on_one_line_in_errors(backend):
    """An id holding a newline (a response id in the path, `previous_response_id`, `after`) made the 404's message
    two lines; the ids are quoted with their control characters escaped, and long ones cut."""
    store = R.ResponseStore()
    for rid in ("a\nb", "x" * 5000):
        for call in (
            lambda: R.retrieve(rid, store),
            lambda: R.parse_request({"input": "hi", "previous_response_id": rid}, backend, store),
        ):
            with pytest.raises(APIError) as err:
                call()
            assert err.value.status == 404 and "\n" not in err.value.message and len(err.value.message) < 300
    obj = R.create({"input": "hi", "max_output_tokens": 2}, backend, store)
    with pytest.raises(APIError) as err:
        response_items.list_input_items(obj["id"], store, {"after": "x\ny"})
    assert err.value.status == 404 and "'x\\ny'" in err.value.message


# ---------------------------------------------------------------------------------------------------------
# Plain-text documents (fastar.serve.documents)
# ---------------------------------------------------------------------------------------------------------

NOTES = (
    "<document>\n<title>notes.txt</title>\n<context>From Monday</context>\n"
    "<content>\nline one\nline two\n</content>\n</document>"
)


def _doc(source: dict, **kw) -> dict:
    return {"type": "document", "source": source, **kw}


def test_anthropic_text_documents_reach_the_engine_rendered_and_count_tokens_agrees(backend):
    """A plain-text `document` block (a `text` source, a `content` source as a string or as text blocks, in a user
    turn or a `tool_result`) reaches the engine as its rendered text in the turn; `count_tokens` counts the prompt
    the generating route runs, and the route's prompt equals the one of the same turn sent as plain text."""
    text_source = {"type": "text", "media_type": "text/plain", "data": "line one\nline two"}
    untitled = "<document>\n<content>\nline one\nline two\n</content>\n</document>"
    ask = {"type": "text", "text": "Summarize it."}
    cases = [
        ([_doc(text_source, title="notes.txt", context="From Monday"), ask], NOTES + "\nSummarize it."),
        ([_doc(text_source, citations={"enabled": False}, title="", context=None), ask], untitled + "\nSummarize it."),
        ([ask, _doc({"type": "content", "content": "line one\nline two"})], "Summarize it.\n" + untitled),
        (
            [
                _doc(
                    {
                        "type": "content",
                        "content": [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}],
                    }
                )
            ],
            untitled,
        ),
    ]
    for content, expected in cases:
        body = {
            "max_tokens": 500,
            "temperature": 0,
            "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": content}],
        }
        msg = A.messages(body, backend)
        assert msg["content"] == [{"type": "text", "text": f"Echo: {expected}"}], content
        usage = msg["usage"]
        counted = A.count_tokens(body, backend)["input_tokens"]
        assert counted == usage["input_tokens"] + usage["cache_read_input_tokens"]
        plain = {**body, "messages": [{"role": "user", "content": expected}]}
        assert prompt_ids(backend, A.parse_request(body, backend)[1]) == prompt_ids(
            backend, A.parse_request(plain, backend)[1]
        )
    # in a tool_result's content, where the Messages API allows documents too
    call = {"type": "tool_use", "id": "t1", "name": "sum", "input": {}}
    result = [{"type": "text", "text": "read:"}, _doc(text_source, title="notes.txt", context="From Monday")]

    def turns(result_content) -> dict:
        return {
            "max_tokens": 500,
            "tools": [SUM],
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": result_content}]},
            ],
        }

    with_doc, as_text = turns(result), turns("read:\n" + NOTES)
    assert prompt_ids(backend, A.parse_request(with_doc, backend)[1]) == prompt_ids(
        backend, A.parse_request(as_text, backend)[1]
    )
    assert A.count_tokens(with_doc, backend) == A.count_tokens(as_text, backend)


def test_anthropic_documents_the_model_cannot_read_are_a_400_naming_the_block(backend):
    """PDFs (base64), URL and Files API sources, another media type, an image in a `content` source, requested
    citations (never returned here), malformed fields, and a document where only text is taken (`system`): each a
    one-line 400 naming the block."""
    pdf = {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0xLjQK"}
    only_text = "only plain-text documents are"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}}
    cases = [
        (_doc(pdf), 'messages[0].content[0]: a base64 document ("application/pdf") is not read', only_text),
        (
            _doc({"type": "url", "url": "https://example.com/a.pdf"}),
            "messages[0].content[0]: a document by URL",
            only_text,
        ),
        (_doc({"type": "file", "file_id": "file_1"}), "messages[0].content[0]: a document by file_id", only_text),
        (
            _doc({"type": "text", "media_type": "text/html", "data": "<p>"}),
            "messages[0].content[0].source.media_type",
            '"text/html"',
        ),
        (
            _doc({"type": "text", "media_type": "text/plain"}),
            "messages[0].content[0].source: a text source needs",
            "'data'",
        ),
        (
            _doc({"type": "content", "content": [{"type": "text", "text": "a"}, image]}),
            "messages[0].content[0].source.content[1]",
            '"image"',
        ),
        (_doc({"type": "content", "content": 5}), "messages[0].content[0].source.content must be", "text blocks"),
        (
            _doc({"type": "text", "media_type": "text/plain", "data": "a"}, citations={"enabled": True}),
            "messages[0].content[0].citations",
            "never returns citation blocks",
        ),
        (
            _doc({"type": "text", "media_type": "text/plain", "data": "a"}, citations=True),
            "messages[0].content[0].citations must be",
            "enabled",
        ),
        (
            _doc({"type": "text", "media_type": "text/plain", "data": "a"}, title=5),
            "messages[0].content[0].title must be a string",
            "5",
        ),
        ({"type": "document"}, "messages[0].content[0]: a document block needs a 'source' object", ""),
    ]
    for block, start, words in cases:
        body = {"max_tokens": 5, "messages": [{"role": "user", "content": [block, {"type": "text", "text": "hi"}]}]}
        for call in (A.messages, A.count_tokens):
            with pytest.raises(APIError) as err:
                call(body, backend)
            message = err.value.message
            assert err.value.status == 400 and message.startswith(start) and words in message, message
            assert "\n" not in message
    doc = _doc({"type": "text", "media_type": "text/plain", "data": "a"})
    with pytest.raises(APIError) as err:
        A.messages({"max_tokens": 5, "system": [doc], "messages": [{"role": "user", "content": "hi"}]}, backend)
    assert err.value.status == 400 and err.value.message.startswith("system[0]: only text blocks are supported here")


def test_the_anthropic_client_sends_a_text_document_the_route_reads(app):
    """The `anthropic` SDK's own document block shapes reach the engine rendered, and its count_tokens agrees."""
    cl = anthropic.Anthropic(base_url=app.url, api_key=API_KEY, max_retries=0)
    content = [
        {
            "type": "document",
            "source": {"type": "text", "media_type": "text/plain", "data": "line one\nline two"},
            "title": "notes.txt",
            "context": "From Monday",
        },
        {"type": "text", "text": "Summarize it."},
    ]
    msg = cl.messages.create(
        model="x",
        max_tokens=500,
        extra_body={"temperature": 0},
        thinking={"type": "disabled"},
        messages=[{"role": "user", "content": content}],
    )
    assert msg.content[0].text == f"Echo: {NOTES}\nSummarize it."
    count = cl.messages.count_tokens(
        model="x", thinking={"type": "disabled"}, messages=[{"role": "user", "content": content}]
    )
    assert count.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_responses_text_input_files_reach_the_engine_rendered_as_documents(backend):
    """An `input_file` whose `file_data` is a data URL of a text type (the filename as its title) reaches the engine
    as the same rendered document a Messages `document` block gives, in a message or a `function_call_output`."""
    notes = "<document>\n<title>notes.txt</title>\n<content>\nline one\nline two\n</content>\n</document>"
    untitled = '<document>\n<content>\n{"a": 1}\n</content>\n</document>'
    file = {"type": "input_file", "filename": "notes.txt", "file_data": data_url("line one\nline two")}
    ask = {"type": "input_text", "text": "Summarize it."}
    cases = [
        ([file, ask], notes + "\nSummarize it."),
        ([{"type": "input_file", "file_data": data_url('{"a": 1}', "application/json")}], untitled),
        ([{**file, "file_data": "data:text/markdown;charset=utf-8,line%20one%0Aline%20two", "file_id": None}], notes),
    ]
    for content, expected in cases:
        body = {
            "input": [{"role": "user", "content": content}],
            "temperature": 0,
            "reasoning": {"effort": "none"},
            "max_output_tokens": 500,
        }
        out = R.create(body, backend, R.ResponseStore())
        assert out["output"][-1]["content"][0]["text"] == f"Echo: {expected}", content
    ask = {"role": "user", "content": "please add 1 and 2"}
    call = {"type": "function_call", "call_id": "c1", "name": "sum", "arguments": "{}"}
    output = {
        "type": "function_call_output",
        "call_id": "c1",
        "output": [{"type": "input_text", "text": "read:"}, file],
    }
    assert R.input_messages([ask, call, output])[-1]["content"] == "read:\n" + notes


def test_responses_input_files_the_model_cannot_read_are_a_400_naming_the_part(backend):
    """By `file_id` (no Files API here), by `file_url` (nothing is fetched), of a type that is not text, not a
    data URL, not base64, not UTF-8, or of another charset: each a one-line 400 naming the part and why."""
    cases = [
        ({"file_id": "file-abc"}, "no Files API"),
        ({"file_url": "https://example.com/a.txt"}, "fetches nothing"),
        ({"file_data": data_url("%PDF-1.4", "application/pdf"), "filename": "a.pdf"}, '"application/pdf" is not read'),
        ({"file_data": data_url("x", "image/png")}, "only text files are"),
        ({"file_data": base64.b64encode(b"hello").decode()}, "must be a data URL"),
        ({"file_data": "data:text/plain;base64,not base64!"}, "not valid base64"),
        (
            {"file_data": "data:text/plain;base64," + base64.b64encode(b"caf\xe9").decode()},
            "not UTF-8 text (byte 0xe9 at offset 3)",
        ),
        ({"file_data": "data:text/plain;charset=latin-1;base64,YQ=="}, 'charset "latin-1"'),
        ({"filename": "a.txt"}, "needs 'file_data'"),
        ({"file_data": data_url("a"), "filename": 5}, "filename must be a string"),
    ]
    for fields_, words in cases:
        content = [{"type": "input_text", "text": "hi"}, {"type": "input_file", **fields_}]
        body = {"input": [{"role": "user", "content": content}], "max_output_tokens": 5}
        with pytest.raises(APIError) as err:
            R.create(body, backend, R.ResponseStore())
        message = err.value.message
        assert (err.value.status, err.value.param) == (400, "input") and message.startswith("input[0].content[1]")
        assert words in message and "\n" not in message, message


def test_a_responses_input_part_of_the_other_sides_kind_is_a_400_naming_the_part():
    """OpenAI's Responses API takes only `output_text` and `refusal` parts in an assistant message, and only input
    parts (`input_text`, `input_image`, `input_file`) in a user, system or developer message or a tool's output;
    another is a 400 `invalid_value` whose `param` is the part's path. Over HTTP, in OpenAI's error shape; a
    readable file in an assistant message too (it would be put in the model's mouth). The right kinds, a refusal
    and the server's own replay (`previous_response_id`, an `item_reference`) still run."""
    server = start_server()
    try:
        file = {"type": "input_file", "filename": "notes.txt", "file_data": data_url("line one")}
        cases = [
            (1, "assistant", [{"type": "input_text", "text": "I said"}], "input[1].content[0]", "'input_text'"),
            (1, "assistant", [{"type": "output_text", "text": "ok"}, file], "input[1].content[1]", "'input_file'"),
            (1, "assistant", [{"type": "input_image", "image_url": "x"}], "input[1].content[0]", "'input_image'"),
            (0, "user", [{"type": "output_text", "text": "hi"}], "input[0].content[0]", "'output_text'"),
            (0, "developer", [{"type": "refusal", "refusal": "no"}], "input[0].content[0]", "'refusal'"),
        ]
        for at, role, content, param, kind in cases:
            items = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
            items[at] = {"type": "message", "role": role, "content": content}
            body = {"model": "deepseek-v4-flash", "input": [*items, {"role": "user", "content": "go on"}]}
            status, _, data = raw(server, "POST", "/v1/responses", {**body, "max_output_tokens": 4})
            err = json.loads(data)["error"]
            assert status == 400, data
            assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, "invalid_value"), data
            assert err["message"].startswith(f"{param}.type: invalid value {kind} in a") and "\n" not in err["message"]
            assert ("'output_text' and 'refusal'" in err["message"]) == (role == "assistant"), err["message"]
        call = {"type": "function_call", "call_id": "c1", "name": "sum", "arguments": "{}"}
        output = {"type": "function_call_output", "call_id": "c1", "output": [{"type": "output_text", "text": "3"}]}
        body = {"model": "deepseek-v4-flash", "input": [{"role": "user", "content": "add"}, call, output]}
        status, _, data = raw(server, "POST", "/v1/responses", {**body, "max_output_tokens": 4})
        assert status == 400 and json.loads(data)["error"]["param"] == "input[2].output[0]", data

        cl = client(server)
        said = [{"type": "output_text", "text": "I said "}, {"type": "refusal", "refusal": "no."}]
        ok = cl.responses.create(
            model="deepseek-v4-flash",
            input=[
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}, file]},
                {"type": "message", "role": "assistant", "content": said},
                {"role": "user", "content": [{"type": "input_text", "text": "go on"}]},
            ],
            max_output_tokens=40,
            temperature=0,
            reasoning={"effort": "none"},
        )
        assert ok.output_text == "Echo: go on"
        again = dict(max_output_tokens=40, temperature=0, reasoning={"effort": "none"})
        follow = cl.responses.create(model="deepseek-v4-flash", previous_response_id=ok.id, input="more", **again)
        assert follow.output_text == "Echo: more"
        reference = {"type": "item_reference", "id": follow.output[-1].id}
        resent = [{"role": "user", "content": "more"}, reference, {"role": "user", "content": "again"}]
        assert cl.responses.create(model="deepseek-v4-flash", input=resent, **again).output_text == "Echo: again"
    finally:
        server.shutdown()


def test_a_responses_input_part_of_an_unknown_type_is_a_400_naming_its_type_and_the_allowed_ones():
    """A part whose `type` OpenAI's Responses API does not take there (Chat Completions' bare `text`, a typo, none) was
    read as text (`text`) or a 400 without a code: it is answered as OpenAI answers it, a 400 `invalid_value`
    whose `param` is the part's path and whose message names the `type` field and the types allowed in that role.
    A part that is no object, or whose text is no string, names itself too."""
    server = start_server()
    try:
        user_types, assistant_types = "'input_text', 'input_image' and 'input_file'", "'output_text' and 'refusal'"
        cases = [
            (0, "user", {"type": "text", "text": "hi"}, "invalid value 'text'", user_types),
            (1, "assistant", {"type": "text", "text": "ok"}, "invalid value 'text'", assistant_types),
            (0, "system", {"type": "input_txt", "text": "hi"}, "invalid value 'input_txt'", user_types),
            (0, "developer", {"text": "hi"}, "missing", user_types),
            (1, "assistant", {"type": 5, "text": "ok"}, "invalid value 5", assistant_types),
        ]
        for at, role, part, said, allowed in cases:
            items = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
            items[at] = {"type": "message", "role": role, "content": [part]}
            body = {"model": "deepseek-v4-flash", "input": [*items, {"role": "user", "content": "go on"}]}
            status, _, data = raw(server, "POST", "/v1/responses", {**body, "max_output_tokens": 4})
            err = json.loads(data)["error"]
            param = f"input[{at}].content[0]"
            assert status == 400, data
            assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, "invalid_value"), data
            message = err["message"]
            assert message.startswith(f"{param}.type: {said} in a") and "\n" not in message, message
            assert f"supported values are {allowed}" in message, message
        output = {"type": "function_call_output", "call_id": "c1", "output": [{"type": "text", "text": "3"}]}
        call = {"type": "function_call", "call_id": "c1", "name": "sum", "arguments": "{}"}
        body = {"model": "deepseek-v4-flash", "input": [{"role": "user", "content": "add"}, call, output]}
        status, _, data = raw(server, "POST", "/v1/responses", {**body, "max_output_tokens": 4})
        err = json.loads(data)["error"]
        assert status == 400 and (err["param"], err["code"]) == ("input[2].output[0]", "invalid_value"), data
        assert err["message"].startswith("input[2].output[0].type: invalid value 'text' in a function_call_output")
    finally:
        server.shutdown()
    for part, says in [
        ("hi", 'input[0].content[0] must be a content part (an object), got "hi"'),
        ({"type": "input_text", "text": 5}, "input[0].content[0].text must be a string, got 5"),
        ({"type": "refusal", "refusal": None}, None),  # a refusal is the assistant's: checked by role first
    ]:
        with pytest.raises(APIError) as info:
            R.input_messages([{"role": "user", "content": [part]}])
        if says is not None:
            assert (info.value.status, info.value.message) == (400, says)
    with pytest.raises(APIError, match=r"^input\[0\]\.content\[0\]\.refusal must be a string, got null$"):
        R.input_messages([{"role": "assistant", "content": [{"type": "refusal", "refusal": None}]}])


def test_a_past_calls_arguments_render_alike_from_every_api_and_the_library(backend):
    """A past call's arguments render as DeepSeek's encoder renders them, whichever API carried them: JSON text
    (chat completions' `function.arguments`, a Responses `function_call`'s `arguments`), the object itself (an
    Anthropic `tool_use`'s `input`, or the library's `engine.chat`, whose encoder takes both) give the same
    prompt; text that is not JSON is taken by chat completions, Responses and the library alike, and rendered as
    the reference renders it, one string parameter `arguments` holding the text (not refused: OpenAI takes it too)."""
    from fastar.encoding import DSML

    def chat_of(arguments) -> list[dict]:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return [
            {"role": "user", "content": "w"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "x"},
        ]

    def responses_of(arguments: str) -> list[dict]:
        call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments}
        return [
            {"role": "user", "content": "w"},
            call,
            {"type": "function_call_output", "call_id": "c1", "output": "x"},
        ]

    text = '{"q": "h", "n": 2}'
    prompt = encode_messages(chat_of(text), "chat")
    assert f'<{DSML}parameter name="n" string="false">2</{DSML}parameter>' in prompt
    assert encode_messages(chat_of(json.loads(text)), "chat") == prompt  # the library's object
    assert encode_messages(R.input_messages(responses_of(text)), "chat") == prompt
    use = {"type": "tool_use", "id": "c1", "name": "f", "input": json.loads(text)}
    anthropic = {
        "max_tokens": 5,
        "thinking": {"type": "disabled"},
        "messages": [
            {"role": "user", "content": "w"},
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "x"}]},
        ],
    }
    assert A.parse_request(anthropic, backend)[1].render() == prompt

    raw_prompt = encode_messages(chat_of("{not json"), "chat")
    assert f'<{DSML}parameter name="arguments" string="true">{{not json</{DSML}parameter>' in raw_prompt
    assert encode_messages(R.input_messages(responses_of("{not json")), "chat") == raw_prompt
    assert raw_prompt == encode_messages(chat_of({"arguments": "{not json"}), "chat")
