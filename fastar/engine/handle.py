"""A request submitted to the step scheduler, as its caller holds it.

Owns: `Handle`: the queue of a request's chunks (iterated from any thread, or bypassed by an `on_chunk` callback),
its cancel switch, its `done` event, and how a failure of the worker reaches the caller (`_fail`).
Does not own: running the request (`scheduler.Scheduler`) or making its chunks (`generate.ChunkMaker`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

from ..errors import FastarError
from .generate import GenerationChunk


class Handle:
    """A submitted request. Iterate it (from any thread) for its `GenerationChunk`s, the last with a
    `finish_reason`; `cancel()` ends it at the next step. With `on_chunk` given to `submit`, chunks go there
    instead (called on the worker thread) and iterating yields nothing."""

    def __init__(self, cancel: threading.Event, on_error: Callable[[BaseException], None] | None = None) -> None:
        self._cancel = cancel
        self._on_error = on_error
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self._taken_all = False
        self.done = threading.Event()  # set once the last chunk is out

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def __iter__(self) -> Iterator[GenerationChunk]:
        """The chunks not yet taken, blocking until the last (an exhausted handle yields nothing). Raises
        `FastarError` if the worker failed while the request was queued or running."""
        while not self._taken_all:
            chunk = self._chunks.get()
            if isinstance(chunk, BaseException):
                self._taken_all = True
                raise FastarError(f"generation failed: {chunk}") from chunk
            if chunk.finish_reason is not None:
                self._taken_all = True
            yield chunk

    def _fail(self, err: BaseException) -> None:
        if self._on_error is not None:
            self._on_error(err)
        else:
            self._chunks.put(err)
        self.done.set()
