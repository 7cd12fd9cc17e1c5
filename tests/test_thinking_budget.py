"""The thinking-budget hook (fastar.engine.thinking_budget) on hand-made logits: `</think>` is forced once the
budget is spent and the model has not closed its thinking, with the model's own logprob, no random number drawn
for it; a model that closes its thinking in time is never forced."""

from __future__ import annotations

import torch

from fastar.engine.sampling import Sampler, SamplingParams
from fastar.engine.thinking_budget import ThinkingBudget, next_token

END = 7


def logits_favouring(token: int, v: int = 10) -> torch.Tensor:
    x = torch.linspace(0.0, 1.0, v)
    x[token] = 5.0
    return x


def test_end_of_thinking_is_forced_when_the_budget_is_spent():
    params = SamplingParams(max_tokens=10, logprobs=2)
    sampler, budget = Sampler(params), ThinkingBudget(2, END)
    out = [next_token(budget, sampler, logits_favouring(3)) for _ in range(5)]
    assert [t for t, _, _ in out] == [3, 3, END, 3, 3]
    logp = torch.log_softmax(logits_favouring(3), dim=-1)
    assert out[2][1] == float(logp[END])  # the model's own logprob of the forced token
    assert [i for i, _ in out[2][2]] == [3, 9]  # and its top logprobs, as for a sampled token
    assert next_token(None, sampler, logits_favouring(3))[0] == 3  # no budget: plain sampling


def test_a_model_that_closes_its_thinking_in_time_is_not_forced():
    sampler, budget = Sampler(SamplingParams()), ThinkingBudget(3, END)
    picks = [3, END, 4, 4, 4, 4]
    assert [next_token(budget, sampler, logits_favouring(t))[0] for t in picks] == picks
    assert not budget.open and budget.forced() is None
    zero = ThinkingBudget(0, END)
    assert next_token(zero, sampler, logits_favouring(3))[0] == END  # budget 0: no thinking at all


def test_a_forced_token_draws_no_random_number():
    """Sampled with a seed: the tokens after the forced one are the draws a budget-free run makes at its steps,
    one step earlier (the forced step took none), so a request gives the same tokens on every path."""
    params = SamplingParams(temperature=1.0, seed=5)
    flat = torch.zeros(10)
    flat[END] = -30.0  # the model itself never ends its thinking
    free = Sampler(params)
    plain = [free(flat)[0] for _ in range(6)]
    sampler, budget = Sampler(params), ThinkingBudget(3, END)
    forced = [next_token(budget, sampler, flat)[0] for _ in range(7)]
    assert forced == plain[:3] + [END] + plain[3:]
