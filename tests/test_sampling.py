"""Sampling: parameter validation, each logits processor against a hand-computed case, greedy, seeds, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastar.engine.constraint import CompiledGrammar
from fastar.engine.logit_adjust import LogitAdjust
from fastar.engine.sampling import (
    Sampler,
    SamplingError,
    SamplingParams,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    processed_logits,
)


def kept(logits: torch.Tensor) -> list[int]:
    return [i for i, v in enumerate(logits.tolist()) if v != float("-inf")]


LOGP = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


# --- SamplingParams ----------------------------------------------------------------------------------------


def test_defaults_are_greedy() -> None:
    p = SamplingParams()
    assert p.is_greedy and p.max_tokens == 256 and p.stop == [] and p.logprobs is None


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", -1),
        ("max_tokens", 1.5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),  # masked (-inf) logits / inf are NaN
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", 1.5),
        ("seed", "x"),
        ("seed", 2**64),  # beyond what a torch.Generator takes: no "Overflow when unpacking long long" later
        ("seed", -(2**63) - 1),
        ("stop", [""]),
        ("stop", 5),  # not a list: no "'int' object is not iterable"
        ("stop_token_ids", 3),
        ("logit_bias", [1.0]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("logprobs", 21),
        ("logprobs", -1),
        ("ignore_eos", 1),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"3": 1.0}),
        ("logit_bias", {3: float("inf")}),
        ("presence_penalty", 2.5),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("grammar", "start: 'a'"),  # Lark text, not compiled: was an AttributeError at the first token
        ("min_tokens", -1),
        ("min_tokens", 257),  # above max_tokens (256 by default)
        ("min_tokens", True),
    ],
)
def test_bad_values_name_the_field(field: str, value) -> None:
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**{field: value})
    assert issubclass(SamplingError, ValueError)  # the server maps ValueError to a 400


def test_min_tokens_bans_the_ending_tokens_until_reached() -> None:
    """The stop token ids and EOS (unless `ignore_eos`) are -inf for the first `min_tokens` tokens, forced ones
    counted; the logprobs reported stay the model's."""
    logits = torch.tensor([0.0, 3.0, 2.0, 1.0, 0.5])
    s = Sampler(SamplingParams(min_tokens=3, stop_token_ids=[2], logprobs=0), eos_token_id=1)
    first = s(logits)
    assert first[0] == 3 and first[1] == pytest.approx(float(torch.log_softmax(logits, -1)[3]))
    assert s.forced(logits, 4)[0] == 4 and s(logits)[0] == 3 and s(logits)[0] == 1  # the ban is over
    free = Sampler(SamplingParams(min_tokens=3, stop_token_ids=[2], ignore_eos=True), eos_token_id=1)
    assert free(logits)[0] == 1  # EOS does not end this request: not banned
    assert Sampler(SamplingParams(min_tokens=3, stop_token_ids=[9]), eos_token_id=1)(logits)[0] == 2  # beyond V


class _Allowing(CompiledGrammar):
    """A grammar whose parser allows the same tokens at every position (no llguidance)."""

    def __init__(self, allowed: list[int], vocab: int) -> None:
        self.mask = np.isin(np.arange(vocab), allowed)

    def start(self):
        mask = self.mask
        return type("Parser", (), {"allowed": lambda self: mask, "advance": lambda self, token: None})()


def test_min_tokens_yields_to_a_grammar_that_must_end() -> None:
    """Under a grammar the ban applies within what it allows; where it allows only the banned EOS, EOS is drawn
    (the grammar is complete), not a token it forbids."""
    logits = torch.tensor([0.0, 3.0, 2.0, 1.0, 0.5])
    for allowed, want in (([1, 3], 3), ([1], 1)):
        p = SamplingParams(min_tokens=3, grammar=_Allowing(allowed, 5))
        assert Sampler(p, eos_token_id=1)(logits)[0] == want, allowed


def test_stop_accepts_a_single_string() -> None:
    assert SamplingParams(stop="###").stop == ["###"]


def test_from_kwargs_aliases_and_unknown_names() -> None:
    p = SamplingParams.from_kwargs(temp=0.7, max_new_tokens=5)
    assert (p.temperature, p.max_tokens) == (0.7, 5)
    assert SamplingParams.from_kwargs(max_completion_tokens=9).max_tokens == 9
    with pytest.raises(SamplingError, match="tempurature"):
        SamplingParams.from_kwargs(tempurature=1.0)


# --- processors against hand-computed cases ----------------------------------------------------------------


def test_top_k() -> None:
    assert kept(apply_top_k(LOGP, 2)) == [0, 1]
    assert kept(apply_top_k(LOGP, 0)) == [0, 1, 2, 3]
    assert kept(apply_top_k(LOGP, 10)) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "p,expect", [(0.4, [0]), (0.5, [0]), (0.7, [0, 1]), (0.8, [0, 1]), (0.81, [0, 1, 2]), (1.0, [0, 1, 2, 3])]
)
def test_top_p_keeps_the_smallest_set_reaching_p(p: float, expect: list[int]) -> None:
    assert kept(apply_top_p(LOGP, p)) == expect


def test_top_p_works_on_unsorted_logits() -> None:
    perm = torch.tensor([2, 0, 3, 1])
    assert kept(apply_top_p(LOGP[perm], 0.7)) == [1, 3]


@pytest.mark.parametrize("min_p,expect", [(0.0, [0, 1, 2, 3]), (0.2, [0, 1, 2]), (0.5, [0, 1]), (1.0, [0])])
def test_min_p_is_relative_to_the_top_token(min_p: float, expect: list[int]) -> None:
    assert kept(apply_min_p(LOGP, min_p)) == expect


def test_temperature_sharpens_before_truncation() -> None:
    # at temperature 0.5 the probabilities become 25:9:2.25:0.25 (/36.5); top-p 0.9 then keeps two tokens
    x = processed_logits(LOGP, SamplingParams(temperature=0.5, top_p=0.9))
    assert kept(x) == [0, 1]
    probs = torch.softmax(x, -1)
    assert probs[0].item() == pytest.approx(25 / 34, abs=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-20, 20), min_size=2, max_size=40),
    st.floats(0.05, 2.0),
    st.integers(0, 5),
    st.floats(0.05, 1.0),
    st.floats(0.0, 1.0),
)
def test_processors_never_remove_the_most_likely_token(vals, temp, k, p, mp) -> None:
    logits = torch.tensor(vals)
    x = processed_logits(logits, SamplingParams(temperature=temp, top_k=k, top_p=p, min_p=mp))
    best = logits == logits.max()  # under ties any of the maximal tokens may be the one kept
    assert bool((x[best] != float("-inf")).any())


# --- Sampler ------------------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_reports_raw_logprobs() -> None:
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    tok, lp, top = Sampler(SamplingParams(logprobs=2))(logits)
    assert tok == 1
    assert lp == pytest.approx(float(torch.log_softmax(logits, -1)[1]))
    assert [t for t, _ in top] == [1, 3] and top[0][1] >= top[1][1]
    assert Sampler(SamplingParams(temperature=5.0, top_k=1))(logits)[0] == 1  # top_k 1 is greedy too


def test_a_temperature_so_small_the_logits_overflow_samples_the_argmax() -> None:
    """logits / 1e-300 overflow float32 to +-inf, and softmax of them is NaN: torch's multinomial failed with
    'probability tensor contains either inf, nan or element < 0'. The limit of a vanishing temperature is the
    argmax, which it draws now; a temperature the division survives is unchanged."""
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9, float("-inf")])
    for seed in range(5):
        assert Sampler(SamplingParams(temperature=1e-300, seed=seed))(logits)[0] == 1
    assert torch.equal(
        processed_logits(-logits.abs(), SamplingParams(temperature=1e-300)).isfinite(), torch.arange(5) == 0
    )  # all negative: they overflow to -inf, the largest is kept
    t = SamplingParams(temperature=1e-3)
    assert torch.equal(processed_logits(logits, t), logits.float() / 1e-3)


def test_logprobs_ignore_temperature() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0])
    _, lp, _ = Sampler(SamplingParams(temperature=0.3, seed=0, top_k=1, logprobs=0))(logits)
    assert lp == pytest.approx(float(torch.log_softmax(logits, -1)[2]))


def test_seed_reproduces_and_different_seeds_differ() -> None:
    logits = torch.zeros(1000)

    def draw(seed: int | None) -> list[int]:
        s = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [s(logits)[0] for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    assert draw(None) != draw(None)  # unseeded generations do not share a stream


def test_sampled_frequencies_follow_the_distribution() -> None:
    s = Sampler(SamplingParams(temperature=1.0, seed=1))
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    n = 3000
    counts = [0, 0, 0]
    for _ in range(n):
        counts[s(logits)[0]] += 1
    for c, p in zip(counts, (0.7, 0.2, 0.1)):
        assert abs(c / n - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_truncated_tokens_are_never_drawn() -> None:
    s = Sampler(SamplingParams(temperature=1.5, top_k=2, seed=3))
    logits = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6])
    assert {s(logits)[0] for _ in range(300)} == {0, 1}


def test_logit_bias_moves_the_draw_not_the_reported_logprobs() -> None:
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    raw = torch.log_softmax(logits, -1)
    tok, lp, top = Sampler(SamplingParams(logprobs=2, logit_bias={1: -100.0}))(logits)
    assert tok == 3 and lp == pytest.approx(float(raw[3]))  # the argmax banned: the next one, at the model's logprob
    assert [t for t, _ in top] == [1, 3]  # the alternatives are the model's too
    assert Sampler(SamplingParams(logit_bias={2: 100.0}))(logits)[0] == 2
    sampled = Sampler(SamplingParams(temperature=1.0, seed=0, logit_bias={0: -100.0, 1: -100.0, 3: -100.0}))
    assert {sampled(logits)[0] for _ in range(50)} == {2}
    assert logits.tolist() == pytest.approx([0.1, 3.0, -1.0, 2.9])  # the caller's logits are left alone
    with pytest.raises(SamplingError, match="logit_bias"):
        Sampler(SamplingParams(logit_bias={4: 1.0}))(logits)


def test_penalties_follow_the_openai_and_vllm_formulas() -> None:
    """presence/frequency: `logit[j] -= count[j] * frequency + (count[j] > 0) * presence` over the generated tokens;
    repetition r over the prompt's and the generated tokens: positive logits divided by r, the others multiplied."""
    logits = torch.tensor([2.0, 1.9, 0.5, -1.0])
    adj = LogitAdjust([1], logit_bias={3: 1.0}, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.0)
    for token in (0, 0, 2):
        adj.observe(token)
    assert adj.apply(logits).tolist() == pytest.approx([2.0 - 0.5 - 0.5, 1.9, 0.5 - 0.25 - 0.5, -1.0 + 1.0])
    rep = LogitAdjust([2, 3], logit_bias={}, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=2.0)
    rep.observe(0)
    assert rep.apply(logits).tolist() == pytest.approx([1.0, 1.9, 0.25, -2.0])
    assert logits.tolist() == pytest.approx([2.0, 1.9, 0.5, -1.0])

    def greedy(**kw) -> list[int]:
        s = Sampler(SamplingParams(logprobs=0, **kw))
        out = [s(logits) for _ in range(4)]
        assert [lp for _, lp, _ in out] == pytest.approx([float(torch.log_softmax(logits, -1)[t]) for t, _, _ in out])
        return [t for t, _, _ in out]

    assert greedy() == [0, 0, 0, 0]
    assert greedy(frequency_penalty=0.2) == [0, 1, 0, 1]  # the penalty grows with each repeat
    assert greedy(presence_penalty=0.2) == [0, 1, 0, 0]  # ... or once, whatever the count
    assert greedy(repetition_penalty=1.5) == [0, 1, 0, 0]  # 2/1.5 < 1.9, then both seen: 1.33 > 1.27
    forced = Sampler(SamplingParams(presence_penalty=0.2))
    forced.forced(logits, 0)  # a forced token (a thinking budget's) counts as well
    assert forced(logits)[0] == 1
    assert not SamplingParams().adjusts_logits and SamplingParams(repetition_penalty=1.1).adjusts_logits


def test_argmax_is_torchs_first_largest_value():
    """The greedy pick (numpy's argmax on CPU float32) equals torch.argmax: first of equal maxima, NaN counts as
    largest, other dtypes and shapes of one position."""
    from fastar.engine.sampling import argmax

    g = torch.Generator().manual_seed(0)
    cases = [
        torch.randn(129280, generator=g),
        torch.randn(1, 3000, generator=g),
        torch.zeros(7),
        torch.tensor([1.0, 5.0, 5.0, 2.0]),
        torch.tensor([1.0, float("nan"), 9.0, float("nan")]),
        torch.tensor([-float("inf"), float("inf"), 3.0]),
        torch.randn(50, generator=g).to(torch.bfloat16),
        torch.randn(10, generator=g).double(),
    ]
    for x in cases:
        assert argmax(x) == int(torch.argmax(x))
    x = torch.randn(4, 6, generator=g)[:, 2]  # a strided view
    assert argmax(x) == int(torch.argmax(x))
