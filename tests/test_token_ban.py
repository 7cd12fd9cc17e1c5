"""Banned tokens (`SamplingParams.banned_token_ids`, which the server's `tool_choice` "none" sets to the DSML marker):
never drawn, greedy or sampled, and the LM head screen keeps serving such a request (`head_screen.Ban`): its
tokens are the unscreened head's with the ban applied, through the screen's rows and the engine alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_head_screen import engines, head, race_token  # noqa: F401 (engines: a fixture)

import fastar
from fastar.engine.draw import gumbel
from fastar.engine.sampling import Sampler, SamplingError, SamplingParams
from fastar.model.head_screen import Ban, HeadScreen, Race
from fastar.quant import kernels as K
from fastar.quant.linear import Linear


def banned_token(logits: np.ndarray, ban: Ban) -> int:
    """The sampler's token for logits [V] with `ban`'s ids at -inf: the argmax, or its race's winner."""
    x = logits.copy()
    x[ban.ids] = -np.inf
    return int(np.argmax(x)) if ban.race is None else race_token(x, ban.race)


def test_sampling_params_check_banned_token_ids():
    assert SamplingParams(banned_token_ids=[9, 3, 9]).banned_token_ids == [3, 9]
    for bad in ([-1], ["x"], [True], 5, [[1]]):
        with pytest.raises(SamplingError, match="banned_token_ids must be a list of token ids"):
            SamplingParams(banned_token_ids=bad)


def test_a_sampler_never_draws_a_banned_token():
    """Greedy and sampled, the banned token is never drawn even where it holds nearly all the probability; the
    head request is a `Ban` of the argmax or race (the screen stays on), and with `min_tokens` the ending tokens join
    the ban until it is reached."""
    g = torch.Generator().manual_seed(4)
    for p in (SamplingParams(banned_token_ids=[7]), SamplingParams(banned_token_ids=[7], temperature=1.0, seed=1)):
        s = Sampler(p, vocab_size=500)
        for _ in range(20):
            logits = torch.randn(500, generator=g)
            logits[7] = 50.0
            want = s.head_request()
            assert isinstance(want, Ban) and want.ids.tolist() == [7]
            assert (want.race is None) == p.is_greedy and (p.is_greedy or isinstance(want.race, Race))
            assert s(logits)[0] != 7
    s = Sampler(SamplingParams(banned_token_ids=[7], min_tokens=1, stop_token_ids=[3]), eos_token_id=1)
    logits = torch.zeros(500)
    logits[[1, 3, 7]] = 5.0
    assert s.head_request().ids.tolist() == [1, 3, 7] and s(logits)[0] == 0
    assert s.head_request().ids.tolist() == [7] and s(logits)[0] == 1
    assert Sampler(SamplingParams(banned_token_ids=[7], top_p=0.5, temperature=1.0)).head_request() is False


@pytest.mark.skipif(not K.available(), reason="the head screen runs on the C kernels")
@pytest.mark.parametrize("T", [1, 3])
def test_screened_rows_with_a_ban_give_the_full_heads_tokens(T):
    """A banned row that could win (the argmax, a race's likely winner, a top-k row) makes its row take the full head;
    a ban of a row that cannot win keeps the screen; either way the token is the full head's with the ban."""
    rng = np.random.default_rng(30 + T)
    w = head(rng)
    full = Linear("head", w, "BF16")
    screen = HeadScreen(full, K)
    gen = torch.Generator().manual_seed(T)
    for trial in range(8):
        y = rng.standard_normal((T, w.shape[1])).astype(np.float32)
        want = full(torch.from_numpy(y)).numpy()
        rows: list[Ban | Race | None] = []
        for t in range(T):
            best = np.argsort(want[t])[::-1]
            race = None if trial % 4 < 2 else Race(0.8, gumbel(screen.V, gen), 40 * (trial == 7))
            winner = int(best[0]) if race is None else race_token(want[t], race)  # the full head's token
            lowest = 8 + int(np.argmin(want[t][8:]))  # (rows 0-7 are `head`'s odd ones: row 5's bound is wide)
            ids = np.array(sorted({winner, int(best[1])} if trial % 2 else {lowest}), np.int64)
            rows.append(Ban(ids, race) if t != 1 else race)  # row 1: no ban, beside banned rows
        got = screen.logits(torch.from_numpy(y), rows).numpy()
        for t, r in enumerate(rows):
            kept = np.isfinite(got[t])
            assert np.array_equal(got[t][kept], want[t][kept])
            if isinstance(r, Ban):
                assert banned_token(got[t], r) == banned_token(want[t], r) and banned_token(got[t], r) not in r.ids
                if trial % 2:  # a banned row could win: the full head
                    assert kept.all()
                elif r.race is None:  # the lowest logit banned: screened (a race's noise may let any row win)
                    assert kept.sum() < screen.V / 4
            elif r is not None:
                assert race_token(got[t], r) == race_token(want[t], r)
    with pytest.raises(ValueError, match="a ban's ids are int64"):
        Ban(np.array([1.0]))


@pytest.mark.skipif(not K.available(), reason="the head screen runs on the C kernels")
def test_banned_tokens_never_come_and_the_screen_keeps_the_full_heads_tokens(engines):  # noqa: F811
    """Through the engine, greedy and sampled (with a top-k too): the token the model would write most never comes,
    the tokens change, and they are the same with the screen (which keeps screening: a fraction of the head's rows)
    as with the full head, where the sampler applies the same ban."""
    on, off = engines
    ids = [5, 17, 300, 42]
    for kw in (dict(), dict(temperature=0.8, seed=3), dict(temperature=0.8, top_k=40, seed=6)):
        free = [c.token for c in off.stream(ids, SamplingParams(max_tokens=16, ignore_eos=True, **kw))]
        ban = max(set(free), key=free.count)
        p = SamplingParams(max_tokens=16, ignore_eos=True, banned_token_ids=[ban], **kw)
        before = on.model.screen.exact_rows
        a, b = [c.token for c in on.stream(ids, p)], [c.token for c in off.stream(ids, p)]
        assert a == b and ban not in a and a != free
        assert 0 < on.model.screen.exact_rows - before < 15 * on.config.vocab_size / 2  # screened, mostly
        # the server's path: the scheduler, two choices batched (n = 2; the second with another seed)
        other = SamplingParams(max_tokens=16, ignore_eos=True, banned_token_ids=[ban], **{**kw, "seed": 8})
        want = [a, [c.token for c in off.stream(ids, other)]]
        assert scheduled(on, ids, [p, other]) == want and ban not in want[1]


def scheduled(engine, ids: list[int], params: list[SamplingParams]) -> list[list[int]]:
    sched = engine.scheduler(max_batch=4)
    handles = sched.submit_choices(ids, params)
    sched.run_until_idle()
    return [[c.token for c in h if c.token is not None] for h in handles]


def test_a_request_with_a_ban_does_not_draft(tiny_fst_path):
    """Drafts are verified against the model's logits, not the ban: a request with banned tokens decodes plainly,
    on the scheduler and through `stream`, and gets the plain tokens."""
    plain, drafting = fastar.load(tiny_fst_path, head_screen=False), fastar.load(tiny_fst_path, draft="mtp")
    ids = [5, 17, 300, 42]
    free = [c.token for c in plain.stream(ids, SamplingParams(max_tokens=16, ignore_eos=True))]
    p = SamplingParams(max_tokens=16, ignore_eos=True, banned_token_ids=[max(set(free), key=free.count)])
    want = [c.token for c in plain.stream(ids, p)]
    sched = drafting.scheduler(max_batch=2)
    handle = sched.submit(ids, p)
    sched.run_until_idle()
    assert sched.metrics()["draft_steps"] == 0 and [c.token for c in handle if c.token is not None] == want
    handle = sched.submit(ids, SamplingParams(max_tokens=16, ignore_eos=True))  # without the ban: it drafts
    sched.run_until_idle()
    assert sched.metrics()["draft_steps"] > 0 and [c.token for c in handle if c.token is not None] == free
    assert [c.token for c in drafting.stream(ids, p)] == want
    plain.close()
    drafting.close()
