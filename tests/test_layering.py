"""The package's dependency order, checked from the source: no module imports a layer above its own, and no two
modules import each other (directly or round a longer loop), lazily or not.

The order (README, "Layout"; docs/ARCHITECTURE.md) from the bottom up. A module may import its own package and
anything in a lower tier; two packages in one tier are independent of each other.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "fastar"

TIERS: list[set[str]] = [
    {"errors", "words"},
    {"config", "encoding", "outputs"},
    {"contracts"},
    {"format", "quant"},
    {"convert"},
    {"weights", "fixtures", "synth"},
    {"model"},
    {"engine"},
    {"audit", "demo", "serve"},
    {"console"},
    {"bench", "evaluate"},
    {"cli"},
    {"__main__"},
]
RANK = {part: i for i, tier in enumerate(TIERS) for part in tier}
# torch-free at import time
TORCH_FREE = ("errors", "words", "config", "contracts", "encoding", "outputs", "format", "serve", "cli")


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(absolute module imported, line, at module level) for every import statement in the file."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    top |= {id(n) for n in tree.body if isinstance(n, ast.If) for n in n.body}  # `if TYPE_CHECKING:` is not runtime
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            # each imported name may be a module (`from . import spec`) or not: the longest module prefix counts
            out += [(f"{name}.{a.name}", node.lineno, id(node) in top) for a in node.names]
    return out


def _component(module: str) -> str | None:
    """The top-level part of fastar a module belongs to (None: outside fastar, or a name of `fastar/__init__`)."""
    parts = module.split(".")
    if parts[0] != "fastar" or len(parts) < 2:
        return None
    return parts[1] if (ROOT / parts[1]).is_dir() or (ROOT / f"{parts[1]}.py").is_file() else None


FILES = sorted(p for p in ROOT.rglob("*.py") if ".venv" not in p.parts)


def test_every_module_has_a_tier():
    missing = sorted({_component(_module(p)) for p in FILES} - set(RANK) - {None})
    assert not missing, f"add {missing} to a tier in TIERS (and to the README's layout)"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_upward_import(path):
    src = _component(_module(path))
    if src is None:  # fastar/__init__.py: the lazy public API, by importlib
        return
    bad = [
        f"line {line}: {name}"
        for name, line, _ in _imports(path)
        if (dst := _component(name)) is not None and dst != src and RANK[dst] >= RANK[src]
    ]
    assert not bad, f"{path.relative_to(ROOT)} ({src}, tier {RANK[src]}) imports at or above its tier: {bad}"


def test_no_import_cycles():
    known = {_module(p) for p in FILES}
    graph: dict[str, set[str]] = {}
    for p in FILES:
        deps = set()
        for name, _, _ in _imports(p):
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != "fastar":
                deps.add(name)
        graph[_module(p)] = deps - {_module(p)}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d) :] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("part", TORCH_FREE)
def test_torch_free_at_import(part):
    paths = [p for p in FILES if _component(_module(p)) == part]
    assert paths
    bad = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in paths
        for name, line, top in _imports(p)
        if top and name.split(".")[0] == "torch"
    ]
    assert not bad, f"{part} must import torch only inside the functions that need it: {bad}"


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The rule itself: a format module importing the model is reported."""
    pkg = tmp_path / "fastar" / "format"
    pkg.mkdir(parents=True)
    (tmp_path / "fastar" / "model").mkdir()
    bad = pkg / "bad.py"
    bad.write_text("from __future__ import annotations\n\ndef f():\n    from ..model import ops\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path / "fastar")
    assert _imports(bad) == [("__future__.annotations", 1, True), ("fastar.model.ops", 4, False)]
    with pytest.raises(AssertionError, match="imports at or above its tier"):
        test_no_upward_import(bad)
