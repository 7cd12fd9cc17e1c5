"""Session: prefix reuse (counted through the stats), rollback, pending tokens, prompt checks, interrupted passes,
save/load; a fake runner for the logic, the tiny model for exactness, the real-vocabulary model for multi-turn
chat through the public API."""

from __future__ import annotations

import json
import os
import re
import struct
import threading
from pathlib import Path

import pytest
import torch

from fastar.engine.session import (
    DIGEST_SIZE,
    MAGIC,
    PromptError,
    Session,
    SessionError,
    Stats,
    common_prefix,
)
from fastar.errors import FastarError

V = 64


class FakeState:
    """Stands in for ModelState: remembers the tokens it processed; may refuse deep rollbacks."""

    def __init__(self, toks: list[int] | None = None, max_rollback: int | None = None) -> None:
        self.toks = list(toks or [])
        self.max_rollback = max_rollback

    @property
    def length(self) -> int:
        return len(self.toks)

    def truncate(self, p: int) -> None:
        if self.max_rollback is not None and self.length - p > self.max_rollback:
            raise FastarError("rows dropped")  # like StateError
        del self.toks[p:]

    def snapshot(self) -> FakeState:
        return FakeState(self.toks, self.max_rollback)

    def to_bytes(self) -> bytes:
        return json.dumps(self.toks).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> FakeState:
        try:
            return cls(json.loads(raw))
        except ValueError:
            raise FastarError("bad state bytes") from None


class FakeRunner:
    """Logits are a pure function of the whole history, so reuse is correct iff results equal a fresh run."""

    prefill_chunk = prefill_span = 4

    def __init__(self, vocab: int = V, max_rollback: int | None = None) -> None:
        self.vocab, self.max_rollback = vocab, max_rollback
        self.calls: list[list[int]] = []
        self.fail_on: int | None = None  # raise KeyboardInterrupt when this token is run

    def check_open(self) -> None:  # never closed
        pass

    def new_state(self) -> FakeState:
        return FakeState(max_rollback=self.max_rollback)

    def prefill(self, ids: list[int], state: FakeState, argmax_only: bool = False) -> torch.Tensor:
        self.calls.append(list(ids))
        for t in ids:
            if t == self.fail_on:
                raise KeyboardInterrupt  # mid-pass: the state is half-updated
            state.toks.append(t)
        g = torch.Generator().manual_seed(hash(tuple(state.toks)) & 0xFFFFFFFF)
        return torch.randn(1, self.vocab, generator=g)

    @property
    def computed(self) -> int:
        return sum(map(len, self.calls))


def make(runner: FakeRunner | None = None, **kw) -> tuple[Session, FakeRunner]:
    runner = runner or FakeRunner()
    return Session(runner, context_length=kw.pop("context_length", 100), vocab_size=V, **kw), runner


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_prefill_reuses_the_longest_common_prefix() -> None:
    s, r = make()
    a = list(range(10))
    logits_a = s.prefill(a)
    assert r.computed == 10 and s.last_cached_tokens == 0 and s.num_processed == 10
    s.append(42)  # a sampled token: pending, not run yet
    assert s.tokens == a + [42] and s.num_processed == 10
    r.calls.clear()
    s.prefill(a + [42, 43, 44])  # the pending token and the new ones, nothing else
    assert r.computed == 3 and s.last_cached_tokens == 10
    r.calls.clear()
    again = s.prefill(a)  # a shorter prompt: roll back, re-run only the last token for its logits
    assert r.computed == 1 and s.num_processed == 10
    assert torch.equal(again, logits_a)
    r.calls.clear()
    s.prefill([9] + a)  # nothing in common
    assert r.computed == 11 and s.last_cached_tokens == 0


def test_stats_count_prefill_and_reuse() -> None:
    stats = Stats()
    s, _ = make(stats=stats)
    s.prefill([1, 2, 3, 4, 5])
    s.prefill([1, 2, 3, 4, 5, 6, 7])
    assert stats.prefill_tokens_computed == 5 + 2 and stats.cached_tokens == 5
    s.append(3)
    s.decode()
    assert stats.decode_tokens_computed == 1
    d = stats.as_dict()
    assert d["prefill_tokens_per_s"] > 0 and d["decode_tokens_per_s"] > 0
    assert stats.since(Stats()).prefill_tokens_computed == 7


def test_reused_results_equal_a_fresh_run() -> None:
    s, _ = make()
    fresh, _ = make()
    s.prefill([1, 2, 3, 4, 5, 6])
    s.prefill([1, 2, 3, 9])
    assert torch.equal(s.prefill([1, 2, 3, 9, 8, 7, 6]), fresh.prefill([1, 2, 3, 9, 8, 7, 6]))


def test_a_state_that_cannot_roll_back_is_rebuilt() -> None:
    s, r = make(FakeRunner(max_rollback=2))
    s.prefill(list(range(10)))
    r.calls.clear()
    s.prefill(list(range(9)) + [50])  # rollback by 1: allowed
    assert r.computed == 1
    r.calls.clear()
    s.prefill([0, 1, 2, 3])  # rollback by 6: refused, and no anchor shares more, so the whole prompt runs again
    assert r.computed == 4


def test_the_anchor_rolls_back_over_a_long_reply() -> None:
    s, r = make(FakeRunner(max_rollback=2))
    prompt = list(range(10))
    s.prefill(prompt)
    for t in range(20, 26):  # a reply longer than max_rollback
        s.append(t)
        s.decode()
    r.calls.clear()
    # thinking mode's next turn: the prompt diverges right before the end of the previous prompt
    logits = s.prefill(prompt[:9] + [40, 41])
    assert r.calls == [[40, 41]] and s.last_cached_tokens == 9
    fresh, _ = make()
    assert torch.equal(logits, fresh.prefill(prompt[:9] + [40, 41]))
    r.calls.clear()
    s.prefill(prompt[:9] + [50])  # a short rollback needs no anchor
    assert r.calls == [[50]]
    plain, r2 = make(FakeRunner(max_rollback=2), anchor=False)
    plain.prefill(prompt)
    for t in range(20, 26):
        plain.append(t)
        plain.decode()
    r2.calls.clear()
    plain.prefill(prompt[:9] + [40, 41])
    assert r2.computed == 11


def test_decode_runs_the_pending_token() -> None:
    s, r = make()
    s.prefill([1, 2, 3])
    s.append(7)
    out = s.decode()
    assert r.calls[-1] == [7] and s.num_processed == 4 and out.shape == (V,)
    with pytest.raises(RuntimeError):
        s.decode()  # nothing pending


def test_cancel_between_prefill_chunks_keeps_what_was_done() -> None:
    s, r = make()
    cancel = threading.Event()
    seen = []

    def progress(done: int, total: int) -> None:
        seen.append((done, total))
        if done >= 4:
            cancel.set()

    assert s.prefill(list(range(10)), cancel, progress) is None
    assert s.num_processed == 4 and s.tokens == [0, 1, 2, 3]
    assert seen == [(0, 10), (4, 10)]
    r.calls.clear()
    s.prefill(list(range(10)))
    assert r.computed == 6


def test_an_interrupted_pass_is_never_reused() -> None:
    s, r = make()
    s.prefill([1, 2, 3, 4, 5])
    r.fail_on = 7
    s.append(6)
    s.append(7)
    with pytest.raises(KeyboardInterrupt):
        s.decode()
    r.fail_on = None
    r.calls.clear()
    s.prefill([1, 2, 3, 4, 5, 6, 7, 8])
    assert r.computed == 8  # the half-updated state was dropped


def test_prompt_checks() -> None:
    s, _ = make(context_length=8)
    with pytest.raises(PromptError, match="empty"):
        s.check_prompt([])
    with pytest.raises(PromptError, match=r"12 tokens.*context length is 8"):
        s.check_prompt(list(range(12)))
    with pytest.raises(PromptError, match=f"token id {V}"):
        s.check_prompt([1, V])
    with pytest.raises(PromptError):
        s.prefill([])  # nothing is run
    s.check_prompt(list(range(7)))


def test_rewind_and_reset() -> None:
    s, _ = make()
    s.prefill([1, 2, 3, 4])
    s.append(5)
    s.rewind(2)
    assert s.tokens == [1, 2] and s.num_processed == 2
    s.meta["x"] = 1
    s.reset()
    assert s.tokens == [] and s.num_processed == 0 and s.meta == {}


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    s, _ = make(fingerprint="model-a")
    s.prefill([1, 2, 3, 4])
    s.append(9)
    s.meta = {"messages": [{"role": "user", "content": "héllo"}]}
    path = s.save(tmp_path / "sub" / "conv.session")
    assert not list(path.parent.glob("*.partial"))
    t, r2 = make(fingerprint="model-a")
    t.load(path)
    assert t.tokens == [1, 2, 3, 4, 9] and t.num_processed == 4 and t.meta == s.meta
    t.prefill([1, 2, 3, 4, 9, 10])
    assert r2.computed == 2  # restored state, nothing recomputed but the pending and new tokens


def test_load_errors(tmp_path: Path) -> None:
    s, _ = make(fingerprint="model-a")
    s.prefill([1, 2])
    path = s.save(tmp_path / "a.session")
    other, _ = make(fingerprint="model-b")
    with pytest.raises(SessionError, match="different model"):
        other.load(path)
    with pytest.raises(SessionError, match="no such file"):
        s.load(tmp_path / "missing.session")
    (tmp_path / "junk").write_bytes(b"hello world, not a session")
    with pytest.raises(SessionError, match="not a fastar session"):
        s.load(tmp_path / "junk")
    raw = path.read_bytes()
    (tmp_path / "cut").write_bytes(raw[:25])
    with pytest.raises(SessionError, match="corrupt"):
        s.load(tmp_path / "cut")
    assert s.tokens == [1, 2]  # a failed load leaves the session as it was


def test_a_damaged_or_truncated_session_file_is_refused_by_its_checksum(tmp_path: Path) -> None:
    """A flipped byte anywhere (here in the state, which would otherwise parse) or a file cut short is a one-line
    `SessionError` naming the file; the session keeps what it had."""
    s, _ = make(fingerprint="model-a")
    s.prefill([1, 2, 3])
    raw = s.save(tmp_path / "a.session").read_bytes()
    state_at = raw.index(b"[1, 2, 3]")
    flipped = raw[:state_at] + b"[1, 2, 4]" + raw[state_at + 9 :]
    for name, data in (("flipped", flipped), ("short", raw[:-1]), ("no-state", raw[:state_at])):
        (tmp_path / name).write_bytes(data)
        t, _ = make(fingerprint="model-a")
        t.prefill([7])
        with pytest.raises(SessionError) as err:
            t.load(tmp_path / name)
        assert str(err.value) == f"{tmp_path / name}: session file is corrupt (checksum mismatch)"
        assert t.tokens == [7]


def test_a_session_file_cut_inside_its_preamble_says_so(tmp_path: Path) -> None:
    """A file cut after the magic (10 bytes of 20) said "session file is corrupt (unpack_from requires a buffer of
    at least 20 bytes for unpacking 12 bytes at offset 8 ...)": struct's words. It says truncated, with the sizes."""
    s, _ = make(fingerprint="model-a")
    s.prefill([1, 2, 3])
    raw = s.save(tmp_path / "a.session").read_bytes()
    (tmp_path / "cut").write_bytes(raw[:10])
    t, _ = make(fingerprint="model-a")
    with pytest.raises(SessionError) as err:
        t.load(tmp_path / "cut")
    assert str(err.value) == f"{tmp_path / 'cut'}: session file is truncated (10 bytes, its preamble is 20)"


def test_a_version_1_session_file_without_a_checksum_still_loads(tmp_path: Path) -> None:
    s, _ = make(fingerprint="model-a")
    s.prefill([1, 2, 3])
    raw = s.save(tmp_path / "a.session").read_bytes()[:-DIGEST_SIZE]
    (tmp_path / "v1.session").write_bytes(raw[:8] + struct.pack("<I", 1) + raw[12:])  # as version 1 wrote it
    t, _ = make(fingerprint="model-a")
    t.load(tmp_path / "v1.session")
    assert t.tokens == [1, 2, 3] and t.num_processed == 3


def test_the_low_level_session_api_names_bad_arguments(tmp_path: Path) -> None:
    """Session.prefill of text or float ids (a comparison TypeError, or floats silently rounded into tokens),
    append of an id outside the vocabulary (taken, to fail later in the model) or of a string, rewind to a
    non-integer, and save with a meta that is not JSON: each a one-line error naming the problem."""
    s, _ = make()
    with pytest.raises(TypeError, match=r"^Session.prefill takes token ids \(a list of int; encode text"):
        s.prefill("hello")
    with pytest.raises(TypeError, match=r"^token ids must be integers, got 1.5 \(float\)$"):
        s.prefill([1, 1.5])
    s.prefill([1, 2])
    for bad, err, says in ((V, PromptError, f"token id {V} is outside"), ("x", TypeError, "must be integers")):
        with pytest.raises(err, match=says):
            s.append(bad)
    assert s.tokens == [1, 2]
    with pytest.raises(ValueError, match=r"^cannot rewind a session of 2 tokens to '1'$"):
        s.rewind("1")
    s.meta = {"seen": {1, 2}}
    with pytest.raises(SessionError, match=r"a.session: cannot save: the session's meta is not JSON"):
        s.save(tmp_path / "a.session")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("bad", [123, None, b"a.session", ""])
def test_save_and_load_name_a_path_of_the_wrong_kind(bad) -> None:
    """`save(123)` / `load(123)` were pathlib's "argument should be a str or an os.PathLike object", naming no
    argument; `save("")` tried the current directory. One line naming the call and what it takes."""
    s, _ = make()
    s.prefill([1, 2])
    for call, name in ((s.save, "Session.save"), (s.load, "Session.load")):
        says = f"{name} takes the session file's path (a non-empty str or os.PathLike), got {bad!r}"
        with pytest.raises(TypeError, match=f"^{re.escape(says)}$"):
            call(bad)
    assert s.tokens == [1, 2]


def test_save_errors_name_the_path(tmp_path: Path) -> None:
    """A path that cannot be written is a `SessionError` naming it (not an OSError naming the temporary file),
    and leaves no partial file behind."""
    s, _ = make(fingerprint="model-a")
    s.prefill([1, 2])
    (tmp_path / "plain").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(SessionError, match=f"^{tmp_path / 'plain' / 'a.session'}: cannot write"):
        s.save(tmp_path / "plain" / "a.session")  # a path under a regular file
    with pytest.raises(
        SessionError, match=rf"^{tmp_path / 'plain' / 'a.session'}: cannot write \({tmp_path / 'plain'} is"
    ):
        s.save(tmp_path / "plain" / "a.session")  # it said "(File exists)"
    for bad in (tmp_path, tmp_path / "fifo"):  # a folder; a FIFO or device (/dev/null), which the rename replaced
        with pytest.raises(SessionError, match=f"^{bad}: not a regular file"):
            s.save(bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "plain"] and (tmp_path / "fifo").is_fifo()


# --- text prompts with the real tokenizer -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from fastar.engine.tokenizer import Tokenizer

    return Tokenizer.default()


def test_text_prompt_keeps_generated_tokens_at_an_added_token_boundary(tokenizer) -> None:
    s, _ = make(FakeRunner(vocab=tokenizer.vocab_size), tokenizer=tokenizer)
    s.vocab_size = tokenizer.vocab_size
    first = "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    ids = tokenizer.encode(first)
    s.prefill(ids)
    # the "model" spelled "Hello" one byte-token at a time: not how the tokenizer would encode it
    odd = [tokenizer.encode(c)[0] for c in "Hello"]
    assert tokenizer.encode("Hello") != odd
    for t in odd:
        s.append(t)
    follow = first + "Hello<｜end▁of▁sentence｜><｜User｜>More<｜Assistant｜></think>"
    got = s.encode_prompt(follow)
    assert got[: len(ids) + 5] == ids + odd
    assert tokenizer.decode(got) == follow
    # not at an added-token boundary: encode afresh
    assert s.encode_prompt(first + "Hello world") == tokenizer.encode(first + "Hello world")
    assert s.encode_prompt([5, 6]) == [5, 6]


def test_text_prompt_keeps_a_reply_whose_special_tokens_the_text_hid(tokenizer) -> None:
    """A reply holding special tokens (a pad, a placeholder) is shown and resent without them (skip_special_tokens):
    the resent conversation still reuses the reply's own ids, up to the end of the turn."""
    s, _ = make(FakeRunner(vocab=tokenizer.vocab_size), tokenizer=tokenizer)
    s.vocab_size = tokenizer.vocab_size
    first = "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    ids = tokenizer.encode(first)
    s.prefill(ids)
    pad = tokenizer.token_to_id("<｜▁pad▁｜>")
    assert tokenizer.is_special(pad)
    reply = [*tokenizer.encode("Hel"), pad, *tokenizer.encode("lo"), pad]
    for t in reply:
        s.append(t)
    shown = tokenizer.decode(reply, skip_special_tokens=True)
    assert shown == "Hello" and tokenizer.encode(shown) != [t for t in reply if t != pad]
    follow = first + shown + "<｜end▁of▁sentence｜><｜User｜>More<｜Assistant｜></think>"
    got = s.encode_prompt(follow)
    assert got[: len(ids) + len(reply)] == ids + reply
    assert tokenizer.decode(got, skip_special_tokens=True) == tokenizer.decode(tokenizer.encode(follow), True)
    assert got[len(ids) + len(reply) :] == tokenizer.encode(follow[len(first + shown) :])
    # text that differs from the reply is encoded afresh
    other = first + "Help<｜end▁of▁sentence｜><｜User｜>More"
    assert s.encode_prompt(other) == tokenizer.encode(other)


# --- the real engine ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine(tiny_ckpt: Path, tmp_path_factory):
    from fastar.convert.hf import convert
    from fastar.engine.engine import load

    return load(convert(tiny_ckpt, tmp_path_factory.mktemp("tiny-fst") / "tiny.fst"))


@pytest.fixture(scope="module")
def vocab_engine(vocab_ckpt: Path, tmp_path_factory):
    from fastar.convert.hf import convert
    from fastar.engine.engine import load

    return load(convert(vocab_ckpt, tmp_path_factory.mktemp("vocab-fst") / "vocab.fst"))


def test_session_save_load_continues_exactly(tiny_engine, tmp_path: Path) -> None:
    e = tiny_engine
    prompt = [5, 17, 99, 3, 250, 7, 8]
    whole = [c.token for c in e.stream(prompt, max_tokens=4, session=e.open_session())]
    s = e.open_session()
    first = [c.token for c in e.stream(prompt, max_tokens=2, session=s)]
    s.save(tmp_path / "s.session")
    t = e.open_session()
    t.load(tmp_path / "s.session")
    before = e.stats()["prefill_tokens_computed"]
    # continue from the loaded state: the prompt is the saved timeline, so only its pending token is run
    rest = [c.token for c in e.stream(t.tokens, max_tokens=2, session=t)]
    assert e.stats()["prefill_tokens_computed"] - before == 1
    assert first + rest == whole


def test_multi_turn_chat_prefills_only_the_new_tokens(vocab_engine) -> None:
    e = vocab_engine
    s = e.open_session()
    tok = e.tokenizer
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there!"}]
    for turn in range(3):
        before = e.stats()
        held = s.num_tokens  # the previous turns, as the session holds them (last reply token still pending)
        reply = e.chat(messages, session=s, max_tokens=3)
        after = e.stats()
        prompt_tokens = reply.usage["prompt_tokens"]
        computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
        if turn == 0:
            assert computed == prompt_tokens
        else:  # the new user turn, its markers, the EOS the template adds, and the one pending reply token
            assert computed == prompt_tokens - held + 1
            assert reply.usage["cached_tokens"] == held - 1
            assert computed < 20
        assert reply.finish_reason == "length" and isinstance(reply, str)
        assert after["generated_tokens"] - before["generated_tokens"] == 3
        messages += [reply.to_message(), {"role": "user", "content": f"And turn {turn + 2}?"}]
    assert tok.decode(s.tokens).startswith("<｜begin▁of▁sentence｜>You are terse.<｜User｜>Hello there!")


def test_thinking_turns_roll_back_from_the_anchor(vocab_engine) -> None:
    """Thinking mode drops the last reply's reasoning from the next prompt, so the new prompt leaves the
    timeline right before the previous prompt's end. With a short `max_rollback` the live state cannot go back
    that far; the anchor can, so only the new tokens are computed, and they match a fresh run (in reference
    numerics: official ones round a short chunk differently from a long one, see fastar.model.deepseek_v4)."""
    from fastar.engine.engine import load

    e = load(vocab_engine.source, max_rollback=2, numerics="reference")
    s = e.open_session()
    messages = [{"role": "user", "content": "Think first."}]
    first = e.chat(messages, thinking=True, session=s, max_tokens=6)
    p1 = first.usage["prompt_tokens"]
    messages += [first.to_message(), {"role": "user", "content": "Now answer."}]
    before = e.stats()["prefill_tokens_computed"]
    second = e.chat(messages, thinking=True, session=s, max_tokens=2)
    computed = e.stats()["prefill_tokens_computed"] - before
    assert second.usage["cached_tokens"] == p1 - 1  # all but the `<think>` that became `</think>`
    assert computed == second.usage["prompt_tokens"] - (p1 - 1)
    fresh = e.chat(messages, thinking=True, session=e.open_session(), max_tokens=2)
    assert fresh.reasoning == second.reasoning


def test_prefill_progress_moves_inside_a_chunk(tiny_engine) -> None:
    """on_progress follows a chunk block by block (a long prompt's one chunk can take minutes): non-decreasing,
    values between chunk ends, ending at (total, total); the logits are those of a prefill without it."""
    e = tiny_engine
    prompt = [int(t) for t in torch.randint(3, 1000, (11,), generator=torch.Generator().manual_seed(5))]
    seen: list[tuple[int, int]] = []
    s = e.open_session()
    chunk, e.prefill_chunk = e.prefill_chunk, 8
    try:
        got = s.prefill(prompt, None, lambda d, t: seen.append((d, t)))
        want = e.open_session().prefill(prompt)
    finally:
        e.prefill_chunk = chunk
    assert torch.equal(got, want)
    dones = [d for d, _ in seen]
    assert all(t == len(prompt) for _, t in seen) and dones == sorted(dones) and seen[-1] == (11, 11)
    assert any(0 < d < 8 for d in dones) and any(8 < d < 11 for d in dones)  # within the first and second chunk
    assert s._state.on_layer is None


@pytest.mark.parametrize("header", [b"[" * 100_000, b'{"tokens": ' + b"9" * 5000 + b"}"])
def test_a_session_header_json_cannot_take_is_a_session_error(tmp_path: Path, header: bytes) -> None:
    """A version-1 file (no checksum) whose header nests deeper than the json module recurses ended `/load` in
    `fastar chat` in a RecursionError traceback; a number of more digits than Python converts was a ValueError
    naming sys.set_int_max_str_digits. Both are the file's own corruption."""
    path = tmp_path / "deep.session"
    path.write_bytes(MAGIC + struct.pack("<IQ", 1, len(header)) + header)
    s, _ = make(fingerprint="model-a")
    s.prefill([5])
    with pytest.raises(SessionError, match="session file is corrupt"):
        s.load(path)
    assert s.tokens == [5]
