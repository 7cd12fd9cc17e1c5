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

    def feed(self, text: str, match: bool = True) -> tuple[str, bool]:
        """`match` False: `text` cannot end the generation (vLLM's `min_tokens`): it is released whole, with what was
        held, and no stop string is looked for in it."""
        if self.hit:
            return "", True
        if not self.stops or not match:
            held, self._held = self._held, ""
            return held + text, False
        buf = self._held + text
        found = self._first(buf)
        wait = self._open(buf)
        if found is not None and found <= wait:
            self._found(buf, found)
            self._held = ""
            return buf[:found], True
        self._held = buf[wait:]
        return buf[:wait], False

    def flush(self) -> str:
        """The end of the text: what was held back, up to a stop string found in it (then `hit` is set)."""
        held, self._held = self._held, ""
        found = None if self.hit else self._first(held)
        if found is not None:
            self._found(held, found)
            return held[:found]
        return "" if self.hit else held

    def _found(self, buf: str, at: int) -> None:
        """A stop string starts at `at`: the longest of those that do (as a whole-text search would report it)."""
        self.hit = True
        self.matched = max((s for s in self.stops if buf.startswith(s, at)), key=len)

    def _first(self, buf: str) -> int | None:
        """Start of the earliest complete stop string in buf."""
        return min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=None)

    def _open(self, buf: str) -> int:
        """Start of the earliest tail of buf that a stop string continues past its end (len(buf) if none)."""
        longest = max(map(len, self.stops))
        for j in range(max(0, len(buf) - longest + 1), len(buf)):
            tail = buf[j:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self.stops):
                return j
        return len(buf)
