"""The prefill pacer's decode steps between the layers of a sliced chunk (`pacing.SlicedChunk`); the pacing of
whole chunks, and the scheduler that uses both, are tests/test_scheduler.py's."""

from __future__ import annotations

import time

from fastar.engine.pacing import PrefillPacer, SlicedChunk


def test_after_a_layer_the_decode_steps_owed_run_before_the_next():
    pacer = PrefillPacer(0.5)
    steps = []

    def decode():
        steps.append(1)
        return 0.002

    chunk = SlicedChunk(pacer, decode)
    t = time.perf_counter()
    time.sleep(0.01)  # the first layer
    layer = time.perf_counter() - t
    chunk(1, 3)
    assert layer <= len(steps) * 0.002 < layer + 0.02  # decode steps for as long as the layer took, no more
    assert pacer.owed == 0.0 and chunk.gave >= 0.0
    n = len(steps)
    chunk(3, 3)  # the last layer: the chunk's head comes next, no step
    assert len(steps) == n
    chunk.end()
    assert pacer.owed > 0.0  # the last layer's time is owed after the chunk


def test_no_decode_steps_at_share_one_and_none_once_nothing_decodes():
    steps = []
    at_one = SlicedChunk(PrefillPacer(1.0), lambda: steps.append(1) or 0.001)
    time.sleep(0.002)
    at_one(1, 2)
    assert steps == []  # nothing is ever owed: the chunk runs unbroken
    pacer = PrefillPacer(0.25)
    gone = SlicedChunk(pacer, lambda: None)  # the decoding sequences finished
    time.sleep(0.002)
    gone(1, 2)  # returns: nothing to wait for
    assert pacer.owed > 0.0
    assert pacer.may_prefill(False, False) and pacer.owed == 0.0  # the next step, with nothing decoding, forgets it
