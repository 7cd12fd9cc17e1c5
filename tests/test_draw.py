"""fastar.engine.draw: the exponential race gives each token its probability and never one of probability 0,
refuses a distribution without mass, gives the same tokens for the same seed, and keeps them where
the logits move a little (where a draw from running sums would move); and the same of `race`, the draw from
logits with Gumbel noise that the sampler takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastar.engine.draw import draw, gumbel, race


def test_draw_gives_each_token_its_probability():
    probs = torch.tensor([0.0, 0.05, 0.3, 0.0, 0.15, 0.4, 0.1, 0.0])
    gen = torch.Generator().manual_seed(11)
    n = 40000
    counts = np.bincount([draw(probs * 7, gen) for _ in range(n)], minlength=8)  # not normalised: the same
    want = probs.numpy() * n
    assert np.all(counts[want == 0] == 0)  # probability 0: never, at the start, inside and at the end
    sd = np.sqrt(want * (1 - probs.numpy()))
    assert np.all(np.abs(counts - want) <= 5 * sd), (counts, want)


def test_draw_follows_the_seed_and_refuses_a_distribution_without_mass():
    probs = torch.softmax(torch.randn(129280, generator=torch.Generator().manual_seed(0)), -1)
    a = [draw(probs, torch.Generator().manual_seed(5)) for _ in range(3)]
    g = torch.Generator().manual_seed(5)
    b = [draw(probs, g) for _ in range(3)]
    assert a[0] == a[1] == a[2] == b[0] and len(set(b)) > 1  # the stream moves on between draws
    one = torch.zeros(1000)
    one[777] = 1e-30
    assert {draw(one, g) for _ in range(20)} == {777}
    for bad in (torch.zeros(10), torch.tensor([0.5, float("nan")]), torch.tensor([0.5, float("inf")])):
        with pytest.raises(ValueError, match="no finite positive mass"):
            draw(bad, g)


def test_draw_keeps_its_tokens_when_the_logits_move_a_little():
    """Logits moved by ~1e-3 (as a prefix from the cache, computed by other kernels, against a fresh prefill) leave a
    seeded draw where it was in nearly every case over a flat distribution of the whole vocabulary: 199 of 200 here,
    where a draw from running sums, which every token's change shifts, kept 161."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(129280, generator=g)
    moved = logits + 1e-3 * torch.randn(129280, generator=g)
    p, q = torch.softmax(logits, -1), torch.softmax(moved, -1)
    same = [draw(p, torch.Generator().manual_seed(s)) == draw(q, torch.Generator().manual_seed(s)) for s in range(200)]
    assert sum(same) >= 196


def test_race_gives_each_token_its_probability():
    """`race` over logits with Gumbel noise draws softmax(logits): the same frequencies as `draw`'s check, -inf
    never drawn."""
    probs = torch.tensor([0.0, 0.05, 0.3, 0.0, 0.15, 0.4, 0.1, 0.0])
    logits = torch.log(probs) + 3.0  # -inf where the probability is 0; shifted: the same distribution
    gen = torch.Generator().manual_seed(12)
    n = 40000
    counts = np.bincount([race(logits, gumbel(8, gen)) for _ in range(n)], minlength=8)
    want = probs.numpy() * n
    assert np.all(counts[want == 0] == 0)
    sd = np.sqrt(want * (1 - probs.numpy()))
    assert np.all(np.abs(counts - want) <= 5 * sd), (counts, want)


def test_race_takes_as_many_uniforms_as_draw_and_refuses_what_it_cannot_draw_from():
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    gumbel(1000, a)
    draw(torch.ones(1000), b)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))  # the same place in the stream
    g = gumbel(100000, torch.Generator().manual_seed(0))
    assert np.isfinite(g).all() and g.min() > -3.7 and g.max() < 37.5
    assert abs(g.mean() - 0.5772) < 0.02  # the Gumbel distribution's mean, Euler's constant
    noise = gumbel(3, a)
    for bad in (torch.full((3,), float("-inf")), torch.tensor([0.0, float("nan"), 1.0])):
        with pytest.raises(ValueError, match="no finite positive mass"):
            race(bad, noise)
    with pytest.raises(ValueError, match="4 logits against 3 noise values"):
        race(torch.zeros(4), noise)


def test_race_keeps_its_tokens_when_the_logits_move_a_little():
    """As `draw`: each score depends on its own logit and noise, so logits moved by ~1e-3 keep nearly every token."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(129280, generator=g)
    moved = logits + 1e-3 * torch.randn(129280, generator=g)
    noises = [gumbel(129280, torch.Generator().manual_seed(s)) for s in range(200)]
    assert sum(race(logits, n) == race(moved, n) for n in noises) >= 196
