"""Handing the server's freed heap memory back to the OS.

Owns `HeapTrimmer`: glibc's `malloc_trim(0)`, called by the worker between scheduler steps: when it goes idle
after serving requests (at most once per `IDLE_TRIM_S` seconds) and, while it stays busy, once per `BUSY_TRIM_S`
seconds; and after tokenizing a very long prompt (`fastar.serve.admission`).

Why. A request's work allocates and frees many buffers of kilobytes to megabytes (activations, logits, top-k
arrays, tokenizer and grammar buffers, JSON), on the worker thread and on the handler threads, each with its own
glibc arena. glibc keeps most of that freed memory: an arena only shrinks from its top, and a freed mmapped block
raises its mmap threshold (up to 32 MiB), so later blocks of that size come from the arenas too. Measured with
`scripts/soak.py` (docs/SERVING.md, "Memory over hours"), the server's RSS rose by about 140 MB over 8 minutes of
mixed requests with a flat Python heap (tracemalloc) and no growing structure: a `malloc_trim(0)` gave 100-150 MB
back each time. So this is no leak to fix at its source but pages to return. The place is between two steps
of the worker: when it goes idle nothing waits on it, and under steady load (8 clients keep it busy for good) a
trim every `BUSY_TRIM_S` costs one step a few milliseconds (`fastar:heap_trim_seconds_total` in /metrics).

Not glibc (musl, macOS): `available` is False and trimming does nothing. Never imports torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections.abc import Callable

IDLE_TRIM_S = 2.0  # a worker gone idle trims unless it trimmed less than this many seconds ago
BUSY_TRIM_S = 10.0  # a worker that never goes idle trims between two steps once per this many seconds


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's `malloc_trim(0)`, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: fn(0)


class HeapTrimmer:
    """Returns freed heap pages to the OS. Thread-safe.

    Args:
        idle_interval: the worker gone idle after serving (`after_step(True)`) trims unless a trim ran less than
            this many seconds ago; if one did, it trims at a later idle wake-up.
        busy_interval: a worker that stays busy (`after_step(False)`) trims once per this many seconds, between
            two steps: under steady load it never idles, and its heap grew all the same.
        trim: what trims (default: glibc's `malloc_trim(0)`); tests pass their own.
    """

    def __init__(
        self,
        idle_interval: float = IDLE_TRIM_S,
        busy_interval: float = BUSY_TRIM_S,
        trim: Callable[[], object] | None = None,
    ) -> None:
        self.idle_interval, self.busy_interval = idle_interval, busy_interval
        self._trim = trim if trim is not None else _malloc_trim()
        self._lock = threading.Lock()
        self._last = time.monotonic()  # nothing to give back before the first request
        self._dirty = False  # work ran since the last trim
        self.trims = 0  # trims done, and their time: /metrics
        self.seconds = 0.0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def _run(self) -> None:  # under _lock
        t0 = time.monotonic()
        self._trim()
        self._last = time.monotonic()
        self._dirty = False
        self.trims += 1
        self.seconds += self._last - t0

    def now(self) -> None:
        """Trim at once (an unusually large allocation was just freed)."""
        if self._trim is not None:
            with self._lock:
                self._run()

    def after_step(self, idle: bool) -> None:
        """The worker's hook after each scheduler step (`Scheduler.run(after_step=)`): `idle` when no request is
        left. Trims when the worker has gone idle after work (at most once per `idle_interval`), and once per
        `busy_interval` while it stays busy."""
        if self._trim is None:
            return
        with self._lock:
            since = time.monotonic() - self._last
            if not idle:
                self._dirty = True
                if since >= self.busy_interval:
                    self._run()
            elif self._dirty and since >= self.idle_interval:
                self._run()
