"""Thinking budgets: the per-request hook that ends a reply's reasoning after a number of tokens.

Owns `ThinkingBudget`. A request with `SamplingParams.thinking_budget` N (its prompt ending in thinking mode's
`<think>`) samples freely until the model closes its reasoning with `</think>`; if it has not after N tokens, the
next token is `</think>`, put there instead of sampled (its logprob is still the model's own), and the answer
follows as the model continues. A forced token is just a token appended to that request's row: the batch, the
other rows, prefix reuse and stop handling see an ordinary token, so batch invariance holds. No random number is
drawn for it, in the scheduler and in `generate_step` alike, so a request gives the same tokens on either path.

Does not own: where budgets come from (the server maps Anthropic's `thinking.budget_tokens` and OpenAI's
`reasoning_effort`, `fastar.serve.thinking_mode`), sampling itself (`sampling.Sampler`).
"""

from __future__ import annotations

import torch

from ..encoding import THINK_END
from ..errors import FastarError
from .sampling import Sampler, SamplingParams


class ThinkingBudget:
    """Counts a reply's thinking tokens and says when `</think>` must come next."""

    def __init__(self, budget: int, end_id: int) -> None:
        self.left, self.end_id, self.open = budget, end_id, True

    @classmethod
    def of(cls, params: SamplingParams, tokenizer) -> ThinkingBudget | None:
        """The budget of a request (None when it has none)."""
        if params.thinking_budget is None:
            return None
        end = tokenizer.token_to_id(THINK_END)
        if end is None:
            raise FastarError(f"this tokenizer has no {THINK_END} token, which a thinking budget ends with")
        return cls(params.thinking_budget, end)

    def forced(self) -> int | None:
        """The token that must come next (`</think>` once the budget is spent while thinking), else None."""
        return self.end_id if self.open and self.left <= 0 else None

    def observe(self, token: int) -> None:
        if self.open:
            if token == self.end_id:
                self.open = False
            else:
                self.left -= 1

    def next_token(self, sampler: Sampler, logits: torch.Tensor) -> tuple[int, float, list[tuple[int, float]]]:
        """`sampler(logits)`, or the forced token with its logprob and top logprobs; counted either way."""
        forced = self.forced()
        out = sampler(logits) if forced is None else sampler.forced(logits, forced)
        self.observe(out[0])
        return out


def next_token(
    budget: ThinkingBudget | None, sampler: Sampler, logits: torch.Tensor
) -> tuple[int, float, list[tuple[int, float]]]:
    """The next token of a request with or without a budget."""
    return sampler(logits) if budget is None else budget.next_token(sampler, logits)
