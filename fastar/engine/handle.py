"""A request submitted to the step scheduler, as its caller holds it.

Owns: `Handle`: the queue of a request's chunks (iterated from any thread, or bypassed by an `on_chunk` callback),
its cancel switch, its `done` event, and how a failure of the worker reaches the caller (`_fail`).
Does not own: running the request (`scheduler.Scheduler`) or making its chunks (`generate.ChunkMaker`); whether
the iterating thread must step the scheduler itself, because no worker does (`stepper.Stepper`).
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

    # how long an iterator waits on a worker's chunks before it checks again that a worker is still there
    WORKER_CHECK_S = 0.5

    def __init__(
        self,
        cancel: threading.Event,
        on_error: Callable[[BaseException], None] | None = None,
        drive: Callable[[], bool] | None = None,
        queued: bool = True,
    ) -> None:
        self._cancel = cancel
        self._on_error = on_error
        self._drive = drive  # steps the scheduler on this thread when no worker does (False: a worker does)
        self._queued = queued  # False: the chunks go to an on_chunk callback, and iterating yields nothing
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self._taken_all = False
        self.done = threading.Event()  # set once the last chunk is out

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def __iter__(self) -> Iterator[GenerationChunk]:
        """The chunks not yet taken, blocking until the last (an exhausted handle yields nothing). Where no worker
        steps the scheduler (no `run` loop, and no other live thread has stepped it), the iterating thread steps
        it itself. Raises `FastarError` if the worker failed while the request was queued or running."""
        while self._queued and not self._taken_all:
            chunk = self._next()
            if isinstance(chunk, BaseException):
                self._taken_all = True
                raise FastarError(f"generation failed: {chunk}") from chunk
            if chunk.finish_reason is not None:
                self._taken_all = True
            yield chunk

    def _next(self) -> GenerationChunk | BaseException:
        while True:
            try:
                return self._chunks.get_nowait()
            except queue.Empty:
                pass
            if self._drive is not None and self._drive():
                continue  # this thread took a step
            try:
                return self._chunks.get(timeout=self.WORKER_CHECK_S)
            except queue.Empty:
                continue  # is the worker still there?

    def _fail(self, err: BaseException) -> None:
        if self._on_error is not None:
            self._on_error(err)
        else:
            self._chunks.put(err)
        self.done.set()
