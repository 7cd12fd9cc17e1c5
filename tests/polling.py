"""Waiting in tests for something another thread or process does: a bounded poll, never a fixed sleep that a busy
machine can outrun."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(cond: Callable[[], object], timeout: float = 10.0) -> bool:
    """Poll `cond` every 10 ms until it holds or `timeout` passes; whether it held."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True
