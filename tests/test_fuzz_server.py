"""Generated request bodies against the real app in-process (Starlette's TestClient, the fake engine): every
answer is a 2xx or a 4xx with the error shape of its route's API (OpenAI's, Anthropic's on `/v1/messages*`) and a
one-line message; never a 5xx, never an exception out of the app; a stream ends with its API's last event or an
error event. Every route is covered: chat completions, completions, `/tokenize`, `/detokenize`, Messages and
count_tokens, Responses (with `previous_response_id` and `item_reference`s to stored responses, and their GET, DELETE
and input_items), other methods and paths. Bodies are mostly valid for their route (its real fields, values of the
right and the wrong types, nested blocks and items), so they get past the first check; one field made wrong on
purpose must be a 400 naming it.

CI runs a fixed, derandomized number of examples. A long local run: `FASTAR_FUZZ_EXAMPLES=5000 python -m pytest -q
tests/test_fuzz_server.py` (that many random examples per test, a new seed each run)."""

from __future__ import annotations

import json
import os
import urllib.parse

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402
from test_agents_api import sse_events  # noqa: E402
from test_server import WEATHER_TOOL, FakeEngine  # noqa: E402

from fastar.serve.server import Server  # noqa: E402

LONG_RUN = int(os.environ.get("FASTAR_FUZZ_EXAMPLES", "0"))  # examples per test of a long local run; 0: CI's


def fuzz(examples: int) -> settings:
    """CI: `examples`, derandomized (the same bodies every run); a long run: FASTAR_FUZZ_EXAMPLES random ones."""
    return settings(
        max_examples=LONG_RUN or examples,
        derandomize=not LONG_RUN,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    )


PATHS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/chat/completions")
ROLES = ("system", "user", "assistant", "tool", "developer", "wizard", "", None, 5)


@pytest.fixture(scope="module")
def app_client():
    server = Server(lambda: FakeEngine(context_length=2048), port=0, max_body_bytes=1 << 20).start_engine()
    assert server.wait_ready(10)
    with TestClient(server.app, base_url="http://localhost", raise_server_exceptions=True) as tc:
        yield tc
    server.host.shutdown()


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
text = st.one_of(st.text(max_size=40), st.sampled_from(["count", "hi", "weather", "", "<｜User｜>", "\u2028"]))
# An OpenAI file part's fields (chat completions' `file` object, Responses' `input_file` part): text data URLs,
# other types, what is not a data URL, undecodable bytes, file ids and URLs.
file_fields = st.fixed_dictionaries(
    {},
    optional={
        "file_data": st.one_of(
            st.sampled_from(
                [
                    "data:text/plain;base64,aGk=",
                    "data:text/markdown;charset=utf-8,%23%20hi",
                    "data:application/json;base64,eyJhIjogMX0=",
                    "data:application/pdf;base64,JVBERi0=",
                    "data:text/plain;base64,/w==",
                    "data:text/plain;base64,@@",
                    "data:text/plain;charset=latin-1,a",
                    "data:,",
                    "aGk=",
                ]
            ),
            json_values,
        ),
        "filename": st.one_of(text, json_values),
        "file_id": st.one_of(st.none(), st.just("file-1"), json_values),
        "file_url": st.one_of(st.just("https://example.com/a.txt"), json_values),
    },
)

message = st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES)},
    optional={
        "content": st.one_of(
            text,
            json_values,
            st.lists(
                st.one_of(
                    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 3]), "text": text}),
                    st.fixed_dictionaries({"type": st.just("file"), "file": st.one_of(file_fields, json_values)}),
                ),
                max_size=3,
            ),
        ),
        "tool_call_id": st.one_of(st.text(max_size=5), json_scalars),
        "tool_calls": json_values,
        "reasoning_content": json_values,
        "name": json_values,
    },
)
tool = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": st.one_of(st.text(max_size=8), json_scalars)},
                optional={"parameters": json_values, "description": json_values},
            ),
        }
    ),
)
fields = {
    "model": st.one_of(st.just("deepseek-v4-flash"), json_scalars),
    "messages": st.one_of(st.lists(message, min_size=1, max_size=4), json_values),
    "prompt": st.one_of(text, st.lists(st.integers(-5, 2**21), max_size=8), json_values),
    "tokens": st.one_of(st.lists(st.integers(-5, 2**22), max_size=8), json_values),
    "max_tokens": st.one_of(st.integers(-3, 5000), json_scalars),
    "max_completion_tokens": st.one_of(st.integers(-3, 60), json_scalars),
    "temperature": st.one_of(st.floats(-1, 3), json_scalars),
    "top_p": json_scalars,
    "top_k": json_scalars,
    "min_p": json_scalars,
    "seed": json_scalars,
    "n": json_scalars,
    "stop": st.one_of(text, json_values),
    "stream": st.one_of(st.booleans(), json_scalars),
    "stream_options": json_values,
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 30), json_scalars),
    "top_logprobs": st.one_of(st.integers(-1, 30), json_scalars),
    "echo": json_scalars,
    "tools": st.one_of(st.lists(tool, max_size=2), json_values),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), json_values),
    "response_format": json_values,
    "thinking": json_values,
    "reasoning_effort": json_values,
    "chat_template_kwargs": json_values,
    "best_of": json_scalars,
    "suffix": json_scalars,
}
# Mostly valid requests with one or two odd fields, so generation, streaming and tools are reached too.
good_message = st.one_of(
    st.fixed_dictionaries({"role": st.just("user"), "content": text}),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": text},
        optional={
            "reasoning_content": text,
            "tool_calls": st.just([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]),
        },
    ),
    st.fixed_dictionaries({"role": st.just("tool"), "content": text, "tool_call_id": st.just("c1")}),
    st.fixed_dictionaries({"role": st.just("system"), "content": text}),
)
plausible = {
    "stream": st.booleans(),
    "max_tokens": st.integers(1, 40),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**32),
    "stop": st.one_of(text, st.lists(text, max_size=3)),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "tools": st.lists(tool, max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"])}),
    "reasoning_effort": st.sampled_from(["low", "high", "max", "none"]),
    "echo": st.booleans(),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
}
near_valid = st.tuples(
    st.fixed_dictionaries(
        {"messages": st.lists(good_message, min_size=1, max_size=4), "prompt": text}, optional=plausible
    ),
    st.dictionaries(st.sampled_from(sorted(fields)), json_values, max_size=1),
).map(lambda pair: json.dumps({**pair[0], **pair[1]}).encode())
bodies = st.one_of(
    near_valid,
    near_valid,
    st.fixed_dictionaries({}, optional=fields).map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass")),
)


ANTHROPIC_ERROR_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
}


def one_line(message) -> None:
    """An error message a client shows: one line of text, no traceback."""
    assert isinstance(message, str) and message.strip() and "\n" not in message, message
    assert "Traceback" not in message and "Error(" not in message, message


def check_error(response) -> dict:
    """A 4xx in the shape of its route's API: Anthropic's on /v1/messages*, OpenAI's elsewhere. Returns its fields."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    body = response.json()
    if response.url.path.startswith("/v1/messages"):
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        err = body["error"]
        assert set(err) == {"type", "message"} and err["type"] in ANTHROPIC_ERROR_TYPES, err
    else:
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["param"] is None or isinstance(err["param"], str), err
        assert err["code"] is None or isinstance(err["code"], str), err
    one_line(err["message"])
    return err


def check_anthropic_stream(text: str) -> None:
    """Messages events: message_start first; blocks opened in order and each closed before the next; the end is
    message_delta + message_stop, or an error event of a client's mistake."""
    events = sse_events([text.encode()])
    assert events and events[0][0] == "message_start", events[:2]
    assert all(name == data["type"] for name, data in events), events
    if events[-1][0] == "error":
        err = events[-1][1]["error"]
        assert err["type"] in ANTHROPIC_ERROR_TYPES, err  # api_error: the server's own fault
        one_line(err["message"])
        return
    assert [name for name, _ in events[-2:]] == ["message_delta", "message_stop"], events[-3:]
    open_index = None
    next_index = 0
    for name, data in events:
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index, (open_index, data)
            open_index, next_index = data["index"], next_index + 1
        elif name == "content_block_delta":
            assert data["index"] == open_index, (open_index, data)
        elif name == "content_block_stop":
            assert data["index"] == open_index, (open_index, data)
            open_index = None
    assert open_index is None and next_index >= 1, events


def check_responses_stream(text: str) -> dict:
    """Responses events: numbered from 0, opening with response.created, ending with response.completed,
    response.incomplete, or an error event and response.failed for a client's mistake. Returns the last response."""
    events = sse_events([text.encode()])
    assert [data["sequence_number"] for _, data in events] == list(range(len(events))), events
    assert all(name == data["type"] for name, data in events), events
    assert events[0][0] == "response.created", events[:2]
    last, data = events[-1]
    assert last in ("response.completed", "response.incomplete", "response.failed"), events[-3:]
    if last == "response.failed":
        error = events[-2][1]
        assert events[-2][0] == "error" and error["code"] != "generation_failed", events[-3:]
        one_line(error["message"])
    return data["response"]


def check(response) -> None:
    """A 2xx or a 4xx of its API's shape; a stream that ends as its API ends one."""
    assert 200 <= response.status_code < 300 or 400 <= response.status_code < 500, (
        response.status_code,
        response.text[:300],
    )
    path = response.url.path
    if response.status_code >= 400:
        check_error(response)
    elif not response.headers["content-type"].startswith("text/event-stream"):
        response.json()
    elif path.startswith("/v1/messages"):
        check_anthropic_stream(response.text)
    elif path.startswith("/v1/responses"):
        check_responses_stream(response.text)
    else:
        assert response.text.endswith("data: [DONE]\n\n")
        for line in response.text.split("\n"):
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    assert event["error"]["code"] != "generation_failed", event
                    one_line(event["error"]["message"])


def lone_surrogate(value) -> bool:
    """Whether a JSON value holds a string (or key) that is not valid Unicode, as the server reads it."""
    if isinstance(value, str):  # (a pair is one astral character once parsed)
        return any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, list):
        return any(lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(lone_surrogate(k) or lone_surrogate(v) for k, v in value.items())
    return False


def check_unicode(response, body) -> None:
    """A body whose parsed JSON holds a lone surrogate is a 400 that says so, on every route, before anything else
    (the text has no UTF-8 encoding, so no tokens)."""
    if not isinstance(body, bytes) and lone_surrogate(json.loads(json.dumps(body))):
        assert response.status_code == 400, (response.status_code, response.text[:300])
        err = check_error(response)
        assert "surrogate" in err["message"] and err.get("code", "invalid_unicode") == "invalid_unicode", err


def post(client, path: str, body) -> object:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


@fuzz(400)
@given(path=st.sampled_from(PATHS), body=bodies)
def test_generated_bodies_get_2xx_or_an_openai_4xx(app_client, path, body):
    check(post(app_client, path, body))


@fuzz(100)
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
    path=st.one_of(
        st.sampled_from(
            [
                *PATHS,
                "/v1/models",
                "/health",
                "/metrics",
                "/",
                "/static/app.js",
                "/v1/messages",
                "/v1/messages/count_tokens",
                "/v1/responses",
                "/v1/responses/resp_x",
                "/v1/responses/resp_x/input_items",
            ]
        ),
        st.text(max_size=20).map(lambda t: "/" + t),
        st.text(max_size=12).map(lambda t: "/v1/responses/" + t),
    ),
    ctype=st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"]),
    host=st.sampled_from(["localhost", "evil.example", "127.0.0.1:8080", ""]),
)
def test_generated_requests_get_2xx_or_an_openai_4xx(app_client, method, path, ctype, host):
    headers = {"Content-Type": ctype} if ctype else {}
    if host:
        headers["Host"] = host
    try:
        response = app_client.request(method, path, content=b"{}", headers=headers)
    except Exception as err:  # httpx refusing to send an unencodable URL is the client's own doing
        if "URL" in type(err).__name__ or "Invalid" in str(err):
            return
        raise
    if method in ("HEAD", "OPTIONS") or response.status_code in (204, 301, 307, 308):
        assert response.status_code < 500
        return
    if response.status_code < 300 and not response.headers["content-type"].startswith("application/json"):
        return  # the UI's pages and the metrics text
    check(response)


# ---------------------------------------------------------------------------------------------------------
# The agent APIs: Anthropic Messages (and count_tokens), OpenAI Responses
# ---------------------------------------------------------------------------------------------------------

# Text as clients send it, and the characters that trip encoders: a control-token string, a line separator, a
# pair (an emoji), astral and combining characters. (A lone surrogate escape is in `raw_bodies` below: json.dumps
# would write it as the escape \ud800, which the server must refuse with a 400 naming the field.)
# A lone surrogate ("\ud800" as json.dumps writes it) makes the body a 400 `invalid_unicode` naming the field;
# "\ud83d\ude00" is a pair, an emoji once parsed.
SURROGATES = ("\ud800", "a\udfffb", "\ud83d\ude00")
agent_text = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["hi", "weather in Paris?", "count", "markdown", "", "<｜User｜>", "\u2028", "é\u0301", "😀"]),
    st.sampled_from(SURROGATES),
)
SCHEMAS = (
    WEATHER_TOOL["function"]["parameters"],
    {"type": "object", "properties": {}},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}}}},
    {"$ref": "#"},
    {"type": "string"},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"enum": [1, "x", None]}}}}},
)
schema = st.one_of(st.sampled_from(SCHEMAS), json_values)
small_int = st.one_of(st.integers(-3, 60), json_scalars)
unit = st.one_of(st.floats(-0.5, 2.5), json_scalars)


def right_or_wrong(good: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a value of the right type, sometimes any JSON value."""
    return st.one_of(good, good, good, json_values)


# Anthropic Messages
a_text_block = st.fixed_dictionaries(
    {"type": st.just("text"), "text": right_or_wrong(agent_text)}, optional={"cache_control": json_values}
)
a_document = st.fixed_dictionaries(
    {
        "type": st.just("document"),
        "source": st.one_of(
            st.fixed_dictionaries(
                {
                    "type": st.just("text"),
                    "media_type": right_or_wrong(st.just("text/plain")),
                    "data": right_or_wrong(agent_text),
                }
            ),
            st.fixed_dictionaries(
                {"type": st.just("content"), "content": st.one_of(agent_text, st.lists(a_text_block, max_size=2))}
            ),
            st.fixed_dictionaries(
                {"type": st.sampled_from(["base64", "url", "file", "bogus"])},
                optional={"media_type": json_values, "data": json_values, "url": json_values, "file_id": json_values},
            ),
            json_values,
        ),
    },
    optional={
        "title": right_or_wrong(agent_text),
        "context": right_or_wrong(agent_text),
        "citations": st.one_of(st.fixed_dictionaries({"enabled": st.booleans()}), json_values),
    },
)
a_tool_result = st.fixed_dictionaries(
    {"type": st.just("tool_result"), "tool_use_id": right_or_wrong(st.sampled_from(["toolu_1", "x", ""]))},
    optional={
        "content": st.one_of(agent_text, st.lists(st.one_of(a_text_block, a_document), max_size=2), json_values),
        "is_error": right_or_wrong(st.booleans()),
    },
)
a_other_block = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["image", "document", "search_result", "bogus", 7, None])}),
    st.fixed_dictionaries({"type": st.just("image"), "source": json_values}),
    json_values,
)
a_tool_use = st.fixed_dictionaries(
    {
        "type": st.just("tool_use"),
        "id": right_or_wrong(st.sampled_from(["toolu_1", ""])),
        "name": right_or_wrong(st.sampled_from(["get_weather", "sum", ""])),
        "input": right_or_wrong(st.dictionaries(st.text(max_size=5), json_values, max_size=3)),
    }
)
a_thinking = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("thinking"), "thinking": right_or_wrong(agent_text), "signature": json_values}
    ),
    st.fixed_dictionaries({"type": st.just("redacted_thinking"), "data": json_values}),
)
a_user = st.fixed_dictionaries(
    {
        "role": st.just("user"),
        "content": st.one_of(
            agent_text,
            agent_text,
            st.lists(st.one_of(a_text_block, a_text_block, a_tool_result, a_document, a_other_block), max_size=3),
            json_values,
        ),
    }
)
a_assistant = st.fixed_dictionaries(
    {
        "role": st.just("assistant"),
        "content": st.one_of(
            agent_text,
            st.lists(st.one_of(a_text_block, a_tool_use, a_thinking, a_other_block), max_size=3),
            json_values,
        ),
    }
)
a_odd_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "tool", "developer", "", None, 3])}, optional={"content": agent_text}
)
a_messages = st.one_of(
    st.lists(st.one_of(a_user, a_assistant), max_size=3).flatmap(lambda head: a_user.map(lambda last: [*head, last])),
    st.lists(st.one_of(a_user, a_assistant, a_odd_message), max_size=4),
    json_values,
)
a_tool = st.fixed_dictionaries(
    {"name": right_or_wrong(st.sampled_from(["get_weather", "sum", "", 'a"b']))},
    optional={
        "description": right_or_wrong(agent_text),
        "input_schema": schema,
        "type": st.sampled_from(["custom", "web_search_20250305", "bash_20250124", None, 4]),
        "cache_control": json_values,
    },
)
a_tool_choice = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "tool", "none", "required", None])},
        optional={
            "name": right_or_wrong(st.sampled_from(["get_weather", "sum", "nope"])),
            "disable_parallel_tool_use": right_or_wrong(st.booleans()),
        },
    ),
    json_values,
)
a_thinking_field = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["enabled", "disabled", "adaptive", "between_tools", "on", None])},
        optional={"budget_tokens": small_int},
    ),
    json_values,
)
a_output_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "json_object", "text"]), "schema": schema}),
    json_values,
)
anthropic_fields = {
    "model": right_or_wrong(st.sampled_from(["claude-sonnet-4-5", "deepseek-v4-flash", ""])),
    "max_tokens": right_or_wrong(st.integers(1, 40)),
    "system": st.one_of(agent_text, st.lists(a_text_block, max_size=2), json_values),
    "temperature": right_or_wrong(st.floats(0, 1)),
    "top_p": right_or_wrong(st.floats(0, 1)),
    "top_k": right_or_wrong(st.integers(-1, 50)),
    "stop_sequences": right_or_wrong(st.lists(agent_text, max_size=3)),
    "stream": right_or_wrong(st.booleans()),
    "tools": right_or_wrong(st.lists(a_tool, max_size=2)),
    "tool_choice": a_tool_choice,
    "thinking": a_thinking_field,
    "output_config": st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "effort": right_or_wrong(st.sampled_from(["low", "medium", "high", "xhigh", "max", "none"])),
                "format": a_output_format,
            },
        ),
        json_values,
    ),
    "output_format": a_output_format,
    "metadata": st.one_of(st.fixed_dictionaries({"user_id": right_or_wrong(agent_text)}), json_values),
    "service_tier": right_or_wrong(st.sampled_from(["auto", "standard_only"])),
}
# A valid request with plausible options, then one to three fields of it set from the wider strategies above.
a_plain_user = st.fixed_dictionaries({"role": st.just("user"), "content": agent_text})
a_valid = st.fixed_dictionaries(
    {
        "model": st.just("claude-sonnet-4-5"),
        "max_tokens": st.integers(2, 40),  # (above the budget_tokens below)
        "messages": st.one_of(
            st.lists(a_plain_user, min_size=1, max_size=2),
            st.just(
                [
                    {"role": "user", "content": "weather in Paris?"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"location": "P"}},
                        ],
                    },
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "20"}]},
                ]
            ),
        ),
    },
    optional={
        "stream": st.booleans(),
        "system": agent_text,
        "temperature": st.floats(0, 1),
        "top_p": st.floats(0, 1),
        "top_k": st.integers(-1, 50),
        "stop_sequences": st.lists(agent_text, max_size=3),
        "tools": st.just([{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}]),
        "tool_choice": st.fixed_dictionaries(
            {"type": st.sampled_from(["auto", "none"])}, optional={"disable_parallel_tool_use": st.booleans()}
        ),
        "thinking": st.one_of(
            st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive"])}),
            st.fixed_dictionaries({"type": st.just("enabled"), "budget_tokens": st.integers(0, 1)}),
        ),
        "output_config": st.fixed_dictionaries({"effort": st.sampled_from(["low", "medium", "high", "max"])}),
        "metadata": st.fixed_dictionaries({"user_id": agent_text}),
    },
)


def mutated(valid: st.SearchStrategy, wide: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """`valid` bodies with zero to three of their fields (or new ones) drawn from `wide`."""
    return st.tuples(valid, st.dictionaries(st.sampled_from(sorted(wide)), st.none(), max_size=3)).flatmap(
        lambda pair: st.fixed_dictionaries({k: wide[k] for k in pair[1]}).map(lambda extra: {**pair[0], **extra})
    )


anthropic_bodies = st.one_of(
    mutated(a_valid, {"messages": a_messages, **anthropic_fields}),
    st.fixed_dictionaries({"messages": a_messages}, optional=anthropic_fields),
)

# OpenAI Responses. "@resp" and "@item" stand for the id of a stored response and of one of its output items
# (`stored` below fills them in); the other ids are ones the server does not hold.
r_part = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["input_text", "output_text", "text"]), "text": right_or_wrong(agent_text)}
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["input_image", "input_file", "refusal", None])}),
    st.builds(lambda spec: {"type": "input_file", **spec}, file_fields),
    json_values,
)
r_content = st.one_of(agent_text, agent_text, st.lists(r_part, max_size=3), json_values)
r_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "user", "assistant", "system", "developer", "tool", None])},
    optional={"type": st.just("message"), "content": r_content, "id": json_values, "status": json_values},
)
r_call_id = right_or_wrong(st.sampled_from(["call_1", "call_2", ""]))
r_function_call = st.fixed_dictionaries(
    {"type": st.just("function_call"), "call_id": r_call_id},
    optional={
        "name": right_or_wrong(st.sampled_from(["get_weather", ""])),
        "arguments": right_or_wrong(st.sampled_from(['{"location": "Paris"}', "{", "[]", ""])),
        "id": json_values,
    },
)
r_call_output = st.fixed_dictionaries(
    {"type": st.just("function_call_output"), "call_id": r_call_id},
    optional={"output": st.one_of(agent_text, st.lists(r_part, max_size=2), json_values)},
)
r_reasoning = st.fixed_dictionaries(
    {"type": st.just("reasoning")},
    optional={
        "summary": st.one_of(
            st.lists(st.fixed_dictionaries({"type": st.just("summary_text"), "text": right_or_wrong(agent_text)})),
            json_values,
        ),
        "content": st.one_of(
            st.lists(
                st.fixed_dictionaries({"type": st.just("reasoning_text"), "text": right_or_wrong(agent_text)}),
                max_size=2,
            ),
            json_values,
        ),
        "encrypted_content": right_or_wrong(agent_text),
        "id": json_values,
    },
)
r_reference = st.fixed_dictionaries(
    {"type": st.just("item_reference"), "id": right_or_wrong(st.sampled_from(["@item", "@item", "msg_nope", ""]))}
)
r_item = st.one_of(r_message, r_message, r_function_call, r_call_output, r_reasoning, r_reference, json_values)
r_tool = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "function", "web_search", "file_search", None])},
        optional={
            "name": right_or_wrong(st.sampled_from(["get_weather", "sum", "", 'a"b'])),
            "parameters": schema,
            "description": right_or_wrong(agent_text),
            "strict": right_or_wrong(st.booleans()),
        },
    ),
    json_values,
)
r_format = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "grammar", None])},
        optional={"schema": schema, "name": right_or_wrong(agent_text), "strict": right_or_wrong(st.booleans())},
    ),
    json_values,
)
responses_fields = {
    "model": right_or_wrong(st.sampled_from(["deepseek-v4-flash", "gpt-4o", ""])),
    "instructions": right_or_wrong(agent_text),
    "max_output_tokens": right_or_wrong(st.integers(1, 40)),
    "temperature": right_or_wrong(st.floats(0, 2)),
    "top_p": right_or_wrong(st.floats(0, 1)),
    "top_k": right_or_wrong(st.integers(-1, 50)),
    "seed": right_or_wrong(st.integers(0, 2**32)),
    "stream": right_or_wrong(st.booleans()),
    "store": right_or_wrong(st.booleans()),
    "tools": right_or_wrong(st.lists(r_tool, max_size=2)),
    "tool_choice": st.one_of(
        st.sampled_from(["none", "auto", "required"]),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "allowed_tools", None])},
            optional={"name": right_or_wrong(st.sampled_from(["get_weather", "nope"]))},
        ),
        json_values,
    ),
    "parallel_tool_calls": right_or_wrong(st.booleans()),
    "text": st.one_of(st.fixed_dictionaries({}, optional={"format": r_format, "verbosity": json_values}), json_values),
    "reasoning": st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "effort": right_or_wrong(st.sampled_from(["none", "minimal", "low", "medium", "high", "max"])),
                "summary": json_values,
            },
        ),
        json_values,
    ),
    "thinking": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"])}), json_values),
    "metadata": st.one_of(st.dictionaries(st.text(max_size=8), agent_text, max_size=3), json_values),
    "include": st.one_of(st.lists(st.sampled_from(["reasoning.encrypted_content", "bogus"]), max_size=2), json_values),
    "previous_response_id": right_or_wrong(st.sampled_from(["@resp", "@resp", "resp_nope", ""])),
    "truncation": right_or_wrong(st.sampled_from(["auto", "disabled"])),
    "user": right_or_wrong(agent_text),
}
r_input = st.one_of(agent_text, st.lists(r_item, min_size=1, max_size=4), st.lists(r_item, max_size=4), json_values)
r_valid = st.fixed_dictionaries(
    {
        "input": st.one_of(
            agent_text,
            st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": agent_text}), min_size=1, max_size=2),
            st.just(
                [
                    {"role": "user", "content": "weather in Paris?"},
                    {"type": "item_reference", "id": "@item"},
                    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "call_1", "output": "20"},
                ]
            ),
        ),
        "max_output_tokens": st.integers(1, 40),
    },
    optional={
        "stream": st.booleans(),
        "store": st.booleans(),
        "instructions": agent_text,
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1),
        "seed": st.integers(0, 2**32),
        "tools": st.just([{"type": "function", **WEATHER_TOOL["function"]}]),
        "tool_choice": st.sampled_from(["none", "auto"]),
        "parallel_tool_calls": st.booleans(),
        "text": st.fixed_dictionaries(
            {"format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})}
        ),
        "reasoning": st.fixed_dictionaries({"effort": st.sampled_from(["none", "low", "high", "max"])}),
        "metadata": st.dictionaries(st.text(max_size=8), agent_text, max_size=3),
        "include": st.just(["reasoning.encrypted_content"]),
        "previous_response_id": st.just("@resp"),
        "truncation": st.sampled_from(["auto", "disabled"]),
    },
)
responses_bodies = st.one_of(
    mutated(r_valid, {"input": r_input, **responses_fields}),
    st.fixed_dictionaries({"input": r_input}, optional=responses_fields),
)


def resolve(value, ids: dict[str, str]):
    """`value` with the "@resp" / "@item" placeholders replaced by the stored ids they stand for."""
    if isinstance(value, str):
        return ids.get(value, value)
    if isinstance(value, list):
        return [resolve(v, ids) for v in value]
    if isinstance(value, dict):
        return {k: resolve(v, ids) for k, v in value.items()}
    return value


def store_response(client, body: dict) -> dict:
    """A stored response of `body` (stored, not streamed), as the server returned it."""
    response = post(client, "/v1/responses", {**body, "store": True, "stream": False})
    assert response.status_code == 200, response.text
    return response.json()


class Stored:
    """Stored responses to refer to: ids of a reply with reasoning and text, and of one with a function call, made
    again when the store has let them go (it keeps the last 256, and the examples store theirs too)."""

    BODIES = (
        {"input": "hi", "reasoning": {"effort": "high"}, "max_output_tokens": 30},
        {"input": "weather in Paris?", "tools": [{"type": "function", **WEATHER_TOOL["function"]}]},
    )

    def __init__(self, client) -> None:
        self.client = client
        self.objs = [store_response(client, body) for body in self.BODIES]
        assert {item["id"][:3] for obj in self.objs for item in obj["output"]} >= {"rs_", "msg", "fc_"}

    def ids(self, which: int) -> dict[str, str]:
        """The placeholders' values: a stored response and its output item `which` (of all of theirs, cyclic)."""
        pairs = [(k, item["id"]) for k, obj in enumerate(self.objs) for item in obj["output"]]
        k, item = pairs[which % len(pairs)]
        if self.client.get(f"/v1/responses/{self.objs[k]['id']}").status_code == 404:
            self.objs[k] = store_response(self.client, self.BODIES[k])
            return self.ids(which)
        return {"@resp": self.objs[k]["id"], "@item": item}


@pytest.fixture(scope="module")
def stored(app_client) -> Stored:
    return Stored(app_client)


@fuzz(300)
@given(path=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]), body=anthropic_bodies)
def test_generated_messages_bodies_get_2xx_or_an_anthropic_4xx(app_client, path, body):
    response = post(app_client, path, body)
    check(response)
    check_unicode(response, body)


@fuzz(300)
@given(body=responses_bodies, which=st.integers(0, 7))
def test_generated_responses_bodies_get_2xx_or_an_openai_4xx(app_client, stored, body, which):
    body = resolve(body, stored.ids(which))
    response = post(app_client, "/v1/responses", body)
    check(response)
    check_unicode(response, body)


# ---------------------------------------------------------------------------------------------------------
# One field made wrong on purpose: a 400 whose message names that field
# ---------------------------------------------------------------------------------------------------------

not_bool = st.one_of(st.integers(), st.text(max_size=5), st.lists(json_scalars, max_size=2), st.just({}))
not_number = st.one_of(st.booleans(), st.text(max_size=5), st.lists(json_scalars, max_size=2), st.just({"a": 1}))
not_int = st.one_of(not_number, st.floats(0.1, 30.5).filter(lambda x: not x.is_integer()))
not_str = st.one_of(st.integers(), st.booleans(), st.lists(json_scalars, max_size=2), st.just({"a": "b"}))
not_object = st.one_of(st.integers(), st.booleans(), st.text(max_size=5), st.lists(json_scalars, max_size=2))
not_list = st.one_of(st.integers(), st.booleans(), st.text(max_size=5), st.just({"a": 1}))
MESSAGES_WRONG = {
    "max_tokens": st.one_of(not_int, st.integers(-5, 0)),
    "temperature": st.one_of(not_number, st.floats(1.01, 5), st.floats(-5, -0.01)),
    "top_p": st.one_of(not_number, st.floats(1.01, 5), st.floats(-5, -0.01)),
    "top_k": st.one_of(not_int, st.integers(-50, -2)),
    "stop_sequences": st.one_of(not_list, st.lists(not_str, min_size=1, max_size=2)),
    "stream": not_bool,
    "model": not_str,
    "messages": st.one_of(not_list, st.just([]), st.lists(not_object, min_size=1, max_size=2)),
    "system": st.one_of(st.integers(), st.booleans(), st.just({"a": 1}), st.lists(not_object, min_size=1)),
    "tools": st.one_of(not_list, st.lists(not_object, min_size=1, max_size=2)),
    "tool_choice": st.one_of(not_object, st.just({"type": "bogus"}), st.just({"type": "tool"})),
    "thinking": st.one_of(
        not_object,
        st.just({"type": "bogus"}),
        st.fixed_dictionaries({"type": st.just("enabled"), "budget_tokens": st.one_of(not_int, st.integers(-9, -1))}),
    ),
    "output_config": st.one_of(
        not_object, st.just({"effort": "bogus"}), st.fixed_dictionaries({"format": st.one_of(not_object, st.just({}))})
    ),
    "metadata": st.one_of(not_object, st.fixed_dictionaries({"user_id": not_str})),
}
RESPONSES_WRONG = {
    "input": st.one_of(st.integers(), st.booleans(), st.just({"a": 1}), st.lists(not_object, min_size=1)),
    "max_output_tokens": st.one_of(not_int, st.integers(-5, 0)),
    "temperature": st.one_of(not_number, st.floats(2.01, 5), st.floats(-5, -0.01)),
    "top_p": st.one_of(not_number, st.floats(1.01, 5), st.floats(-5, -0.01)),
    "seed": not_int,
    "stream": not_bool,
    "store": not_bool,
    "parallel_tool_calls": not_bool,
    "model": not_str,
    "instructions": not_str,
    "tools": st.one_of(not_list, st.lists(not_object, min_size=1, max_size=2)),
    "tool_choice": st.one_of(st.integers(), st.booleans(), st.just("bogus"), st.just({"type": "bogus"})),
    "text": st.one_of(not_object, st.fixed_dictionaries({"format": st.one_of(not_object, st.just({"type": "x"}))})),
    "reasoning": st.one_of(not_object, st.fixed_dictionaries({"effort": st.one_of(not_str, st.just("bogus"))})),
    "metadata": st.one_of(not_object, st.fixed_dictionaries({"k": not_str})),
    "include": st.one_of(not_list, st.lists(not_str, min_size=1, max_size=2)),
    "previous_response_id": not_str,
    "truncation": st.one_of(not_str, st.just("bogus")),
}


def named(err: dict, field: str) -> bool:
    """The error is about `field`: its `param` (OpenAI's shape) or, failing that, its message names it."""
    param = err.get("param") or ""
    return param.split(".")[0].split("[")[0] == field or field in err["message"]


@fuzz(200)
@given(base=a_valid, data=st.data())
def test_a_wrong_messages_field_is_a_400_naming_it(app_client, base, data):
    field = data.draw(st.sampled_from(sorted(MESSAGES_WRONG)), "field")
    body = {**base, field: data.draw(MESSAGES_WRONG[field], "value")}
    assume(not lone_surrogate(json.loads(json.dumps(body))))  # (that one is refused first, test_generated_*)
    response = post(app_client, "/v1/messages", body)
    assert response.status_code == 400, (field, response.status_code, response.text[:300])
    assert named(check_error(response), field), (field, response.text[:300])


@fuzz(200)
@given(base=r_valid, data=st.data(), which=st.integers(0, 7))
def test_a_wrong_responses_field_is_a_400_naming_it(app_client, stored, base, data, which):
    field = data.draw(st.sampled_from(sorted(RESPONSES_WRONG)), "field")
    body = {**resolve(base, stored.ids(which)), field: data.draw(RESPONSES_WRONG[field], "value")}
    assume(not lone_surrogate(json.loads(json.dumps(body))))  # (that one is refused first, test_generated_*)
    response = post(app_client, "/v1/responses", body)
    assert response.status_code == 400, (field, response.status_code, response.text[:300])
    assert named(check_error(response), field), (field, response.text[:300])


# ---------------------------------------------------------------------------------------------------------
# Stored responses: GET, DELETE, input_items, continued and referred to, in any order
# ---------------------------------------------------------------------------------------------------------

other_id = st.one_of(  # (no "/", "." or "..": path segments, which route elsewhere; the generic test sends those)
    st.sampled_from(["resp_nope", "msg_x", "x" * 300, "ü", " ", "resp_%00", "input_items"]),
    st.text(min_size=1, max_size=12).filter(lambda t: t not in (".", "..") and "/" not in t),
)
input_items_query = st.fixed_dictionaries(
    {},
    optional={
        "order": st.one_of(st.sampled_from(["asc", "desc"]), st.text(max_size=5)),
        "limit": st.one_of(st.integers(-2, 120).map(str), st.text(max_size=5)),
        "after": st.one_of(st.just("@item"), st.text(max_size=5)),
    },
)
stored_ops = st.lists(
    st.tuples(
        st.sampled_from(["get", "delete", "input_items", "continue", "reference"]),
        st.one_of(st.just(None), st.just(None), other_id),  # None: the response this example stored
        input_items_query,
        st.booleans(),  # stream (continue, reference)
    ),
    min_size=1,
    max_size=6,
)


@fuzz(120)
@given(ops=stored_ops)
def test_stored_responses_answer_each_operation_as_their_state_says(app_client, ops):
    """A response stored by this example, then GET / DELETE / input_items / previous_response_id / item_reference on
    it or on an id never stored: 200 while it is stored, 404 (400 for an item_reference) once deleted or never."""
    own = store_response(app_client, {"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 3})
    item = own["output"][-1]["id"]
    deleted = False
    for op, other, query, stream in ops:
        rid = own["id"] if other is None else other
        alive = other is None and not deleted
        path = "/v1/responses/" + urllib.parse.quote(rid, safe="")
        if op == "get":
            response = app_client.get(path)
        elif op == "delete":
            response = app_client.delete(path)
        elif op == "input_items":
            query = {k: (item if v == "@item" else v) for k, v in query.items()}
            response = app_client.get(path + "/input_items", params=query)
        elif op == "continue":
            body = {"previous_response_id": rid, "input": "and?", "max_output_tokens": 3, "stream": stream}
            response = post(app_client, "/v1/responses", body)
        else:
            ref = item if other is None else other
            body = {"input": [{"type": "item_reference", "id": ref}, {"role": "user", "content": "and?"}]}
            response = post(app_client, "/v1/responses", {**body, "max_output_tokens": 3, "stream": stream})
        check(response)
        if op == "reference":  # an item of another id may still be stored (`stored` above): only own is known
            assert response.status_code == (200 if alive else 400) or other is not None, response.text[:300]
            continue
        if op == "input_items" and alive and response.status_code != 200:
            err = check_error(response)  # a bad query value is a 400 naming it, an unknown `after` a 404
            assert err["param"] in query and (response.status_code, err["param"]) != (404, "order"), err
            continue
        assert response.status_code == (200 if alive else 404), (op, rid, response.status_code, response.text[:300])
        if not alive:
            code = "previous_response_not_found" if op == "continue" else "response_not_found"
            assert check_error(response)["code"] == code, response.text[:300]
        elif op == "get":
            assert response.json()["id"] == own["id"]
        elif op == "delete":
            assert response.json() == {"id": own["id"], "object": "response", "deleted": True}
            deleted = True


CHAT_VALID = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
COMPLETION_VALID = {"prompt": "hi", "max_tokens": 5}
SAMPLING_WRONG = {
    "max_tokens": st.one_of(not_int, st.integers(-5, -1)),
    "temperature": st.one_of(not_number, st.floats(2.01, 5), st.floats(-5, -0.01)),
    "top_p": st.one_of(not_number, st.floats(1.01, 5), st.floats(-5, -0.01)),
    "top_k": st.one_of(not_int, st.integers(-50, -2)),
    "min_p": st.one_of(not_number, st.floats(1.01, 5)),
    "seed": st.one_of(not_int, st.just(2**64)),
    "n": st.one_of(not_int, st.integers(-3, 0), st.integers(129, 10**6)),
    "stop": st.one_of(st.integers(), st.booleans(), st.just({}), st.lists(not_str, min_size=1, max_size=2)),
    "stream": not_bool,
    "model": not_str,
    "logit_bias": st.one_of(not_object, st.just({"x": 1}), st.just({"1": 101}), st.just({"1": "a"})),
    "presence_penalty": st.one_of(not_number, st.floats(2.01, 9)),
    "frequency_penalty": st.one_of(not_number, st.floats(-9, -2.01)),
    "repetition_penalty": st.one_of(not_number, st.just(0), st.floats(2.01, 9)),
    "min_tokens": st.one_of(not_int, st.integers(-5, -1), st.integers(6, 100)),
    "ignore_eos": not_bool,
    "skip_special_tokens": not_bool,
    "prompt_logprobs": st.one_of(not_int, st.integers(21, 100), st.integers(-5, -1)),
}
CHAT_WRONG = {
    **SAMPLING_WRONG,
    "messages": st.one_of(not_list, st.just([]), st.lists(not_object, min_size=1, max_size=2)),
    "max_completion_tokens": st.one_of(not_int, st.integers(-5, 0)),
    "logprobs": not_bool,
    "top_logprobs": st.one_of(not_int, st.integers(21, 100), st.integers(-5, -1)),
    "stream_options": st.one_of(not_object, st.just({"include_usage": True})),  # (not streamed: a 400 too)
    "tools": st.one_of(not_list, st.lists(not_object, min_size=1, max_size=2)),
    "tool_choice": st.one_of(st.integers(), st.booleans(), st.just("bogus"), st.just({"type": "bogus"})),
    "response_format": st.one_of(not_object, st.just({"type": "bogus"})),
    "thinking": st.one_of(st.integers(), st.text(max_size=5), st.just({"type": "bogus"})),
    "reasoning_effort": st.one_of(not_str, st.just("bogus")),
    "chat_template_kwargs": st.one_of(not_object, st.just({"thinking": "yes"})),
    "parallel_tool_calls": not_bool,
}
COMPLETION_WRONG = {
    **SAMPLING_WRONG,
    "prompt": st.one_of(st.integers(), st.booleans(), st.just({}), st.just([]), st.just(""), st.just([[1], 5])),
    "echo": not_bool,
    "logprobs": st.one_of(not_int, st.integers(21, 100), st.integers(-5, -1)),
    "best_of": st.one_of(not_int, st.integers(-3, 0)),
    "suffix": st.one_of(st.integers(1, 9), st.text(min_size=1, max_size=5)),
}


@fuzz(200)
@given(data=st.data())
def test_a_wrong_openai_field_is_a_400_naming_it(app_client, data):
    path, base, wrong = data.draw(
        st.sampled_from(
            [("/v1/chat/completions", CHAT_VALID, CHAT_WRONG), ("/v1/completions", COMPLETION_VALID, COMPLETION_WRONG)]
        ),
        "route",
    )
    field = data.draw(st.sampled_from(sorted(wrong)), "field")
    response = post(app_client, path, {**base, field: data.draw(wrong[field], "value")})
    expected = 404 if field == "model" and response.status_code == 404 else 400  # another model's name: a 404
    assert response.status_code == expected, (field, response.status_code, response.text[:300])
    assert named(check_error(response), field), (field, response.text[:300])


# ---------------------------------------------------------------------------------------------------------
# /tokenize and /detokenize: vLLM's fields
# ---------------------------------------------------------------------------------------------------------

tokenize_bodies = st.one_of(
    mutated(
        st.fixed_dictionaries(
            {"messages": st.lists(good_message, min_size=1, max_size=3)},
            optional={
                "add_generation_prompt": st.booleans(),
                "continue_final_message": st.booleans(),
                "add_special_tokens": st.booleans(),
                "return_token_strs": st.booleans(),
                "reasoning_effort": st.sampled_from(["low", "high", "max", "none"]),
                "tools": st.lists(tool, max_size=1),
                "model": st.just("deepseek-v4-flash"),
            },
        ),
        {
            "messages": st.one_of(st.lists(message, max_size=3), json_values),
            "add_generation_prompt": right_or_wrong(st.booleans()),
            "continue_final_message": right_or_wrong(st.booleans()),
            "add_special_tokens": right_or_wrong(st.booleans()),
            "return_token_strs": right_or_wrong(st.booleans()),
            "chat_template_kwargs": json_values,
            "prompt": right_or_wrong(agent_text),
        },
    ),
    mutated(
        st.fixed_dictionaries(
            {"prompt": agent_text}, optional={"add_special_tokens": st.booleans(), "return_token_strs": st.booleans()}
        ),
        {
            "prompt": right_or_wrong(agent_text),
            "content": right_or_wrong(agent_text),
            "add_special_tokens": right_or_wrong(st.booleans()),
            "return_token_strs": right_or_wrong(st.booleans()),
            "model": right_or_wrong(st.just("gpt-4o")),
        },
    ),
)
detokenize_bodies = st.fixed_dictionaries(
    {"tokens": st.one_of(st.lists(st.integers(-3, 600), max_size=12), json_values)},
    optional={"model": right_or_wrong(st.just("deepseek-v4-flash"))},
)


@fuzz(200)
@given(body=tokenize_bodies)
def test_generated_tokenize_bodies_get_2xx_or_an_openai_4xx(app_client, body):
    response = post(app_client, "/tokenize", body)
    check(response)
    check_unicode(response, body)
    if response.status_code == 200:
        out = response.json()
        assert out["count"] == len(out["tokens"]) and all(isinstance(t, int) for t in out["tokens"]), out
        assert "token_strs" not in out or len(out["token_strs"]) == out["count"], out
        detokenized = post(app_client, "/detokenize", {"tokens": out["tokens"]})
        assert detokenized.status_code == 200, detokenized.text[:300]
        if "prompt" in body and "messages" not in body and isinstance(body["prompt"], str):
            sent = json.loads(json.dumps(body["prompt"]))  # (a surrogate pair, as the server parsed it)
            assert detokenized.json()["prompt"] == sent  # the fake tokenizer's text round-trips


@fuzz(100)
@given(body=detokenize_bodies)
def test_generated_detokenize_bodies_get_2xx_or_an_openai_4xx(app_client, body):
    check(post(app_client, "/detokenize", body))
