"""The Anthropic Messages and OpenAI Responses front-ends over the real engine (the vocab-size random model,
real DeepSeek-V4 tokenizer), through the official clients: what the fake-engine tests assume holds for real.

The random model samples token sequences the tokenizer would not produce from their text, so resending a reply
re-tokenizes it differently; the replay cache must still give the follow-up the whole previous conversation as
cached tokens, in each API shape: all of it but the last sampled token, which was appended to the session and
never run through the model (the follow-up's prefill starts with it).
"""

from __future__ import annotations

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import types  # noqa: E402 (after the importorskip guards)

from serial_scheduler import SchedulesSerially  # noqa: E402 (after the importorskip guards)
from test_agents_api import API_KEY, App  # noqa: E402 (after the importorskip guards)

from fastar.convert.hf import convert  # noqa: E402 (after the importorskip guards)
from fastar.engine.engine import load  # noqa: E402 (after the importorskip guards)
from fastar.engine.generate import GenerationChunk  # noqa: E402 (after the importorskip guards)
from fastar.engine.tokenizer import Tokenizer  # noqa: E402 (after the importorskip guards)
from fastar.serve.metrics import Metrics  # noqa: E402 (after the importorskip guards)
from fastar.serve.turn import Backend, Conversation, prompt_ids  # noqa: E402 (after the importorskip guards)
from fastar.serve.worker import Batching, EngineHost  # noqa: E402

NO_THINK = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def app(vocab_ckpt, tmp_path_factory):
    fst = convert(vocab_ckpt, tmp_path_factory.mktemp("agents") / "m.fst", progress=False)
    engines = []

    def factory():
        engine = load(fst)
        engine.context_length = 512
        engines.append(engine)
        return engine

    host = EngineHost(factory, Batching(max_queue=4, keep_states=2), metrics=Metrics())
    host.start(on_ready=lambda e: None)
    assert host.wait_ready(120)
    served = App(Backend(engine=host.require_engine, submit=host.submit, metrics=host.metrics))
    yield served, engines[0]
    served.close()
    host.shutdown()


def test_messages_on_the_real_engine_reuse_the_whole_conversation(app):
    served, engine = app
    cl = anthropic.Anthropic(base_url=served.url, api_key=API_KEY, max_retries=0)
    first_msgs = [{"role": "user", "content": "Name three colours."}]
    kw = {"model": "deepseek-v4-flash", "max_tokens": 8, "extra_body": {"temperature": 0, **NO_THINK}}
    first = cl.messages.create(messages=first_msgs, **kw)
    assert first.stop_reason == "max_tokens" and first.usage.output_tokens == 8
    with cl.messages.stream(messages=first_msgs, **kw) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == first.content[0].text
    direct = engine.chat(first_msgs, thinking=False, max_tokens=8, temperature=0)
    assert str(direct) == first.content[0].text
    prior = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens

    follow = first_msgs + [
        {"role": "assistant", "content": first.content[0].text},
        {"role": "user", "content": "And two more?"},
    ]
    count = cl.messages.count_tokens(model="deepseek-v4-flash", messages=follow, **NO_THINK)
    second = cl.messages.create(messages=follow, **kw)
    assert second.usage.cache_read_input_tokens == prior - 1  # the last sampled token has no KV yet
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == count.input_tokens


def test_responses_on_the_real_engine_continue_by_id(app):
    served, _ = app
    cl = openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0)
    kw = {"model": "deepseek-v4-flash", "max_output_tokens": 6, "temperature": 0, "reasoning": {"effort": "none"}}
    first = cl.responses.create(input="Tell me about foxes.", **kw)
    assert first.status == "incomplete" and first.usage.output_tokens == 6
    # a stream cut at max_output_tokens ends with `response.incomplete` (the SDK's stream helper waits for a
    # `response.completed` only, so the raw events are read)
    events = list(cl.responses.create(input="Tell me about foxes.", stream=True, **kw))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == first.output_text
    second = cl.responses.create(previous_response_id=first.id, input="Go on.", **kw)
    prior = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens == prior - 1


class ScriptedEngine(SchedulesSerially):
    """The real V4 tokenizer and a scripted model: it answers with token ids the tokenizer would not produce
    from their text ("Hel" + "lo" + " world"), then EOS; its sessions keep their tokens and report the cached
    prefix, as the engine does."""

    model_name_default, context_length, context_note = "deepseek-v4-flash", 4096, None  # a `ServedEngine`

    def __init__(self) -> None:
        self.tokenizer = Tokenizer.default()
        tok = self.tokenizer
        self.reply = tok.encode("Hel") + tok.encode("lo") + tok.encode(" world") + [tok.eos_id]

    def close(self) -> None:  # the Engine contract the server's worker calls on shutdown
        pass

    def open_session(self):
        return types.SimpleNamespace(tokens=[])

    def stream(self, prompt_ids, params, session=None, cancel=None, on_prefill_progress=None):
        common = 0
        while common < min(len(session.tokens), len(prompt_ids)) and session.tokens[common] == prompt_ids[common]:
            common += 1
        session.tokens = list(prompt_ids)
        for i, tid in enumerate(self.reply):
            session.tokens.append(tid)
            last = i == len(self.reply) - 1
            yield GenerationChunk(
                self.tokenizer.decode([tid]),
                tid,
                finish_reason="stop" if last else None,
                usage={"cached_tokens": common} if last else None,
            )


def test_non_canonical_replies_replay_exactly_in_every_api_shape():
    engine = ScriptedEngine()
    tok = engine.tokenizer
    assert tok.encode(tok.decode(engine.reply[:-1])) != engine.reply[:-1]  # the point of the test
    host = EngineHost(lambda: engine, Batching(max_queue=4, keep_states=2), metrics=Metrics())
    host.start(on_ready=lambda e: None)
    assert host.wait_ready(10)
    served = App(Backend(engine=host.require_engine, submit=host.submit, metrics=host.metrics))
    try:
        backend = served.backend
        cl = anthropic.Anthropic(base_url=served.url, api_key=API_KEY, max_retries=0)
        msgs = [{"role": "user", "content": "Say hello."}]
        first = cl.messages.create(model="x", max_tokens=50, messages=msgs, **NO_THINK)
        assert first.content[0].text == "Hello world" and first.stop_reason == "end_turn"
        prefix = prompt_ids(backend, Conversation(msgs, thinking=False))[1] + engine.reply
        assert first.usage.input_tokens + first.usage.output_tokens == len(prefix)

        # OpenAI chat completions shape, tokenized through the same Backend (as the chat route will be)
        chat = msgs + [{"role": "assistant", "content": "Hello world"}, {"role": "user", "content": "Again"}]
        ids = prompt_ids(backend, Conversation(chat, thinking=False))[1]
        assert ids[: len(prefix)] == prefix
        assert tok.encode(Conversation(chat, thinking=False).render())[: len(prefix)] != prefix  # without replay

        # Anthropic: the follow-up reports the whole previous conversation as cached
        follow = msgs + [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "Again"}]
        second = cl.messages.create(model="x", max_tokens=50, messages=follow, **NO_THINK)
        assert second.usage.cache_read_input_tokens == len(prefix)

        # Responses, by previous_response_id and by resending the items
        oc = openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0)
        r1 = oc.responses.create(model="deepseek-v4-flash", input="Say hi.", reasoning={"effort": "none"})
        prefix = prompt_ids(backend, Conversation([{"role": "user", "content": "Say hi."}], False))[1] + engine.reply
        r2 = oc.responses.create(
            model="deepseek-v4-flash", input="Again", previous_response_id=r1.id, reasoning={"effort": "none"}
        )
        assert r2.usage.input_tokens_details.cached_tokens == len(prefix)
        items = [
            {"role": "user", "content": "Say hi."},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": r1.output_text}]},
            {"role": "user", "content": "Once more"},
        ]
        r3 = oc.responses.create(model="deepseek-v4-flash", input=items, reasoning={"effort": "none"})
        # (the session that continued r1 also holds the next "<｜User｜>" token: at least the prefix)
        assert r3.usage.input_tokens_details.cached_tokens >= len(prefix)
    finally:
        served.close()
        host.shutdown()
