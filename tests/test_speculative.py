"""Speculative decoding (`fastar.engine.speculative`): the acceptance rule on synthetic distributions, the
output distribution of the whole loop against the target's (chi-square), greedy identity with MTP, DSpark and a
high-acceptance replay draft over 200-token generations, state after rejections equal to a fresh run, the stream
contract (stops mid-pass, max tokens, context limit), draft-aware expert prefetch, the schedule, and `--draft`.

Numerics: a verify pass of at most `VERIFY_MAX` (8) tokens computes each token bit-identically to one-token decode
(model docstring, batch invariance), so greedy identity holds in both numerics: the identity tests run `reference`
numerics, and `official` (the default: FP8/FP4 activation rounding, where any difference would grow) with the
replay drafts; the loop never verifies more than VERIFY_MAX tokens at once.

Statistical tests use fixed seeds, so they are deterministic; each states the false-alarm rate it would have
with fresh seeds.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from fastar.contracts import Unpaged
from fastar.engine import speculative as sp
from fastar.engine.engine import load
from fastar.engine.sampling import SamplingParams, processed_logits
from fastar.engine.session import Session
from fastar.model.state import LayerState, ModelState

TOKENS = 200


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompt(seed: int, n: int = 24) -> list[int]:
    return torch.randint(2, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def chi2_critical(df: int, alpha: float = 1e-3) -> float:
    """Upper alpha-quantile of chi-square(df), Wilson-Hilferty (within ~1% for df >= 10)."""
    z = {1e-3: 3.0902, 1e-4: 3.7190}[alpha]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson statistic over the cells with positive probability; asserts no sample fell outside them."""
    assert all(probs.get(k, 0.0) > 0 for k in counts), "a sample has zero target probability"
    stat = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in probs.items() if p > 0)
    return stat, sum(p > 0 for p in probs.values()) - 1


# --- the acceptance rule on synthetic distributions ----------------------------------------------------------


def random_dist(V: int, g: torch.Generator, zeros: int = 0) -> torch.Tensor:
    p = torch.rand(V, generator=g) ** 3
    if zeros:
        p[torch.randperm(V, generator=g)[:zeros]] = 0
    return p / p.sum()


def test_acceptance_rule_is_exact():
    """Closed form of one verified draft: P(out = v) = q(v) min(1, p(v)/q(v)) + P(reject) r(v), with
    r = max(p - q, 0) normalised; it equals p for any p, q (including disjoint and truncated supports)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        V = 2 + trial % 9
        p, q = random_dist(V, g, trial % 2), random_dist(V, g, (trial // 2) % 2)
        keep = q * torch.where(q > 0, torch.clamp(p / q.clamp_min(1e-30), max=1), torch.zeros(()))
        residual = (p - q).clamp(min=0)
        out = keep + (1 - keep.sum()) * (residual / residual.sum() if residual.sum() > 0 else p)
        assert torch.allclose(out, p, atol=1e-6)
        assert sp.expected_acceptance(p, q, 0) == pytest.approx(float(keep.sum()), abs=1e-6)


def test_accept_sampled_matches_the_target_distribution():
    """Monte Carlo of `accept_sampled` with 3 drafts from q: the emitted first token is distributed as p[0]
    and, given all three accepted, the bonus as p[3]. False-alarm rate with fresh seeds: 1e-3 per chi-square."""
    g = torch.Generator().manual_seed(1)
    V, L, N = 6, 3, 20000
    p = torch.stack([random_dist(V, g, 1) for _ in range(L + 1)])
    q = torch.stack([random_dist(V, g) for _ in range(L)])
    first, accepted = {}, 0
    for _ in range(N):
        drafts = [int(torch.multinomial(q[k], 1, generator=g)) for k in range(L)]
        n, nxt = sp.accept_sampled(p, q, drafts, g)
        tok = drafts[0] if n > 0 else nxt
        first[tok] = first.get(tok, 0) + 1
        accepted += n
    stat, df = chi2(first, {v: float(p[0, v]) for v in range(V)}, N)
    assert stat < chi2_critical(df)
    # the mean number accepted is sum_k prod_{i<=k} E[accept_i]; draft k's acceptance is independent of the
    # earlier ones here (p rows do not depend on earlier tokens), so E[n] = a1 + a1 a2 + a1 a2 a3
    a = [float(torch.minimum(p[k], q[k]).sum()) for k in range(L)]
    mean = a[0] + a[0] * a[1] + a[0] * a[1] * a[2]
    assert abs(accepted / N - mean) < 4 * math.sqrt(L * L / N)  # generous: n is bounded by L


def test_accept_greedy():
    logits = torch.tensor([[0, 5, 1.0], [3, 0, 1], [0, 0, 9]])
    assert sp.accept_greedy(logits, [1, 0]) == (2, 2)
    assert sp.accept_greedy(logits, [1, 2]) == (1, 0)
    assert sp.accept_greedy(logits, [0, 0]) == (0, 1)
    assert sp.accept_greedy(logits[:1], []) == (0, 1)


# --- the whole loop on a fake model with a tiny vocabulary: output distribution = target's ---------------------


class FakeTarget:
    """A 'model' whose next-token logits depend on the current token only: table A[V, V]. The state records
    positions (truncation and snapshots work as for the real model)."""

    def __init__(self, A: torch.Tensor) -> None:
        self.A, self.experts, self.layers = A, Unpaged(), []
        self.config = types.SimpleNamespace(vocab_size=A.shape[0])

    def new_state(self) -> ModelState:
        return ModelState([LayerState.new(0, 1 << 20, 1, 1)], max_rollback=None)

    def forward(self, ids, state, all_logits=True):
        s = state.layers[0]
        s.kv.append(torch.zeros(len(ids), 1))
        s.length += len(ids)
        logits = self.A[torch.tensor(ids)]
        return (logits if all_logits else logits[-1:]), logits


class FakeDraft(sp.Drafter):
    """Drafts up to 3 tokens from another table B (also chained on the previous token)."""

    kind, max_drafts = "fake", 3

    def __init__(self, model, B: torch.Tensor) -> None:
        super().__init__(model)
        self.B = B

    def _observe(self, state, rec, prev) -> None:
        pass

    def propose(self, state, anchor, k, pick):
        toks, probs, prev = [], [], anchor
        for _ in range(k):
            t, q = pick(self.B[prev])
            toks.append(t)
            probs.append(q)
            prev = t
        return sp.Proposal(toks, None if probs[0] is None else torch.stack(probs), [None] * k)


class Runner:
    """What a `Session` needs of its engine, with the passes routed through the drafter (as `Engine` does)."""

    prefill_chunk = prefill_span = 256

    def __init__(self, drafter: sp.Drafter) -> None:
        self.drafter = drafter

    def check_open(self) -> None:  # never closed
        pass

    def new_state(self):
        return self.drafter.new_state()

    def prefill(self, ids, state, all_logits=False):
        return self.drafter.forward(ids, state, all_logits)[0]


def run_fake(drafter, params: SamplingParams, schedule: sp.Schedule, prompt_ids: list[int], n: int) -> list[int]:
    session = Session(Runner(drafter), context_length=10_000, vocab_size=drafter.model.A.shape[0])
    steps = sp.speculative_generate_step(
        session, prompt_ids, params, drafter=drafter, schedule=schedule, stats=sp.SpeculativeStats()
    )
    out = [next(steps)[0] for _ in range(n)]
    steps.close()
    assert session.tokens == prompt_ids + out  # the finally: rewinds tokens computed but not yielded
    return out


@pytest.mark.parametrize("fixed", [3, None])
def test_loop_output_distribution_matches_target(fixed):
    """First 4 tokens over 3000 seeds with temperature 0.9 and top-k 3 on a 5-token vocabulary: the joint
    distribution of (t1..t4) (81 cells) against the exact target joint. Covers drafted, accepted, rejected
    (residual) and bonus tokens across several passes. False-alarm rate with fresh seeds: 1e-3."""
    g = torch.Generator().manual_seed(2)
    V, K, N = 5, 4, 3000
    A, B = torch.randn(V, V, generator=g) * 1.5, torch.randn(V, V, generator=g) * 1.5
    B = 0.5 * B + 0.5 * A  # a draft that is right often, but not always
    drafter = FakeDraft(FakeTarget(A), B)
    counts: dict[tuple, int] = {}
    for seed in range(N):
        params = SamplingParams(temperature=0.9, top_k=3, seed=seed, max_tokens=K)
        out = tuple(run_fake(drafter, params, sp.Schedule(fixed=fixed), [0, 3], K))
        counts[out] = counts.get(out, 0) + 1
    params = SamplingParams(temperature=0.9, top_k=3)
    P = torch.softmax(torch.stack([processed_logits(A[v], params) for v in range(V)]), -1)  # [V, V]
    probs: dict[tuple, float] = {(): 1.0}
    for _ in range(K):  # exact joint by enumeration: last prompt token is 3
        probs = {seq + (v,): pr * float(P[seq[-1] if seq else 3, v]) for seq, pr in probs.items() for v in range(V)}
    stat, df = chi2(counts, probs, N)
    assert stat < chi2_critical(df), (stat, df)


def test_loop_greedy_on_fake_model_and_seed_reproducibility():
    g = torch.Generator().manual_seed(3)
    A = torch.randn(7, 7, generator=g)
    drafter = FakeDraft(FakeTarget(A), A.clone())  # a perfect draft: every pass accepts all 3 + bonus
    out = run_fake(drafter, SamplingParams(max_tokens=20), sp.Schedule(fixed=3), [1], 20)
    expect, t = [], 1
    for _ in range(20):
        t = int(A[t].argmax())
        expect.append(t)
    assert out == expect
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12)
    assert run_fake(drafter, params, sp.Schedule(fixed=3), [1], 12) == run_fake(
        drafter, params, sp.Schedule(fixed=3), [1], 12
    )


# --- the real tiny models ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_runs(tiny_ckpt):
    """Plain greedy continuations (reference numerics) of 3 prompts; `tiny` and `tiny-dspark` share every
    main-model tensor (same seed, same names), so these are the targets of both drafts."""
    eng = load(tiny_ckpt, numerics="reference")
    return {
        s: [c.token for c in eng.stream(prompt(s), max_tokens=TOKENS, ignore_eos=True, session=eng.open_session())]
        for s in (11, 12, 13)
    }


class ReplayMixin:
    """Replaces a real drafter's tokens by the plain transcript's (each kept right with probability 0.7), while
    the real drafter still runs, so its context rows go through every accept/reject/rollback."""

    transcript: list[int]  # set per generation (`generate`)

    def propose(self, state, anchor, k, pick):
        prop = super().propose(state, anchor, k, pick)
        m, seq = state.length, self.transcript
        g = torch.Generator().manual_seed(1000 + m)
        toks = []
        for j, t in enumerate(prop.tokens):
            right = seq[m + 1 + j] if m + 1 + j < len(seq) else t
            toks.append(right if float(torch.rand(1, generator=g)) < 0.7 else (right + 1) % 1024)
        return sp.Proposal(toks, prop.probs, prop.confidence)


class ReplayMTP(ReplayMixin, sp.MTPDrafter):
    pass


class ReplayDSpark(ReplayMixin, sp.DSparkDrafter):
    pass


def speculative_engine(path, draft: str, fixed: int | None, numerics: str = "reference", replay: bool = False):
    eng = load(path, numerics=numerics, draft=draft)
    if replay:
        cls = ReplayMTP if draft == "mtp" else ReplayDSpark
        d = cls(eng.model) if draft == "mtp" else cls(eng.model, eng.source)
        eng.use_draft(d, sp.Schedule(fixed=fixed), draft)
    else:
        eng.draft_schedule.fixed = fixed
    return eng


def generate(eng, seed: int, n: int = TOKENS, transcript=None, **kw):
    if transcript is not None:
        eng.drafter.transcript = prompt(seed) + transcript
    session = eng.open_session()
    out = [c.token for c in eng.stream(prompt(seed), max_tokens=n, ignore_eos=True, session=session, **kw)]
    return out, session


@pytest.mark.parametrize("draft,fixed,replay", [("mtp", 1, False), ("dspark", 4, False), ("dspark", None, True)])
def test_greedy_is_token_identical_to_plain(request, plain_runs, draft, fixed, replay):
    """3 prompts x 200 tokens. The MTP/DSpark drafts of the random fixtures are almost never right (every pass
    rejects and rolls back); the replay runs (real DSpark context, transcript tokens 70% right, the confidence
    schedule choosing the length) accept most drafts."""
    path = request.getfixturevalue("tiny_ckpt" if draft == "mtp" else "dspark_ckpt")
    eng = speculative_engine(path, draft, fixed, replay=replay)
    for seed, expect in plain_runs.items():
        out, _ = generate(eng, seed, transcript=expect if replay else None)
        assert out == expect, (seed, next(i for i, (a, b) in enumerate(zip(out, expect)) if a != b))
    st = eng.stats()
    assert st["draft_verify_passes"] > 0 and st["draft_mode"] == draft
    if replay:
        assert st["draft_acceptance_rate"] > 0.4 and st["draft_tokens_per_pass"] > 1.5


@pytest.fixture(scope="module")
def plain_official(tiny_ckpt):
    """`plain_runs` under the default `official` numerics."""
    eng = load(tiny_ckpt)
    return {
        s: [c.token for c in eng.stream(prompt(s), max_tokens=TOKENS, ignore_eos=True, session=eng.open_session())]
        for s in (11, 12, 13)
    }


@pytest.mark.parametrize("draft,fixed", [("mtp", 1), ("dspark", 5)])
def test_greedy_is_token_identical_to_plain_under_official_numerics(request, plain_official, draft, fixed):
    """3 prompts x 200 tokens in the default numerics, where FP8/FP4 activation rounding turns any difference
    between a verify pass and decode into other tokens (before the model was batch-invariant, these runs parted
    from plain greedy after 9 to 124 tokens). Replay drafts (70% right), so that passes of 2 (MTP) and 6 (DSpark)
    tokens accept, reject and roll back all along."""
    from fastar.quant import kernels, linear

    if linear._kernels() is None or kernels.get_isa() == "scalar":
        pytest.skip("batch invariance is a promise of the C kernels' SIMD dot path")
    path = request.getfixturevalue("tiny_ckpt" if draft == "mtp" else "dspark_ckpt")
    eng = speculative_engine(path, draft, fixed, numerics="official", replay=True)
    for seed, expect in plain_official.items():
        out, _ = generate(eng, seed, transcript=expect)
        assert out == expect, (seed, next(i for i, (a, b) in enumerate(zip(out, expect)) if a != b))
    st = eng.stats()
    assert st["draft_acceptance_rate"] > 0.4 and st["draft_tokens_per_pass"] > (1.5 if draft == "mtp" else 2.5)
    assert 0 < st["draft_accepted_0_passes"] < st["draft_verify_passes"]  # rejections (and rollbacks) happened


def test_verify_passes_stay_within_the_batch_invariant_width():
    """A draft offering more than VERIFY_MAX - 1 tokens is verified VERIFY_MAX tokens at a time at most (beyond,
    a pass would no longer compute each token exactly as decode does)."""
    g = torch.Generator().manual_seed(4)
    A = torch.randn(7, 7, generator=g)
    drafter = FakeDraft(FakeTarget(A), A.clone())  # a perfect draft: it would fill any width
    drafter.max_drafts = 12
    widths, forward = [], drafter.forward

    def spy(ids, state, all_logits=True):
        widths.append(len(ids))
        return forward(ids, state, all_logits)

    drafter.forward = spy
    out = run_fake(drafter, SamplingParams(max_tokens=40), sp.Schedule(fixed=12), [1], 40)
    assert sp.VERIFY_MAX == 8 and max(widths[1:]) == sp.VERIFY_MAX  # widths[0]: the prompt
    expect, t = [], 1
    for _ in range(40):
        t = int(A[t].argmax())
        expect.append(t)
    assert out == expect


def passes_of(eng) -> list:
    """Record every target pass the drafter sees: (p0, ids, logits)."""
    seen, forward = [], eng.drafter.forward

    def spy(ids, state, all_logits=True):
        out = forward(ids, state, all_logits)
        rec = eng.drafter.last
        seen.append((rec.p0, list(rec.ids), rec.logits.clone()))
        return out

    eng.drafter.forward = spy
    return seen


def test_a_speculative_stream_rolls_back_its_drafts_while_the_caller_may_not_rewind(tiny_ckpt, plain_runs):
    """Speculative decoding drops its rejected drafts with the session's unguarded `roll_back` mid-generation;
    the caller's `rewind` meanwhile raises `SessionInUse`. The stream's tokens stay the plain ones. And a suspended
    stream that lost its session to a newer generation leaves that one's timeline alone when it is closed (it
    used to roll the session back to its own prompt plus the tokens it had yielded)."""
    from fastar.engine.session import SessionInUse

    eng = speculative_engine(tiny_ckpt, "mtp", 1, replay=True)
    seed, expect = 11, plain_runs[11][:40]
    eng.drafter.transcript = prompt(seed) + plain_runs[seed]
    session = eng.open_session()
    stream = eng.stream(prompt(seed), max_tokens=40, ignore_eos=True, session=session)
    got = [next(stream).token for _ in range(20)]
    with pytest.raises(SessionInUse, match=r"^cannot rewind this session while a generation on it is unfinished"):
        session.rewind(len(prompt(seed)))
    got += [c.token for c in stream]
    assert got == expect and eng.draft_stats.passes > 0 and eng.draft_stats.accepted < eng.draft_stats.drafted

    old = eng.stream(prompt(seed), max_tokens=40, ignore_eos=True, session=session)
    assert [next(old).token for _ in range(2)] == expect[:2]
    newer = [c.token for c in eng.stream(prompt(seed), max_tokens=10, ignore_eos=True, session=session)]
    assert newer == expect[:10] and session.tokens == prompt(seed) + newer
    old.close()
    assert session.tokens == prompt(seed) + newer


@pytest.mark.parametrize("draft", ["mtp", "dspark"])
def test_after_rejection_state_and_logits_equal_a_fresh_run(request, plain_runs, draft):
    """Replay drafts (accepted and rejected mixed) across 160 tokens: 20 ratio-4 and one ratio-128 compression
    window closing inside verify passes. Then (1) the logits of every kept position of every pass, in
    particular the first pass after each rejection, equal a fresh prefill of the final tokens; (2) every buffer of
    the main state (window, compressed entries, compressor and indexer partial windows) and of the draft context
    equals the fresh run's; (3) the next draft from the rolled-back context equals the fresh context's."""
    path = request.getfixturevalue("tiny_ckpt" if draft == "mtp" else "dspark_ckpt")
    eng = speculative_engine(path, draft, None if draft == "dspark" else 1, replay=True)
    seen = passes_of(eng)
    seed, n = 12, 160
    out, session = generate(eng, seed, n=n, transcript=plain_runs[seed])
    tokens = prompt(seed) + out
    assert out == plain_runs[seed][:n]
    rejected = [i for i, (p0, ids, _) in enumerate(seen[:-1]) if seen[i + 1][0] < p0 + len(ids)]
    assert len(rejected) > 10  # many rollbacks happened

    fresh = load(path, numerics="reference", draft=draft)
    fstate = fresh.new_state()
    ref = fresh.prefill(tokens[:-1], fstate, all_logits=True)  # [len-1, V], position i predicts i+1
    for p0, ids, logits in seen[1:]:  # verify passes (the first record is the prompt)
        keep = [j for j in range(len(ids)) if p0 + j < len(tokens) - 1 and tokens[p0 + j] == ids[j]]
        keep = keep[: next((j for j, k in enumerate(keep) if k != j), len(keep))]  # the prefix still kept
        assert keep, "the anchor of a pass is always kept"
        assert (logits[keep] - ref[p0 + keep[0] : p0 + keep[-1] + 1]).abs().max() <= 1e-4

    state = eng.drafter.last.state  # the session's state (the drafter saw its last pass)
    assert session.num_processed == state.length
    if state.length == len(tokens):  # the last token was a verified draft, already processed
        fresh.prefill([tokens[-1]], fstate)
    assert state.length == fstate.length
    compared = 0
    for a, b in zip(state.layers + state.mtp, fstate.layers + fstate.mtp):
        for name, buf in a.buffers().items():
            other = b.buffers()[name]
            lo, hi = max(buf.start, other.start), min(buf.stop, other.stop)
            if hi > lo:
                assert (buf.rows(lo, hi) - other.rows(lo, hi)).abs().max() <= 1e-4, name
                compared += 1
    assert compared >= len(state.layers) + len(state.mtp)

    def greedy(logits):
        return int(logits.argmax()), None

    propose = sp.MTPDrafter.propose if draft == "mtp" else sp.DSparkDrafter.propose  # the real draft, no replay
    a = propose(eng.drafter, state, 5, eng.drafter.max_drafts, greedy)
    b = propose(fresh.drafter, fstate, 5, fresh.drafter.max_drafts, greedy)
    assert a.tokens == b.tokens


def test_stream_contract_with_a_draft(tiny_ckpt, plain_runs):
    """A stop token inside an accepted run of drafts, max_tokens ending mid-pass, the context limit, and the
    session afterwards: all exactly as plain generation leaves them."""
    expect = plain_runs[11]
    eng = speculative_engine(tiny_ckpt, "mtp", 1, replay=True)
    plain = load(tiny_ckpt, numerics="reference")
    for n, kw in ((TOKENS, {"stop_token_ids": [expect[37]]}), (23, {})):
        out, session = generate(eng, 11, n=n, transcript=expect, **kw)
        ref = [
            c.token for c in plain.stream(prompt(11), max_tokens=n, ignore_eos=True, session=plain.open_session(), **kw)
        ]
        assert out == ref and len(out) <= 38
        assert session.tokens == prompt(11) + out and session.num_processed <= session.num_tokens
    eng.context_length = plain.context_length = len(prompt(11)) + 30
    chunks = [c for c in eng.stream(prompt(11), max_tokens=TOKENS, ignore_eos=True, session=eng.open_session())]
    ref = [c for c in plain.stream(prompt(11), max_tokens=TOKENS, ignore_eos=True, session=plain.open_session())]
    assert [c.token for c in chunks] == [c.token for c in ref] and chunks[-1].finish_reason == "length"
    assert chunks[-1].usage == ref[-1].usage


def test_prefix_reuse_and_seeded_sampling(tiny_ckpt):
    """Two sampled requests on one session with a draft, the second reusing the first's prefix; the same two
    requests on a fresh session give the same tokens (a seed pins the text for the same history: prefix reuse
    changes the chunking and the draft's context, hence which drafts are drawn, though not the distribution)."""

    def two_requests(eng):
        s = eng.open_session()
        a = [c.token for c in eng.stream(prompt(1), max_tokens=12, temperature=0.8, seed=5, session=s)]
        b = [c.token for c in eng.stream(prompt(1) + a + [7, 8], max_tokens=12, temperature=0.8, seed=5, session=s)]
        assert s.last_cached_tokens >= len(prompt(1)) + len(a) - 1
        return a, b

    eng = load(tiny_ckpt, draft="mtp")
    assert two_requests(eng) == two_requests(eng)
    st = eng.stats()
    assert st["draft_mode"] == "mtp" and st["draft_tokens_verified"] > 0
    assert {"draft_acceptance_rate", "draft_tokens_per_pass", "draft_seconds"} <= set(st)


def test_draft_aware_prefetch_asks_for_hash_layer_experts(tiny_ckpt, plain_runs):
    """With a provider that pages, each verify pass's hash-routed experts (tid2eid of the anchor and
    the drafts) are requested before the pass runs."""
    eng = speculative_engine(tiny_ckpt, "mtp", 1, replay=True)
    inner, log = eng.model.experts, []

    class Prefetching(Unpaged):
        pages = True

        def get(self, layer, e):
            log.append(("get", layer, e))
            return inner.get(layer, e)

        def prefetch(self, layer, ids, source="manual"):
            log.append(("prefetch", layer, tuple(ids), source))

    for block in eng.model.layers + [eng.model.mtp[0].block]:
        block.ffn.experts = Prefetching()
    eng.model.experts = block.ffn.experts
    generate(eng, 11, n=20, transcript=plain_runs[11])
    pre = [x for x in log if x[0] == "prefetch"]
    hash_layers = [b.layer for b in eng.model.layers if b.ffn.is_hash]
    assert pre and {x[1] for x in pre} == set(hash_layers) and all(x[3] == "hash" for x in pre)
    i = log.index(pre[0])
    layer, ids = pre[0][1], set(pre[0][2])
    nxt = {x[2] for x in log[i:] if x[0] == "get" and x[1] == layer}
    assert ids <= nxt  # the experts prefetched are the ones the pass then gets
    assert eng.stats()["draft_prefetched_experts"] > 0


# --- schedule, auto and the front-ends -----------------------------------------------------------------------


def test_schedule_verifies_more_when_it_pays():
    s = sp.Schedule(r=0.1, q=0.1)
    for _ in range(50):
        s.observe(0, 1.0, None)
        s.observe(1, 0.9, None)
    assert s.choose([None, None]) == 2
    expensive = sp.Schedule(r=1.0, q=0.1)
    assert expensive.choose([None, None]) == 0  # each verified token costs a full pass: never worth it
    low = sp.Schedule(r=0.3, q=0.1)
    for _ in range(50):
        low.observe(0, 0.05, None)
    assert low.choose([None]) == 0
    conf = sp.Schedule(r=0.3, q=0.3)  # DSpark: confidence drives the length around the measured rates
    assert conf.choose([0.95, 0.9, 0.9, 0.1, 0.9]) == 3
    assert conf.choose([0.05, 0.9, 0.9, 0.9, 0.9]) == 0


def test_auto_stops_drafting_when_passes_cost_too_much():
    s = sp.Schedule(r=0.3, q=0.12, adaptive=True, probe_every=8)
    assert s.want_draft(1)  # no evidence yet: try
    for width, t in ((1, 1.0), (2, 2.0), (3, 3.0)):  # measured: every token costs a full pass (expert misses)
        s.observe_time(width, t, 0.2)
    for _ in range(20):
        s.observe(0, 0.6, None)  # a decent draft, but verifying costs as much as decoding
    r, q = s.costs()
    assert r == pytest.approx(1.0) and q == pytest.approx(0.2)
    decisions = [s.want_draft(1) for _ in range(32)]
    assert decisions.count(True) == 4  # probes only

    # epochs: drafting measured at 10 tok/s, plain at 20 (say, wide passes thrash the expert cache): auto settles
    # on plain, probing drafting briefly, and after 4 verdicts switches it off
    e = sp.Schedule(adaptive=True, epoch_tokens=64, probe_tokens=16, settle=0)
    modes = []
    while not e.retired and len(modes) < 1000:
        modes.append(e.mode)
        e.observe_step(1, 0.1 if e.mode == "draft" else 0.05)
    assert e.retired and modes.count("draft") < modes.count("plain") / 2 and not e.want_draft(1)
    e = sp.Schedule(adaptive=True, epoch_tokens=64, probe_tokens=16, settle=0)
    for _ in range(500):  # the other way round: drafting wins, plain is only probed
        e.observe_step(1, 0.05 if e.mode == "draft" else 0.1, verified=e.mode == "draft")
    assert not e.retired and e.speed["draft"] > e.speed["plain"] and e.mode in ("draft", "plain")
    e = sp.Schedule(adaptive=True, epoch_tokens=64, probe_tokens=16, settle=0)
    for _ in range(2000):  # as fast either way, but draft epochs hardly verify anything: the draft is useless
        e.observe_step(1, 0.05, verified=False)
    assert e.retired

    cheap = sp.Schedule(adaptive=True)
    for width, t in ((1, 1.0), (2, 1.1), (6, 1.5)):
        cheap.observe_time(width, t, 0.1)
    for _ in range(20):
        cheap.observe(0, 0.8, None)
    assert cheap.costs()[0] < 0.15 and all(cheap.want_draft(1) for _ in range(8))


@pytest.mark.parametrize("ckpt", ["tiny_ckpt", "dspark_ckpt"])
def test_auto_skips_draft_upkeep_in_plain_epochs(ckpt, request):
    """In a plain epoch `auto` runs plain target passes (no draft context); back in a draft epoch the draft's
    context starts over where it has a gap, and the output is plain greedy throughout."""
    path = request.getfixturevalue(ckpt)
    plain = load(path)
    ids = list(range(3, 23))
    want = plain.generate_tokens(ids, 24, ignore_eos=True)
    eng = load(path, draft="auto")
    eng.draft_schedule.mode = "plain"
    eng.draft_schedule.epoch[3] = 12.0  # 12 plain tokens, then a draft epoch
    eng.draft_schedule.speed["draft"] = 1e9  # as if drafting had been measured fast: the next epoch drafts
    got, paused = [], []
    for chunk in eng.stream(ids, max_tokens=24, ignore_eos=True):
        if chunk.token is not None:
            got.append(chunk.token)
            paused.append(eng.drafter.paused)
    assert got == want
    assert paused[1] and not paused[-1] and eng.draft_schedule.mode == "draft"


def test_resolve_draft_names(tiny_ckpt, dspark_ckpt):
    assert load(tiny_ckpt, draft="auto").draft_stats.mode == "auto:mtp"
    eng = load(dspark_ckpt, draft="auto")
    assert eng.draft_stats.mode == "auto:dspark" and eng.draft_schedule.adaptive
    assert load(tiny_ckpt).drafter is None and load(tiny_ckpt).stats()["draft_mode"] == "none"
    with pytest.raises(ValueError, match="no dspark"):
        load(tiny_ckpt, draft="dspark")
    with pytest.raises(ValueError, match="draft must be"):
        load(tiny_ckpt, draft="eagle")
    bare = types.SimpleNamespace(config=types.SimpleNamespace(has_dspark=False), mtp=[])
    assert sp.resolve("auto", bare, None)[0] is None and sp.resolve("auto", bare, None)[2] == "none"


def test_draft_flag_on_run_chat_serve():
    from fastar.cli import build_parser

    p = build_parser()
    for cmd in (["run", "-p", "x"], ["chat"], ["serve"]):
        assert p.parse_args(cmd + ["--draft", "mtp"]).draft == "mtp"
        assert p.parse_args(cmd).draft == "none"
    with pytest.raises(SystemExit):
        p.parse_args(["run", "--draft", "eagle"])


def test_run_with_a_draft_end_to_end(vocab_ckpt, capsys):
    """`fastar run --draft mtp --verbose` on the real-vocabulary fixture streams text and reports the draft line."""
    from fastar import cli

    assert (
        cli.main(
            ["run", "-m", str(vocab_ckpt), "-p", "Hello there", "-n", "12", "--raw", "--draft", "mtp", "--verbose"]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "draft mtp:" in err and "tokens per verify pass" in err


def test_verbose_line_reports_the_draft():
    from fastar.console import draft_line

    st = sp.SpeculativeStats(mode="mtp", passes=10, drafted=10, accepted=4, accept_counts=[6, 4])
    line = draft_line({}, {**st.as_dict(0.01), "generated_tokens": 20})
    assert "mtp" in line and "40.0%" in line and "1.40 tokens per verify pass" in line
    assert draft_line({}, {"draft_mode": "none"}) is None
    # `run --draft mtp -n 1`: its token came out of the prefill, nothing was drafted or verified: no rate over none
    # (it said "0.0% of 0 drafts accepted; 0.00 tokens per verify pass")
    idle = sp.SpeculativeStats(mode="mtp").as_dict(0.01)
    assert draft_line({}, idle) == "draft mtp: no draft; 0 plain steps"


def test_bench_draft_honours_the_ram_budget_and_head_screen(tiny_ckpt, monkeypatch, capsys):
    """`fastar bench draft --ram-budget A,B --no-head-screen`: one row group per budget, its simulated cache the
    experts that fit it (none: all of them), and every engine loaded without the head screen."""
    from fastar.bench import speculative as sb
    from fastar.cli import main
    from fastar.engine import engine as engine_mod

    loaded, real_load = [], engine_mod.load
    monkeypatch.setattr(engine_mod, "load", lambda *a, **kw: loaded.append(kw["head_screen"]) or real_load(*a, **kw))
    source = engine_mod.open_source(tiny_ckpt)
    stride, n_exp = source.expert_stride, source.config.num_layer_slots * source.config.n_routed_experts
    rows = sb.bench(tiny_ckpt, drafts=("none",), ram_budgets=(3 * stride + 1, None), head_screen=False, tokens=3)
    assert [r["cache_bytes"] for r in rows] == [3 * stride, n_exp * stride] and loaded == [False, False]
    assert rows[0]["capacity"] == 3 / n_exp and rows[0]["hit_rate"] < rows[1]["hit_rate"]
    seen = {}
    monkeypatch.setattr(sb, "bench", lambda path, **kw: seen.update(kw) or rows)
    assert main(["bench", "draft", "-m", str(tiny_ckpt), "--ram-budget", "300K,none", "--no-head-screen"]) == 0
    assert seen["ram_budgets"] == (300 << 10, None) and seen["head_screen"] is False
    assert "cache_MB" in capsys.readouterr().out
    assert main(["bench", "draft", "-m", str(tiny_ckpt)]) == 0 and seen["ram_budgets"] is None and seen["head_screen"]
    for bad in ("12Q", "1G,auto"):
        assert main(["bench", "draft", "-m", str(tiny_ckpt), "--ram-budget", bad]) != 0
        err = capsys.readouterr().err
        assert err.startswith("fastar: error: --ram-budget: ") and err.count("\n") == 1, err


def test_bench_runs(tiny_ckpt):
    from fastar.bench import speculative as sb

    rows = sb.bench(
        tiny_ckpt,
        drafts=("none", "mtp", "replay:0.9"),
        capacities=(1.0, 0.1),
        tokens=10,
        miss_ms=0.5,
        prompts=1,
        reps=1,
    )
    assert len(rows) == 6 and all(r["tok_per_s"] > 0 for r in rows)
    replay = [r for r in rows if r["mode"] == "replay:0.9"]
    assert all(r["acceptance"] > 0.5 for r in replay)
    # no draft verified: no acceptance, tokens per pass or plain share (they said 0.00), "-" in the table
    plain = [r for r in rows if r["mode"] == "none"]
    assert all(r["acceptance"] is r["tokens_per_pass"] is r["plain_share"] is None for r in plain)
    table = sb.format_bench(rows)
    assert "speedup" in table
    for line in table.splitlines()[1:]:
        assert (line.split()[-3:] == ["-", "-", "-"]) == (line.split()[0] == "none"), line
