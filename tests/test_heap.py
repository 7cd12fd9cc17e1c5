"""`fastar.serve.heap.HeapTrimmer`: freed heap memory handed back to the OS between the worker's steps (a soak's
RSS rose for minutes with a flat Python heap: glibc kept the freed pages): when the worker goes idle after work,
and at intervals while it stays busy, never while it idles with nothing served."""

from __future__ import annotations

import itertools
import time

from fastar.serve.heap import HeapTrimmer


def counting(**intervals) -> tuple[HeapTrimmer, list[float]]:
    calls: list[float] = []
    return HeapTrimmer(trim=lambda: calls.append(time.monotonic()), **intervals), calls


def test_idle_with_nothing_served_never_trims():
    heap, calls = counting(idle_interval=0, busy_interval=60)
    for _ in range(5):
        heap.after_step(True)
    assert calls == [] and heap.trims == 0


def test_going_idle_after_work_trims_once():
    heap, calls = counting(idle_interval=0, busy_interval=60)
    heap.after_step(False)
    assert calls == []  # busy, and the busy interval has not passed
    heap.after_step(True)
    heap.after_step(True)
    assert len(calls) == 1 and heap.trims == 1 and heap.seconds >= 0


def test_an_idle_trim_too_soon_after_the_last_waits_for_a_later_idle_step():
    heap, calls = counting(idle_interval=0.5, busy_interval=60)
    heap.after_step(False)
    heap.after_step(True)  # less than idle_interval since the trimmer started: not yet
    assert calls == []
    time.sleep(0.55)
    heap.after_step(True)  # the worker's next idle wake-up
    assert len(calls) == 1


def test_a_worker_that_stays_busy_trims_once_per_busy_interval():
    t0 = time.monotonic()  # before the trimmer starts its clock
    heap, calls = counting(idle_interval=0, busy_interval=0.2)
    while (time.monotonic() < t0 + 0.5 or not calls) and time.monotonic() < t0 + 10:
        heap.after_step(False)
        time.sleep(0.01)
    # steady load never idles, and its heap is trimmed all the same: after 0.2 s, then 0.2 s or more apart (a step
    # delayed by a busy machine moves a trim later, never earlier, so this holds however the sleeps run)
    assert calls, "a worker busy for good never trimmed"
    assert calls[0] - t0 >= 0.2
    assert all(b - a >= 0.2 for a, b in itertools.pairwise(calls))


def test_a_trim_now_is_not_rate_limited_and_restarts_the_intervals():
    heap, calls = counting(idle_interval=60, busy_interval=60)
    heap.now()
    heap.now()
    assert len(calls) == 2
    heap.after_step(False)
    heap.after_step(True)
    assert len(calls) == 2


def test_the_default_trim_runs_on_this_platform():
    heap = HeapTrimmer()
    heap.now()  # glibc's malloc_trim(0), or nothing without one; never raises
    assert heap.trims == (1 if heap.available else 0)
