"""One speculative step on a bare decode state: how the step scheduler drafts for a sequence while it is alone.

Owns: `draft_step`, the state-level twin of one iteration of `speculative.speculative_generate_step`'s loop:
propose drafts after the pending token, verify pending token + drafts in one target pass, roll the state back past
the rejected ones. Greedy (`sampling` None): it returns the verified logits rows and leaves choosing the tokens
to the caller's own `Sampler` (the argmax of each row, which is the accepted draft, then the correction or bonus),
so the tokens, logprobs and chunks come out of the same code as a plain decode step's. Sampled (`sampling` given):
drafts are drawn from the draft's processed distribution and accepted by standard speculative sampling
(`speculative.accept_sampled`, with the request's own generator), so each token is distributed exactly as a plain
step's draw from the target's processed distribution; it returns the rows and the tokens chosen.
Does not own: the acceptance rules (`speculative.accept_greedy`, `accept_sampled`), the drafters and the schedule
(`speculative`), when to draft (the scheduler: one decoding sequence, nothing else active, greedy or unseeded).

Why not seeded sampling: speculative sampling draws other random numbers than one draw per token, so a seeded
request's tokens would differ from the batched path's; the scheduler promises a seed the same tokens either way.
Exactness: a verify pass holds at most `speculative.VERIFY_MAX` tokens, where the C kernels give every token the
logits and state a one-token pass gives (batch invariance), so the accepted rows equal plain decode's rows.
"""

from __future__ import annotations

import time

import torch

from ..model.state import ModelState
from . import speculative as sp
from .sampling import SamplingParams, argmax, processed_logits


def _greedy_pick(logits: torch.Tensor) -> tuple[int, None]:
    return argmax(logits), None


def draft_step(
    drafter: sp.Drafter,
    schedule: sp.Schedule,
    stats: sp.SpeculativeStats,
    state: ModelState,
    tokens: list[int],
    room: int,
    sampling: tuple[SamplingParams, torch.Generator] | None = None,
) -> tuple[torch.Tensor, list[int] | None]:
    """Decode the pending token `tokens[-1]` (at position m = state.length; `tokens` are the ids of positions
    0..m) with up to `room` drafts after it. Returns (logits [n+1, V] of the positions kept: rows 0..n-1 pick the
    n accepted drafts, row n the next token; the tokens picked: None when greedy (each row's argmax), else the n
    accepted drafts and the token drawn after them with `sampling` = (params, the request's generator)); the state
    then holds positions < m+1+n. With no draft (the schedule chose none, `room` is 0, or the drafter's last pass
    on this state did not cover position m-1 with these tokens: a batched step ran since) it is a plain one-token
    pass through the drafter (sampled: one draw from its processed distribution, as `Sampler` draws), which
    brings the draft's context up to date for the next step."""
    m, anchor = state.length, tokens[-1]
    assert len(tokens) == m + 1, (len(tokens), m)
    t0 = time.perf_counter()
    if schedule.retired and not drafter.paused:
        drafter.paused, stats.mode = True, stats.mode + " (off: drafting did not pay)"
    elif schedule.adaptive and not schedule.retired:
        drafter.paused = schedule.mode == "plain"  # `auto` in a plain epoch: no context upkeep either
    rec = drafter.pass_of(state)
    # the draft reads the hidden row of position m-1 from the drafter's last pass on this state, if that pass
    # covered it with the tokens the sequence really has (a rejected draft's row, or a batched step, does not)
    current = rec is not None and rec.p0 < m <= rec.p0 + len(rec.ids) and tokens[rec.p0 : m] == rec.ids[: m - rec.p0]
    prop, n_drafts = None, 0
    if current and room > 0 and not drafter.paused and schedule.want_draft(drafter.max_drafts):
        pick = _greedy_pick if sampling is None else sp._picker(*sampling)  # sampled: q drawn with its generator
        prop = drafter.propose(state, anchor, room, pick)
        stats.draft_calls += 1
        n_drafts = schedule.choose(prop.confidence)
    drafts = prop.tokens[:n_drafts] if prop else []
    if drafts:
        stats.prefetched += sp._prefetch(drafter.model, [anchor] + drafts)
    t1 = time.perf_counter()
    stats.draft_seconds += t1 - t0
    out, _ = drafter.forward([anchor] + drafts, state, all_logits=True)  # [L+1, V]
    t2 = time.perf_counter()
    schedule.observe_time(len(drafts) + 1, t2 - t1, (t1 - t0) if prop else None)
    if sampling is None:
        n, _ = sp.accept_greedy(out, drafts)
        picks = None
    else:
        params, gen = sampling
        p = torch.softmax(torch.stack([processed_logits(r, params) for r in out]), dim=-1)  # [L+1, V]
        n, nxt = sp.accept_sampled(p, prop.probs[: len(drafts)] if drafts else None, drafts, gen)
        picks = drafts[:n] + [nxt]
    schedule.observe_step(n + 1, t2 - t0, verified=bool(drafts))
    if drafts:
        stats.passes += 1
        stats.verify_seconds += t2 - t1
        stats.drafted += len(drafts)
        stats.accepted += n
        stats.accept_counts += [0] * (len(drafts) + 1 - len(stats.accept_counts))
        stats.accept_counts[n] += 1
        for k in range(min(n + 1, len(drafts))):  # the slots actually tried
            seen = float(k < n) if sampling is None else sp.expected_acceptance(p[k], prop.probs[k], drafts[k])
            schedule.observe(k, seen, prop.confidence[k])
        if n < len(drafts):
            state.truncate(m + 1 + n)  # drop the rejected drafts' positions (within max_rollback: < VERIFY_MAX)
    else:
        stats.plain_steps += 1
        stats.plain_seconds += t2 - t1
    return out[: n + 1], picks
