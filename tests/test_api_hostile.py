"""The Python API against hostile input, as a library user meets it (`scripts/api_probe.py` sweeps the same on the
demo model): every refused call is one line of a built-in-compatible type (TypeError for a wrong kind or an unknown
keyword, ValueError for a bad value, FileNotFoundError for a missing model) raised at the call, before any model work,
and the engine gives the same greedy tokens after it as before."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from fastar.engine.engine import load
from fastar.engine.sampling import SamplingError, SamplingParams
from fastar.engine.session import PromptError
from fastar.errors import ConfigError, FormatError

PROMPT = [5, 17, 99, 3, 250, 7, 8, 300, 12]
CONTEXT = 64
HI = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def engine(tiny_fst_path: Path):
    with load(tiny_fst_path) as eng:
        eng.context_length = CONTEXT
        yield eng


def greedy(engine, prompt=PROMPT, n=4) -> list[int]:
    return [c.token for c in engine.stream(prompt, max_tokens=n, ignore_eos=True, session=engine.open_session())]


@pytest.fixture(scope="module")
def reference(engine) -> list[int]:
    return greedy(engine)


# (call, the exception types it must be, the message's start): each of these ran, failed deep or said something else
# before (the comment says what)
REFUSED = {
    # a typo in a sampling keyword was a SamplingError (a ValueError) where Python, mlx-lm and llama-cpp-python raise
    # a TypeError for an unexpected keyword; it is both now, and names the parameter meant
    "typo in generate": (
        lambda e: e.generate(PROMPT, max_token=2),
        (TypeError, SamplingError),
        "unknown sampling parameter 'max_token' (did you mean 'max_tokens'? known: banned_token_ids,",
    ),
    "typo in stream": (
        lambda e: e.stream(PROMPT, temprature=0.5),
        (TypeError, SamplingError),
        "unknown sampling parameter 'temprature' (did you mean 'temperature'? known:",
    ),
    "typo in chat": (
        lambda e: e.chat([HI], max_token=2),
        (TypeError, SamplingError),
        "unknown sampling parameter 'max_token' (did you mean 'max_tokens'?",
    ),
    "typo in submit": (
        lambda e: e.scheduler().submit(PROMPT, max_token=2),
        (TypeError, SamplingError),
        "unknown sampling parameter 'max_token' (did you mean 'max_tokens'?",
    ),
    "another library's keyword": (
        lambda e: e.generate(PROMPT, echo=True),
        (TypeError, SamplingError),
        "unknown sampling parameter 'echo' (known: banned_token_ids,",
    ),
    # serve_batch's dicts went to SamplingParams(**kw): "SamplingParams.__init__() got an unexpected keyword argument"
    "typo in serve_batch": (
        lambda e: e.serve_batch([(PROMPT, {"max_token": 2})]),
        (TypeError, SamplingError),
        "unknown sampling parameter 'max_token' (did you mean 'max_tokens'?",
    ),
    # None: "'NoneType' object is not iterable"; a str: "... pairs, got 'h'"
    "serve_batch of None": (
        lambda e: e.serve_batch(None),
        (TypeError,),
        "serve_batch takes a list of (prompt, params or a dict of sampling keywords) pairs, got NoneType",
    ),
    "serve_batch of a str": (
        lambda e: e.serve_batch("hi"),
        (TypeError,),
        "serve_batch takes a list of (prompt, params or a dict of sampling keywords) pairs, got str",
    ),
    # a dict iterated as its keys ("token ids must be integers, got 'a' (str)"), a set in no order (it ran)
    "dict prompt": (
        lambda e: e.generate({"a": 1}, max_tokens=2),
        (TypeError,),
        "a prompt is text (str) or token ids (a list of int), got dict",
    ),
    "set prompt": (
        lambda e: e.generate({5, 17, 99}, max_tokens=2),
        (TypeError,),
        "a prompt is text (str) or token ids (a list of int), got set",
    ),
    "dict prompt to the scheduler": (
        lambda e: e.scheduler().submit({5: 1}, max_tokens=2),
        (TypeError,),
        "a prompt is text (str) or token ids (a list of int), got dict",
    ),
    # "no" is true: the thinking was kept
    "drop_thinking not a bool": (
        lambda e: e.chat([HI], drop_thinking="no", max_tokens=2),
        (TypeError,),
        "drop_thinking must be True or False, got 'no'",
    ),
    # a logit_bias id beyond the vocabulary failed at the first token's draw, after the prefill (the scheduler's
    # handle: "generation failed: ..."); stop and banned ids beyond it were ignored
    "logit_bias beyond the vocabulary, at stream's call": (
        lambda e: e.stream(PROMPT, max_tokens=2, logit_bias={1029: 1.0}),
        (SamplingError, ValueError),
        "logit_bias names token 1029, beyond the 1024 of the vocabulary",
    ),
    "logit_bias beyond the vocabulary, at submit": (
        lambda e: e.scheduler().submit(PROMPT, max_tokens=2, logit_bias={1029: 1.0}),
        (SamplingError, ValueError),
        "logit_bias names token 1029, beyond the 1024 of the vocabulary",
    ),
    "stop_token_ids beyond the vocabulary": (
        lambda e: e.stream(PROMPT, max_tokens=2, stop_token_ids=[3, 5000]),
        (SamplingError, ValueError),
        "stop_token_ids names token 5000, beyond the 1024 of the vocabulary",
    ),
    "banned_token_ids beyond the vocabulary": (
        lambda e: e.scheduler().submit(PROMPT, SamplingParams(max_tokens=2, banned_token_ids=[1024])),
        (SamplingError, ValueError),
        "banned_token_ids names token 1024, beyond the 1024 of the vocabulary",
    ),
    # `logits` and `generate_tokens` ran past the context ("prefill needs at least one token" for none)
    "logits past the context": (
        lambda e: e.logits(list(range(CONTEXT + 1))),
        (PromptError, ValueError),
        f"the prompt is {CONTEXT + 1} tokens, but the context length is {CONTEXT} tokens",
    ),
    "logits of nothing": (lambda e: e.logits([]), (PromptError, ValueError), "the prompt is empty"),
    "generate_tokens with no room for a reply": (
        lambda e: e.generate_tokens(list(range(CONTEXT)), 2),
        (PromptError, ValueError),
        f"the prompt is {CONTEXT} tokens, but the context length is {CONTEXT} tokens (it must be shorter, to leave "
        "room for the reply)",
    ),
    "generate_tokens of nothing": (
        lambda e: e.generate_tokens([], 2),
        (PromptError, ValueError),
        "the prompt is empty",
    ),
    # a FastarError only, where every other empty prompt is a ValueError
    "perplexity of nothing": (
        lambda e: e.perplexity([], ctx=4),
        (PromptError, ValueError),
        "nothing to score: the text is 0 token(s), it needs at least 2",
    ),
}

# refused well already: pinned here so the sweep's cases stay as they are
HELD = {
    "bytes prompt": (lambda e: e.generate(b"hi", max_tokens=2), (TypeError,), "a prompt is text (str) or token ids"),
    "float max_tokens": (
        lambda e: e.generate(PROMPT, max_tokens=1.5),
        (SamplingError, ValueError),
        "max_tokens must be an integer >= 0, got 1.5",
    ),
    "negative max_tokens": (
        lambda e: e.generate(PROMPT, max_tokens=-1),
        (SamplingError, ValueError),
        "max_tokens must be an integer >= 0, got -1",
    ),
    "temperature -1": (
        lambda e: e.generate(PROMPT, temperature=-1),
        (SamplingError, ValueError),
        "temperature must be a finite number >= 0, got -1",
    ),
    "temperature inf": (
        lambda e: e.generate(PROMPT, temperature=float("inf")),
        (SamplingError, ValueError),
        "temperature must be a finite number >= 0, got inf",
    ),
    "top_p 0": (lambda e: e.generate(PROMPT, top_p=0), (SamplingError, ValueError), "top_p must be a number in (0, 1]"),
    "top_p 2": (lambda e: e.generate(PROMPT, top_p=2), (SamplingError, ValueError), "top_p must be a number in (0, 1]"),
    "top_k -5": (
        lambda e: e.generate(PROMPT, top_k=-5),
        (SamplingError, ValueError),
        "top_k must be an integer >= 0 (0 = off), got -5",
    ),
    "seed a str": (
        lambda e: e.generate(PROMPT, seed="x"),
        (SamplingError, ValueError),
        "seed must be None or an integer",
    ),
    "logit_bias with str keys": (
        lambda e: e.generate(PROMPT, logit_bias={"5": 1}),
        (SamplingError, ValueError),
        "logit_bias must be a dict of token id -> finite number",
    ),
    "stop an int": (
        lambda e: e.generate(PROMPT, stop=5),
        (SamplingError, ValueError),
        "stop must be a non-empty string or a list of non-empty strings, got 5",
    ),
    "stop with an empty string": (
        lambda e: e.generate(PROMPT, stop=["x", ""]),
        (SamplingError, ValueError),
        "stop must be a non-empty string or a list of non-empty strings",
    ),
    "empty prompt": (lambda e: e.generate([], max_tokens=2), (PromptError, ValueError), "the prompt is empty"),
    "prompt past the context": (
        lambda e: e.stream(list(range(CONTEXT + 5)), max_tokens=2),
        (PromptError, ValueError),
        f"the prompt is {CONTEXT + 5} tokens, but the context length is {CONTEXT} tokens",
    ),
    "None messages": (lambda e: e.chat(None), (ValueError,), "messages must be a non-empty list of dicts"),
    "a message without its role": (
        lambda e: e.chat([{"content": "hi"}]),
        (ValueError,),
        "messages[0]: unknown role None; expected one of",
    ),
    "a message without its content": (
        lambda e: e.chat([{"role": "user"}]),
        (ValueError,),
        "messages[0]: 'content' is required",
    ),
    "a content part of an unknown type": (
        lambda e: e.chat([{"role": "user", "content": [{"type": "hologram"}]}]),
        (ValueError,),
        "messages[0]: unsupported content part 'hologram' (the model reads text only)",
    ),
    "tool_calls not a list": (
        lambda e: e.chat([HI, {"role": "assistant", "tool_calls": "x"}, {"role": "tool", "content": "1"}]),
        (ValueError,),
        "messages[1]: 'tool_calls' must be a list",
    ),
}


def check_refused(engine, reference, call, kinds, says) -> None:
    with pytest.raises(kinds[0], match=f"^{re.escape(says)}") as info:
        call(engine)
    assert all(isinstance(info.value, k) for k in kinds), type(info.value).__mro__
    assert "\n" not in str(info.value)
    assert greedy(engine) == reference  # usable after it, with the same tokens


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_hostile_call_is_refused_at_the_call_in_one_line(engine, reference, case) -> None:
    check_refused(engine, reference, *REFUSED[case])


@pytest.mark.parametrize("case", list(HELD))
def test_hostile_calls_refused_already_stay_refused(engine, reference, case) -> None:
    check_refused(engine, reference, *HELD[case])


def test_generate_tokens_stops_at_the_context_as_stream_does(engine) -> None:
    """It ran past the context length (every token asked for); now it ends where `stream` ends, "length"."""
    prompt = list(range(10, 10 + CONTEXT - 3))
    chunks = list(engine.stream(prompt, max_tokens=10, ignore_eos=True, session=engine.open_session()))
    assert chunks[-1].finish_reason == "length"
    streamed = [c.token for c in chunks if c.token is not None]
    assert len(streamed) == 3
    assert engine.generate_tokens(prompt, 10, ignore_eos=True) == streamed


def test_interrupted_and_abandoned_streams_leave_the_engine_as_it_was(engine, reference) -> None:
    """Ctrl-C inside a stream (a KeyboardInterrupt from its progress callback, or thrown into it where the loop
    was), a stream closed or dropped halfway: the next generation, on the engine's own session or the one the stream
    had, gives the tokens of a fresh run."""

    def interrupt(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        list(engine.stream(PROMPT, max_tokens=4, on_prefill_progress=interrupt))
    assert [c.token for c in engine.stream(PROMPT, max_tokens=4, ignore_eos=True)] == reference
    session = engine.open_session()
    stream = engine.stream(PROMPT, max_tokens=4, ignore_eos=True, session=session)
    next(stream)
    with pytest.raises(KeyboardInterrupt):
        stream.throw(KeyboardInterrupt)
    assert [c.token for c in engine.stream(PROMPT, max_tokens=4, ignore_eos=True, session=session)] == reference
    for end in ("close", "drop"):
        stream = engine.stream(PROMPT, max_tokens=4, ignore_eos=True)
        next(stream), next(stream)
        if end == "close":
            stream.close()
        del stream
        assert [c.token for c in engine.stream(PROMPT, max_tokens=4, ignore_eos=True)] == reference


def test_a_cancelled_handle_ends_with_one_cancelled_chunk(engine, reference) -> None:
    sched = engine.scheduler()
    handle = sched.submit(PROMPT, max_tokens=4)
    handle.cancel()
    assert [(c.token, c.finish_reason) for c in handle] == [(None, "cancelled")]
    assert list(handle) == []  # iterated again: nothing more, no hang
    assert [c.token for c in sched.submit(PROMPT, max_tokens=4, ignore_eos=True)] == reference


# --- load ----------------------------------------------------------------------------------------------------


@pytest.fixture
def no_model_work(monkeypatch):
    """`load`'s model work (the expert pager, the model's build) fails the test if it starts."""
    from fastar.engine import build

    def started(*args, **kwargs):
        raise AssertionError("load started building before refusing its arguments")

    monkeypatch.setattr(build, "build_model", started)
    monkeypatch.setattr(build, "paged_experts", started)


@pytest.mark.parametrize(
    "options,error,says",
    [
        # each was refused only after the model was built (draft, numerics) or the slab allocated (cache_policy)
        ({"draft": "magic"}, ValueError, "draft must be one of none, mtp, dspark, auto; got 'magic'"),
        ({"numerics": "fast"}, ValueError, "numerics must be 'official' or 'reference', got 'fast'"),
        ({"cache_policy": "fifo"}, ValueError, "unknown expert cache policy 'fifo'; choose from ('lru', 'lrfu')"),
        # "cannot read 'lots' as a size" named no option; -1 was "--ram-budget -1 B is smaller than one expert"
        ({"ram_budget": "lots"}, ConfigError, "ram_budget: cannot read 'lots' as a size (examples: 24G, 512M,"),
        ({"ram_budget": "-1G"}, ConfigError, "ram_budget: size '-1G' is negative"),
        ({"ram_budget": -1}, ValueError, "ram_budget must be a number of bytes >= 0, a size such as '24G', 'auto' or "),
        ({"gpu_budget": "x"}, ConfigError, "gpu_budget: cannot read 'x' as a size"),
    ],
)
def test_load_refuses_a_bad_choice_before_any_model_work(tiny_fst_path, no_model_work, options, error, says) -> None:
    with pytest.raises(error, match=f"^{re.escape(says)}"):
        load(tiny_fst_path, **options)


# load options refused once checked against the model or the machine: (options, the option named, the problem)
REFUSED_AT_LOAD = [
    ({"ram_budget": 0}, "ram_budget=0", "0 B is smaller than one expert"),
    ({"ram_budget": 1000}, "ram_budget=1000", "1000 B is smaller than one expert"),
    ({"draft": "dspark"}, "draft='dspark'", "this checkpoint has no dspark weights (it has: mtp)"),
    ({"device": "tpu"}, "device='tpu'", "expected cpu, torch:cpu, cuda or cuda:N"),
    ({"device": "cuda:x"}, "device='cuda:x'", "expected cpu, torch:cpu, cuda or cuda:N"),
    ({"device": "torch:cpu", "draft": "mtp"}, "draft='mtp'", "speculative decoding runs on device='cpu' only"),
]


@pytest.mark.parametrize("options,named,problem", REFUSED_AT_LOAD)
def test_a_load_option_refused_by_the_model_names_the_keyword_not_the_flag(
    tiny_fst_path, options, named, problem
) -> None:
    """`load(ram_budget=0)` said "--ram-budget 0 B is smaller than one expert ...; or 'none'", the command line's
    words (as did a `draft` the checkpoint lacks and a `device` there is none of): the Python API names its keyword
    and its values (`ram_budget='1M'`, `None`); the CLI names its flags (tests/test_cli_hostile.py)."""
    with pytest.raises(ConfigError) as err:
        load(tiny_fst_path, **options)
    message = str(err.value)
    assert message.startswith(f"{named}: {problem}") and "--" not in message and "\n" not in message, message
    if "ram_budget" in options:
        assert re.search(r"give at least ram_budget='\d+M' \(\d+ bytes\), or ram_budget=None$", message), message


def test_load_of_a_missing_path_is_a_file_not_found_error(tmp_path, monkeypatch, tiny_fst_path) -> None:
    """It was a FormatError only ("no such file"), where `open()` of the path is a FileNotFoundError; a path
    starting with "~" (which Python does not expand) says so when the expanded one exists."""
    missing = tmp_path / "missing.fst"
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(str(missing))}: no such file or directory$") as info:
        load(missing)
    assert isinstance(info.value, FormatError)
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copy(tiny_fst_path, tmp_path / "m.fst")
    with pytest.raises(FileNotFoundError, match=r"^~/m.fst: no such file or directory \(a path starting with ~ is not"):
        load("~/m.fst")


def test_loading_a_missing_session_file_is_a_file_not_found_error(engine, tmp_path) -> None:
    """It was a SessionError only; the session is unchanged and usable."""
    from fastar.engine.session import SessionError

    session = engine.open_session()
    missing = tmp_path / "missing.bin"
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(str(missing))}: no such file$") as info:
        session.load(missing)
    assert isinstance(info.value, SessionError)
    assert [c.token for c in engine.stream(PROMPT, max_tokens=4, ignore_eos=True, session=session)] == greedy(engine)


@pytest.mark.parametrize(
    "content,says",
    [
        (b"", "file is 0 bytes, too short for a .fst preamble"),
        (b"hello, I am not a model\n" * 10, "not a .fst file (bad magic)"),
        ("half", "file is truncated"),
    ],
)
def test_load_of_what_is_no_model_names_the_file(tmp_path, tiny_fst_path, content, says) -> None:
    path = tmp_path / "model.fst"
    data = tiny_fst_path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if content == "half" else content)
    with pytest.raises(FormatError, match=f"^{re.escape(str(path))}: {re.escape(says)}"):
        load(path)
