"""The draw of a token from a distribution over the vocabulary: an exponential race over the tokens it allows.

A token drawn with probability p_i / sum p is the argmax of p_i / E_i over independent E_i ~ Exp(1) (what
`torch.multinomial(probs, 1)` computes too). `torch.multinomial` draws its exponentials for every entry, one by one
from the generator: ~4 ms of one core a token on the 129,280-entry vocabulary, whatever a top-k or top-p left.
`draw` races only the tokens of nonzero probability (a top-p nucleus: tens; temperature alone: all), with
E_i = -log(u_i + 2^-54) from one float64 uniform each (`torch.rand`, ~0.5 ms for the whole vocabulary): never 0 or
infinite, so a token of probability 0 never wins. Like any race it is robust to rounding in the probabilities: a
token changes only where two tokens' p / E lie within that rounding of each other, so the same seed gives the same
tokens where logits differ in their last bits (a prefix from the cache against a fresh prefill). The tokens are not
those `torch.multinomial` gave for a seed.

Owns: `draw`. Does not own: the distribution (`fastar.engine.sampling.processed_logits`) or the generator.
"""

from __future__ import annotations

import torch

HALF_ULP = 2.0**-54  # half the spacing of torch.rand's float64 values: u + HALF_ULP lies in (0, 1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn from `probs` [V] (non-negative, not necessarily normalised, at least one > 0) with uniforms
    from `generator` (None: torch's global one), one per token of nonzero probability."""
    p = probs.detach().reshape(-1).float().cpu()
    idx = torch.nonzero(p > 0).reshape(-1)
    if len(idx) == 1:
        return int(idx[0])  # no race to run: no uniform drawn
    u = torch.rand(len(idx), generator=generator, dtype=torch.float64)
    e = torch.log(u + HALF_ULP).neg_()
    return int(idx[int(torch.argmax(p[idx].double() / e))])
