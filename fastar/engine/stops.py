"""Stop strings in streamed text: where to cut, decided as early as possible and never leaked.

Owns `StopStrings`, shared by the engine's streams (`fastar.engine.generate`) and the server's responses
(`fastar.serve.choice_turn`), and `ReasoningEnd`, where a thinking-mode reply's answer starts in its text: stop
strings match the answer only, never the reasoning before it (a client asks for stops of the reply it reads, and
the reasoning is not that reply). Pure text, no torch: the server imports it without the model stack.
"""

from __future__ import annotations

from ..encoding import EOS, THINK_END, TOOL_CALLS_START

__all__ = ["ReasoningEnd", "StopStrings"]


class ReasoningEnd:
    """Where the reasoning of a thinking-mode reply ends in its streamed text, as the chat parser
    (`fastar.encoding.StreamParser`) reads it: right after the first `</think>` (or EOS), or at the tool-call
    opener where the model opens a call before closing its reasoning. `feed(text)` returns `(reasoning, answer)`:
    reasoning text now known to be before the end (the end marker `</think>` included), and answer text. A tail
    that could still grow into an end marker is held back until decided; `flush()` gives it back at the end."""

    # (marker, whether the answer starts after it rather than at it)
    MARKERS = ((THINK_END, True), (EOS, True), (TOOL_CALLS_START, False))

    def __init__(self) -> None:
        self.ended = False
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        if self.ended:
            return "", text
        buf = self._held + text
        hits = [(at, at + len(m) if after else at) for m, after in self.MARKERS if (at := buf.find(m)) >= 0]
        if hits:
            cut = min(hits)[1]  # the earliest marker, as the parser ends the reasoning at it
            self.ended, self._held = True, ""
            return buf[:cut], buf[cut:]
        keep = _open_tail(buf, [m for m, _ in self.MARKERS])
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], ""

    def flush(self) -> str:
        """The end of the text: the held tail (it never became an end marker: still reasoning)."""
        held, self._held = self._held, ""
        return held


def _open_tail(text: str, markers: list[str]) -> int:
    """Length of the longest tail of `text` that a marker continues past its end."""
    for k in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


class StopStrings:
    """Finds stop strings in streamed text. `feed(text)` returns `(releasable, hit)`: text that can no longer
    be part of a stop string, and whether one was found (then `releasable` ends right before it, `matched` is the
    stop string, and `hit` stays set: later text is swallowed). The cut is where the whole text would be cut at
    once: at the earliest start of any stop string, so a found stop is not acted on while one starting earlier
    could still complete. A tail that could still grow into a stop string is held back until decided; `flush()`
    settles it at the end.

    `thinking`: the text starts with reasoning (a thinking-mode reply): stop strings are matched from where the
    answer starts (`ReasoningEnd`), so none is found in the reasoning nor across its end; the reasoning is
    released as it comes (but for a tail that could begin the end marker). Without stop strings nothing is held."""

    def __init__(self, stops: list[str], thinking: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.reasoning = ReasoningEnd() if thinking and self.stops else None
        self.hit = False
        self.matched: str | None = None  # the stop string found, once `hit`
        self._held = ""
        self._floor = 0  # leading characters of `_held` fed with `match` False: no stop string may end within them

    def feed(self, text: str, match: bool = True) -> tuple[str, bool]:
        """`match` False: `text` cannot end the generation (vLLM's `min_tokens`): no stop string ending within it is
        looked for, but one that starts in it and ends in later text is (vLLM looks back a stop string's length
        before the first text it matches), so a tail that could begin one is held back all the same."""
        if self.hit:
            return "", True
        if not self.stops:
            return text, False
        if self.reasoning is not None and not self.reasoning.ended:
            before, text = self.reasoning.feed(text)
            if not text:
                return before, False
            out, hit = self._feed(text, match)
            return before + out, hit
        return self._feed(text, match)

    def _feed(self, text: str, match: bool) -> tuple[str, bool]:
        buf = self._held + text
        floor = len(buf) if not match else self._floor
        found = self._first(buf, floor)
        wait = self._open(buf)
        if found is not None and found <= wait:
            self._found(buf, found, floor)
            self._held, self._floor = "", 0
            return buf[:found], True
        self._held, self._floor = buf[wait:], max(0, floor - wait)
        return buf[:wait], False

    def flush(self) -> str:
        """The end of the text: what was held back, up to a stop string found in it (then `hit` is set)."""
        if self.reasoning is not None and not self.reasoning.ended:
            return "" if self.hit else self.reasoning.flush()  # the text ended in its reasoning: nothing to match
        held, floor = self._held, self._floor
        self._held, self._floor = "", 0
        found = None if self.hit else self._first(held, floor)
        if found is not None:
            self._found(held, found, floor)
            return held[:found]
        return "" if self.hit else held

    def _found(self, buf: str, at: int, floor: int) -> None:
        """A stop string starts at `at`: the longest of those that do and end past `floor` (as a whole-text search
        would report it)."""
        self.hit = True
        self.matched = max((s for s in self.stops if buf.startswith(s, at) and at + len(s) > floor), key=len)

    def _first(self, buf: str, floor: int = 0) -> int | None:
        """Start of the earliest complete stop string in buf that ends past its first `floor` characters."""
        starts = (buf.find(s, max(0, floor - len(s) + 1)) for s in self.stops)
        return min((i for i in starts if i >= 0), default=None)

    def _open(self, buf: str) -> int:
        """Start of the earliest tail of buf that a stop string continues past its end (len(buf) if none)."""
        longest = max(map(len, self.stops))
        for j in range(max(0, len(buf) - longest + 1), len(buf)):
            tail = buf[j:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self.stops):
                return j
        return len(buf)
