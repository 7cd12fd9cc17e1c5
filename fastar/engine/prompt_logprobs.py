"""Prompt logprobs: the log-probability the model gives each prompt token after the tokens before it.

Owns:
  * `PromptLogprobs`: one entry per prompt token (None for the first, which nothing predicts): its logprob, its
    rank in the vocabulary (1 = the most likely) and the top-N alternatives;
  * `PromptScorer`: fed the final residual streams of each prefill forward in order (`DeepseekV4.forward` returns
    them beside the logits), it applies the LM head `HEAD_ROWS` positions at a time and reduces each piece at once
    to what was asked (the target's logprob and rank, the top-N; optionally the full log-softmax rows to a sink,
    for `fastar.engine.perplexity`), so a long prompt never holds prompt x vocab floats;
  * `score_prompt(engine, ids, top)`, behind `Engine.prompt_logprobs`: a fresh state, the prompt prefilled in the
    engine's spans, every position scored.
Does not own: the forward pass and the head (`fastar.model`), when a served request prefills (`scheduler`, which
feeds a `PromptScorer` from its own prefill chunks), the API shapes (`fastar.serve`).

Numbers: a logprob is log_softmax of the float32 logits, as `sampling.Sampler` computes a generated token's. The
head's rows do not depend on how many rows a call holds beyond `ops.SMALL_CHUNK` (the C kernels' product of more
rows is row-invariant), so pieces keep more than that many rows where they can, and the numbers are those of
`Engine.logits` on the same prompt; the scheduler's prefill (chunks of `prefill_chunk`, or spans) gives the same
numbers as `score_prompt`, because a span computes what its chunks one by one compute.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..model import ops
from .session import PromptError, token_ids

HEAD_ROWS = 64  # positions per LM-head call: [64, 129280] float32 is 33 MB


@dataclass(slots=True)
class PromptLogprobs:
    """Per prompt token i: `logprobs[i]` = log p(token_ids[i] | token_ids[:i]), `ranks[i]` its rank (1 = the most
    likely token), `top[i]` the `num_top` most likely (token id, logprob) pairs at that position; entry 0 is None
    (and []), since nothing predicts the first token."""

    token_ids: list[int]
    logprobs: list[float | None]
    ranks: list[int | None]
    top: list[list[tuple[int, float]]]
    num_top: int = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def total(self) -> float:
        """The sum of the logprobs of tokens 1.. (the prompt's log-likelihood after its first token)."""
        return float(sum(lp for lp in self.logprobs[1:]))


def _pieces(a: int, b: int, rows: int) -> list[tuple[int, int]]:
    """[a, b) in pieces of `rows`, a last piece of at most `ops.SMALL_CHUNK` rows merged into the one before."""
    cuts = list(range(a, b, rows)) + [b]
    if len(cuts) > 2 and cuts[-1] - cuts[-2] <= ops.SMALL_CHUNK:
        del cuts[-2]
    return list(itertools.pairwise(cuts))


class PromptScorer:
    """Scores the prompt `ids` from the final streams of its prefill, fed in order (`feed`).

    Args:
        model: the `DeepseekV4` whose `head_logits` turns streams into logits.
        ids: the prompt's token ids (the position p's logits score ids[p + 1]).
        top: alternatives kept per position (0: none).
        first: the first token to score (default 1: all but the first); earlier positions' heads are skipped.
        on_rows: called as (first target index, logprobs [P, V] float32) with each piece's full log-softmax rows
            (the rows for targets first..first+P-1), before they are dropped.
    """

    def __init__(
        self,
        model,
        ids: list[int],
        top: int = 0,
        first: int = 1,
        on_rows: Callable[[int, torch.Tensor], None] | None = None,
    ) -> None:
        if top < 0:
            raise ValueError(f"top must be >= 0, got {top}")
        n = len(ids)
        self.model, self.ids, self.top, self.first, self.on_rows = model, list(ids), top, max(1, first), on_rows
        self.done = 0  # positions fed so far
        self.targets = torch.tensor(self.ids, dtype=torch.long)  # [n]
        self.logprobs = np.full(n, np.nan, dtype=np.float32)  # [n]; NaN where not scored
        self.ranks = np.zeros(n, dtype=np.int64)  # [n]; 0 where not scored
        self.top_ids = np.zeros((n, top), dtype=np.int64)  # [n, top]
        self.top_logprobs = np.zeros((n, top), dtype=np.float32)  # [n, top]

    @torch.inference_mode()
    def feed(self, X: torch.Tensor) -> None:
        """The final streams X [T, n, d] of positions done..done+T-1 (a prefill forward's second output)."""
        p0, T = self.done, X.shape[0]
        self.done += T
        a, b = max(p0, self.first - 1), min(p0 + T, len(self.ids) - 1)  # positions whose targets are scored
        if a >= b:
            return
        for s, e in _pieces(a, b, HEAD_ROWS):
            logp = torch.log_softmax(self.model.head_logits(X[s - p0 : e - p0]), dim=-1)  # [P, V]
            tgt = self.targets[s + 1 : e + 1]  # [P]
            lp = logp.gather(1, tgt[:, None])  # [P, 1]
            self.logprobs[s + 1 : e + 1] = lp[:, 0].numpy()
            self.ranks[s + 1 : e + 1] = ((logp > lp).sum(dim=1) + 1).numpy()
            if self.top:
                vals, idx = torch.topk(logp, self.top, dim=-1)  # [P, top]
                self.top_ids[s + 1 : e + 1] = idx.numpy()
                self.top_logprobs[s + 1 : e + 1] = vals.numpy()
            if self.on_rows is not None:
                self.on_rows(s + 1, logp)

    def result(self) -> PromptLogprobs:
        """The scores so far as a `PromptLogprobs` (None where a token was not scored)."""
        n = len(self.ids)
        scored = ~np.isnan(self.logprobs)
        return PromptLogprobs(
            token_ids=list(self.ids),
            logprobs=[float(self.logprobs[i]) if scored[i] else None for i in range(n)],
            ranks=[int(self.ranks[i]) if scored[i] else None for i in range(n)],
            top=[
                list(zip(self.top_ids[i].tolist(), self.top_logprobs[i].tolist())) if scored[i] else []
                for i in range(n)
            ],
            num_top=self.top,
        )


def check_prompt(engine, ids: list[int], reply: bool = False) -> None:
    """What a prompt run from a fresh state must be: non-empty, within the context (all of it to score it, or
    `Engine.logits`; shorter, with `reply`, to leave room for one: `Engine.generate_tokens`, as a session's
    prompt), ids in the vocabulary. Raises `PromptError`."""
    if not ids:
        raise PromptError("the prompt is empty")
    if len(ids) > engine.context_length - reply:
        note = f"; {engine.context_note}" if engine.context_note else ""
        room = " (it must be shorter, to leave room for the reply)" if reply else ""
        raise PromptError(
            f"the prompt is {len(ids)} tokens, but the context length is {engine.context_length} tokens{room}{note}"
        )
    v = engine.config.vocab_size
    bad = next((t for t in ids if not 0 <= t < v), None)
    if bad is not None:
        raise PromptError(f"token id {bad} is outside the vocabulary [0, {v})")


def run_prefill(engine, ids: list[int], scorer: PromptScorer, on_progress: Callable[[int], None] | None = None):
    """Prefill `ids` on a fresh state in the engine's spans (`Engine.prefill`'s forwards), feeding each span's
    final streams to `scorer`; returns the state. `on_progress(done)` after each span."""
    model, span = engine.model, engine.prefill_span
    state = model.new_state()
    for a in range(0, len(ids), span):
        _, X = model.forward(ids[a : a + span], state, all_logits=False, chunk=engine.paged_chunk)
        scorer.feed(X)
        if on_progress is not None:
            on_progress(a + X.shape[0])
    return state


def score_prompt(engine, prompt: str | list[int], top: int = 0) -> PromptLogprobs:
    """`Engine.prompt_logprobs`: every prompt token's logprob, rank and top-`top` alternatives."""
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else token_ids(prompt)
    check_prompt(engine, ids)
    vocab = engine.config.vocab_size
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= vocab:
        raise ValueError(f"top must be an integer in [0, {vocab}] (the vocabulary), got {top!r}")
    scorer = PromptScorer(engine.model, ids, top)
    run_prefill(engine, ids, scorer)
    return scorer.result()
