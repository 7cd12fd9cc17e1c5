"""The examples users copy out of the docs work as written.

- Every `fastar ...` command line of README.md, docs/*.md and CONTRIBUTING.md (fenced, indented, or an inline code
  span) parses with fastar's own parser, its `add_check` checks included, without running: a misspelt, renamed or
  removed flag in a doc fails here. A line that names a command or a flag in prose rather than a whole command is
  in FRAGMENTS with its reason; its command and every `--flag` it names must still exist.
- Every `python scripts/X.py ...` line of the same docs parses with the script's own argparse parser (the script
  run up to its `parse_args`).
- docs/SERVING.md's curl, openai, anthropic and Responses-stream examples, and docs/SCALING.md's client, run
  against a live server on the small model with the real vocabulary (its host and port put in) and give what the
  docs say. (README.md's scheduler example: tests/test_readme.py.)
- The other ```python examples of docs/EXPERT_MEMORY.md and docs/PERPLEXITY.md run (the model path put in), or are
  in NOT_RUN with the concrete reason.
- docs/EXPERT_MEMORY.md's API synopsis shows the code's parameters; docs/FORMAT.md's header example the keys of a
  header fastar writes; CONTRIBUTING.md's and docs/DEVICE.md's shell lines name files and tests that exist.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import http.client
import importlib
import inspect
import io
import itertools
import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys

import pytest
from doc_examples import DOCS, README, ROOT, SCRIPT, Command, argv, commands, fenced_blocks

from fastar.cli import build_parser

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the small models: torch's threads only add overhead

# Spans that name a command or a flag in running text, not a command to copy; the reason says which.
FRAGMENTS = {
    "fastar convert": "the command named in prose",
    "fastar verify": "the command named in prose",
    "fastar export": "the command named in prose",
    "fastar synth": "the command named in prose",
    "fastar bench -m": "the model benchmark named in prose (a heading and a sentence about its ceiling)",
    "fastar synth --router-bias 0.2": "the flag named in prose (how the skewed model was made)",
    "fastar bench --profile-prefill": "the flag named in prose (the profile that found it)",
    "fastar bench --replay": "the flag named in prose (the replay it compares with)",
    "fastar run --min-tokens": "the flag named in a table of request fields",
    "fastar run --thinking --stop": "the flags named in a table of request fields",
    "fastar synth -o OUT.fst --layers 4 [--experts --vocab --hidden --inter --mtp --seed --router-bias --force]": (
        "a synopsis listing the optional flags without their values"
    ),
}

# Placeholders written as a bare word in a value's place (`--repeats N`), and what the check gives them. Paths
# (FILE, DIR, flash.fst, ...) stay as written: the parser reads a path without opening it.
PLACEHOLDERS = {"N": "16", "P": "16", "R": "3"}


def _variants(text: str) -> list[list[str]]:
    """The argument lists a documented line stands for: `[...]` optional parts taken, an ellipsis (`…`, more
    flags of the user's) dropped, a placeholder word filled in, and a word of alternatives `a|b|c` (`--draft
    mtp|dspark|auto`, `--prompt-tokens 512|64`) giving one list per alternative."""
    text = re.sub(r"\s…(?=\s|$)", "", text.replace("[", "").replace("]", ""))  # `-p "…"` keeps its prompt
    words = [PLACEHOLDERS.get(w, w) for w in argv(text)]
    return [list(ws) for ws in itertools.product(*(w.split("|") if "|" in w else [w] for w in words))]


def _all_commands() -> list[Command]:
    return [c for path in (README, *DOCS) for c in commands(path)]


def _parse(args: list[str]) -> str | None:
    """None when fastar's parser takes `args` (its checks included), else its one-line error."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(args)
    except SystemExit as e:
        return err.getvalue().strip() or f"exit {e.code}"
    return None


def _unknown_names(text: str) -> list[str]:
    """The command and `--flags` of a line that fastar does not know (a fragment's check)."""
    parser = build_parser()
    words = argv(text.replace("[", "").replace("]", ""))
    commands = parser._subparsers._group_actions[0].choices
    if words[0] not in commands:
        return [words[0]]
    known = commands[words[0]]._option_string_actions
    return [w for w in words[1:] if w.startswith("-") and w.split("=")[0] not in known]


@pytest.fixture
def no_fastar_env(monkeypatch):
    """The FASTAR_* mirrors of the flags would change what parses (a required flag set by one)."""
    for name in list(os.environ):
        if name.startswith("FASTAR_"):
            monkeypatch.delenv(name)


def test_the_docs_show_fastar_command_lines_and_every_fragment_is_still_in_them():
    found = _all_commands()
    texts = {c.text for c in found}
    assert len(found) > 100, len(found)  # the extraction finds the docs' commands (fenced, indented, inline)
    assert set(FRAGMENTS) <= texts, set(FRAGMENTS) - texts  # a fragment no doc holds any more leaves the list
    for doc in ("docs/SERVING.md", "docs/PERPLEXITY.md", "docs/SCALING.md", "CONTRIBUTING.md", "README.md"):
        assert any(c.doc == doc and c.text not in FRAGMENTS for c in found), doc


def _failures(found: list[Command]) -> list[str]:
    """What a whole command line (each alternative of an `a|b` word) fails with, and a fragment's unknown names."""
    failures = []
    for c in found:
        if c.text in FRAGMENTS:
            if unknown := _unknown_names(c.text):
                failures.append(f"{c}\n    not in fastar: {' '.join(unknown)}")
            continue
        for args in _variants(c.text):
            if (error := _parse(args)) is not None:
                failures.append(f"{c}\n    fastar {' '.join(args)}\n    {error}")
    return failures


def test_every_documented_fastar_command_line_parses(no_fastar_env):
    """Each whole command line parses, the parser's checks included; each fragment names what fastar has."""
    failures = _failures(_all_commands())
    assert not failures, "documented commands that do not parse:\n" + "\n".join(failures)


def test_a_misspelt_flag_in_a_doc_line_fails_the_check(no_fastar_env, tmp_path):
    """The check can fail: CONTRIBUTING.md with one flag of a command misspelt, or a fragment's flag misspelt."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    for good, bad in [
        ("--policies lrfu,lru --repeats 3", "--policies lrfu,lru --repeat-count 3"),
        ("fastar bench draft -m /tmp/f.fst", "fastar bench draft -m /tmp/f.fst --replay"),
    ]:
        assert good in text
        doc = tmp_path / "CONTRIBUTING.md"
        doc.write_text(text.replace(good, bad))
        (failure,) = _failures(commands(doc))
        assert bad.split()[-1] in failure or "--repeat-count" in failure, failure
    doc.write_text(text + "\nNamed in prose: `fastar run --thinking --stopp`.\n")
    with pytest.MonkeyPatch.context() as m:
        m.setitem(FRAGMENTS, "fastar run --thinking --stopp", "a fragment")
        (failure,) = _failures(commands(doc))
    assert "not in fastar: --stopp" in failure, failure


class _Parsed(Exception):
    """Raised in place of running a script once its arguments parsed."""


def _parse_script(words: list[str], monkeypatch) -> str | None:
    """None when the script's own argparse parser takes its arguments (run up to that point: its imports and
    `main` until `parse_args` returns), else the script's one-line error."""
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise _Parsed

    err = io.StringIO()
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        m.setattr(sys, "argv", [str(ROOT / words[0]), *words[1:]])
        m.syspath_prepend(str((ROOT / words[0]).parent))  # as python puts a script's folder first
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                runpy.run_path(str(ROOT / words[0]), run_name="__main__")
        except _Parsed:
            return None
        except SystemExit as e:
            return err.getvalue().strip() or f"exit {e.code}"
    return "ran without parsing its arguments with argparse"


def test_every_documented_script_command_line_parses(monkeypatch):
    """`python scripts/X.py ...` lines (placeholders and alternatives as for fastar's) parse with the script's
    parser: a flag a script renamed or dropped fails here."""
    found = [c for path in (README, *DOCS) for c in commands(path, SCRIPT)]
    assert len(found) >= 10, found
    failures = []
    for c in found:
        for args in _variants(c.text):
            if (error := _parse_script(args, monkeypatch)) is not None:
                failures.append(f"{c}\n    python {' '.join(args)}\n    {error}")
    assert not failures, "documented script lines that do not parse:\n" + "\n".join(failures)


def test_the_shell_lines_of_contributing_and_device_name_files_and_tests_that_exist():
    """CONTRIBUTING.md's `bash X` set-up lines and `python -m pytest` lines (a file, a `file::test`, `-k WORD`),
    and docs/DEVICE.md's GPU check: the files, the test and a test matching the word exist."""
    checked = 0
    for path in (ROOT / "CONTRIBUTING.md", ROOT / "docs" / "DEVICE.md"):
        for block in fenced_blocks(path):
            if block.lang not in ("", "sh"):
                continue
            for line in block.text.split("\n"):
                words = [w for w in shlex.split(line, comments=True) if "=" not in w]  # DRY=1: an environment
                if words[:1] == ["bash"]:
                    assert (ROOT / words[1]).is_file(), line
                    checked += 1
                if words[:3] != ["python", "-m", "pytest"]:
                    continue
                files = [w for w in words if w.startswith("tests/")]
                for w in files:
                    file, _, test = w.partition("::")
                    assert (ROOT / file).is_file(), line
                    assert not test or f"def {test}(" in (ROOT / file).read_text(), line
                    checked += 1
                if "-k" in words:
                    word = words[words.index("-k") + 1]
                    (file,) = files
                    assert re.search(rf"def test\w*{word}\w*\(", (ROOT / file).read_text()), line
    assert checked >= 6, checked


# ---------------------------------------------------------------------------------------------------------------
# The code examples

SERVING, SCALING = ROOT / "docs" / "SERVING.md", ROOT / "docs" / "SCALING.md"
EXPERT_MEMORY, PERPLEXITY = ROOT / "docs" / "EXPERT_MEMORY.md", ROOT / "docs" / "PERPLEXITY.md"

# The ```python blocks no test here runs, by the text that identifies each, with the reason.
NOT_RUN = {
    (EXPERT_MEMORY, "cache = ExpertCache(fst: FstFile"): (
        "an API synopsis (annotated parameters and `-> result`s), not code: its imports run and its calls' "
        "parameters are compared with the code's signatures below"
    ),
    (EXPERT_MEMORY, "res = bench_cache("): (
        "reads the 20 GB Flash-width synthetic /tmp/fb/flash4.fst (its budgets are counts of Flash's 13.4 MB "
        "records) and sleeps 15 ms a layer for 100 tokens: a benchmark of minutes"
    ),
}


def run_block(code: str, scope: dict) -> list:
    """Run an example as written, in `scope`; the values of its top-level expression statements (the lines a
    reader would see printed at a prompt), each computed once."""
    values = []
    for stmt in ast.parse(code).body:
        if isinstance(stmt, ast.Expr):
            values.append(eval(compile(ast.Expression(stmt.value), "<doc>", "eval"), scope))
        else:
            exec(compile(ast.Module([stmt], []), "<doc>", "exec"), scope)
    return values


def python_block(path, marker: str) -> str:
    (block,) = [b.text for b in fenced_blocks(path, "python") if marker in b.text]
    return block


def test_every_python_block_of_these_docs_is_run_or_listed():
    """A new ```python example in these docs is run by a test here or listed in NOT_RUN with its reason."""
    run_here = {
        (SERVING, "client.chat.completions.create("),
        (SERVING, "client.messages.create("),
        (SERVING, "client.responses.stream("),
        (SCALING, "gpu-box:8080"),
        (EXPERT_MEMORY, "simulate(tr, 256, n"),
        (PERPLEXITY, "engine.prompt_logprobs("),
    }
    markers = run_here | set(NOT_RUN)
    for path in (SERVING, SCALING, EXPERT_MEMORY, PERPLEXITY):
        for b in fenced_blocks(path, "python"):
            assert sum(m in b.text for p, m in markers if p == path) == 1, f"{path.name}:{b.line} run or listed?"


@pytest.fixture(scope="module")
def server(vocab_ckpt):
    """The small model with the real vocabulary, served on a free port. Its context is 192 tokens: a request
    without max_tokens (docs/SCALING.md's) fills the room left and no more."""
    from fastar.engine.engine import load
    from fastar.serve.server import Server

    engine = load(vocab_ckpt)
    engine.context_length = 192
    srv = Server(lambda: engine, port=0).start()
    try:
        assert srv.wait_ready(120)
        yield srv
    finally:
        srv.shutdown()


def _at(text: str, srv, where: str = "127.0.0.1:8080") -> str:
    assert where in text
    return text.replace(where, f"127.0.0.1:{srv.port}")


def test_serving_curl_example_gets_a_chat_reply(server):
    """The curl line as written (curl when installed, else the same request through http.client): the reply's
    `choices[0].message` holds `content` and, in thinking mode (the default), `reasoning_content`."""
    (block,) = [b.text for b in fenced_blocks(SERVING, "sh") if b.text.startswith("curl ")]
    block = _at(block, server)
    if shutil.which("curl"):
        done = subprocess.run(["bash", "-c", block], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        reply = json.loads(done.stdout)
    else:
        (body,) = re.findall(r"-d '(.*)'", block)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        reply = json.loads(conn.getresponse().read())
        conn.close()
    message = reply["choices"][0]["message"]
    assert message["role"] == "assistant" and "content" in message, reply
    assert message["reasoning_content"], reply
    assert reply["usage"]["completion_tokens"] <= 64


def test_serving_openai_anthropic_and_responses_stream_examples_run(server, capsys):
    """Run as written against the server: the openai reply answers at once (content printed, no reasoning), the
    anthropic reply has no thinking block, and the Responses stream (with the openai example's `client`) ends
    with its response, completed or incomplete; cut short, the SDK's `get_final_response()` raises
    the error the doc quotes."""
    scope: dict = {}
    block = python_block(SERVING, "client.chat.completions.create(")
    assert 'base_url="http://127.0.0.1:8080/v1"' in block
    exec(_at(block, server), scope)
    assert scope["reply"].choices[0].message.content, scope["reply"]
    assert not getattr(scope["reply"].choices[0].message, "reasoning_content", None)
    assert capsys.readouterr().out.strip() == scope["reply"].choices[0].message.content.strip()

    exec(python_block(SERVING, "client.responses.stream("), scope)  # the client above
    assert scope["response"].status in ("completed", "incomplete"), scope["response"]
    if scope["response"].status == "incomplete":  # sampled at temperature 1: nearly always 16 tokens of thinking
        assert scope["response"].incomplete_details.reason == "max_output_tokens"
    # what the doc says the SDK's helper does with a stream cut short (greedy: the same tokens every run), verbatim
    (said,) = re.findall(r"``RuntimeError: (.*?)``", SERVING.read_text())
    cut_short = scope["client"].responses.stream(
        model="deepseek-v4-flash", input="Hello", max_output_tokens=16, temperature=0
    )
    with pytest.raises(RuntimeError) as raised, cut_short as stream:
        stream.get_final_response()
    assert str(raised.value) == said

    a_scope: dict = {}
    exec(_at(python_block(SERVING, "client.messages.create("), server), a_scope)
    message = a_scope["message"]
    assert message.content and [b.type for b in message.content] == ["text"], message
    assert capsys.readouterr().out.startswith("[TextBlock(")


def test_scaling_client_example_runs_against_fastar(server):
    """docs/SCALING.md's client, pointed back at fastar: the same fields are accepted (thinking on, effort high)."""
    (reply,) = run_block(_at(python_block(SCALING, "gpu-box:8080"), server, "gpu-box:8080"), {})
    assert reply.choices[0].message.reasoning_content, reply  # thinking, as chat_template_kwargs asked


def _synopsis_calls(synopsis: str, scope: dict) -> list[tuple[object, str, list[str], int]]:
    """Each `name(params)` of the API synopsis: what it names (a line `fastar.x.y:` makes the module the owner of
    the bare names after it, a line starting `cache` the ExpertCache, `Name(` or `Name:` that class for the `.name(`
    lines after it), the documented parameter names, and the line."""
    lines = [line.split("#")[0] for line in synopsis.split("\n")]
    owners, owner = [], None
    for line in lines:
        if m := re.match(r"(fastar(?:\.\w+)+):$", line.strip()):
            owner = importlib.import_module(m.group(1))
        elif m := re.match(r"(cache\b|[A-Z]\w*[(:])", line):
            owner = scope["ExpertCache" if m.group(1) == "cache" else m.group(1)[:-1]]
        owners.append(owner)
    text, calls = "\n".join(lines), []
    for m in re.finditer(r"\b(\w+)\(", text):
        depth, end = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        pieces, depth, start = [], 0, m.end()
        for i in range(m.end(), end - 1):
            depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(text[i], 0)
            if text[i] == "," and depth == 0:
                pieces.append(text[start:i])
                start = i + 1
        pieces.append(text[start : end - 1])
        names = [re.match(r"\w*", p.strip().lstrip("*")).group(0) for p in pieces]
        line = text.count("\n", 0, m.start())
        calls.append((owners[line], m.group(1), [n for n in names if n], line + 1))
    return calls


def test_expert_memory_api_synopsis_matches_the_code_and_the_sweep_runs():
    """The API synopsis's imports exist and each call it shows names a function or method with those parameters,
    in that order, every required one shown (a renamed, moved or removed parameter fails). The sweep cell gives
    three hit rates in [0, 1], the prefetched one no lower than LRFU alone (the doc's table: prefetch adds hits)."""
    synopsis = python_block(EXPERT_MEMORY, "cache = ExpertCache(fst: FstFile")
    scope: dict = {}
    exec("\n".join(line for line in synopsis.split("\n") if line.startswith("from fastar")), scope)
    calls = _synopsis_calls(synopsis, scope)
    assert len(calls) > 30, calls
    wrong = []
    for owner, name, documented, line in calls:
        fn = owner if getattr(owner, "__name__", None) == name else getattr(owner, name, None)
        if fn is None:
            wrong.append(f"synopsis line {line}: {name} is not in {owner}")
            continue
        params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
        real = [p.name for p in params]
        required = [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not set(required) <= set(documented) or [n for n in real if n in documented] != documented:
            wrong.append(
                f"synopsis line {line}: {name}({', '.join(documented)}) but the code has {name}{inspect.signature(fn)}"
            )
    assert not wrong, "\n".join(wrong)

    before, after = run_block(python_block(EXPERT_MEMORY, "simulate(tr, 256, n"), {})
    assert all(0 <= r <= 1 for r in (*before, after)), (before, after)
    assert after >= before[1], (before, after)


def test_perplexity_prompt_logprobs_example_runs(vocab_ckpt):
    """With the small model's path for flash.fst: one logprob, rank and top list per token, as the comments say."""
    block = python_block(PERPLEXITY, "engine.prompt_logprobs(")
    assert '"flash.fst"' in block
    scope: dict = {}
    logprobs, ranks, top, total = run_block(block.replace('"flash.fst"', repr(str(vocab_ckpt))), scope)
    s, engine = scope["scores"], scope["engine"]
    try:
        assert (logprobs, ranks, top, total) == (s.logprobs, s.ranks, s.top, s.total())
        n = len(engine.tokenizer.encode("The capital of France is Paris."))
        assert len(s.logprobs) == len(s.ranks) == len(s.top) == n > 1
        assert s.logprobs[0] is None and s.ranks[0] is None and s.top[0] == []
        assert all(lp <= 0 for lp in s.logprobs[1:]) and all(r >= 1 for r in s.ranks[1:])
        assert all(len(t) == 5 for t in s.top[1:])
        assert s.total() == pytest.approx(sum(s.logprobs[1:]))
    finally:
        engine.close()


def _lenient_json(text: str):
    """A documented JSON example with `...` for what it leaves out: `[...]` an empty list, `, ...` dropped, a
    `...` value null."""
    text = re.sub(r"\[\s*\.\.\.\s*\]", "[]", text)
    text = re.sub(r",\s*\.\.\.\s*(?=[\]}])", "", text)
    return json.loads(re.sub(r":\s*\.\.\.", ": null", text))


def test_format_header_example_has_the_fields_a_written_header_has(tiny_fst_file):
    """docs/FORMAT.md's header: the same keys as the header fastar writes, at every level it shows (its `config`
    lists a few of the fields, each a real one); the first tensor's, blob's and expert section's keys likewise."""
    (block,) = fenced_blocks(ROOT / "docs" / "FORMAT.md", "json")
    doc, real = _lenient_json(block.text), tiny_fst_file.header
    assert doc.keys() == real.keys()
    assert doc["format"] == real["format"] and doc["version"] == real["version"]
    for key in ("converter", "source", "experts"):
        assert doc[key].keys() == real[key].keys(), key
    assert doc["config"].keys() <= real["config"].keys()
    for key in ("tensors", "blobs"):
        assert doc[key][0].keys() == real[key][0].keys(), key
    assert doc["experts"]["sections"][0].keys() == real["experts"]["sections"][0].keys()
    assert doc["tensors"][0]["name"] in {t["name"] for t in real["tensors"]}
