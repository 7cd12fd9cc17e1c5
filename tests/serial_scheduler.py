"""The scheduler contract the server's worker drives (`engine.scheduler(...)` -> submit / run / idle / metrics),
over a fake engine's `stream()`, for the server tests that script replies instead of running a model.

`SerialScheduler` runs one request at a time in a few of the engine's sessions, each picked by the longest common
token prefix with the prompt (so scripted engines that count prefill tokens show prefix reuse), and reports the
reused tokens as `cached_tokens` on the last chunk when the engine does not. The real `fastar.engine.scheduler`
batches; what the server must do with either (chunks, errors, 503s, cancellation) is the same.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque

from fastar.engine.generate import GenerationChunk
from fastar.engine.scheduler import QueueFull
from fastar.engine.session import common_prefix


@dataclasses.dataclass(eq=False)
class _Req:
    ids: list[int]
    params: object
    on_chunk: object
    on_error: object
    on_progress: object
    cancel: threading.Event


class _Handle:
    def __init__(self, cancel: threading.Event) -> None:
        self._cancel = cancel

    def cancel(self) -> None:
        self._cancel.set()


class _Slot:
    def __init__(self, session) -> None:
        self.session, self.tokens, self.used, self.prompt_len = session, [], 0.0, 0


class SerialScheduler:
    def __init__(self, engine, max_queue: int = 16, keep_states: int = 4, **_ignored) -> None:
        self.engine, self.max_queue, self.keep = engine, max_queue, keep_states
        self._lock = threading.Condition()
        self._waiting: deque[_Req] = deque()
        self._running: _Req | None = None
        self._slots: list[_Slot] = []
        self._progress: tuple[int, int] | None = None  # the running prompt's (done, total) while it prefills
        self.rejected = 0

    def submit(self, ids, params, on_chunk=None, on_error=None, on_progress=None, cancel=None):
        if not ids:
            raise ValueError("the prompt is empty")
        req = _Req(list(ids), params, on_chunk, on_error, on_progress, cancel or threading.Event())
        with self._lock:
            if len(self._waiting) >= self.max_queue:
                self.rejected += 1
                raise QueueFull(f"{len(self._waiting)} requests are waiting", retry_after=2)
            self._waiting.append(req)
            self._lock.notify_all()
        return _Handle(req.cancel)

    def submit_choices(self, ids, params, on_chunk, on_error, on_progress=None, cancel=None):
        """The choices of one prompt, one after the other (the real scheduler prefills once and forks)."""
        cancel = cancel or [None] * len(params)
        return [
            self.submit(ids, p, chunk, error, on_progress if i == 0 else (lambda done, total: None), event)
            for i, (p, chunk, error, event) in enumerate(zip(params, on_chunk, on_error, cancel, strict=True))
        ]

    def flush(self) -> None:
        pass  # no prompt cache

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._waiting and self._running is None

    def metrics(self) -> dict:
        with self._lock:
            running, queued = int(self._running is not None), len(self._waiting)
        zeros = dict.fromkeys(
            (
                "steps", "step_seconds_total", "step_seconds_last", "tokens_per_s_per_sequence_finished_mean",
                "requests_rejected", "prefix_memory_hits", "prefix_memory_misses", "prefix_memory_states",
                "prefix_disk_hits", "prefix_disk_misses", "prefix_disk_bytes", "prefix_disk_loading", "draft_steps",
                "sampled_draft_steps",
                "prefix_disk_stores", "prefix_disk_evictions", "prefix_disk_rejected", "prefix_disk_writes_paused",
            ),
            0,
        )  # fmt: skip
        return {
            **zeros,
            "active_sequences": running,
            "queued_requests": queued,
            "decoding_sequences": running,
            "batch_size_histogram": {},
            "tokens_per_s_per_sequence": [],
            "prefill_progress": [self._progress] if self._progress else [],
            "requests_rejected": self.rejected,
        }

    def run(self, stop: threading.Event, idle_wait: float = 0.05, after_step=None) -> None:
        while not stop.is_set():
            if after_step is not None:  # as the real scheduler: after each request served, and each idle wake-up
                with self._lock:
                    idle = not self._waiting
                after_step(idle)
            with self._lock:
                if not self._waiting:
                    self._lock.wait(idle_wait)
                    continue
                req = self._running = self._waiting.popleft()
            try:
                self._serve(req)
            except Exception as err:
                req.on_error(err)
            finally:
                with self._lock:
                    self._running = None

    def _serve(self, req: _Req) -> None:
        if req.cancel.is_set():  # left while it waited: never generated
            req.on_chunk(GenerationChunk("", finish_reason="cancelled", usage={"cached_tokens": 0}))
            return
        slot = self._acquire(req.ids)
        common = common_prefix(slot.tokens, req.ids) if slot else 0
        tokens, ok = list(req.ids), False

        def progress(done: int, total: int) -> None:
            self._progress = (done, total)
            req.on_progress(done, total)

        stream = self.engine.stream(
            req.ids, req.params, session=slot.session if slot else None, cancel=req.cancel,
            on_prefill_progress=progress,
        )  # fmt: skip
        try:
            for chunk in stream:
                self._progress = None
                if chunk.token is not None:
                    tokens.append(chunk.token)
                if chunk.finish_reason is not None and chunk.usage is None:
                    chunk = dataclasses.replace(chunk, usage={"cached_tokens": common})
                req.on_chunk(chunk)
                if chunk.finish_reason is not None:
                    break
            ok = True
        finally:
            self._progress = None
            stream.close()
            if slot is not None:
                slot.tokens = tokens if ok else []

    def _acquire(self, prompt: list[int]) -> _Slot | None:
        """The old server's session-pool rule: the same conversation keeps its session; another one gets a free
        session while there is one, else the most recent partial match, else the least recently used."""
        if self.keep <= 0:
            return None
        best, best_len = None, 0
        for slot in self._slots:
            n = common_prefix(slot.tokens, prompt)
            if n > best_len or (n == best_len and n > 0 and slot.used > best.used):
                best, best_len = slot, n
        if best is not None and (best_len == len(best.tokens) or best_len >= best.prompt_len > 0):
            chosen = best
        elif len(self._slots) < self.keep:
            chosen = _Slot(self.engine.open_session())
            self._slots.append(chosen)
        else:
            chosen = best or min(self._slots, key=lambda s: s.used)
        chosen.used, chosen.prompt_len = time.monotonic(), len(prompt)
        return chosen


class SchedulesSerially:
    """Mixin for fake engines: the `scheduler()`, `load_progress()` and expert warm-up of the engine contract (a
    fake has no expert cache: nothing to warm)."""

    def scheduler(self, **options) -> SerialScheduler:
        return SerialScheduler(self, **options)

    def load_progress(self) -> float:
        return 1.0

    def warm_experts(self, profile_dir=None) -> None:
        pass

    def warm_status(self) -> dict:
        return {"status": "off"}
