"""Generated request bodies against the real app in-process (Starlette's TestClient, the fake engine): every
answer is a 2xx or a 4xx with an OpenAI-shaped error body; never a 5xx, never an exception out of the app."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402
from test_server import FakeEngine  # noqa: E402

from fastar.serve.server import Server  # noqa: E402

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
message = st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES)},
    optional={
        "content": st.one_of(
            text,
            json_values,
            st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 3]), "text": text}), max_size=3
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


def check(response) -> None:
    assert 200 <= response.status_code < 300 or 400 <= response.status_code < 500, (
        response.status_code,
        response.text[:300],
    )
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), err
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n")
        for line in response.text.split("\n"):
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event or event["error"]["code"] != "generation_failed", event
    else:
        response.json()


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(path=st.sampled_from(PATHS), body=bodies)
def test_generated_bodies_get_2xx_or_an_openai_4xx(app_client, path, body):
    check(app_client.post(path, content=body, headers={"Content-Type": "application/json"}))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
    path=st.one_of(
        st.sampled_from([*PATHS, "/v1/models", "/health", "/metrics", "/", "/static/app.js"]),
        st.text(max_size=20).map(lambda t: "/" + t),
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
