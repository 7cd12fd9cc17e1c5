"""`fastar run` and `fastar chat`: the demo model's atomic build, `run` end to end in a subprocess, bad input as
one-line errors, the chat REPL against a fake engine, and `chat` driven through a pseudo-terminal for three turns
with a Ctrl-C mid-reply, /save and /load."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fastar import cli, demo
from fastar.console import DIM, ChatREPL, timings_line
from fastar.engine.generate import GenerationChunk
from fastar.engine.sampling import SamplingParams
from fastar.errors import FastarError

ROOT = Path(__file__).resolve().parents[1]


# --- the demo model ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_cache(vocab_ckpt: Path, tmp_path_factory) -> Path:
    """A cache dir holding the demo model, built by the real build path (the fixture checkpoint is the session's
    shared `vocab` one, which is exactly what the demo writes: preset "vocab", seed 0)."""
    cache = tmp_path_factory.mktemp("fastar-cache")
    calls = []

    def write_checkpoint(out, preset, seed):
        calls.append((preset, seed))
        return Path(shutil.copytree(vocab_ckpt, out))

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTAR_CACHE_DIR", str(cache))
        mp.setattr("fastar.fixtures.write_checkpoint", write_checkpoint)
        path = demo.ensure_demo_model()
    assert calls == [("vocab", demo.DEMO_SEED)]
    assert path == cache / demo.DEMO_NAME and path.is_file()
    assert not [p for p in cache.iterdir() if p.name.startswith(".demo-build-")]  # temporaries cleaned up
    return cache


def test_demo_cache_dir_honours_the_env(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FASTAR_CACHE_DIR", str(tmp_path / "c"))
    assert demo.demo_path() == tmp_path / "c" / demo.DEMO_NAME
    monkeypatch.delenv("FASTAR_CACHE_DIR")
    assert "fastar" in str(demo.cache_dir())


def test_concurrent_builds_build_once(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FASTAR_CACHE_DIR", str(tmp_path))
    builds = []

    def slow_build(tmp: Path, final: Path) -> None:
        builds.append(tmp)
        (tmp / "x.partial").write_bytes(b"half")
        time.sleep(0.3)  # the others must wait on the lock, not start their own build or read a half file
        (tmp / final.name).write_bytes(b"whole")
        os.replace(tmp / final.name, final)

    monkeypatch.setattr(demo, "_build", slow_build)
    results = []
    threads = [threading.Thread(target=lambda: results.append(demo.ensure_demo_model())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(results) == 3 and len(set(results)) == 1
    assert results[0].read_bytes() == b"whole"


def test_an_interrupted_build_leaves_no_file(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FASTAR_CACHE_DIR", str(tmp_path))
    stale = tmp_path / ".demo-build-dead"  # what a killed process leaves behind
    stale.mkdir()

    def dies(tmp: Path, final: Path) -> None:
        (tmp / final.name).write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_build", dies)
    with pytest.raises(KeyboardInterrupt):
        demo.ensure_demo_model()
    assert not demo.demo_path().exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".demo-build-")]


# --- fastar run ------------------------------------------------------------------------------------------------


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def fastar(*args: str, env: dict | None = None, timeout: float = 180, stdin: str | None = None):
    e = {**os.environ, "PYTHONPATH": _pythonpath(), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "fastar", *args],
        capture_output=True,
        text=True,
        env=e,
        timeout=timeout,
        cwd=ROOT,
        input=stdin if stdin is not None else "",
        check=False,
    )


def test_run_end_to_end_with_the_demo_model(demo_cache: Path) -> None:
    r = fastar("run", "-p", "Hello, who are you?", "-n", "6", "--verbose", env={"FASTAR_CACHE_DIR": str(demo_cache)})
    assert r.returncode == 0, r.stderr
    assert "DEMO model" in r.stderr and "meaningless" in r.stderr
    assert r.stdout.strip() and r.stdout.endswith("\n")
    assert re.search(r"timings: prompt \d+ tokens .*prefill \d+ tokens in .* tok/s.*decode 5 tokens", r.stderr)
    assert "'completion_tokens': 6" in r.stderr and "Traceback" not in r.stderr


def test_run_flags_env_mirrors_and_stdin(demo_cache: Path) -> None:
    model = str(demo_cache / demo.DEMO_NAME)
    env = {"FASTAR_MODEL": model, "FASTAR_MAX_TOKENS": "3", "FASTAR_TEMP": "0.8", "FASTAR_SEED": "5"}
    a = fastar("run", "--raw", "--verbose", "--top-k", "50", env=env, stdin="Once upon a time")
    assert a.returncode == 0, a.stderr
    assert "'completion_tokens': 3" in a.stderr and "DEMO" not in a.stderr
    b = fastar("run", "--raw", "-p", "Once upon a time", "--top-k", "50", env=env)
    assert b.stdout == a.stdout  # same seed, same text; stdin and -p give the same prompt


def run_main(capsys, *args: str) -> tuple[int, str]:
    code = cli.main(list(args))
    return code, capsys.readouterr().err


def one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("fastar: error: "), err
    return lines[0]


def test_bad_input_is_one_line_and_exit_1(capsys, tmp_path: Path, demo_cache: Path) -> None:
    model = str(demo_cache / demo.DEMO_NAME)
    code, err = run_main(capsys, "run", "-m", str(tmp_path / "nope.fst"), "-p", "hi")
    assert code == 1 and "no such file" in one_line_error(err)
    (tmp_path / "notes.txt").write_text("not a model at all, just some text that is long enough " * 4)
    code, err = run_main(capsys, "run", "-m", str(tmp_path / "notes.txt"), "-p", "hi")
    assert code == 1 and "not a .fst file" in one_line_error(err)
    code, err = run_main(capsys, "run", "-m", model, "-p", "   ")
    assert code == 1 and "empty" in one_line_error(err)
    code, err = run_main(capsys, "run", "-m", model, "-c", "16", "-p", "many words " * 20)
    line = one_line_error(err)
    assert code == 1 and re.search(r"prompt is \d\d+ tokens.*context length is 16", line)
    code, err = run_main(capsys, "chat", "-m", model, "-c", "999999999")
    assert code == 1 and "context length" in one_line_error(err)
    code, err = run_main(capsys, "run", "-m", model, "-n", "4", "--min-tokens", "5", "-p", "hi")
    assert code == 1 and "--min-tokens 5 is larger than --max-tokens 4" in one_line_error(err)


def test_min_tokens_errors_name_the_flag(capsys) -> None:
    """`run --min-tokens -1` said "min_tokens must be an integer in [0, max_tokens (256)]", the API's field: the
    flag is named, as the other flags' errors name theirs (-1 a usage error, as `--top-k -1` is), before the model
    is opened."""
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "-m", "x.fst", "-p", "hi", "--min-tokens", "-1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --min-tokens: a count must be at least 0, got -1" in err, err
    assert "min_tokens" not in err
    code, err = run_main(capsys, "run", "-m", "x.fst", "-n", "2", "--min-tokens", "5", "-p", "hi")
    assert (code, err) == (
        1,
        "fastar: error: --min-tokens 5 is larger than --max-tokens 2: the output cannot be that long\n",
    )


def test_run_min_tokens_keeps_a_stop_string_in_its_first_tokens(capsys, demo_cache: Path) -> None:
    """`fastar run --min-tokens N`: a stop string in the first N tokens' text does not end the output."""
    args = ["run", "-m", str(demo_cache / demo.DEMO_NAME), "--raw", "-p", "Once upon a time", "--temp", "0", "-n", "6"]
    assert cli.main(args) == 0
    text = capsys.readouterr().out.strip()
    assert len(text) > 2
    assert cli.main([*args, "--stop", text[:2]]) == 0
    assert capsys.readouterr().out.strip() == ""  # cut at once
    assert cli.main([*args, "--stop", text[:2], "--min-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip() == text


def test_run_with_drafts_times_the_tokens_it_wrote(capsys, demo_cache: Path) -> None:
    """`fastar run --draft mtp`: the timings line's decode count is the tokens written after the prefill's first
    (it counted every position the verify passes ran, rejected drafts too: `-n 12` showed 13)."""
    model = str(demo_cache / demo.DEMO_NAME)
    args = ["run", "-m", model, "--draft", "mtp", "-n", "12", "--temp", "0", "--raw", "-p", "Once upon a time"]
    code, err = run_main(capsys, *args, "--verbose")
    drafts = re.search(r"draft mtp: ([\d.]+)% of (\d+) drafts accepted", err)
    assert code == 0 and drafts and int(drafts[2]) > 0 and float(drafts[1]) < 100, err  # some drafts were rejected
    completion = int(re.search(r"'completion_tokens': (\d+)", err)[1])
    assert int(re.search(r"decode (\d+) tokens in", err)[1]) == completion - 1, err
    assert re.search(r"\d+ positions run, \d+ rejected drafts among them", err), err


def test_run_raw_refuses_the_chat_encoding_flags(capsys, demo_cache: Path) -> None:
    """`--system` and `--thinking` shape the chat encoding that `--raw` skips: they were taken without a word and
    changed nothing; now each is one line, before the model loads."""
    model = str(demo_cache / demo.DEMO_NAME)
    code, err = run_main(capsys, "run", "-m", model, "--raw", "--system", "be brief", "-p", "hi")
    assert code == 1 and "--system has no effect with --raw" in one_line_error(err)
    code, err = run_main(capsys, "run", "-m", model, "--raw", "--thinking", "-p", "hi")
    assert code == 1 and "--thinking has no effect with --raw" in one_line_error(err)
    assert run_main(capsys, "run", "-m", model, "--raw", "--no-thinking", "-n", "2", "-p", "hi")[0] == 0


def test_a_reply_the_context_cut_short_says_so(capsys, monkeypatch, demo_cache: Path) -> None:
    """`-n 100` with `-c 16`: the reply stops when the context is full. It used to stop there without a word, like
    a reply of -n tokens; now one line on stderr says the context ended it and how to raise it (run and chat)."""
    model = str(demo_cache / demo.DEMO_NAME)
    code, err = run_main(capsys, "run", "-m", model, "-c", "16", "-n", "100", "--temp", "0", "--raw", "-p", "hi")
    notes = [ln for ln in err.splitlines() if "context" in ln]
    assert code == 0 and notes == ["fastar: the reply stopped at the end of the context (16 tokens; -c/--ctx-size)"]
    code, err = run_main(capsys, "run", "-m", model, "-c", "16", "-n", "3", "--temp", "0", "--raw", "-p", "hi")
    assert code == 0 and "context" not in err  # -n ended it
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    code, err = run_main(capsys, "chat", "-m", model, "-c", "16", "-n", "100", "--no-prompt-cache", "--no-thinking")
    assert code == 0 and "fastar: the reply stopped at the end of the context (16 tokens; -c/--ctx-size)" in err


def test_piped_chat_whose_every_turn_fails_exits_1(capsys, monkeypatch, demo_cache: Path) -> None:
    """A piped `fastar chat -c 16` whose one turn cannot fit the context: one error line, exit 1 (it was 0)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("many words " * 20 + "\n"))
    code, err = run_main(capsys, "chat", "-m", str(demo_cache / demo.DEMO_NAME), "-c", "16", "--no-prompt-cache")
    errors = [ln for ln in err.splitlines() if ln.startswith("fastar: error: ")]
    assert code == 1 and len(errors) == 2 and "context length is 16" in errors[0], err
    # the last line says why the status is 1, as a failing command's does
    assert err.splitlines()[-1] == errors[-1] == "fastar: error: 1 line of the input failed (see above)"
    assert "Traceback" not in err


def test_a_chat_that_ran_no_turn_prints_no_session_totals(capsys, monkeypatch, demo_cache: Path) -> None:
    """`fastar chat < /dev/null` printed "session totals: prompt 0 tokens ... (0.0 tok/s)": nothing now; a chat
    that replied still ends in its totals."""
    model = str(demo_cache / demo.DEMO_NAME)
    for text, totals in (("", False), ("/help\n", False), ("hi\n", True)):
        monkeypatch.setattr(sys, "stdin", io.StringIO(text))
        code, err = run_main(capsys, "chat", "-m", model, "-n", "2", "--no-prompt-cache")
        assert code == 0 and ("session totals: prompt " in err) == totals, (text, err)
        assert not re.search(r"(?<![\d.])0\.0 tok/s", err), err  # a zero rate, not one like 630.0 tok/s


def test_bad_input_in_a_subprocess_has_no_traceback(tmp_path: Path) -> None:
    r = fastar("run", "-m", str(tmp_path / "missing.fst"), "-p", "hi")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("fastar: error: ") and r.stdout == ""


def test_timings_line() -> None:
    before = {"prompt_tokens": 0, "prefill_tokens_computed": 0, "prefill_seconds": 0.0}
    after = {
        "prompt_tokens": 10,
        "cached_tokens": 4,
        "prefill_tokens_computed": 6,
        "prefill_seconds": 0.5,
        "generated_tokens": 10,
        "decode_tokens_computed": 9,
        "decode_seconds": 3.0,
        "expert_cache_hits": 3,
        "expert_cache_misses": 1,
    }
    line = timings_line(before, after)
    assert "prompt 10 tokens (4 reused)" in line and "12.0 tok/s" in line and "3.0 tok/s" in line
    assert "hit rate 75.0%" in line and "generated 10 tokens (the first by the prefill); decode 9 tokens" in line


def test_timings_line_of_a_reply_without_a_decode_step() -> None:
    """`-n 1`, or a reply whose first token is the end of sequence: that token comes out of the prefill and no
    decode step runs. The line said "decode 0 tokens in 0.00 s (0.0 tok/s)"; now it says what was generated and
    that no decode step ran, and prints no rate over zero tokens (nor divides by zero seconds)."""
    one = {"requests": 1, "prompt_tokens": 5, "prefill_tokens_computed": 5, "prefill_seconds": 0.02}
    one |= {"generated_tokens": 1, "decode_tokens_computed": 0, "decode_seconds": 0.0}
    line = timings_line({}, one)
    assert "; generated 1 token (by the prefill; no decode step);" in line, line
    assert "decode 0" not in line and "(0.0 tok/s" not in line and line.count("tok/s") == 1, line
    # many such replies (chat's session totals), and a request stopped during its prefill
    line = timings_line({}, {k: 3 * v for k, v in one.items()})
    assert "generated 3 tokens (by the prefills; no decode step)" in line and "decode 0" not in line, line
    line = timings_line({}, one | {"generated_tokens": 0})
    assert "; generated 0 tokens;" in line and "decode" not in line, line
    # nothing at all yet (/stats before a turn): no rate of any kind
    assert "tok/s" not in timings_line({}, {"prompt_tokens": 0})


def test_run_and_chat_of_one_token_say_no_decode_step(capsys, monkeypatch, demo_cache: Path) -> None:
    """`fastar run -n 1` printed "decode 0 tokens in 0.00 s (0.0 tok/s)"; chat --verbose's per-turn line and its
    session totals did too."""
    model = str(demo_cache / demo.DEMO_NAME)
    code, err = run_main(capsys, "run", "-m", model, "-n", "1", "--temp", "0", "--raw", "-p", "Hello")
    (line,) = [ln for ln in err.splitlines() if ln.startswith("timings: ")]
    assert code == 0 and "; generated 1 token (by the prefill; no decode step);" in line, err
    assert "decode 0" not in err and "(0.0 tok/s" not in err, err
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nagain\n"))
    code, err = run_main(capsys, "chat", "-m", model, "-n", "1", "--no-prompt-cache", "--no-thinking", "--verbose")
    turns = [ln for ln in err.splitlines() if ln.startswith("timings: ")]
    (totals,) = [ln for ln in err.splitlines() if ln.startswith("session totals: ")]
    assert code == 0 and len(turns) == 2, err
    assert all("; generated 1 token (by the prefill; no decode step);" in ln for ln in turns), turns
    assert "; generated 2 tokens (by the prefills; no decode step);" in totals, totals
    assert "decode 0" not in err and "(0.0 tok/s" not in err, err


# --- the chat REPL against a fake engine ------------------------------------------------------------------


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class FakeSession:
    def __init__(self) -> None:
        self.meta: dict = {}
        self.num_tokens = 0

    def reset(self) -> None:
        self.meta, self.num_tokens = {}, 0

    def save(self, path) -> Path:
        import json

        if Path(path).is_dir():  # as Session.save answers a path it cannot write
            raise FastarError(f"{path}: not a regular file (a session is renamed into place over it)")
        Path(path).write_text(json.dumps(self.meta))
        return Path(path)

    def load(self, path) -> None:
        import json

        if not Path(path).exists():
            raise FastarError(f"{path}: no such file")
        self.meta = json.loads(Path(path).read_text())


class FakeEngine:
    """Replies with `replies[i]` in 3-character pieces; `on_chunk(i)` (-1 = before the first) may interrupt."""

    def __init__(self, replies: list[str]) -> None:
        self.replies, self.prompts = list(replies), []
        self.on_chunk = None
        self.raise_error: Exception | None = None
        self.source = SimpleNamespace(path=None)  # a model of no files: `/save` has none to keep clear of

    def open_session(self) -> FakeSession:
        return FakeSession()

    def stats(self) -> dict:
        return {"prompt_tokens": 1, "cached_tokens": 0}

    def stream(self, prompt, params, session=None, cancel=None, on_prefill_progress=None):
        if self.raise_error:
            raise self.raise_error
        self.prompts.append(prompt)
        text = self.replies.pop(0)
        pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
        if self.on_chunk:
            self.on_chunk(-1)  # "prefill"
        if cancel is not None and cancel.is_set():
            yield GenerationChunk("", None, finish_reason="cancelled")
            return
        for i, piece in enumerate(pieces):
            if self.on_chunk:
                self.on_chunk(i)
            if cancel is not None and cancel.is_set():
                yield GenerationChunk(piece, i, finish_reason="cancelled")
                return
            yield GenerationChunk(piece, i, finish_reason="stop" if i == len(pieces) - 1 else None)


def make_repl(replies: list[str], **kw) -> tuple[ChatREPL, FakeEngine, TTY]:
    eng = FakeEngine(replies)
    out = TTY()
    return ChatREPL(eng, SamplingParams(max_tokens=5), out=out, err=io.StringIO(), **kw), eng, out


def test_history_and_chat_encoding() -> None:
    repl, eng, out = make_repl(["Hi! I am here.", "Sure thing."], system="Be brief.")
    repl.handle("Hello")
    repl.handle("Again")
    assert eng.prompts[0] == "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hello<｜Assistant｜></think>"
    assert eng.prompts[1] == (
        eng.prompts[0] + "Hi! I am here.<｜end▁of▁sentence｜><｜User｜>Again<｜Assistant｜></think>"
    )
    assert "Hi! I am here.\n" in out.getvalue() and [m["role"] for m in repl.messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]


def test_thinking_is_dimmed_and_kept_in_history(monkeypatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)  # a terminal that takes styling
    monkeypatch.setenv("TERM", "xterm")
    repl, eng, out = make_repl(["Let me see.</think>Yes."])
    repl.handle("/thinking on")
    repl.handle("Well?")
    assert eng.prompts[0].endswith("<｜Assistant｜><think>")
    text = out.getvalue()
    assert f"{DIM}Let" in text and "Yes." in text
    assert repl.messages[-1] == {"role": "assistant", "content": "Yes.", "reasoning_content": "Let me see."}


@pytest.mark.parametrize("env", [{"NO_COLOR": "1"}, {"TERM": "dumb"}])
def test_no_color_or_a_dumb_terminal_gets_no_escapes(monkeypatch, env) -> None:
    """NO_COLOR (no-color.org) and TERM=dumb turn the dimming off: the reasoning comes as plain text."""
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    repl, eng, out = make_repl(["Let me see.</think>Yes."])
    repl.handle("/thinking on")
    repl.handle("Well?")
    assert "Let me see." in out.getvalue() and "\x1b" not in out.getvalue()


def test_stats_says_the_timings_then_every_counter() -> None:
    """/stats printed only `key=value` pairs with seconds rounded to a tenth (a 4 ms prefill: `prefill_seconds=0.0`);
    now the timings line's words first, then the counters unrounded."""
    repl, eng, out = make_repl([])
    eng.stats = lambda: {"prompt_tokens": 9, "cached_tokens": 4, "prefill_tokens_computed": 5, "prefill_seconds": 0.004}
    repl.handle("/stats")
    first, second = out.getvalue().splitlines()
    assert first.startswith("so far: prompt 9 tokens (4 reused); prefill 5 tokens in 0.00 s (1250.0 tok/s)"), first
    assert second == "details: prompt_tokens=9 cached_tokens=4 prefill_tokens_computed=5 prefill_seconds=0.004"


def test_ctrl_c_stops_the_reply_and_keeps_the_chat() -> None:
    repl, eng, out = make_repl(["one two three four five", "ok"])
    eng.on_chunk = lambda i: i == 2 and repl.cancel.set()  # what the SIGINT handler does
    repl.handle("Count")
    assert "(stopped)" in out.getvalue()
    assert repl.messages[-1] == {"role": "assistant", "content": "one two t"}  # kept as far as it went
    eng.on_chunk = None
    repl.handle("Go on")
    assert repl.messages[-1]["content"] == "ok"


def test_a_reply_stopped_before_any_text_drops_the_message() -> None:
    repl, eng, out = make_repl(["abc"])
    eng.on_chunk = lambda i: i == -1 and repl.cancel.set()
    repl.handle("Hi")
    assert repl.messages == [] and "(stopped)" in out.getvalue()


def test_errors_keep_the_chat() -> None:
    repl, eng, out = make_repl([])
    eng.raise_error = FastarError("the prompt is 99 tokens, but the context length is 16 tokens")
    assert repl.handle("Hi")
    assert "(error: the prompt is 99 tokens" in out.getvalue() and repl.messages == []


def test_a_piped_chat_exits_1_when_a_turn_failed(monkeypatch) -> None:
    """From a pipe a failed turn (or /save, /load) is a `fastar: error: ...` line on stderr, the chat goes on with
    the next line, and it exits 1 at the end; on a terminal it is said in the chat and the exit stays 0."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n/load /no/such/file\nAgain\n"))
    repl, eng, out = make_repl(["Fine."])
    eng.raise_error = FastarError("the prompt is 99 tokens, but the context length is 16 tokens")
    assert repl.run() == 1
    assert repl.err.getvalue().splitlines() == [
        "fastar: error: the prompt is 99 tokens, but the context length is 16 tokens",
        "fastar: error: cannot load: /no/such/file: no such file",
        "fastar: error: the prompt is 99 tokens, but the context length is 16 tokens",
    ]
    assert "error" not in out.getvalue()  # stdout keeps the replies alone
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\nAgain\n"))
    repl, eng, out = make_repl(["Fine.", "Ok."])
    assert repl.run() == 0 and repl.err.getvalue() == "" and repl.messages[-1]["content"] == "Ok."
    assert out.getvalue() == "Fine.\nOk.\n"  # the replies alone: no banner about Ctrl-C and /help before them
    monkeypatch.setattr(sys, "stdin", TTY())  # a terminal: unchanged
    repl, eng, out = make_repl([])
    eng.raise_error = FastarError("too long")
    lines = iter(["Hi", "/exit"])
    assert repl.run(lambda prompt: next(lines)) == 0 and "(error: too long)" in out.getvalue()


def test_a_piped_chat_exits_1_on_a_command_it_cannot_run(monkeypatch) -> None:
    """From a pipe, `/sav x` (no such command), `/save` or `/load` without a file and `/thinking maybe` printed a
    hint on stdout among the replies and the chat exited 0: a script never learnt its command did nothing. Each is a
    `fastar: error:` line on stderr now, the chat goes on, and it exits 1; on a terminal they are said in the chat."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("/sav x\n/save\n/load\n/thinking maybe\n/thinking\nHi\n"))
    repl, eng, out = make_repl(["Fine."])
    assert repl.run() == 1
    assert repl.err.getvalue().splitlines() == [
        "fastar: error: unknown command /sav; /help lists them",
        "fastar: error: usage: /save [--force] FILE",
        "fastar: error: usage: /load FILE",
        "fastar: error: /thinking maybe: use /thinking on|off",
    ]
    assert "(thinking is off" in out.getvalue() and repl.messages[-1]["content"] == "Fine."
    monkeypatch.setattr(sys, "stdin", TTY())
    repl, eng, out = make_repl([])
    lines = iter(["/sav x", "/exit"])
    assert repl.run(lambda prompt: next(lines)) == 0 and "(error: unknown command /sav;" in out.getvalue()


def test_an_endless_line_on_stdin_ends_the_chat(monkeypatch) -> None:
    """From a pipe (`fastar chat < /dev/zero`), a line is read up to a bound: a longer one ends the chat with one
    error line, where it was read to the end of memory (a MemoryError traceback)."""
    from fastar import console

    monkeypatch.setattr(console, "MAX_STDIN_PROMPT", 100)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n" + "y" * 1000))
    repl, _, out = make_repl(["Hi."])
    with pytest.raises(FastarError, match="a line on standard input is longer than 100 characters"):
        repl.run()
    assert repl.messages[-1]["content"] == "Hi."  # the lines before it were answered
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n/exit\n"))
    assert make_repl(["Hi."])[0].run() == 0


def test_commands(tmp_path: Path) -> None:
    repl, _, out = make_repl(["Hi."], system="S")
    repl.handle("Hello")
    repl.handle(f"/save {tmp_path / 'c.json'}")
    repl.handle("/reset")
    assert repl.messages == [{"role": "system", "content": "S"}]
    repl.handle("/thinking on")
    repl.handle(f"/load {tmp_path / 'c.json'}")
    assert len(repl.messages) == 3 and repl.thinking is False
    repl.handle(f"/save {tmp_path}")  # a path that cannot be written: said, and the chat goes on
    assert f"(cannot save: {tmp_path}: not a regular file" in out.getvalue() and len(repl.messages) == 3
    repl.handle("/load /no/such/file")
    assert "(cannot load: /no/such/file: no such file)" in out.getvalue() and len(repl.messages) == 3
    repl.handle("/frobnicate")
    assert "unknown command /frobnicate" in out.getvalue()
    repl.handle("/help")
    assert "/thinking on|off" in out.getvalue()
    assert repl.handle("/exit") is False


def test_save_and_load_paths_read_as_a_shell_would(tmp_path: Path, monkeypatch) -> None:
    """`/save ~/c.json` wrote a folder named `~` in the current directory (and said "saved to ~/c.json"), and a
    quoted path with a space made a folder named `"`: a leading `~` is the home folder and one pair of quotes
    around the path is dropped, for /save and /load."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    repl, _, out = make_repl(["Hi.", "Again."])
    repl.handle("Hello")
    repl.handle("/save ~/c.json")
    repl.handle(f'/save "{tmp_path / "a b.json"}"')
    repl.handle(f"/save '{tmp_path / 'c d.json'}'")
    assert (home / "c.json").is_file() and (tmp_path / "a b.json").is_file() and (tmp_path / "c d.json").is_file()
    assert list(work.iterdir()) == [] and f"to {home / 'c.json'})" in out.getvalue()
    repl.handle("/reset")
    repl.handle("/load ~/c.json")
    assert len(repl.messages) == 2
    repl.handle("/reset")
    repl.handle(f'/load "{tmp_path / "a b.json"}"')
    assert len(repl.messages) == 2


def test_save_refuses_to_write_over_the_model_in_use(tmp_path: Path) -> None:
    """`/save model.fst` renamed the session over the model the chat was running on and said "saved": the 154 MB
    model became a 68 KB session file. Refused, the model untouched; also for a file of a checkpoint folder. The
    refusal is one clean line (it read "cannot save: /save PATH: ...", the command named twice)."""
    model = tmp_path / "model.fst"
    model.write_bytes(b"the model")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    for source, target in ((model, model), (folder, folder / "config.json")):
        repl, eng, out = make_repl(["Hi."])
        eng.source = SimpleNamespace(path=source)
        repl.handle("Hello")
        asked = tmp_path / "." / target.relative_to(tmp_path)
        repl.handle(f"/save {asked}")
        assert f"(cannot save: {asked}: it is a file of the model in use (" in out.getvalue(), out.getvalue()
        assert "/save" not in out.getvalue() and repl.failures == 1
    assert model.read_bytes() == b"the model" and (folder / "config.json").read_text() == "{}"
    repl.handle(f"/save {tmp_path / 'chat.session'}")
    assert (tmp_path / "chat.session").is_file()


# --- fastar chat through a pseudo-terminal ----------------------------------------------------------------


class Term:
    """A child process on a pseudo-terminal, with expect-style reads."""

    def __init__(self, argv: list[str], env: dict) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child: the pty is its controlling terminal, so Ctrl-C is a real SIGINT
            os.chdir(ROOT)
            os.execve(sys.executable, [sys.executable, "-m", "fastar", *argv], env)
        self.buf = b""
        self.pos = 0

    def read(self, timeout: float) -> bool:
        r, _, _ = select.select([self.fd], [], [], timeout)
        if not r:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            data = b""
        self.buf += data
        return bool(data)

    def expect(self, needle: str, timeout: float = 240) -> str:
        """Wait for `needle` after the last match; returns the text between."""
        end = time.monotonic() + timeout
        want = needle.encode()
        while want not in self.buf[self.pos :]:
            left = end - time.monotonic()
            if left <= 0 or (not self.read(min(left, 1.0)) and self.exited()):
                raise AssertionError(f"did not see {needle!r}; got:\n{self.buf[self.pos :].decode(errors='replace')}")
        i = self.buf.index(want, self.pos)
        seg = self.buf[self.pos : i].decode(errors="replace")
        self.pos = i + len(want)
        return seg

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def exited(self) -> bool:
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid:
            self.status = os.waitstatus_to_exitcode(status)
        return bool(pid)

    def close(self) -> int:
        end = time.monotonic() + 60
        while not hasattr(self, "status") and time.monotonic() < end:
            self.read(0.2)
            self.exited()
        if not hasattr(self, "status"):
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.status = -9
        os.close(self.fd)
        return self.status


def test_chat_in_a_terminal(demo_cache: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "TERM": "dumb", "FASTAR_CACHE_DIR": str(demo_cache)}
    env.pop("FASTAR_MODEL", None)
    t = Term(["chat", "-n", "30", "--seed", "1"], env)
    try:
        t.expect("DEMO model")
        t.expect(">>> ")
        t.send("Hello there!\n")
        first = t.expect(">>> ")
        assert "Hello there!" in first and len(first.strip()) > len("Hello there!")
        # turn 2: interrupt the reply as soon as it starts
        t.send("Tell me a long story.\n")
        t.expect("Tell me a long story.")
        while not t.buf[t.pos :].strip():
            assert t.read(120), "no reply started"
        t.send("\x03")  # Ctrl-C: the terminal sends SIGINT to the chat
        stopped = t.expect(">>> ")
        assert "(stopped)" in stopped and "Traceback" not in stopped
        # save, forget, restore: the restored session continues without recomputing the conversation
        t.send(f"/save {tmp_path / 'conv.session'}\n")
        assert "saved" in t.expect(">>> ")
        saved = (tmp_path / "conv.session").read_bytes()
        (tmp_path / "cut.session").write_bytes(saved[: len(saved) // 2])  # a copy cut short: refused, chat goes on
        t.send(f"/load {tmp_path / 'cut.session'}\n")
        refused = t.expect(">>> ")
        assert f"(cannot load: {tmp_path / 'cut.session'}: session file is corrupt (checksum mismatch))" in refused
        t.send("/reset\n")
        assert "reset" in t.expect(">>> ")
        t.send(f"/load {tmp_path / 'conv.session'}\n")
        assert re.search(r"loaded [45] messages", t.expect(">>> "))
        # turn 3
        t.send("And then?\n")
        third = t.expect(">>> ")
        assert len(third.strip()) > len("And then?")
        t.send("/stats\n")
        stats = t.expect(">>> ")
        assert int(re.search(r"cached_tokens=(\d+)", stats).group(1)) > 10  # turn 3 reused the loaded prefix
        t.send("/exit\n")
        t.expect("session totals:")
    finally:
        code = t.close()
    assert code == 0, t.buf.decode(errors="replace")
    assert b"Traceback" not in t.buf


def test_a_new_chat_resumes_from_the_prompt_cache(vocab_ckpt: Path, tmp_path: Path) -> None:
    """`fastar chat` saves the state at the end of each turn; a later chat (a restart: a new engine, a new cache
    object on the same folder) that resends the conversation prefills only its new tail."""
    from fastar.engine.engine import load

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    system = "You answer in one short sentence. " * 8

    def chat(turns: list[str]) -> tuple[ChatREPL, int]:
        eng = load(vocab_ckpt)
        cache = eng.open_prefix_cache(tmp_path / "pc", "1G")
        repl = ChatREPL(eng, params, system=system, out=io.StringIO(), err=io.StringIO(), prompt_cache=cache)
        computed = []
        for text in turns:
            before = eng.stats()["prefill_tokens_computed"]
            repl.reply(text)
            computed.append(eng.stats()["prefill_tokens_computed"] - before)
        return repl, computed

    first, computed = chat(["Hello there.", "And then?"])
    assert len(first.messages) == 5 and any((tmp_path / "pc").iterdir())
    prompt_len = first.session.num_tokens  # the whole conversation, its last reply token pending
    again, recomputed = chat(["Hello there."])  # the same first turn: only its last prompt token runs
    assert recomputed == [1] and computed[0] > 50
    # the conversation resent with a third message: everything up to the second reply comes from the cache
    third, more = chat(["Hello there.", "And then?", "Why?"])
    assert more[:2] == [1, 1] and 0 < more[2] < prompt_len


def test_run_prints_no_text_for_the_special_tokens_the_model_writes(demo_cache: Path) -> None:
    """The demo model's greedy reply to this prompt starts with a placeholder token, one tokenizer.json marks
    special: `run` printed its text (`<｜place▁holder▁no▁...｜>`). It gives none now, as the HTTP routes' default."""
    from fastar.encoding import encode_messages
    from fastar.engine.engine import load
    from fastar.engine.sampling import SamplingParams

    model = demo_cache / demo.DEMO_NAME
    engine = load(model)
    prompt = engine.tokenizer.encode(encode_messages([{"role": "user", "content": "Name three colours."}], "chat"))
    ids = [c.token for c in engine.stream(prompt, SamplingParams(max_tokens=8)) if c.token is not None]
    special = [i for i in ids if engine.tokenizer.is_special(i)]
    assert special, ids  # the case this test is about
    r = fastar("run", "-m", str(model), "-p", "Name three colours.", "-n", "8", "--no-thinking")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert all(engine.tokenizer.decode([i]) not in r.stdout for i in special)


def test_chat_reuses_a_reply_whose_special_tokens_were_hidden(demo_cache: Path) -> None:
    """`fastar chat` on the demo model, with replies of special tokens (which the printed text skips; here the
    pad, made the argmax by a bias): each next turn reuses every token the session processed, the reply's own ids
    included, instead of prefilling again from where the resent text left them out (tests/test_session.py has
    text and hidden tokens mixed in one reply)."""
    import fastar

    engine = fastar.load(str(demo_cache / demo.DEMO_NAME))
    try:
        pad = engine.tokenizer.token_to_id("<｜▁pad▁｜>")
        params = SamplingParams(max_tokens=8, temperature=0, logit_bias={pad: 12.0})
        repl = ChatREPL(engine, params, out=io.StringIO(), err=io.StringIO())
        for i, line in enumerate(["Hello there", "What is two plus two?", "Tell me more"]):
            processed = repl.session.num_processed
            repl.handle(line)
            assert repl.session.last_cached_tokens == processed, f"turn {i}"
        assert repl.session.tokens.count(pad) > 1  # the replies did hold pads, which their text hid
    finally:
        engine.close()
