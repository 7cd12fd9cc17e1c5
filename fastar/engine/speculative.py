"""Speculative decoding: a cheap draft proposes tokens, one target pass checks them all, and the tokens kept are
distributed exactly as plain generation's (greedy: the same tokens). A verify pass holds at most `VERIFY_MAX`
tokens: up to that many, the model with its C kernels computes each token's logits and state bit-identically to
one-token decode, in both numerics (batch invariance, see `fastar.model.deepseek_v4`). A longer pass, or torch's
products (`kernels=False`), would round FP8/FP4 activations slightly differently under `official` numerics, so
greedy text could part from plain decoding at a near-tie.

Owns:
- the acceptance rule (`accept_greedy`, `accept_sampled`), written out beside the loop that uses it;
- `speculative_generate_step`, the sibling of `generate.generate_step`: same session, same yield contract
  `(token, logprob, top_logprobs)`; it drafts, verifies, rolls rejected tokens back and fills `SpeculativeStats`;
- drafters, which are also the engine's hook on every target pass (`forward`) so their context follows the target
  through prefill, verification and rollback: `MTPDrafter` (the checkpoint's `mtp.0` block, MTP-1) and
  `DSparkDrafter` (`fastar.model.dspark`, up to 5 drafts per pass);
- `Schedule`: how many drafts to verify (acceptance estimates, DSpark confidences and a cost model) and, under
  `auto`, whether to draft at all; `resolve` (the `--draft` names). The benchmark against expert-cache pressure
  is `fastar.bench.speculative`.
Does not own: logits processing (`sampling.processed_logits`, used for target and draft alike, so verification is
exact for the distribution actually sampled), the timeline (`Session`), the models.

Context of a draft: its per-position rows live in `ModelState.mtp` (so `truncate`, snapshots and saved sessions
carry them). MTP row i needs the target's final streams at i and token i+1; DSpark row i needs the target state
entering the target layers at i. A drafter keeps what the last target pass produced (`Pass`) to fill the rows
`ModelState.truncate` drops (it keeps p-1 draft rows). Where a row's input was not kept (a rollback across
requests, a restored session) it is filled from zeros: only draft quality suffers, never the output.

Cost model (relative to one plain decode pass): verifying L drafts costs 1 + r*L, drafting costs q. On CPU with
experts in RAM, r ~ 0.3 for DeepSeek-V4-Flash (each extra token adds its 6 experts x 43 layers to ~7.3 GB of
resident reads); when experts come from SSD each extra token adds its misses and r -> 1, so drafting loses. The
schedule verifies L* = argmax_L (1 + sum_{k<=L} a_k) / (1 + r*L), a_k = survival of draft k. `auto` measures r and
q from the engine's own passes and skips drafting while max_L (1 + sum a_k) / (1 + r*L + q) < 1 (probing every 16
steps); it also times whole epochs with and without drafting (256 tokens in the faster mode, then 32 in the
other), because wide passes can evict experts that narrow ones would hit, which no per-pass cost shows; after 3
drafting epochs in a row that lost it switches the draft off, context upkeep included (keeping MTP's rows costs
one more block per token: ~2% of V4-Flash, but 1/6 of the 5-layer fixture).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..errors import OptionError
from ..model import ops
from ..model.state import LayerState, ModelState, RowBuffer, StateError
from .draw import draw
from .sampling import SamplingParams, argmax, processed_logits, report

DRAFT_KINDS = ("none", "mtp", "dspark", "auto")
VERIFY_MAX = ops.SMALL_CHUNK  # tokens of one verify pass (anchor + drafts): batch-invariant up to this many

Pick = Callable[[torch.Tensor], tuple[int, torch.Tensor | None]]


# --- the acceptance rule -------------------------------------------------------------------------------------


def accept_greedy(target_logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    """target_logits [L+1, V] of the verify pass. Accept drafts while each equals the target's argmax; the next
    token is the argmax after the last accepted one (a correction, or the bonus when all L were accepted)."""
    best = [argmax(row) for row in target_logits]
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return n, best[n]


def accept_sampled(p: torch.Tensor, q: torch.Tensor, drafts: list[int], gen: torch.Generator) -> tuple[int, int]:
    """Standard speculative sampling. p [L+1, V] target and q [L, V] draft distributions (both after the same
    temperature / top-k / top-p / min-p processing); drafts[k] was drawn from q[k]."""
    for k, x in enumerate(drafts):
        u = float(torch.rand(1, generator=gen))
        # q(x) <= p(x): always accept;  q(x) > p(x): accept with probability p(x)/q(x)
        if u * float(q[k, x]) < float(p[k, x]):
            continue
        # rejected: draw from the leftover mass max(p - q, 0), renormalised (falls back to p if none is left)
        residual = (p[k] - q[k]).clamp(min=0)
        if float(residual.sum()) <= 0:
            residual = p[k]
        return k, draw(residual, gen)
    return len(drafts), draw(p[len(drafts)], gen)  # all accepted: bonus token


def expected_acceptance(p: torch.Tensor, q: torch.Tensor | None, draft: int) -> float:
    """Probability that `draft` is accepted: sum_v min(p, q) when sampling, [draft == argmax] when greedy
    (q None; p are then raw logits)."""
    if q is None:
        return float(argmax(p) == draft)
    return float(torch.minimum(p, q).sum())


# --- drafters ------------------------------------------------------------------------------------------------


@dataclass
class Pass:
    """What a drafter keeps of a target pass: enough to draft from any position it covered."""

    ref: weakref.ref  # the state it ran on (weak: a finished session's state is freed)
    p0: int
    ids: list[int]
    logits: torch.Tensor  # [T, V] (all positions when T <= verify width), else [1, V]
    hidden: torch.Tensor | None  # the draft's input per position: MTP [T, n, d] final streams, DSpark [T, d]
    # main_x; None for a pass made while the drafter was paused

    @property
    def state(self) -> ModelState | None:
        return self.ref()

    def row(self, state: ModelState, pos: int) -> torch.Tensor | None:
        """The hidden of position `pos` if this pass covered it and it still holds for `state` (a later pass on
        the same state replaces the record, so rows below the state's length are still the ones computed)."""
        if (
            self.hidden is not None
            and self.state is state
            and self.p0 <= pos < min(self.p0 + len(self.ids), state.length)
        ):
            return self.hidden[pos - self.p0]
        return None


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None  # [k, V] processed draft distributions; None when greedy
    confidence: list[float | None]  # per draft, None when the drafter has no confidence head


class Drafter:
    """Base: the hook on target passes. Subclasses: `kind`, `max_drafts`, `_observe`, `propose`, `new_state`."""

    kind = ""
    max_drafts = 0

    KEEP = 8  # states whose last pass is remembered (sessions may interleave)

    def __init__(self, model) -> None:
        self.model = model
        self.paused = False  # no context upkeep (`auto` switched drafting off): passes are plain target passes
        self.last: Pass | None = None  # the most recent pass, on any state
        self._passes: dict[int, Pass] = {}  # id(state) -> its last pass

    def new_state(self) -> ModelState:
        return self.model.new_state()

    def pass_of(self, state: ModelState) -> Pass | None:
        rec = self._passes.get(id(state))
        return rec if rec is not None and rec.state is state else None

    def _remember(self, rec: Pass) -> None:
        self._passes = {k: v for k, v in self._passes.items() if v.state is not None and k != id(rec.state)}
        self._passes[id(rec.state)] = rec
        while len(self._passes) > self.KEEP:
            del self._passes[next(iter(self._passes))]
        self.last = rec

    @torch.inference_mode()
    def forward(self, ids: list[int], state: ModelState, all_logits: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The target pass (`DeepseekV4.forward`'s contract), plus the draft context rows of these positions.
        Short passes (a verify pass is one) keep the logits of every position in `self.last`."""
        ids = [int(t) for t in ids]
        p0, prev = state.length, self.pass_of(state)
        keep_all = all_logits or len(ids) <= self.max_drafts + 1
        if self.paused:  # a plain pass: no draft inputs kept (the draft's context gets a gap here)
            logits, X = self.model.forward(ids, state, all_logits=keep_all)
            hidden = None
        else:
            logits, X, hidden = self._target(ids, state, keep_all)
        rec = Pass(
            weakref.ref(state), p0, ids, logits if keep_all and len(ids) <= self.max_drafts + 1 else logits[-1:], hidden
        )
        if not self.paused:
            self._observe(state, rec, prev)
        self._remember(rec)
        return (logits if all_logits else logits[-1:]), X

    def _target(self, ids, state, all_logits):
        logits, X = self.model.forward(ids, state, all_logits=all_logits)
        return logits, X, X

    def _observe(self, state: ModelState, rec: Pass, prev: Pass | None) -> None:
        raise NotImplementedError

    def propose(self, state: ModelState, anchor: int, k: int, pick: Pick) -> Proposal:
        raise NotImplementedError

    def hidden(self, state: ModelState, pos: int, prev: Pass | None = None) -> torch.Tensor | None:
        for rec in (self.pass_of(state), prev):
            h = rec.row(state, pos) if rec is not None else None
            if h is not None:
                return h
        return None


def _restart(s: LayerState, start: int) -> LayerState:
    """A ratio-0 state at length `start` whose window before it is zero rows (the inputs were not kept)."""
    k0 = max(0, start - s.window + 1)
    return LayerState(0, s.window, RowBuffer(s.kv.width, k0, torch.zeros(start - k0, s.kv.width)), length=start)


class MTPDrafter(Drafter):
    """MTP-1 with the checkpoint's `mtp.0` block: from the target's final streams at position m-1 and the token
    at m (just sampled) it predicts the token at m+1. Its own sliding-window rows are `state.mtp[0]`."""

    kind = "mtp"
    max_drafts = 1

    def __init__(self, model) -> None:
        if not model.mtp:
            raise ValueError("this checkpoint has no MTP block (mtp.0 with e_proj/h_proj)")
        super().__init__(model)
        self.block = model.mtp[0]

    def _rows(self, state: ModelState, X: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
        """Append MTP rows at positions mtp.length.. (X [R, n, d], next tokens [R]); returns normed outputs."""
        s = state.mtp[0]
        ids = torch.tensor(next_ids)
        p0 = s.length
        y = self.block(X, self.model.embed.rows(ids), ids, p0, s)  # [R, d]
        s.length = p0 + len(next_ids)
        s.trim(state.max_rollback)
        return y

    def _sync(self, state: ModelState, upto: int, recs: tuple[Pass | None, ...], next_of: Callable[[int], int]) -> None:
        """Make the MTP rows cover exactly the positions < upto, reading the streams of position i from `recs`
        (zeros where none has them) and t_{i+1} from `next_of(i)`."""
        if not state.mtp:  # a state made without the MTP block
            cfg = self.model.config
            state.mtp = [LayerState.new(0, cfg.sliding_window, cfg.head_dim, cfg.index_head_dim)]
        s = state.mtp[0]
        if s.length > upto:
            try:
                s.truncate(upto)
            except StateError:  # rows needed were dropped (max_rollback): start this window over
                state.mtp[0] = s = _restart(s, upto)

        def streams(i: int) -> torch.Tensor | None:
            return next((h for r in recs if r is not None and (h := r.row(state, i)) is not None), None)

        first = next((i for i in range(s.length, upto) if streams(i) is not None), upto)
        if first - s.length > s.window:  # a long stretch without inputs: only the last window of it can matter
            state.mtp[0] = s = _restart(s, first - s.window)
        if s.length < upto:
            zero = torch.zeros(self.model.config.hc_mult, self.model.config.hidden_size)
            pos = range(s.length, upto)
            X = torch.stack([h if (h := streams(i)) is not None else zero for i in pos])
            self._rows(state, X, [next_of(i) for i in pos])

    def _observe(self, state: ModelState, rec: Pass, prev: Pass | None) -> None:
        # rows up to the pass's second-to-last position (the last one waits for its next token); before the
        # pass, t_{i+1} is unknown: such rows (a state made elsewhere) start over as a zero window
        a, T = rec.p0, len(rec.ids)
        if state.mtp and state.mtp[0].length < a - 1:
            state.mtp[0] = _restart(state.mtp[0], a - 1)
        known = {a + j - 1: t for j, t in enumerate(rec.ids)}  # position i -> t_{i+1}
        self._sync(state, a + T - 1, (rec, prev), lambda i: known[i])

    @torch.inference_mode()
    def propose(self, state: ModelState, anchor: int, k: int, pick: Pick) -> Proposal:
        m = state.length
        rec = self.pass_of(state)
        self._sync(state, m - 1, (rec,), lambda i: anchor)  # (normally a no-op)
        h = rec.row(state, m - 1) if rec is not None else None
        X = (h if h is not None else torch.zeros(self.model.config.hc_mult, self.model.config.hidden_size))[None]
        logits = self.model.head(self._rows(state, X, [anchor]))[0]  # [V]: the token at m+1
        tok, q = pick(logits)
        return Proposal([tok], None if q is None else q[None], [None])


class DSparkDrafter(Drafter):
    """DSpark (`fastar.model.dspark`): the target passes capture the state entering the target layers, each
    stage keeps one context row per target position in `state.mtp[k]`, and a draft is one block run."""

    kind = "dspark"

    def __init__(self, model, source, kernels: bool = True) -> None:
        from ..model.dspark import DSparkDraft
        from ..quant.linear import Weights

        super().__init__(model)
        self.draft = DSparkDraft(
            Weights(source, kernels), model.config, model.numerics, model.experts, kernels, model.embed, model.head
        )
        self.max_drafts = self.draft.block_size

    def new_state(self) -> ModelState:
        state = self.model.new_state()
        state.mtp = self.draft.new_states()
        return state

    def _stages(self, state: ModelState, start: int) -> list[LayerState]:
        n = len(self.draft.stages)
        if len(state.mtp) != n or any(s.ratio or s.kv.width != self.draft.head_dim for s in state.mtp):
            state.mtp = self.draft.new_states(start)  # a state made without this draft: its context starts here
        return state.mtp

    def _target(self, ids, state, all_logits):
        cap = {t: None for t in self.draft.targets}
        logits, X = self.model.forward(ids, state, all_logits=all_logits, capture=cap)
        return logits, X, self.draft.main_x(cap)

    def _sync(self, state: ModelState, upto: int, prev: Pass | None) -> None:
        """Make the context rows cover exactly the positions < upto."""
        stages = self._stages(state, upto)
        have = stages[0].length
        if have > upto:
            try:
                for s in stages:
                    s.truncate(upto)
            except StateError:  # rows needed were dropped (max_rollback): the context starts over here
                state.mtp = stages = self.draft.new_states(upto)
        elif upto - have > self.draft.window:
            state.mtp = stages = self.draft.new_states(upto - self.draft.window)
        have = stages[0].length
        if have < upto:
            zero = torch.zeros(self.model.config.hidden_size)  # -> exactly zero KV rows, masked by the stages
            rows = [h if (h := self.hidden(state, i, prev)) is not None else zero for i in range(have, upto)]
            self.draft.extend(stages, torch.stack(rows), have, upto - have, state.max_rollback)

    def _observe(self, state: ModelState, rec: Pass, prev: Pass | None) -> None:
        # state.length is already past this pass: the rows before it first, then the pass's own rows
        self._sync(state, rec.p0, prev)
        self.draft.extend(self._stages(state, rec.p0), rec.hidden, rec.p0, len(rec.ids), state.max_rollback)

    @torch.inference_mode()
    def propose(self, state: ModelState, anchor: int, k: int, pick: Pick) -> Proposal:
        self._sync(state, state.length, None)
        blk = self.draft.draft(self._stages(state, state.length), anchor, k, pick)
        return Proposal(blk.tokens, blk.probs, list(blk.confidence))


# --- how many to verify --------------------------------------------------------------------------------------

PRIOR_COST = {"mtp": (0.3, 0.12), "dspark": (0.3, 0.3)}  # (r, q) for V4-Flash with experts in RAM; see docstring


@dataclass
class Schedule:
    """Chooses the verification length from acceptance estimates (per draft slot, conditional on the slots before
    it being accepted; DSpark confidences scale them) and the cost model (r, q). `fixed` verifies a fixed number
    (tests, benchmarks). `adaptive` (`--draft auto`) measures r and q from the passes and may skip drafting;
    otherwise the schedule depends only on the generated tokens, so a seed reproduces the same text."""

    r: float = 0.3
    q: float = 0.12
    fixed: int | None = None
    adaptive: bool = False
    probe_every: int = 16
    warmup: int = 8
    # auto: epochs of `epoch_tokens` in the faster mode, each followed by `probe_tokens` in the other; the first
    # `settle` tokens of an epoch are not timed (the expert cache adapts to the switch); after `retire_after`
    # drafting epochs in a row that lost (slower than plain, or verifying in under 10% of steps), drafting is
    # switched off for good
    epoch_tokens: int = 256
    probe_tokens: int = 32
    settle: int = 8
    retire_after: int = 3
    retired: bool = False
    mode: str = "draft"
    speed: dict[str, float] = field(default_factory=dict)  # measured tokens/s of each mode (EMA over epochs)
    epoch: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 32.0, 0.0, 0.0])  # tokens, timed tokens,
    # seconds, length, steps, steps that verified drafts
    plain_wins: int = 0
    tried: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    conf_sum: list[float] = field(default_factory=list)
    times: dict[int, float] = field(default_factory=dict)  # target pass seconds by width (EMA)
    draft_time: float | None = None
    skipped: int = 0

    def _slot(self, k: int) -> None:
        while len(self.tried) <= k:
            self.tried.append(0.0)
            self.accepted.append(0.0)
            self.conf_sum.append(0.0)

    def rate(self, k: int) -> float:
        """Estimated P(slot k accepted | earlier slots accepted) with a uniform prior."""
        self._slot(k)
        return (self.accepted[k] + 1) / (self.tried[k] + 2)

    def survival(self, confidence: list[float | None]) -> list[float]:
        a, out = 1.0, []
        for k, c in enumerate(confidence):
            rate = self.rate(k)
            if c is not None:  # calibrate the confidence head against what was actually accepted
                rate = min(0.999, c * rate / ((self.conf_sum[k] + 0.5) / (self.tried[k] + 1)))
            a *= rate
            out.append(a)
        return out

    def choose(self, confidence: list[float | None]) -> int:
        if self.fixed is not None:
            return min(self.fixed, len(confidence))
        best, best_l, expect = 1.0, 0, 1.0
        r, _ = self.costs()
        for L, a in enumerate(self.survival(confidence), start=1):
            expect += a
            if expect / (1 + r * L) > best + 1e-9:
                best, best_l = expect / (1 + r * L), L
        return best_l

    def want_draft(self, max_drafts: int) -> bool:
        """Under `auto`: draft while the best expected gain beats plain decoding, after `warmup` tries of the first
        slot (so the estimates start from evidence), and probe every `probe_every` skipped steps after that."""
        self._slot(0)
        if not self.adaptive or self.fixed is not None:
            return True
        if self.retired or self.mode == "plain":
            return False
        if self.tried[0] < self.warmup:
            return True
        r, q = self.costs()
        expect, best = 1.0, 0.0
        for L, a in enumerate(self.survival([None] * max_drafts), start=1):
            expect += a
            best = max(best, expect / (1 + r * L + q))
        if best >= 1.0:
            return True
        self.skipped += 1
        return self.skipped % self.probe_every == 0

    def observe_step(self, tokens: int, seconds: float, verified: bool = False) -> None:
        """Under `auto`: tokens emitted by one step and its seconds. The per-pass cost model cannot see that wide
        passes evict experts narrow ones would hit (an expert cache between one token's and one pass's working set),
        so `auto` also times whole epochs of each mode and runs the faster one."""
        if not self.adaptive or self.fixed is not None or self.retired:
            return
        e = self.epoch
        e[0], e[4], e[5] = e[0] + tokens, e[4] + 1, e[5] + verified
        if e[0] > self.settle:
            e[1], e[2] = e[1] + tokens, e[2] + seconds
        if e[0] < e[3]:
            return
        if e[2] > 0:
            old = self.speed.get(self.mode)
            self.speed[self.mode] = e[1] / e[2] if old is None else 0.5 * old + 0.5 * e[1] / e[2]
        other = "plain" if self.mode == "draft" else "draft"
        if other not in self.speed:  # the first epoch of each mode is a probe
            self.mode, length = other, self.probe_tokens
        else:
            if self.mode == "draft":  # a verdict on drafting: slower, or hardly ever found worth a verify pass
                lost = self.speed["plain"] >= self.speed["draft"] or e[5] < 0.1 * e[4]
                self.plain_wins = self.plain_wins + 1 if lost else 0
                self.retired = self.plain_wins >= self.retire_after
            best = max(self.speed, key=self.speed.get)
            probing = self.mode == best and e[3] == self.epoch_tokens  # a long epoch ends: probe the other
            self.mode = other if probing else best
            length = self.probe_tokens if probing else self.epoch_tokens
        self.epoch = [0.0, 0.0, 0.0, float(length), 0.0, 0.0]

    def observe(self, k: int, p_accept: float, confidence: float | None) -> None:
        self._slot(k)
        self.tried[k] += 1
        self.accepted[k] += p_accept
        self.conf_sum[k] += 0.5 if confidence is None else confidence

    def observe_time(self, width: int, seconds: float, draft_seconds: float | None = None) -> None:
        old = self.times.get(width)
        self.times[width] = seconds if old is None else 0.8 * old + 0.2 * seconds
        if draft_seconds is not None:
            self.draft_time = draft_seconds if self.draft_time is None else 0.8 * self.draft_time + 0.2 * draft_seconds

    def _fit(self) -> tuple[float, float] | None:
        """(intercept, slope) of pass seconds against width, least squares over the widths seen (two or more)."""
        if len(self.times) < 2:
            return None
        xs, ys = list(self.times), list(self.times.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        return my - b * mx, b

    def pass_time(self) -> float | None:
        """Seconds of a one-token target pass: measured, else read off the fit."""
        fit = self._fit()
        return self.times.get(1) or (max(1e-9, fit[0] + fit[1]) if fit else None)

    def costs(self) -> tuple[float, float]:
        """(r, q): measured under `adaptive` once two pass widths were seen, else the priors."""
        fit, t1 = self._fit(), self.pass_time()
        if not self.adaptive or fit is None:
            return self.r, self.q
        q = self.q if self.draft_time is None else self.draft_time / t1
        return min(5.0, max(0.01, fit[1] / t1)), q


# --- stats ---------------------------------------------------------------------------------------------------


@dataclass
class SpeculativeStats:
    """Counters of speculative generation since load (`Engine.stats()` shows them as `draft_*`)."""

    mode: str = "none"
    passes: int = 0  # verify passes (at least one draft checked)
    plain_steps: int = 0  # target passes without a draft (schedule chose 0, or the budget left none)
    drafted: int = 0  # drafts verified
    accepted: int = 0
    accept_counts: list[int] = field(default_factory=list)  # passes that accepted 0, 1, ... drafts
    draft_calls: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    plain_seconds: float = 0.0
    prefetched: int = 0  # experts asked of the provider's `prefetch` once drafts were known

    def as_dict(self, pass_time: float | None = None) -> dict:
        tokens = self.accepted + self.passes + self.plain_steps
        seconds = self.draft_seconds + self.verify_seconds + self.plain_seconds
        d = {
            "draft_mode": self.mode,
            "draft_verify_passes": self.passes,
            "draft_plain_steps": self.plain_steps,
            "draft_tokens_verified": self.drafted,
            "draft_tokens_accepted": self.accepted,
            "draft_acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "draft_tokens_per_pass": (self.accepted + self.passes) / self.passes if self.passes else 0.0,
            "draft_seconds": self.draft_seconds,
            "draft_verify_seconds": self.verify_seconds,
            "draft_prefetched_experts": self.prefetched,
        }
        for n, c in enumerate(self.accept_counts):
            d[f"draft_accepted_{n}_passes"] = c
        if pass_time and seconds:  # tokens/s of this loop against one plain pass per token
            d["draft_est_speedup"] = tokens / seconds * pass_time
        return d


# --- the loop ------------------------------------------------------------------------------------------------


def _picker(params: SamplingParams, gen: torch.Generator) -> Pick:
    """The sampler shared by target and drafts: greedy argmax, or a draw from the processed distribution."""
    if params.is_greedy:
        return lambda logits: (argmax(logits), None)

    def pick(logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        q = torch.softmax(processed_logits(logits, params), dim=-1)
        return draw(q, gen), q

    return pick


def _prefetch(model, tokens: list[int]) -> int:
    """Ask the expert provider for the hash-routed layers' experts of the verify pass (known from token ids)."""
    if not model.experts.pages:  # nothing to gain: every expert is present on request
        return 0
    ids, n = torch.tensor(tokens), 0
    for block in model.layers:
        if block.ffn.is_hash:
            experts = block.ffn.tid2eid[ids].unique().tolist()
            model.experts.prefetch(block.layer, experts, source="hash")
            n += len(experts)
    return n


def speculative_generate_step(
    session,
    prompt_ids: list[int],
    params: SamplingParams,
    cancel: threading.Event | None = None,
    on_prefill_progress: Callable[[int, int], None] | None = None,
    *,
    drafter: Drafter,
    schedule: Schedule,
    stats: SpeculativeStats,
) -> Iterator[tuple[int, float, list[tuple[int, float]]]]:
    """Yields `(token, logprob, top_logprobs)` like `generate.generate_step`, several per target pass.

    The session's runner must route its passes through `drafter.forward` (the engine does when a draft is set).
    Tokens computed but not yet yielded sit in the session; closing the generator rewinds the session to exactly
    the prompt plus the yielded tokens (the `finally:`), so a stop mid-pass leaves the timeline plain generation
    would have left.
    """
    claim = session.generation  # the stream's, claimed before its first step
    logits = session.prefill(prompt_ids, cancel, on_prefill_progress)
    if logits is None:
        return
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    gen = torch.Generator().manual_seed(seed)
    pick = _picker(params, gen)
    greedy = params.is_greedy
    base, yielded = len(prompt_ids), 0
    shadow: tuple[int, torch.Tensor | None] | None = None  # a draft not verified: checked against the next token
    try:
        token = pick(logits)[0]
        session.append(token)
        yielded += 1
        yield report(logits, token, params)
        while True:
            rec, tokens = drafter.last, session.tokens
            m, anchor = len(tokens) - 1, tokens[-1]
            # the drafter drafts from the state its last pass ran on: make sure that was this session's
            ours = (
                rec is not None
                and rec.state is not None
                and rec.state.length == m == session.num_processed
                and tokens[rec.p0 : m] == rec.ids[: m - rec.p0]
            )
            # room: keep the tokens of a pass within max_tokens, and below the context length (so the stream's
            # length check fires exactly where it would in plain generation), and the pass within VERIFY_MAX
            room = min(
                drafter.max_drafts, VERIFY_MAX - 1, params.max_tokens - yielded - 1, session.context_length - m - 3
            )
            prop, L, t0 = None, 0, time.perf_counter()
            if schedule.retired and not drafter.paused:
                drafter.paused, stats.mode = True, stats.mode + " (off: drafting did not pay)"
            elif schedule.adaptive and not schedule.retired:
                # `auto` in a plain epoch: no draft context upkeep either (the drafters restart their context
                # where it has a gap, so a later draft epoch starts over from a short window)
                drafter.paused = schedule.mode == "plain"
            if ours and room > 0 and schedule.want_draft(drafter.max_drafts):
                state = rec.state
                prop = drafter.propose(state, anchor, room, pick)
                stats.draft_calls += 1
                L = schedule.choose(prop.confidence)
            t1 = time.perf_counter()
            stats.draft_seconds += t1 - t0
            session.stats.decode_seconds += t1 - t0
            drafts = prop.tokens[:L] if prop else []
            if drafts:
                stats.prefetched += _prefetch(drafter.model, [anchor] + drafts)
            for d in drafts:
                session.append(d)
            session.decode()  # the verify pass: anchor + drafts at positions m..m+L
            rec = drafter.last
            if rec is None or rec.p0 != m or rec.ids != [anchor] + drafts:
                raise RuntimeError("speculative decoding needs the session's passes to go through the drafter")
            out = rec.logits  # [L+1, V]
            t2 = time.perf_counter()
            schedule.observe_time(L + 1, t2 - t1, (t1 - t0) if prop else None)
            if shadow is not None:  # last step's unverified draft: would it have been accepted?
                row = out[0] if shadow[1] is None else torch.softmax(processed_logits(out[0], params), -1)
                schedule.observe(0, expected_acceptance(row, shadow[1], shadow[0]), None)
            shadow = None
            if greedy:
                n, nxt = accept_greedy(out, drafts)
            else:
                p = torch.softmax(torch.stack([processed_logits(r, params) for r in out]), dim=-1)
                n, nxt = accept_sampled(p, prop.probs[:L] if drafts else None, drafts, gen)
            schedule.observe_step(n + 1, t2 - t0, verified=bool(drafts))
            if drafts:
                stats.passes += 1
                stats.verify_seconds += t2 - t1
                stats.drafted += L
                stats.accepted += n
                stats.accept_counts += [0] * (L + 1 - len(stats.accept_counts))
                stats.accept_counts[n] += 1
                for k in range(min(n + 1, L)):  # slots that were actually tried
                    if greedy:
                        seen = float(k < n)
                    else:
                        seen = expected_acceptance(p[k], prop.probs[k], drafts[k])
                    schedule.observe(k, seen, prop.confidence[k])
            else:
                stats.plain_steps += 1
                stats.plain_seconds += t2 - t1
                if prop is not None:
                    shadow = (prop.tokens[0], None if prop.probs is None else prop.probs[0])
            if n < L:
                session.roll_back(m + 1 + n)  # drops the rejected drafts; every layer state truncates with it
            session.append(nxt)
            for j, tok in enumerate(drafts[:n] + [nxt]):
                yielded += 1
                yield report(out[j], tok, params)
    finally:  # drafts appended past the last token yielded, unless another generation has the session now
        if yielded and session.num_tokens > base + yielded and session.holds(claim):
            session.roll_back(base + yielded)


# --- choosing a draft ----------------------------------------------------------------------------------------


def available(model) -> list[str]:
    """Draft kinds this model's checkpoint carries."""
    if model.config.has_dspark:
        return ["dspark"]
    return ["mtp"] if model.mtp else []


def draft_kind(kind: str | None) -> str:
    """A `--draft` name, lower-cased (None: "none"); one not in `DRAFT_KINDS` is a ValueError naming them (`load`
    checks it before anything is read, `resolve` once the model is built)."""
    kind = "none" if kind is None else str(kind).lower()
    if kind not in DRAFT_KINDS:
        raise ValueError(f"draft must be one of {', '.join(DRAFT_KINDS)}; got {kind!r}")
    return kind


def resolve(kind: str | None, model, source, kernels: bool = True) -> tuple[Drafter | None, Schedule, str]:
    """`--draft` name -> (drafter or None, schedule, the mode actually used).

    `auto`: the draft the checkpoint carries (DeepSeek-V4-Flash: MTP; -0731: DSpark, which replaces the MTP block
    under the same `mtp.*` names, so no checkpoint offers both), with an adaptive schedule that measures the cost
    of passes and drafts and decodes plainly while drafting would not pay (probing every 16 steps). `none` or an
    `auto` with no draft weights: plain decoding. Naming a draft the checkpoint lacks is an error.
    """
    kind = draft_kind(kind)
    have = available(model)
    if kind == "none" or (kind == "auto" and not have):
        return None, Schedule(), "none"
    use = have[0] if kind == "auto" else kind
    if use not in have:
        raise OptionError(
            "draft", kind, f"this checkpoint has no {use} weights (it has: {', '.join(have) or 'no draft weights'})"
        )
    drafter = MTPDrafter(model) if use == "mtp" else DSparkDrafter(model, source, kernels)
    r, q = PRIOR_COST[use]
    return drafter, Schedule(r=r, q=q, adaptive=kind == "auto"), (f"auto:{use}" if kind == "auto" else use)
