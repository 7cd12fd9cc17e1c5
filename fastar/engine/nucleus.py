"""The top-p nucleus found among the largest probabilities, not by a sort of the whole vocabulary.

`sampling.apply_top_p` defines the nucleus: the smallest set of most likely tokens whose probability reaches p
(the tokens in descending order of their logits, their probabilities' running sum in float64, the token that
crosses p kept). On the 129,280-entry vocabulary its `torch.sort` takes 10-20 ms of one core, a decode step's worth
on small models, for every token of a request with top_p < 1. A nucleus that reaches p lies among the largest
logits, and every token outside the set of all those of probability >= t comes after them in that order (a smaller
probability has a smaller logit); so `top_p` takes the 64 largest logits (`torch.topk`, ~0.5 ms) and, where they
hold less than p, every token of probability at least the smallest of theirs / 64 (sorted alone), and so on down to
the whole vocabulary. The order is the logits', not the probabilities': two probabilities can round to the same
value where the logits differ. Among tokens of equal logits at the nucleus's edge either may be the one kept, as
with the sort (which is not stable).

Owns: `top_p`. Does not own: the other processors and the draw (`fastar.engine.sampling`).
"""

from __future__ import annotations

import torch

FIRST_K = 64  # the first candidates: the largest probabilities
THRESHOLD_STEP = 64.0  # then every token of probability >= the smallest candidate's / 64, again while they fall short


def top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """`sampling.apply_top_p(logits, p)`: logits [V] float32 with -inf outside the nucleus of p."""
    if p >= 1.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    # in the logits' order, as the reference: probabilities can tie (round to the same value) where logits do not
    idx = torch.topk(logits, min(FIRST_K, logits.numel())).indices  # descending
    top = probs[idx]
    t = float(top[-1])
    while True:
        before = top.double().cumsum(dim=-1) - top.double()  # the mass of the tokens before each, as the reference
        if float(before[-1]) >= p or len(top) == probs.numel():  # the nucleus lies among these (or they are all)
            out = torch.full_like(logits, float("-inf"))
            keep = idx[before < p]
            out[keep] = logits[keep]
            return out
        # more candidates: every token of probability >= t (all below it come after them in any sorted order)
        t = t / THRESHOLD_STEP if t > 0 else 0.0
        idx = torch.nonzero(probs >= t).reshape(-1) if t > 0 else torch.arange(probs.numel())
        idx = idx[torch.sort(logits[idx], descending=True).indices]
        top = probs[idx]
