"""The step scheduler with a drafter: a lone greedy sequence is decoded with draft/verify passes and gets exactly
the tokens (and logprobs, stops, usage) of plain decoding; a second request switches the steps back to batched
ones and both outputs equal their solo runs; a seeded sampled request is never drafted, an unseeded one alone
drafts with speculative sampling and keeps the target's distribution. And prefix states read from disk
off the worker thread: the other sequences keep stepping while a load is in progress.

Tiny fixtures in official numerics. The random fixtures' own drafts are almost never right, so the drafters here
replay the plain transcript (each token kept right with probability 0.7) while the real drafter still runs: its
context goes through every accept, reject and rollback.
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch
from batch_helpers import needs_invariant_kernels, prompt, same_chunks, solo

from fastar.engine import speculative as sp
from fastar.engine.engine import load
from fastar.engine.prefix_cache import PrefixCache
from fastar.engine.sampling import SamplingParams
from fastar.engine.scheduler import Scheduler
from fastar.model.deepseek_v4 import Block

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ReplayMixin:
    """Drafts the plain transcripts' next tokens (keyed by the state's tokens so far), each right with probability
    0.7; the real drafter's propose still runs first."""

    transcripts: list[list[int]]  # prompt + plain continuation, one per request

    def propose(self, state, anchor, k, pick):
        prop = super().propose(state, anchor, k, pick)
        m = state.length
        g = torch.Generator().manual_seed(1000 + m)
        # the transcript this state follows: the one whose token at m is the anchor (prompts differ early on)
        seq = next((t for t in self.transcripts if len(t) > m and t[m] == anchor), [])
        toks = []
        for j, t in enumerate(prop.tokens):
            right = seq[m + 1 + j] if m + 1 + j < len(seq) else t
            toks.append(right if float(torch.rand(1, generator=g)) < 0.7 else (right + 1) % 1024)
        return sp.Proposal(toks, prop.probs, prop.confidence)


class ReplayMTP(ReplayMixin, sp.MTPDrafter):
    pass


class ReplayDSpark(ReplayMixin, sp.DSparkDrafter):
    pass


@pytest.fixture(scope="module")
def plain(tiny_ckpt):
    return load(tiny_ckpt)  # official numerics, no drafter: the reference


def drafting(path, kind: str, fixed: int):
    eng = load(path, draft=kind)
    d = ReplayMTP(eng.model) if kind == "mtp" else ReplayDSpark(eng.model, eng.source)
    d.transcripts = []
    eng.use_draft(d, sp.Schedule(fixed=fixed), kind)
    return eng


@pytest.fixture(scope="module", params=[("mtp", 1), ("dspark", 4)], ids=["mtp", "dspark"])
def drafted(request):
    kind, fixed = request.param
    return drafting(request.getfixturevalue("tiny_ckpt" if kind == "mtp" else "dspark_ckpt"), kind, fixed)


def transcript(ids, chunks):
    return ids + [c.token for c in chunks if c.token is not None]


def run_alone(eng, ids, params, **options):
    sched = Scheduler(eng, **options)
    h = sched.submit(ids, params)
    sched.run_until_idle()
    return list(h), sched


def test_lone_greedy_request_drafts_and_equals_plain(plain, drafted):
    """One greedy request at a time (logprobs; then a stop string that falls inside verified passes; then an odd
    max_tokens): the same chunks as plain `stream`, with drafts really verified, accepted and rejected."""
    needs_invariant_kernels()
    eng = drafted
    ids = prompt(1, 23)
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2)
    expect = solo(plain, ids, params)
    eng.drafter.transcripts = [transcript(ids, expect)]
    before = eng.draft_stats.accepted, eng.draft_stats.passes
    got, sched = run_alone(eng, ids, params, keep_states=2)
    same_chunks(got, expect)
    st = eng.draft_stats
    assert sched.metrics()["draft_steps"] > 0
    assert st.accepted - before[0] > 5 and st.passes - before[1] > 5
    assert 0 < st.accept_counts[0] < st.passes  # rejections (and rollbacks) happened too
    assert eng.stats()["draft_tokens_accepted"] == st.accepted

    # stops: a stop string somewhere in the middle of the text, and a max_tokens that ends inside a pass
    text = "".join(c.text for c in expect)
    for kw in (dict(stop=[text[len(text) // 2 : len(text) // 2 + 3]]), dict(max_tokens=17)):
        p = SamplingParams(**{**dict(max_tokens=40, ignore_eos=True, logprobs=2), **kw})
        ref = solo(plain, ids, p)
        got, sched = run_alone(eng, ids, p, keep_states=2)
        same_chunks(got, ref)
        # the state kept for reuse holds exactly what plain batched decoding (draft=False) leaves: no position
        # of a draft verified past the stop
        ref_sched = run_alone(eng, ids, p, keep_states=2, draft=False)[1]
        (kept,), (ref_kept,) = sched.memory._kept, ref_sched.memory._kept
        assert kept.tokens == ref_kept.tokens and kept.state.length == ref_kept.state.length == len(kept.tokens)


def test_seeded_sampled_request_is_not_drafted(plain, drafted):
    """A sampled request with a seed stays on plain steps: the tokens of plain decoding with that seed."""
    needs_invariant_kernels()
    ids, params = prompt(2, 9), SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)
    got, sched = run_alone(drafted, ids, params)
    same_chunks(got, solo(plain, ids, params))
    assert sched.metrics()["draft_steps"] == 0 and sched.metrics()["sampled_draft_steps"] == 0


def test_logit_biased_request_is_not_drafted(plain, drafted):
    """A greedy request with a `logit_bias` stays on plain steps (drafts are verified against the unbiased logits):
    the tokens of plain decoding with that bias, here one that bans the plain greedy run's first token."""
    needs_invariant_kernels()
    ids = prompt(3, 11)
    first = solo(plain, ids, SamplingParams(max_tokens=1))[0].token
    params = SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={first: -100.0})
    expect = solo(plain, ids, params)
    drafted.drafter.transcripts = [transcript(ids, expect)]
    got, sched = run_alone(drafted, ids, params)
    same_chunks(got, expect)
    assert expect[0].token != first and sched.metrics()["draft_steps"] == 0


def test_a_min_tokens_request_is_not_drafted(plain, drafted):
    """A greedy request with `min_tokens` decodes plainly (drafts are not checked against its ban), here with a
    drafter that proposes the banned token: the tokens of plain decoding with the ban."""
    needs_invariant_kernels()
    ids = prompt(4, 13)
    free = solo(plain, ids, SamplingParams(max_tokens=24, ignore_eos=True))
    banned = free[2].token
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[banned], min_tokens=10)
    expect = solo(plain, ids, params)
    assert banned not in [c.token for c in expect[:10]]
    drafted.drafter.transcripts = [transcript(ids, free)]  # the drafts hold the banned token
    got, sched = run_alone(drafted, ids, params)
    same_chunks(got, expect)
    assert sched.metrics()["draft_steps"] == 0


class UniformDraft(sp.MTPDrafter):
    """The MTP drafter's context upkeep, but each draft drawn (from its own generator) uniformly from `support`:
    a draft distribution q that overlaps the target's, so drafts are accepted and rejected alike."""

    support: list[int]

    def propose(self, state, anchor, k, pick):
        prop = super().propose(state, anchor, k, pick)
        V = self.model.config.vocab_size
        q = torch.zeros(V)
        q[self.support] = 1 / len(self.support)
        toks = [self.support[int(torch.randint(len(self.support), (1,), generator=self.gen))] for _ in prop.tokens]
        return sp.Proposal(toks, q.expand(len(toks), V).clone(), prop.confidence)


def _chi2_p(observed: dict, expected: dict, n: int) -> float:
    """Pearson's chi-square p-value of the counts `observed` against the probabilities `expected` (cells expected
    fewer than 5 times pooled into one)."""
    small = [c for c in expected if expected[c] * n < 5]
    cells = [([c], expected[c]) for c in expected if c not in small]
    if small:
        cells.append((small, sum(expected[c] for c in small)))
    stat = sum((sum(observed.get(c, 0) for c in cs) - n * e) ** 2 / (n * e) for cs, e in cells if e > 0)
    stray = sum(v for c, v in observed.items() if c not in expected)  # an outcome the target never gives
    if stray:
        return 0.0
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_lone_unseeded_sampled_request_drafts_with_the_target_distribution(plain, tiny_ckpt, monkeypatch):
    """A lone sampled request without a seed decodes with draft/verify passes (speculative sampling), and its
    tokens keep the target's distribution: the first three tokens' joint frequencies over many requests against
    the exact probabilities from plain forwards (temperature 1, top-k 2: 8 outcomes; the second token is an
    accepted draft or a draw from the residual, the third the bonus or the next step's draw). The same counts are
    far from what accepting every draft would give (the test can tell)."""
    from types import SimpleNamespace

    from fastar.engine import sampling

    eng = load(tiny_ckpt, draft="mtp")
    drafter = UniformDraft(eng.model)
    drafter.gen = torch.Generator().manual_seed(7)
    eng.use_draft(drafter, sp.Schedule(fixed=1), "mtp")
    ids = prompt(3, 6)
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=2, ignore_eos=True)

    def dist(seq: list[int]) -> dict[int, float]:  # the target's processed next-token distribution after seq
        logits = plain.prefill(seq, plain.new_state())[-1]
        probs = torch.softmax(sampling.processed_logits(logits, params), -1)
        return {int(t): float(probs[t]) for t in probs.nonzero().reshape(-1)}

    exact = {}
    for t1, p1 in dist(ids).items():
        for t2, p2 in dist(ids + [t1]).items():
            for t3, p3 in dist(ids + [t1, t2]).items():
                exact[(t1, t2, t3)] = p1 * p2 * p3
    seconds = {t2 for _, t2, _ in exact}
    drafter.support = sorted(seconds) + [max(seconds) + 1]  # and one token the target never draws: rejected
    seeds = iter(range(1, 10**6))  # unseeded requests draw their seed from os.urandom: made reproducible here
    monkeypatch.setattr(sampling, "os", SimpleNamespace(urandom=lambda n: next(seeds).to_bytes(n, "little")))
    sched, n, counts = Scheduler(eng), 240, {}
    before = eng.draft_stats.accepted, eng.draft_stats.drafted
    for _ in range(n):
        h = sched.submit(ids, params)
        sched.run_until_idle()
        key = tuple(c.token for c in h if c.token is not None)
        counts[key] = counts.get(key, 0) + 1
    m = sched.metrics()
    accepted, drafted = eng.draft_stats.accepted - before[0], eng.draft_stats.drafted - before[1]
    assert m["sampled_draft_steps"] >= n and m["draft_steps"] == m["sampled_draft_steps"]
    assert 0 < accepted < drafted  # drafts accepted and rejected
    assert _chi2_p(counts, exact, n) > 1e-3
    # accepting every draft would make the second token uniform over the support (given the first)
    first = {t1: sum(v for k, v in exact.items() if k[0] == t1) for t1 in {k[0] for k in exact}}
    naive = {(t1, t2): first[t1] / len(drafter.support) for t1 in first for t2 in drafter.support}
    pairs = {}
    for k, v in counts.items():
        pairs[k[:2]] = pairs.get(k[:2], 0) + v
    assert _chi2_p(pairs, naive, n) < 1e-6


def test_second_request_switches_to_batched_steps(plain, drafted):
    """A drafts alone; B arrives mid-stream: the steps become batched (two rows a call) until B finishes, then A
    drafts again. Both get their solo runs' chunks."""
    needs_invariant_kernels()
    eng = drafted
    a_ids, b_ids = prompt(3, 17), prompt(4, 30)
    a_params = SamplingParams(max_tokens=48, ignore_eos=True)
    b_params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
    a_ref, b_ref = solo(plain, a_ids, a_params), solo(plain, b_ids, b_params)
    eng.drafter.transcripts = [transcript(a_ids, a_ref), transcript(b_ids, b_ref)]
    sched = Scheduler(eng, keep_states=2)
    a_out, b_out = [], []
    sched.submit(a_ids, a_params, on_chunk=a_out.append)
    while len(a_out) < 10:
        assert sched.step()
    drafted_alone = sched.metrics()["draft_steps"]
    assert drafted_alone > 0 and sched.metrics()["steps"] < len(a_out)  # it drafted: fewer steps than tokens
    sched.submit(b_ids, b_params, on_chunk=b_out.append)
    while not b_out or b_out[-1].finish_reason is None:
        assert sched.step()
    m = sched.metrics()
    assert m["draft_steps"] == drafted_alone  # no drafting while two were active
    b_tokens = sum(c.token is not None for c in b_ref)
    assert m["batch_size_histogram"].get(2, 0) >= b_tokens - 1  # B's tokens after its first came in pairs
    a_when_b_ended = len(a_out)
    sched.run_until_idle()
    same_chunks(a_out, a_ref)
    same_chunks(b_out, b_ref)
    if a_when_b_ended < len(a_ref) - 2:
        assert sched.metrics()["draft_steps"] > drafted_alone  # alone again: drafting resumed


# --- prefix states loaded off the worker thread -------------------------------------------------------------


class GatedCache(PrefixCache):
    """A prefix cache whose lookups of prompts starting with `gated` wait (on the loader thread) for `release`."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.gated: list[int] = []
        self.entered, self.release = threading.Event(), threading.Event()
        self.threads: list[str] = []

    def lookup(self, ids, limit, better_than=0):
        self.threads.append(threading.current_thread().name)
        if ids[: len(self.gated)] == self.gated:
            self.entered.set()
            assert self.release.wait(60), "the test never released the load"
        return super().lookup(ids, limit, better_than)


def test_other_streams_keep_stepping_while_a_state_loads(plain, tmp_path):
    """B's prompt extends a prefix on disk; its load is held on the loader thread while A decodes five more
    tokens (B meanwhile neither prefills nor decodes); released, B adopts the state, prefills only its tail and
    gets the tokens a scheduler that loads without any wait gives it."""
    needs_invariant_kernels()
    eng = plain
    shared, a_ids = prompt(5, 40), prompt(6, 12)
    b_ids = shared + prompt(7, 6)
    b_params, a_params = SamplingParams(max_tokens=10, ignore_eos=True), SamplingParams(max_tokens=30, ignore_eos=True)
    folder = tmp_path / "cache"
    warm = eng.scheduler(prefix_cache=folder)
    warm.submit(shared, SamplingParams(max_tokens=1))
    warm.run_until_idle()  # the state at the end of `shared` is on disk now
    shutil.copytree(folder, tmp_path / "copy")  # the reference run stores B's own prompt: in a copy
    b_ref, _ = run_alone(eng, b_ids, b_params, prefix_cache=eng.open_prefix_cache(tmp_path / "copy", background=True))
    assert b_ref[-1].usage["cached_tokens"] == len(shared)

    fingerprint = eng.open_prefix_cache(folder).fingerprint
    cache = GatedCache(folder, fingerprint, 1 << 30, background=True)
    cache.gated = shared
    sched = Scheduler(eng, prefix_cache=cache)
    a_out, b_out = [], []
    sched.submit(a_ids, a_params, on_chunk=a_out.append)
    while not a_out:
        sched.step()
    sched.submit(b_ids, b_params, on_chunk=b_out.append)
    sched.step()  # admits B: its lookup starts on the loader thread
    assert cache.entered.wait(60)
    n = len(a_out)
    for _ in range(5):
        assert sched.step()
    assert len(a_out) == n + 5 and not b_out
    m = sched.metrics()
    assert m["prefix_disk_loading"] == 1 and m["prefill_progress"] == []
    cache.release.set()
    sched.run_until_idle()
    same_chunks(b_out, b_ref)
    assert b_out[-1].usage["cached_tokens"] == len(shared)
    assert a_out[-1].finish_reason == "length" and len(a_out) == 30
    assert cache.threads and all(t.startswith("fastar-prefix-load") for t in cache.threads)


def test_run_waits_for_a_load_without_spinning(plain, tmp_path):
    """`run` on its own thread with one request whose load is held: the worker sleeps on the scheduler's
    condition (a step or two, not a busy loop) until the load lands, then serves the request."""
    eng = plain
    ids = prompt(8, 20)
    folder = tmp_path / "c"
    warm = eng.scheduler(prefix_cache=folder)  # a prefix of `ids` on disk: its load is what gets held
    warm.submit(ids[:12], SamplingParams(max_tokens=1))
    warm.run_until_idle()
    cache = GatedCache(folder, eng.open_prefix_cache(folder).fingerprint, 1 << 30, background=True)
    cache.gated = ids[:1]
    sched = Scheduler(eng, prefix_cache=cache)
    calls, step = [], sched.step
    sched.step = lambda: calls.append(1) or step()
    out, done = [], threading.Event()
    stop = threading.Event()
    worker = threading.Thread(target=sched.run, args=(stop,), kwargs={"idle_wait": 60}, daemon=True)
    worker.start()
    sched.submit(ids, SamplingParams(max_tokens=3, ignore_eos=True), on_chunk=lambda c: out.append(c) or (
        c.finish_reason and done.set()))  # fmt: skip
    assert cache.entered.wait(60)
    assert not done.wait(0.3)  # held: it cannot finish (and a spinning worker would step thousands of times)
    assert sched.metrics()["steps"] == 0 and not out and len(calls) <= 3
    cache.release.set()
    assert done.wait(60)
    stop.set()
    with sched._lock:
        sched._lock.notify_all()
    worker.join(60)
    assert [c.token for c in out] == [c.token for c in solo(eng, ids, SamplingParams(max_tokens=3, ignore_eos=True))]


def test_a_disk_miss_starts_without_the_loader(plain, tmp_path):
    """Nothing on disk can serve the prompt (known from the file names): the request prefills at once, without a
    trip through the loader thread, and the miss is counted."""
    ids = prompt(10, 20)
    cache = GatedCache(tmp_path / "c", "fp", 1 << 30, background=True)
    cache.gated = []  # any lookup would wait on the loader thread until the test released it (it never does)
    sched = Scheduler(plain, prefix_cache=cache)
    out = []
    sched.submit(ids, SamplingParams(max_tokens=3, ignore_eos=True), on_chunk=out.append)
    sched.run_until_idle()
    assert not cache.threads and cache.stats()["misses"] == 1
    assert [c.token for c in out] == [c.token for c in solo(plain, ids, SamplingParams(max_tokens=3, ignore_eos=True))]


def test_server_drafts_a_lone_greedy_request(plain, tiny_ckpt):
    """Over HTTP (`fastar serve --draft mtp`'s engine): a lone greedy completion has the plain text, and /metrics
    shows the draft steps and the accepted draft tokens."""
    openai = pytest.importorskip("openai")
    import http.client
    import re

    from fastar.serve.server import Server

    needs_invariant_kernels()
    ids = prompt(9, 15)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = solo(plain, ids, params)
    eng = drafting(tiny_ckpt, "mtp", 1)
    eng.drafter.transcripts = [transcript(ids, ref)]
    srv = Server(lambda: eng, port=0, max_sessions=0).start()
    assert srv.wait_ready(60)
    try:
        cl = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)
        r = cl.completions.create(
            model="deepseek-v4-flash", prompt=ids, max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text == "".join(c.text for c in ref) and r.usage.completion_tokens == 30
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        values = {k: float(v) for k, v in re.findall(r"^fastar:(\w+) (\S+)$", text, re.M)}
        assert values["draft_steps_total"] > 0 and values["engine_draft_tokens_accepted"] > 5
        assert values["engine_draft_tokens_verified"] >= values["engine_draft_tokens_accepted"]
    finally:
        srv.shutdown()


def test_a_long_prompt_prefilled_through_the_drafter_gives_way_between_its_layers(plain, drafted, monkeypatch):
    """A greedy request drafting alone, then a 120-token prompt (chunks of 16) that may draft too, so its chunks go
    through the drafter's target pass: they give way between their layers to the first request's decode steps
    (plain batched steps meanwhile), and both equal their plain solo runs; alone again, the first drafts again."""
    needs_invariant_kernels()
    eng = drafted
    reader = (prompt(20, 7), SamplingParams(max_tokens=300, ignore_eos=True))
    long_ = (prompt(21, 120), SamplingParams(max_tokens=4, ignore_eos=True))
    expect = {"reader": solo(plain, *reader), "long": solo(plain, *long_)}
    eng.drafter.transcripts = [transcript(reader[0], expect["reader"]), transcript(long_[0], expect["long"])]
    before, eng.prefill_chunk = eng.prefill_chunk, 16
    try:
        sched = Scheduler(eng, prefill_share=0.5)
        log = []
        inside = []  # per decode step: whether a chunk's target pass was in progress
        passes = []
        forward_rows, target = eng.model.forward_rows, eng.drafter.forward

        def counted(ids, *args, **kw):
            inside.append(bool(passes))
            return forward_rows(ids, *args, **kw)

        def chunk(ids, *args, **kw):
            passes.append(len(ids))
            try:
                return target(ids, *args, **kw)
            finally:
                passes.pop()

        block_call = Block.__call__

        def slow(self, *args, **kw):  # a layer longer than a decode step, whose credit then never covers one
            time.sleep(0.005)
            return block_call(self, *args, **kw)

        monkeypatch.setattr(Block, "__call__", slow)
        a = sched.submit(*reader, on_chunk=lambda c: log.append(("reader", c)))
        for _ in range(3):
            sched.step()
        b = sched.submit(*long_, on_chunk=lambda c: log.append(("long", c)))
        eng.model.forward_rows, eng.drafter.forward = counted, chunk
        try:
            while not b.done.is_set():
                sched.step()
        finally:
            del eng.model.forward_rows, eng.drafter.forward
        drafts = sched.metrics()["draft_steps"]
        monkeypatch.undo()
        sched.run_until_idle()
    finally:
        eng.prefill_chunk = before
    assert a.done.is_set()
    assert sum(inside) >= (120 // 16) * (len(eng.model.layers) - 1)  # between every two layers of each chunk
    assert sched.metrics()["draft_steps"] > drafts  # alone again, it drafts
    for who in ("reader", "long"):
        same_chunks([c for w, c in log if w == who], expect[who])
