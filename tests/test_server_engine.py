"""The server over the real engine (vocab-size random model): what the fake-engine tests assume holds for real."""

from __future__ import annotations

import threading

import pytest
from polling import wait_until

openai = pytest.importorskip("openai")

from fastar.convert.hf import convert  # noqa: E402 (after the importorskip)
from fastar.engine.engine import load  # noqa: E402
from fastar.serve.server import Server  # noqa: E402


@pytest.fixture(scope="module")
def vocab_fst(vocab_ckpt, tmp_path_factory):
    return convert(vocab_ckpt, tmp_path_factory.mktemp("srv") / "m.fst", progress=False)


@pytest.fixture(scope="module")
def server(vocab_fst):
    fst = vocab_fst
    engines = []

    def factory():
        e = load(fst)
        e.context_length = 512
        engines.append(e)
        return e

    s = Server(factory, port=0).start()
    assert s.wait_ready(120)
    yield s, engines
    s.shutdown()


def _client(s):
    return openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)


def test_chat_stream_equals_non_stream_and_generate(server):
    s, engines = server
    c = _client(s)
    msgs = [{"role": "user", "content": "Name three colours."}]
    kw = dict(
        model="deepseek-v4-flash",
        messages=msgs,
        max_tokens=12,
        temperature=0,
        extra_body={"thinking": {"type": "disabled"}},
    )
    full = c.chat.completions.create(**kw)
    parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw) if ch.choices]
    assert full.choices[0].message.content == "".join(parts)
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    # the same text the engine gives directly, outside the server
    direct = engines[0].chat(msgs, thinking=False, max_tokens=12, temperature=0)
    assert str(direct) == full.choices[0].message.content


def test_seed_reproducible_and_prefix_reused(server):
    s, _ = server
    c = _client(s)
    msgs = [{"role": "user", "content": "Tell me a story about a fox."}]
    kw = dict(model="deepseek-v4-flash", messages=msgs, max_tokens=10, temperature=1.0, seed=7)
    a = c.chat.completions.create(**kw)
    b = c.chat.completions.create(**kw)
    assert a.choices[0].message == b.choices[0].message
    assert b.usage.prompt_tokens_details.cached_tokens > 0  # the resent conversation reused its prefix


def test_concurrent_clients_get_their_solo_answers(server):
    s, _ = server
    prompts = [f"Question number {i}?" for i in range(4)]

    def ask(p):
        return (
            _client(s)
            .completions.create(model="deepseek-v4-flash", prompt=p, max_tokens=6, temperature=0)
            .choices[0]
            .text
        )

    solo = [ask(p) for p in prompts]
    out = [None] * len(prompts)
    ts = [threading.Thread(target=lambda i=i: out.__setitem__(i, ask(prompts[i]))) for i in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert out == solo


def test_oversize_prompt_is_400_with_both_numbers(server):
    s, _ = server
    with pytest.raises(openai.BadRequestError) as ei:
        _client(s).chat.completions.create(
            model="deepseek-v4-flash", max_tokens=4, messages=[{"role": "user", "content": "word " * 700}]
        )
    msg = str(ei.value)
    assert "512" in msg and "70" in msg


# --- the agent APIs on the real server --------------------------------------------------------------------------


def greedy_message(content: str, max_tokens: int) -> dict:
    """Anthropic `messages.create` arguments: one user turn, thinking off, greedy."""
    return dict(
        model="deepseek-v4-flash",
        max_tokens=max_tokens,
        thinking={"type": "disabled"},
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": content}],
    )


def test_anthropic_client_on_the_real_server(server):
    anthropic = pytest.importorskip("anthropic")
    s, _ = server
    c = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0)
    kw = greedy_message("Name three colours.", max_tokens=8)
    msg = c.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == 8 and msg.content and msg.content[0].type == "text"
    with c.messages.stream(**kw) as st:
        streamed = "".join(st.text_stream)
        final = st.get_final_message()
    assert streamed == msg.content[0].text == final.content[0].text  # greedy: the stream says the same
    n = c.messages.count_tokens(model="deepseek-v4-flash", messages=kw["messages"], thinking={"type": "disabled"})
    assert n.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    with pytest.raises(anthropic.BadRequestError) as err:
        c.messages.create(model="deepseek-v4-flash", max_tokens=8, messages=[])
    assert err.value.body["type"] == "error"  # Anthropic's error shape, not OpenAI's


def test_openai_responses_on_the_real_server(server):
    s, _ = server
    c = _client(s)
    r = c.responses.create(model="deepseek-v4-flash", input="Name three colours.", max_output_tokens=8, temperature=0)
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens == 8
    text = r.output_text
    events = [
        e.type
        for e in c.responses.create(
            model="deepseek-v4-flash", input="Name three colours.", max_output_tokens=8, temperature=0, stream=True
        )
    ]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
    assert {"response.output_text.delta", "response.reasoning_text.delta"} & set(events)  # thinking is on by default
    again = c.responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == text


def test_restarted_server_reuses_a_thinking_conversation_from_the_prompt_cache(vocab_fst, tmp_path):
    """Thinking mode (the chat default): the prompt ends in `<think>`, which the resent conversation renders as
    `</think>` (the reply's reasoning dropped). The state stored at the end of the prompt stops before that token,
    so a restarted server still prefills only what follows it."""
    folder = str(tmp_path / "pc")
    first = [{"role": "system", "content": "You review code."}, {"role": "user", "content": "Read this file. " * 40}]

    def serve():
        return Server(lambda: load(vocab_fst), port=0, prompt_cache=folder).start()

    s = serve()
    try:
        assert s.wait_ready(120)
        r1 = _client(s).chat.completions.create(model="deepseek-v4-flash", messages=first, max_tokens=4, temperature=0)
        assert r1.usage.prompt_tokens_details is None or not r1.usage.prompt_tokens_details.cached_tokens
    finally:
        s.shutdown()
    s = serve()
    try:
        assert s.wait_ready(120)
        reply = r1.choices[0].message.content or ""
        resent = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the tail?"}]
        r2 = _client(s).chat.completions.create(model="deepseek-v4-flash", messages=resent, max_tokens=2, temperature=0)
        assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens - 1  # all but `<think>`
        assert s.host.engine.stats()["prefill_tokens_computed"] == r2.usage.prompt_tokens - (r1.usage.prompt_tokens - 1)
    finally:
        s.shutdown()


def test_anthropic_stop_sequence_on_the_real_engine(server):
    """The engine cuts the stop string itself (it never reaches the route); the reply still names it."""
    anthropic = pytest.importorskip("anthropic")
    s, _ = server
    c = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0)
    kw = greedy_message("Count to ten.", max_tokens=16)
    text = c.messages.create(**kw).content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    before = text[: text.find(stop)]
    msg = c.messages.create(stop_sequences=["never here", stop], **kw)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert "".join(b.text for b in msg.content if b.type == "text") == before
    with c.messages.stream(stop_sequences=[stop], **kw) as st:
        streamed = "".join(st.text_stream)
        final = st.get_final_message()
    assert streamed == before and final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_chat_n_choices_equal_solo_requests_with_seed_plus_index(server):
    s, _ = server
    c = _client(s)
    kw = dict(
        model="deepseek-v4-flash",
        messages=[{"role": "user", "content": "Pick a fruit."}],
        max_tokens=8,
        temperature=1.0,
        extra_body={"thinking": {"type": "disabled"}},
    )
    solo = [c.chat.completions.create(seed=3 + j, **kw) for j in range(3)]
    r = c.chat.completions.create(n=3, seed=3, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.message.content for ch in r.choices] == [x.choices[0].message.content for x in solo]
    assert r.usage.prompt_tokens == solo[0].usage.prompt_tokens  # the prompt counted once
    assert r.usage.completion_tokens == sum(x.usage.completion_tokens for x in solo)
    texts: dict[int, str] = {}
    for chunk in c.chat.completions.create(n=3, seed=3, stream=True, **kw):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert texts == {j: x.choices[0].message.content for j, x in enumerate(solo)}


def test_logit_bias_bans_and_forces_tokens(server):
    """OpenAI's `logit_bias` is applied to the draw: -100 on the greedy first token gives the model's second choice
    (its logprob still the model's own), +100 on a token makes every token that one."""
    s, _ = server
    c = _client(s)
    kw = dict(model="deepseek-v4-flash", max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    kw["messages"], kw["extra_body"] = (
        [{"role": "user", "content": "Name a river."}],
        {"thinking": {"type": "disabled"}},
    )
    first = c.chat.completions.create(**kw).choices[0].logprobs.content[0]
    top = s.host.engine.tokenizer.encode(first.token)
    assert len(top) == 1
    banned = c.chat.completions.create(logit_bias={str(top[0]): -100}, **kw).choices[0].logprobs.content[0]
    assert banned.token == first.top_logprobs[1].token and banned.logprob == first.top_logprobs[1].logprob
    r = c.completions.create(
        model="deepseek-v4-flash", prompt="The river", max_tokens=4, temperature=1.0, seed=1, logit_bias={"1000": 100}
    )
    assert r.choices[0].text == s.host.engine.tokenizer.decode([1000] * 4)


def test_frequency_and_presence_penalties_reach_the_draw(server):
    """A +10 bias on tokens 1000 and 1001 makes them the greedy choices at every step; a frequency penalty of 2 takes
    2 off a token per repeat (so another token wins in the end), a presence penalty of 2 once (the biased ones go on
    winning, in another order); the same tokens as the engine's own `stream` with the same parameters."""
    s, engines = server
    c = _client(s)
    bias = {1000: 10.0, 1001: 10.0}
    kw = dict(model="deepseek-v4-flash", prompt="The river", max_tokens=8, temperature=0)
    tok = s.host.engine.tokenizer

    def ids(**extra) -> list[int]:
        r = c.completions.create(logprobs=0, logit_bias={str(t): b for t, b in bias.items()}, **kw, **extra)
        return [tok.encode(t)[0] for t in r.choices[0].logprobs.tokens]

    def direct(**extra) -> list[int]:
        chunks = engines[0].stream("The river", max_tokens=8, temperature=0, logit_bias=bias, **extra)
        return [chunk.token for chunk in chunks if chunk.token is not None]

    plain = ids()
    assert set(plain) <= set(bias)
    freq, presence = ids(frequency_penalty=2.0), ids(presence_penalty=2.0)
    assert freq != plain and presence != plain and freq[0] == presence[0] == plain[0]
    assert not set(freq) <= set(bias)  # 2 per repeat: after some repeats another token outbids the +10
    assert set(presence) <= set(bias)  # 2 once: the biased tokens keep winning
    assert freq == direct(frequency_penalty=2.0) and presence == direct(presence_penalty=2.0)


def test_thinking_budget_forces_the_end_of_thinking_on_the_real_engine(server):
    """DeepSeek's/Anthropic's `budget_tokens` on chat completions: after 4 thinking tokens the 5th is `</think>`
    (the random model never writes it itself) and the answer follows; the same tokens as `Engine.chat` with the
    same budget (the scheduler and `Engine.stream` force alike)."""
    s, engines = server
    c = _client(s)
    msgs = [{"role": "user", "content": "Think about colours."}]
    kw = dict(model="deepseek-v4-flash", messages=msgs, max_tokens=12, temperature=0, logprobs=True)
    free = c.chat.completions.create(**kw)
    free_tokens = [t.token for t in free.choices[0].logprobs.content]
    assert "</think>" not in free_tokens and free.choices[0].message.content in ("", None)
    # the special tokens' text kept (the random model writes a placeholder), so the text is the logprobs' tokens
    budget = {"thinking": {"type": "enabled", "budget_tokens": 4}, "skip_special_tokens": False}
    r = c.chat.completions.create(extra_body=budget, **kw)
    tokens = [t.token for t in r.choices[0].logprobs.content]
    assert tokens[:4] == free_tokens[:4] and tokens[4] == "</think>" and len(tokens) == 12
    msg = r.choices[0].message
    assert msg.model_dump()["reasoning_content"] == "".join(tokens[:4]) and msg.content == "".join(tokens[5:])
    direct = engines[0].chat(
        msgs, thinking=True, max_tokens=12, temperature=0, thinking_budget=4, skip_special_tokens=False
    )
    assert (direct.reasoning, direct.content) == (msg.model_dump()["reasoning_content"], msg.content)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(extra_body={"thinking": {"type": "enabled", "budget_tokens": 12}}, **kw)


def test_stop_strings_match_the_answer_not_the_reasoning_on_the_real_engine(server):
    """A stop string the reasoning holds does not end a thinking-mode reply: the engine matches stops from the end of
    the reasoning on (the random model never writes `</think>`: a budget of 4 forces it). Chat completions (streamed,
    not, n=2) and Messages give the reply without the stop, with the same reasoning and answer; a stop string of the
    answer still cuts the answer (`stop`, `stop_sequence`), never the reasoning."""
    anthropic = pytest.importorskip("anthropic")
    s, _ = server
    c = _client(s)
    kw = dict(
        model="deepseek-v4-flash",
        messages=[{"role": "user", "content": "Think about colours."}],
        max_tokens=12,
        temperature=0,
        extra_body={"thinking": {"type": "enabled", "budget_tokens": 4}},
    )
    free = c.chat.completions.create(**kw).choices[0]
    reasoning, content = free.message.model_dump()["reasoning_content"], free.message.content
    assert free.finish_reason == "length" and reasoning and content
    inside = next(reasoning[i : i + 2] for i in range(len(reasoning) - 1) if reasoning[i : i + 2] not in content)
    answer_stop = content[len(content) // 2 : len(content) // 2 + 2]
    assert answer_stop not in reasoning  # (the seed's reply has such a stop string; else it would cut the reasoning)

    def replies(stop: str, **extra) -> list[tuple[str, str, str]]:
        r = c.chat.completions.create(stop=[stop], n=2, **kw, **extra)
        return [
            (ch.message.model_dump()["reasoning_content"], ch.message.content, ch.finish_reason) for ch in r.choices
        ]

    def streamed(stop: str) -> tuple[str, str, str | None]:
        parts, finish = ["", ""], None
        for chunk in c.chat.completions.create(stop=[stop], stream=True, **kw):
            for ch in chunk.choices:
                parts[0] += ch.delta.model_dump().get("reasoning_content") or ""
                parts[1] += ch.delta.content or ""
                finish = ch.finish_reason or finish
        return parts[0], parts[1], finish

    assert replies(inside) == [(reasoning, content, "length")] * 2
    assert streamed(inside) == (reasoning, content, "length")
    cut = content[: content.find(answer_stop)]
    assert replies(answer_stop) == [(reasoning, cut, "stop")] * 2
    assert streamed(answer_stop) == (reasoning, cut, "stop")
    m = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0)
    mkw = dict(
        model="x",
        max_tokens=12,
        messages=kw["messages"],
        thinking={"type": "enabled", "budget_tokens": 4},
        extra_body={"temperature": 0},
    )
    for stop, text, reason, hit in (
        (inside, content, "max_tokens", None),
        (answer_stop, cut, "stop_sequence", answer_stop),
    ):
        msg = m.messages.create(stop_sequences=[stop], **mkw)
        assert [b.type for b in msg.content] == ["thinking", "text"] and msg.content[0].thinking == reasoning
        assert (msg.content[1].text, msg.stop_reason, msg.stop_sequence) == (text, reason, hit)
        with m.messages.stream(stop_sequences=[stop], **mkw) as st:
            assert "".join(st.text_stream) == text
            final = st.get_final_message()
        assert (final.content[0].thinking, final.stop_reason, final.stop_sequence) == (reasoning, reason, hit)


PAD = "<｜▁pad▁｜>"  # token 2, marked special in tokenizer.json


def test_special_tokens_give_no_text_unless_skip_special_tokens_is_false(server):
    """A special token the model writes (here the pad token, made likely by a logit bias) showed in the text. It
    gives none now, as vLLM's default `skip_special_tokens: true` decodes, on both routes, streamed or not; with
    false it shows. The tokens are the same either way (same seed), so is the usage; a stop string is matched in
    the text the client gets, across a skipped token."""
    s, engines = server
    c = _client(s)
    nothink = {"thinking": {"type": "disabled"}}
    comp = dict(model="deepseek-v4-flash", prompt="The river", max_tokens=16, temperature=1.0, seed=0)
    chat = {k: v for k, v in comp.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "Hi."}]}

    def completion(extra=None, **kw):
        body = {**comp, "extra_body": {"logit_bias": {"2": 12}, **(extra or {})}, **kw}
        r = c.completions.create(**body)
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **body) if ch.choices)
        assert streamed == r.choices[0].text
        return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason

    def chatted(extra=None, **kw):
        body = {**chat, "extra_body": {"logit_bias": {"2": 12}, **nothink, **(extra or {})}, **kw}
        r = c.chat.completions.create(**body)
        parts = c.chat.completions.create(stream=True, **body)
        assert "".join(ch.choices[0].delta.content or "" for ch in parts if ch.choices) == r.choices[0].message.content
        return r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason

    for run in (completion, chatted):
        kept, n_kept, _ = run({"skip_special_tokens": False})
        skipped, n_skipped, _ = run()
        assert PAD in kept and PAD not in skipped and skipped == kept.replace(PAD, ""), (kept, skipped)
        assert n_kept == n_skipped == 16
        i = kept.index(PAD)
        j = i
        while kept.startswith(PAD, j):
            j += len(PAD)
        assert i > 0 and j < len(kept), kept
        stop = kept[i - 1] + kept[j]  # the characters either side of the pad tokens: adjacent once they are skipped
        cut, _, finish = run(stop=[stop])
        assert finish == "stop" and cut == skipped[: skipped.index(stop)], (cut, skipped, stop)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(**comp, extra_body={"skip_special_tokens": "no"})
    assert err.value.body["param"] == "skip_special_tokens"
    # the engine's own default (what `fastar run` and `chat` print) skips them too
    from fastar.engine.sampling import SamplingParams

    engine = engines[0]
    ids = engine.tokenizer.encode("The river")
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=0, logit_bias={2: 12})
    chunks = list(engine.stream(ids, params, session=engine.open_session()))
    assert 2 in [ch.token for ch in chunks] and PAD not in "".join(ch.text for ch in chunks)


def test_a_corrupt_expert_fails_its_request_in_one_log_line(vocab_fst, tmp_path, caplog):
    """An expert failing its checksum at its first read ends the request with a 500 naming it, and the log says so
    in one line: it logged a traceback through the scheduler, as for a bug."""
    import shutil

    from fastar.format.reader import FstFile

    bad = tmp_path / "bad.fst"
    shutil.copy(vocab_fst, bad)
    with FstFile(bad) as f:
        first, stride, records = f.bank["offset"], f.expert_stride, f.bank["slots"] * f.bank["experts"]
    with open(bad, "r+b") as out:  # one flipped byte in every expert: whichever the router picks is corrupt
        for i in range(records):
            out.seek(first + i * stride + 100)
            byte = out.read(1)[0]
            out.seek(first + i * stride + 100)
            out.write(bytes([byte ^ 1]))
    s = Server(lambda: load(bad), port=0).start()
    try:
        assert s.wait_ready(120)
        with pytest.raises(openai.InternalServerError, match=r"expert \(layer \d+, id \d+\) fails its checksum"):
            _client(s).chat.completions.create(
                model="deepseek-v4-flash", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        # the request gets its error from inside the step; the worker logs the step's failure once it is raised out
        # of the scheduler, which may be after the client has read its 500
        wait_until(lambda: any("a generation step failed" in r.getMessage() for r in caplog.records), timeout=10)
        failed = [r for r in caplog.records if "a generation step failed" in r.getMessage()]
        assert failed and "fails its checksum" in failed[0].getMessage(), [r.getMessage() for r in caplog.records]
        assert all(r.exc_info is None for r in failed)
    finally:
        s.shutdown()
