"""What the tests of the docs' examples share (tests/test_readme.py, tests/test_doc_examples.py): the documents users
copy from, their fenced blocks, and every `fastar ...` command line they show (fenced, indented or an inline code
span), each with the document and line it came from."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "CONTRIBUTING.md"]

_FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    lang: str  # the fence's info string ("" for a plain fence)
    text: str
    line: int  # of the block's first line, 1-based


@dataclass(frozen=True)
class Command:
    text: str  # as the document writes it, whitespace collapsed (an inline span may break across lines)
    doc: str  # the file name relative to the repository
    line: int

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def fenced_blocks(path: Path, lang: str | None = None) -> list[Block]:
    """The fenced code blocks of a Markdown file, in order; only those whose info string is `lang` when given."""
    text = path.read_text()
    blocks = []
    for m in _FENCE.finditer(text):
        if lang is None or m.group(1) == lang:
            blocks.append(Block(m.group(1), m.group(2), text.count("\n", 0, m.start(2)) + 1))
    return blocks


FASTAR = r"fastar\s+[a-z-]"  # a command of the `fastar` program
SCRIPT = r"python3?\s+scripts/\w+\.py\b"  # one of the repository's scripts


def commands(path: Path, program: str = FASTAR) -> list[Command]:
    """Every `fastar ...` command line of a Markdown file (or whatever `program` matches at a line's start): the
    lines of its fenced blocks (a trailing `\\` joins the next line), its indented lines outside fences, and its
    inline code spans that match (a span may break across lines; `\\|`, a table's escaped bar, is read as `|`)."""
    doc = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    text = path.read_text()
    found: list[Command] = []
    for block in fenced_blocks(path):  # a python block's synopsis lines too
        lines = block.text.split("\n")
        i = 0
        while i < len(lines):
            start, line = i, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            if re.match(program, line.strip()):
                found.append(Command(" ".join(line.split()), doc, block.line + start))
    # outside the fences (blanked, keeping the line count): indented lines, then inline code spans
    rest = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for n, line in enumerate(rest.split("\n"), 1):
        if line.startswith("    ") and re.match(program, line.strip()):
            found.append(Command(" ".join(line.split()), doc, n))
    for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", rest, re.S):
        span = m.group(2)
        if "\n\n" in span:
            continue
        span = " ".join(span.replace("\\|", "|").split())
        if re.match(program, span):
            found.append(Command(span, doc, rest.count("\n", 0, m.start()) + 1))
    found.sort(key=lambda c: c.line)
    return found


def argv(command: str) -> list[str]:
    """A command line's arguments after `fastar` (after `python`, its script first), as a shell splits them (a
    `#` comment dropped)."""
    words = shlex.split(command, comments=True)
    assert words[0] in ("fastar", "python", "python3"), command
    return words[1:]
