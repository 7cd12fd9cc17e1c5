"""Streaming generation: stop strings (held back, across token boundaries), stop tokens, UTF-8 split across tokens,
max tokens, context limit, cancellation, usage; then greedy determinism and seed reproducibility on the tiny model."""

from __future__ import annotations

import itertools
import re
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastar.encoding import THINK_END, TOOL_CALLS_START
from fastar.engine.generate import (
    ChatResult,
    GenerationChunk,
    StopStrings,
    generate_text,
    stream_generate,
)
from fastar.engine.sampling import SamplingParams
from fastar.engine.session import PromptError, Session

EOS = 1


# --- StopStrings --------------------------------------------------------------------------------------------


def run_stops(pieces: list[str], stops: list[str], unmatched: int = 0) -> tuple[list[str], bool]:
    """`unmatched`: the first pieces are fed with `match` False (vLLM's `min_tokens`)."""
    s = StopStrings(stops)
    out = []
    for i, p in enumerate(pieces):
        text, hit = s.feed(p, i >= unmatched)
        out.append(text)
        if hit:
            return out, True
    out.append(s.flush())
    return out, s.hit  # the end of the text can settle a held stop string


def test_stop_string_across_pieces_is_never_leaked() -> None:
    out, hit = run_stops(["Hel", "lo w", "orld"], ["o wo"])
    assert hit and "".join(out) == "Hell"
    assert out == ["Hel", "l", ""]  # "o w" was held back until decided


def test_held_text_is_released_when_it_does_not_become_a_stop() -> None:
    out, hit = run_stops(["ab", "c#", "#x"], ["###"])
    assert not hit and "".join(out) == "abc##x" and out[1] == "c"


def test_earliest_of_several_stops_wins() -> None:
    out, hit = run_stops(["one two three"], ["three", "two"])
    assert hit and "".join(out) == "one "


def test_a_stop_starting_earlier_wins_though_it_completes_later() -> None:
    """'b' completes first, but 'aba' starts before it: the cut waits for 'aba' and is where the whole text would be
    cut; at the end of the text the held 'b' still counts."""
    assert run_stops(["aab", "a"], ["b", "aba"]) == (["a", ""], True)
    assert run_stops(["aab", "c"], ["b", "aba"]) == (["a", "a"], True)
    s = StopStrings(["b", "aba"])
    assert s.feed("aab") == ("a", False) and s.flush() == "a" and s.hit  # text ended: the held 'b' is the stop
    s = StopStrings(["ab"])
    assert s.feed("xa") == ("x", False) and s.feed("bab", match=False) == ("abab", False) and not s.hit
    assert s.feed("ab") == ("", True) and s.matched == "ab"  # matched again once `match` is back


@settings(max_examples=200, deadline=None)
@given(
    st.text("ab#", max_size=30),
    st.lists(st.text("ab#", min_size=1, max_size=4), min_size=1, max_size=3),
    st.lists(st.integers(0, 30), max_size=6),
)
def test_stops_match_the_one_shot_answer(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out, hit = run_stops(pieces, stops)
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
    expect = text if first is None else text[:first]
    assert "".join(out) == expect and hit == (first is not None)
    acc = ""
    for piece in out:  # every released piece is final: never a part of a stop string taken back later
        acc += piece
        assert expect.startswith(acc)


def test_a_stop_string_spanning_the_min_tokens_boundary_ends_the_text_and_never_leaks() -> None:
    """vLLM's `min_tokens` check looks back a stop string's length before the first text it matches: a stop
    string that starts in the first `min_tokens` tokens and ends after them cuts the text there; its start was
    held back, never released. One wholly within them stays in the text."""
    s = StopStrings(["abc"])
    assert s.feed("xab", match=False) == ("x", False)  # "ab" could begin "abc": held although nothing ends here
    assert s.feed("c") == ("", True) and s.matched == "abc"
    assert run_stops(["xabc", "d"], ["abc"], unmatched=1) == (["xabc", "d", ""], False)
    assert run_stops(["xa", "bc", "d"], ["abc", "b"], unmatched=1) == (["x", ""], True)  # "b" alone: no earlier


@settings(max_examples=300, deadline=None)
@given(
    st.text("ab#", max_size=30),
    st.lists(st.text("ab#", min_size=1, max_size=4), min_size=1, max_size=3),
    st.lists(st.integers(0, 30), max_size=6),
    st.integers(0, 30),
)
def test_stops_after_min_tokens_match_vllms_answer(text: str, stops: list[str], cuts: list[int], floor: int) -> None:
    """The first `floor` characters come in pieces fed with `match` False: the text is cut at the earliest stop
    string that ends past them (vLLM's search from `floor - len(stop) + 1`), and nothing released is taken back."""
    floor = min(floor, len(text))
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, floor, len(text)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out, hit = run_stops(pieces, stops, unmatched=bounds.index(floor))
    first = min((i for i in (text.find(s, max(0, floor - len(s) + 1)) for s in stops) if i >= 0), default=None)
    expect = text if first is None else text[:first]
    assert "".join(out) == expect and hit == (first is not None)
    acc = ""
    for piece in out:
        acc += piece
        assert expect.startswith(acc)


def run_thinking_stops(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    s = StopStrings(stops, thinking=True)
    out = []
    for p in pieces:
        text, hit = s.feed(p)
        out.append(text)
        if hit:
            return out, True
    out.append(s.flush())
    return out, s.hit


def test_in_thinking_mode_stop_strings_match_the_answer_only() -> None:
    """A thinking-mode reply: a stop string in the reasoning does not end it, one in the answer does, and one across
    the end of the reasoning (`</think>` included) is no match; the reasoning streams as it comes, but for a tail
    that could begin `</think>`. Without thinking, the same stop string cuts the reasoning, as before."""
    pieces = ["Let me th", "ink about it.<", "/think>The ans", "wer is ink."]
    out, hit = run_thinking_stops(pieces, ["ink"])
    assert hit and "".join(out) == "Let me think about it.</think>The answer is "
    assert out[:2] == ["Let me th", "ink about it."]  # "<" held: it could begin `</think>`
    assert run_stops(pieces, ["ink"]) == (["Let me th", ""], True)  # thinking off: cut in the reasoning
    for across in ("it.</think>The", "k>The", "</think>"):
        out, hit = run_thinking_stops(pieces, [across])
        assert not hit and "".join(out) == "".join(pieces), across
    # the answer starts at a tool-call opener written before any `</think>` (the chat parser's tool block)
    opener = f"{TOOL_CALLS_START}>"
    out, hit = run_thinking_stops(["plan: call", opener[:3], opener[3:] + "x"], ["call", "DSML"])
    assert hit and "".join(out) == "plan: call" + opener[: opener.index("DSML")]
    assert run_thinking_stops(["no stop here"], []) == (["no stop here", ""], False)  # nothing held without stops


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(["a", "b", "<", "/", "think>", "</think>", "k>"]), max_size=14),
    st.lists(st.text("ab<>/k", min_size=1, max_size=4), min_size=1, max_size=3),
    st.lists(st.integers(0, 40), max_size=6),
)
def test_thinking_stops_match_the_one_shot_answer(parts: list[str], stops: list[str], cuts: list[int]) -> None:
    """However the text is cut into pieces: the reasoning (up to the first `</think>`) is never cut, and the text
    is cut at the earliest stop string in what follows it, as a search of the answer alone would cut it."""
    text = "".join(parts)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    out, hit = run_thinking_stops([text[a:b] for a, b in itertools.pairwise(bounds)], stops)
    end = text.find(THINK_END)
    answer = len(text) if end < 0 else end + len(THINK_END)
    first = min((i for i in (text.find(s, answer) for s in stops) if i >= 0), default=None)
    expect = text if first is None else text[:first]
    assert "".join(out) == expect and hit == (first is not None)
    acc = ""
    for piece in out:  # nothing released is taken back
        acc += piece
        assert expect.startswith(acc)


# --- stream_generate with a scripted model and the real tokenizer -------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from fastar.engine.tokenizer import Tokenizer

    return Tokenizer.default()


class ScriptState:
    max_rollback = None  # as `ModelState`'s: every position kept, so no anchor

    def __init__(self) -> None:
        self.length = 0

    def truncate(self, p: int) -> None:
        self.length = p


class ScriptRunner:
    """Emits `script` after a prompt of `prompt_len` tokens (then `filler` forever), as one-hot logits."""

    prefill_chunk = prefill_span = 8

    def __init__(self, vocab: int, prompt_len: int, script: list[int], filler: int = 13) -> None:
        self.vocab, self.prompt_len, self.script, self.filler = vocab, prompt_len, script, filler
        self.runs = 0

    def check_open(self) -> None:  # never closed
        pass

    def new_state(self) -> ScriptState:
        return ScriptState()

    def prefill(self, ids: list[int], state: ScriptState, argmax_only: bool = False) -> torch.Tensor:
        self.runs += len(ids)
        state.length += len(ids)
        i = state.length - self.prompt_len
        tok = self.script[i] if 0 <= i < len(self.script) else self.filler
        logits = torch.full((1, self.vocab), -30.0)
        logits[0, tok] = 10.0
        return logits


def scripted(tokenizer, script: list[int], prompt: list[int] | None = None, context_length: int = 200):
    prompt = prompt or [100, 101, 102]
    runner = ScriptRunner(tokenizer.vocab_size, len(prompt), script)
    s = Session(runner, context_length=context_length, vocab_size=tokenizer.vocab_size, tokenizer=tokenizer)
    return s, prompt, runner


def chunks_of(s: Session, prompt, **kw) -> list[GenerationChunk]:
    cancel = kw.pop("cancel", None)
    progress = kw.pop("progress", None)
    return list(
        stream_generate(s, prompt, SamplingParams(**kw), eos_token_id=EOS, cancel=cancel, on_prefill_progress=progress)
    )


def test_utf8_split_across_tokens_is_held_until_whole(tokenizer) -> None:
    parrot = tokenizer.encode("🦜")
    assert len(parrot) == 3  # four UTF-8 bytes in three tokens
    s, prompt, _ = scripted(tokenizer, tokenizer.encode("A") + parrot + tokenizer.encode("B") + [EOS])
    out = chunks_of(s, prompt, max_tokens=20)
    assert [c.text for c in out] == ["A", "", "", "🦜", "B", ""]
    assert out[-1].finish_reason == "stop" and out[-1].token == EOS


def test_utf8_cut_by_max_tokens_ends_in_a_replacement_char(tokenizer) -> None:
    s, prompt, _ = scripted(tokenizer, tokenizer.encode("A🦜"))
    out = chunks_of(s, prompt, max_tokens=2)
    assert "".join(c.text for c in out) == "A\ufffd" and out[-1].finish_reason == "length"


def test_stop_string_across_token_boundaries(tokenizer) -> None:
    script = tokenizer.encode("Hello world, stop here")  # Hello| world|,| stop| here
    s, prompt, _ = scripted(tokenizer, script)
    out = chunks_of(s, prompt, max_tokens=20, stop=["lo wor"])
    acc = ""
    for c in out:
        acc += c.text
        assert "Hel".startswith(acc)  # nothing of "lo wor" is ever shown
    assert acc == "Hel" and out[-1].finish_reason == "stop" and out[-1].token == script[1]
    assert len(out) == 2


def test_stop_string_released_when_generation_ends_undecided(tokenizer) -> None:
    s, prompt, _ = scripted(tokenizer, tokenizer.encode("Hello wor") + [EOS])
    out = chunks_of(s, prompt, max_tokens=20, stop=["world"])
    assert generate_text(iter(out)) == "Hello wor" and out[-1].finish_reason == "stop"


def test_stop_tokens_and_eos(tokenizer) -> None:
    script = tokenizer.encode("Hello world") + [EOS]
    s, prompt, _ = scripted(tokenizer, script)
    out = chunks_of(s, prompt, max_tokens=20, stop_token_ids=[script[1]])
    assert "".join(c.text for c in out) == "Hello" and out[-1].finish_reason == "stop"
    s, prompt, _ = scripted(tokenizer, script + [5, 6])
    out = chunks_of(s, prompt, max_tokens=4, ignore_eos=True)
    assert [c.token for c in out] == script + [5] and out[-1].finish_reason == "length"


def test_max_tokens_usage_and_logprobs(tokenizer) -> None:
    s, prompt, runner = scripted(tokenizer, tokenizer.encode("one two three four five"))
    out = chunks_of(s, prompt, max_tokens=3, logprobs=2)
    assert len(out) == 3 and [c.finish_reason for c in out] == [None, None, "length"]
    assert out[-1].usage == {"prompt_tokens": 3, "completion_tokens": 3, "cached_tokens": 0}
    assert all(c.logprob == pytest.approx(0.0, abs=1e-6) and len(c.top_logprobs) == 2 for c in out)
    assert runner.runs == 3 + 2  # the prompt, then only the tokens that were needed: the last one never runs
    assert s.num_tokens == 6 and s.num_processed == 5
    zero = chunks_of(s, prompt, max_tokens=0)
    assert len(zero) == 1 and zero[0].finish_reason == "length" and zero[0].text == ""


def test_generation_stops_at_the_context_length(tokenizer) -> None:
    s, prompt, _ = scripted(tokenizer, [], context_length=6)
    out = chunks_of(s, prompt, max_tokens=50)
    assert len(out) == 3 and out[-1].finish_reason == "length" and s.num_tokens == 6


def test_prompt_errors_come_before_any_chunk(tokenizer) -> None:
    s, _, runner = scripted(tokenizer, [], context_length=10)

    def start(prompt):  # raised by the call itself, so a server can still answer 400 instead of a stream
        return stream_generate(s, prompt, SamplingParams(), eos_token_id=EOS)

    with pytest.raises(PromptError, match="empty"):
        start([])
    with pytest.raises(PromptError, match=r"12 tokens.*10"):
        start(list(range(12)))
    with pytest.raises(PromptError, match="empty"):
        start("")
    assert runner.runs == 0


def test_cancel_stops_at_the_next_token(tokenizer) -> None:
    s, prompt, runner = scripted(tokenizer, tokenizer.encode("a b c d e f g h"))
    cancel = threading.Event()
    out = []
    for c in stream_generate(s, prompt, SamplingParams(max_tokens=50), eos_token_id=EOS, cancel=cancel):
        out.append(c)
        if len(out) == 2:
            cancel.set()
    assert len(out) == 3 and out[-1].finish_reason == "cancelled" and out[-1].usage["completion_tokens"] == 3
    assert runner.runs == 3 + 2


def test_cancel_during_prefill(tokenizer) -> None:
    s, _, _ = scripted(tokenizer, [], prompt=list(range(100, 120)))
    cancel = threading.Event()
    out = chunks_of(
        s, list(range(100, 120)), max_tokens=5, cancel=cancel, progress=lambda done, total: done and cancel.set()
    )
    assert len(out) == 1 and out[0].token is None and out[0].finish_reason == "cancelled"
    assert s.num_processed == 8  # one prefill chunk, kept for the next request


def test_text_prompt_and_chat_result(tokenizer) -> None:
    s, _, _ = scripted(tokenizer, tokenizer.encode("Sure</think>Fine") + [EOS], prompt=tokenizer.encode("Hi"))
    assert generate_text(stream_generate(s, "Hi", SamplingParams(), eos_token_id=EOS)) == "Sure</think>Fine"
    r = ChatResult("Fine", reasoning="Sure", finish_reason="stop")
    assert r == "Fine" and r.reasoning == "Sure"
    assert r.to_message() == {"role": "assistant", "content": "Fine", "reasoning_content": "Sure"}


# --- the tiny model ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_ckpt: Path, tmp_path_factory):
    from fastar.convert.hf import convert
    from fastar.engine.engine import load

    return load(convert(tiny_ckpt, tmp_path_factory.mktemp("tiny-fst") / "tiny.fst"))


PROMPT = [5, 17, 99, 3, 250, 7, 8, 300, 12]


def test_a_prompt_that_is_neither_text_nor_token_ids_is_a_type_error_naming_it(engine) -> None:
    """None, a number, bytes (which iterate as ints), float ids (which were rounded into tokens) or strings in an id
    list: a one-line TypeError from every entry point, where some ran and others failed deep inside."""
    import numpy as np

    sched = engine.scheduler()
    calls = {
        "generate": lambda p: engine.generate(p, max_tokens=1),
        "prompt_logprobs": engine.prompt_logprobs,
        "perplexity": lambda p: engine.perplexity(p, ctx=4),
        "scheduler": lambda p: sched.submit(p, max_tokens=1),
    }
    for name, call in calls.items():
        for bad, says in ((None, "got NoneType"), (5, "got int"), (b"hi", "got bytes")):
            with pytest.raises(
                TypeError, match=f"^a prompt is text \\(str\\) or token ids \\(a list of int\\), {says}$"
            ):
                call(bad)
        for ids, says in (([5, 1.5], "got 1.5 \\(float\\)"), ([5, "6"], "got '6' \\(str\\)"), ([5, True], "got True")):
            with pytest.raises(TypeError, match=f"^token ids must be integers, {says}"):
                call(ids)
    short = PROMPT[:4]
    assert engine.generate(np.array(short), max_tokens=2, ignore_eos=True) == engine.generate(
        short, max_tokens=2, ignore_eos=True
    )


def test_other_bad_arguments_are_named(engine, tiny_ckpt) -> None:
    """A session of another engine (which ran on that engine, not this one), something that is not a session or a
    SamplingParams, `top` beyond the vocabulary (a RuntimeError from torch's topk), a ctx that is not an integer."""
    from fastar.engine.engine import load

    with load(tiny_ckpt) as other, pytest.raises(ValueError, match=r"^the session belongs to another engine"):
        engine.generate(PROMPT, max_tokens=1, session=other.open_session())
    with pytest.raises(TypeError, match=r"^session must be a Session from open_session\(\), got str$"):
        engine.generate(PROMPT, max_tokens=1, session="chat-1")
    with pytest.raises(TypeError, match=r"^params must be a SamplingParams .*got dict$"):
        engine.stream(PROMPT, {"max_tokens": 1})
    vocab = engine.config.vocab_size
    with pytest.raises(ValueError, match=f"^top must be an integer in \\[0, {vocab}\\]"):
        engine.prompt_logprobs(PROMPT, top=vocab + 1)
    assert len(engine.prompt_logprobs(PROMPT[:3], top=vocab).top[1]) == vocab
    for bad in ({"ctx": "8"}, {"ctx": 8.0}, {"ctx": 8, "stride": 2.5}):
        with pytest.raises(TypeError, match="must be an integer, got"):
            engine.perplexity(PROMPT, **bad)
    with pytest.raises(ValueError, match=r"^max_tokens must be an integer >= 0, got -1$"):
        engine.generate_tokens(PROMPT, -1)


def test_chat_scheduler_and_stream_arguments_of_the_wrong_kind_are_named(engine) -> None:
    """A conversation ending with an assistant or system message (the model would write on after its own EOS, where
    the server answers a 400), `thinking` that is not a bool, a `cancel` or progress callback of the wrong kind, a
    dict for the scheduler's params, a non-integer max_batch, serve_batch without pairs, an uncompiled grammar."""
    from fastar.encoding import EncodingError

    hi = {"role": "user", "content": "hi"}
    for last in ("assistant", "system"):
        with pytest.raises(
            EncodingError, match=f"^the conversation must end with a user or tool message, not '{last}'"
        ):
            engine.chat([hi, {"role": last, "content": "ok"}], max_tokens=1)
    with pytest.raises(TypeError, match=r"^thinking must be True or False, got 'yes'$"):
        engine.chat([hi], thinking="yes", max_tokens=1)
    with pytest.raises(TypeError, match=r"^cancel must be a threading.Event, got bool$"):
        engine.stream(PROMPT, max_tokens=1, cancel=True)
    with pytest.raises(TypeError, match=r"^on_prefill_progress must be callable"):
        engine.stream(PROMPT, max_tokens=1, on_prefill_progress=5)
    with pytest.raises(TypeError, match=r"^params must be a SamplingParams .*got dict$"):
        engine.scheduler().submit(PROMPT, {"max_tokens": 1})
    with pytest.raises(TypeError, match=r"^max_batch must be an integer, got '2'$"):
        engine.scheduler(max_batch="2")
    with pytest.raises(TypeError, match=r"^serve_batch takes \(prompt, params or a dict of sampling keywords\) pairs"):
        engine.serve_batch([PROMPT])
    with pytest.raises(TypeError, match=r"^compile_grammar takes a constraint.Grammar"):
        engine.compile_grammar("start: 'a'")  # (a Grammar compiles: tests/test_constraint.py)


def test_generate_tokens_and_open_session_check_their_arguments_as_stream_does(engine) -> None:
    """`generate_tokens` checked only `temperature < 0` and `max_tokens`: a NaN temperature and a str seed failed
    inside torch ("probability tensor contains either inf, nan", "manual_seed expected a long"), a str temperature
    with "'<' not supported", and `ignore_eos="no"` (true) ran past EOS; `open_session(anchor="no")` kept the
    anchor. Each is one line naming the argument now."""
    from fastar.engine.sampling import SamplingError

    for kw, says in (
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
        ({"temperature": "0"}, "temperature must be a finite number >= 0, got '0'"),
        ({"temperature": 1.0, "seed": "x"}, "seed must be None or an integer"),
        ({"ignore_eos": "no"}, "ignore_eos must be true or false, got 'no'"),
    ):
        with pytest.raises(SamplingError, match=f"^{re.escape(says)}"):
            engine.generate_tokens(PROMPT, 2, **kw)
    with pytest.raises(TypeError, match=r"^anchor must be True or False, got 'no'$"):
        engine.open_session(anchor="no")


def test_scheduler_arguments_that_failed_in_the_worker_are_named_at_the_call(engine, tmp_path) -> None:
    """`submit(on_chunk="x")` or `cancel="x"` was queued and failed at the worker's step, ending every request of
    the batch with its TypeError/AttributeError; `keep_states="x"` failed in a comparison, `draft="no"` drafted,
    `prefix_cache=""` made the cache in the current directory and a file in its place was a bare FileExistsError.
    Each is one line at the call now, and nothing is queued."""
    from fastar.errors import FastarError

    sched = engine.scheduler()
    for kw, says in (
        ({"on_chunk": "x"}, "on_chunk must be callable, got 'x'"),
        ({"on_error": 5}, "on_error must be callable, got 5"),
        ({"on_progress": "x"}, "on_progress must be callable as (done, total), got 'x'"),
        ({"cancel": "x"}, "cancel must be a threading.Event, got str"),
    ):
        with pytest.raises(TypeError, match=f"^{re.escape(says)}$"):
            sched.submit(PROMPT, max_tokens=1, **kw)
    assert sched.idle
    for kw, says in (
        ({"keep_states": "x"}, "keep_states must be an integer, got 'x'"),
        ({"keep_states": None}, "keep_states must be an integer, got None"),
        ({"draft": "no"}, "draft must be True or False, got 'no'"),
        ({"prefix_cache": ""}, "the prefix cache folder must be a non-empty path, got ''"),
        ({"prefix_cache": 5}, "the prefix cache folder must be a non-empty path, got 5"),
    ):
        with pytest.raises(TypeError, match=f"^{re.escape(says)}$"):
            engine.scheduler(**kw)
    taken = tmp_path / "a-file"
    taken.write_text("x")
    with pytest.raises(FastarError, match=f"^{re.escape(str(taken))}: cannot be the cache folder \\(File exists\\)$"):
        engine.scheduler(prefix_cache=taken)


def test_engine_folder_arguments_of_the_wrong_kind_are_named(engine) -> None:
    """`warm_experts(5)` was pathlib's "argument should be a str or an os.PathLike object" naming no argument (and
    nothing at all without an expert cache), `warm_experts("")` and `load(warm_experts="")` put the usage profile
    in the current directory. Each is one line naming the argument, as `open_prefix_cache(5)` is."""
    from fastar.engine.engine import load

    for call, says in (
        (lambda: engine.warm_experts(5), "the usage profile folder (profile_dir) must be a non-empty path, got 5"),
        (lambda: engine.warm_experts(""), "the usage profile folder (profile_dir) must be a non-empty path, got ''"),
        (lambda: engine.open_prefix_cache(5), "the prefix cache folder must be a non-empty path, got 5"),
        (
            lambda: load(engine.source, warm_experts=""),
            "warm_experts must be True, False or a folder (of the usage profile), got ''",
        ),
    ):
        with pytest.raises(TypeError, match=f"^{re.escape(says)}$"):
            call()
    assert engine.warm_status() == {"status": "off"}  # nothing started


def test_id_only_entry_points_say_they_take_ids_and_prompt_logprobs_takes_no_session(engine) -> None:
    """`logits` and `generate_tokens` given text said "a prompt is text (str) or token ids"; `stream` with
    `prompt_logprobs` and a session ignored the session (it scores from a fresh state)."""
    for name, call in (("logits", engine.logits), ("generate_tokens", lambda p: engine.generate_tokens(p, 1))):
        with pytest.raises(TypeError, match=rf"^{name} takes token ids \(a list of int; encode text"):
            call("hello")
    with pytest.raises(ValueError, match=r"^prompt_logprobs scores the prompt from a fresh state: pass no session"):
        engine.stream(PROMPT, max_tokens=1, prompt_logprobs=0, session=engine.open_session())


def test_interleaved_generations_on_one_session_fail_instead_of_mixing_tokens(engine) -> None:
    """Two streams on one session (the engine's own, when none is passed) interleaved: the first, resumed after the
    second ran, went on from the second's timeline and returned wrong tokens without a word. It raises
    `SessionInUse` now; a stream left unfinished (a loop broken out of) simply loses the session to the next."""
    from fastar.engine.session import SessionInUse

    alone = [c.token for c in engine.stream(PROMPT, max_tokens=5, ignore_eos=True, session=engine.open_session())]
    for session in (None, engine.open_session()):
        first = engine.stream(PROMPT, max_tokens=5, ignore_eos=True, session=session)
        assert [next(first).token for _ in range(2)] == alone[:2]
        engine.generate(PROMPT[:3], max_tokens=2, ignore_eos=True, session=session)
        with pytest.raises(SessionInUse, match=r"^another generation ran on this session since this one started"):
            next(first)
        left = engine.stream(PROMPT, max_tokens=5, ignore_eos=True, session=session)
        next(left)  # abandoned
        assert [c.token for c in engine.stream(PROMPT, max_tokens=5, ignore_eos=True, session=session)] == alone
    assert issubclass(SessionInUse, RuntimeError)


def test_changing_a_session_under_an_unfinished_generation_is_refused(engine, tmp_path) -> None:
    """`Session.rewind` (and `reset`, `resume`, `load`) while a stream on the session was suspended changed the
    timeline under it: its next token came from a state it had not left. They raise `SessionInUse` now, the stream
    goes on with its own tokens, and once it is exhausted or closed the session is the caller's again."""
    from fastar.engine.session import SessionInUse

    alone = [c.token for c in engine.stream(PROMPT, max_tokens=5, ignore_eos=True, session=engine.open_session())]
    s = engine.open_session()
    s.save(tmp_path / "s.bin")
    stream = engine.stream(PROMPT, max_tokens=5, ignore_eos=True, session=s)
    got = [next(stream).token for _ in range(2)]
    state = engine.new_state()
    for what, call in (
        ("rewind", lambda: s.rewind(3)),
        ("reset", s.reset),
        ("reset", lambda: s.resume(PROMPT, state)),
        ("load into", lambda: s.load(tmp_path / "s.bin")),
    ):
        with pytest.raises(SessionInUse, match=rf"^cannot {what} this session while a generation on it is unfinished"):
            call()
    got += [c.token for c in stream]
    assert got == alone and s.tokens == PROMPT + alone
    s.rewind(len(PROMPT) + 2)  # exhausted: the caller's again
    assert s.tokens == PROMPT + alone[:2]
    stream = engine.stream(PROMPT, max_tokens=5, ignore_eos=True, session=s)
    next(stream)
    stream.close()  # closed early: free too
    s.rewind(3)
    assert s.tokens == PROMPT[:3]


@pytest.mark.parametrize(
    "option,value,error,says",
    [
        ("head_screen", "no", TypeError, "head_screen must be True or False, got 'no'"),  # "no" is truthy: was on
        ("verify", 0, TypeError, "verify must be True or False, got 0"),
        ("kernels", "yes", TypeError, "kernels must be True or False"),
        ("lookahead", None, TypeError, "lookahead must be True or False"),
        ("direct_io", "maybe", TypeError, "direct_io must be True, False or None"),
        ("max_rollback", -1, ValueError, "max_rollback must be an integer >= 0 or None, got -1"),  # was taken
        ("prefill_chunk", "512", ValueError, "prefill_chunk must be an integer >= 1, got '512'"),
        ("threads", 0, ValueError, "threads must be an integer >= 1 or None, got 0"),
        # True was a 1-byte budget (refused only as "smaller than one expert"), 1.5 one byte too
        ("ram_budget", True, TypeError, "ram_budget must be a number of bytes (int), a size such as '24G'"),
        ("ram_budget", 1.5e9, TypeError, "ram_budget must be a number of bytes (int)"),
        ("gpu_budget", False, TypeError, "gpu_budget must be a number of bytes (int)"),
        ("draft", True, TypeError, "draft must be a string or None, got True"),  # was taken as "true"
        ("ram_bugdet", "8G", TypeError, "load: unknown option 'ram_bugdet' (the options are kernels,"),
    ],
)
def test_load_options_of_the_wrong_kind_are_named_before_anything_is_read(tiny_ckpt, option, value, error, says):
    from fastar.engine.engine import load

    with pytest.raises(error, match=f"^{re.escape(says)}"):
        load(tiny_ckpt, **{option: value})


@pytest.mark.parametrize(
    "model,error,says",
    [
        # each was a raw pathlib message not naming load ("expected str, bytes or os.PathLike object, not int")
        (123, TypeError, "load takes a model path (a .fst file or a checkpoint directory, as str or os.PathLike) "),
        (None, TypeError, "load takes a model path"),
        (b"model.fst", TypeError, "load takes a model path"),
        # an object with a `tensor` attribute passed for a source, to fail later on its missing `config`
        (type("NotASource", (), {"tensor": None})(), TypeError, "load takes a model path"),
        (
            "",
            ValueError,
            "load: the model path '' is no path",
        ),  # "" was the current directory: "config.json is missing"
        ("m\0.fst", ValueError, "load: the model path 'm\\x00.fst' is no path"),  # was "embedded null byte"
    ],
)
def test_load_of_something_that_is_no_model_names_it(model, error, says) -> None:
    from fastar.engine.engine import load

    with pytest.raises(error, match=f"^{re.escape(says)}"):
        load(model)


def test_an_engine_of_a_path_says_to_load_it(tiny_ckpt) -> None:
    from fastar.engine.engine import Engine

    with pytest.raises(
        TypeError, match=r"^Engine takes an opened WeightSource, got PosixPath: use fastar.load\(path\)$"
    ):
        Engine(tiny_ckpt)


def test_load_of_a_fifo_or_device_is_refused_instead_of_blocking(tmp_path) -> None:
    """`fastar.load` of a FIFO blocked forever in open() waiting for a writer (the CLI checked, the library did
    not); a device was read as a file."""
    import os

    from fifo_helpers import call_bounded

    from fastar.engine.engine import load
    from fastar.errors import FormatError

    fifo = tmp_path / "model.fst"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        errors, hung = call_bounded(lambda: load(path), fifo)
        assert not hung, f"load({path}) blocked"
        (err,) = errors
        assert isinstance(err, FormatError) and str(err) == f"{path}: not a regular file or checkpoint directory"


# After `Engine.close()`, every public name of Engine and Session: a call that runs the model, opens, changes, reads
# out or saves a session, or sets the engine up raises `EngineClosed`; what the engine reports stays readable (the
# server's /metrics reads `stats()` while it shuts down; a stream closed after the engine releases its session).
CLOSED_CALLS = {
    "Engine": {
        "check_open": lambda c: c.engine.check_open(),
        "use_draft": lambda c: c.engine.use_draft(None),
        "new_state": lambda c: c.engine.new_state(),
        "prefill": lambda c: c.engine.prefill(PROMPT, c.state),
        "logits": lambda c: c.engine.logits(PROMPT),
        "prompt_logprobs": lambda c: c.engine.prompt_logprobs(PROMPT),
        "perplexity": lambda c: c.engine.perplexity(PROMPT, ctx=4),
        "generate_tokens": lambda c: c.engine.generate_tokens(PROMPT, 1),
        "compile_grammar": lambda c: c.engine.compile_grammar(c.grammar),
        "context_length": lambda c: setattr(c.engine, "context_length", 64),
        "open_session": lambda c: c.engine.open_session(),
        "stream": lambda c: c.engine.stream(PROMPT, max_tokens=1),
        "generate": lambda c: c.engine.generate(PROMPT, max_tokens=1, session=c.session),
        "chat": lambda c: c.engine.chat([{"role": "user", "content": "hi"}], max_tokens=1),
        "warm_experts": lambda c: c.engine.warm_experts(),
        "scheduler": lambda c: c.engine.scheduler(),
        "serve_batch": lambda c: c.engine.serve_batch([(PROMPT, {"max_tokens": 1})]),
        "open_prefix_cache": lambda c: c.engine.open_prefix_cache(c.tmp / "prefixes"),
    },
    "Session": {
        "claim": lambda c: c.session.claim(),
        "resume": lambda c: c.session.resume(PROMPT, c.state),
        "processed": lambda c: c.session.processed(),
        "reset": lambda c: c.session.reset(),
        "rewind": lambda c: c.session.rewind(1),
        "roll_back": lambda c: c.session.roll_back(1),
        "encode_prompt": lambda c: c.session.encode_prompt(PROMPT),
        "check_prompt": lambda c: c.session.check_prompt(PROMPT),
        "prefill": lambda c: c.session.prefill(PROMPT),
        "append": lambda c: c.session.append(1),
        "decode": lambda c: c.session.decode(),
        "save": lambda c: c.session.save(c.tmp / "saved.session"),
        "load": lambda c: c.session.load(c.saved),
    },
}
READABLE_AFTER_CLOSE = {
    "Engine": {
        "close": lambda c: c.engine.close(),  # idempotent
        "stats": lambda c: c.engine.stats(),
        "counters": lambda c: c.engine.counters,
        "warm_status": lambda c: c.engine.warm_status(),
        "load_progress": lambda c: c.engine.load_progress(),
        "context_length": lambda c: c.engine.context_length,
        "context_note": lambda c: c.engine.context_note,
        "tokenizer": lambda c: c.engine.tokenizer,
        "paged_chunk": lambda c: c.engine.paged_chunk,
        "prefill_span": lambda c: c.engine.prefill_span,
        "model_name_default": lambda c: c.engine.model_name_default,
        "MAX_DEFAULT_CONTEXT": lambda c: c.engine.MAX_DEFAULT_CONTEXT,
    },
    "Session": {
        "runner": lambda c: c.session.runner,
        "tokens": lambda c: c.session.tokens,
        "num_tokens": lambda c: c.session.num_tokens,
        "num_processed": lambda c: c.session.num_processed,
        "generation": lambda c: c.session.generation,
        "holds": lambda c: c.session.holds(object()),
        "check_claim": lambda c: c.session.check_claim(c.session.generation),  # a stream's own check
        "release": lambda c: c.session.release(object()),  # a stream closed after the engine frees its session
    },
}


@pytest.fixture(scope="module")
def closed_engine(tiny_ckpt, tmp_path_factory):
    """A closed engine, a session of it that held a prompt (saved before the close) and a state made before."""
    from types import SimpleNamespace

    from fastar.engine.constraint import output_grammar
    from fastar.engine.engine import load

    tmp = tmp_path_factory.mktemp("closed")
    eng = load(tiny_ckpt)
    session = eng.open_session()
    session.prefill(PROMPT)
    session.append(1)
    saved = session.save(tmp / "before.session")
    state = eng.new_state()
    eng.close()
    return SimpleNamespace(
        engine=eng,
        session=session,
        state=state,
        saved=saved,
        tmp=tmp,
        grammar=output_grammar(thinking=False, json_object=True),
    )


def test_every_public_name_of_engine_and_session_is_checked_after_close() -> None:
    """A method added to Engine or Session must say here whether it raises after close() or stays readable."""
    from fastar.engine.engine import Engine

    for cls in (Engine, Session):
        public = {name for name in dir(cls) if not name.startswith("_")}
        named = set(CLOSED_CALLS[cls.__name__]) | set(READABLE_AFTER_CLOSE[cls.__name__])
        assert public == named, f"{cls.__name__}: unlisted {sorted(public - named)}, gone {sorted(named - public)}"


@pytest.mark.parametrize(
    "owner, name",
    [pytest.param(owner, name, id=f"{owner}.{name}") for owner, calls in CLOSED_CALLS.items() for name in calls],
)
def test_a_closed_engine_says_so_at_every_entry_point(closed_engine, owner, name) -> None:
    """After `close()` every call of Engine and Session is a one-line `EngineClosed` (a RuntimeError), where some said
    the expert cache was closed, and opening a session or a scheduler, or saving a session, still worked. Nothing is
    written and the session is left as it was."""
    from fastar.errors import EngineClosed

    c = closed_engine
    before = (c.session.tokens, c.session.num_processed, sorted(p.name for p in c.tmp.iterdir()))
    with pytest.raises(
        EngineClosed, match=r"^this engine is closed \(Engine.close\(\) was called\): load the model again$"
    ):
        CLOSED_CALLS[owner][name](c)
    assert (c.session.tokens, c.session.num_processed, sorted(p.name for p in c.tmp.iterdir())) == before
    assert issubclass(EngineClosed, RuntimeError)


@pytest.mark.parametrize(
    "owner, name",
    [
        pytest.param(owner, name, id=f"{owner}.{name}")
        for owner, calls in READABLE_AFTER_CLOSE.items()
        for name in calls
    ],
)
def test_what_a_closed_engine_reports_stays_readable(closed_engine, owner, name) -> None:
    READABLE_AFTER_CLOSE[owner][name](closed_engine)


def test_greedy_is_deterministic_and_matches_the_reference_loop(engine) -> None:
    a = [c.token for c in engine.stream(PROMPT, max_tokens=4, ignore_eos=True, session=engine.open_session())]
    s = engine.open_session()
    b = [c.token for c in engine.stream(PROMPT, max_tokens=4, ignore_eos=True, session=s)]
    assert a == b == engine.generate_tokens(PROMPT, 4, ignore_eos=True)
    # and again in the same session: the prompt is reused (one token re-run for its logits)
    before = engine.stats()["prefill_tokens_computed"]
    c = [c.token for c in engine.stream(PROMPT, max_tokens=4, ignore_eos=True, session=s)]
    assert c == a and engine.stats()["prefill_tokens_computed"] - before == 1


def test_seed_reproduces_sampled_text(engine) -> None:
    def run(seed: int) -> list[int]:
        return [
            c.token
            for c in engine.stream(
                PROMPT, temperature=1.0, seed=seed, max_tokens=4, ignore_eos=True, session=engine.open_session()
            )
        ]

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_engine_surface(engine) -> None:
    assert engine.context_length == 4096  # tiny: max_position_embeddings, under the cap
    engine.context_length = 64
    try:
        with pytest.raises(PromptError, match="64"):
            list(engine.stream(list(range(70)), max_tokens=1))
    finally:
        engine.context_length = 4096
    with pytest.raises(ValueError):
        engine.context_length = 10**9
    assert engine.model_name_default == "deepseek-v4-flash" and engine.load_progress() == 1.0
    stats = engine.stats()
    for key in (
        "prompt_tokens",
        "generated_tokens",
        "prefill_tokens_computed",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
    ):
        assert key in stats
