"""The draw of a token from a distribution over the vocabulary: an exponential race, in numpy.

A token drawn with probability p_i / sum p is the argmax of p_i / E_i over independent E_i ~ Exp(1), which is what
`torch.multinomial(probs, 1)` computes, drawing its exponentials one by one from the generator (~2.7-4 ms of one
core a token on the 129,280-entry vocabulary). `draw` takes one float64 uniform u_i per entry from the same
generator (`torch.rand`, ~0.5 ms) and races E_i = -log(u_i + 2^-54) (never 0 or infinite) in numpy's vectorized
log, division and argmax (~0.3 ms): a token of probability 0 scores 0 and never wins. Each entry keeps its own
uniform whatever the others' probabilities, so like any race it is robust to rounding: the token changes only
where two tokens' p / E lie within that rounding of each other, and the same seed gives the same tokens where the
logits differ a little (a prefix from the cache against a fresh prefill, computed by other kernels). The tokens
are not those `torch.multinomial` gave for a seed.

Owns: `draw`. Does not own: the distribution (`fastar.engine.sampling.processed_logits`) or the generator.
"""

from __future__ import annotations

import numpy as np
import torch

HALF_ULP = 2.0**-54  # half the spacing of torch.rand's float64 values: u + HALF_ULP lies in (0, 1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn from `probs` [V] (non-negative, not necessarily normalised, some > 0) with V uniforms from
    `generator` (None: torch's global one). Raises ValueError for a distribution with no finite positive mass."""
    p = probs.detach().reshape(-1).float().cpu().contiguous().numpy()
    u = torch.rand(len(p), generator=generator, dtype=torch.float64).numpy()
    score = p / -np.log(u + HALF_ULP)
    i = int(np.argmax(score))  # a NaN, if any, is numpy's largest: score[i] is then NaN
    if not (np.isfinite(score[i]) and score[i] > 0):
        raise ValueError("the distribution to draw a token from has no finite positive mass")
    return i
