"""Who steps a scheduler: its worker, or, where it has none, the threads waiting on its handles.

Owns: `Stepper`: the lock that keeps steps from overlapping, which thread is the worker (one in a `run` loop, or one
inside a `step` it called itself, for as long as that step lasts), and `drive`: the step an iterating handle takes
on its own thread when there is no worker, so iterating a handle never waits on a worker that does not exist. A
thread that called `step` and went on to other work (`run_until_idle` returned, a loop of its own ended) is no
worker: it steps no more, so a handle iterated elsewhere steps the scheduler itself.
Does not own: what a step does (`scheduler.Scheduler`), or a handle's chunks (`handle.Handle`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..errors import FastarError


class Stepper:
    """Runs `step` (one scheduler step) for whichever thread asks, one at a time; `on_failure` ends every request
    with the error when a step raises (no caller may wait forever on a worker that died)."""

    def __init__(self, step: Callable[[], bool], on_failure: Callable[[BaseException], None]) -> None:
        self._step = step
        self._on_failure = on_failure
        self._lock = threading.Lock()  # steps never overlap, whichever thread takes them
        self._state = threading.Lock()  # guards the fields below
        self._driver: threading.Thread | None = None  # the thread inside a `step` it called itself: the worker now
        self._stepping: threading.Thread | None = None  # the thread inside a step now
        self._running = 0  # `run` loops going

    def step(self) -> bool:
        """A worker's step (`Scheduler.step`): the calling thread is the worker while the step lasts (waiting for
        the step lock included), not after it returns."""
        me = threading.current_thread()
        with self._state:
            self._driver = me
        try:
            return self._locked()
        finally:
            with self._state:
                if self._driver is me:
                    self._driver = None

    @contextmanager
    def running(self) -> Iterator[None]:
        """Around a `run` loop: while it goes, it is the worker."""
        with self._state:
            self._running += 1
        try:
            yield
        finally:
            with self._state:
                self._running -= 1

    def failing_step(self) -> bool:
        """One step; when it raises, every request ends with the error first."""
        try:
            return self._locked()
        except BaseException as err:
            self._on_failure(err)
            raise

    def drive(self) -> bool:
        """Take one step on this thread when no worker steps the scheduler; False when one does (the caller waits
        for its chunks). Raises FastarError inside a step (an `on_chunk` callback iterating a handle would wait on
        its own thread)."""
        me = threading.current_thread()
        with self._state:
            if self._stepping is me:
                raise FastarError(
                    "a request's handle cannot be iterated inside the scheduler's own step (an on_chunk "
                    "callback): its chunks come from that step"
                )
            if self._running or (self._driver is not None and self._driver is not me):
                return False  # a worker steps: its chunks come (the caller rechecks after WORKER_CHECK_S)
        self.failing_step()
        return True

    def _locked(self) -> bool:
        with self._lock:
            with self._state:
                self._stepping = threading.current_thread()
            try:
                return self._step()
            finally:
                with self._state:
                    self._stepping = None
