"""Stop strings in streamed text: where to cut, decided as early as possible and never leaked.

Owns `StopStrings`, shared by the engine's streams (`fastar.engine.generate`) and the server's responses
(`fastar.serve.choice_turn`). Pure text, no torch: the server imports it without the model stack.
"""

from __future__ import annotations

__all__ = ["StopStrings"]


class StopStrings:
    """Finds stop strings in streamed text. `feed(text)` returns `(releasable, hit)`: text that can no longer
    be part of a stop string, and whether one was found (then `releasable` ends right before it, `matched` is the
    stop string, and `hit` stays set: later text is swallowed). The cut is where the whole text would be cut at
    once: at the earliest start of any stop string, so a found stop is not acted on while one starting earlier
    could still complete. A tail that could still grow into a stop string is held back until decided; `flush()`
    settles it at the end."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
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
