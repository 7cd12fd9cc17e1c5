"""fastar.engine.nucleus.top_p against the full sort (`sampling.apply_top_p`, the reference): the same nucleus for
flat and peaked distributions over the whole vocabulary, with -inf entries and ties, found in one round or several."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastar.engine import nucleus
from fastar.engine.sampling import apply_top_p


def kept(x: torch.Tensor) -> np.ndarray:
    return np.flatnonzero(torch.isfinite(x).numpy())


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0, 12.0])
def test_top_p_is_the_full_sorts_nucleus(scale):
    g = torch.Generator().manual_seed(int(scale * 100))
    logits = torch.randn(129280, generator=g) * scale
    logits[::7] = float("-inf")  # a top-k or a grammar before it
    logits[100:110] = logits[5]  # ties
    sizes = []
    for p in (0.1, 0.5, 0.9, 0.95, 0.999, 0.9999999, 1.0):
        got, want = nucleus.top_p(logits, p), apply_top_p(logits, p)
        a, b = kept(got), kept(want)
        assert len(a) == len(b), (scale, p, len(a), len(b))
        # the same set, but for tokens tied at its edge (which of them a sort puts first is unspecified)
        assert torch.all(logits[np.setxor1d(a, b)] == logits[b].min())
        assert torch.equal(got[torch.isfinite(got)], logits[torch.isfinite(got)])
        sizes.append(len(a))
    assert sizes == sorted(sizes) and sizes[-1] == int(torch.isfinite(logits).sum())
    if scale == 0.05:  # flat: the nucleus of 0.5 holds tens of thousands, found past the first 64
        assert sizes[1] > 10 * nucleus.FIRST_K
    if scale == 12.0:  # peaked: a handful, within the first 64
        assert sizes[3] < nucleus.FIRST_K


def test_top_p_orders_by_the_logits_where_probabilities_round_to_a_tie():
    """exp(-1e-45) rounds to 1: both tokens have probability 0.5, but the nucleus of 0.5 is the larger logit's."""
    logits = torch.tensor([-1.401298464324817e-45, 0.0])
    for f in (nucleus.top_p, apply_top_p):
        assert kept(f(logits, 0.5)).tolist() == [1]


def test_top_p_keeps_the_top_token_and_all_when_p_is_not_reached():
    logits = torch.tensor([0.0, 5.0, float("-inf"), 1.0])
    assert kept(nucleus.top_p(logits, 1e-9)).tolist() == [1]
    assert kept(nucleus.top_p(logits, 0.99999999999)).tolist() == [0, 1, 3]
