"""The step scheduler: batched decoding is bit-identical to serving each request alone; admission, the bounded
queue, cancellation and counters; chunked prefill interleaved with decoding."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch
from batch_helpers import needs_invariant_kernels, prompt, same_chunks, solo
from polling import wait_until

from fastar.encoding import THINK_START
from fastar.engine.engine import load
from fastar.engine.pacing import MAX_STALL
from fastar.engine.sampling import SamplingParams
from fastar.engine.scheduler import QueueFull, Scheduler
from fastar.model.deepseek_v4 import Block

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def eng(tiny_ckpt):
    return load(tiny_ckpt)  # official numerics


@pytest.fixture
def chunk16(eng):
    """The engine prefills 16 tokens a chunk for the test (a few steps for a 200-token prompt), as before after it."""
    before = eng.prefill_chunk
    eng.prefill_chunk = 16
    yield
    eng.prefill_chunk = before


def record_layers_and_steps(monkeypatch, model, sleep: float, span: bool = False) -> list:
    """Patch the model's blocks (`Block.span` for a paged model's spans, else `Block.__call__`) to sleep `sleep` s
    before each layer, and its `forward_rows`; returns the list they log into: ("layer", tokens, start, end) and
    ("decode", rows, start, end)."""
    events = []
    name = "span" if span else "__call__"
    block, forward_rows = getattr(Block, name), model.forward_rows

    def layer(self, X, *args, **kw):
        t = time.perf_counter()
        time.sleep(sleep)
        out = block(self, X, *args, **kw)
        events.append(("layer", sum(x.shape[0] for x in X) if span else X.shape[0], t, time.perf_counter()))
        return out

    def rows(ids, *args, **kw):
        t = time.perf_counter()
        out = forward_rows(ids, *args, **kw)
        events.append(("decode", len(ids), t, time.perf_counter()))
        return out

    monkeypatch.setattr(Block, name, layer)
    monkeypatch.setattr(model, "forward_rows", rows)
    return events


# (prompt length, sampling): prompts across the indexer's scoring start (17 positions) and the ratio-128
# compressor's first entry (128), greedy and seeded sampling, logprobs, a stop token, EOS honoured
REQUESTS = [
    (5, dict(max_tokens=40, ignore_eos=True)),
    (23, dict(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True, logprobs=3)),
    (120, dict(max_tokens=24, ignore_eos=True)),
    (9, dict(max_tokens=35, temperature=1.0, top_k=50, seed=9, ignore_eos=True)),
    (64, dict(max_tokens=12, ignore_eos=True, logprobs=0)),
    (31, dict(max_tokens=40, temperature=0.7, top_p=0.9, seed=1)),
    (2, dict(max_tokens=20, ignore_eos=True)),
    (77, dict(max_tokens=28, temperature=0.9, min_p=0.05, seed=4, ignore_eos=True)),
    (15, dict(max_tokens=33, ignore_eos=True)),
    (40, dict(max_tokens=18, temperature=0.6, seed=12, ignore_eos=True)),
]


def requests(n: int = len(REQUESTS)) -> list[tuple[list[int], SamplingParams]]:
    return [(prompt(100 + i, length), SamplingParams(**kw)) for i, (length, kw) in enumerate(REQUESTS[:n])]


def test_forward_rows_is_bit_identical_to_one_token_forward(eng):
    """Five sequences at different positions: a batched decode step gives every row the logits and the state
    (all buffers, byte for byte) that decoding it alone gives, step after step across compression boundaries."""
    needs_invariant_kernels()
    model = eng.model
    states, tokens = [], []
    for i, n in enumerate((3, 16, 61, 126, 7)):
        s = model.new_state()
        logits, _ = model.forward(prompt(i, n), s, all_logits=False)
        states.append(s)
        tokens.append(int(logits[-1].argmax()))
    alone = [s.snapshot() for s in states]
    for _ in range(12):
        batched = model.forward_rows(tokens, states)
        for b, (tok, s) in enumerate(zip(tokens, alone)):
            ref, _ = model.forward([tok], s, all_logits=False)
            assert torch.equal(batched[b], ref[-1]), b
        assert [s.to_bytes() for s in states] == [s.to_bytes() for s in alone]
        tokens = [int(row.argmax()) for row in batched]


def test_a_lone_decode_token_takes_forward_rows_with_forwards_bits(eng, monkeypatch):
    """Engine.prefill of one token (Session.decode, generate_tokens) runs the scheduler's one-row step where it gives
    `forward`'s bits, and `forward` where it would not: the logits and the state the same either way."""
    needs_invariant_kernels()
    model = eng.model
    a, b = prompt(7, 40), prompt(7, 40)
    sa, sb = model.new_state(), model.new_state()
    model.forward(a, sa, all_logits=False)
    model.forward(b, sb, all_logits=False)
    calls = []
    rows = model.forward_rows
    monkeypatch.setattr(model, "forward_rows", lambda *args: calls.append(1) or rows(*args))
    tok = 5
    for _ in range(6):
        got = eng.prefill([tok], sa)
        want, _ = model.forward([tok], sb, all_logits=False)
        assert torch.equal(got, want) and sa.to_bytes() == sb.to_bytes()
        tok = int(got[-1].argmax())
    assert len(calls) == 6
    monkeypatch.setattr(model, "rows_match_forward", lambda: False)  # e.g. the scalar ISA: forward itself
    eng.prefill([tok], sa)
    assert len(calls) == 6


def test_forward_rows_refuses_bad_batches(eng):
    s = eng.model.new_state()
    eng.model.forward([1, 2], s)
    with pytest.raises(ValueError, match="distinct state"):
        eng.model.forward_rows([1, 2], [s, s])
    with pytest.raises(ValueError, match="one per state"):
        eng.model.forward_rows([1] * 9, [eng.model.new_state() for _ in range(9)])


@pytest.mark.parametrize("max_batch", [8, 3])
def test_batched_generation_equals_each_request_alone(eng, max_batch):
    """Ten requests (greedy and seeded sampling, logprobs, EOS, different lengths) at once: with max_batch 8 the
    decode steps run 8 rows then the rest; with 3, requests wait and join as others finish. Each request's
    chunks (tokens, text, logprobs, finish, usage) equal `Engine.stream` on a fresh session."""
    needs_invariant_kernels()
    reqs = requests()
    sched = Scheduler(eng, max_batch=max_batch, max_queue=16)
    handles = [sched.submit(ids, params) for ids, params in reqs]
    sched.run_until_idle()
    for (ids, params), h in zip(reqs, handles):
        same_chunks(list(h), solo(eng, ids, params))
    hist = sched.metrics()["batch_size_histogram"]
    assert max(hist) == min(8, max_batch) and sum(hist.values()) > 0


def test_choices_of_one_prompt_are_prefilled_once_and_each_equals_its_solo_run(eng):
    """`submit_choices` (n > 1, best_of): the prompt runs once, then every choice decodes from a fork of its state
    as a row of the batch (beside an unrelated request) and gets exactly the chunks it gets alone: greedy choices
    are all the same, seeded ones each follow their own seed."""
    needs_invariant_kernels()
    ids, other = prompt(7, 70), prompt(8, 12)
    greedy = [SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2)] * 3
    seeded = [SamplingParams(max_tokens=20, temperature=0.9, seed=5 + i, ignore_eos=True) for i in range(4)]
    sched = Scheduler(eng, max_batch=8, max_queue=16)
    before = eng.counters.prefill_tokens_computed
    lone = sched.submit(other, SamplingParams(max_tokens=25, ignore_eos=True))
    g = sched.submit_choices(ids, greedy)
    r = sched.submit_choices(ids[:50], seeded)
    sched.run_until_idle()
    assert eng.counters.prefill_tokens_computed - before == len(ids) + 50 + len(other)  # each prompt once
    same_chunks(list(lone), solo(eng, other, SamplingParams(max_tokens=25, ignore_eos=True)))
    ref = solo(eng, ids, greedy[0])
    for h in g:
        same_chunks(list(h), ref)
    outs = [list(h) for h in r]
    for params, chunks in zip(seeded, outs):
        same_chunks(chunks, solo(eng, ids[:50], params))
    assert len({tuple(c.token for c in chunks) for chunks in outs}) > 1  # the seeds do differ
    assert max(sched.metrics()["batch_size_histogram"]) == 8  # 1 + 3 + 4 rows in one decode call


def test_choices_cancelled_before_the_fork_and_a_group_wider_than_the_batch(eng):
    """A choice cancelled while its prompt prefills ends without a token and the others go on; the prompt itself
    stops only once every choice is cancelled. A group of more choices than max_batch is admitted."""
    params = [SamplingParams(max_tokens=6, ignore_eos=True)] * 3
    sched = Scheduler(eng, max_batch=2, max_queue=4)
    hs = sched.submit_choices(prompt(9, 40), params)
    hs[1].cancel()
    sched.run_until_idle()
    outs = [list(h) for h in hs]
    assert [len(o) for o in outs] == [6, 1, 6] and outs[1][-1].finish_reason == "cancelled"
    assert [c.token for c in outs[0]] == [c.token for c in outs[2]]
    gone = sched.submit_choices(prompt(10, 40), params[:2])
    for h in gone:
        h.cancel()
    before = eng.counters.prefill_tokens_computed
    sched.run_until_idle()
    assert eng.counters.prefill_tokens_computed == before
    assert all(list(h)[-1].finish_reason == "cancelled" for h in gone)
    with pytest.raises(ValueError, match="same max_tokens"):
        sched.submit_choices([1, 2], [SamplingParams(max_tokens=1), SamplingParams(max_tokens=2)])


def test_a_group_wider_than_the_batch_holds_its_extra_choices_back(eng):
    """Six choices with max_batch 2, beside a request queued after them: two rows decode at a time, the other
    choices wait and are forked from one kept copy of the prefilled state as rows free (before the later request),
    so at most 3 forked states exist at once (2 rows + the copy), not 5; each choice, a cancelled held one aside,
    gets exactly its solo chunks; the prompt is prefilled once."""
    needs_invariant_kernels()
    ids, other = prompt(11, 60), prompt(12, 9)
    params = [SamplingParams(max_tokens=10, temperature=0.8, seed=20 + i, ignore_eos=True) for i in range(6)]
    sched = Scheduler(eng, max_batch=2, max_queue=8)
    before = eng.counters.prefill_tokens_computed
    hs = sched.submit_choices(ids, params)
    late = sched.submit(other, SamplingParams(max_tokens=5, ignore_eos=True))
    hs[4].cancel()
    sched.run_until_idle()
    assert eng.counters.prefill_tokens_computed - before == len(ids) + len(other)
    outs = [list(h) for h in hs]
    for i, (p, chunks) in enumerate(zip(params, outs)):
        if i == 4:
            assert [c.finish_reason for c in chunks] == ["cancelled"]
        else:
            same_chunks(chunks, solo(eng, ids, p))
    same_chunks(list(late), solo(eng, other, SamplingParams(max_tokens=5, ignore_eos=True)))
    m = sched.metrics()
    assert m["forked_states_peak"] == 3 and m["forked_states"] == 0
    assert max(m["batch_size_histogram"]) == 2


def test_stop_strings_and_stop_tokens_batched(eng):
    """Stop strings (held back, never leaked) and stop tokens cut each request where its solo run cuts it."""
    needs_invariant_kernels()
    base = requests(4)
    texts = [solo(eng, ids, p) for ids, p in base]
    reqs = []
    for (ids, p), chunks in zip(base, texts):
        text = "".join(c.text for c in chunks)
        kw = {
            f: getattr(p, f)
            for f in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "ignore_eos", "logprobs")
        }
        reqs.append((ids, SamplingParams(**kw, stop=[text[len(text) // 2 : len(text) // 2 + 3]])))
        reqs.append((ids, SamplingParams(**kw, stop_token_ids=[chunks[len(chunks) // 3].token])))
    out = eng.serve_batch(reqs)
    for (ids, p), chunks in zip(reqs, out):
        ref = solo(eng, ids, p)
        same_chunks(chunks, ref)
        assert chunks[-1].finish_reason == "stop"


def test_min_tokens_batched(eng):
    """`min_tokens`: the stop token ids may not be drawn and a stop string does not end the reply before that many
    tokens, batched as alone: each request's chunks are its solo run's, and run past where the stop cut them."""
    needs_invariant_kernels()
    base = requests(4)
    reqs, cuts = [], []
    for ids, p in base:
        chunks = solo(eng, ids, p)
        text = "".join(c.text for c in chunks)
        kw = {
            f: getattr(p, f)
            for f in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "ignore_eos", "logprobs")
        }
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        reqs.append((ids, SamplingParams(**kw, stop=[stop], min_tokens=len(chunks) - 2)))
        cuts.append(stop)
        stop_id = chunks[len(chunks) // 3].token
        reqs.append((ids, SamplingParams(**kw, stop_token_ids=[stop_id], min_tokens=len(chunks) // 3 + 4)))
        cuts.append(stop_id)
    out = eng.serve_batch(reqs)
    for (ids, p), chunks, cut in zip(reqs, out, cuts):
        same_chunks(chunks, solo(eng, ids, p))
        assert len(chunks) > p.min_tokens
        if isinstance(cut, str):  # kept in the text: it came within the first min_tokens tokens
            assert cut in "".join(c.text for c in chunks[: p.min_tokens])
        else:
            assert cut not in [c.token for c in chunks[: p.min_tokens]]


def test_chunked_prefill_interleaves_with_decoding(eng, chunk16):
    """A 200-token prompt prefilled 16 tokens a step while another request decodes: the decoding one gets a
    token every step meanwhile, and both still equal their solo runs at that chunk size. (A chunk every step:
    `prefill_share` 1; the pacing of the chunks, and of their layers, is the tests' below.)"""
    needs_invariant_kernels()
    short, long_ = (
        (prompt(1, 6), SamplingParams(max_tokens=40, ignore_eos=True)),
        (prompt(2, 200), SamplingParams(max_tokens=8, ignore_eos=True)),
    )
    sched = Scheduler(eng, prefill_share=1.0)
    got = {"short": 0}
    log = []
    a = sched.submit(*short, on_chunk=lambda c: log.append(("short", c)))
    sched.step()  # the short prompt: one chunk, first token
    b = sched.submit(*long_, on_chunk=lambda c: log.append(("long", c)))
    for _ in range(13):  # 200 tokens = 13 chunks of 16
        n = len(log)
        sched.step()
        got["short"] += sum(1 for who, _ in log[n:] if who == "short")
    assert got["short"] == 13  # one token per step while the long prompt prefilled
    assert not any(who == "long" for who, _ in log[:-1])  # its first token comes with its last chunk
    sched.run_until_idle()
    assert a.done.is_set() and b.done.is_set()
    same_chunks([c for who, c in log if who == "short"], solo(eng, *short))
    same_chunks([c for who, c in log if who == "long"], solo(eng, *long_))


def test_a_short_prompt_goes_before_a_long_prompts_remaining_chunks(eng, chunk16):
    """A 6-token prompt submitted while a 200-token one prefills 16 tokens a step is prefilled next (the prompt with
    the fewest tokens left goes first): its first token comes one step later, long before the long prompt's, which
    then goes on; both still equal their solo runs. (A chunk every step: `prefill_share` 1; the pacing of the chunks
    is the next test's.)"""
    needs_invariant_kernels()
    long_, short = (
        (prompt(3, 200), SamplingParams(max_tokens=6, ignore_eos=True)),
        (prompt(4, 6), SamplingParams(max_tokens=30, ignore_eos=True)),
    )
    sched = Scheduler(eng, prefill_share=1.0)
    log = []
    a = sched.submit(*long_, on_chunk=lambda c: log.append(("long", c)))
    for _ in range(3):
        sched.step()  # 48 of the long prompt's 200 tokens
    b = sched.submit(*short, on_chunk=lambda c: log.append(("short", c)))
    sched.step()  # the short prompt's only chunk, and its first token
    assert [who for who, _ in log] == ["short"]
    steps = 0
    while not any(who == "long" for who, _ in log):
        sched.step()
        steps += 1
    assert steps == 10  # the long prompt's 152 tokens left: 10 more chunks of 16, one a step
    assert sum(who == "short" for who, _ in log) == 11  # the short one decoded a token each of those steps
    sched.run_until_idle()
    assert a.done.is_set() and b.done.is_set()
    same_chunks([c for who, c in log if who == "short"], solo(eng, *short))
    same_chunks([c for who, c in log if who == "long"], solo(eng, *long_))


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_a_long_prompts_chunks_keep_to_their_share_while_another_decodes(eng, chunk16, monkeypatch, share):
    """A 200-token prompt submitted while another request decodes, each layer of a prefill made to take 30 ms more
    (longer than a decode step even on a machine busy with other work, so a step's credit never covers a layer):
    at prefill_share 0.5 its chunks give way between their layers, and after each layer (but a chunk's last) the
    decoding request gets as long in decode steps before the next layer (less a step's credit); at 1 a chunk every
    step, unbroken, one token between chunks. A short prompt submitted meanwhile is prefilled at once, its one chunk
    unbroken. Every request equals its solo run. (The reader decodes until the long prompt is done, then is
    cancelled: with a fixed number of tokens it could run out before, on a machine busy with other work.)"""
    needs_invariant_kernels()
    reader = (prompt(5, 6), SamplingParams(max_tokens=eng.context_length - 8, ignore_eos=True))
    long_ = (prompt(6, 200), SamplingParams(max_tokens=3, ignore_eos=True))
    late = (prompt(7, 5), SamplingParams(max_tokens=3, ignore_eos=True))
    events = record_layers_and_steps(monkeypatch, eng.model, 0.03)
    layers = len(eng.model.layers)
    sched = Scheduler(eng, prefill_share=share)
    log = []
    a = sched.submit(*reader, on_chunk=lambda c: log.append(("reader", c)))
    sched.step()  # its only chunk and first token
    b = sched.submit(*long_, on_chunk=lambda c: log.append(("long", c)))
    while sum(e[:2] == ("layer", 16) for e in events) < 4 * layers:  # four of the long prompt's chunks
        sched.step()
    c = sched.submit(*late, on_chunk=lambda c: log.append(("late", c)))
    n = len(events)
    sched.step()
    late_layers = [i for i, e in enumerate(events) if e[:2] == ("layer", 5)]
    assert late_layers and late_layers[0] >= n  # the late prompt's chunk, in the step after it came
    assert late_layers == list(range(late_layers[0], late_layers[0] + layers))  # unbroken
    while not any(who == "long" for who, _ in log):
        sched.step()
    long_layers = [i for i, e in enumerate(events) if e[0] == "layer" and e[1] in (16, 8)]
    assert len(long_layers) == (200 // 16 + 1) * layers  # the long prompt's chunks of 16 (its last one has 8)
    step = max(e[3] - e[2] for e in events if e[0] == "decode")  # the longest decode step
    for k, (i, j) in enumerate(itertools.pairwise(long_layers)):
        between = [e for e in events[i + 1 : j] if e[0] == "decode"]
        if any(e[0] == "layer" for e in events[i + 1 : j]):  # the late prompt's chunk came between
            continue
        last_layer = (k + 1) % layers == 0  # layer i ends a chunk
        if share == 1.0:
            assert len(between) == (1 if last_layer else 0)  # a chunk every step, unbroken
        elif not last_layer:  # decoding at least as long, less the credit of a step that ran past the last debt
            assert events[j][2] - events[i][3] >= events[i][3] - events[i][2] - 2 * step
            assert between
    a.cancel()
    sched.run_until_idle()
    assert a.done.is_set() and b.done.is_set() and c.done.is_set()
    monkeypatch.undo()
    for who, req in (("long", long_), ("late", late)):
        same_chunks([c for w, c in log if w == who], solo(eng, *req))
    read = [c.token for w, c in log if w == "reader" and c.token is not None]
    assert read == [c.token for c in solo(eng, reader[0], SamplingParams(max_tokens=len(read), ignore_eos=True))]


def test_a_short_prompt_that_comes_during_a_long_chunk_starts_between_its_layers(eng, chunk16, monkeypatch):
    """A 6-token prompt submitted while the first chunk of a 200-token one runs its second layer (nothing else
    decoding) is prefilled before that chunk's third layer, its first token then, not a chunk later; it then decodes
    between the long prompt's layers, and both equal their solo runs."""
    needs_invariant_kernels()
    long_ = (prompt(10, 200), SamplingParams(max_tokens=3, ignore_eos=True))
    short = (prompt(11, 6), SamplingParams(max_tokens=40, ignore_eos=True))
    events = []  # ("layer", tokens) / ("token", who)
    block_call = Block.__call__
    log = []

    def layer(self, X, *args, **kw):
        time.sleep(0.01)  # a layer far longer than a decode step (whose credit then never covers one)
        out = block_call(self, X, *args, **kw)
        events.append(("layer", X.shape[0]))
        if events.count(("layer", 16)) == 2 and not log:
            log.append(("submitted", sched.submit(*short, on_chunk=on_chunk("short"))))
        return out

    def on_chunk(who):
        def add(c):
            events.append(("token", who))
            log.append((who, c))

        return add

    monkeypatch.setattr(Block, "__call__", layer)
    sched = Scheduler(eng, prefill_share=0.5)
    a = sched.submit(*long_, on_chunk=on_chunk("long"))
    sched.run_until_idle()
    layers = len(eng.model.layers)
    second = [i for i, e in enumerate(events) if e == ("layer", 16)][1]
    assert events[second + 1 : second + 1 + layers] == [("layer", 6)] * layers  # the short prompt's chunk, unbroken
    assert events[second + 1 + layers] == ("token", "short")  # and its first token, before the long chunk's third
    assert events[second + 2 + layers] == ("layer", 16)
    last_short = len(events) - 1 - events[::-1].index(("token", "short"))
    long_layers = [i for i, e in enumerate(events[:last_short]) if e[0] == "layer" and e[1] in (16, 8) and i >= second]
    assert len(long_layers) > layers  # the short one decoded while the long prompt's chunks went on
    for i, j in itertools.pairwise(long_layers):
        assert ("token", "short") in events[i:j]  # between every two of their layers
    assert a.done.is_set() and log[0][1].done.is_set()
    monkeypatch.undo()
    same_chunks([c for w, c in log if w == "short"], solo(eng, *short))
    same_chunks([c for w, c in log if w == "long"], solo(eng, *long_))


@pytest.mark.parametrize("share", [0.2, 1.0])
def test_a_short_prompts_chunk_gives_the_reader_a_step_once_it_waited_the_stall(eng, chunk16, monkeypatch, share):
    """A 14-token prompt (one chunk) submitted while another request decodes, each layer made to take 20 ms and
    `max_stall` 15 ms: its chunk starts in the next step (the pacer does not hold a short prompt back) and after each
    of its layers but the last the reader gets one decode step, not more (not the pacer's share); at share 1 none
    (a chunk every step, unbroken). Both equal their solo runs."""
    needs_invariant_kernels()
    reader = (prompt(30, 6), SamplingParams(max_tokens=200, ignore_eos=True))
    short = (prompt(31, 14), SamplingParams(max_tokens=3, ignore_eos=True))
    events = record_layers_and_steps(monkeypatch, eng.model, 0.02)
    sched = Scheduler(eng, prefill_share=share, max_stall=0.015)
    log = []
    a = sched.submit(*reader, on_chunk=lambda c: log.append(("reader", c)))
    sched.step()
    b = sched.submit(*short, on_chunk=lambda c: log.append(("short", c)))
    n = len(events)
    sched.step()
    layers = len(eng.model.layers)
    got = [e[0] if e[0] == "decode" else e[1] for e in events[n:] if e[0] == "decode" or e[1] == 14]
    if share == 1.0:
        assert got == ["decode"] + [14] * layers
    else:
        assert got == ["decode"] + [14, "decode"] * (layers - 1) + [14]  # the step's, then one after each layer
    sched.run_until_idle()
    assert a.done.is_set() and b.done.is_set()
    monkeypatch.undo()
    for who, req in (("reader", reader), ("short", short)):
        same_chunks([c for w, c in log if w == who], solo(eng, *req))


def test_a_shorter_prompt_starts_between_a_short_prompts_layers_and_a_third_waits_a_layer(eng, chunk16, monkeypatch):
    """Nothing else running: a 14-token prompt prefills; during its second layer a 5-token and a 15-token prompt come.
    The 5-token one is prefilled before the 14-token one's third layer, its first token then; the 15-token one
    (longer) waits for the 14-token one to end. During the 5-token one's first layer a 4-token one comes: it is not
    started between the 5-token one's layers (no third level) but before the 14-token one's next layer. All equal
    their solo runs."""
    needs_invariant_kernels()
    reqs = {n: (prompt(40 + n, n), SamplingParams(max_tokens=3, ignore_eos=True)) for n in (14, 5, 15, 4)}
    events = []
    block_call = Block.__call__
    handles = {}

    def submit(n):
        def on_chunk(c):
            if all(w != n for w, _ in log):
                events.append(("first", n))
            log.append((n, c))

        handles[n] = sched.submit(*reqs[n], on_chunk=on_chunk)

    def layer(self, X, *args, **kw):
        out = block_call(self, X, *args, **kw)
        events.append(("layer", X.shape[0]))
        if events.count(("layer", 14)) == 2 and 5 not in handles:
            submit(5)
            submit(15)
        if events.count(("layer", 5)) == 1 and 4 not in handles:
            submit(4)
        return out

    log = []
    monkeypatch.setattr(Block, "__call__", layer)
    sched = Scheduler(eng)
    submit(14)
    sched.run_until_idle()
    layers = len(eng.model.layers)
    order = [e if e[0] == "first" else e[1] for e in events if e[0] == "first" or e[1] >= 4]  # (decode rows: < 4)
    first = [("first", n) for n in (5, 4, 14, 15)]
    want = [14] * 2 + [5] * layers + first[:1] + [14] + [4] * layers + first[1:2] + [14] * (layers - 3) + first[2:3]
    assert order == want + [15] * layers + first[3:]
    assert all(handles[n].done.is_set() for n in reqs)
    monkeypatch.undo()
    for n, req in reqs.items():
        same_chunks([c for w, c in log if w == n], solo(eng, *req))


def test_a_long_prompt_cancelled_mid_chunk_stops_after_the_layer_it_ran(eng, chunk16, monkeypatch):
    """A 200-token prompt cancelled during the second layer of its second chunk (another request decoding) stops
    there: no layer of it runs after, its request ends cancelled at once, the other goes on equal to its solo run,
    and its half-advanced state is kept for no one (not among the states kept for reuse; the same prompt again
    equals its solo run)."""
    needs_invariant_kernels()
    reader = (prompt(12, 6), SamplingParams(max_tokens=60, ignore_eos=True))
    long_ = (prompt(13, 200), SamplingParams(max_tokens=3, ignore_eos=True))
    events = []
    block_call = Block.__call__
    handles = {}

    def layer(self, X, *args, **kw):
        out = block_call(self, X, *args, **kw)
        events.append(("layer", X.shape[0]))
        if events.count(("layer", 16)) == len(eng.model.layers) + 2:
            handles["long"].cancel()
        return out

    monkeypatch.setattr(Block, "__call__", layer)
    sched = Scheduler(eng, prefill_share=0.5, keep_states=4)
    log = []
    handles["reader"] = sched.submit(*reader, on_chunk=lambda c: log.append(("reader", c)))
    sched.step()
    handles["long"] = sched.submit(*long_, on_chunk=lambda c: log.append(("long", c)))
    while not handles["long"].done.is_set():
        sched.step()
    assert events.count(("layer", 16)) == len(eng.model.layers) + 2  # not one layer more
    assert [c.finish_reason for w, c in log if w == "long"] == ["cancelled"]
    sched.run_until_idle()
    assert events.count(("layer", 16)) == len(eng.model.layers) + 2
    monkeypatch.undo()
    same_chunks([c for w, c in log if w == "reader"], solo(eng, *reader))
    assert [k.tokens[:6] for k in sched.memory._kept] == [reader[0]]  # the reader's state only
    again = list(sched.submit(*long_))
    same_chunks(again, solo(eng, *long_))


def test_a_paged_prefill_gives_way_between_its_layers_bit_for_bit(tiny_fst_path, monkeypatch):
    """Over paged experts (the bank larger than the budget: each chunk a span whose layers read their experts behind
    one another) a long prompt's chunks still give way between their layers while another request decodes, and both
    requests equal their solo runs on the mapped model. (The reader decodes until the long prompt is done, then is
    cancelled: a reader that could run out first, as a machine busy with other work could make it, would leave the
    long prompt's last chunks to a span of several.)"""
    needs_invariant_kernels()
    stride = load(tiny_fst_path, ram_budget=None).source.expert_stride
    paged = load(tiny_fst_path, ram_budget=3 * stride, prefill_chunk=16)
    assert paged.paged_chunk == 16
    reader = (prompt(8, 6), SamplingParams(max_tokens=paged.context_length - 8, ignore_eos=True))
    long_ = (prompt(9, 90), SamplingParams(max_tokens=4, ignore_eos=True))
    # a layer longer than a decode step, whose credit then never covers one
    events = record_layers_and_steps(monkeypatch, paged.model, 0.005, span=True)
    sched = Scheduler(paged, prefill_share=0.2)
    log = []
    a = sched.submit(*reader, on_chunk=lambda c: log.append(("reader", c)))
    sched.step()
    b = sched.submit(*long_, on_chunk=lambda c: log.append(("long", c)))
    while not b.done.is_set():
        sched.step()
    a.cancel()
    sched.run_until_idle()
    assert a.done.is_set()
    layers = len(paged.model.layers)
    marks = "".join(e[0][0] for e in events if e[0] == "decode" or e[1] > 6)  # decode steps, the long prompt's layers
    assert marks.count("l") == (90 // 16 + 1) * layers
    while_read = marks[: marks.rindex("d")].replace("d", " ").split()  # runs of layers while the reader decoded
    assert sum(map(len, while_read)) >= 3 * layers and max(map(len, while_read)) == 1  # every layer gave way
    monkeypatch.undo()
    mapped = load(tiny_fst_path, ram_budget=None, prefill_chunk=16)
    same_chunks([c for w, c in log if w == "long"], solo(mapped, *long_))
    read = [c.token for w, c in log if w == "reader" and c.token is not None]
    alone = solo(mapped, reader[0], SamplingParams(max_tokens=len(read), ignore_eos=True))
    assert read == [c.token for c in alone]


@pytest.mark.parametrize(
    "share, error",
    [(0, ValueError), (1.5, ValueError), (float("nan"), TypeError), ("0.5", TypeError), (True, TypeError)],
)
def test_a_bad_prefill_share_is_refused(eng, share, error):
    with pytest.raises(error, match="prefill_share"):
        Scheduler(eng, prefill_share=share)


@pytest.mark.parametrize(
    "stall, error",
    [(0, ValueError), (-1, ValueError), (float("nan"), TypeError), (float("inf"), TypeError), ("1", TypeError)],
)
def test_a_bad_max_stall_is_refused(eng, stall, error):
    with pytest.raises(error, match="max_stall must be a positive number of seconds"):
        Scheduler(eng, max_stall=stall)


def test_max_stall_is_the_constructors_option(eng):
    """The stall limit was the constant `pacing.MAX_STALL`, settable only as an attribute after construction."""
    assert Scheduler(eng).max_stall == MAX_STALL == 1.0
    assert Scheduler(eng, max_stall=0.25).max_stall == 0.25
    assert eng.scheduler(max_stall=2).max_stall == 2.0


def test_queue_is_bounded(eng):
    sched = Scheduler(eng, max_batch=1, max_queue=1)
    p = SamplingParams(max_tokens=3)
    sched.submit(prompt(0, 4), p)  # admitted at the next step
    sched.submit(prompt(1, 4), p)  # waits
    with pytest.raises(QueueFull, match="busy") as e:
        sched.submit(prompt(2, 4), p)
    assert e.value.retry_after >= 1
    assert sched.metrics()["requests_rejected"] == 1 and sched.metrics()["queued_requests"] == 2
    sched.run_until_idle()
    assert sched.idle and sched.metrics()["requests_finished"] == 2


def test_cancel_frees_the_slot_within_one_step(eng):
    """max_batch 1: cancelling the active request ends it at the next step, whose admission lets the waiting
    one in; a waiting request cancelled before admission ends without running."""
    sched = Scheduler(eng, max_batch=1)
    a = sched.submit(prompt(0, 5), max_tokens=100, ignore_eos=True)
    b = sched.submit(prompt(1, 5), max_tokens=4, ignore_eos=True)
    c = sched.submit(prompt(2, 5), max_tokens=4, ignore_eos=True)
    for _ in range(3):
        sched.step()
    c.cancel()
    a.cancel()
    sched.step()
    chunks = list(a)
    assert chunks[-1].finish_reason == "cancelled" and 1 <= len(chunks) - 1 <= 3
    assert chunks[-1].usage["completion_tokens"] == len(chunks) - 1
    assert [(x.finish_reason, x.usage["completion_tokens"]) for x in c] == [("cancelled", 0)]
    assert list(c) == []  # an exhausted handle yields nothing more
    m = sched.metrics()
    assert m["active_sequences"] == 1 and m["queued_requests"] == 0 and m["requests_cancelled"] == 2
    sched.run_until_idle()
    assert [x.finish_reason for x in b][-1] == "length"


def test_token_budget_admits_what_fits(eng):
    """Two requests whose prompt + max_tokens exceed the budget together run one after the other (each alone
    is always admitted); the metrics show batches of one only."""
    sched = Scheduler(eng, token_budget=30)
    p = SamplingParams(max_tokens=10, ignore_eos=True)
    h = [sched.submit(prompt(i, 12), p) for i in range(2)]
    sched.step()
    assert sched.metrics()["active_sequences"] == 1 and sched.metrics()["queued_requests"] == 1
    sched.run_until_idle()
    assert all(list(x)[-1].finish_reason == "length" for x in h)
    m = sched.metrics()
    assert set(m["batch_size_histogram"]) == {1} and m["requests_finished"] == 2
    assert m["step_seconds_mean"] > 0 and m["tokens_per_s_per_sequence_finished_mean"] > 0


def test_bad_requests_fail_at_submit(eng):
    sched = Scheduler(eng)
    with pytest.raises(ValueError, match="empty"):
        sched.submit([], max_tokens=3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sched.submit([5, 5000], max_tokens=3)
    with pytest.raises(ValueError, match="temperature"):
        sched.submit([5], temperature=-1)
    assert sched.idle
    h = sched.submit([5, 6], max_tokens=0)
    sched.run_until_idle()
    assert [(c.finish_reason, c.usage["completion_tokens"]) for c in h] == [("length", 0)]


def test_worker_thread_and_callers_on_other_threads(eng):
    """The worker loop (`run`) on one thread, requests from four others at once: each gets its solo chunks."""
    import threading

    needs_invariant_kernels()
    sched = Scheduler(eng)
    stop = threading.Event()
    worker = threading.Thread(target=sched.run, args=(stop, 0.01))
    worker.start()
    reqs = requests(4)
    out = [None] * 4

    def client(i):
        out[i] = list(sched.submit(*reqs[i]))

    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    try:
        for t in clients:
            t.start()
        for t in clients:
            t.join(60)
    finally:
        stop.set()
        worker.join(60)
    for (ids, p), chunks in zip(reqs, out):
        same_chunks(chunks, solo(eng, ids, p))


def test_bench_streams_cli(tiny_ckpt, tmp_path):
    """`fastar bench --streams` on a paged .fst with a small expert budget (misses): every N reports its rows,
    every stream equal to its solo run, one decode call per step carrying all N rows, measured (tokens/s and
    the ceiling) over the steps where all N decode."""
    import json
    import subprocess
    import sys

    from fastar.convert.hf import convert
    from fastar.format.reader import FstFile

    needs_invariant_kernels()
    fst = convert(tiny_ckpt, tmp_path / "t.fst", progress=False)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastar",
            "bench",
            "-m",
            str(fst),
            "--streams",
            "1,3",
            "--json",
            "--decode-tokens",
            "6",
            "--prompt-tokens",
            "8",
            "--ram-budget",
            "400K",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [row["streams"] for row in out["rows"]] == [1, 3]
    for row in out["rows"]:
        assert row["identical_to_solo"] is True and len(row["per_stream_tok_s"]) == row["streams"]
        assert row["aggregate_decode_tok_s"] > 0 and row["itl_p95_ms"] >= row["itl_p50_ms"] > 0
        # measured while all N decode: every call of the window carries N rows, the ceiling over those calls
        assert row["window_all_streams"] is True and row["window_calls"] >= 1
        assert row["window_rows_per_call"] == row["streams"]
        # the roofline: per call the larger of the byte time and the arithmetic time, so never above the byte
        # ceiling, and above it never more than the arithmetic floor allows
        assert row["roofline_tok_s"] <= row["batched_ceiling_tok_s"] * (1 + 1e-9)
        assert row["roofline_tok_s"] <= row["arithmetic_floor_tok_s"] * row["streams"] * (1 + 1e-9)
        assert row["fraction_of_roofline"] >= row["fraction_of_ceiling"]
    assert out["decode_macs_fp32_path"] > 0 and out["decode_macs_quant_path"] > 0
    assert out["rows"][1]["expert_reads_per_call"] >= out["rows"][0]["expert_reads_per_call"]
    # every call's experts counted, by whichever router the layer takes (the C one where it applies): at least k
    # distinct a layer
    with FstFile(fst) as f:
        least = f.config.num_hidden_layers * f.config.num_experts_per_tok
    assert all(row["window_experts_per_call"] >= least for row in out["rows"])
    # the misses read over the window, at the faster of the probe and the rate they were served at
    assert all(row["ceiling_disk_gbps"] >= max(out["disk_gbps"], row["disk_served_gbps"]) for row in out["rows"])
    # the tiny head stays in the caches, so the hits' bandwidth is the start-of-run probe's, never 0 (unknown)
    assert out["membw_gbps"] > 0 and all(row["membw_gbps"] == out["membw_gbps"] for row in out["rows"])


def test_a_failing_worker_ends_every_request_with_its_error(eng, monkeypatch):
    """If a step raises (a bug, a read error), the worker loop does not leave callers waiting forever: every queued
    and active request's iterator raises the error, and `run` re-raises it on the worker thread."""
    import threading

    from fastar.errors import FastarError

    sched = Scheduler(eng)
    handles = [sched.submit(p, kw) for p, kw in requests(3)]

    def boom():
        raise RuntimeError("disk read failed")

    monkeypatch.setattr(sched, "_admit", boom)
    caught = []

    def worker():
        try:
            sched.run(threading.Event(), 0.01)
        except RuntimeError as err:
            caught.append(err)

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive() and caught
    for h in handles:
        with pytest.raises(FastarError, match="disk read failed"):
            list(h)


def test_on_chunk_callers_hear_of_a_failing_step(eng, monkeypatch):
    """Callers in on_chunk mode (the server) get the error through on_error, once each, and nothing after it."""
    import threading

    sched = Scheduler(eng)
    seen: dict[int, list] = {i: [] for i in range(3)}
    for i, (p, kw) in enumerate(requests(3)):
        sched.submit(p, kw, on_chunk=seen[i].append, on_error=seen[i].append)
    sched.step()  # admitted and running
    monkeypatch.setattr(sched, "_decode", lambda group: (_ for _ in ()).throw(RuntimeError("disk read failed")))
    with pytest.raises(RuntimeError):
        sched.run(threading.Event(), 0.01)
    for got in seen.values():
        assert isinstance(got[-1], RuntimeError) and sum(isinstance(x, BaseException) for x in got) == 1
    assert sched.idle


def test_prefill_progress_is_reported_per_layer_and_per_chunk_in_metrics(eng, chunk16):
    """A prompt reports its progress after each layer of each chunk (the keep-alive comments of a long prefill show
    it), one within one chunk too (at full depth its chunk takes seconds); the metrics give the chunks done."""
    sched = Scheduler(eng)
    progress = []
    sched.submit(prompt(7, 40), SamplingParams(max_tokens=2), on_progress=lambda d, t: progress.append((d, t)))
    sched.step()
    assert sched.metrics()["prefill_progress"] == [(16, 40)]
    sched.run_until_idle()
    n = len(eng.model.layers)
    want = [0] + [base + size * i // n for base, size in ((0, 16), (16, 16), (32, 8)) for i in range(1, n + 1)]
    assert progress == [(d, 40) for d in want]
    assert sched.metrics()["prefill_progress"] == []
    short = []
    sched.submit(prompt(8, 12), SamplingParams(max_tokens=2), on_progress=lambda d, t: short.append((d, t)))
    sched.run_until_idle()
    assert short == [(0, 12)] + [(12 * i // n, 12) for i in range(1, n + 1)]


def test_kept_states_let_a_continued_conversation_prefill_only_its_tail(eng):
    """keep_states: a finished request's state (prompt + reply) serves the next turn from RAM; its tokens equal
    `Engine.stream` continuing one session (the same reuse, the same chunks)."""
    first, p = prompt(20, 30), SamplingParams(max_tokens=10, ignore_eos=True)
    sched = Scheduler(eng, keep_states=2)
    h = sched.submit(first, p)
    sched.run_until_idle()
    reply = [c.token for c in h]
    second = first + reply + prompt(21, 7)
    before = eng.stats()["prefill_tokens_computed"]
    h = sched.submit(second, p)
    sched.run_until_idle()
    got = list(h)
    assert got[-1].usage["cached_tokens"] == len(first) + len(reply) - 1  # the last reply token never ran
    assert eng.stats()["prefill_tokens_computed"] - before == 8
    assert sched.metrics()["prefix_memory_hits"] == 1
    s = eng.open_session()
    assert [c.token for c in eng.stream(first, p, session=s)] == reply
    ref = list(eng.stream(second, p, session=s))
    assert [c.token for c in got] == [c.token for c in ref] and got[-1].usage == ref[-1].usage


def test_run_calls_after_step_with_whether_the_scheduler_is_idle(eng):
    """`run(after_step=)`: called after every step with False while requests remain, True once none is left, and
    on each idle wake-up (the server's heap trimmer decides there; `fastar.serve.heap`)."""
    sched = Scheduler(eng)
    seen: list[bool] = []
    stop = threading.Event()
    worker = threading.Thread(target=sched.run, args=(stop, 0.01, seen.append), daemon=True)
    worker.start()
    try:
        assert wait_until(lambda: len(seen) >= 3, 30)  # idle wake-ups only
        assert all(seen)
        n = len(seen)
        handles = [sched.submit(prompt(40 + i, 6), max_tokens=3, ignore_eos=True) for i in range(2)]
        for h in handles:
            assert list(h)[-1].finish_reason == "length"
        assert wait_until(lambda: seen[-1] is True, 30), "the worker never reported itself idle after the work"
        during = seen[n:]
        assert False in during, "no step reported work left"
    finally:
        stop.set()
        worker.join(60)


def test_a_thinking_turn_hands_its_state_to_the_next_turn(eng):
    """A prompt ending in `<think>` comes back in the next turn with `</think>` there (the reasoning dropped): the
    kept state is handed over, rolled back to the tokens before it, however short the conversation (a copy would
    need `min_shared` tokens in common)."""
    think, think_end = 7, 8  # the tiny model's vocabulary lacks the tokenizer's ids: two of its own stand in
    first, p = prompt(30, 12) + [think], SamplingParams(max_tokens=6, ignore_eos=True)
    sched = Scheduler(eng, keep_states=2)
    assert sched._think_start == eng.tokenizer.token_to_id(THINK_START) is not None
    sched._think_start = think
    h = sched.submit(first, p)
    sched.run_until_idle()
    reply = [c.token for c in h]
    second = first[:-1] + [think_end] + reply + prompt(31, 5) + [think]
    h = sched.submit(second, p)
    sched.run_until_idle()
    got = list(h)
    assert got[-1].usage["cached_tokens"] == len(first) - 1
    assert sched.metrics()["prefix_memory_hits"] == 1 and len(sched.memory) == 1  # handed over, not copied
    s = eng.open_session()
    ref = list(eng.stream(second, p, session=s))
    assert [c.token for c in got] == [c.token for c in ref]
