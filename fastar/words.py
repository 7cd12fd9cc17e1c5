"""Counts said in words: `counted(1, "layer")` is "1 layer", `counted(3, "layer")` "3 layers".

Owns: the singular/plural choice of every count the command line prints beside its noun (the CLI, `fastar run` and
`chat`, the benchmarks), so that none says "1 layers". Does not own: the number's own format (pass `fmt`, e.g.
`","` for thousands separators) nor nouns whose plural is not the singular plus "s" (pass `plural`).
"""

from __future__ import annotations


def counted(n: float, noun: str, plural: str | None = None, fmt: str = "") -> str:
    """`n` and `noun`, the noun plural unless `n` is exactly 1 ("1 token", "0 tokens", "2 tokens");
    `plural` where adding "s" is wrong ("1 reply", "2 replies"), `fmt` the number's format spec."""
    return f"{n:{fmt}} {noun if n == 1 else plural or noun + 's'}"
