"""The LM head screened by an int8 copy of its rows, for decode steps that need only the argmax (greedy tokens).

The LM head is the largest weight a decode step reads (BF16 [129280, 4096] on Flash, 1.06 GB: half of a 4-layer
step's bytes and a large part of a batched step's arithmetic). A greedy token needs only the largest logit, so
`HeadScreen` keeps the rows also as int8 with a scale per row (half the bytes) and, for a row y of final normed
streams, bounds every logit from the int8 products and computes exactly, with the BF16 head's own kernel, only
the rows whose bound reaches the best lower bound. The other rows cannot hold the maximum: the token is the one
the full head gives, bit for bit, and so are the logits of the rows computed.

The bound, for row i of the head W (float values W_i, int8 q_i with scale s_i, dW_i = W_i - s_i q_i) and y
(x = y / s_x rounded to int8, dy = y - s_x x): the exact dot y.W_i differs from the int8 estimate
A_i = s_x s_i (x . q_i) by at most |dy| |W_i| + s_x |x| |dW_i| (Cauchy-Schwarz, |.| the 2-norm), and the kernel's
float32 logit differs from the exact dot by at most gamma_K |y| |W_i| (K fused multiply-adds in any order,
gamma_K = K u / (1 - K u), u = 2^-24). With b_i the sum of the three, a row whose A_i + b_i is below
max_j (A_j - b_j) has a logit strictly below the largest one. y is taken as two int8 terms (x1 and the rounding
error of x1 as x2), which makes |dy| negligible: the bound is then mostly the weights' own int8 error. The int8
dot products are exact (int32, `head_i8_dot`); the norms come in float64 and the bounds in float32
(`head_i8_select`), every term widened by a relative 1e-6, far more than their rounding.

The first term alone gives a bound too (its own |dy| and |x|), about twice as wide: on Flash-width weights it
leaves ~1.5 % of the rows open where both terms leave ~0.05 %. From `ONE_TERM_ROWS` decode rows, where the products
bind (two terms a row: 4-16 token rows over the 0.5 GB of int8 rows), `head_i8_screen` takes the first term over
the whole head and the second only for the rows the first leaves open, in the same pass while they are in L2: a
row is kept where both bounds reach the largest lower bound of either (the same rows whichever the threads computed
first). The argmax and every logit computed are the same; fewer rows may be computed than with `head_i8_select`.

A sampled row (temperature alone) is screened the same way (`Race`): its token is the argmax over i of the race
score fl64(fl32(l_i / t) + g_i), g_i the sampler's Gumbel noise drawn before the step (`fastar.engine.draw`). The
score is monotone in l_i, and t times it lies within l_i + o_i +- e_i, o_i = fl32(t g_i), e_i ~ 2^-24 (|l_i| +
|o_i|): every bound above shifted by the row's own o_i, its widening by (|estimate| + |o_i|) 1e-6, bounds t times
the score, so a row whose shifted upper bound is below the largest shifted lower bound cannot win the race. The
kernels take the offsets o [T, V] (zero for greedy rows: the same bits as none); the rows kept are exact, so the
race over the screened logits (-inf elsewhere) gives the full head's token, ties included (the first index: every
row tied with the winner is kept). A race among the top k (top-k sampling) is screened by the logits' own bounds
(no offsets): the 4k rows of largest upper bound are computed exactly, the k-th largest of their logits, L, is at
most the k-th largest logit, and every row whose upper bound reaches L (widened by `TOP_K_MARGIN` for the division's
rounding) is computed too: that holds every row the top-k keeps, so the k-th value, the rows kept and the race are
the full head's.

A row with banned tokens (`Ban`: the sampler sets them to -inf) is screened as without them; where one of them is
among the rows computed (it could be the argmax or win), that row takes the full head, else the rows computed hold
every row that can win over the tokens not banned (a token rarely banned and rarely a candidate costs nothing).

Owns: the int8 copy (built once from the BF16 rows), the screen of a step's rows, and the logits it returns:
exact at the rows it computed (every row that can be the argmax, or win the race), -inf elsewhere. Rows whose y is
not finite, or so large that a logit could overflow, take the full head.
Does not own: when a step may be screened (the sampler's contract, `fastar.engine.sampling.Sampler.head_request`),
the noise (`fastar.engine.draw.gumbel`), the BF16 head product itself (`fastar.quant.linear.Linear`), the int8
kernels (`fastar.quant.kernels`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..quant import kernels as K
from ..quant.linear import Linear
from . import ops

U = 2.0**-24  # float32 unit roundoff
MARGIN = 1e-6  # relative widening of the float64 bound (its own rounding is ~1e-15)
HUGE = 1e30  # |y| |W_i| beyond this could overflow a float32 logit: the full head
# The temperatures a race is screened at: from the smallest, with |logit| <= HUGE logit / t stays finite in float32
# (the sampler's smaller temperatures fall back to the argmax when the division overflows, which needs every logit);
# to the largest, t times the noise (at most ~37.4) stays far inside float32's range (at 1e38 the offsets overflow to
# +-inf, outside the bounds' error analysis)
MIN_RACE_TEMPERATURE = 1e-3
MAX_RACE_TEMPERATURE = 1e6
# The largest top-k a race is screened with: its rows are computed exactly (more than ~1e3 would cost what the head
# does)
MAX_RACE_TOP_K = 1024
TOP_K_MARGIN = 1e-6  # relative widening of a top-k row's floor: logit / t rounded may tie the k-th where logits differ
TOP_K_PROBE = 4  # a top-k row's floor is the k-th largest logit of this many times k rows (those of largest bound)


@dataclass(frozen=True, eq=False)
class Race:
    """A decode row whose token is the argmax over i of fl64(fl32(logit_i / temperature) + noise[i]) (a sampled token
    at `temperature`, `fastar.engine.draw.race`), among the `top_k` largest where top_k > 0, which the screen may
    compute from the rows that can win (module docstring). noise: float64 [V], finite."""

    temperature: float
    noise: np.ndarray
    top_k: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.top_k <= MAX_RACE_TOP_K:
            raise ValueError(f"a screened race takes a top_k in [0, {MAX_RACE_TOP_K}], not {self.top_k}")
        if not MIN_RACE_TEMPERATURE <= self.temperature <= MAX_RACE_TEMPERATURE:
            raise ValueError(
                f"a screened race needs a temperature in [{MIN_RACE_TEMPERATURE}, {MAX_RACE_TEMPERATURE:g}], "
                f"not {self.temperature}"
            )
        if self.noise.dtype != np.float64 or self.noise.ndim != 1:
            raise ValueError(f"a race's noise is float64 [V], not {self.noise.dtype} {list(self.noise.shape)}")

    def offsets(self) -> np.ndarray:
        """o = fl32(temperature * noise) [V]: the shift of each head row's bounds (module docstring)."""
        return (self.temperature * self.noise).astype(np.float32)


@dataclass(frozen=True, eq=False)
class Ban:
    """A decode row whose token is the argmax of its logits, or the winner of its `race`, with the tokens `ids` (int64,
    sorted) excluded: set to -inf before the draw (a request's banned tokens). The screen computes the row as it
    would without the ban and, where a banned row is among the rows it computed (one could win), takes the full head
    for it: otherwise the rows that can win over the whole vocabulary, none of them banned, are the ones that can
    win over the rest, so the token is the full head's with the ban applied."""

    ids: np.ndarray
    race: Race | None = None

    def __post_init__(self) -> None:
        if self.ids.dtype != np.int64 or self.ids.ndim != 1:
            raise ValueError(f"a ban's ids are int64 [n], not {self.ids.dtype} {list(self.ids.shape)}")


# What a step asks of the head for one row (`DeepseekV4.forward`'s `argmax_only`, `Sampler.head_request`): False,
# every logit; True, the argmax alone; a `Race`, its winner; a `Ban` of either, the same over the tokens not banned.
HeadRequest = bool | Race | Ban


class HeadScreen:
    """The int8 copy of a BF16 head and the screened logits of decode rows (see the module docstring)."""

    # The most decode rows a step screens (more take the full head). head_i8_dot reads the int8 rows once per 4 terms
    # (in tiles of 4 rows: one stream) and re-reads them from L2 for the next 4; from ONE_TERM_ROWS rows a row is one
    # term but for the few head rows its first leaves open, so 8 rows take about what 1-2 rows' two terms take, well
    # below the BF16 head's 8-row product (docs/PERFORMANCE.md): every decode step pays (`DeepseekV4.forward_rows`
    # takes at most 8 rows).
    MAX_ROWS = 8
    # From this many rows the screen takes the first int8 term alone where it settles a head row (`head_i8_screen`):
    # half the products over the whole head, the second term's only for the ~1 % of rows the first leaves open,
    # from L2. At one row the two terms' products take one pass over the weights, bound by memory: paired, 0.93-1.08x
    # the two-term time either way, where 2 rows took 0.87-0.93x (docs/PERFORMANCE.md).
    ONE_TERM_ROWS = 2

    def __init__(self, head: Linear, kernels) -> None:
        if head.dtype != "BF16":
            raise ValueError(f"{head.name}: the head screen needs BF16 rows, not {head.dtype}")
        self.head, self.k = head, kernels
        self._w = w = head.weight.view(torch.int16).numpy().view(np.uint16)  # the stored bits, [V, K]
        self.V, self.K = w.shape
        self.q = np.empty(w.shape, np.int8)
        self.scale = np.empty(self.V, np.float32)
        self.rowsum = np.empty(self.V, np.int32)
        wnorm, dnorm = np.empty(self.V, np.float64), np.empty(self.V, np.float64)
        kernels.head_i8_build(w, self.q, self.scale, wnorm, dnorm, self.rowsum)
        n = self.K + 16  # the additions on a logit's longest path, with room for the kernels' final sums
        self.gamma = n * U / (1 - n * U)
        self.wmax = float(np.max(wnorm[np.isfinite(wnorm)], initial=0.0))
        # the norms as float32 for the bound, rounded up (an infinite norm stays infinite: always computed)
        self.wnorm32 = np.nextafter(wnorm.astype(np.float32), np.float32(np.inf))
        self.dnorm32 = np.nextafter(dnorm.astype(np.float32), np.float32(np.inf))
        self.exact_rows = 0  # rows computed exactly so far (a count for benchmarks)
        self._keep, self._rows = np.empty(self.V, np.uint8), np.empty(self.V, np.int64)  # head_i8_select's scratch
        self._dots = np.empty((0, self.V), np.int32)  # head_i8_dot's products, kept: MBs a step at 8 rows
        self._ub = np.empty((0, self.V), np.float32)  # head_i8_screen's scratch, kept likewise
        self._off = np.empty((0, self.V), np.float32)  # the races' offsets, kept likewise
        # per row count, head_i8_quantize's outputs (x, sx, stats): a step's numpy calls run from cold caches, tens
        # of microseconds each, so the step makes as few as it can
        self._terms: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    @classmethod
    def build(cls, head: Linear) -> HeadScreen | None:
        """The screen of `head`, or None where it has none: no C kernels, or a head not stored as BF16."""
        return cls(head, K) if K.available() and head.dtype == "BF16" else None

    @staticmethod
    def bytes_for(rows: int, cols: int) -> int:
        """The memory a screen of a [rows, cols] head takes: int8 rows; per row a scale, two norms and a sum (float32,
        int32), head_i8_select's scratch (a byte and an index) and, at most, 2 MAX_ROWS int32 products or float32
        bounds (head_i8_dot's two terms of fewer than ONE_TERM_ROWS rows, head_i8_screen's MAX_ROWS), and MAX_ROWS
        float32 race offsets."""
        return rows * (cols + 4 + 4 + 4 + 4 + 1 + 8 + 4 * 3 * HeadScreen.MAX_ROWS)

    @property
    def nbytes(self) -> int:
        return self.bytes_for(self.V, self.K)

    @property
    def read_delta(self) -> int:
        """Bytes a screened step reads beside the full head's (negative): its int8 rows in place of the BF16 ones,
        before the candidate rows it computes exactly (2 K bytes each)."""
        return self.q.nbytes - self.head.nbytes

    def logits(self, y: torch.Tensor, races: list[Race | Ban | None] | None = None) -> torch.Tensor:
        """y [T, K] float32 (the head's input rows) -> logits [T, V] float32: the full head's values at every row
        that can hold a row's largest logit, or win its race where races[t] is one (and at the other rows'
        candidates), -inf elsewhere. races: per row a `Race` or None (the argmax), or a `Ban` of either (a row
        whose banned tokens could win takes the full head: every logit); None: every row's argmax."""
        bans = [r.ids if isinstance(r, Ban) else None for r in races or ()]
        out = self._screened(y, None if races is None else [r.race if isinstance(r, Ban) else r for r in races])
        for t, ids in enumerate(bans):
            if ids is not None and ids.size and np.isfinite(out[t, ids[ids < self.V]].numpy()).any():
                out[t] = self.head(y[t : t + 1].detach().float())[0]
        return out

    def _screened(self, y: torch.Tensor, races: list[Race | None] | None) -> torch.Tensor:
        """`logits` without bans."""
        yn = ops.buffer_array(y)  # a decode step's registered rows (`hc_chain`): the array itself, no conversion
        if yn is None:
            yn = y.detach().contiguous().float().numpy()
        T = yn.shape[0]
        off = None
        if races is not None and any(r is not None for r in races):
            if len(races) != T:
                raise ValueError(f"{len(races)} races for {T} rows")
            if self._off.shape[0] < T:
                self._off = np.empty((T, self.V), np.float32)
            off = self._off[:T]  # kept, as `_ub`: a step's offsets are MBs
            for t, r in enumerate(races):
                if r is not None and r.noise.shape != (self.V,):
                    raise ValueError(f"a race's noise has {r.noise.shape[0]} entries, the head {self.V} rows")
                if r is None or r.top_k:  # greedy and top-k rows: offsets 0, the same bits as none
                    off[t] = 0
                else:
                    off[t] = r.offsets()
        ks = [r.top_k if r is not None else 0 for r in races or [None] * T]
        if T not in self._terms:
            self._terms[T] = np.empty((2 * T, self.K), np.int8), np.empty(2 * T, np.float32), np.empty((T, 5))
        x, sx, stats = self._terms[T]
        self.k.extension.head_i8_quantize(yn, x, sx, stats)
        st = stats.tolist()  # [|dy|, |x|, |y|, and the first term's alone |dy|, |x|] per row: T is at most 8
        plain = [not (math.isfinite(ny) and ny != 0 and ny * self.wmax <= HUGE) for _, _, ny, _, _ in st]
        if not any(plain):  # the candidates' exact logits into an -inf-filled output, one call (`_exact`'s bits)
            rows = self._candidates(x, sx, st, off, ks, yn, copy=False)  # used before the next screen
            out = np.empty((T, self.V), np.float32)
            self.exact_rows += len(rows)
            self.k.extension.head_i8_exact(self._w, rows, yn, out)
            return torch.from_numpy(out)
        out = np.full((T, self.V), -np.inf, np.float32)
        screened = [t for t in range(T) if not plain[t]]
        if screened:  # the screened rows' terms alone (rows t and T + t of x for each)
            idx = screened + [T + t for t in screened]
            rows = self._candidates(
                x[idx],
                sx[idx],
                [st[t] for t in screened],
                None if off is None else off[screened],
                [ks[t] for t in screened],
                yn[screened],
            )
            out[np.ix_(screened, rows)] = self._exact(np.ascontiguousarray(yn[screened]), rows)
        full = [t for t in range(T) if plain[t]]
        out[full] = self.head(torch.from_numpy(np.ascontiguousarray(yn[full]))).numpy()
        return torch.from_numpy(out)

    def _candidates(
        self,
        x: np.ndarray,
        sx: np.ndarray,
        st: list[list[float]],
        off: np.ndarray | None,
        ks: list[int],
        y: np.ndarray,
        copy: bool = True,
    ) -> np.ndarray:
        """The sorted union over the screened rows (their int8 terms x [2T, K] with scales sx, per row `logits`'s
        stats, the races' offsets off [T, V] or None, their top-k ks and their rows y [T, K]) of the head rows that
        can hold that row's largest logit or win its race (`copy` False: a view of the scratch that the next screen
        overwrites). From ONE_TERM_ROWS rows, or where a row takes a top-k (which reads the upper bounds it leaves),
        `head_i8_screen`'s one pass; below, `head_i8_dot` of both terms and `head_i8_select` (the same bounds, each
        row taking both terms)."""
        T = len(st)
        # float64 arithmetic as numpy's on the same values, then rounded to float32: c1 = (|dy| + gamma |y|) (1 +
        # MARGIN), c2 = |x| (1 + MARGIN), for both terms and (`head_i8_screen`) for the first alone
        c = np.array(
            [
                [(d + self.gamma * ny) * (1 + MARGIN), n * (1 + MARGIN)]
                for dy, nx, ny, dy1, nx1 in st
                for d, n in ((dy1, nx1), (dy, nx))
            ],
            np.float32,
        ).reshape(T, 4)
        if T >= self.ONE_TERM_ROWS or any(ks):
            if self._ub.shape[0] < T:
                self._ub = np.empty((T, self.V), np.float32)
            n = self.k.extension.head_i8_screen(
                x,
                sx,
                c,
                self.q,
                self.rowsum,
                self.scale,
                self.wnorm32,
                self.dnorm32,
                MARGIN,
                self._ub[:T],
                self._keep,
                self._rows,
                off,
            )
        else:
            if self._dots.shape[0] < 2 * T:
                self._dots = np.empty((2 * T, self.V), np.int32)
            dots = self._dots[: 2 * T]
            self.k.extension.head_i8_dot(x, self.q, self.rowsum, dots)
            n = self.k.extension.head_i8_select(
                dots,
                sx,
                self.scale,
                np.ascontiguousarray(c[:, 2]),
                np.ascontiguousarray(c[:, 3]),
                self.wnorm32,
                self.dnorm32,
                MARGIN,
                self._keep,
                self._rows,
                off,
            )
        if any(ks):  # a new array, whatever `copy`
            tops = [self._top_k_rows(np.ascontiguousarray(y[t : t + 1]), self._ub[t], k) for t, k in enumerate(ks) if k]
            return np.union1d(self._rows[:n], np.concatenate(tops))
        return self._rows[:n].copy() if copy else self._rows[:n]

    def _top_k_rows(self, y: np.ndarray, ub: np.ndarray, k: int) -> np.ndarray:
        """The head rows a top-k race of the row y [1, K] may keep, from its upper bounds ub [V] (`head_i8_screen`'s,
        offsets 0): those whose bound reaches L, the k-th largest exact logit among the 4k rows of largest bound (k
        rows with logits at least L: L is at most the k-th largest logit, and the more rows it is taken from, the
        closer; module docstring); every row where one of those logits is not finite."""
        k, m = min(k, self.V), min(TOP_K_PROBE * k, self.V)
        top = np.sort(np.argpartition(ub, self.V - m)[self.V - m :])
        got = self._exact(y, top)[0]
        low = float(np.partition(got, m - k)[m - k]) if np.isfinite(got).all() else math.nan
        if not math.isfinite(low):
            return np.arange(self.V)
        return np.flatnonzero(ub >= low - abs(low) * TOP_K_MARGIN - 1e-30)

    def _exact(self, y: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The full head's logits [T, len(rows)] at `rows` for y [T, K] (C-contiguous): its own kernel on those rows
        gathered, so each value has the bits the full product gives it (each (row, token) sum is the same chain
        whatever the rows around it)."""
        self.exact_rows += len(rows)
        sub = np.empty((len(rows), self.K), np.uint16)
        self.k.extension.gather_rows(self._w, rows, sub)
        out = np.empty((y.shape[0], len(rows)), np.float32)
        self.k.extension.bf16_matmul(y, sub, out)
        return out
