"""A reply cut off inside its tool-call block (max_tokens mid-name, mid-arguments, right after the opener; a stop
string inside the block), in the three API shapes over the real server and the scripted engine: the stream,
reassembled as a client does (chat completions' also by the `openai` client's own accumulation, each call streamed
piece by piece in OpenAI's delta shape), is the non-streamed reply (blocks / items / message, text, tool calls, stop or
finish reason, usage), the block's raw DSML never comes back as text, and an unfinished call is never given as a
complete one (`fastar.serve.cut_calls`)."""

from __future__ import annotations

import json

import pytest
from test_agents_api import AgentEngine, sse_events
from test_server import FakeTokenizer, _sse_events, accumulate_chat, raw, same_chat_choices, start_server

from fastar.encoding import StreamParser
from fastar.serve.cut_calls import ToolBlock

jiter = pytest.importorskip("jiter", reason="the anthropic client's partial JSON reader, a test dependency")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency")

PREFIX = "Let me look."
BLOCK = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="location" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
SCRIPT = PREFIX + BLOCK
TOOL = {
    "name": "get_weather",
    "description": "Weather",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer"}}},
}


def at(marker: str, extra: int = 0) -> int:
    """max_tokens that cuts the script right after `marker` (+ extra tokens): one token per character, the DSML
    marker one (`FakeTokenizer`, as the V4 tokenizer has it)."""
    return len(FakeTokenizer().encode(SCRIPT[: SCRIPT.index(marker) + len(marker)])) + extra


# (case, max_tokens, stop, the tool call's input as the client ends up with it, or None for no call)
CUTS = [
    ("mid-opener", at("<｜DSML｜tool_"), None, None),
    ("after the opener", at("<｜DSML｜tool_calls>\n"), None, None),
    ("mid-name", at('name="get_wea'), None, None),
    ("mid-arguments", at('string="true">Pa'), None, {}),
    ("mid a non-string value", at('string="false">'), None, {"location": "Paris"}),
    ("between calls and the closer", at("</｜DSML｜invoke>"), None, {"location": "Paris", "days": 3}),
    ("stop string inside the block", 400, ["ari"], {}),
    ("whole", 400, None, {"location": "Paris", "days": 3}),
]


class ScriptedEngine(AgentEngine):
    script = SCRIPT
    thought = "Hmm."

    def reply(self, prompt: str, params) -> str:
        return (f"{self.thought}</think>" if prompt.endswith("<think>") else "") + self.script


@pytest.fixture(scope="module")
def server():
    srv = start_server(ScriptedEngine())
    yield srv
    srv.shutdown()


def post(server, path: str, body: dict, stream: bool):
    status, _, data = raw(server, "POST", path, {**body, "stream": stream}, {"x-api-key": "k"})
    assert status == 200, data
    return data if stream else json.loads(data)


def anthropic_stream(data: bytes) -> dict:
    """The message a streaming Anthropic client builds (tool input read as the SDK reads it: partially)."""
    msg, bufs = {}, {}
    for name, ev in sse_events([data]):
        if name == "message_start":
            msg = ev["message"]
        elif name == "content_block_start":
            msg["content"].append(dict(ev["content_block"]))
        elif name == "content_block_delta":
            block, delta = msg["content"][ev["index"]], ev["delta"]
            if delta["type"] == "input_json_delta":
                bufs[ev["index"]] = bufs.get(ev["index"], "") + delta["partial_json"]
                block["input"] = jiter.from_json(bufs[ev["index"]].encode(), partial_mode=True)
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                key = "text" if delta["type"] == "text_delta" else "thinking"
                block[key] += delta[key]
        elif name == "message_delta":
            msg.update(ev["delta"], usage=ev["usage"])
    msg["_json"] = bufs  # the raw argument text of each tool_use block
    return msg


def responses_stream(data: bytes) -> tuple[dict, list[dict]]:
    """The final response event, and the items as the item and delta events built them."""
    events = sse_events([data])
    items: dict[int, dict] = {}
    for name, ev in events:
        if name == "response.output_item.added":
            items[ev["output_index"]] = {"deltas": ""}
        elif name.endswith(".delta"):
            items[ev["output_index"]]["deltas"] += ev["delta"]
        elif name == "response.output_item.done":
            items[ev["output_index"]].update(ev["item"])
    assert events[-1][0] in ("response.completed", "response.incomplete")
    return events[-1][1]["response"], [items[i] for i in sorted(items)]


def chat_stream(data: bytes) -> dict:
    """The choice a streaming chat client builds, with its finish reason and the usage chunk."""
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    out = {"message": msg}
    for line in data.decode().split("\n"):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            out["usage"] = chunk["usage"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            msg["content"] += delta.get("content") or ""
            msg["reasoning_content"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                if call["index"] == len(msg["tool_calls"]):
                    msg["tool_calls"].append(
                        {"id": call["id"], "type": "function", "function": {"name": "", "arguments": ""}}
                    )
                fn = msg["tool_calls"][call["index"]]["function"]
                fn["name"] += call["function"].get("name") or ""
                fn["arguments"] += call["function"].get("arguments") or ""
            if choice.get("finish_reason"):
                out["finish_reason"] = choice["finish_reason"]
    return out


def same_usage(a: dict, b: dict) -> bool:
    """Equal usage but for how much of the prompt the cache held (the second request of a pair finds it there)."""

    def counts(u: dict) -> dict:
        u = {k: v for k, v in u.items() if k not in ("prompt_tokens_details", "input_tokens_details")}
        if "cache_read_input_tokens" in u:  # Anthropic's input_tokens leave the cache reads out
            u["input_tokens"] += u.pop("cache_read_input_tokens")
        return u

    return counts(a) == counts(b)


def without_ids(value):
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in ("id", "call_id", "signature")}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("case, limit, stop, call_input", CUTS, ids=[c[0] for c in CUTS])
def test_anthropic_cut_inside_a_tool_call_streams_the_message_it_returns(
    server, thinking, case, limit, stop, call_input
):
    think = len("Hmm.</think>") - len("</think>") + 1 if thinking else 0  # the reasoning's tokens come first
    body = {
        "model": "deepseek-v4-flash",
        "max_tokens": limit + think,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"name": TOOL["name"], "input_schema": TOOL["parameters"]}],
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    if stop:
        body["stop_sequences"] = stop
    whole = post(server, "/v1/messages", body, False)
    streamed = anthropic_stream(post(server, "/v1/messages", body, True))
    texts = [b["text"] for b in whole["content"] if b["type"] == "text"]
    assert texts == [PREFIX], (case, whole["content"])  # the DSML never comes back as text
    calls = [b for b in whole["content"] if b["type"] == "tool_use"]
    assert [b["input"] for b in calls] == ([] if call_input is None else [call_input]), case
    expected = "tool_use" if case == "whole" else "stop_sequence" if stop else "max_tokens"
    assert whole["stop_reason"] == streamed["stop_reason"] == expected
    assert whole["stop_sequence"] == streamed["stop_sequence"] == (stop[0] if stop else None)
    assert without_ids(streamed["content"]) == without_ids(whole["content"]), case
    assert same_usage(streamed["usage"], whole["usage"])
    for index, text in streamed["_json"].items():  # a call's JSON is whole exactly when the reply says it is
        complete = case in ("whole", "between calls and the closer")
        try:
            assert json.loads(text) == whole["content"][index]["input"] and complete, case
        except json.JSONDecodeError:
            assert not complete, case


@pytest.mark.parametrize(
    "case, limit, stop, call_input", [c for c in CUTS if c[2] is None], ids=[c[0] for c in CUTS if c[2] is None]
)
def test_responses_cut_inside_a_tool_call_streams_the_response_it_returns(server, case, limit, stop, call_input):
    body = {
        "input": "weather?",
        "max_output_tokens": limit,
        "reasoning": {"effort": "none"},
        "tools": [{"type": "function", **TOOL}],
    }
    whole = post(server, "/v1/responses", body, False)
    final, items = responses_stream(post(server, "/v1/responses", body, True))
    assert without_ids(final["output"]) == without_ids(whole["output"]), case
    assert [{k: v for k, v in i.items() if k != "deltas"} for i in items] == final["output"]
    for item in items:  # the deltas built each item's text or arguments
        assert item["deltas"] == (item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"])
    assert (final["status"], final["incomplete_details"]) == (whole["status"], whole["incomplete_details"])
    assert same_usage(final["usage"], whole["usage"])
    assert [o["content"][0]["text"] for o in whole["output"] if o["type"] == "message"] == [PREFIX]
    calls = [o for o in whole["output"] if o["type"] == "function_call"]
    assert len(calls) == (0 if call_input is None else 1), case
    if case == "whole":
        assert whole["status"] == "completed" and calls[0]["status"] == "completed"
    else:
        assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    for call in calls:  # an unfinished call says so; a finished one parses to what it wrote
        if call["status"] == "completed":
            assert json.loads(call["arguments"]) == call_input
        else:
            with pytest.raises(json.JSONDecodeError):
                json.loads(call["arguments"])


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("case, limit, stop, call_input", CUTS, ids=[c[0] for c in CUTS])
def test_chat_completions_cut_inside_a_tool_call_streams_the_choice_it_returns(
    server, thinking, case, limit, stop, call_input
):
    think = len("Hmm.</think>") - len("</think>") + 1 if thinking else 0
    body = {
        "model": "deepseek-v4-flash",
        "max_tokens": limit + think,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": TOOL}],
        "thinking": {"type": "enabled" if thinking else "disabled"},
        "stream_options": {"include_usage": True},
    }
    if stop:
        body["stop"] = stop
    whole = post(server, "/v1/chat/completions", {k: v for k, v in body.items() if k != "stream_options"}, False)
    data = post(server, "/v1/chat/completions", body, True)
    streamed = chat_stream(data)
    # the official client's accumulation, each tool-call delta in OpenAI's shape: the call streams piece by piece
    sdk, pieces = accumulate_chat(data)
    same_chat_choices(sdk, openai.types.chat.ChatCompletion.model_validate(whole))
    if call_input is not None:
        assert list(pieces) == [(0, 0)] and len(pieces[0, 0]) > 2, (case, pieces)
        deltas = [c["choices"][0]["delta"] for c in _sse_events(data) if c["choices"]]
        text = [i for i, d in enumerate(deltas) if d.get("content")]
        assert max(text) < min(i for i, d in enumerate(deltas) if d.get("tool_calls")), case  # text, then the call
    choice = whole["choices"][0]
    msg = choice["message"]
    expected = "tool_calls" if case == "whole" else "stop" if stop else "length"
    assert choice["finish_reason"] == streamed["finish_reason"] == expected, case
    assert msg["content"] == streamed["message"]["content"] == PREFIX, case
    assert (msg.get("reasoning_content") or "") == streamed["message"]["reasoning_content"]
    assert without_ids(msg.get("tool_calls") or []) == without_ids(streamed["message"]["tool_calls"]), case
    assert same_usage(streamed["usage"], whole["usage"])
    calls = msg.get("tool_calls") or []
    assert len(calls) == (0 if call_input is None else 1), case
    for call in calls:  # arguments parse exactly when the finish reason says the calls are whole
        try:
            assert json.loads(call["function"]["arguments"]) == call_input and expected in ("tool_calls", "length")
            assert case in ("whole", "between calls and the closer"), case
        except json.JSONDecodeError:
            assert case not in ("whole", "between calls and the closer"), case


def test_a_malformed_block_the_model_ended_is_its_calls_or_else_its_text():
    """Without a cut, a block in which no call started comes back as its text; one in which a call started is
    that call (incomplete), and its raw text is not also given as content. A cut opener is dropped only once it
    is markup (past `<｜`)."""
    for body, calls, text in (
        ("\n\n<｜DSML｜tool_callsXX", 0, "\n\n<｜DSML｜tool_callsXX"),
        ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<oops>', 1, ""),
    ):
        parser, block = StreamParser(False), ToolBlock()
        parser.feed("hi" + body)
        list(block.feed(parser))
        released = parser.flush()
        result = parser.finish()
        settled = block.settle(result.content, result.tool_calls, released, cut=False)
        assert (len(settled.tool_calls), settled.content, settled.parsed) == (calls, "hi" + text, False)
        if calls:
            assert settled.cut_input == {} and settled.cut_call_id == settled.tool_calls[0]["id"]
    for tail, kept in (("\n\n<", "\n\n<"), ("\n\n<｜DSML｜to", "")):  # cut: a blank line and `<` may be text
        parser = StreamParser(False)
        parser.feed("hi" + tail)
        released = parser.flush()
        assert ToolBlock().settle(parser.finish().content, [], released, cut=True).content == "hi" + kept


THOUGHT, ANSWER = "Let me ponder it.", "The answer is 42."
# (case, max_tokens, stop): cuts around the thinking, in the thinking mode; the tokens are characters, `</think>` one.
# Stop strings match the answer only: the first three are no stop (the reply ends with its EOS), the fourth is.
AROUND_THINKING = [
    ("stop inside the thinking", 100, ["ponder"]),
    ("stop spanning the thinking's end", 100, ["it.</think>The"]),
    ("stop ending in the marker", 100, ["it.</th"]),
    ("stop in the answer", 100, ["is 4"]),
    ("max_tokens at the marker", len(THOUGHT) + 1, None),
    ("max_tokens before the marker", len(THOUGHT), None),
    ("max_tokens in the answer", len(THOUGHT) + 5, None),
]
ANSWER_STOPS = {"stop in the answer"}


@pytest.mark.parametrize("case, limit, stop", AROUND_THINKING, ids=[c[0] for c in AROUND_THINKING])
def test_every_shape_streams_what_it_returns_around_the_thinking(server, case, limit, stop):
    """Stop strings and max_tokens around the thinking's end: each API's stream, reassembled, is its non-streamed
    reply (text, reasoning, reason, usage), legacy completions included; and the shapes agree with each other. A stop
    string of the reasoning, or across its end, is none: the whole reply comes, ended by its EOS."""
    engine = server.engine
    cut = case in ANSWER_STOPS
    engine.script, engine.thought = ANSWER, THOUGHT
    try:
        ask = [{"role": "user", "content": "q"}]
        body = {"model": "deepseek-v4-flash", "max_tokens": limit, "messages": ask, "thinking": {"type": "enabled"}}
        whole = post(server, "/v1/chat/completions", {**body, "stop": stop}, False)
        streamed = chat_stream(
            post(
                server, "/v1/chat/completions", {**body, "stop": stop, "stream_options": {"include_usage": True}}, True
            )
        )
        choice = whole["choices"][0]
        reasoning, content = choice["message"].get("reasoning_content") or "", choice["message"]["content"] or ""
        assert (streamed["message"]["reasoning_content"], streamed["message"]["content"]) == (reasoning, content)
        assert streamed["finish_reason"] == choice["finish_reason"] == ("stop" if stop else "length")
        assert same_usage(streamed["usage"], whole["usage"])
        assert not any(s in content for s in stop or [])
        if stop and not cut:
            assert (reasoning, content) == (THOUGHT, ANSWER)

        msg = post(server, "/v1/messages", {**body, "stop_sequences": stop}, False)
        streamed = anthropic_stream(post(server, "/v1/messages", {**body, "stop_sequences": stop}, True))
        assert without_ids(streamed["content"]) == without_ids(msg["content"])
        blocks = {b["type"]: b.get("thinking", b.get("text")) for b in msg["content"]}
        assert (blocks.get("thinking", ""), blocks.get("text", "")) == (reasoning, content)  # as chat's
        assert (streamed["stop_reason"], streamed["stop_sequence"]) == (msg["stop_reason"], msg["stop_sequence"])
        assert msg["stop_reason"] == ("stop_sequence" if cut else "end_turn" if stop else "max_tokens")
        assert same_usage(streamed["usage"], msg["usage"])
        assert msg["usage"]["output_tokens"] == whole["usage"]["completion_tokens"]

        if stop is None:  # (Responses takes no stop strings)
            rbody = {"input": "q", "max_output_tokens": limit, "reasoning": {"effort": "high"}}
            resp = post(server, "/v1/responses", rbody, False)
            final, _ = responses_stream(post(server, "/v1/responses", rbody, True))
            assert without_ids(final["output"]) == without_ids(resp["output"])
            assert (final["status"], final["incomplete_details"]) == (resp["status"], resp["incomplete_details"])
            assert resp["status"] == "incomplete" and same_usage(final["usage"], resp["usage"])

        cbody = {"model": "deepseek-v4-flash", "prompt": "q", "max_tokens": limit, "stop": stop}
        text = post(server, "/v1/completions", cbody, False)
        pieces, finish, use = "", None, None
        raw_stream = post(server, "/v1/completions", {**cbody, "stream_options": {"include_usage": True}}, True)
        for line in raw_stream.decode().split("\n"):
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                use = chunk.get("usage") or use
                for c in chunk["choices"]:
                    pieces, finish = pieces + c["text"], c.get("finish_reason") or finish
        assert (pieces, finish) == (text["choices"][0]["text"], text["choices"][0]["finish_reason"])
        assert same_usage(use, text["usage"])
    finally:
        engine.script, engine.thought = SCRIPT, ScriptedEngine.thought


def test_a_stop_string_after_a_closed_block_is_no_stop_sequence(server):
    """The calls are complete and the reply is a tool call: Messages said `stop_reason: "tool_use"` with the stop
    string in `stop_sequence`, which Anthropic sets only with `stop_reason: "stop_sequence"`."""
    server.engine.script = SCRIPT + "trailing words"
    try:
        body = {"model": "m", "max_tokens": 400, "messages": [{"role": "user", "content": "q"}]}
        body |= {"thinking": {"type": "disabled"}, "stop_sequences": ["trailing"]}
        msg = post(server, "/v1/messages", body, False)
        streamed = anthropic_stream(post(server, "/v1/messages", body, True))
        for reply in (msg, streamed):
            assert (reply["stop_reason"], reply["stop_sequence"]) == ("tool_use", None)
            assert [b["type"] for b in reply["content"]] == ["text", "tool_use"]
    finally:
        server.engine.script = SCRIPT


def test_a_responses_reply_cut_before_any_output_is_one_incomplete_message_streamed_or_not(server):
    """max_output_tokens right after the opener, with nothing before it: the reply is its empty message, which
    `create()` closed `incomplete` and the stream `completed`."""
    server.engine.script = BLOCK
    try:
        body = {"input": "q", "max_output_tokens": at("<｜DSML｜tool_calls>\n") - len(PREFIX)}
        body |= {"reasoning": {"effort": "none"}, "tools": [{"type": "function", **TOOL}]}
        whole = post(server, "/v1/responses", body, False)
        final, items = responses_stream(post(server, "/v1/responses", body, True))
        for output in (
            whole["output"],
            final["output"],
            [{k: v for k, v in i.items() if k != "deltas"} for i in items],
        ):
            assert [(o["type"], o["status"], o["content"][0]["text"]) for o in output] == [
                ("message", "incomplete", "")
            ]
        assert whole["status"] == final["status"] == "incomplete"
    finally:
        server.engine.script = SCRIPT
