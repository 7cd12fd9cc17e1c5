"""Choice groups: several choices of one prompt (the server's `n` and `best_of`) in the step scheduler.

Owns: `ChoiceGroups`, the scheduler's bookkeeping for them: checking a group's arguments (`check_group`), splitting
a group into the choices forked as soon as its prompt is prefilled and those held back beyond `max_batch`, forking
the prefilled state for each (`ModelState.fork`) and counting the live forks (`forked_states` and its peak), the
kept copy (state and last logits) held choices fork from, and giving held choices the rows that free, oldest first.
Does not own: the requests, the wait queue, admission, sampling or finishing a request (`scheduler.Scheduler`, which
passes those in as callables). A request here is the scheduler's, used through its choice fields: `forks`, `held`,
`forked`, `state`, `done`, `cached`, `scores`, `handle`, `chunks`.

The prompt is prefilled once, by the first choice; when its last chunk has run, the state is forked for every other
choice (a copy of the rows the next tokens read, not of those kept for long rollbacks), each choice samples the same
last logits with its own sampler, and from then on the choices are independent rows of the batch. A fork is exact,
so each choice's chunks equal a request of its own with its params. The group takes one row per choice, up to
`max_batch`: the choices beyond it are held back, and the prefilled state is kept once (one more fork, with the last
logits) for them; each held choice is forked from that kept copy when a row frees (before any waiting request is
admitted), the last one taking the copy itself. So a group of any width holds at most `max_batch` rows' states plus
that one copy, never one state per choice (`forked_states_peak` counts them).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import speculative
from .prompt_logprobs import PromptLogprobs
from .sampling import SamplingParams


def check_group(
    params: list, on_chunk: list | None, on_error: list | None, cancel: list | None, on_progress: object = None
) -> tuple:
    """A group's per-choice arguments, each a list of one entry per choice (None: all None). Raises `ValueError`
    for no choice, differing `max_tokens`, or a list of another length; `TypeError` for a callback that cannot be
    called or a cancel that is no `threading.Event` (found only by the worker, they failed every request in the
    batch)."""
    k = len(params)
    bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
    if bad is not None:
        raise TypeError(f"params must be a SamplingParams (or pass keyword arguments), got {type(bad).__name__}")
    if k < 1 or len({p.max_tokens for p in params}) != 1:
        raise ValueError(f"submit_choices needs at least one choice, all with the same max_tokens (got {k})")
    on_chunk, on_error, cancel = on_chunk or [None] * k, on_error or [None] * k, cancel or [None] * k
    if not len(on_chunk) == len(on_error) == len(cancel) == k:
        raise ValueError("on_chunk, on_error and cancel need one entry per choice")
    for name, fn in [*(("on_chunk", f) for f in on_chunk), *(("on_error", f) for f in on_error)]:
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable, got {fn!r}")
    if on_progress is not None and not callable(on_progress):
        raise TypeError(f"on_progress must be callable as (done, total), got {on_progress!r}")
    bad = next((c for c in cancel if c is not None and not isinstance(c, threading.Event)), None)
    if bad is not None:
        raise TypeError(f"cancel must be a threading.Event, got {type(bad).__name__}")
    return on_chunk, on_error, cancel


@dataclass(eq=False)
class _Held:
    """Choices of a prefilled prompt waiting for a row: the kept copy of its state and last logits they fork from."""

    state: object
    logits: torch.Tensor
    done: int
    cached: int
    scores: PromptLogprobs | None
    choices: deque


class ChoiceGroups:
    """The choice groups of one scheduler (see the module docstring). Called on its worker thread only, but for
    `group` (under the scheduler's lock) and `drain` (under it too)."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.held: deque[_Held] = deque()  # choices of prefilled prompts waiting for a row (before waiting requests)
        self.forked_states = 0  # live states forked for choices (held copies included)
        self.forked_states_peak = 0

    def group(self, reqs: list):
        """The request that prefills the prompt for all of `reqs` (the first), the next ones forked from it after
        prefill, up to `max_batch` in all, the rest held."""
        req = reqs[0]
        req.forks, req.held = reqs[1 : self.max_batch], reqs[self.max_batch :]
        return req

    def new_fork(self, state):
        self.forked_states += 1
        self.forked_states_peak = max(self.forked_states_peak, self.forked_states)
        return state.fork(speculative.VERIFY_MAX)

    def release(self, req) -> None:
        """req's state is dropped: no longer counted if it was a fork."""
        self.forked_states -= req.forked
        req.forked = False

    def hold(self, req, logits: torch.Tensor) -> None:
        """Keep req's prefilled state once (a fork, with its last logits) for its held choices, if any: before req
        decodes (its state changes, or goes to prefix memory, from then on)."""
        if req.held:
            held, req.held = req.held, []
            self.held.append(_Held(self.new_fork(req.state), logits, req.done, req.cached, req.scores, deque(held)))

    def fork(self, req, cancelled: Callable[[object, int], None]) -> list:
        """The other choices of req's prompt, now prefilled, each with a fork of its state (enough to roll a verify
        pass back), for the batch; one cancelled meanwhile goes to `cancelled(choice, cached)`."""
        forked, forks, req.forks = [], req.forks, []
        for f in forks:
            if f.handle.cancelled:
                cancelled(f, req.cached)
                continue
            f.state, f.done, f.cached, f.forked = self.new_fork(req.state), req.done, req.cached, True
            forked.append(f)
        return forked

    def unhold(
        self,
        has_row: Callable[[object], bool],
        cancelled: Callable[[object, int], None],
        join: Callable[[object, torch.Tensor], None],
    ) -> None:
        """Fork held choices into the rows that are free (`has_row(choice)`), oldest first, each then given to
        `join(choice, last logits)`; a cancelled one goes to `cancelled(choice, cached)`. The last choice of a group
        takes the kept copy itself."""
        while self.held:
            h = self.held[0]
            f = h.choices[0]
            if not f.handle.cancelled and not has_row(f):
                return
            h.choices.popleft()
            if not h.choices:
                self.held.popleft()
            if f.handle.cancelled:
                cancelled(f, h.cached)
                if not h.choices:
                    self.forked_states -= 1  # the kept copy, no longer needed
                continue
            f.state = h.state if not h.choices else self.new_fork(h.state)
            f.done, f.cached, f.scores, f.forked = h.done, h.cached, h.scores, True
            join(f, h.logits)

    def drain(self) -> list:
        """Every held choice, the held groups and the fork count cleared (the worker failed)."""
        held, self.held = [f for h in self.held for f in h.choices], deque()
        self.forked_states = 0
        return held
