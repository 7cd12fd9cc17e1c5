"""Continuous batching: a step scheduler that serves many requests at once, each bit-identical to serving it alone.

Owns: `Scheduler` (admission, the bounded wait queue, one step = one decode token of every active sequence plus
one prefill chunk of a waiting prompt, when the chunks have not used up their share of the time while others
decode (`pacing.PrefillPacer`; a prompt's chunk gives way between its layers, `pacing.SlicedChunk`),
cancellation, prefix reuse from RAM and disk); what `submit` returns is a `handle.Handle` (a submitted request:
its chunks and its cancel switch); a full queue raises `fastar.errors.QueueFull`.
Does not own: the forward pass (`DeepseekV4.forward` for prefill chunks, `DeepseekV4.forward_rows` for the batched
decode step), sampling (`Sampler`), turning tokens into chunks (`generate.ChunkMaker`, the same code `Engine.stream`
uses), the prefix caches themselves (`prefix_cache`), the bookkeeping of several choices of one prompt (`choices`:
splitting a group, forking its state, holding back choices beyond the batch), the counters and the /metrics dict
(`batch_metrics`).

Threads: `submit` and `Handle.cancel` may be called from any thread; `step` (and `run`, which loops over it)
only from the one worker thread that owns the engine; a scheduler without one (a library caller that submits and
iterates) is stepped by the threads iterating its handles (`stepper.Stepper`: steps never overlap).

Exactness. A request's tokens do not depend on what else runs:
  * its prompt is prefilled alone, in chunks of the engine's `prefill_chunk` tokens from its first uncached
    position, one `forward` call per chunk: the calls `Session.prefill` makes for it alone (decode steps of
    others run between a chunk's layers touch only their own states);
  * each decode step runs the next token of up to `ops.SMALL_CHUNK` (8) sequences in one `forward_rows` call
    (more in groups of 8), which gives every row the logits a one-token `forward` on its own state gives
    (batch-invariant kernels; tests/test_scheduler.py compares whole generations);
  * each request samples from its own `Sampler` (its own seeded generator) and applies its own stops.
So with the C kernels' SIMD path, in either numerics, a request gets the tokens `Engine.stream` gives it on a fresh
session (with a drafter too: speculative decoding is bit-identical to plain decoding).

Prefix reuse: a prompt starts from the longest prefix it shares with a kept state, from RAM (`PrefixMemory`: the
states of recently finished requests, `keep_states` of them) or, when longer, from disk (`PrefixCache`), and
prefills only the rest, as `Engine.stream` does when it continues a session. Then its prompt is chunked from
that position, so (as with a session) its bits equal a fresh prefill's only where the kernels are chunk-invariant.

Prompt logprobs (`SamplingParams.prompt_logprobs`): such a request prefills from its first position (no prefix
reuse: every position's final streams are scored) and feeds each chunk's streams to a `PromptScorer`, which applies
the LM head a few positions at a time; its first chunk carries the `PromptLogprobs` (the numbers
`Engine.prompt_logprobs` gives). With max_tokens 0 it is scored only: one chunk, no token.

Speculative decoding (with the engine's drafter, `--draft`): while exactly one sequence is active (decoding, with
nothing else prefilling or loading) and its request is greedy, each step decodes it with the drafter's
propose/verify step (`draft_step.draft_step`: up to `speculative.VERIFY_MAX` tokens a pass, rejected drafts
rolled back), which gives the tokens plain decoding gives (verify passes are batch-invariant). A lone sampled
request (temperature > 0) without a `seed` drafts too, with lossless speculative sampling (`draft_step.draft_step`
with its sampler's generator: each token is distributed exactly as a plain step's draw, though from other random
numbers); with a `seed` it stays on plain steps, whose one draw per token is what makes its tokens reproducible
whatever else runs. As soon as another request is admitted, steps are plain batched steps again: drafting would
hold the others' next tokens back behind a wider pass and, the batch already sharing the weight reads, pays little.
A constrained request (`SamplingParams.grammar`) never drafts: drafts are not checked against the grammar's mask,
so it decodes plainly, one token a step, its mask applied to its own row by its own `Sampler` (a free request in
the same step does no mask work). Nor does a request with a logit bias or a penalty (drafts are verified
against the model's own logits). Prompts that may draft are prefilled through the drafter so its context is ready.

Prefix states on disk are read and parsed on the prefix cache's loader thread (`PrefixCache.lookup_async`); the
request waits for it (neither prefilling nor decoding) while the others keep stepping, and the worker only adopts
the parsed state. Storing snapshots the state here and serializes it on the cache's writer thread.

Several choices of one prompt (`submit_choices`: the server's `n` and `best_of`): the prompt is prefilled once, by
the first choice, then its state is forked for the others (`ModelState.fork`, exact), at most `max_batch` rows at
once; the choices beyond wait for rows freed later. `choices.ChoiceGroups` keeps that bookkeeping (see its
docstring; `metrics()["forked_states_peak"]` counts the forked states).

Admission: a request waits in a FIFO queue of at most `max_queue` (beyond: `QueueFull`, which a server answers
with 503 and Retry-After); it becomes active when fewer than `max_batch` are active and, with `token_budget`, when
its prompt plus max_tokens fits beside the active ones' (a request alone is always admitted, so none starves; a group
of choices counts one row and max_tokens per choice it forks at once, at most max_batch; its held choices take rows
freed later before any waiting request, by the same two bounds).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..encoding import THINK_START
from ..errors import QueueFull  # noqa: F401 (importable from here too)
from ..model import ops
from . import speculative
from .batch_metrics import BatchMetrics
from .choices import ChoiceGroups, check_group
from .constraint import ConstraintError
from .draft_step import draft_step
from .generate import ChunkMaker, GenerationChunk
from .handle import Handle  # (importable from here too)
from .pacing import MAX_STALL, ChunkCancelled, PrefillPacer, SlicedChunk, stall_limit
from .prefix_cache import PrefixMemory
from .prompt_logprobs import PromptLogprobs, PromptScorer
from .sampling import Sampler, SamplingError, SamplingParams, report
from .session import token_ids
from .stepper import Stepper
from .thinking_budget import ThinkingBudget, next_token


@dataclass(eq=False)
class _Request:
    ids: list[int]
    params: SamplingParams
    handle: Handle
    emit: Callable[[GenerationChunk], None]
    chunks: ChunkMaker
    sampler: Sampler
    submitted: float
    on_progress: Callable[[int, int], None] | None = None
    state: object = None
    done: int = 0  # prompt tokens processed (cached ones included)
    cached: int = 0  # prompt tokens taken from the prefix cache
    pending: int | None = None  # the sampled token decode runs next
    loading: Future | None = None  # the prefix state being read from disk (off the worker thread)
    scorer: PromptScorer | None = None  # with `params.prompt_logprobs`: scores the prompt as it prefills
    scores: PromptLogprobs | None = None  # its result, for this choice's first chunk
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None
    forks: list[_Request] = field(default_factory=list)  # the other choices of its prompt, forked after prefill
    held: list[_Request] = field(default_factory=list)  # choices beyond max_batch: forked later from a kept copy
    forked: bool = False  # its state is a fork of its prompt's (counted in the scheduler's forked states)
    budget: ThinkingBudget | None = None  # forces `</think>` when its thinking budget is spent

    @property
    def cost(self) -> int:
        return len(self.ids) + self.params.max_tokens + sum(f.params.max_tokens for f in self.forks)

    @property
    def slots(self) -> int:
        """Rows of the batch it takes (each choice not yet forked counts)."""
        return 1 + len(self.forks)

    @property
    def all_cancelled(self) -> bool:
        """Cancelled, and so is every choice still waiting for its prompt (only then may the prompt stop)."""
        return self.handle.cancelled and all(f.handle.cancelled for f in [*self.forks, *self.held])


class Scheduler:
    """Serves requests in steps on one engine (see the module docstring).

    Args:
        engine: the `Engine` (its model, prefill_chunk, tokenizer, context length and counters).
        max_batch: sequences active at once (prefilling or decoding).
        max_queue: requests waiting beyond those; one more raises `QueueFull`.
        token_budget: bound on the sum of prompt + max_tokens over the active requests (None: no bound).
        prefix_cache: a `PrefixCache`: prompts that extend a cached prefix load its state and prefill only the
            rest; states are saved at the end of each prompt and of each reply.
        keep_states: states of finished requests kept in RAM for prefix reuse (`PrefixMemory`; 0: none).
        draft: draft a lone greedy sequence with the engine's drafter, if it has one (False: never draft).
        prefill_share: the part of the time prompts' prefill chunks may take while other sequences decode, in
            (0, 1] (`PrefillPacer`; 1: a chunk every step). No token depends on it.
        max_stall: seconds the decoding sequences wait at most for a step while a prompt within one chunk prefills
            (a decode step then runs between two of its layers; `SlicedChunk`), a positive number. Lower: smoother
            streaming for the others; higher: that prompt's first token sooner. No token depends on it.
    """

    def __init__(
        self,
        engine,
        max_batch: int = 8,
        max_queue: int = 64,
        token_budget: int | None = None,
        prefix_cache=None,
        keep_states: int = 0,
        draft: bool = True,
        prefill_share: float = 0.5,
        max_stall: float = MAX_STALL,
    ) -> None:
        sizes = {
            "max_batch": max_batch,
            "max_queue": max_queue,
            "token_budget": token_budget,
            "keep_states": keep_states,
        }
        bad = next((k for k, v in sizes.items() if not isinstance(v, int | None) or isinstance(v, bool)), None)
        if bad is not None or keep_states is None:
            bad = bad or "keep_states"
            raise TypeError(f"{bad} must be an integer, got {sizes[bad]!r}")
        if not isinstance(draft, bool):  # "no" is true
            raise TypeError(f"draft must be True or False, got {draft!r}")
        max_stall = stall_limit(max_stall)
        if max_batch < 1 or max_queue < 0 or (token_budget is not None and token_budget < 1):
            raise ValueError(
                f"max_batch must be >= 1, max_queue >= 0 and token_budget >= 1 or None "
                f"(got {max_batch}, {max_queue}, {token_budget})"
            )
        self.engine, self.model = engine, engine.model
        self.max_batch, self.max_queue, self.token_budget = max_batch, max_queue, token_budget
        self.prefix_cache = prefix_cache
        # a prompt ending in the thinking generation prompt is stored without that token (see _prefill)
        self._think_start = engine.tokenizer.token_to_id(THINK_START)
        self.memory = PrefixMemory(keep_states)
        self.draft = draft
        self._landed = False  # a disk load finished since the worker last looked (guarded by _lock)
        self._lock = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._active: list[_Request] = []  # admission order: prefilling ones, then decoding
        self._groups = ChoiceGroups(max_batch)  # choices of groups: forked states, held choices
        self._metrics = BatchMetrics()
        self._pacer = PrefillPacer(prefill_share)
        self.max_stall = max_stall  # seconds decoding sequences wait at most for a step while a short prompt prefills
        self._stepper = Stepper(self._step, self._fail_all)  # who steps: the worker, or a handle's iterator

    @property
    def prefill_share(self) -> float:
        """The part of the time prompts' prefill chunks may take while others decode (`PrefillPacer.share`)."""
        return self._pacer.share

    # --- any thread ---------------------------------------------------------------------------------------

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        on_chunk: Callable[[GenerationChunk], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        cancel: threading.Event | None = None,
        **sampling,
    ) -> Handle:
        """Queue a request (token ids or raw text). Raises `PromptError`/`SamplingError` for a bad request and
        `QueueFull` when the queue is full, here, before anything runs.

        Args:
            on_chunk: called on the worker thread with each chunk (instead of queueing it for iteration).
            on_error: called on the worker thread with the exception when a step fails (instead of raising it
                from iteration); the request is over then, with no last chunk.
            on_progress: called on the worker thread as (prompt tokens done, prompt tokens) after each prefill
                chunk (cached tokens count as done).
            cancel: the event that cancels the request (`Handle.cancel` sets it); a new one by default.
        """
        if params is None:
            params = SamplingParams.from_kwargs(**sampling)
        elif sampling:
            raise TypeError("pass either params or sampling keyword arguments, not both")
        return self.submit_choices(prompt, [params], [on_chunk], [on_error], on_progress, [cancel])[0]

    def submit_choices(
        self,
        prompt: str | list[int],
        params: list[SamplingParams],
        on_chunk: list[Callable[[GenerationChunk], None] | None] | None = None,
        on_error: list[Callable[[BaseException], None] | None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        cancel: list[threading.Event | None] | None = None,
    ) -> list[Handle]:
        """Queue several choices of one prompt (`n`, `best_of`): one `Handle` per entry of `params`, each choice
        getting exactly the chunks `submit(prompt, params[i])` would give. The prompt is prefilled once; its state
        is then forked for every other choice (`ModelState.fork`) and the choices decode as rows of the batch. The
        group takes one row per choice, at most `max_batch`; the others wait for rows (see the module docstring).
        `on_chunk`, `on_error`, `cancel`: one per choice (as for `submit`);
        `on_progress`: the shared prompt's. All choices have the same `max_tokens`. Raises as `submit` does."""
        on_chunk, on_error, cancel = check_group(params, on_chunk, on_error, cancel, on_progress)
        eng = self.engine
        ids = eng.tokenizer.encode(prompt) if isinstance(prompt, str) else token_ids(prompt)
        session_check(eng, ids)
        reqs = []
        for p, chunk_fn, error_fn, event in zip(params, on_chunk, on_error, cancel, strict=True):
            handle = Handle(event or threading.Event(), error_fn, self.drive, queued=chunk_fn is None)
            reqs.append(
                _Request(
                    ids,
                    p,
                    handle,
                    chunk_fn or handle._chunks.put,
                    ChunkMaker(eng.tokenizer, p, eng.config.eos_token_id, len(ids), eng.context_length),
                    Sampler(p, ids, eng.config.eos_token_id, eng.config.vocab_size),
                    time.perf_counter(),
                    on_progress if not reqs else None,
                    budget=ThinkingBudget.of(p, eng.tokenizer),
                )
            )
        req = self._groups.group(reqs)
        with self._lock:
            free = max(0, self.max_batch - len(self._active))  # waiting requests the next step admits
            if len(self._waiting) >= self.max_queue + free:
                self._metrics.counts["rejected"] += 1
                raise QueueFull(
                    f"the server is busy: {len(self._waiting)} requests are waiting (max_queue {self.max_queue})",
                    retry_after=self._metrics.retry_after(),
                )
            self._waiting.append(req)
            self._metrics.counts["submitted"] += len(reqs)
            self._lock.notify_all()
        return [r.handle for r in reqs]

    def metrics(self) -> dict:
        """Counters for /metrics: active sequences, queued requests, the batch-size histogram (decode rows per
        model call -> calls), step time, decode tokens/s per sequence (active ones and recently finished), the
        prefill progress of prompts being processed ((done, total) each, in admission order), prefix reuse from
        RAM and disk."""
        with self._lock:
            active = list(self._active)
            queued = len(self._waiting)
        return self._metrics.report(active, queued, self.memory, self.prefix_cache, self._groups)

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._waiting and not self._active

    # --- the worker thread --------------------------------------------------------------------------------

    def run(
        self, stop: threading.Event, idle_wait: float = 0.5, after_step: Callable[[bool], object] | None = None
    ) -> None:
        """Step while there is work, sleep on new submissions otherwise, until `stop` is set.

        `after_step(idle)`: called on this thread after every step (and every idle wake-up, each `idle_wait`
        seconds), outside the scheduler's lock so submissions go on, with whether the scheduler has no request
        left. The server hands freed heap memory back to the OS there (`fastar.serve.heap`)."""
        with self._stepper.running():
            while not stop.is_set():
                busy = self._stepper.failing_step()
                if after_step is not None:
                    after_step(not busy and self.idle)
                with self._lock:
                    if (not busy and not self._waiting and not self._active) or self._only_loading():
                        self._lock.wait(idle_wait)  # a submission or a finished disk load wakes it

    def drive(self) -> bool:
        """What an iterating `Handle` calls while its next chunk has not come: one step on this thread when no
        worker steps the scheduler (`Stepper.drive`); False when a worker does."""
        if not self._stepper.drive():
            return False
        with self._lock:
            if self._only_loading():
                self._lock.wait(Handle.WORKER_CHECK_S)  # a finished disk load wakes it, as it wakes `run`
        return True

    def _fail_all(self, err: BaseException) -> None:
        """End every queued and active request with `err` (their iterators raise it)."""
        with self._lock:
            reqs, self._waiting = [*self._waiting, *self._active], deque()
            held = self._groups.drain()
            self._active = []
        for r in reqs:
            for member in (r, *r.forks, *r.held):
                member.handle._fail(err)
        for f in held:
            f.handle._fail(err)

    def run_until_idle(self) -> None:
        """Step until every request has finished, and its states are on disk."""
        while self.step():
            with self._lock:
                while self._only_loading():
                    self._lock.wait()
        self.flush()

    def flush(self) -> None:
        """Wait until the prefix states saved so far are written (the disk cache writes on its own thread)."""
        if self.prefix_cache is not None:
            self.prefix_cache.flush()

    def _only_loading(self) -> bool:
        """(Under _lock.) Nothing can run until a disk load finishes: every active request is loading, none has
        landed, and no waiting request could be admitted."""
        return (
            bool(self._active)
            and all(r.loading is not None for r in self._active)
            and not self._landed
            and not (self._waiting and len(self._active) < self.max_batch)
        )

    def step(self) -> bool:
        """One step: drop cancelled requests, admit waiting ones, adopt the prefix states loaded from disk, decode
        one token of every decoding sequence (groups of 8 per model call; a lone greedy one: a draft/verify step),
        then one prefill chunk of the prefilling prompt with the fewest tokens left (the oldest of those). Returns
        whether work remains. The calling thread is the scheduler's worker while the step lasts, not after it
        (`Stepper`): a handle iterated on another thread once it returned steps the scheduler itself."""
        return self._stepper.step()

    def _step(self) -> bool:
        t0 = time.perf_counter()
        self._drop_cancelled()
        self._unhold()
        self._admit()
        self._adopt_loaded()
        decoding = [r for r in self._active if r.pending is not None]
        if self._can_draft(decoding):
            self._draft(decoding[0])
        else:
            self._decode_all(decoding)
        if decoding:
            self._pacer.decoded(time.perf_counter() - t0)
        prefilling = [r for r in self._active if r.pending is None and r.loading is None]
        gave = 0.0  # seconds of decode steps run between a sliced chunk's layers (counted as steps of their own)
        if prefilling:
            # the prompt with the fewest tokens left (the oldest of those): a short request that arrives while a long
            # prompt prefills waits for one of its chunks, not for all of them (the prompts' numbers do not change)
            req = min(prefilling, key=lambda r: len(r.ids) - r.done)
            # while others decode, the chunks keep to their share of the time (`PrefillPacer`)
            if self._pacer.may_prefill(bool(decoding), len(req.ids) - req.done <= self.engine.prefill_chunk):
                gave = self._prefill_chunk(req)
        if decoding or prefilling:
            self._metrics.stepped(time.perf_counter() - t0 - gave)
        with self._lock:
            return bool(self._waiting or self._active or self._groups.held)

    def _drop_cancelled(self) -> None:
        """Drop cancelled requests; a prompt shared by several choices only once all of them are cancelled."""
        with self._lock:
            gone = [r for r in self._waiting if r.all_cancelled]
            for r in gone:
                self._waiting.remove(r)
        for r in gone:
            for f in [*r.forks, *r.held]:
                self._finish(f, f.chunks.cancelled(0), count="cancelled", active=False)
            self._finish(r, r.chunks.cancelled(0), count="cancelled", active=False)
        for r in [r for r in self._active if r.all_cancelled]:
            self._drop_active(r)

    def _drop_active(self, r: _Request) -> None:
        """Finish the active request r, cancelled (every choice of its prompt is)."""
        for f in [*r.forks, *r.held]:
            self._finish(f, f.chunks.cancelled(r.cached), count="cancelled", active=False)
        r.forks, r.held = [], []
        last = r.chunks.cancelled(r.cached) if not r.generated else r.chunks.finish_cancelled(r.cached)
        self._finish(r, last, count="cancelled")

    def _unhold(self) -> None:
        """Give held choices the rows that are free (as `_admit` counts rows and the token budget), oldest first."""
        self._groups.unhold(self._has_row, self._cancel_choice, self._join)

    def _has_row(self, req: _Request) -> bool:
        if not self._active:
            return True
        if sum(r.slots for r in self._active) >= self.max_batch:
            return False
        in_flight = sum(r.cost for r in self._active)
        return self.token_budget is None or in_flight + req.cost <= self.token_budget

    def _cancel_choice(self, req: _Request, cached: int) -> None:
        self._finish(req, req.chunks.cancelled(cached), count="cancelled", active=False)

    def _join(self, req: _Request, logits: torch.Tensor) -> None:
        """A held choice, forked, takes its row and samples its prompt's last logits."""
        with self._lock:
            self._active.append(req)
        self._sampled(req, logits)

    def _admit(self) -> None:
        admitted = []
        with self._lock:
            while self._waiting and not self._groups.held:  # held choices of an admitted group take free rows first
                req = self._waiting[0]
                used = sum(r.slots for r in self._active)
                if self._active and used + req.slots > self.max_batch:  # a group alone is always admitted
                    break
                in_flight = sum(r.cost for r in self._active)
                if self._active and self.token_budget is not None and in_flight + req.cost > self.token_budget:
                    break
                self._waiting.popleft()
                self._active.append(req)
                admitted.append(req)
        for req in admitted:
            self._start(req)

    def _start(self, req: _Request) -> None:
        stats = self.engine.counters
        stats.requests += 1
        stats.prompt_tokens += len(req.ids)
        if req.params.prompt_logprobs is not None:  # every position's streams are scored: no prefix reuse
            req.scorer = PromptScorer(self.model, req.ids, req.params.prompt_logprobs)
            self._adopt(req, None, reuse=False)
            return
        if req.params.max_tokens == 0:  # (every choice's: they share it)
            for f in [*req.forks, *req.held]:
                self._finish(f, f.chunks.empty(), active=False)
            req.forks, req.held = [], []
            self._finish(req, req.chunks.empty())
            return
        limit = len(req.ids) - 1  # the prompt's last token must run: its logits give the first token
        # read from disk only what beats RAM (RAM's entry then stays kept); a miss is known from the file names
        better = self.memory.match(req.ids, limit) if self.prefix_cache is not None else 0
        if self.prefix_cache is not None and self.prefix_cache.candidates(req.ids, limit, better):
            req.loading = self.prefix_cache.lookup_async(req.ids, limit, better_than=better)
            req.loading.add_done_callback(self._on_landed)
            return
        if self.prefix_cache is not None:
            self.prefix_cache.note_miss()
        self._adopt(req, None)

    def _on_landed(self, _future: Future) -> None:  # the loader thread (or this one, if already done)
        with self._lock:
            self._landed = True
            self._lock.notify_all()

    def _adopt_loaded(self) -> None:
        """Start the requests whose disk lookup has finished from what it found (RAM's best match otherwise)."""
        with self._lock:
            self._landed = False  # cleared before looking: a load landing after this sets it again
        for req in [r for r in self._active if r.loading is not None and r.loading.done()]:
            future, req.loading = req.loading, None
            self._adopt(req, future.result())

    def _adopt(self, req: _Request, hit: tuple | None, reuse: bool = True) -> None:
        stats = self.engine.counters
        hit = hit or (self.memory.take(req.ids, len(req.ids) - 1) if reuse else None)
        req.state, req.done = hit if hit is not None else (self.model.new_state(), 0)
        if hit is not None:
            req.cached = req.done
            self._metrics.counts["cache_hits"] += 1
            self._metrics.counts["cache_tokens"] += req.done
            stats.cached_tokens += req.done
        if req.on_progress is not None:
            req.on_progress(req.done, len(req.ids))

    def _prefill_chunk(self, req: _Request, nested: bool = False) -> float:
        """The next `prefill_span` tokens of req's prompt (as `Session.prefill` runs them); after the last, the
        first token is sampled. While other sequences decode, one `prefill_chunk` only, so a paged span (several
        chunks, the same numbers) does not hold their next tokens back. Every chunk gives way between its layers
        (`SlicedChunk`): to the decode steps the pacer owes where the prompt is longer than one chunk, else to a step
        once the decoding sequences have waited `max_stall`; and to the shorter prompts that came, prefilled there
        (`_start_short`), unless this chunk is one of those (`nested`). Returns the seconds spent in that work."""
        decoding = any(r.pending is not None for r in self._active)
        size = self.engine.prefill_chunk if decoding else self.engine.prefill_span
        part = req.ids[req.done : req.done + size]
        stats = self.engine.counters
        t = time.perf_counter()
        sliced = self._sliced(req, nested)
        state = req.state
        before, state.on_layer = state.on_layer, self._on_layer(req, len(part), sliced)
        try:
            if self._drafter is not None and self._may_draft(req):  # it may draft later: keep the draft's context
                logits, X = self._drafter.forward(part, req.state, all_logits=False)
            else:
                # the prompt's last chunk: a lone choice reads its first token's argmax (or race) alone, so the head
                # may be screened; held and forked choices draw from the same logits with their own samplers
                lone = req.done + len(part) == len(req.ids) and not req.forks and not req.held
                want = req.sampler.head_request() if lone else False
                logits, X = self.model.forward(
                    part, req.state, all_logits=False, chunk=self.engine.paged_chunk, argmax_only=want
                )
        except ChunkCancelled:  # its layers part advanced: the state is of no use to anyone (not kept for reuse)
            req.state = None
            self._drop_active(req)
            return sliced.gave
        finally:
            state.on_layer = before
        sliced.end()
        gave = sliced.gave
        if req.scorer is not None:
            req.scorer.feed(X)
        stats.prefill_seconds += time.perf_counter() - t - gave
        stats.prefill_tokens_computed += len(part)
        req.done += len(part)
        if req.on_progress is not None:
            req.on_progress(req.done, len(req.ids))
        if req.done < len(req.ids):
            return gave
        if self.prefix_cache is not None:
            # An identical prompt gains nothing from its last token either: that token must run again.
            resent = self._resent(req.ids)
            self.prefix_cache.store(req.ids, req.state, keep=resent if resent < len(req.ids) else None)
        if req.scorer is not None:  # every choice's first chunk carries the prompt's scores
            req.scores, req.scorer = req.scorer.result(), None
            for f in [*req.forks, *req.held]:
                f.scores = req.scores
        if req.params.max_tokens == 0:  # scored only (prompt logprobs): nothing to generate, for any choice
            for r in [*req.forks, *req.held, req]:
                last = r.chunks.empty()
                last.prompt_logprobs = r.scores
                self._finish(r, last, active=r is req)
            req.forks, req.held = [], []
            return gave
        self._groups.hold(req, logits[-1])  # held choices' copy, kept before req decodes
        forked = self._groups.fork(req, self._cancel_choice)
        with self._lock:
            self._active.extend(forked)
        self._sampled(req, logits[-1])
        for f in forked:  # each samples the same last logits with its own sampler, as it would alone
            self._sampled(f, logits[-1])
        return gave

    def _sliced(self, req: _Request, nested: bool) -> SlicedChunk:
        """req's next chunk, giving way between its layers to this scheduler's other requests: a long prompt's
        (longer than one chunk) at the pacer's share, a short one's to a decode step where they have waited
        `max_stall` (at share 1 to none: a chunk every step, unbroken); to shorter prompts unless `nested` (itself
        one of those)."""
        left = len(req.ids) - req.done
        paced = len(req.ids) - req.cached > self.engine.prefill_chunk or self._pacer.share == 1.0
        return SlicedChunk(
            self._pacer,
            decode=self._decode_owed,
            start_short=(lambda: None) if nested else (lambda: self._start_short(left)),
            decoding=self._decoding,
            cancelled=lambda: req.all_cancelled,
            stall=None if paced else self.max_stall,
            stalled=self._stalled,
        )

    @staticmethod
    def _on_layer(req: _Request, tokens: int, sliced: SlicedChunk) -> Callable[[int, int], None]:
        """What the model calls after each layer of req's chunk of `tokens`: `sliced`, after reporting the prompt's
        progress layer by layer (as a session does) where req asks for progress."""
        if req.on_progress is None:
            return sliced
        base, report = req.done, req.on_progress

        def on_layer(i: int, n: int) -> None:
            if i < n:  # (the chunk's end is reported once it is done)
                report(base + tokens * i // n, len(req.ids))
            sliced(i, n)

        return on_layer

    def _decode_all(self, decoding: list[_Request]) -> None:
        """The next token of every sequence in `decoding`, `ops.SMALL_CHUNK` rows a model call."""
        for a in range(0, len(decoding), ops.SMALL_CHUNK):
            self._decode(decoding[a : a + ops.SMALL_CHUNK])

    def _decoding(self) -> bool:
        return any(r.pending is not None for r in self._active)

    def _stalled(self) -> float:
        """Seconds the decoding sequence that waits longest has waited since its last token (0 when none decodes)."""
        last = [r.last_token_at for r in self._active if r.pending is not None]
        return time.perf_counter() - min(last) if last else 0.0

    def _start_short(self, left: int) -> None:
        """Between the layers of a chunk of a prompt with `left` tokens to prefill: the waiting requests admitted
        and the prefix states loaded adopted (as a step does), and the prompts that fit in one chunk and are shorter
        than `left` prefilled now, the shortest first (as between chunks), their first token sampled; each of those
        chunks gives way between its layers to decode steps only (`nested`)."""
        self._admit()
        self._adopt_loaded()
        chunk = self.engine.prefill_chunk
        waiting = [r for r in self._active if r.pending is None and r.loading is None and r.done == r.cached]
        for r in sorted(waiting, key=lambda r: len(r.ids) - r.done):
            if len(r.ids) - r.done <= chunk and len(r.ids) - r.done < left and not r.all_cancelled:
                self._prefill_chunk(r, nested=True)

    def _decode_owed(self) -> float | None:
        """A decode step of every decoding sequence, run between the layers of a sliced prefill chunk (none of them
        may draft: the prefilling prompt is active too); its seconds, or None when none decodes."""
        decoding = [r for r in self._active if r.pending is not None]
        if not decoding:
            return None
        t = time.perf_counter()
        self._decode_all(decoding)
        seconds = time.perf_counter() - t
        self._metrics.stepped(seconds)
        return seconds

    def _decode(self, group: list[_Request]) -> None:
        stats = self.engine.counters
        t = time.perf_counter()
        logits = self.model.forward_rows(
            [r.pending for r in group], [r.state for r in group], [r.sampler.head_request() for r in group]
        )
        stats.decode_seconds += time.perf_counter() - t
        stats.decode_tokens_computed += len(group)
        self._metrics.batch_sizes[len(group)] += 1
        for r, row in zip(group, logits):
            self._sampled(r, row)

    @property
    def _drafter(self) -> speculative.Drafter | None:
        return self.engine.drafter if self.draft else None

    @staticmethod
    def _may_draft(req: _Request) -> bool:
        """Greedy, or sampled without a seed: drafting keeps its tokens (greedy) or their distribution (sampled); never
        under a grammar (drafts are not checked against its mask), nor while a thinking budget may still force a token
        (a draft pass would not ask it), nor with a logit bias or a penalty (the drafts and their verification see the
        model's own logits, not the adjusted ones), nor with `min_tokens` or `banned_token_ids` (the drafts are not
        checked against a ban, as `Engine.stream` decodes them plainly)."""
        if req.budget is not None and req.budget.open:
            return False
        p = req.params
        free = p.grammar is None and not p.adjusts_logits and not p.min_tokens and not p.banned_token_ids
        return (p.is_greedy or p.seed is None) and free

    def _can_draft(self, decoding: list[_Request]) -> bool:
        """A draft/verify step only for a lone sequence that may draft (see the module docstring)."""
        lone = len(decoding) == 1 and len(self._active) == 1
        return lone and self._drafter is not None and self._may_draft(decoding[0])

    def _draft(self, req: _Request) -> None:
        """Decode the lone sequence `req` with a draft/verify pass: the tokens of the rows kept (greedy: the argmax
        of each, by its sampler; sampled: what speculative sampling accepted and drew) are emitted one by one, as
        plain steps would."""
        eng, m = self.engine, req.state.length
        room = min(
            self._drafter.max_drafts,
            speculative.VERIFY_MAX - 1,
            req.params.max_tokens - len(req.generated) - 1,
            eng.context_length - m - 3,  # as `speculative_generate_step`: the length check fires where plain would
        )
        t = time.perf_counter()
        sampling = None if req.params.is_greedy else (req.params, req.sampler.generator)
        rows, picks = draft_step(
            self._drafter, eng.draft_schedule, eng.draft_stats, req.state, req.ids + req.generated, room, sampling
        )
        eng.counters.decode_seconds += time.perf_counter() - t
        eng.counters.decode_tokens_computed += len(rows)
        self._metrics.batch_sizes[1] += 1
        self._metrics.counts["draft_steps"] += 1
        self._metrics.counts["sampled_draft_steps"] += picks is not None
        for j, row in enumerate(rows):
            if picks is None:
                self._sampled(req, row)
            else:
                self._emit(req, *report(row, picks[j], req.params))
            if req.state is None:  # finished (a stop, max_tokens or EOS inside the verified tokens)
                break

    def _sampled(self, req: _Request, logits: torch.Tensor) -> None:
        try:
            picked = next_token(req.budget, req.sampler, logits)
        except (ConstraintError, SamplingError) as err:  # its grammar's parser failed, or its grammar allows only
            # tokens it bans: this request ends, the others go on
            with self._lock:
                self._active.remove(req)
            self._metrics.counts["finished"] += 1
            self._groups.release(req)
            req.state = None
            req.handle._fail(err)
            return
        self._emit(req, *picked)

    def _emit(self, req: _Request, token: int, logprob: float, top: list[tuple[int, float]]) -> None:
        req.pending = token
        req.generated.append(token)
        now = time.perf_counter()
        req.first_token_at = req.first_token_at or now
        req.last_token_at = now
        self.engine.counters.generated_tokens += 1
        chunk = req.chunks.feed(
            token, logprob, top, len(req.ids) + len(req.generated), req.handle.cancelled, req.cached
        )
        if req.scores is not None:
            chunk.prompt_logprobs, req.scores = req.scores, None
        if chunk.finish_reason is None:
            req.emit(chunk)
            return
        keep = len(req.ids) + len(req.generated) - 1  # what plain decoding has run by now (the last token waits)
        if req.state.length > keep:  # it stopped inside a verified draft: drop the positions after the stop
            req.state.truncate(keep)
        if self.prefix_cache is not None and req.state.length > len(req.ids):
            self.prefix_cache.store(req.ids + req.generated[: req.state.length - len(req.ids)], req.state)
        self._finish(req, chunk, count="cancelled" if chunk.finish_reason == "cancelled" else "finished")

    def _resent(self, ids: list[int]) -> int:
        """How much of prompt `ids` the conversation's next turn sends again: all of it, or, where it ends in
        `<think>`, the tokens before it (the next turn renders this one with `</think>`, its reasoning dropped)."""
        return len(ids) - 1 if ids and ids[-1] == self._think_start else len(ids)

    def _finish(self, req: _Request, last: GenerationChunk, count: str = "finished", active: bool = True) -> None:
        if active:
            with self._lock:
                self._active.remove(req)
        self._metrics.counts[count] += 1
        self._metrics.finished(req)
        if req.state is not None and req.state.length > 0:  # what it processed, for the next turn to reuse
            self.memory.put((req.ids + req.generated)[: req.state.length], req.state, self._resent(req.ids))
        self._groups.release(req)
        req.state = None
        req.emit(last)
        req.handle.done.set()


def session_check(engine, ids: list[int]) -> None:
    """The prompt checks every front-end relies on (`Session.check_prompt`: empty, too long, bad ids)."""
    engine.open_session(anchor=False).check_prompt(ids)
