"""The HTTP server against a deterministic FakeEngine: the official `openai` client on a live server, raw HTTP
for what a well-behaved client never sends (bad JSON, traversal paths, missing keys, preflights).

FakeEngine implements the Engine contract the server programs against (tokenizer, stats, load_progress and
`scheduler()`, here tests/serial_scheduler.py over its open_session and its stream with session, cancel and
prefill progress) with a character-level tokenizer and scripted replies:
  * "Echo: <last user text>" at temperature 0; seeded random words at temperature > 0;
  * "count..." -> "1 2 3 ... 1999" (long: stop strings, max_tokens, disconnects);
  * "weather" with tools -> a DSML get_weather call ("weather in Paris and Rome": two calls in one block); where
    the request bans a token the script holds (`tool_choice` "none" bans the DSML marker), the reply goes on from
    there with BANNED_ALTERNATIVE;
  * "explode" -> the engine raises mid-stream;
  * thinking mode (prompt ends with <think>) -> "Thinking about <text>.</think>" before the reply; then EOS.
"""

from __future__ import annotations

import base64
import http.client
import json
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from serial_scheduler import SchedulesSerially

from fastar.encoding import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    LATEST_REMINDER,
    THINK_END,
    THINK_START,
    USER,
    ChatPrompt,
    encode_messages,
    render_tool_calls,
)
from fastar.engine.constraint import CompiledGrammar
from fastar.engine.generate import GenerationChunk
from fastar.engine.prompt_logprobs import PromptLogprobs
from fastar.serve import choice_turn, fields, openai_request, thinking_mode
from fastar.serve import server as S
from fastar.serve.api_error import APIError
from fastar.serve.app import parse_json
from fastar.serve.server import Server

try:
    import openai
except ImportError:  # FakeEngine stays importable (test_webui uses it) without the client
    openai = None
pytestmark = pytest.mark.skipif(openai is None, reason="the openai client is a test dependency: pip install openai")

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo")
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]},
    },
}
TWO_CALLS = render_tool_calls(
    [{"name": "get_weather", "arguments": {"location": city}, "raw": ""} for city in ("Paris", "Rome")]
)
MARKDOWN_REPLY = (
    "# Title\n\nSome **bold** and *italic* text with `code` and <b>raw html</b>.\n\n"
    "```python\ndef f(x):\n    return x < 3 and '<script>alert(1)</script>'\n```\n\n"
    "- item one\n- item [link](https://example.com)\n\n1. first\n2. second\n\n> quoted"
)


class FakeTokenizer:
    """One token per character (id = code point); DeepSeek's special strings are single ids above Unicode."""

    SPECIALS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, LATEST_REMINDER, DSML)
    BASE = 0x110000
    _split = re.compile("(" + "|".join(map(re.escape, SPECIALS)) + ")")

    def __init__(self) -> None:
        self.vocab_size = self.BASE + len(self.SPECIALS)
        self.eos_id = self.BASE + self.SPECIALS.index(EOS)

    def encode(self, text: str) -> list[int]:
        if isinstance(text, ChatPrompt):  # as the real tokenizer: special strings count only in the template
            return [i for part, content in text.segments for i in (map(ord, part) if content else self.encode(part))]
        ids: list[int] = []
        for part in self._split.split(text):
            if part in self.SPECIALS:
                ids.append(self.BASE + self.SPECIALS.index(part))
            else:
                ids.extend(map(ord, part))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.SPECIALS[i - self.BASE] if i >= self.BASE else chr(i) for i in ids)

    def token_bytes(self, token: int) -> bytes:
        return self.decode([token]).encode("utf-8", errors="replace")

    def id_to_token(self, token: int) -> str:
        return self.decode([token])

    def token_to_id(self, token: str) -> int | None:
        return self.BASE + self.SPECIALS.index(token) if token in self.SPECIALS else None

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        return self.encode(encode_messages(messages, **kwargs))

    def max_token_bytes(self) -> int:
        return max(4, *(len(s.encode()) for s in self.SPECIALS))


# with parallel tool calls disabled the reply ends here: the tokens (characters, a DSML marker one) up to the first
# call's end
FIRST_CALL_END = TWO_CALLS.index("</｜DSML｜invoke>") + len("</｜DSML｜invoke>")
ONE_CALL_TOKENS = len(FakeTokenizer().encode(TWO_CALLS[:FIRST_CALL_END]))
# what the fake model writes where its script would write a banned token (`tool_choice` "none" bans the DSML marker)
BANNED_ALTERNATIVE = "No tool then: Paris is sunny."


class ScriptedGrammar(CompiledGrammar):
    """What FakeEngine.compile_grammar gives: a `CompiledGrammar` (as `SamplingParams` requires) that holds the
    request's grammar; never started, since the scripted replies ignore it."""

    def __init__(self, grammar) -> None:
        self.grammar = grammar


class FakeSession:
    def __init__(self) -> None:
        self.tokens: list[int] = []


class FakeEngine(SchedulesSerially):
    model_name_default = "fake-v4"
    context_note = None  # (a `ServedEngine`: the context is never capped)

    def __init__(self, context_length: int = 4096, token_delay: float = 0.0, prefill_delay: float = 0.0) -> None:
        self.tokenizer = FakeTokenizer()
        self.context_length = context_length
        self.token_delay = token_delay
        self.prefill_delay = prefill_delay
        self.gate = threading.Event()  # clear it to hold generations at the start (queue tests)
        self.gate.set()
        self.started = threading.Semaphore(0)
        self.sessions_opened = 0
        self._lock = threading.Lock()
        self._stats = dict(
            prompt_tokens=0,
            generated_tokens=0,
            prefill_tokens_computed=0,
            expert_cache_hits=0,
            expert_cache_misses=0,
            expert_cache_bytes_read=0,
            requests=0,
            tokens_after_cancel=0,
        )

    def close(self) -> None:  # `Engine.close`: the host calls it at shutdown
        self.closed = True

    def compile_grammar(self, grammar):  # `Engine.compile_grammar`: the scripted replies ignore it
        return ScriptedGrammar(grammar)

    def _bump(self, **kw: int) -> None:
        with self._lock:
            for key, value in kw.items():
                self._stats[key] += value

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    def load_progress(self) -> float:
        return 1.0

    def open_session(self) -> FakeSession:
        self.sessions_opened += 1
        return FakeSession()

    def reply(self, prompt: str, params) -> str:
        user = prompt.rsplit(USER, 1)[-1].split(ASSISTANT, 1)[0]
        if user.startswith("count"):
            body = " ".join(str(i) for i in range(1, 2000))
        elif "weather in Paris and Rome" in user and "## Tools" in prompt:
            body = TWO_CALLS
        elif "weather" in user and "## Tools" in prompt:
            body = render_tool_calls([{"name": "get_weather", "arguments": {"location": "Paris"}, "raw": ""}])
        elif "markdown" in user:
            body = MARKDOWN_REPLY
        elif params.temperature > 0:
            rng = random.Random(params.seed)
            body = " ".join(rng.choice(WORDS) for _ in range(12))
        else:
            body = f"Echo: {user}"
        if prompt.endswith(THINK_START):
            body = f"Thinking about {user[:30]}.{THINK_END}{body}"
        return body

    def stream(self, prompt_ids, params, session=None, cancel=None, on_prefill_progress=None):
        """The scripted chunks; the first carries scripted prompt logprobs when they are asked for."""
        for i, chunk in enumerate(self._script(prompt_ids, params, session, cancel, on_prefill_progress)):
            if i == 0 and params.prompt_logprobs is not None:
                chunk.prompt_logprobs = fake_prompt_logprobs(prompt_ids, params.prompt_logprobs)
            yield chunk

    def _script(self, prompt_ids, params, session, cancel, on_prefill_progress):
        self._bump(requests=1, prompt_tokens=len(prompt_ids))
        self.started.release()
        while not self.gate.wait(0.01):
            if cancel is not None and cancel.is_set():
                yield GenerationChunk("", finish_reason="cancelled")
                return
        common = 0
        if session is not None:
            while common < min(len(session.tokens), len(prompt_ids)) and session.tokens[common] == prompt_ids[common]:
                common += 1
        todo = len(prompt_ids) - common
        for done in range(0, todo, 64):  # cancelled between chunks, as the scheduler's prefill steps are
            if cancel is not None and cancel.is_set():
                yield GenerationChunk("", finish_reason="cancelled")
                return
            if on_prefill_progress:
                on_prefill_progress(common + done, len(prompt_ids))
            time.sleep(self.prefill_delay * 64 / max(todo, 1))
        self._bump(prefill_tokens_computed=todo)
        if session is not None:
            session.tokens = list(prompt_ids)
        prompt = self.tokenizer.decode(prompt_ids)
        if "refuse" in prompt.rsplit(USER, 1)[-1]:
            raise ValueError("the fake engine refuses this prompt")
        if "explode" in prompt.rsplit(USER, 1)[-1]:
            yield GenerationChunk("Boo", ord("B"))
            raise RuntimeError("the fake engine exploded")
        ids = self.tokenizer.encode(self.reply(prompt, params))
        banned = [i for i, tid in enumerate(ids) if tid in params.banned_token_ids]
        if banned:  # the model's next choice where its script would write a banned token
            ids = ids[: banned[0]] + self.tokenizer.encode(BANNED_ALTERNATIVE)
        ids.append(self.tokenizer.eos_id)
        for i, tid in enumerate(ids):
            if cancel is not None and cancel.is_set():
                yield GenerationChunk("", finish_reason="cancelled")
                return
            if i >= params.max_tokens:
                yield GenerationChunk("", finish_reason="length")
                return
            time.sleep(self.token_delay)
            self._bump(
                generated_tokens=1,
                expert_cache_hits=5,
                expert_cache_misses=1,
                expert_cache_bytes_read=4096,
                tokens_after_cancel=int(cancel is not None and cancel.is_set()),
            )
            if session is not None:
                session.tokens.append(tid)
            top = [(tid, -0.25), (ord("?"), -1.5), (ord("!"), -3.0)][: params.logprobs or 0]
            yield GenerationChunk(
                self.tokenizer.decode([tid]), tid, -0.25, top, "stop" if tid == self.tokenizer.eos_id else None
            )


def fake_prompt_logprobs(ids: list[int], top: int) -> PromptLogprobs:
    """Token i scores -0.5 * (i % 4), ranked 1 + i % 4; the alternatives are "?" and "!"."""
    alternatives = [(ord("?"), -0.125), (ord("!"), -2.0)][:top]
    return PromptLogprobs(
        token_ids=list(ids),
        logprobs=[None] + [-0.5 * (i % 4) for i in range(1, len(ids))],
        ranks=[None] + [1 + i % 4 for i in range(1, len(ids))],
        top=[[]] + [list(alternatives) for _ in ids[1:]],
        num_top=top,
    )


# ---------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------------------------------------


def start_server(engine: FakeEngine | None = None, **kw) -> Server:
    engine = engine or FakeEngine()
    kw.setdefault("port", 0)
    server = Server(lambda: engine, **kw).start()
    assert server.wait_ready(10)
    server.engine = engine  # type: ignore[attr-defined]
    return server


@pytest.fixture(scope="module")
def server():
    srv = start_server()
    yield srv
    srv.shutdown()


def client(server: Server, **kw) -> openai.OpenAI:
    kw.setdefault("api_key", "unused")
    return openai.OpenAI(base_url=server.url + "/v1", max_retries=0, timeout=30, **kw)


def raw(
    server: Server, method: str, path: str, body: bytes | str | dict | None = None, headers: dict | None = None
) -> tuple[int, dict, bytes]:
    """One request with the path sent exactly as given (no client-side normalisation of '..')."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    if isinstance(body, dict):
        body = json.dumps(body)
    headers = dict(headers or {})
    if method == "POST":  # the server refuses POST bodies of any other type (cross-site forms, text/plain)
        headers.setdefault("Content-Type", "application/json")
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data


def chat(cl, text: str, **kw):
    kw.setdefault("temperature", 0)  # the API's default is 1.0 (sampled); the scripted echo wants greedy
    return cl.chat.completions.create(model="deepseek-v4-flash", messages=[{"role": "user", "content": text}], **kw)


NO_THINK = {"thinking": {"type": "disabled"}}


def stream_text(cl, text: str, **kw) -> tuple[str, str, str | None, list]:
    """(content, reasoning, finish_reason, chunks) of a streamed chat completion."""
    chunks = list(chat(cl, text, stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return content, reasoning, finish[-1] if finish else None, chunks


def accumulate_chat(chunks) -> tuple:
    """The completion the `openai` client's stream helper (`ChatCompletionStreamState`, what
    `chat.completions.stream()` runs) builds from a chat stream (the client's chunks, or the raw SSE bytes), and each
    tool call's argument pieces by (choice, call index), its opening delta's empty arguments first. Every tool-call
    delta is held to OpenAI's shape on the way: a call's first delta carries its index (0, 1, ... in order), id,
    type and name with empty arguments; each later one only its index and a non-empty piece of the arguments."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    if isinstance(chunks, bytes):
        chunks = [ChatCompletionChunk.model_validate(event) for event in _sse_events(chunks)]
    state = ChatCompletionStreamState()
    pieces: dict[tuple[int, int], list[str]] = {}
    for chunk in chunks:
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                sent, key = call.to_dict(), (choice.index, call.index)
                if key in pieces:
                    piece = sent["function"]["arguments"]
                    assert sent == {"index": call.index, "function": {"arguments": piece}} and piece, sent
                else:
                    assert call.index == sum(k[0] == choice.index for k in pieces), sent  # the next index
                    opening = {"name": call.function.name, "arguments": ""}
                    assert sent == {"index": call.index, "id": call.id, "type": "function", "function": opening}
                    assert call.id and call.function.name, sent
                pieces.setdefault(key, []).append(sent["function"]["arguments"])
    return state.current_completion_snapshot, pieces


def same_chat_choices(streamed, whole) -> None:
    """A streamed chat completion, accumulated (`accumulate_chat`), says what the non-streamed one says: each
    choice's finish reason, content (the stream's opening `""` is no content), reasoning, tool calls (but for
    their ids: another request's), logprobs; and the same token counts."""
    assert len(streamed.choices) == len(whole.choices)
    for s, w in zip(streamed.choices, whole.choices):
        assert (s.index, s.finish_reason) == (w.index, w.finish_reason)
        assert (s.message.content or None) == (w.message.content or None)
        assert getattr(s.message, "reasoning_content", None) == getattr(w.message, "reasoning_content", None)
        calls = [[(c.type, c.function.name, c.function.arguments) for c in m.message.tool_calls or []] for m in (s, w)]
        assert calls[0] == calls[1]
        ids = [c.id for c in s.message.tool_calls or []]
        assert len(set(ids)) == len(ids) and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids), ids
        logprobs = [[e.model_dump() for e in (c.logprobs.content if c.logprobs else [])] for c in (s, w)]
        assert logprobs[0] == logprobs[1]  # each token's once, in order
    uses = (streamed.usage, whole.usage)
    counts = [(u.prompt_tokens, u.completion_tokens, u.completion_tokens_details) for u in uses]
    assert counts[0] == counts[1]


# ---------------------------------------------------------------------------------------------------------
# The API through the official client
# ---------------------------------------------------------------------------------------------------------


def test_health_models_and_tokenize(server):
    status, _, body = raw(server, "GET", "/health")
    assert (status, json.loads(body)) == (200, {"status": "ok", "experts": {"status": "off"}})  # no expert cache
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["deepseek-v4-flash"]
    assert models.data[0].max_model_len == 4096
    status, _, body = raw(server, "POST", "/tokenize", {"prompt": "hi" + EOS})
    assert status == 200 and json.loads(body)["tokens"] == [ord("h"), ord("i"), FakeTokenizer().eos_id]
    status, _, body = raw(server, "POST", "/detokenize", {"tokens": [ord("o"), ord("k")]})
    assert status == 200 and json.loads(body)["prompt"] == "ok"
    msgs = [{"role": "user", "content": "hello"}]
    status, _, body = raw(server, "POST", "/tokenize", {"messages": msgs})
    assert json.loads(body)["tokens"] == FakeTokenizer().encode_chat(msgs, thinking_mode="thinking")


def test_tokenize_template_options(server):
    """vLLM's /tokenize options: `add_generation_prompt` (default true) and `continue_final_message` shape a
    `messages` rendering with the chat route's thinking options; `add_special_tokens` is checked on both kinds (V4's
    tokenizer adds no token around a text, so a prompt's ids are the ones a completion is fed); `return_token_strs`
    lists each id's entry; a wrong type is a 400 naming the field."""
    tok = FakeTokenizer()

    def tokenize(body: dict) -> tuple[int, dict]:
        status, _, data = raw(server, "POST", "/tokenize", body)
        return status, json.loads(data)

    for flag in ({}, {"add_special_tokens": True}, {"add_special_tokens": False}):
        assert tokenize({"prompt": "hi", **flag}) == (200, {"tokens": [104, 105], "count": 2, "max_model_len": 4096})
    msgs = [{"role": "user", "content": "hello"}]
    opened = tok.encode_chat(msgs, thinking_mode="thinking")
    assert tokenize({"messages": msgs, "add_special_tokens": False})[1]["tokens"] == opened
    assert opened[-2:] == [tok.encode(ASSISTANT)[0], tok.encode(THINK_START)[0]]
    status, body = tokenize({"messages": msgs, "add_generation_prompt": False})
    assert status == 200 and body["tokens"] == opened[:-2] and tok.decode(body["tokens"]).endswith(USER + "hello")
    no_think = {"messages": msgs, "chat_template_kwargs": {"thinking": False}}
    assert tokenize(no_think)[1]["tokens"][-1] == tok.encode(THINK_END)[0]
    assert tokenize({**no_think, "add_generation_prompt": False})[1]["tokens"] == opened[:-2]
    reply = [*msgs, {"role": "assistant", "content": "Hi the"}]
    status, body = tokenize({"messages": reply, "continue_final_message": True, **NO_THINK})
    assert status == 200 and tok.decode(body["tokens"]).endswith(ASSISTANT + THINK_END + "Hi the")
    status, body = tokenize({"messages": msgs, "return_token_strs": True, "add_generation_prompt": False})
    assert body["token_strs"] == [tok.decode([i]) for i in body["tokens"]] and body["token_strs"][-1] == "o"
    bad = [
        ({"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
        ({"messages": msgs, "add_special_tokens": 1}, "add_special_tokens"),
        ({"messages": msgs, "add_generation_prompt": "no"}, "add_generation_prompt"),
        ({"messages": msgs, "continue_final_message": "on"}, "continue_final_message"),
        ({"messages": reply, "continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"prompt": "hi", "return_token_strs": "true"}, "return_token_strs"),
    ]
    for body, param in bad:
        status, err = tokenize(body)
        assert status == 400 and err["error"]["param"] == param, (body, err)
        assert param in err["error"]["message"] and "\n" not in err["error"]["message"]
    # another model's name is a 404, as on the generating routes (its tokenizer could count differently)
    for path, body in (
        ("/tokenize", {"prompt": "hi"}),
        ("/tokenize", {"messages": msgs}),
        ("/detokenize", {"tokens": [1]}),
    ):
        status, _, data = raw(server, "POST", path, {**body, "model": "gpt-4o"})
        assert status == 404 and json.loads(data)["error"]["code"] == "model_not_found", (path, data)
        assert raw(server, "POST", path, {**body, "model": "deepseek-v4-flash"})[0] == 200


def test_a_json_schema_format_of_the_wrong_kind_is_a_400_naming_it():
    """`strict: "yes"` (or a name or description that is not a string) was taken as if it were right; OpenAI
    answers a 400 naming the field."""
    base = {"messages": [{"role": "user", "content": "hi"}]}
    fmt = {"name": "r", "schema": {"type": "object"}}
    for bad, key in (({"strict": "yes"}, "strict"), ({"name": 5}, "name"), ({"description": []}, "description")):
        body = {**base, "response_format": {"type": "json_schema", "json_schema": {**fmt, **bad}}}
        with pytest.raises(APIError) as err:
            openai_request.parse_chat_request(body, ("deepseek-v4-flash",))
        assert (err.value.status, err.value.param) == (400, f"response_format.json_schema.{key}")
    ok = {**base, "response_format": {"type": "json_schema", "json_schema": {**fmt, "strict": False}}}
    assert openai_request.parse_chat_request(ok, ("deepseek-v4-flash",)).sampling["grammar"] is not None


def test_models_retrieve(server):
    """`models.retrieve` (GET /v1/models/{model}) gives the listed entry; another name is the client's NotFoundError."""
    cl = client(server)
    assert cl.models.retrieve("deepseek-v4-flash") == cl.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as ei:
        cl.models.retrieve("gpt-4o")
    assert ei.value.body["code"] == "model_not_found" and ei.value.body["param"] == "model"


def test_chat_non_streaming_with_usage(server):
    r = chat(client(server), "hello there", extra_body=NO_THINK)
    msg = r.choices[0].message
    assert msg.content == "Echo: hello there" and msg.role == "assistant"
    assert r.choices[0].finish_reason == "stop"
    prompt = FakeTokenizer().encode_chat([{"role": "user", "content": "hello there"}], thinking_mode="chat")
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len("Echo: hello there") + 1  # + EOS
    assert getattr(msg, "reasoning_content", None) is None


def test_chat_streaming_matches_non_streaming(server):
    cl = client(server)
    content, reasoning, finish, chunks = stream_text(
        cl, "stream me", extra_body=NO_THINK, stream_options={"include_usage": True}
    )
    assert content == "Echo: stream me" and reasoning == "" and finish == "stop"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(content) + 1
    assert EOS not in content


def test_thinking_default_and_reasoning_content(server):
    cl = client(server)
    r = chat(cl, "why?")
    msg = r.choices[0].message
    assert msg.reasoning_content == "Thinking about why?." and msg.content == "Echo: why?"
    content, reasoning, _, _ = stream_text(cl, "why?")
    assert (content, reasoning) == ("Echo: why?", "Thinking about why?.")
    for extra in ({"chat_template_kwargs": {"thinking": False}}, {"reasoning_effort": "none"}, NO_THINK):
        msg = chat(cl, "why?", extra_body=extra).choices[0].message
        assert msg.content == "Echo: why?" and getattr(msg, "reasoning_content", None) is None, extra
    msg = chat(cl, "why?", extra_body={"reasoning_effort": "max", "chat_template_kwargs": {"thinking": True}})
    assert msg.choices[0].message.reasoning_content == "Thinking about why?."


def test_usage_counts_the_reasoning_tokens(server):
    """`usage.completion_tokens_details.reasoning_tokens`, as OpenAI's and DeepSeek's APIs give it: the scripted
    thinking is "Thinking about why?." (20 tokens) and `</think>`; the answer "Echo: why?" and EOS follow. The same
    in the stream's usage chunk and in what the Responses API reports for the same reply."""
    cl = client(server)
    r = chat(cl, "why?")
    assert (r.usage.completion_tokens, r.usage.completion_tokens_details.reasoning_tokens) == (32, 21)
    chunks = list(chat(cl, "why?", stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 21
    resp = cl.responses.create(model="deepseek-v4-flash", input="why?", temperature=0)
    assert resp.usage.output_tokens_details.reasoning_tokens == 21
    assert chat(cl, "why?", extra_body=NO_THINK).usage.completion_tokens_details.reasoning_tokens == 0


def test_reasoning_field_flag():
    srv = start_server(reasoning_field="reasoning")
    try:
        msg = chat(client(srv), "q").choices[0].message
        assert msg.reasoning == "Thinking about q." and getattr(msg, "reasoning_content", None) is None
    finally:
        srv.shutdown()


def test_reasoning_sent_back_is_accepted(server):
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning": "r1"},
        {"role": "user", "content": "c"},
    ]
    r = client(server).chat.completions.create(model="deepseek-v4-flash", messages=messages, temperature=0)
    assert r.choices[0].message.content == "Echo: c"


def test_completions(server):
    cl = client(server)
    r = cl.completions.create(model="deepseek-v4-flash", prompt="Hello", max_tokens=50, temperature=0)
    assert r.choices[0].text == "Echo: Hello" and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == 5
    text = "".join(
        c.choices[0].text
        for c in cl.completions.create(model="deepseek-v4-flash", prompt="Hello", stream=True, temperature=0)
        if c.choices
    )
    assert text == "Echo: Hello"
    r = cl.completions.create(model="deepseek-v4-flash", prompt="Hi", echo=True, logprobs=1, temperature=0)
    assert r.choices[0].text == "HiEcho: Hi"
    lp = r.choices[0].logprobs  # the prompt's tokens first (null for the first), then the generated ones
    assert lp.tokens[:4] == ["H", "i", "E", "c"] and lp.token_logprobs[:2] == [None, -0.5]
    assert lp.top_logprobs[:2] == [None, {"?": -0.125}] and lp.text_offset[:4] == [0, 1, 2, 3]


def test_completions_without_max_tokens_stop_at_16_as_openai(server):
    """/v1/completions defaults `max_tokens` to 16 (OpenAI's and vLLM's default), capped at the room the context
    leaves, where it used to run to the end of the context; chat completions still fill it."""
    cl = client(server)
    r = cl.completions.create(model="deepseek-v4-flash", prompt="count", temperature=0)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (16, "length")
    assert r.choices[0].text == "1 2 3 4 5 6 7 8 "
    chunks = list(cl.completions.create(model="deepseek-v4-flash", prompt="count", temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    near = cl.completions.create(model="deepseek-v4-flash", prompt="count" + "." * 4086, temperature=0)
    assert (near.usage.prompt_tokens, near.usage.completion_tokens) == (4091, 5)  # the room left, not a 400
    long = chat(cl, "count", extra_body=NO_THINK)
    assert long.usage.completion_tokens > 16


def test_a_conversation_must_end_with_a_user_or_tool_turn(server):
    """After an assistant or system message the V4 prompt has no `<｜Assistant｜>` to reply after: a 400 naming
    `messages`, not a reply the model writes on after its own EOS; /tokenize still counts such a conversation."""
    cl = client(server)
    hi = {"role": "user", "content": "hi"}
    for messages in (
        [hi, {"role": "assistant", "content": "Hel"}],
        [hi, {"role": "assistant", "content": "ok"}, {"role": "system", "content": "be brief"}],
        [{"role": "system", "content": "be brief"}],
    ):
        with pytest.raises(openai.BadRequestError) as ei:
            cl.chat.completions.create(model="deepseek-v4-flash", messages=messages, max_tokens=4)
        assert ei.value.body["param"] == "messages" and "must end with a user or tool message" in ei.value.message
        status, _, body = raw(server, "POST", "/tokenize", {"messages": messages})
        assert status == 200 and json.loads(body)["count"] > 0
    ok = [hi, {"role": "assistant", "content": "ok"}, {"role": "developer", "content": "again"}]
    assert cl.chat.completions.create(model="deepseek-v4-flash", messages=ok, max_tokens=4, temperature=0).choices


def test_a_bad_message_is_named_by_its_own_index_when_tools_are_given(server):
    """The tools ride on a system message put first; an error in the client's messages[1] still says messages[1]."""
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "user", "content": "ok"},
    ]
    for extra in ({}, {"tools": [WEATHER_TOOL]}, {"response_format": {"type": "json_object"}}):
        status, _, body = raw(server, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 2, **extra})
        assert status == 400 and json.loads(body)["error"]["message"].startswith("messages[1]:"), extra


def test_stop_strings_never_leak(server):
    cl = client(server)
    r = chat(cl, "count", stop=["5 6"], extra_body=NO_THINK)
    assert r.choices[0].message.content == "1 2 3 4 " and r.choices[0].finish_reason == "stop"
    content, _, finish, chunks = stream_text(cl, "count", stop=["7 8", "12"], extra_body=NO_THINK)
    assert content == "1 2 3 4 5 6 " and finish == "stop"
    assert all("7" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    r = cl.completions.create(model="deepseek-v4-flash", prompt="count", stop="3 4", temperature=0)
    assert r.choices[0].text == "1 2 "


def test_max_tokens_and_alias(server):
    cl = client(server)
    r = chat(cl, "count", max_tokens=5, extra_body=NO_THINK)
    assert r.choices[0].message.content == "1 2 3" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    content, _, finish, _ = stream_text(cl, "count", max_completion_tokens=3, extra_body=NO_THINK)
    assert (content, finish) == ("1 2", "length")


def test_seed_reproducibility(server):
    cl = client(server)
    a = chat(cl, "story", temperature=1.0, seed=42, extra_body=NO_THINK).choices[0].message.content
    b = chat(cl, "story", temperature=1.0, seed=42, extra_body=NO_THINK).choices[0].message.content
    c, _, _, _ = stream_text(cl, "story", temperature=1.0, seed=42, extra_body=NO_THINK)
    d = chat(cl, "story", temperature=1.0, seed=7, extra_body=NO_THINK).choices[0].message.content
    assert a == b == c and a != d


def test_logprobs(server):
    r = chat(client(server), "lp", logprobs=True, top_logprobs=2, extra_body=NO_THINK)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    assert entries[0].token == "E" and entries[0].logprob == -0.25
    assert [t.token for t in entries[0].top_logprobs] == ["E", "?"]


def test_tool_calls(server):
    cl = client(server)
    r = chat(cl, "weather in Paris?", tools=[WEATHER_TOOL], extra_body=NO_THINK)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"location": "Paris"}
    assert call.id and not choice.message.content
    chunks = list(chat(cl, "weather in Paris?", tools=[WEATHER_TOOL], stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather" and calls[0].index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "DSML" not in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # tool_choice "none": the DSML marker is banned, so where the script would call it answers in text
    r = chat(cl, "weather in Paris?", tools=[WEATHER_TOOL], tool_choice="none", extra_body=NO_THINK)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert BANNED_ALTERNATIVE in r.choices[0].message.content


def test_parallel_tool_calls_false_ends_the_reply_after_its_first_call(server):
    """With tools left to the model, `parallel_tool_calls: false` still means at most one call: the reply ends once
    the first call is complete (finish_reason "tool_calls"), streamed or not; by default both calls come back."""
    cl = client(server)
    ask = "weather in Paris and Rome"
    both = chat(cl, ask, tools=[WEATHER_TOOL], extra_body=NO_THINK).choices[0]
    cities = [json.loads(c.function.arguments)["location"] for c in both.message.tool_calls]
    assert (cities, both.finish_reason) == (["Paris", "Rome"], "tool_calls")
    r = chat(cl, ask, tools=[WEATHER_TOOL], parallel_tool_calls=False, extra_body=NO_THINK)
    (call,) = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"location": "Paris"} and r.choices[0].finish_reason == "tool_calls"
    assert not r.choices[0].message.content and r.usage.completion_tokens == ONE_CALL_TOKENS  # generation stopped
    chunks = list(chat(cl, ask, tools=[WEATHER_TOOL], parallel_tool_calls=False, stream=True, extra_body=NO_THINK))
    streamed, pieces = accumulate_chat(chunks)
    assert list(pieces) == [(0, 0)] and json.loads("".join(pieces[0, 0])) == {"location": "Paris"}
    (call,) = streamed.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"location": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "DSML" not in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("thinking", [False, True])
def test_tool_calls_stream_piece_by_piece_and_add_up_to_the_reply(server, thinking):
    """As OpenAI streams them: each call opens with its index, id and name, then its arguments come as the model
    writes them; parallel calls by index, each of `n` choices its own; the reasoning first. The official client's
    accumulation of the stream is the non-streamed reply, logprobs and usage included."""
    cl = client(server)
    ask, mode = "weather in Paris and Rome", {"thinking": {"type": "enabled" if thinking else "disabled"}}
    kw = {"tools": [WEATHER_TOOL], "n": 2, "logprobs": True, "top_logprobs": 2, "extra_body": mode}
    whole = chat(cl, ask, **kw)
    chunks = list(chat(cl, ask, stream=True, stream_options={"include_usage": True}, **kw))
    streamed, pieces = accumulate_chat(chunks)
    same_chat_choices(streamed, whole)
    cities = ("Paris", "Rome")
    assert list(pieces) == [(i, j) for i in range(2) for j in range(2)]
    for (i, j), parts in pieces.items():
        assert "".join(parts) == json.dumps({"location": cities[j]})
        assert len(parts) > len(cities[j]) + 2  # the city a character a delta, as the fake model writes it
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"] * 2
        assert len(choice.logprobs.content) == whole.usage.completion_tokens // 2
        assert (getattr(choice.message, "reasoning_content", None) is not None) == thinking
    for i in range(2):  # the reasoning streams before the calls
        kinds = [k for c in chunks for ch in c.choices if ch.index == i for k, v in ch.delta if v and k != "role"]
        assert kinds == ["reasoning_content"] * kinds.count("reasoning_content") + ["tool_calls"] * kinds.count(
            "tool_calls"
        )
        assert kinds.count("reasoning_content") == (len("Thinking about weather in Paris and Rome.") if thinking else 0)


def test_the_openai_stream_helper_reads_each_call_as_it_is_written(server):
    """`chat.completions.stream()` with strict tools: an arguments delta event per piece, each call done (its
    arguments parsed) once the next one opens or the reply ends, and the final completion is `create()`'s."""
    cl = client(server)
    tool = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
    kw = {"model": "deepseek-v4-flash", "tools": [tool], "temperature": 0, "extra_body": NO_THINK}
    kw["messages"] = [{"role": "user", "content": "weather in Paris and Rome"}]
    whole = cl.chat.completions.create(**kw)
    with cl.chat.completions.stream(stream_options={"include_usage": True}, **kw) as stream:
        events = [e for e in stream if e.type.startswith("tool_calls.")]
        final = stream.get_final_completion()
    same_chat_choices(final, whole)
    done = [(e.index, e.name, e.parsed_arguments) for e in events if e.type.endswith(".done")]
    assert done == [(0, "get_weather", {"location": "Paris"}), (1, "get_weather", {"location": "Rome"})]
    assert [c.function.parsed_arguments for c in final.choices[0].message.tool_calls] == [d[2] for d in done]
    deltas = [e for e in events if e.type.endswith(".delta")]
    assert (
        len(deltas) > 2 * len("Paris")
        and deltas[-1].arguments == whole.choices[0].message.tool_calls[1].function.arguments
    )
    order = [(e.type.rsplit(".", 1)[1], e.index) for e in events]
    k = order.index(("done", 0))  # the first call is done when the second opens, before its arguments come
    assert set(order[: k - 1]) == {("delta", 0)} and order[k - 1] == ("delta", 1) and order[-1] == ("done", 1)


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"response_format": {"type": "json_object"}},
        {"parallel_tool_calls": False},
        {"max_tokens": ONE_CALL_TOKENS + 60},  # inside the second call
        {"stop": ["Rome"]},
    ],
)
def test_a_streamed_tool_call_is_the_one_returned_whatever_shapes_the_reply(server, extra):
    """Forced calls and a JSON format (their grammars compiled and sent with the job), one call at most, a cut:
    the accumulated stream is the non-streamed reply."""
    cl = client(server)
    kw = {"tools": [WEATHER_TOOL], "extra_body": NO_THINK, **extra}
    whole = chat(cl, "weather in Paris and Rome", **kw)
    streamed, pieces = accumulate_chat(
        chat(cl, "weather in Paris and Rome", stream=True, stream_options={"include_usage": True}, **kw)
    )
    same_chat_choices(streamed, whole)
    assert len(pieces[0, 0]) > 2 and whole.choices[0].message.tool_calls


def test_errors_through_the_client(server):
    cl = client(server)
    with pytest.raises(openai.NotFoundError) as e:
        cl.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"
    long_text = "x" * 5000
    n = len(FakeTokenizer().encode_chat([{"role": "user", "content": long_text}], thinking_mode="thinking"))
    with pytest.raises(openai.BadRequestError) as e:
        chat(cl, long_text)
    assert str(n) in e.value.message and "4096" in e.value.message
    assert e.value.body["code"] == "context_length_exceeded"
    n = len(FakeTokenizer().encode_chat([{"role": "user", "content": "y" * 3000}], thinking_mode="thinking"))
    with pytest.raises(openai.BadRequestError) as e:
        chat(cl, "y" * 3000, max_tokens=2000)
    assert all(str(v) in e.value.message for v in (n, 2000, 4096))
    for bad in (
        {"temperature": "hot"},
        {"max_tokens": 0},
        {"top_p": 3},
        {"n": 0},
        {"n": 129},
        {"stop": 5},
        {"messages": "hi"},
        {"thinking": {"type": "maybe"}},
        {"reasoning_effort": "huge"},
        {"logprobs": "yes"},
        {"seed": 1.5},
        {"messages": [{"role": "wizard", "content": "x"}]},
    ):
        body = {"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "x"}], **bad}
        status, _, data = raw(server, "POST", "/v1/chat/completions", body)
        err = json.loads(data)["error"]
        assert status == 400 and set(err) == {"message", "type", "param", "code"}, (bad, data)
        assert err["type"] == "invalid_request_error"


def test_engine_error_mid_stream(server):
    cl = client(server)
    with pytest.raises(openai.InternalServerError):
        chat(cl, "explode", extra_body=NO_THINK)
    with pytest.raises(openai.APIError, match="exploded"):
        list(chat(cl, "explode", stream=True, extra_body=NO_THINK))
    with pytest.raises(openai.BadRequestError, match="refuses"):  # the engine's own PromptError is a 400
        chat(cl, "refuse", extra_body=NO_THINK)
    assert chat(cl, "fine", extra_body=NO_THINK).choices[0].message.content == "Echo: fine"


def test_logit_bias_is_validated(server):
    """`logit_bias` maps token ids (string keys) to biases in [-100, 100]; anything else is a 400 naming it, never
    silently ignored."""
    cl = client(server)
    many_digits = {"9" * 5000: 1}  # more digits than Python converts: this was a 500
    for bias in (
        "x",
        [1],
        {"a": 1},
        {"-1": 1},
        {"5": 101},
        {"5": "1"},
        {"5": True},
        {"5": None},
        {str(10**9): 1},
        many_digits,
    ):
        with pytest.raises(openai.BadRequestError) as ei:
            chat(cl, "hi", max_tokens=2, logit_bias=bias, extra_body=NO_THINK)
        assert ei.value.body["param"] == "logit_bias", bias
        status, _, body = raw(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": bias})
        assert status == 400 and json.loads(body)["error"]["param"] == "logit_bias", bias
    assert chat(cl, "hi", logit_bias={"5": -100, "6": 2.5}, extra_body=NO_THINK).choices[0].message.content


def test_penalties_are_validated_and_reach_the_sampling_params():
    body = {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5, "frequency_penalty": -1}
    sampling = openai_request.parse_chat_request({**body, "repetition_penalty": 1.2}, ("m",)).sampling
    assert (sampling["presence_penalty"], sampling["frequency_penalty"], sampling["repetition_penalty"]) == (
        0.5,
        -1,
        1.2,
    )
    for key, value in (("presence_penalty", 2.5), ("frequency_penalty", "1"), ("repetition_penalty", 0)):
        with pytest.raises(APIError) as ei:
            openai_request.parse_completion_request({"prompt": "hi", key: value}, ("m",))
        assert (ei.value.status, ei.value.param) == (400, key)


def test_malformed_requests(server):
    cases = [
        ("POST", "/v1/chat/completions", b"{not json", 400),
        ("POST", "/v1/chat/completions", b"[1, 2]", 400),
        ("POST", "/v1/chat/completions", b"\xff\xfe", 400),
        ("POST", "/v1/completions", {"prompt": 5}, 400),
        ("POST", "/v1/completions", {"prompt": ["a", ""]}, 400),
        ("POST", "/v1/completions", {"prompt": ["a", 5]}, 400),
        ("POST", "/v1/completions", {"prompt": "a", "n": 2, "best_of": 1}, 400),
        ("POST", "/v1/completions", {"prompt": "a", "best_of": 2, "stream": True}, 400),
        ("POST", "/v1/completions", {"prompt": [1, 10**9]}, 400),
        ("POST", "/detokenize", {"tokens": ["a"]}, 400),
        ("GET", "/v1/nothing", None, 404),
        ("GET", "/v1/chat/completions", None, 405),
    ]
    for method, path, body, want in cases:
        status, headers, data = raw(server, method, path, body)
        assert status == want, (path, body, data)
        assert headers["content-type"] == "application/json" and "error" in json.loads(data)


def test_body_size_limit():
    srv = start_server(max_body_bytes=1000)
    try:
        big = {"messages": [{"role": "user", "content": "x" * 2000}]}
        status, _, data = raw(srv, "POST", "/v1/chat/completions", big)
        assert status == 413 and json.loads(data)["error"]["code"] == "request_too_large"
        assert chat(client(srv), "small", extra_body=NO_THINK).choices[0].message.content == "Echo: small"
    finally:
        srv.shutdown()


# ---------------------------------------------------------------------------------------------------------
# Concurrency, cancellation, queueing, prefix reuse, keep-alive
# ---------------------------------------------------------------------------------------------------------


def test_concurrent_clients_get_what_they_get_alone():
    srv = start_server(FakeEngine(token_delay=0.001))
    try:
        cl = client(srv)
        jobs = [(f"alone {i}", i % 2 == 0, {"temperature": 1.0, "seed": i} if i % 3 == 0 else {}) for i in range(8)]

        def run(text, streamed, kw):
            if streamed:
                return stream_text(cl, text, extra_body=NO_THINK, **kw)[0]
            return chat(cl, text, extra_body=NO_THINK, **kw).choices[0].message.content

        alone = [run(*job) for job in jobs]
        results: dict[int, str] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(*jobs[i]))) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [results[i] for i in range(len(jobs))] == alone
    finally:
        srv.shutdown()


def test_disconnect_cancels_generation():
    engine = FakeEngine(token_delay=0.02)
    srv = start_server(engine)
    try:
        stream = chat(client(srv), "count", stream=True, extra_body=NO_THINK)
        for received, _ in enumerate(stream, 1):
            if received == 10:
                break
        at_close = engine.stats()["generated_tokens"]
        stream.close()  # drops the connection mid-stream
        deadline = time.monotonic() + 5
        while srv.host.num_running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not srv.host.num_running(), "generation still running after the client left"
        stats = engine.stats()
        generated = stats["generated_tokens"]
        # The server notices the closed socket on its next write or two; the worker then stops within a token.
        assert generated - at_close <= 3, (at_close, generated)  # not the 2000 the client asked for
        assert stats["tokens_after_cancel"] <= 1
        status, _, text = raw(srv, "GET", "/metrics")
        assert f"fastar:engine_generated_tokens {generated}" in text.decode()
        # the worker is free again
        assert chat(client(srv), "after", extra_body=NO_THINK).choices[0].message.content == "Echo: after"
    finally:
        srv.shutdown()


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "count"}], **NO_THINK}),
        ("/v1/completions", {"prompt": f"{USER}count{ASSISTANT}", "max_tokens": 3000, "n": 2}),
    ],
)
def test_a_non_streamed_client_that_leaves_while_tokens_flow_cancels_its_generation(path, body):
    """The client of a non-streamed request times out and closes its connection while the tokens come faster than
    the server's idle poll (every real decode rate): its generation is cancelled, not run on to max_tokens."""
    engine = FakeEngine(token_delay=0.01)  # a token every 10 ms: the reply's queue is never idle for 0.25 s
    srv = start_server(engine)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=0.6)
        conn.request(
            "POST",
            path,
            json.dumps({"model": "deepseek-v4-flash", "temperature": 0, **body}),
            {"Content-Type": "application/json"},
        )
        with pytest.raises(TimeoutError):
            conn.getresponse()  # (the whole count takes 20 s)
        conn.close()
        at_close = engine.stats()["generated_tokens"]
        deadline = time.monotonic() + 5
        while srv.host.num_running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not srv.host.num_running(), "the generation went on after its client left"
        assert engine.stats()["generated_tokens"] - at_close < 150 * (body.get("n") or 1)  # not the 2000 asked
        assert chat(client(srv), "after", extra_body=NO_THINK).choices[0].message.content == "Echo: after"
    finally:
        srv.shutdown()


def test_full_queue_is_503_and_waiting_client_that_leaves_is_skipped():
    engine = FakeEngine()
    engine.gate.clear()
    srv = start_server(engine, max_queue=2)
    try:
        cl = client(srv)
        results = {}

        def wait_queued(n: int) -> None:
            deadline = time.monotonic() + 5
            while srv.host.num_waiting() < n and time.monotonic() < deadline:
                time.sleep(0.01)
            assert srv.host.num_waiting() == n

        first = threading.Thread(target=lambda: results.setdefault("a", chat(cl, "first", extra_body=NO_THINK)))
        first.start()
        assert engine.started.acquire(timeout=5)  # the worker holds the first request
        leaver = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        leaver.request(
            "POST",
            "/v1/chat/completions",
            json.dumps({"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "I leave"}]}),
            {"Content-Type": "application/json"},
        )
        wait_queued(1)
        third = threading.Thread(target=lambda: results.setdefault("c", chat(cl, "third", extra_body=NO_THINK)))
        third.start()
        wait_queued(2)
        with pytest.raises(openai.InternalServerError) as e:  # the client's class for every 5xx
            chat(cl, "fourth", extra_body=NO_THINK)
        assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
        assert int(e.value.response.headers["retry-after"]) >= 1
        msg = {"model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        status, headers, data = raw(srv, "POST", "/v1/messages", msg)  # Anthropic's shape for the same refusal
        assert status == 503 and int(headers["retry-after"]) >= 1
        assert json.loads(data)["error"]["type"] == "overloaded_error"
        leaver.close()  # gone while it waits: it must never be generated
        time.sleep(0.5)
        engine.gate.set()
        first.join(10)
        third.join(10)
        assert results["a"].choices[0].message.content == "Echo: first"
        assert results["c"].choices[0].message.content == "Echo: third"
        assert engine.stats()["requests"] == 2
    finally:
        engine.gate.set()
        srv.shutdown()


def test_resent_conversation_reuses_the_common_prefix():
    engine = FakeEngine()
    srv = start_server(engine)
    try:
        cl = client(srv)
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first question"}]
        r1 = cl.chat.completions.create(model="deepseek-v4-flash", messages=msgs, extra_body=NO_THINK, temperature=0)
        other = [{"role": "user", "content": "an unrelated conversation"}]
        cl.chat.completions.create(model="deepseek-v4-flash", messages=other, extra_body=NO_THINK, temperature=0)
        msgs += [
            {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": "second question"},
        ]
        before = engine.stats()["prefill_tokens_computed"]
        r2 = cl.chat.completions.create(model="deepseek-v4-flash", messages=msgs, extra_body=NO_THINK, temperature=0)
        computed = engine.stats()["prefill_tokens_computed"] - before
        turn1 = r1.usage.prompt_tokens + r1.usage.completion_tokens  # prompt + reply + EOS, all in the session
        assert r2.usage.prompt_tokens_details.cached_tokens == turn1
        assert computed == r2.usage.prompt_tokens - turn1
        assert engine.sessions_opened == 2
    finally:
        srv.shutdown()


def test_keepalive_comments_during_long_prefill():
    srv = start_server(FakeEngine(prefill_delay=1.0), keepalive_interval=0.2)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(
                {
                    "model": "deepseek-v4-flash",
                    "stream": True,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": "x" * 500}],
                }
            ),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
        # meanwhile /metrics shows how far the prompt is
        deadline, seen = time.monotonic() + 5, None
        while seen is None and time.monotonic() < deadline:
            text = raw(srv, "GET", "/metrics")[2].decode()
            seen = re.search(r'^fastar:prefill_tokens_done\{slot="0"\} (\d+)$', text, re.M)
        assert seen, "no prefill progress in /metrics during the prefill"
        total = int(re.search(r'^fastar:prefill_tokens_total\{slot="0"\} (\d+)$', text, re.M).group(1))
        assert 0 <= int(seen.group(1)) < total and total > 500
        body = resp.read().decode()
        assert ": keep-alive" in body and body.endswith("data: [DONE]\n\n")
        assert re.search(r"^: keep-alive prefill \d+/\d+$", body, re.M)  # what the web UI's progress bar reads
        events = [json.loads(line[6:]) for line in body.split("\n") if line.startswith("data: {")]
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events).startswith("Echo: xxx")
    finally:
        srv.shutdown()


def test_health_while_loading_and_load_failure():
    release = threading.Event()

    def slow_factory(progress):
        progress(0.5)
        release.wait(10)
        return FakeEngine()

    srv = Server(slow_factory, port=0).start()
    try:
        status, _, data = raw(srv, "GET", "/health")
        body = json.loads(data)
        assert status == 503 and body["progress"] == 0.5 and body["error"]["code"] == "model_loading"
        status, _, data = raw(srv, "GET", "/v1/models")
        assert status == 503 and "50%" in json.loads(data)["error"]["message"]
        release.set()
        assert srv.wait_ready(10)
        assert raw(srv, "GET", "/health")[0] == 200
    finally:
        release.set()
        srv.shutdown()

    def broken_factory():
        raise OSError("model.fst: no such file")

    srv = Server(broken_factory, port=0).start()
    try:
        with pytest.raises(S.FastarError, match="no such file"):
            srv.wait_ready(10)
        status, _, data = raw(srv, "GET", "/health")
        assert status == 500 and "no such file" in json.loads(data)["error"]["message"]
    finally:
        srv.shutdown()


def test_a_failed_expert_warm_up_does_not_stop_the_server(caplog):
    """The warm-up only saves the first requests some reads: if starting it fails (an unreadable prompt cache
    folder, say), the server still serves, says so in the log, and /health reports the warm-up off."""

    class NoWarmUp(FakeEngine):
        def warm_experts(self, profile_dir=None) -> None:
            raise PermissionError(13, "Permission denied", "cache/hot-experts.json")

    srv = start_server(NoWarmUp())
    try:
        status, _, data = raw(srv, "GET", "/health")
        assert status == 200 and json.loads(data)["experts"] == {"status": "off"}
        assert chat(client(srv), "still served", extra_body=NO_THINK).choices[0].message.content
        assert any("warm" in r.getMessage() and "Permission denied" in r.getMessage() for r in caplog.records)
    finally:
        srv.shutdown()


def test_metrics(server):
    chat(client(server), "measure me", extra_body=NO_THINK)
    status, headers, data = raw(server, "GET", "/metrics")
    text = data.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in (
        "fastar:prompt_tokens_total",
        "fastar:generation_tokens_total",
        "fastar:generation_tokens_per_second",
        'fastar:time_to_first_token_seconds_bucket{le="+Inf"}',
        "fastar:engine_expert_cache_hits",
        "fastar:engine_expert_cache_misses",
        "fastar:engine_expert_cache_bytes_read",
        "fastar:num_requests_waiting",
        'fastar:request_success_total{finished_reason="stop"}',
    ):
        assert name in text, name
    sample = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-z_]+="[^"]*"\})? -?[0-9.e+]+$')
    for line in text.strip().split("\n"):
        assert line.startswith("# ") or sample.match(line), line


# ---------------------------------------------------------------------------------------------------------
# Static files, auth, CORS
# ---------------------------------------------------------------------------------------------------------


def test_static_files_and_traversal(tmp_path, monkeypatch):
    static = tmp_path / "static"
    static.mkdir()
    (static / "index.html").write_text("<h1>ui</h1>")
    (static / "app.js").write_text("let x = 1;")
    (tmp_path / "secret.txt").write_text("SECRET")
    (static / "link-out").symlink_to(tmp_path / "secret.txt")
    (static / "dir-out").symlink_to(tmp_path)
    monkeypatch.setattr(S, "STATIC_DIR", static)
    srv = start_server()
    try:
        status, headers, body = raw(srv, "GET", "/")
        assert status == 200 and body == b"<h1>ui</h1>" and headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in headers["content-security-policy"]
        status, headers, body = raw(srv, "GET", "/static/app.js")
        assert status == 200 and "javascript" in headers["content-type"]
        for path in (
            "/static/../secret.txt",
            "/static/%2e%2e/secret.txt",
            "/static/%2E%2E%2Fsecret.txt",
            "/static/%252e%252e%252fsecret.txt",
            "/static/..%2fsecret.txt",
            "/static/..%5csecret.txt",
            "/../secret.txt",
            "/static//etc/passwd",
            "/static/%2fetc%2fpasswd",
            "/static/link-out",
            "/static/dir-out/secret.txt",
            "/static/",
            "/static/./app.js",
            "/static/app.js%00.html",
            "/etc/passwd",
            "/static/C:%5cwindows",
            "/secret.txt",
            "/static/nope.js",
        ):
            status, _, body = raw(srv, "GET", path)
            assert status == 404 and b"SECRET" not in body, path
    finally:
        srv.shutdown()


def test_shipped_ui_is_served(server):
    status, _, body = raw(server, "GET", "/")
    assert status == 200 and b"<script" in body
    for name in re.findall(rb'(?:src|href)="(/static/[^"]+)"', body):
        assert raw(server, "GET", name.decode())[0] == 200, name


def test_api_key():
    srv = start_server(api_key="sekrit")
    try:
        assert raw(srv, "GET", "/health")[0] == 200
        for method, path in (
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
            ("POST", "/tokenize"),
            ("POST", "/v1/chat/completions"),
            ("GET", "/"),
        ):
            status, headers, data = raw(srv, method, path, {"prompt": "x"} if method == "POST" else None)
            assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key", path
            assert raw(srv, method, path, None, {"Authorization": "Bearer wrong"})[0] == 401
        assert headers["www-authenticate"].startswith("Basic")  # the UI: the browser asks for the key
        with pytest.raises(openai.AuthenticationError):
            client(srv, api_key="wrong").models.list()
        assert client(srv, api_key="sekrit").models.list().data[0].id == "deepseek-v4-flash"
        basic = base64.b64encode(b"user:sekrit").decode()
        assert raw(srv, "GET", "/", None, {"Authorization": f"Basic {basic}"})[0] == 200
        assert raw(srv, "GET", "/v1/models", None, {"Authorization": f"Basic {basic}"})[0] == 200
    finally:
        srv.shutdown()


def test_cors():
    srv = start_server(cors_origin="http://ui.example")
    try:
        _, headers, _ = raw(srv, "GET", "/v1/models", None, {"Origin": "http://ui.example"})
        assert headers["access-control-allow-origin"] == "http://ui.example"
        _, headers, _ = raw(srv, "GET", "/v1/models", None, {"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in headers
        preflight = {
            "Origin": "http://ui.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        status, headers, _ = raw(srv, "OPTIONS", "/v1/chat/completions", None, preflight)
        assert status == 204 and headers["access-control-allow-origin"] == "http://ui.example"
        assert {"POST", "DELETE"} <= set(headers["access-control-allow-methods"].split(", "))  # DELETE: Responses
        assert "authorization" in headers["access-control-allow-headers"].lower()
        status, headers, _ = raw(
            srv, "OPTIONS", "/v1/chat/completions", None, {**preflight, "Origin": "http://evil.example"}
        )
        assert status == 403 and "access-control-allow-origin" not in headers
    finally:
        srv.shutdown()
    srv = start_server()
    try:
        _, headers, _ = raw(srv, "GET", "/v1/models", None, {"Origin": "http://ui.example"})
        assert "access-control-allow-origin" not in headers
    finally:
        srv.shutdown()


# ---------------------------------------------------------------------------------------------------------
# Units: stop filter, request parsing, CLI glue, no torch
# ---------------------------------------------------------------------------------------------------------


def test_stop_filter_holds_back_partial_stops():
    rng = random.Random(0)
    text = "the cat sat on the mat; the end"
    for stops, want in (
        (["sat on"], "the cat "),
        (["the end", "mat"], "the cat sat on the "),
        (["zzz"], text),
        (["t;", "at;"], "the cat sat on the m"),
    ):
        for _ in range(50):
            cuts = sorted(rng.sample(range(1, len(text)), 6))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            f = choice_turn.StopFilter(stops)
            out = []
            for p in pieces:
                got = f.feed(p)
                out.append(got)
                assert not any(s in "".join(out) for s in stops)
            assert "".join(out) + f.flush() == want


def test_parse_thinking_precedence():
    names = ("deepseek-v4-flash",)
    base = {"messages": [{"role": "user", "content": "x"}]}
    assert openai_request.parse_chat_request(base, names).thinking is True
    assert openai_request.parse_chat_request(base, names, default_thinking=False).thinking is False
    r = openai_request.parse_chat_request({**base, "reasoning_effort": "max"}, names)
    assert (r.thinking, r.reasoning_effort) == (True, "max")
    r = openai_request.parse_chat_request({**base, "reasoning_effort": "none", "thinking": {"type": "enabled"}}, names)
    assert r.thinking is True
    r = openai_request.parse_chat_request(
        {**base, "chat_template_kwargs": {"thinking": True, "drop_thinking": False}, "thinking": {"type": "disabled"}},
        names,
    )
    assert (r.thinking, r.drop_thinking, r.reasoning_effort) == (False, False, None)
    r = openai_request.parse_chat_request({**base, "tools": [WEATHER_TOOL]}, names)
    assert r.messages[0] == {"role": "system", "content": "", "tools": [WEATHER_TOOL]} and r.has_tools


def test_thinking_budgets_and_the_reasoning_default():
    """Where a request's thinking budget comes from (chat completions): DeepSeek's/Anthropic's `thinking` object
    with `budget_tokens` (below max_tokens), else the effort (low 1,024, medium 8,192, none for high and max);
    vLLM's `chat_template_kwargs` switch thinking off as `enable_thinking` or `thinking`; the server's default mode
    applies where the request chooses none."""
    names = ("deepseek-v4-flash",)
    base = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100}

    def parsed(extra: dict, *default) -> tuple:
        r = openai_request.parse_chat_request({**base, **extra}, names, *default)
        return r.thinking, r.reasoning_effort, r.sampling["thinking_budget"]

    assert parsed({"thinking": {"type": "enabled", "budget_tokens": 40}}) == (True, None, 40)
    assert parsed({"reasoning_effort": "low"}) == (True, "low", 1024)
    assert parsed({"reasoning_effort": "minimal"}) == (True, "low", 1024)
    assert parsed({"reasoning_effort": "medium"}) == (True, "medium", 8192)
    assert parsed({"reasoning_effort": "high"}) == (True, "high", None)
    assert parsed({"reasoning_effort": "max"}) == (True, "max", None)
    assert parsed({"reasoning_effort": "none"}) == (False, None, None)
    assert parsed({"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"}) == (
        False,
        None,
        None,
    )
    assert parsed({"chat_template_kwargs": {"thinking": False}}) == (False, None, None)
    assert parsed({}, False, None) == (False, None, None)  # --reasoning-default none
    assert parsed({}, True, "max") == (True, "max", None)  # --reasoning-default max
    assert parsed({}, True, "low") == (True, "low", 1024)
    assert parsed({"reasoning_effort": "high"}, True, "low") == (True, "high", None)  # the request's choice wins
    assert parsed({"thinking": {"type": "enabled"}}, False, None) == (True, None, None)
    for bad in (100, 101, -1, "many"):
        with pytest.raises(APIError) as err:
            parsed({"thinking": {"type": "enabled", "budget_tokens": bad}})
        assert err.value.status == 400 and err.value.param == "thinking.budget_tokens"
    assert thinking_mode.REASONING_DEFAULTS["thinking"] == (True, None) and thinking_mode.REASONING_DEFAULTS[
        "none"
    ] == (False, None)
    with pytest.raises(ValueError, match="reasoning_default"):
        Server(lambda: None, reasoning_default="sometimes")


def test_reasoning_default_flag_and_its_environment_mirror(monkeypatch):
    from fastar import cli

    seen = {}
    monkeypatch.setattr(S, "serve", lambda factory, **kw: seen.update(kw) or 0)
    monkeypatch.setenv("FASTAR_REASONING_DEFAULT", "max")
    args = cli.build_parser().parse_args(["serve", "-m", "x.fst"])
    S.run_from_args(args, lambda: None)
    assert seen["reasoning_default"] == "max"
    args = cli.build_parser().parse_args(["serve", "-m", "x.fst", "--reasoning-default", "none"])  # the flag wins
    S.run_from_args(args, lambda: None)
    assert seen["reasoning_default"] == "none"


def test_a_server_whose_default_is_no_thinking_answers_at_once():
    srv = start_server(reasoning_default="none")
    try:
        kw = dict(model="deepseek-v4-flash", messages=[{"role": "user", "content": "hi"}], temperature=0)
        r = client(srv).chat.completions.create(**kw)
        assert r.choices[0].message.content == "Echo: hi"
        assert r.choices[0].message.model_dump().get("reasoning_content") is None
        on = client(srv).chat.completions.create(reasoning_effort="high", **kw)
        assert on.choices[0].message.model_dump()["reasoning_content"] == "Thinking about hi."
    finally:
        srv.shutdown()


def test_cli_arguments_delegate_to_serve(monkeypatch):
    import argparse

    parser = argparse.ArgumentParser()
    S.add_arguments(parser)
    args = parser.parse_args(
        [
            "--port",
            "9000",
            "--api-key",
            "k",
            "--reasoning-field",
            "reasoning",
            "--max-queue",
            "3",
            "--cors-origin",
            "http://a",
            "--reasoning-default",
            "none",
        ]
    )
    seen = {}
    monkeypatch.setattr(S, "serve", lambda factory, **kw: seen.update(kw) or 0)
    assert S.run_from_args(args, lambda: None) == 0
    assert seen == {
        "host": "127.0.0.1",
        "port": 9000,
        "api_key": "k",
        "cors_origin": "http://a",
        "served_model_name": "deepseek-v4-flash",
        "max_queue": 3,
        "reasoning_field": "reasoning",
        "reasoning_default": "none",
        "max_sessions": 4,
        "allowed_hosts": None,
        "max_connections": 4096,
        "max_batch": 8,
        "prompt_cache": S.default_prompt_cache(),
        "prompt_cache_size": 20 << 30,
        "prefill_share": 0.5,
        "max_stall": 1.0,
    }


def test_batching_and_prompt_cache_flags(monkeypatch, capsys, tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    S.add_arguments(parser)
    seen = {}
    monkeypatch.setattr(S, "serve", lambda factory, **kw: seen.update(kw) or 0)
    pc = str(tmp_path / "pc")  # made before the server starts
    args = ["--max-batch", "4", "--prompt-cache", pc, "--prompt-cache-size", "1.5G", "--prefill-share", "0.25"]
    S.run_from_args(parser.parse_args([*args, "--max-stall", "0.3"]), lambda: None)
    assert (seen["max_batch"], seen["prompt_cache"], seen["prompt_cache_size"]) == (4, pc, 3 << 29)
    assert seen["prefill_share"] == 0.25 and seen["max_stall"] == 0.3
    assert (tmp_path / "pc").is_dir()
    S.run_from_args(parser.parse_args(["--no-prompt-cache"]), lambda: None)
    assert seen["prompt_cache"] is None and seen["prefill_share"] == 0.5 and seen["max_stall"] == 1.0
    assert S.default_prompt_cache().endswith("prompt-cache")
    bad_shares = [["--prefill-share", v] for v in ("0", "1.5", "nan", "-1", "half")]
    bad_stalls = [["--max-stall", v] for v in ("0", "-1", "nan", "inf", "abc")]
    for bad in (
        ["--prompt-cache-size", "lots"],
        ["--prompt-cache-size", "0"],
        ["--max-batch", "0"],
        *bad_shares,
        *bad_stalls,
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
        err = capsys.readouterr().err
        assert f"argument {bad[0]}" in err and "Traceback" not in err


def test_server_modules_do_not_import_torch():
    code = (
        "import sys, fastar; pre = 'torch' in sys.modules; import fastar.serve.server; "
        "print(pre, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    ).stdout.split()
    if out[0] == "True":
        pytest.skip("the fastar package itself imports torch")
    assert out[1] == "False", "importing fastar.serve.server pulled in torch"


def test_over_context_error_says_why_the_context_is_short():
    from fastar.serve.api_error import APIError

    note = "m.fst has no lightning-indexer weights: write m.fst.indexer with fastar convert"
    with pytest.raises(APIError) as e:
        fields.resolve_max_tokens(3000, None, 2051, note)
    assert "2051" in str(e.value.message) and note in str(e.value.message)
    assert fields.resolve_max_tokens(100, None, 2051, note) == 1951


def _sse_events(data: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in data.decode().split("\n") if line.startswith("data: {")]


def test_include_usage_puts_a_null_usage_on_every_other_chunk(server):
    """With `stream_options.include_usage` OpenAI's reference has every chunk but the last carry `"usage": null`
    (clients that read `chunk["usage"]` without a default rely on it); the chunks used to leave the key out."""
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **NO_THINK}),
        ("/v1/completions", {"prompt": "Hello"}),
    ):
        body = {"model": "deepseek-v4-flash", "stream": True, "temperature": 0, "n": 2, **body}
        status, _, data = raw(server, "POST", path, {**body, "stream_options": {"include_usage": True}})
        events = _sse_events(data)
        assert status == 200 and len(events) > 3
        assert all("usage" in e and e["usage"] is None for e in events[:-1]), path
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
        status, _, data = raw(server, "POST", path, body)  # without it, no usage at all
        assert status == 200 and not any("usage" in e for e in _sse_events(data))


def test_min_tokens_reaches_the_engine_and_holds_off_stop_strings(server):
    """vLLM's `min_tokens`: the engine gets it in its `SamplingParams`, and a stop string within the first
    `min_tokens` tokens does not cut the reply (the scripted engine's tokens are characters); a bad value, or one
    above `max_tokens`, is a 400 naming it; with no `max_tokens` it counts up to the limit the request gets."""
    seen = []
    stream = server.engine.stream
    server.engine.stream = lambda ids, params, *a, **kw: seen.append(params) or stream(ids, params, *a, **kw)
    try:
        # (the stop string ends at token 13 of the chat reply, at token 2 of the completion)
        for path, body, text, least in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "stop me here"}], **NO_THINK}, None, 13),
            ("/v1/completions", {"prompt": "Hello"}, "text", 2),
        ):
            body = {"model": "deepseek-v4-flash", "max_tokens": 40, "temperature": 0, "stop": ["me", "Ec"], **body}

            def reply(extra):
                status, _, data = raw(server, "POST", path, {**body, **extra})
                assert status == 200, data
                choice = json.loads(data)["choices"][0]
                return choice["text"] if text else choice["message"]["content"]

            assert reply({}) in ("Echo: stop ", "")
            assert seen[-1].min_tokens == 0
            full = reply({"min_tokens": least})
            assert full in ("Echo: stop me here", "Echo: Hello") and seen[-1].min_tokens == least
            for bad, words in ((-1, "at least 0"), ("3", "an integer"), (41, "'max_tokens' (40)")):
                status, _, data = raw(server, "POST", path, {**body, "min_tokens": bad})
                err = json.loads(data)["error"]
                assert status == 400 and err["param"] == "min_tokens" and words in err["message"], (path, bad)
            status, _, data = raw(
                server, "POST", path, {**{k: v for k, v in body.items() if k != "max_tokens"}, "min_tokens": 100000}
            )
            assert status == 200 and seen[-1].min_tokens == seen[-1].max_tokens, data
    finally:
        server.engine.stream = stream


def test_a_stop_string_spanning_the_min_tokens_boundary_cuts_the_reply_and_never_streams_its_start(server):
    """vLLM matches a stop string that starts within the first `min_tokens` tokens and ends after them; the text it
    starts with was held back, so no streamed delta carries it (several choices, thinking on or off)."""
    cl = client(server)
    for thinking, reasoning, content in (
        (False, "", "Echo: stop "),  # "me" is tokens 12-13 of "Echo: stop me here"
        (True, "Thinking about stop me here.", "Echo: stop "),  # the reasoning's "me" is no match (the answer's only)
    ):
        # the "m" is the last of the first min_tokens tokens (after the reasoning and its `</think>`, one token)
        least = (len(reasoning) + 1 if thinking else 0) + len(content) + 1
        kw = dict(stop=["me"], n=2, max_tokens=60, extra_body={"min_tokens": least})
        if not thinking:
            kw["extra_body"] |= NO_THINK
        whole = chat(cl, "stop me here", **kw)
        assert [(c.message.content, c.finish_reason) for c in whole.choices] == [(content, "stop")] * 2
        assert [getattr(c.message, "reasoning_content", None) or "" for c in whole.choices] == [reasoning] * 2
        chunks = list(chat(cl, "stop me here", stream=True, **kw))
        for i in range(2):
            deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == i]
            assert "".join(d.content or "" for d in deltas) == content
            assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
        wholly_within = chat(cl, "stop me here", **{**kw, "extra_body": {**kw["extra_body"], "min_tokens": least + 1}})
        assert wholly_within.choices[0].finish_reason in ("stop", "length")  # "me" wholly within: kept
        assert "stop me" in (wholly_within.choices[0].message.content or "") + (
            getattr(wholly_within.choices[0].message, "reasoning_content", None) or ""
        )
    text = raw(
        server,
        "POST",
        "/v1/completions",
        {
            "model": "deepseek-v4-flash",
            "prompt": "Hello",
            "max_tokens": 20,
            "temperature": 0,
            "stop": ["ho"],
            "min_tokens": 3,
        },
    )
    assert json.loads(text[2])["choices"][0]["text"] == "Ec"  # "ho" of "Echo: Hello" is tokens 3-4: cut


def test_stop_strings_match_the_answer_not_the_reasoning(server):
    """With thinking on, stop strings apply to the answer: one the reasoning holds ("about") does not end the reply,
    nor one across the end of the reasoning ("k>Echo", `</think>` included), and one in both ("stop me") cuts the
    answer, not the reasoning; streamed or not, each of several choices, chat completions and Messages alike.
    (The scripted thinking reply: "Thinking about stop me here.</think>Echo: stop me here".)"""
    cl = client(server)
    reasoning = "Thinking about stop me here."
    for stops in (["about"], ["k>Echo"]):
        whole = chat(cl, "stop me here", stop=stops, n=2, max_tokens=80)
        assert [(c.message.content, c.finish_reason) for c in whole.choices] == [("Echo: stop me here", "stop")] * 2
        assert [c.message.reasoning_content for c in whole.choices] == [reasoning] * 2
    whole = chat(cl, "stop me here", stop=["stop me"], n=2, max_tokens=80)
    assert [(c.message.content, c.finish_reason) for c in whole.choices] == [("Echo: ", "stop")] * 2
    assert [c.message.reasoning_content for c in whole.choices] == [reasoning] * 2
    chunks = list(chat(cl, "stop me here", stop=["stop me"], n=2, max_tokens=80, stream=True))
    for i in range(2):
        deltas = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(d.delta.content or "" for d in deltas) == "Echo: "
        assert "".join(getattr(d.delta, "reasoning_content", None) or "" for d in deltas) == reasoning
        assert deltas[-1].finish_reason == "stop"
    body = {
        "model": "x",
        "max_tokens": 80,
        "temperature": 0,
        "thinking": {"type": "enabled", "budget_tokens": 64},
        "messages": [{"role": "user", "content": "stop me here"}],
    }
    for stops, text, reason, hit in (
        (["about"], "Echo: stop me here", "end_turn", None),
        (["stop me"], "Echo: ", "stop_sequence", "stop me"),
    ):
        status, _, data = raw(server, "POST", "/v1/messages", {**body, "stop_sequences": stops})
        msg = json.loads(data)
        assert status == 200 and [b["type"] for b in msg["content"]] == ["thinking", "text"], data
        assert msg["content"][0]["thinking"] == reasoning and msg["content"][1]["text"] == text
        assert (msg["stop_reason"], msg["stop_sequence"]) == (reason, hit)
        status, _, data = raw(server, "POST", "/v1/messages", {**body, "stop_sequences": stops, "stream": True})
        events = [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: ")]
        deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
        assert "".join(d.get("thinking", "") for d in deltas) == reasoning
        assert "".join(d.get("text", "") for d in deltas) == text
        end = next(e for e in events if e["type"] == "message_delta")["delta"]
        assert (end["stop_reason"], end["stop_sequence"]) == (reason, hit)


def test_stream_options_without_stream_is_a_400(server):
    """`stream_options` asks for something only a stream has (`include_usage`): on a request that does not stream
    it is a 400 naming it, as OpenAI and vLLM answer, where it was silently ignored. `null` stays accepted."""
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "so"}], **NO_THINK}),
        ("/v1/completions", {"prompt": "Hello"}),
    ):
        body = {"model": "deepseek-v4-flash", "max_tokens": 2, **body}
        for stream in ({}, {"stream": False}):
            status, _, data = raw(server, "POST", path, {**body, **stream, "stream_options": {"include_usage": True}})
            err = json.loads(data)["error"]
            assert status == 400 and err["param"] == "stream_options" and "'stream'" in err["message"], (path, stream)
        status, _, _ = raw(server, "POST", path, {**body, "stream_options": None})
        assert status == 200, path


def test_top_logprobs_without_logprobs_is_a_400(server):
    """`top_logprobs` needs `logprobs: true` (OpenAI's reference; vLLM refuses it too): the request used to
    succeed with no logprobs at all, the client's mistake hidden. 0 asks for nothing and stays accepted."""
    body = {"messages": [{"role": "user", "content": "lp"}], "max_tokens": 3, **NO_THINK}
    for extra in ({"top_logprobs": 2}, {"top_logprobs": 2, "logprobs": False}):
        status, _, data = raw(server, "POST", "/v1/chat/completions", {**body, **extra})
        err = json.loads(data)["error"]
        assert status == 400 and err["param"] == "top_logprobs" and "'logprobs'" in err["message"], extra
    status, _, data = raw(server, "POST", "/v1/chat/completions", {**body, "top_logprobs": 0})
    assert status == 200 and json.loads(data)["choices"][0]["logprobs"] is None
    status, _, data = raw(server, "POST", "/v1/chat/completions", {**body, "top_logprobs": 2, "logprobs": True})
    assert status == 200 and len(json.loads(data)["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


def test_values_and_names_a_client_sent_are_quoted_short_and_on_one_line_in_errors():
    """Found by tests/test_fuzz_server.py: an error quoted the client's value whole (a 1 MB list came back in the
    message) and a model name or an object key holding a newline made a message of two lines."""
    for call in (
        lambda: fields.integer({"max_tokens": ["x" * 100] * 10_000}, "max_tokens", 1, None, None),
        lambda: fields.number({"temperature": "9" * 100_000}, "temperature", 0, 2, 1.0),
        lambda: fields.boolean({"stream": {"k": "v" * 100_000}}, "stream", False),
        lambda: thinking_mode.choose({"reasoning_effort": "x" * 100_000}, False),
    ):
        with pytest.raises(APIError) as err:
            call()
        assert err.value.status == 400 and len(err.value.message) < 200 and "..." in err.value.message
    with pytest.raises(APIError) as err:
        fields.check_model({"model": "evil\nmodel"}, ("deepseek-v4-flash",))
    assert err.value.status == 404 and "'evil\\nmodel'" in err.value.message
    with pytest.raises(APIError) as err:
        parse_json(b'{"a\\nb": "\\ud800"}')
    assert err.value.status == 400 and "\n" not in err.value.message and "'a\\nb'" in err.value.message


def test_a_chat_template_kwargs_flag_of_the_wrong_type_is_named_in_full():
    """`chat_template_kwargs: {"thinking": "yes"}` was a 400 blaming a top-level `'thinking'` (param `thinking`), a
    field the request did not send; it names `chat_template_kwargs.thinking` now (found by the fuzz tests)."""
    for key in ("thinking", "enable_thinking", "drop_thinking"):
        with pytest.raises(APIError) as err:
            thinking_mode.choose({"chat_template_kwargs": {key: "yes"}}, True)
        assert (err.value.status, err.value.param) == (400, f"chat_template_kwargs.{key}")
        assert f"'chat_template_kwargs.{key}' must be true or false" in err.value.message
    assert thinking_mode.choose({"chat_template_kwargs": {"thinking": False, "drop_thinking": None}}, True) == (
        False,
        None,
        True,
    )


# ---------------------------------------------------------------------------------------------------------
# Text files as content parts (fastar.serve.documents)
# ---------------------------------------------------------------------------------------------------------


def data_url(text: str, media: str = "text/plain") -> str:
    """`text` as the base64 data URL an OpenAI client puts in a file part's `file_data`."""
    return f"data:{media};base64," + base64.b64encode(text.encode()).decode()


def test_chat_text_file_parts_reach_the_engine_rendered_and_tokenize_counts_them(server):
    """A user message's `file` part holding a text data URL reaches the engine as the rendered document (the
    filename as its title), joined to the message's text parts with a newline; `/tokenize` counts the prompt the
    route runs, the same as the message sent as plain text."""
    file = {"type": "file", "file": {"filename": "notes.txt", "file_data": data_url("line one\nline two")}}
    expected = "<document>\n<title>notes.txt</title>\n<content>\nline one\nline two\n</content>\n</document>"
    messages = [{"role": "user", "content": [file, {"type": "text", "text": "Summarize it."}]}]
    reply = client(server).chat.completions.create(
        model="deepseek-v4-flash", messages=messages, temperature=0, extra_body=NO_THINK
    )
    assert reply.choices[0].message.content == f"Echo: {expected}\nSummarize it."
    plain = [{"role": "user", "content": f"{expected}\nSummarize it."}]
    counts = [json.loads(raw(server, "POST", "/tokenize", {"messages": m, **NO_THINK})[2]) for m in (messages, plain)]
    assert counts[0]["tokens"] == counts[1]["tokens"] and counts[0]["count"] == reply.usage.prompt_tokens


def test_chat_file_parts_the_model_cannot_read_are_a_400_naming_the_part(server):
    """By `file_id`, of a type that is not text, not a data URL, not UTF-8, or no `file` object: a one-line 400
    naming `messages[i].content[j]`, on the generating route and on `/tokenize` alike."""
    cases = [
        ({"file": {"file_id": "file-abc"}}, "no Files API"),
        ({"file": {"file_data": data_url("%PDF-1.4", "application/pdf")}}, '"application/pdf" is not read'),
        ({"file": {"file_data": "aGVsbG8="}}, "must be a data URL"),
        ({"file": {"file_data": "data:text/plain;base64,/w=="}}, "not UTF-8 text (byte 0xff at offset 0)"),
        ({"file": "notes.txt"}, "must be an object"),
    ]
    for part, words in cases:
        messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "file", **part}]}]
        for path in ("/v1/chat/completions", "/tokenize"):
            status, _, data = raw(server, "POST", path, {"model": "deepseek-v4-flash", "messages": messages})
            error = json.loads(data)["error"]
            assert status == 400 and error["message"].startswith("messages[0].content[1].file"), (path, error)
            assert words in error["message"] and "\n" not in error["message"], error


def test_a_chat_file_part_outside_a_user_message_is_a_400_saying_files_are_read_in_user_messages(server):
    """A `file` part in a system or assistant message (a readable text file) is a one-line 400 naming the message
    and part and saying files are read only in user messages, not the encoder's generic "reads text only"."""
    file = {"type": "file", "file": {"filename": "notes.txt", "file_data": data_url("line one")}}
    for k, role in enumerate(("system", "assistant")):
        messages = [{"role": "user", "content": "hi"}] * (k + 1) + [
            {"role": role, "content": [{"type": "text", "text": "x"}, file]},
            {"role": "user", "content": "go on"},
        ]
        for path in ("/v1/chat/completions", "/tokenize"):
            status, _, data = raw(server, "POST", path, {"model": "deepseek-v4-flash", "messages": messages})
            message = json.loads(data)["error"]["message"]
            assert status == 400 and message.startswith(f"messages[{k + 1}].content[1]"), (path, message)
            assert f'"{role}" message' in message and "only in user messages" in message, message
            assert "reads text only" not in message and "\n" not in message, message


def test_a_file_is_measured_decoded_by_the_prompt_guard_and_its_encoding_by_the_body_limit():
    """The prompt-length guard (context x longest token, before tokenizing) counts a file's decoded text, as it
    counts the rest of the rendered prompt; the data URL itself is bounded by the body limit, and its decoded
    text is never longer than it (base64 decodes to 3/4 of its length, a percent-encoded URL to at most its own)."""
    engine = FakeEngine(context_length=64)
    srv = start_server(engine, max_body_bytes=4000)
    try:
        over = 64 * engine.tokenizer.max_token_bytes() + 1
        assert over < 2000
        fits = {"type": "file", "file": {"file_data": data_url("a" * 2000)}}  # 2,668 base64 characters: in the body
        status, _, data = raw(srv, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [fits]}]})
        error = json.loads(data)["error"]
        assert status == 400 and error["code"] == "context_length_exceeded" and "characters" in error["message"]
        encoded = {"type": "file", "file": {"file_data": data_url("a" * 3000)}}  # 4,000 base64 characters
        status, _, data = raw(
            srv, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [encoded]}]}
        )
        assert status == 413 and json.loads(data)["error"]["code"] == "request_too_large"
    finally:
        srv.shutdown()


def test_serve_logs_the_prompt_cache_cap_in_gib(tmp_path, caplog):
    """`fastar serve` names its prompt cache's size cap as a size (it logged `up to 21474836480`)."""

    def broken_factory():
        raise OSError("model.fst: no such file")

    caplog.set_level("INFO")
    with pytest.raises(S.FastarError, match="no such file"):
        S.serve(broken_factory, port=0, prompt_cache=str(tmp_path), prompt_cache_size=20 << 30)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prompt cache: ")]
    assert lines == [f"prompt cache: {tmp_path} (up to 20.0 GiB)"]
