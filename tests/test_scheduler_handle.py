"""A scheduler's handles as a library caller holds them: iterating one where no worker steps the scheduler steps it
on the iterating thread (never a wait on a worker that does not exist); a handle whose chunks go to a callback
yields nothing; iterating inside the scheduler's own step is refused. Each iteration runs on a daemon thread
joined with a bound, so a hang is a failure, not a stuck run."""

from __future__ import annotations

import threading

import pytest
from batch_helpers import needs_invariant_kernels, prompt, same_chunks, solo

from fastar.engine.engine import load
from fastar.engine.sampling import SamplingParams
from fastar.engine.scheduler import Scheduler
from fastar.errors import FastarError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BOUND_S = 120  # far above what the tiny model needs; only a hang reaches it


@pytest.fixture(scope="module")
def eng(tiny_ckpt):
    return load(tiny_ckpt)


def bounded(fn):
    """Run `fn` on a daemon thread; its result, or a failure if it is still running after BOUND_S."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as err:  # handed to the test thread
            out["error"] = err

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(BOUND_S)
    assert not t.is_alive(), "iterating the handle did not finish: it waits on a worker that does not exist"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_handle_iterated_with_no_worker_steps_the_scheduler_itself(eng):
    """submit, then iterate, with no `run` loop anywhere: the handle's chunks are those of the request alone."""
    needs_invariant_kernels()
    sched = Scheduler(eng)
    ids, p = prompt(1, 9), SamplingParams(max_tokens=6, ignore_eos=True)
    h = sched.submit(ids, p)
    chunks = bounded(lambda: list(h))
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage["completion_tokens"] == 6
    same_chunks(chunks, solo(eng, ids, p))
    assert sched.idle


def test_callers_on_several_threads_with_no_worker_all_finish(eng):
    """Three threads each submit and iterate their own request, with no worker: they step the scheduler in turn
    (steps never overlap) and every one gets its solo chunks."""
    needs_invariant_kernels()
    sched = Scheduler(eng)
    reqs = [(prompt(10 + i, 5 + 7 * i), SamplingParams(max_tokens=5 + i, ignore_eos=True)) for i in range(3)]
    handles = [sched.submit(ids, p) for ids, p in reqs]
    out: list = [None] * 3

    def client(i):
        out[i] = list(handles[i])

    def all_clients():
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(BOUND_S)
        return [t.is_alive() for t in threads]

    assert bounded(all_clients) == [False] * 3
    for (ids, p), chunks in zip(reqs, out, strict=True):
        same_chunks(chunks, solo(eng, ids, p))


def test_requests_left_when_the_worker_loop_stopped_are_stepped_by_their_iterator(eng):
    """A `run` loop that was stopped (its thread gone) is no longer a worker: a request submitted after it is
    stepped by the thread iterating its handle."""
    sched = Scheduler(eng)
    stop = threading.Event()
    worker = threading.Thread(target=sched.run, args=(stop, 0.01), daemon=True)
    worker.start()
    first = sched.submit(prompt(2, 6), max_tokens=3, ignore_eos=True)
    assert [c.finish_reason for c in bounded(lambda: list(first))][-1] == "length"  # the worker ran it
    stop.set()
    worker.join(BOUND_S)
    assert not worker.is_alive()
    late = sched.submit(prompt(3, 6), max_tokens=4, ignore_eos=True)
    chunks = bounded(lambda: list(late))
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage["completion_tokens"] == 4


def test_a_thread_that_stepped_and_stopped_is_no_longer_the_worker(eng):
    """A thread that called `step` (here `run_until_idle`) and then went on to wait on something else, alive, is
    not a worker any more: a request submitted afterwards is stepped by the thread iterating its handle (it used
    to wait on that thread for ever)."""
    sched = Scheduler(eng)
    first = sched.submit(prompt(7, 6), max_tokens=2, ignore_eos=True)
    stepped, release = threading.Event(), threading.Event()

    def stepper():
        sched.run_until_idle()
        stepped.set()
        release.wait()  # alive, stepping no more

    t = threading.Thread(target=stepper, daemon=True)
    t.start()
    try:
        assert stepped.wait(BOUND_S)
        assert [c.finish_reason for c in first][-1] == "length"
        late = sched.submit(prompt(8, 6), max_tokens=3, ignore_eos=True)
        chunks = bounded(lambda: list(late))
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage["completion_tokens"] == 3
    finally:
        release.set()
        t.join(BOUND_S)


def test_a_handle_whose_chunks_go_to_a_callback_yields_nothing(eng):
    """With on_chunk, the chunks go to the callback and iterating the handle yields nothing (it used to wait for
    chunks that never come to its queue)."""
    sched = Scheduler(eng)
    seen = []
    h = sched.submit(prompt(4, 5), SamplingParams(max_tokens=3, ignore_eos=True), on_chunk=seen.append)
    assert bounded(lambda: list(h)) == []
    sched.run_until_idle()
    assert seen[-1].finish_reason == "length" and seen[-1].usage["completion_tokens"] == 3


def test_iterating_a_handle_inside_the_schedulers_step_is_refused(eng):
    """An on_chunk callback (on the stepping thread, inside a step) that iterates a handle still waiting would wait
    on its own thread: one clear error instead."""
    sched = Scheduler(eng, max_batch=1)
    errors: list[BaseException] = []
    waiting = None

    def on_chunk(_chunk):
        try:
            next(iter(waiting))
        except FastarError as err:
            errors.append(err)

    sched.submit(prompt(5, 5), SamplingParams(max_tokens=2, ignore_eos=True), on_chunk=on_chunk)
    waiting = sched.submit(prompt(6, 5), SamplingParams(max_tokens=2, ignore_eos=True))  # queued behind it
    bounded(lambda: [sched.step() for _ in range(2)])  # the callback used to wait on its own thread
    assert errors and "inside the scheduler's own step" in str(errors[0])
    sched.run_until_idle()
    assert [c.finish_reason for c in waiting][-1] == "length"
