"""What one request adds to the model's logits before they are sampled: OpenAI's `logit_bias` and its
`presence_penalty` / `frequency_penalty`, and vLLM's `repetition_penalty`.

Owns `LogitAdjust`, built per request by its `Sampler` (only when something is asked: a plain request does no
work) and told each token the request emits (`observe`). `apply(logits)` returns a new tensor, in this order:

  * the repetition penalty r (vLLM's, over the prompt's and the generated tokens): a seen token's logit is
    divided by r where it is positive and multiplied by r where it is not;
  * the presence and frequency penalties (OpenAI's, over the generated tokens only):
    `logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty`;
  * the bias: `logit[j] += logit_bias[j]`.

Does not own: the grammar mask, temperature, truncation and the draw (`fastar.engine.sampling.Sampler`, which
applies this first), the reported logprobs (the model's own, unadjusted). Drafting verifies against the unadjusted
logits, so an adjusted request is never drafted (`SamplingParams.adjusts_logits`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class LogitAdjust:
    def __init__(
        self,
        prompt_ids: Sequence[int] = (),
        *,
        logit_bias: dict[int, float],
        presence_penalty: float,
        frequency_penalty: float,
        repetition_penalty: float,
    ) -> None:
        bias = logit_bias
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long) if bias else None
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32) if bias else None
        self.presence, self.frequency, self.repetition = presence_penalty, frequency_penalty, repetition_penalty
        self.prompt_ids = list(prompt_ids) if self.repetition != 1.0 else []
        self.counts: torch.Tensor | None = None  # [V] float32 counts of the generated tokens, from the first call
        self.seen: torch.Tensor | None = None  # [V] bool: in the prompt or generated (the repetition penalty)
        self.generated: list[int] = []  # tokens observed before the first call knew the vocabulary's size

    @property
    def largest_bias_id(self) -> int:
        return -1 if self.bias_ids is None else int(self.bias_ids.max())

    def observe(self, token: int) -> None:
        """A token the request emitted (sampled or forced): it counts for the penalties from the next position."""
        if self.counts is None:
            self.generated.append(token)
            return
        self.counts[token] += 1
        self.seen[token] = True

    def _tables(self, vocab: int) -> None:
        self.counts = torch.zeros(vocab, dtype=torch.float32)
        self.seen = torch.zeros(vocab, dtype=torch.bool)
        self.seen[torch.tensor(self.prompt_ids, dtype=torch.long)] = True
        for token in self.generated:
            self.observe(token)
        self.generated = []

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] float32 adjusted, as a new tensor (the caller's stays the model's)."""
        if self.counts is None:
            self._tables(logits.numel())
        x = logits
        if self.repetition != 1.0:
            x = torch.where(self.seen, torch.where(x > 0, x / self.repetition, x * self.repetition), x)
        if self.presence or self.frequency:
            x = x - self.counts * self.frequency - (self.counts > 0).float() * self.presence
        if self.bias_ids is not None:
            x = x.index_add(0, self.bias_ids, self.bias_values)
        return x
