"""How much of the scheduler's time a prompt's prefill chunks take while other sequences decode.

A step decodes one token of every decoding sequence and may prefill one chunk of a waiting prompt. On a CPU a
512-token chunk takes seconds (3-4 s on a 4-layer Flash-width model, tens of seconds at full depth) against tens
to hundreds of milliseconds for a decode step, so if every step carried a chunk, a user reading a reply would get
one token per chunk for as long as another user's long prompt prefills. `PrefillPacer` keeps the chunks to a
share of the time instead: after a chunk of C seconds run while others decode, the decoding sequences are owed
C (1 - share) / share seconds of decode steps before the next chunk. At share 0.5 they decode at about half their
speed and the long prompt prefills at about half of its own; at 1 every step carries a chunk (the old order).

A prompt whose rest fits in one chunk (a short request, or a long prompt's last chunk) is not held back: its first
token comes as soon as it can, as shortest-remaining-first scheduling intends; its chunk's time is owed all the
same. Only when a chunk runs changes; the chunks themselves do not, so no token changes (a prompt is prefilled in
the chunks `Session.prefill` uses, and decode steps are batch-invariant).

Owns: the time owed and the decision. Does not own: timing the steps or choosing which prompt's chunk (the
`Scheduler`).
"""

from __future__ import annotations

import math


class PrefillPacer:
    """`share`: the part of the worker's time prefill chunks may take while other sequences decode, in (0, 1]."""

    def __init__(self, share: float = 0.5) -> None:
        if isinstance(share, bool) or not isinstance(share, int | float) or not math.isfinite(share):
            raise TypeError(f"prefill_share must be a number in (0, 1], got {share!r}")
        if not 0 < share <= 1:
            raise ValueError(f"prefill_share must be in (0, 1], got {share}")
        self.share = float(share)
        self.owed = 0.0  # seconds of decode steps owed to the decoding sequences before the next chunk

    def may_prefill(self, decoding: bool, last_chunk: bool) -> bool:
        """Whether this step may run a chunk: always when nothing decodes (then nothing is owed any more) or the
        chunk ends its prompt; else once the decode steps owed have run."""
        if not decoding:
            self.owed = 0.0
            return True
        return last_chunk or self.owed <= 0.0

    def prefilled(self, seconds: float, decoding: bool) -> None:
        """A chunk took `seconds`; while others decoded, they are owed their share of it."""
        if decoding:
            self.owed += seconds * (1.0 - self.share) / self.share

    def decoded(self, seconds: float) -> None:
        """Decode steps took `seconds` of what is owed."""
        self.owed = max(0.0, self.owed - seconds)
