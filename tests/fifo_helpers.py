"""Tests that a path which is a FIFO is refused at once rather than blocking in open() for a writer."""

from __future__ import annotations

import os
import threading


def call_bounded(fn, fifo) -> tuple[list[BaseException], bool]:
    """Runs `fn()` on a thread joined with a bound (a bound on a hang, not a timing: a refusal is immediate).
    -> (what it raised, whether it hung). A hung call is released by a writer that comes and goes on `fifo`."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as err:  # handed to the test thread
            errors.append(err)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(60)
    hung = worker.is_alive()
    if hung:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    return errors, hung
