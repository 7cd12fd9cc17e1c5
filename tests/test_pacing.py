"""The prefill pacer's work between the layers of a sliced chunk (`pacing.SlicedChunk`); the pacing of whole
chunks, and the scheduler that uses both, are tests/test_scheduler.py's."""

from __future__ import annotations

import time

import pytest

from fastar.engine.pacing import ChunkCancelled, PrefillPacer, SlicedChunk


def sliced(pacer, **kw):
    """A `SlicedChunk` whose callables do nothing (decoding: yes, cancelled: no) unless given."""
    calls = dict(decode=lambda: None, start_short=lambda: None, decoding=lambda: True, cancelled=lambda: False)
    return SlicedChunk(pacer, **{**calls, **kw})


def test_after_a_layer_short_prompts_start_and_the_decode_steps_owed_run_before_the_next():
    pacer = PrefillPacer(0.5)
    calls = []

    def decode():
        calls.append("decode")
        return 0.002

    chunk = sliced(pacer, decode=decode, start_short=lambda: calls.append("short"))
    t = time.perf_counter()
    time.sleep(0.01)  # the first layer
    layer = time.perf_counter() - t
    chunk(1, 3)
    assert calls[0] == "short"  # the prompts that came, before the steps owed
    steps = calls.count("decode")
    assert layer <= steps * 0.002 < layer + 0.02  # decode steps for as long as the layer took, no more
    assert -0.002 <= pacer.owed <= 0.0 and chunk.gave > 0.0  # a step past the debt: credit for the next layer
    n = len(calls)
    chunk(3, 3)  # the last layer: the chunk's head comes next, then the step (which admits and decodes)
    assert len(calls) == n
    time.sleep(0.005)  # the last layer
    chunk.end()
    assert pacer.owed > 0.0  # the last layer's time is owed after the chunk


def test_nothing_owed_at_share_one_nor_while_nothing_decodes():
    steps = []
    at_one = sliced(PrefillPacer(1.0), decode=lambda: steps.append(1) or 0.001)
    time.sleep(0.002)
    at_one(1, 2)
    assert steps == []  # nothing is ever owed: the chunk runs unbroken
    pacer = PrefillPacer(0.25)
    alone = sliced(pacer, decode=lambda: steps.append(1) or 0.001, decoding=lambda: False)
    time.sleep(0.002)
    alone(1, 2)
    alone.end()
    assert steps == [] and pacer.owed == 0.0  # nobody decodes: nothing owed, no step asked for
    gone = sliced(pacer, decode=lambda: None)  # they finished in their last step
    time.sleep(0.002)
    gone(1, 2)  # returns: nothing to wait for
    assert pacer.owed > 0.0
    assert pacer.may_prefill(False, False) and pacer.owed == 0.0  # the next step, with nothing decoding, forgets it


def test_a_cancelled_prompts_chunk_stops_after_the_layer_it_ran():
    cancel = []
    steps = []
    chunk = sliced(PrefillPacer(0.5), decode=lambda: steps.append(1) or 0.001, cancelled=lambda: bool(cancel))
    time.sleep(0.002)
    chunk(1, 4)
    assert steps
    cancel.append(True)
    n = len(steps)
    with pytest.raises(ChunkCancelled):
        chunk(2, 4)
    assert len(steps) == n  # no step: the chunk stops at once


def test_a_step_past_the_debt_is_credit_for_the_next_layer_but_decoding_alone_banks_no_more():
    pacer = PrefillPacer(0.5)
    pacer.prefilled(1.0, True)  # a layer of 1 s: 1 s of decoding owed
    pacer.decoded(0.7)
    pacer.decoded(0.7)  # 0.4 s past it
    assert pacer.owed == pytest.approx(-0.4)
    pacer.prefilled(1.0, True)
    assert pacer.owed == pytest.approx(0.6)  # the next layer's debt, less the credit
    for _ in range(50):
        pacer.decoded(0.7)  # decoding alone, nothing to prefill
    assert pacer.owed == pytest.approx(-0.7)  # one step's credit, not 35 s of it


def test_a_short_prompts_chunk_gives_one_step_only_once_the_others_have_waited_the_stall():
    """A short prompt's chunk (`stall` given) is not held to the pacer's share: after a layer it runs one decode step
    where the decoding sequences have waited `stall` seconds since their last, none before, whatever is owed."""
    pacer = PrefillPacer(0.1)  # much owed after every layer
    steps = []
    waited = [0.2]
    chunk = sliced(pacer, decode=lambda: steps.append(1) or 0.001, stall=0.5, stalled=lambda: waited[0])
    time.sleep(0.005)
    chunk(1, 4)
    assert steps == [] and pacer.owed > 0.0  # owed, but they waited 0.2 s only: no step
    waited[0] = 0.5
    chunk(2, 4)
    assert steps == [1]  # one step, not the many owed
    chunk(3, 4)
    assert steps == [1, 1]  # (they wait 0.5 s still: `stalled` is the scheduler's clock since their last step)
    gone = sliced(pacer, decode=lambda: None, stall=0.5, stalled=lambda: 9.0)  # they finished in their last step
    gone(1, 2)  # asks for a step, gets none, goes on
