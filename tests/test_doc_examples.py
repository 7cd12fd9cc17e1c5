"""The command lines users copy out of the docs parse as written.

Every `fastar ...` command line of README.md, docs/*.md and CONTRIBUTING.md (fenced, indented, or an inline code
  span) parses with fastar's own parser, its `add_check` checks included, without running: a misspelt, renamed or
  removed flag in a doc fails here. A line that names a command or a flag in prose rather than a whole command is
  in FRAGMENTS with its reason; its command and every `--flag` it names must still exist.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import re

import pytest
from doc_examples import DOCS, README, ROOT, Command, argv, commands

from fastar.cli import build_parser

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
