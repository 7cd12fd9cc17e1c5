"""The screened LM head (fastar.model.head_screen) against the full head: the same argmax for every row, the same
bits at every row it computes, every row that holds the largest logit among them; rows it cannot screen take the
full head; greedy generation through the engine gives the same tokens with the screen as without it; and sampled
rows screened for their race (`Race`) draw the tokens the full head gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastar
from fastar.engine.draw import gumbel, race
from fastar.engine.sampling import Sampler, SamplingParams, processed_logits, report, screenable
from fastar.engine.scheduler import Scheduler
from fastar.model import ops
from fastar.model.head_screen import Ban, HeadScreen, Race
from fastar.quant import kernels as K
from fastar.quant.linear import Linear

pytestmark = pytest.mark.skipif(not K.available(), reason="the head screen runs on the C kernels")


def bf16_bits(a: np.ndarray) -> np.ndarray:
    return (
        (torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16).view(torch.int16))
        .numpy()
        .view(np.uint16)
    )


def head(rng, V: int = 3000, K_: int = 256) -> np.ndarray:
    w = rng.standard_normal((V, K_)).astype(np.float32) * 0.02
    w[1] = w[0]  # an exact tie for any y
    w[3] = w[2] * (1 + 2.0**-7)  # rows one bfloat16 step apart
    w[5, :8] *= 40  # a row with outliers (a coarse int8 scale)
    w[7] = 0  # an all-zero row
    return bf16_bits(w)


def check(screen: HeadScreen, full: Linear, y: torch.Tensor) -> None:
    got, want = screen.logits(y).numpy(), full(y).numpy()
    for t in range(y.shape[0]):
        g, w = got[t], want[t]
        kept = np.isfinite(g) | np.isnan(g)
        assert np.array_equal(g[kept], w[kept], equal_nan=True), f"row {t}: a computed logit differs from the head's"
        assert np.all(g[~kept] == -np.inf)
        assert int(np.argmax(g)) == int(np.argmax(w)), f"row {t}: argmax {np.argmax(g)} != {np.argmax(w)}"
        if not np.isnan(w).any():
            assert kept[w == w.max()].all(), f"row {t}: a row with the largest logit was not computed"


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 6, 8])
def test_screen_matches_the_full_head(T):
    rng = np.random.default_rng(T)
    w = head(rng)
    full = Linear("head", w, "BF16")
    screen = HeadScreen(full, K)
    for trial in range(6):
        y = rng.standard_normal((T, w.shape[1])).astype(np.float32)
        if trial == 1:
            y[:, :8] *= 50  # outliers: a coarse int8 scale for x
        if trial == 2:
            y *= 1e-30  # tiny values
        if trial == 3:  # rows 0 and 1 tie exactly, and lead: the first must win, as in the full head
            y[:] = np.sign(w[0].view(np.int16)).astype(np.float32)
        check(screen, full, torch.from_numpy(y))
    assert screen.logits(torch.from_numpy(y)).isfinite().sum() < T * w.shape[0] / 2  # it did screen


def test_non_finite_weights_and_rows_the_screen_cannot_bound():
    rng = np.random.default_rng(9)
    w = head(rng, V=1000)
    w[10] = bf16_bits(np.full(w.shape[1], np.inf, np.float32))
    w[11, 3] = bf16_bits(np.array([np.nan], np.float32))[0]
    full = Linear("head", w, "BF16")
    screen = HeadScreen(full, K)
    y = rng.standard_normal((4, w.shape[1])).astype(np.float32)
    got = screen.logits(torch.from_numpy(y)).numpy()
    want = full(torch.from_numpy(y)).numpy()
    assert np.array_equal(got[:, 10:12], want[:, 10:12], equal_nan=True)  # always computed
    assert np.array_equal(np.argmax(got, axis=1), np.argmax(want, axis=1))
    y[1, 0] = np.nan  # not screened: the full head's row, every value
    y[2] = 0.0
    y[3, 5] = np.inf
    got = screen.logits(torch.from_numpy(y)).numpy()
    want = full(torch.from_numpy(y)).numpy()
    assert np.array_equal(got[1:], want[1:], equal_nan=True)


def test_screenable_requests_report_no_logprob():
    logits = torch.randn(50)
    for p in (
        SamplingParams(),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=1),
        SamplingParams(temperature=0.7, top_k=40),
    ):
        assert screenable(p)
        assert report(logits, 3, p) == (3, None, [])
    for p in (
        SamplingParams(logprobs=0),
        SamplingParams(temperature=0.7, logprobs=0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=4000),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9),
        SamplingParams(temperature=0.7, min_p=0.1),
        SamplingParams(temperature=1e-4),  # below MIN_RACE_TEMPERATURE
        SamplingParams(temperature=1e38),  # above MAX_RACE_TEMPERATURE: t g would overflow the offsets
        SamplingParams(logit_bias={1: 2.0}),
    ):
        assert not screenable(p)
        token, logprob, _ = report(logits, 3, p)
        assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[3]))


@pytest.fixture(scope="module")
def engines(tiny_fst_path):
    on = fastar.load(tiny_fst_path, head_screen=True)
    off = fastar.load(tiny_fst_path, head_screen=False)
    assert on.model.screen is not None and off.model.screen is None
    yield on, off
    on.close()
    off.close()


def test_greedy_tokens_are_the_full_heads(engines):
    on, off = engines
    ids = [5, 17, 300, 42]
    before = on.model.screen.exact_rows
    assert on.generate_tokens(ids, 24, ignore_eos=True) == off.generate_tokens(ids, 24, ignore_eos=True)
    assert 0 < on.model.screen.exact_rows - before < 23 * on.config.vocab_size / 2  # 23 steps screened
    p = SamplingParams(max_tokens=16, ignore_eos=True)
    a = list(on.stream(ids, p))
    b = list(off.stream(ids, p))
    assert [c.token for c in a] == [c.token for c in b] and all(c.logprob is None for c in a + b)
    p = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)  # asks for logprobs: the full head, numbers kept
    a = list(on.stream(ids, p))
    b = list(off.stream(ids, p))
    assert [(c.token, c.logprob, c.top_logprobs) for c in a] == [(c.token, c.logprob, c.top_logprobs) for c in b]


@pytest.mark.parametrize(
    "flags",
    [[True, True], [True, False], [True] * 3, [True] * 8, [True] * 7 + [False]],
)
def test_batched_rows_screen_when_all_are_argmax_only_and_few(engines, flags):
    on, off = engines
    m_on, m_off = on.model, off.model
    prompts = [[5 + 4 * i, 6 + 4 * i, 7 + 4 * i, 8][: 2 + i % 3] for i in range(len(flags))]
    screened = all(flags) and len(flags) <= HeadScreen.MAX_ROWS
    states_on, states_off, last = [], [], []
    for ids in prompts:
        for m, states in ((m_on, states_on), (m_off, states_off)):
            s = m.new_state()
            m.forward(ids, s, all_logits=False)
            states.append(s)
        last.append(ids[-1] + 1)
    for _ in range(4):
        got = m_on.forward_rows(last, states_on, flags)
        want = m_off.forward_rows(last, states_off)
        for b in range(len(flags)):
            kept = torch.isfinite(got[b])
            assert torch.equal(got[b][kept], want[b][kept]) and int(got[b].argmax()) == int(want[b].argmax())
            assert bool(kept.all()) != screened  # screened rows computed only some head rows, the others all
        last = [int(want[b].argmax()) for b in range(len(flags))]


def test_select_checks_its_arguments():
    V, T = 100, 2
    dots = np.zeros((2 * T, V), np.int32)
    f = np.ones(V, np.float32)
    args = [dots, np.ones(2 * T, np.float32), f, np.ones(T, np.float32), np.ones(T, np.float32), f, f, 1e-6]
    keep, rows = np.empty(V, np.uint8), np.empty(V, np.int64)
    assert K.extension.head_i8_select(*args, keep, rows) == V  # every estimate 0, every bound 2: all can be the max
    assert np.array_equal(rows, np.arange(V))
    with pytest.raises(ValueError, match="keep has 99 entries"):
        K.extension.head_i8_select(*args, np.empty(V - 1, np.uint8), rows)
    with pytest.raises(ValueError, match="two per decode row"):
        K.extension.head_i8_select(np.zeros((3, V), np.int32), *args[1:], keep, rows)


def screen_inputs(rng, T: int, V: int = 3000, K_: int = 256):
    """A screened head (`HeadScreen` of `head`), decode rows y [T, K] and head_i8_screen's arguments for them."""
    w = head(rng, V, K_)
    screen = HeadScreen(Linear("head", w, "BF16"), K)
    y = rng.standard_normal((T, K_)).astype(np.float32)
    x, sx, st = np.empty((2 * T, K_), np.int8), np.empty(2 * T, np.float32), np.empty((T, 5))
    K.extension.head_i8_quantize(y, x, sx, st)
    g, m = screen.gamma, 1e-6
    c = np.array(
        [[(r[3] + g * r[2]) * (1 + m), r[4] * (1 + m), (r[0] + g * r[2]) * (1 + m), r[1] * (1 + m)] for r in st],
        np.float32,
    )
    return screen, y, x, sx, c


def screen_rows(screen: HeadScreen, x, sx, c) -> np.ndarray:
    T, V = c.shape[0], screen.V
    keep, rows = np.empty(V, np.uint8), np.empty(V, np.int64)
    args = (x, sx, c, screen.q, screen.rowsum, screen.scale, screen.wnorm32, screen.dnorm32, 1e-6)
    n = K.extension.head_i8_screen(*args, np.empty((T, V), np.float32), keep, rows)
    return rows[:n].copy()


@pytest.mark.parametrize("isa", K.cpu_features()["usable_isas"] if K.available() else [])
@pytest.mark.parametrize("T", [1, 2, 4, 5, 8])
def test_one_pass_screen_keeps_what_both_bounds_keep(T, isa):
    """head_i8_screen against its contract computed in numpy from both terms' full products (float64, so rows
    within a rounding of the floor may go either way): the rows it keeps lie between those the contract keeps with
    the floor raised and lowered by a relative 1e-5, they are the same for any thread count, and each decode row's
    largest exact logit is among them."""
    rng = np.random.default_rng(40 + T)
    screen, y, x, sx, c = screen_inputs(rng, T)
    dots = K.head_i8_dot(x, screen.q, screen.rowsum).astype(np.float64)
    scale, wn, dn = (
        screen.scale.astype(np.float64),
        screen.wnorm32.astype(np.float64),
        screen.dnorm32.astype(np.float64),
    )
    strict, loose = np.zeros(screen.V, bool), np.zeros(screen.V, bool)
    for t in range(T):
        a1, a2 = dots[t] * sx[t] * scale, dots[T + t] * sx[T + t] * scale
        b1 = c[t, 0] * wn + c[t, 1] * dn + np.abs(a1) * 1e-6
        b2 = c[t, 2] * wn + c[t, 3] * dn + (np.abs(a1) + np.abs(a2)) * 1e-6
        ub = np.minimum(a1 + b1, a1 + a2 + b2)
        floor = max((a1 - b1).max(), (a1 + a2 - b2).max())
        strict |= ub >= floor + 1e-5 * abs(floor)
        loose |= ub >= floor - 1e-5 * abs(floor)
    assert strict.sum() < screen.V / 4  # the second term settles most rows the first leaves open
    logits = screen.head(torch.from_numpy(y)).numpy()
    best = np.flatnonzero((logits == logits.max(1, keepdims=True)).any(0))  # each decode row's largest logits
    n = K.get_num_threads()
    K.set_isa(isa)  # the second terms' products with VNNI or in portable C; the bounds' loops per ISA
    try:
        for threads in (1, 2, 3):
            K.set_num_threads(threads)
            got = screen_rows(screen, x, sx, c)
            mask = np.zeros(screen.V, bool)
            mask[got] = True
            assert np.all(mask[strict]) and not np.any(mask & ~loose), f"{threads} threads"
            assert np.all(np.diff(got) > 0)
            if threads == 1:
                first = got
            assert np.array_equal(got, first), f"{threads} threads keep other rows than 1"
    finally:
        K.set_num_threads(n)
        K.set_isa("auto")
    assert np.isin(best, got).all()


def test_screen_checks_its_arguments():
    rng = np.random.default_rng(5)
    screen, _, x, sx, c = screen_inputs(rng, 2, V=100, K_=64)
    V = screen.V
    args = [x, sx, c, screen.q, screen.rowsum, screen.scale, screen.wnorm32, screen.dnorm32, 1e-6]
    ub, keep, rows = np.empty((2, V), np.float32), np.empty(V, np.uint8), np.empty(V, np.int64)
    assert 0 < K.extension.head_i8_screen(*args, ub, keep, rows) <= V
    with pytest.raises(ValueError, match="ub has shape"):
        K.extension.head_i8_screen(*args, np.empty((3, V), np.float32), keep, rows)
    with pytest.raises(ValueError, match="two per decode row"):
        K.extension.head_i8_screen(x[:3], *args[1:], ub, keep, rows)
    with pytest.raises(ValueError, match="c has shape"):
        K.extension.head_i8_screen(x, sx, c[:, :3].copy(), *args[3:], ub, keep, rows)


def test_quantize_takes_each_row_as_two_int8_terms():
    rng = np.random.default_rng(3)
    y = rng.standard_normal((3, 128)).astype(np.float32)
    y[1, 5] = np.nan
    x, sx, stats = np.empty((6, 128), np.int8), np.empty(6, np.float32), np.empty((3, 3))
    K.extension.head_i8_quantize(y, x, sx, stats)
    for t in (0, 2):
        assert np.abs(x[t]).max() == 127 and sx[t] == np.float32(np.abs(y[t]).max() / 127.0)
        approx = sx[t].astype(np.float64) * x[t] + sx[3 + t].astype(np.float64) * x[3 + t]
        y64 = y[t].astype(np.float64)
        want = [np.linalg.norm(y64 - approx), np.linalg.norm(approx), np.linalg.norm(y64)]
        assert np.allclose(stats[t], want, rtol=1e-12)
        assert stats[t, 0] < 1e-3 * stats[t, 2]  # the second term leaves (1/127)^2 of the first one's error
    assert np.all(x[[1, 4]] == 0) and np.all(np.isinf(stats[1]))
    five = np.empty((3, 5))
    K.extension.head_i8_quantize(y, x, sx, five)  # with the first term's own norms
    assert np.array_equal(five[:, :3], stats, equal_nan=True) and np.all(np.isinf(five[1]))
    for t in (0, 2):
        first = sx[t].astype(np.float64) * x[t]
        want = [np.linalg.norm(y[t].astype(np.float64) - first), np.linalg.norm(first)]
        assert np.allclose(five[t, 3:], want, rtol=1e-12)
        assert five[t, 3] > 10 * five[t, 0]


@pytest.mark.parametrize("isa", K.cpu_features()["usable_isas"] if K.available() else [])
def test_head_i8_exact_equals_gather_matmul_scatter(isa):
    """`head_i8_exact` (one call) against what it replaces: `gather_rows`, `bf16_matmul` on the gathered rows and an
    index assignment into an -inf-filled array, bit for bit on every ISA, for 1 to 8 rows and 0 to all candidates; and
    its argument checks."""
    rng = np.random.default_rng(4)
    w = head(rng, V=700, K_=256)
    K.set_isa(isa)
    try:
        for T in (1, 2, 5, 8):
            y = rng.standard_normal((T, w.shape[1])).astype(np.float32)
            for U in (0, 1, 7, 64, 700):
                rows = np.sort(rng.choice(w.shape[0], U, replace=False)).astype(np.int64)
                sub = np.empty((U, w.shape[1]), np.uint16)
                K.extension.gather_rows(w, rows, sub)
                exact = np.empty((T, U), np.float32)
                K.extension.bf16_matmul(y, sub, exact)
                want = np.full((T, w.shape[0]), -np.inf, np.float32)
                want[:, rows] = exact
                got = np.full((T, w.shape[0]), np.nan, np.float32)
                K.extension.head_i8_exact(w, rows, y, got)
                assert np.array_equal(got.view(np.int32), want.view(np.int32)), (isa, T, U)
    finally:
        K.set_isa("auto")
    out = np.empty((1, w.shape[0]), np.float32)
    with pytest.raises(ValueError, match=r"rows\[1\] = 700 is not a row of w's 700"):
        K.extension.head_i8_exact(w, np.array([0, 700], np.int64), np.ones((1, 256), np.float32), out)
    with pytest.raises(ValueError, match="out has shape"):
        K.extension.head_i8_exact(w, np.array([0], np.int64), np.ones((2, 256), np.float32), out)
    with pytest.raises(ValueError, match="y has shape"):
        K.extension.head_i8_exact(w, np.array([0], np.int64), np.ones((1, 255), np.float32), out)


def screened_races(screen: HeadScreen, y: np.ndarray, races: list[Race | None], want: np.ndarray) -> np.ndarray:
    """The screened logits of rows y with `races`, each row's token checked against the full head's logits `want`:
    a race's from the race, a greedy row's (None) the argmax."""
    got = screen.logits(torch.from_numpy(y), races).numpy()
    for t, r in enumerate(races):
        if r is None:
            assert int(np.argmax(got[t])) == int(np.argmax(want[t])), f"row {t}"
        else:
            assert race_token(got[t], r) == race_token(want[t], r), f"row {t}"
    return got


def race_token(logits: np.ndarray, race_: Race) -> int:
    """A sampler's token for logits [V] (float32) and a race: its temperature's (and top-k's) processed logits, then
    the race."""
    p = SamplingParams(temperature=race_.temperature, top_k=race_.top_k)
    return race(processed_logits(torch.from_numpy(logits), p), race_.noise)


@pytest.mark.parametrize("isa", K.cpu_features()["usable_isas"] if K.available() else [])
@pytest.mark.parametrize("T", [1, 2, 5, 8])
def test_offsets_shift_both_kernels_bounds(T, isa):
    """head_i8_select (both terms) and head_i8_screen (one pass) with offsets against the contract in numpy with
    every bound shifted by its row's offset (rows within a relative 1e-5 of the floor may go either way); offsets of
    0 keep the rows that no offsets keep."""
    rng = np.random.default_rng(60 + T)
    screen, y, x, sx, c = screen_inputs(rng, T)
    V = screen.V
    off = (rng.gumbel(size=(T, V)) * rng.choice([0.1, 1.0, 3.0])).astype(np.float32)
    dots = K.head_i8_dot(x, screen.q, screen.rowsum)
    d = dots.astype(np.float64)
    scale, wn, dn = (a.astype(np.float64) for a in (screen.scale, screen.wnorm32, screen.dnorm32))
    strict, loose = np.zeros(V, bool), np.zeros(V, bool)
    strict2, loose2 = np.zeros(V, bool), np.zeros(V, bool)  # both terms for every row (head_i8_select's bounds)
    for t in range(T):
        o = off[t].astype(np.float64)
        a1, a2 = d[t] * sx[t] * scale, d[T + t] * sx[T + t] * scale
        b1 = c[t, 0] * wn + c[t, 1] * dn + (np.abs(a1) + np.abs(o)) * 1e-6
        b2 = c[t, 2] * wn + c[t, 3] * dn + (np.abs(a1) + np.abs(a2) + np.abs(o)) * 1e-6
        ub = np.minimum(a1 + o + b1, a1 + a2 + o + b2)
        floor = max((a1 + o - b1).max(), (a1 + a2 + o - b2).max())
        strict |= ub >= floor + 1e-5 * abs(floor)
        loose |= ub >= floor - 1e-5 * abs(floor)
        floor2 = (a1 + a2 + o - b2).max()
        strict2 |= a1 + a2 + o + b2 >= floor2 + 1e-5 * abs(floor2)
        loose2 |= a1 + a2 + o + b2 >= floor2 - 1e-5 * abs(floor2)
    K.set_isa(isa)
    try:
        keep, rows = np.empty(V, np.uint8), np.empty(V, np.int64)
        args = (x, sx, c, screen.q, screen.rowsum, screen.scale, screen.wnorm32, screen.dnorm32, 1e-6)
        n = K.extension.head_i8_screen(*args, np.empty((T, V), np.float32), keep, rows, off)
        sel = (dots, sx, screen.scale, c[:, 2].copy(), c[:, 3].copy(), screen.wnorm32, screen.dnorm32, 1e-6)
        for got, lo, hi in (
            (rows[:n].copy(), strict, loose),
            (rows[: K.extension.head_i8_select(*sel, keep, rows, off)].copy(), strict2, loose2),
        ):
            mask = np.zeros(V, bool)
            mask[got] = True
            assert np.all(mask[lo]) and not np.any(mask & ~hi)
        assert n < V / 2  # it screened
        zero = np.zeros((T, V), np.float32)
        got0 = rows[: K.extension.head_i8_screen(*args, np.empty((T, V), np.float32), keep, rows, zero)].copy()
        assert np.array_equal(got0, screen_rows(screen, x, sx, c))
        got0 = rows[: K.extension.head_i8_select(*sel, keep, rows, zero)].copy()
        assert np.array_equal(got0, rows[: K.extension.head_i8_select(*sel, keep, rows)])
        with pytest.raises(ValueError, match="off has shape"):
            K.extension.head_i8_screen(*args, np.empty((T, V), np.float32), keep, rows, zero[:, 1:].copy())
        with pytest.raises(ValueError, match="off has shape"):
            K.extension.head_i8_select(*sel, keep, rows, zero[:, 1:].copy())
    finally:
        K.set_isa("auto")


@pytest.mark.parametrize("T", [1, 2, 3, 4, 8])
def test_screened_races_draw_the_full_heads_tokens(T):
    """Sampled rows (`Race`), alone or beside greedy rows: the race over the screened logits gives the full head's
    token for each, at several temperatures, with a tie between the two best scores going to the first as in the
    full head, and the greedy rows their argmax; the screen computes a small part of the head."""
    rng = np.random.default_rng(80 + T)
    w = head(rng)
    full = Linear("head", w, "BF16")
    screen = HeadScreen(full, K)
    gen = torch.Generator().manual_seed(T)
    for trial, temp in enumerate([1.0, 0.3, 2.0, 0.05, 1.0, 0.7]):
        y = rng.standard_normal((T, w.shape[1])).astype(np.float32)
        want_logits = full(torch.from_numpy(y)).numpy()
        races: list[Race | None] = [Race(temp, gumbel(screen.V, gen)) for _ in range(T)]
        if trial == 4 and T > 1:
            races[0] = None  # a greedy row among sampled ones
        if trial == 5:  # the full head's two best scores of row T - 1 made an exact tie: the first index wins
            r = races[-1]
            x = processed_logits(torch.from_numpy(want_logits[-1]), SamplingParams(temperature=temp)).numpy()
            score = x.astype(np.float64) + r.noise
            a, b = np.argsort(score)[-2:][::-1]
            r.noise[b] = score[a] - np.float64(x[b])
            assert np.float64(x[b]) + r.noise[b] == score[a]
        got = screened_races(screen, y, races, want_logits)
        for t, r in enumerate(races):
            kept = np.isfinite(got[t])
            assert np.array_equal(got[t][kept], want_logits[t][kept])
            assert r is None or kept.sum() < screen.V / 4
        if trial == 5:
            assert race_token(got[-1], races[-1]) == min(a, b)
    with pytest.raises(ValueError, match="noise has 5 entries"):
        screen.logits(torch.from_numpy(y), [Race(1.0, np.zeros(5))] * T)
    with pytest.raises(ValueError, match=r"top_k in \[0, 1024\]"):
        Race(1.0, np.zeros(5), 1025)


@pytest.mark.parametrize("T", [1, 2, 5])
def test_screened_top_k_races_draw_the_full_heads_tokens(T):
    """Races among the top k (alone, beside races without it and greedy rows): the k-th largest logit and every row
    the top-k keeps are exact in the screened logits, so the token is the full head's; with logits crowded at the
    k-th (rows of the k-th's weights, one bfloat16 step apart) too."""
    rng = np.random.default_rng(90 + T)
    w = head(rng)
    w[20:60] = w[2]  # 40 rows tied with row 2 and one with a step above (row 3): a crowd at the k-th for k near 40
    full = Linear("head", w, "BF16")
    screen = HeadScreen(full, K)
    gen = torch.Generator().manual_seed(T)
    for trial, (temp, k) in enumerate([(1.0, 40), (0.3, 5), (2.0, 1000), (0.7, 40), (1.0, 1), (1.0, 41)]):
        y = rng.standard_normal((T, w.shape[1])).astype(np.float32)
        if trial >= 3:  # rows 2, 3 and 20-59 lead: the k-th largest lies inside the crowd
            y[:] = np.sign(w[2].view(np.int16)).astype(np.float32)
        want_logits = full(torch.from_numpy(y)).numpy()
        races: list[Race | None] = [Race(temp, gumbel(screen.V, gen), k) for _ in range(T)]
        if T > 1:
            races[0] = None  # a greedy row beside them
        if T > 2:
            races[1] = Race(temp, gumbel(screen.V, gen))  # and a race without a top-k
        got = screened_races(screen, y, races, want_logits)
        for t, r in enumerate(races):
            if r is not None and r.top_k:
                for _ in range(3):  # other noises over the same logits: a top-k row's kept rows do not depend on it
                    other = Race(r.temperature, gumbel(screen.V, gen), r.top_k)
                    assert race_token(got[t], other) == race_token(want_logits[t], other), f"trial {trial} row {t}"
                kept = np.isfinite(got[t])
                kth = np.sort(want_logits[t])[-r.top_k]
                assert kept[want_logits[t] >= kth].all()  # every row the top-k keeps was computed
                if T == 1 and r.top_k <= 100:  # (a batch computes the union of its rows' candidates)
                    assert kept.sum() < screen.V / 4
    for t in (1e-4, 1e38, float("nan")):
        with pytest.raises(ValueError, match=r"temperature in \[0\.001, 1e\+06\]"):
            Race(t, np.zeros(5))


def test_sampled_tokens_are_the_full_heads(engines):
    """Seeded sampled generation at a temperature alone screens its steps (from the second token) and gives the
    tokens the full head gives; with top_p it takes the full head, the same tokens either way. Batched rows mixing
    races, greedy rows and a row that needs every logit match the full head's too."""
    on, off = engines
    ids = [5, 17, 300, 42]
    for p in (
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.5, seed=4, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1e30, seed=5, max_tokens=12, ignore_eos=True),  # not screened: every logit
        SamplingParams(temperature=0.8, top_k=40, seed=6, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=5000, seed=6, max_tokens=8, ignore_eos=True),  # too many to screen
    ):
        before = on.model.screen.exact_rows
        a, b = list(on.stream(ids, p)), list(off.stream(ids, p))
        assert [c.token for c in a] == [c.token for c in b]
        assert len({c.token for c in a}) > 3  # sampled, not a repeated token
        screened = on.model.screen.exact_rows - before
        if screenable(p):
            assert 0 < screened < 23 * on.config.vocab_size / 2 and all(c.logprob is None for c in a + b)
        else:
            assert screened == 0 and all(c.logprob is not None for c in a)
    m_on, m_off = on.model, off.model
    V = on.config.vocab_size
    gen = torch.Generator().manual_seed(9)
    states_on, states_off, last = [], [], []
    for i in range(4):
        for m, states in ((m_on, states_on), (m_off, states_off)):
            s = m.new_state()
            m.forward([5 + i, 6, 7 + i], s, all_logits=False)
            states.append(s)
        last.append(8 + i)
    for flags in ([True, None, None, True], [None, None, None, None], [None, True, False, None]):
        wants = [Race(0.9, gumbel(V, gen)) if f is None else f for f in flags]
        got = m_on.forward_rows(last, states_on, wants)
        want = m_off.forward_rows(last, states_off)
        last = []
        for b, f in enumerate(wants):
            if isinstance(f, Race):
                last.append(race_token(got[b].numpy(), f))
                assert last[-1] == race_token(want[b].numpy(), f)
            else:
                last.append(int(want[b].argmax()))
                assert int(got[b].argmax()) == last[-1]
        assert bool(torch.isfinite(got).all()) == (False in flags)  # screened unless a row needs every logit


def test_min_tokens_tokens_are_the_full_heads(engines):
    """`min_tokens` bans the stop token ids (its steps screened with the ban, `Ban`) and screens the steps after it:
    the same tokens with the screen and without, greedy and sampled; the ban changes the tokens."""
    on, off = engines
    ids = [5, 17, 300, 42]
    for kw in (dict(), dict(temperature=0.8, seed=3), dict(temperature=0.8, top_k=40, seed=6)):
        free = [c.token for c in off.stream(ids, SamplingParams(max_tokens=12, ignore_eos=True, **kw))]
        stop = next(t for t in free[3:] if t not in free[:3])
        p = SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[stop], min_tokens=12, **kw)
        before = on.model.screen.exact_rows
        a, b = list(on.stream(ids, p)), list(off.stream(ids, p))
        assert [c.token for c in a] == [c.token for c in b] and all(c.logprob is None for c in a + b)
        tokens = [c.token for c in a]
        assert tokens[: free.index(stop)] == free[: free.index(stop)] and stop not in tokens[:12]
        assert 0 < on.model.screen.exact_rows - before < (len(a) - 1) * on.config.vocab_size / 2  # screened


def test_generate_tokens_samples_as_stream_does(engines):
    """`Engine.generate_tokens` draws with a `Sampler` and screens its steps as `stream` does: for a temperature and a
    seed the same tokens as `stream`, with the screen and without."""
    on, off = engines
    ids = [9, 8, 7, 6]
    for temperature in (0.0, 0.7):
        p = SamplingParams(temperature=temperature, seed=11, max_tokens=16, ignore_eos=True)
        want = [c.token for c in off.stream(ids, p) if c.token is not None]
        before = on.model.screen.exact_rows
        for eng in (on, off):
            assert eng.generate_tokens(ids, 16, temperature=temperature, seed=11, ignore_eos=True) == want
        assert on.model.screen.exact_rows > before  # its steps were screened


def test_a_sampler_draws_the_same_tokens_whether_or_not_its_steps_ask_early():
    """`head_request` draws the next token's noise before its logits, from the generator where the token would have
    drawn it: the same tokens with and without, through a forced token (which draws nothing) too."""
    p = SamplingParams(temperature=0.9, seed=21)
    early, late = Sampler(p), Sampler(p)
    assert early.head_request() is False  # the vocabulary is not known before the first token
    g = torch.Generator().manual_seed(2)
    tokens = []
    for step in range(12):
        logits = torch.randn(5000, generator=g)
        want = early.head_request() if step else None
        if step:
            assert isinstance(want, Race) and want.temperature == 0.9 and early.head_request().noise is want.noise
        if step == 5:  # a forced token: no noise is used, the early one stays for the next token
            assert early.forced(logits, 7)[0] == late.forced(logits, 7)[0] == 7
            continue
        a, b = early(logits), late(logits)
        assert a == b and a[1] is None
        tokens.append(a[0])
    assert len(set(tokens)) > 5
    assert Sampler(SamplingParams()).head_request() is True
    assert Sampler(SamplingParams(temperature=0.9, top_p=0.5)).head_request() is False
    banning = Sampler(SamplingParams(min_tokens=2), eos_token_id=1)  # bans EOS for its first two tokens: a `Ban`
    logits = torch.zeros(5000)
    logits[1] = 1.0
    for _ in range(2):
        want = banning.head_request()
        assert isinstance(want, Ban) and want.ids.tolist() == [1] and want.race is None and banning(logits)[0] == 0
    assert banning.head_request() is True and banning(logits)[0] == 1


@pytest.mark.parametrize("budget", [None, "300K"])  # one forward call; a paged span of pieces (`DeepseekV4._span`)
def test_a_first_token_screens_the_prompts_head(engines, tiny_fst_path, budget):
    """The prompt's last position screens its head where the request reads its argmax (or a race's) alone, on every
    path that prefills (`Engine.stream`'s session, `generate_tokens`, the scheduler): the first token, greedy or
    sampled at a temperature, is the full head's, and only a few head rows were computed for it. A request that
    asks for logprobs, and a scheduled prompt with several choices (each draws from the same logits), keep the
    full head."""
    off = engines[1]
    on = fastar.load(tiny_fst_path, head_screen=True, ram_budget=budget)
    assert (on.paged_chunk is not None) == (budget is not None) and ops.SMALL_CHUNK < 40
    ids = torch.randint(2, 1000, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    V = on.config.vocab_size

    def screened(run) -> tuple[list, int]:
        before = on.model.screen.exact_rows
        out = run(on)
        return out, on.model.screen.exact_rows - before

    def scheduled(e, params):
        sched = Scheduler(e, max_batch=4, max_queue=4)
        handles = sched.submit_choices(ids, params)
        sched.run_until_idle()
        return [[c.token for c in h if c.token is not None] for h in handles]

    one = SamplingParams(max_tokens=1, ignore_eos=True)
    want = [c.token for c in off.stream(ids, one)]
    with on:
        got, rows = screened(lambda e: [c.token for c in e.stream(ids, one)])
        assert got == want and 0 < rows < V / 2
        got, rows = screened(lambda e: e.generate_tokens(ids, 1, ignore_eos=True))
        assert got == want and 0 < rows < V / 2
        got, rows = screened(lambda e: [c.token for c in e.stream(ids, SamplingParams(max_tokens=1, logprobs=1))])
        assert got[:1] == want and rows == 0
        for seed in range(3):  # a sampled first token races over the screened head: the full head's draw
            hot = SamplingParams(max_tokens=1, temperature=0.9, seed=seed, ignore_eos=True)
            drawn = [c.token for c in off.stream(ids, hot)]
            got, rows = screened(lambda e: [c.token for c in e.stream(ids, hot)])
            assert got == drawn and 0 < rows < V / 2
            got, rows = screened(lambda e: scheduled(e, [hot]))
            assert got == [drawn] and 0 < rows < V / 2
            got, rows = screened(lambda e: e.generate_tokens(ids, 1, temperature=0.9, seed=seed, ignore_eos=True))
            assert got == drawn and 0 < rows < V / 2
        got, rows = screened(lambda e: scheduled(e, [one]))
        assert got == [want] and 0 < rows < V / 2
        got, rows = screened(lambda e: scheduled(e, [one, one]))
        assert got == [want, want] and rows == 0
