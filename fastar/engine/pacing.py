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

A chunk is itself one model call, seconds long on a CPU (tens at full depth), so paced chunks alone would still
freeze the others' replies for a whole chunk at a time, and a short request that came meanwhile would wait for the
whole chunk too. A chunk of a prompt longer than one chunk gives way between its layers instead (`SlicedChunk`,
called by the model after each layer through `ModelState.on_layer`): there the requests that came are admitted and
those whose prompt fits in one chunk are prefilled at once (shortest first, as between chunks), each layer's time is
owed as a chunk's is, and the decode steps owed run, all before the next layer. The reader's longest wait, and a
short request's, become one layer of one chunk rather than a chunk. The chunk computes what it computes anyway (its
layers run in order on its own state; the work between them touches only the other requests' states), so no token
changes either. A prompt that fits in one chunk is not held back within its chunk either (its first token as soon
as it can), yet its chunk gives way too: at full depth a few hundred tokens take tens of seconds, and the replies
being read would stop that long. Between its layers a decode step runs once the decoding sequences have waited
the scheduler's `max_stall` since their last (`MAX_STALL`, 1 s, unless given another: `fastar serve --max-stall`),
and a still shorter prompt that came meanwhile is prefilled there (its layers giving way to the decode steps the
same way, but to no third prompt: it waits for the next layer). A prompt
cancelled meanwhile (its client gone, Stop pressed) stops there too, a layer later rather than a chunk
later, its half-advanced state dropped.

Owns: the time owed and the decision; what a sliced chunk does between its layers (timing them, asking for the work
owed). Does not own: running decode steps or prefills, timing whole steps, or choosing which prompt's chunk (the
`Scheduler`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


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
        """A decode step took `seconds` of what is owed. What it ran past the debt is credit for the next chunk or
        layer, up to that one step (decoding alone banks no more): a step can take as long as a layer of a sliced
        chunk at full depth, and without the credit the decoding sequences got about a step more than their share
        after every layer."""
        self.owed = max(-seconds, self.owed - seconds)


class ChunkCancelled(Exception):
    """Raised out of the model's forward by `SlicedChunk` when its prompt's request was cancelled: the chunk stops
    after the layer it ran, its state half advanced (to be dropped, not kept)."""


MAX_STALL = 1.0  # seconds the decoding sequences wait at most for a step while a short prompt prefills (a layer more)


def stall_limit(seconds: float) -> float:
    """`max_stall` checked: seconds the decoding sequences wait at most for a step while a prompt within one chunk
    prefills (`SlicedChunk`'s `stall`), a positive finite number. Lower: the replies being read stream more
    smoothly; higher: that prompt's first token comes sooner (fewer decode steps between its layers)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds):
        raise TypeError(f"max_stall must be a positive number of seconds, got {seconds!r}")
    if seconds <= 0:
        raise ValueError(f"max_stall must be a positive number of seconds, got {seconds}")
    return float(seconds)


class SlicedChunk:
    """One prefill chunk, giving way between its layers: the model calls it after each of its layers
    (`ModelState.on_layer(done, layers)`). There it stops the chunk if `cancelled()` (raising `ChunkCancelled`),
    lets `start_short()` admit the requests that came and prefill the shorter prompts that fit in one chunk (their
    first tokens then come a layer later, not a chunk later), books the layer's time with `pacer` as a chunk's (owed
    only while `decoding()`), and runs decode steps before the next layer: `decode()` runs one step of every
    decoding sequence and returns its seconds, or None when none decodes. With `stall` None (a long prompt's chunk)
    the steps the pacer owes; with a number of seconds (a short prompt's: its first token as soon as it can) one
    step where the decoding sequences have waited that long since their last (`stalled()`, seconds), so a reader
    waits about that long at most, not a whole chunk. `gave`: the seconds spent in that work, which are not the
    chunk's."""

    def __init__(
        self,
        pacer: PrefillPacer,
        *,
        decode: Callable[[], float | None],
        start_short: Callable[[], None],
        decoding: Callable[[], bool],
        cancelled: Callable[[], bool],
        stall: float | None = None,
        stalled: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.pacer, self.decode, self.start_short, self.decoding = pacer, decode, start_short, decoding
        self.cancelled, self.stall, self.stalled = cancelled, stall, stalled
        self.gave = 0.0
        self._at = time.perf_counter()  # when the layer running now began

    def __call__(self, done: int, layers: int) -> None:
        if self.cancelled():
            raise ChunkCancelled
        if done == layers:  # the chunk's last layer: its head comes next, then the step ends
            return
        now = time.perf_counter()
        self.pacer.prefilled(now - self._at, self.decoding())
        self.start_short()
        if self.stall is not None:
            seconds = self.decode() if self.stalled() >= self.stall else None
            if seconds is not None:
                self.pacer.decoded(seconds)
        while self.stall is None and not self.pacer.may_prefill(self.decoding(), False):
            seconds = self.decode()
            if seconds is None:
                break
            self.pacer.decoded(seconds)
        self._at = time.perf_counter()
        self.gave += self._at - now

    def end(self) -> None:
        """The chunk is done: its last layer's time (and its head's) is owed too while others decode."""
        self.pacer.prefilled(time.perf_counter() - self._at, self.decoding())
