"""Perplexity over sliding windows, and the token-by-token comparison of two runs (docs/PERPLEXITY.md).

Owns:
  * `windows(n, ctx, stride)`: the windows a text of n tokens is scored in. Window k covers tokens
    [k * stride, k * stride + ctx) (the last one ends at the text's end) and scores only the tokens no earlier
    window scored, each from the logits of the token before it; so with stride <= ctx - 1 every token but the
    first is scored exactly once, with at least ctx - stride tokens of context after the first window;
  * `perplexity(engine, ids, ...)` -> `Perplexity`: each window prefilled from a fresh state and scored by a
    `PromptScorer` (the LM head a few positions at a time); optionally each scored position's full distribution
    saved (`LogitsWriter`) or compared with a saved run's (`Divergence`);
  * `Perplexity` (the scored tokens' logprobs, PPL, its standard error, timings) and `Divergence` (KL divergence
    per token, top-1 agreement, the largest change of a scored token's logprob).
Does not own: scoring positions (`prompt_logprobs`), the file layout (`logits_file`), reading text files and
printing (`fastar.evaluate`, the `fastar perplexity` command).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import FastarError
from .logits_file import LogitsFile, LogitsWriter
from .prompt_logprobs import PromptScorer, check_prompt, run_prefill
from .session import PromptError

PERCENTILES = (50, 90, 95, 99, 99.9)


def windows(n: int, ctx: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored token) of each window over n tokens; see the module docstring."""
    if ctx < 2 or not 1 <= stride <= ctx:
        raise ValueError(f"need ctx >= 2 and 1 <= stride <= ctx (got ctx {ctx}, stride {stride})")
    out, begin, scored_to = [], 0, 1
    while True:
        end = min(begin + ctx, n)
        first = max(begin + 1, scored_to)
        if first < end:
            out.append((begin, end, first))
        scored_to = max(scored_to, end)
        if end >= n:
            return out
        begin += stride


@dataclass
class Divergence:
    """One run against a saved base run, token by token (the base's distribution is P, this run's Q)."""

    kl: list[float] = field(default_factory=list)  # KL(P || Q) of each scored token, nats
    same_top: int = 0  # tokens whose most likely entry is the same in both
    max_delta: float = 0.0  # largest |log Q(token) - log P(token)| of a scored token
    base_nll: float = 0.0  # the base run's summed negative logprob of the scored tokens

    def add(self, base_rows: np.ndarray, rows16: np.ndarray, base_targets: np.ndarray, targets: np.ndarray) -> None:
        """Rows [P, V] of both runs, float16 log-softmax as saved; targets [P] float32 as computed."""
        p = torch.from_numpy(np.asarray(base_rows, dtype=np.float64))
        q = torch.from_numpy(rows16.astype(np.float64))
        p, q = p - torch.logsumexp(p, -1, keepdim=True), q - torch.logsumexp(q, -1, keepdim=True)  # renormalized
        prob = p.exp()
        kl = torch.where(prob > 0, prob * (p - q), torch.zeros_like(p)).sum(-1).clamp_min(0.0)  # [P]
        self.kl.extend(kl.tolist())
        self.same_top += int((p.argmax(-1) == q.argmax(-1)).sum())
        delta = np.abs(targets.astype(np.float64) - np.asarray(base_targets, dtype=np.float64))
        self.max_delta = max(self.max_delta, float(delta.max(initial=0.0)))
        self.base_nll -= float(np.asarray(base_targets, dtype=np.float64).sum())

    def summary(self) -> dict:
        kl = np.asarray(self.kl, dtype=np.float64)
        n = kl.size
        out = {
            "tokens": n,
            "kl_mean": float(kl.mean()),
            "kl_mean_stderr": float(kl.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
            "kl_max": float(kl.max()),
            "top1_agreement": self.same_top / n,
            "max_abs_delta_logprob": self.max_delta,
            "base_ppl": math.exp(self.base_nll / n),
        }
        for q in PERCENTILES:
            out[f"kl_p{q:g}"] = float(np.percentile(kl, q))
        return out


@dataclass
class Perplexity:
    """A run's result: `logprobs` of the scored tokens (at `positions`), in order."""

    num_tokens: int
    ctx: int
    stride: int
    num_windows: int
    positions: list[int]
    logprobs: np.ndarray  # float32 [scored]
    seconds: float
    evaluated: int  # tokens run through the model (windows overlap)
    divergence: Divergence | None = None

    @property
    def nll(self) -> float:
        """Mean negative logprob of the scored tokens, nats per token."""
        return float(-self.logprobs.astype(np.float64).mean())

    @property
    def nll_stderr(self) -> float:
        n = self.logprobs.size
        return float(self.logprobs.astype(np.float64).std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    def summary(self) -> dict:
        out = {
            "tokens": self.num_tokens,
            "scored": int(self.logprobs.size),
            "ctx": self.ctx,
            "stride": self.stride,
            "windows": self.num_windows,
            "nll": self.nll,
            "nll_stderr": self.nll_stderr,
            "ppl": self.ppl,
            "ppl_stderr": self.ppl * self.nll_stderr,  # the delta method: d exp(x) = exp(x) dx
            "seconds": self.seconds,
            "evaluated_tokens": self.evaluated,
            "tokens_per_s": self.evaluated / self.seconds if self.seconds > 0 else 0.0,
        }
        if self.divergence is not None:
            out["kl_divergence"] = self.divergence.summary()
        return out


def perplexity(
    engine,
    ids: list[int],
    ctx: int,
    stride: int | None = None,
    save_logits: str | None = None,
    compare: str | None = None,
    on_window: Callable[[int, int, float], None] | None = None,
    meta: dict | None = None,
) -> Perplexity:
    """Perplexity of token ids `ids` in windows of `ctx` tokens moved by `stride` (default ctx // 2).

    Args:
        save_logits: write each scored position's log-softmax (float16) to this file (`logits_file`).
        compare: a file saved by an earlier run on the same tokens, windows and vocabulary: adds a `Divergence`.
        on_window: called after each window as (scored tokens so far, scored tokens in all, seconds so far).
        meta: extra header fields for the saved file (numerics, model).
    """
    stride = max(1, ctx // 2) if stride is None else stride
    spans = windows(len(ids), ctx, stride)
    if not spans:
        raise PromptError(f"nothing to score: the text is {len(ids)} token(s), it needs at least 2")
    for b, e, _ in spans[:1]:
        check_prompt(engine, ids[b:e])  # the longest window: ids, and the window against the context
    positions = [p for _, e, first in spans for p in range(first, e)]
    vocab = engine.config.vocab_size
    base = _open_base(compare, ids, positions, vocab, ctx, stride) if compare is not None else None
    writer = (
        LogitsWriter(save_logits, ids, positions, vocab, ctx=ctx, stride=stride, **(meta or {}))
        if save_logits
        else None
    )
    divergence = Divergence() if base is not None else None
    logprobs = np.zeros(len(positions), dtype=np.float32)
    done, evaluated, t0 = 0, 0, time.perf_counter()
    try:
        for b, e, first in spans:
            window = ids[b:e]

            def rows(target: int, logp: torch.Tensor, b=b, at=done, first=first) -> None:
                k = at + (target + b - first)  # this piece's first row among all scored positions
                rows16 = logp.numpy().astype(np.float16)  # [P, V]
                targets = logp.gather(1, torch.tensor(window[target : target + logp.shape[0]])[:, None])[:, 0]
                if writer is not None:
                    writer.add(rows16, targets.numpy())
                if divergence is not None:
                    P = logp.shape[0]
                    divergence.add(base.rows_at(k, P), rows16, base.targets[k : k + P], targets.numpy())

            scorer = PromptScorer(engine.model, window, first=first - b, on_rows=rows if writer or divergence else None)
            run_prefill(engine, window, scorer)
            logprobs[done : done + e - first] = scorer.logprobs[first - b :]
            done += e - first
            evaluated += e - b
            if on_window is not None:
                on_window(done, len(positions), time.perf_counter() - t0)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.close()
    return Perplexity(
        len(ids), ctx, stride, len(spans), positions, logprobs, time.perf_counter() - t0, evaluated, divergence
    )


def _open_base(path: str, ids: list[int], positions: list[int], vocab: int, ctx: int, stride: int) -> LogitsFile:
    base = LogitsFile(path)
    if base.header["vocab_size"] != vocab:
        raise FastarError(f"{path}: saved with a vocabulary of {base.header['vocab_size']}, this model has {vocab}")
    if len(base.ids) != len(ids) or not np.array_equal(base.ids, np.asarray(ids, dtype=np.int32)):
        raise FastarError(f"{path}: saved from other tokens (another text or tokenizer)")
    h = base.header
    if (h.get("ctx"), h.get("stride")) != (ctx, stride) or not np.array_equal(base.positions, np.asarray(positions)):
        raise FastarError(
            f"{path}: saved with other windows (ctx {h.get('ctx')}, stride {h.get('stride')}; this run's: ctx {ctx}, "
            f"stride {stride}): score with the same ctx and stride"
        )
    return base
