"""A hostile-input sweep of the Python API on the demo model: every case's outcome, one line each.

Run: python scripts/api_probe.py [model.fst]. Each case prints OK (it returned), or the exception's type, its
first line and the file it was raised in, then whether a plain greedy generate still gives the reference tokens.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import fastar
from fastar.engine.sampling import SamplingParams

MODEL = Path(sys.argv[1] if len(sys.argv) > 1 else Path.home() / ".cache/fastar/demo-v1-seed0.fst")
TMP = Path(tempfile.mkdtemp(prefix="api-probe-"))


class Hang(Exception):
    pass


def _alarm(*_):
    raise Hang("no answer in 60 s")


signal.signal(signal.SIGALRM, _alarm)


def outcome(call) -> str:
    signal.alarm(60)
    try:
        r = call()
        if hasattr(r, "__next__"):
            r = list(r)
        out = f"OK -> {str(r)[:60]!r}"
    except BaseException as e:  # noqa: BLE001
        tb = traceback.extract_tb(e.__traceback__)[-1]
        where = Path(tb.filename).name
        line = str(e).splitlines()[0] if str(e) else ""
        out = f"{type(e).__name__}[{','.join(c.__name__ for c in type(e).__mro__[1:4])}] {line[:150]!r} @ {where}"
    finally:
        signal.alarm(0)
    return out


engine = fastar.load(MODEL)
P = "The capital of France is"
REF = [c.token for c in engine.stream(P, max_tokens=6, ignore_eos=True, session=engine.open_session())]


def healthy() -> str:
    try:
        got = [c.token for c in engine.stream(P, max_tokens=6, ignore_eos=True)]
        return "engine ok" if got == REF else f"ENGINE DIFFERS {got} != {REF}"
    except BaseException as e:  # noqa: BLE001
        return f"ENGINE BROKEN {type(e).__name__}: {e}"


def case(name, call):
    print(f"{name:55s} {outcome(call)} | {healthy()}", flush=True)


g = engine.generate
hi = {"role": "user", "content": "hi"}
long_prompt = list(range(10, 10 + engine.context_length + 5))
vocab = engine.config.vocab_size

CASES = [
    # wrong types
    ("generate(dict prompt)", lambda: g({"a": 1}, max_tokens=2)),
    ("generate(bytes prompt)", lambda: g(b"hi", max_tokens=2)),
    ("generate(max_tokens=1.5)", lambda: g(P, max_tokens=1.5)),
    ("generate(max_tokens='4')", lambda: g(P, max_tokens="4")),
    ("generate(max_tokens=None)", lambda: g(P, max_tokens=None)),
    ("generate(temperature='hot')", lambda: g(P, temperature="hot")),
    ("generate(temperature=True)", lambda: g(P, max_tokens=2, temperature=True)),
    ("generate(ignore_eos=1)", lambda: g(P, max_tokens=2, ignore_eos=1)),
    ("generate(logprobs=True)", lambda: g(P, max_tokens=2, logprobs=True)),
    ("generate(params=dict)", lambda: g(P, params={"max_tokens": 2})),
    ("generate(params=SP, max_tokens=2)", lambda: g(P, params=SamplingParams(), max_tokens=2)),
    ("generate(session='x')", lambda: g(P, session="x", max_tokens=2)),
    ("generate(prompt=[1, None])", lambda: g([1, None], max_tokens=2)),
    ("generate(prompt=[[1,2]])", lambda: g([[1, 2]], max_tokens=2)),
    ("generate(prompt=(1,2,3) tuple)", lambda: g((1, 2, 3), max_tokens=2)),
    ("generate(prompt=range(5))", lambda: g(range(5), max_tokens=2)),
    ("generate(prompt=iter generator)", lambda: g((i for i in range(5)), max_tokens=2)),
    ("generate(prompt=np.float array)", lambda: g(__import__("numpy").array([1.0, 2.0]), max_tokens=2)),
    ("chat(None)", lambda: engine.chat(None, max_tokens=2)),
    ("chat('hi')", lambda: engine.chat("hi", max_tokens=2)),
    ("chat({'role':'user',...}) not a list", lambda: engine.chat(hi, max_tokens=2)),
    ("chat([])", lambda: engine.chat([], max_tokens=2)),
    ("chat([None])", lambda: engine.chat([None], max_tokens=2)),
    ("chat([['user','hi']])", lambda: engine.chat([["user", "hi"]], max_tokens=2)),
    ("chat(missing role)", lambda: engine.chat([{"content": "hi"}], max_tokens=2)),
    ("chat(missing content)", lambda: engine.chat([{"role": "user"}], max_tokens=2)),
    ("chat(content None)", lambda: engine.chat([{"role": "user", "content": None}], max_tokens=2)),
    ("chat(content=5)", lambda: engine.chat([{"role": "user", "content": 5}], max_tokens=2)),
    ("chat(role='wizard')", lambda: engine.chat([{"role": "wizard", "content": "hi"}], max_tokens=2)),
    ("chat(role=5)", lambda: engine.chat([{"role": 5, "content": "hi"}], max_tokens=2)),
    (
        "chat(content text parts)",
        lambda: engine.chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], max_tokens=2),
    ),
    (
        "chat(content image_url part)",
        lambda: engine.chat(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}], max_tokens=2
        ),
    ),
    (
        "chat(content unknown part type)",
        lambda: engine.chat([{"role": "user", "content": [{"type": "hologram", "data": 1}]}], max_tokens=2),
    ),
    ("chat(content part not dict)", lambda: engine.chat([{"role": "user", "content": ["hi", 5]}], max_tokens=2)),
    (
        "chat(content part text=None)",
        lambda: engine.chat([{"role": "user", "content": [{"type": "text"}]}], max_tokens=2),
    ),
    ("chat(thinking='yes')", lambda: engine.chat([hi], thinking="yes", max_tokens=2)),
    (
        "chat(reasoning_effort='ultra')",
        lambda: engine.chat([hi], thinking=True, reasoning_effort="ultra", max_tokens=2),
    ),
    ("chat(reasoning_effort=5)", lambda: engine.chat([hi], thinking=True, reasoning_effort=5, max_tokens=2)),
    ("chat(drop_thinking='no')", lambda: engine.chat([hi], drop_thinking="no", max_tokens=2)),
    ("chat(max_token=2) typo", lambda: engine.chat([hi], max_token=2)),
    ("chat(messages=..., tools=[...]) unknown", lambda: engine.chat([hi], tools=[{"type": "function"}], max_tokens=2)),
    (
        "chat(tool-call shape, args str)",
        lambda: engine.chat(
            [
                hi,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ],
            max_tokens=2,
        ),
    ),
    (
        "chat(tool-call shape, args dict)",
        lambda: engine.chat(
            [
                hi,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ],
            max_tokens=2,
        ),
    ),
    (
        "chat(tool_calls no function)",
        lambda: engine.chat(
            [hi, {"role": "assistant", "tool_calls": [{"id": "c1"}]}, {"role": "tool", "content": "1"}], max_tokens=2
        ),
    ),
    (
        "chat(tool_calls='x')",
        lambda: engine.chat(
            [hi, {"role": "assistant", "tool_calls": "x"}, {"role": "tool", "content": "1"}], max_tokens=2
        ),
    ),
    (
        "chat(tool_calls args bad json)",
        lambda: engine.chat(
            [
                hi,
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}],
                },
                {"role": "tool", "content": "1"},
            ],
            max_tokens=2,
        ),
    ),
    ("chat(tool msg content dict)", lambda: engine.chat([hi, {"role": "tool", "content": {"a": 1}}], max_tokens=2)),
    # out of range
    ("generate(max_tokens=-1)", lambda: g(P, max_tokens=-1)),
    ("generate(max_tokens=0)", lambda: g(P, max_tokens=0)),
    ("generate(temperature=-1)", lambda: g(P, temperature=-1)),
    ("generate(temperature=nan)", lambda: g(P, temperature=float("nan"))),
    ("generate(temperature=inf)", lambda: g(P, temperature=float("inf"))),
    ("generate(temperature=1e-30)", lambda: g(P, max_tokens=2, temperature=1e-30)),
    ("generate(temperature=1e30)", lambda: g(P, max_tokens=2, temperature=1e30, seed=1)),
    ("generate(top_p=0)", lambda: g(P, top_p=0)),
    ("generate(top_p=2)", lambda: g(P, top_p=2)),
    ("generate(top_p=nan)", lambda: g(P, top_p=float("nan"))),
    ("generate(top_k=-5)", lambda: g(P, top_k=-5)),
    ("generate(top_k=10**9)", lambda: g(P, max_tokens=2, top_k=10**9, temperature=1.0, seed=1)),
    ("generate(min_p=2)", lambda: g(P, min_p=2)),
    ("generate(seed='x')", lambda: g(P, seed="x")),
    ("generate(seed=1.5)", lambda: g(P, seed=1.5)),
    ("generate(seed=-1)", lambda: g(P, max_tokens=2, seed=-1, temperature=1.0)),
    ("generate(seed=2**70)", lambda: g(P, seed=2**70)),
    ("generate(logit_bias={vocab+5: 5})", lambda: g(P, max_tokens=2, logit_bias={vocab + 5: 5})),
    ("generate(logit_bias={-1: 5})", lambda: g(P, max_tokens=2, logit_bias={-1: 5})),
    ("generate(logit_bias={'5': 5}) str key", lambda: g(P, max_tokens=2, logit_bias={"5": 5})),
    ("generate(logit_bias={5: nan})", lambda: g(P, max_tokens=2, logit_bias={5: float("nan")})),
    ("generate(logit_bias={5: 1e6})", lambda: g(P, max_tokens=2, logit_bias={5: 1e6})),
    ("generate(logit_bias=[1,2])", lambda: g(P, max_tokens=2, logit_bias=[1, 2])),
    ("generate(stop=5)", lambda: g(P, max_tokens=2, stop=5)),
    ("generate(stop=[''])", lambda: g(P, max_tokens=2, stop=[""])),
    ("generate(stop='')", lambda: g(P, max_tokens=2, stop="")),
    ("generate(stop=[None])", lambda: g(P, max_tokens=2, stop=[None])),
    ("generate(stop=b'x')", lambda: g(P, max_tokens=2, stop=b"x")),
    ("generate(stop={'a'} set)", lambda: g(P, max_tokens=2, stop={"a"})),
    ("generate(stop_token_ids=[vocab+5])", lambda: g(P, max_tokens=2, stop_token_ids=[vocab + 5])),
    ("generate(stop_token_ids=5)", lambda: g(P, max_tokens=2, stop_token_ids=5)),
    ("generate(banned_token_ids=[vocab+5])", lambda: g(P, max_tokens=2, banned_token_ids=[vocab + 5])),
    ("generate(presence_penalty=5)", lambda: g(P, max_tokens=2, presence_penalty=5)),
    ("generate(repetition_penalty=0)", lambda: g(P, max_tokens=2, repetition_penalty=0)),
    ("generate(logprobs=100)", lambda: g(P, max_tokens=2, logprobs=100)),
    ("generate(min_tokens=5,max_tokens=2)", lambda: g(P, max_tokens=2, min_tokens=5)),
    ("generate(thinking_budget=-1)", lambda: g(P, max_tokens=2, thinking_budget=-1)),
    ("generate(grammar='x')", lambda: g(P, max_tokens=2, grammar="x")),
    # empty / long
    ("generate('')", lambda: g("", max_tokens=2)),
    ("generate([])", lambda: g([], max_tokens=2)),
    ("generate('   ')", lambda: g("   ", max_tokens=2)),
    ("generate([-1])", lambda: g([-1], max_tokens=2)),
    ("generate([vocab])", lambda: g([vocab], max_tokens=2)),
    ("generate(prompt > context)", lambda: g(long_prompt, max_tokens=2)),
    ("generate(prompt = context)", lambda: g(long_prompt[: engine.context_length], max_tokens=2)),
    ("generate(prompt = context-1, max_tokens 5)", lambda: g(long_prompt[: engine.context_length - 1], max_tokens=5)),
    ("generate(lone surrogate text)", lambda: g("hi \ud800 there", max_tokens=2)),
    ("generate(NUL text)", lambda: g("hi\0there", max_tokens=2)),
    ("stream(prompt > context) not iterated", lambda: engine.stream(long_prompt, max_tokens=2) and "returned"),
    ("stream('') not iterated", lambda: engine.stream("", max_tokens=2) and "returned"),
    # unknown kwargs
    ("generate(max_token=2) typo", lambda: g(P, max_token=2)),
    ("generate(temprature=0.5) typo", lambda: g(P, max_tokens=2, temprature=0.5)),
    ("stream(max_token=2) typo", lambda: engine.stream(P, max_token=2)),
    ("generate(max_new_tokens=2) alias", lambda: g(P, max_new_tokens=2)),
    ("generate(temp=0.0) alias", lambda: g(P, max_tokens=2, temp=0.0)),
    ("generate(verbose=True) mlx-style", lambda: g(P, max_tokens=2, verbose=True)),
    ("generate(echo=True) llama-cpp-style", lambda: g(P, max_tokens=2, echo=True)),
    ("generate(stream=True) llama-cpp-style", lambda: g(P, max_tokens=2, stream=True)),
    ("generate_tokens(max_token=2) typo", lambda: engine.generate_tokens([1, 2, 3], max_token=2)),
    ("generate_tokens([1,2], 2.0)", lambda: engine.generate_tokens([1, 2], 2.0)),
    ("generate_tokens([], 2)", lambda: engine.generate_tokens([], 2)),
    ("generate_tokens([vocab], 2)", lambda: engine.generate_tokens([vocab], 2)),
    ("generate_tokens(long, 2)", lambda: engine.generate_tokens(long_prompt, 2)),
    ("scheduler().submit(P, max_token=2) typo", lambda: engine.scheduler().submit(P, max_token=2)),
    ("scheduler().submit('', max_tokens=2)", lambda: engine.scheduler().submit("", max_tokens=2)),
    ("scheduler().submit(long)", lambda: engine.scheduler().submit(long_prompt, max_tokens=2)),
    (
        "scheduler().submit(logit_bias oov)",
        lambda: list(engine.scheduler().submit(P, max_tokens=2, logit_bias={vocab + 5: 1})),
    ),
    ("scheduler().submit_choices(n=0)", lambda: engine.scheduler().submit_choices(P, n=0, max_tokens=2)),
    ("scheduler().submit_choices(n='2')", lambda: engine.scheduler().submit_choices(P, n="2", max_tokens=2)),
    ("scheduler(max_batch=0)", lambda: engine.scheduler(max_batch=0)),
    ("scheduler(max_queue=-1)", lambda: engine.scheduler(max_queue=-1)),
    ("scheduler(prefill_share=2)", lambda: engine.scheduler(prefill_share=2)),
    ("scheduler(prefill_share='x')", lambda: engine.scheduler(prefill_share="x")),
    ("scheduler(token_budget=0)", lambda: engine.scheduler(token_budget=0)),
    ("scheduler(maxbatch=2) typo", lambda: engine.scheduler(maxbatch=2)),
    ("serve_batch([(P, {'max_token': 2})])", lambda: engine.serve_batch([(P, {"max_token": 2})])),
    ("serve_batch('hi')", lambda: engine.serve_batch("hi")),
    ("serve_batch(None)", lambda: engine.serve_batch(None)),
    ("open_session(anchor='no')", lambda: engine.open_session(anchor="no")),
    ("session.save(None)", lambda: engine.open_session().save(None)),
    ("session.load(missing)", lambda: engine.open_session().load(TMP / "missing.bin")),
    (
        "session.load(text file)",
        lambda: (TMP / "t.bin").write_text("hello") and engine.open_session().load(TMP / "t.bin"),
    ),
    ("session.load(dir)", lambda: engine.open_session().load(TMP)),
    ("session.rewind(-1)", lambda: engine.open_session().rewind(-1)),
    ("session.rewind('x')", lambda: engine.open_session().rewind("x")),
    ("session.rewind(100) empty", lambda: engine.open_session().rewind(100)),
    ("context_length='big'", lambda: setattr(engine, "context_length", "big")),
    ("context_length=1", lambda: setattr(engine, "context_length", 1)),
    ("logits([])", lambda: engine.logits([])),
    ("prompt_logprobs('', top=-1)", lambda: engine.prompt_logprobs(P, top=-1)),
    ("perplexity('', ctx=4)", lambda: engine.perplexity("", ctx=4)),
    ("perplexity(P, ctx=1)", lambda: engine.perplexity(P, ctx=1)),
    ("perplexity(P, ctx=-4)", lambda: engine.perplexity(P, ctx=-4)),
]


def main():
    for name, call in CASES:
        case(name, call)

    # abandoned stream, closed stream, KeyboardInterrupt in a callback / thrown into the generator
    s = engine.stream(P, max_tokens=6, ignore_eos=True)
    next(s), next(s)
    del s
    case("abandoned stream (del) then generate", lambda: "done")
    s = engine.stream(P, max_tokens=6, ignore_eos=True)
    next(s)
    case("stream.close() halfway", lambda: s.close())

    def boom(done, total):
        raise KeyboardInterrupt

    case(
        "KeyboardInterrupt from on_prefill_progress",
        lambda: list(engine.stream(P, max_tokens=4, on_prefill_progress=boom)),
    )
    s = engine.stream(P, max_tokens=6, ignore_eos=True)
    next(s)
    case("KeyboardInterrupt thrown into stream", lambda: s.throw(KeyboardInterrupt))
    sess = engine.open_session()
    s = engine.stream(P, max_tokens=6, ignore_eos=True, session=sess)
    next(s)
    case("KeyboardInterrupt in own session, then reuse", lambda: s.throw(KeyboardInterrupt))
    case(
        "  ... same session greedy after interrupt",
        lambda: [c.token for c in engine.stream(P, max_tokens=6, ignore_eos=True, session=sess)] == REF or "DIFFERS",
    )
    # cancelled handle
    sched = engine.scheduler()
    h = sched.submit(P, max_tokens=4)
    h.cancel()
    case("iterate a cancelled handle", lambda: [(c.text, c.finish_reason) for c in h])
    case("iterate a cancelled handle again", lambda: [(c.text, c.finish_reason) for c in h])
    h2 = sched.submit(P, max_tokens=3)
    case("handle after cancelled one", lambda: [c.token for c in h2])
    ev = threading.Event()
    ev.set()
    case(
        "stream with set cancel", lambda: [(c.text, c.finish_reason) for c in engine.stream(P, max_tokens=3, cancel=ev)]
    )

    # load
    L = fastar.load
    case("load(missing path)", lambda: L(TMP / "nope.fst"))
    (TMP / "empty").mkdir()
    case("load(empty dir)", lambda: L(TMP / "empty"))
    trunc = TMP / "trunc.fst"
    with open(MODEL, "rb") as f, open(trunc, "wb") as o:
        o.write(f.read(os.path.getsize(MODEL) // 2))
    case("load(truncated .fst half)", lambda: L(trunc))
    with open(MODEL, "rb") as f, open(trunc, "wb") as o:
        o.write(f.read(100))
    case("load(truncated .fst 100 B)", lambda: L(trunc))
    with open(MODEL, "rb") as f, open(trunc, "wb") as o:
        o.write(f.read(os.path.getsize(MODEL) - 10))
    case("load(truncated .fst minus 10 B)", lambda: L(trunc))
    txt = TMP / "text.fst"
    txt.write_text("hello, I am not a model\n" * 10)
    case("load(text file renamed .fst)", lambda: L(txt))
    (TMP / "zero.fst").write_bytes(b"")
    case("load(empty file)", lambda: L(TMP / "zero.fst"))
    case("load(ram_budget='lots')", lambda: L(MODEL, ram_budget="lots"))
    case("load(ram_budget=-1)", lambda: L(MODEL, ram_budget=-1))
    case("load(ram_budget='-1G')", lambda: L(MODEL, ram_budget="-1G"))
    case("load(ram_budget=0)", lambda: L(MODEL, ram_budget=0))
    case("load(ram_bugdet='8G')", lambda: L(MODEL, ram_bugdet="8G"))
    case("load(numerics='fast')", lambda: L(MODEL, numerics="fast"))
    case("load(numerics=5)", lambda: L(MODEL, numerics=5))
    case("load(device='tpu')", lambda: L(MODEL, device="tpu"))
    case("load(cache_policy='fifo')", lambda: L(MODEL, cache_policy="fifo"))
    case("load(draft='magic')", lambda: L(MODEL, draft="magic"))
    case("load(threads=2.5)", lambda: L(MODEL, threads=2.5))
    case("load(path, 'official', 'x') extra positional", lambda: L(MODEL, "official", "x"))

    # after close
    e2 = L(MODEL)
    sess2 = e2.open_session()
    sched2 = e2.scheduler()
    st2 = e2.stream(P, max_tokens=4)
    next(st2)
    e2.close()
    case("closed: generate", lambda: e2.generate(P, max_tokens=2))
    case("closed: stream", lambda: e2.stream(P, max_tokens=2))
    case("closed: resume a stream opened before", lambda: list(st2))
    case("closed: chat", lambda: e2.chat([hi], max_tokens=2))
    case("closed: generate_tokens", lambda: e2.generate_tokens([1, 2], 2))
    case("closed: open_session", lambda: e2.open_session())
    case("closed: session.prefill", lambda: sess2.prefill([1, 2, 3]))
    case("closed: generate(session=)", lambda: e2.generate(P, max_tokens=2, session=sess2))
    case("closed: session.save", lambda: sess2.save(TMP / "s.bin"))
    case("closed: session.load", lambda: sess2.load(TMP / "s.bin"))
    case("closed: scheduler()", lambda: e2.scheduler())
    case("closed: old scheduler.submit", lambda: sched2.submit(P, max_tokens=2))
    case("closed: old scheduler.submit + iterate", lambda: list(sched2.submit(P, max_tokens=2)))
    case("closed: old scheduler.step", lambda: sched2.step())
    case("closed: serve_batch", lambda: e2.serve_batch([(P, {"max_tokens": 2})]))
    case("closed: stats", lambda: e2.stats())
    case("closed: tokenizer.encode", lambda: e2.tokenizer.encode("hi"))
    case("closed: warm_experts()", lambda: e2.warm_experts())
    case("closed: close twice", lambda: e2.close())
    case("closed: with-block reenter", lambda: e2.__enter__() and "entered")
    case("closed: context_length", lambda: e2.context_length)
    shutil.rmtree(TMP, ignore_errors=True)


main()
