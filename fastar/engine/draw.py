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

The sampler draws its tokens from logits, as the same race in the log domain (`race`): the argmax of x_i + g_i,
x the processed logits (float32, -inf where a token may not be drawn) and g_i = -log(E_i) with E_i from the same
uniforms (`gumbel`, one per entry; Gumbel noise): p_i / E_i and x_i + g_i order the tokens alike, and the
distribution is softmax(x). Each score depends on its own logit and its own noise alone, and the noise can be drawn
before the logits exist: the LM head screen (`fastar.model.head_screen.Race`) computes the exact logits of only the
rows that can win, and the token is the full head's.

Owns: `draw`, `gumbel`, `race`. Does not own: the distribution (`fastar.engine.sampling.processed_logits`) or the
generator.
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


def gumbel(n: int, generator: torch.Generator | None) -> np.ndarray:
    """Gumbel noise float64 [n] from n uniforms of `generator` (as `draw` takes them): g = -log(-log(u + 2^-54)),
    finite (-3.6 to 37.4)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64).numpy()
    return -np.log(-np.log(u + HALF_ULP))


def race(logits: torch.Tensor | np.ndarray, noise: np.ndarray) -> int:
    """The token whose score fl64(logit) + noise is the largest (the first such), logits [V] float32 with -inf where a
    token may not be drawn, noise `gumbel`'s [V]: a draw from softmax(logits). Raises ValueError where no score is
    finite (no token may be drawn) or a logit is NaN."""
    x = logits.detach().reshape(-1).float().cpu().numpy() if isinstance(logits, torch.Tensor) else logits.reshape(-1)
    if x.shape != noise.shape:
        raise ValueError(f"{x.shape[0]} logits against {noise.shape[0]} noise values")
    score = x.astype(np.float64) + noise
    i = int(np.argmax(score))  # a NaN, if any, is numpy's largest: score[i] is then NaN
    if not np.isfinite(score[i]):
        raise ValueError("the distribution to draw a token from has no finite positive mass")
    return i
