"""The engine side of the server: the one worker thread that owns the engine, and what it keeps.

Owns:
  * `EngineHost`: loads the engine in the background (reporting progress), then runs the single worker thread
    that takes `Job`s from a bounded queue and streams the engine's chunks back on each job's own event queue.
    Nothing else ever calls the engine's generation; the queue is the only way in (ds4 and mlx-lm do the same).
  * `SessionPool`: a few engine sessions, each remembering the tokens of its conversation. A request that
    resends a conversation is given the session with the longest common token prefix, so the engine only
    prefills the new tail (on this model a full re-prefill costs minutes).
  * `Metrics`: counters and histograms rendered as Prometheus text, plus every numeric `engine.stats()` entry.

Does not own: HTTP or the OpenAI shapes (`fastar.serve.server`, `fastar.serve.protocol`). Never imports torch.
"""

from __future__ import annotations

import inspect
import logging
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastar.errors import FastarError
from fastar.serve.protocol import APIError

if TYPE_CHECKING:  # fastar.engine.sampling imports torch; the server only passes the object through
    from fastar.engine.sampling import SamplingParams

log = logging.getLogger("fastar.serve")

SHUTDOWN_MESSAGE = "the server is shutting down"


@dataclass(eq=False)
class Job:
    """One generation request between a handler thread and the worker.

    Events on `events`: ("chunk", GenerationChunk)*, then optionally ("error", (status, message)), then always
    ("end", cached_prompt_tokens | None). Setting `cancel` stops the engine at its next token."""

    prompt_ids: list[int]
    params: SamplingParams
    cancel: threading.Event = field(default_factory=threading.Event)
    # Anything with a thread-safe put(); the HTTP handlers pass one that lands on their event loop.
    events: Any = field(default_factory=queue.Queue)
    created: float = field(default_factory=time.monotonic)
    progress: tuple[int, int] | None = None  # (prefilled, total) while the prompt is being processed


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i, step = 0, 1024
    while i + step <= n and a[i : i + step] == b[i : i + step]:  # slices compare in C; a 1M-token history stays fast
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(eq=False)
class _Slot:
    session: Any
    tokens: list[int]
    last_used: float = 0.0
    prompt_len: int = 0  # length of the last prompt run in this session


class SessionPool:
    """Up to `size` sessions, each holding one conversation's state. Only the worker thread touches it."""

    def __init__(self, engine: Any, size: int) -> None:
        self.engine = engine
        self.size = size if hasattr(engine, "open_session") else 0
        self.slots: list[_Slot] = []

    def acquire(self, prompt: list[int]) -> Any:
        """The session to run `prompt` in (None when sessions are off)."""
        if self.size <= 0:
            return None
        best, best_len = None, 0
        for slot in self.slots:  # the longest match; among equals, the most recently used
            n = common_prefix(slot.tokens, prompt)
            if n > best_len or (n == best_len and n > 0 and slot.last_used > best.last_used):
                best, best_len = slot, n
        if best is not None and (best_len == len(best.tokens) or best_len >= best.prompt_len > 0):
            # The same conversation: grown, or resent with its last reply changed or dropped (regenerate, or
            # thinking mode dropping earlier reasoning). Rolling back only loses that reply's tail.
            chosen = best
        elif len(self.slots) < self.size and (fresh := self._open()) is not None:
            # A new session rather than rewinding `best`, which would throw away another conversation's tail.
            chosen = _Slot(fresh, [])
            self.slots.append(chosen)
        elif not self.slots:
            return None
        elif best is not None:
            chosen = best  # full: reuse the partial match rather than evict it for nothing
        else:
            chosen = min(self.slots, key=lambda s: s.last_used)
        chosen.last_used = time.monotonic()
        chosen.prompt_len = len(prompt)
        return chosen.session

    def _open(self) -> Any:
        try:
            return self.engine.open_session()
        except Exception:  # e.g. no memory for another KV cache: share the sessions we have
            log.warning("engine.open_session() failed; keeping %d sessions", len(self.slots), exc_info=True)
            self.size = len(self.slots)
            return None

    def release(self, session: Any, tokens: list[int]) -> None:
        """Record what `session` now holds; the engine's own record wins where it keeps one."""
        for slot in self.slots:
            if slot.session is session:
                own = getattr(session, "tokens", None)
                slot.tokens = list(own) if isinstance(own, (list, tuple)) else tokens


def _prefill_counter(engine: Any) -> int | None:
    try:
        value = engine.stats().get("prefill_tokens_computed")
    except Exception:
        return None
    return value if isinstance(value, int) else None


class EngineHost:
    """Loads the engine off the request path, then owns it through one worker thread."""

    def __init__(self, factory: Callable[..., Any], max_queue: int, max_sessions: int, metrics: Metrics) -> None:
        self.factory = factory
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.max_queue = max_queue
        self.max_sessions = max_sessions
        self.metrics = metrics
        self.engine: Any = None
        self.pool: SessionPool | None = None
        self.error: str | None = None
        self.ready = threading.Event()
        self.current: Job | None = None
        self._settled = threading.Event()  # loaded or failed
        self._stopping = threading.Event()
        self._loading: Any = None
        self._progress = 0.0
        self._worker: threading.Thread | None = None

    # ---- loading ----------------------------------------------------------------------------------------

    def start(self, on_ready: Callable[[Any], None]) -> None:
        threading.Thread(target=self._load, args=(on_ready,), name="fastar-loader", daemon=True).start()

    def _set_progress(self, fraction: float) -> None:
        self._progress = min(max(float(fraction), 0.0), 1.0)

    def _load(self, on_ready: Callable[[Any], None]) -> None:
        try:
            # A factory may take a `progress` callback; an engine may also load itself and report load_progress().
            if "progress" in inspect.signature(self.factory).parameters:
                engine = self.factory(progress=self._set_progress)
            else:
                engine = self.factory()
            self._loading = engine
            while hasattr(engine, "load_progress") and engine.load_progress() < 1.0 and not self._stopping.is_set():
                time.sleep(0.1)
            self.engine = engine
            self.pool = SessionPool(engine, self.max_sessions)
            on_ready(engine)
        except BaseException as err:  # noqa: BLE001 - reported through /health, and by serve() as the exit reason
            if not isinstance(err, (FastarError, OSError)):  # those are the user's to fix, in one line
                log.exception("loading the model failed")
            self.error = f"{type(err).__name__}: {err}"
            self._settled.set()
            return
        self._worker = threading.Thread(target=self._run, name="fastar-worker", daemon=True)
        self._worker.start()
        self.ready.set()
        self._settled.set()

    def progress(self) -> float:
        if self.ready.is_set():
            return 1.0
        engine = self._loading
        if engine is not None and hasattr(engine, "load_progress"):
            try:
                return float(engine.load_progress())
            except Exception:
                pass
        return self._progress

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._settled.wait(timeout)
        if self.error is not None:
            raise FastarError(f"loading the model failed: {self.error}")
        return self.ready.is_set()

    def require_engine(self) -> Any:
        if self.error is not None:
            raise APIError(500, f"model failed to load: {self.error}", "server_error", code="model_load_failed")
        if not self.ready.is_set():
            raise APIError(
                503,
                f"model is loading ({self.progress():.0%}); retry when /health answers 200",
                "unavailable_error",
                code="model_loading",
            )
        return self.engine

    # ---- the queue and the worker -----------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        if self._stopping.is_set():
            raise APIError(503, SHUTDOWN_MESSAGE, "unavailable_error", code="shutting_down")
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise APIError(
                503,
                f"server busy: {self.max_queue} requests are already waiting; retry later",
                "unavailable_error",
                code="queue_full",
            ) from None

    def num_waiting(self) -> int:
        return self.jobs.qsize()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if self._stopping.is_set():
                _abort(job)
                continue
            self.current = job
            try:
                self._generate(job)
            except Exception:  # a bug here must not kill the only worker: every later request would hang
                log.exception("worker error")
                job.events.put(("error", (500, "internal server error")))
                job.events.put(("end", None))
            finally:
                self.current = None

    def _generate(self, job: Job) -> None:
        if job.cancel.is_set():  # the client left while it waited
            job.events.put(("end", None))
            return
        engine, pool = self.engine, self.pool
        assert pool is not None
        session = pool.acquire(job.prompt_ids)
        before = _prefill_counter(engine)
        generated: list[int] = []
        first = last = None
        ok = False
        reported: int | None = None  # cached prompt tokens, when the engine's last chunk carries `usage`
        last_finish: str | None = None

        def on_progress(done: int, total: int) -> None:
            job.progress = (done, total)

        try:
            stream = engine.stream(
                job.prompt_ids, job.params, session=session, cancel=job.cancel, on_prefill_progress=on_progress
            )
            try:
                for chunk in stream:
                    if chunk.token is not None:
                        last = time.monotonic()
                        first = first or last
                        generated.append(chunk.token)
                    usage = getattr(chunk, "usage", None)
                    if isinstance(usage, dict) and isinstance(usage.get("cached_tokens"), int):
                        reported = usage["cached_tokens"]
                    job.events.put(("chunk", chunk))
                    last_finish = chunk.finish_reason or last_finish
                    if job.cancel.is_set():
                        break  # don't wait for the engine to notice: close the generator now
            finally:
                close = getattr(stream, "close", None)
                if close is not None:
                    close()
            ok = True
            if self._stopping.is_set() and last_finish in (None, "cancelled"):
                # Cut short by shutdown: say so, so a client never takes the truncated text for a full reply.
                job.events.put(("error", (503, SHUTDOWN_MESSAGE)))
        except Exception as err:
            # A ValueError before any token is the engine refusing the request (its PromptError): the client's 400.
            status = 400 if isinstance(err, ValueError) and not generated else 500
            if status == 500:
                log.exception("generation failed")
            job.events.put(("error", (status, f"{'' if status == 400 else 'generation failed: '}{err}")))
        finally:
            # After a failure the session's state is unknown: record nothing, so it is never picked as a match.
            pool.release(session, job.prompt_ids + generated if ok else [])
            after = _prefill_counter(engine)
            cached = reported
            if cached is None and before is not None and after is not None:
                cached = max(0, len(job.prompt_ids) - (after - before))
            self.metrics.generation(job, len(generated), first, last, cached)
            job.events.put(("end", cached))

    def shutdown(self) -> None:
        self._stopping.set()
        current = self.current
        if current is not None:
            current.cancel.set()
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                _abort(job)
        try:
            self.jobs.put_nowait(None)
        except queue.Full:
            pass
        if self._worker is not None:
            self._worker.join(timeout=10)
            if not self._worker.is_alive() and self.engine is not None:
                self.engine.close()


def _abort(job: Job) -> None:
    job.cancel.set()
    job.events.put(("error", (503, SHUTDOWN_MESSAGE)))
    job.events.put(("end", None))


# ---------------------------------------------------------------------------------------------------------
# Metrics (Prometheus text format, `fastar:` prefix as vLLM uses `vllm:`)
# ---------------------------------------------------------------------------------------------------------

# A first token can take minutes on this model (long prefill, experts read from SSD), so the buckets go far.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LATENCY_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # cumulative, as Prometheus wants them
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts, strict=True)]
        return out + [
            f'{name}_bucket{{le="+Inf"}} {self.count}',
            f"{name}_sum {self.sum:.6f}",
            f"{name}_count {self.count}",
        ]


def _metric_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_")


class Metrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.decode_tokens = 0
        self.decode_seconds = 0.0
        self.last_tps = 0.0
        self.finish_reasons: dict[str, int] = {}
        self.errors: dict[int, int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)

    def generation(
        self, job: Job, n_generated: int, first: float | None, last: float | None, cached: int | None
    ) -> None:
        now = time.monotonic()
        with self.lock:
            self.prompt_tokens += len(job.prompt_ids)
            self.generation_tokens += n_generated
            self.cached_tokens += cached or 0
            self.latency.observe(now - job.created)
            if first is not None:
                self.ttft.observe(first - job.created)  # queue wait included: it is what the user waits
            if first is not None and last is not None and n_generated > 1 and last > first:
                self.last_tps = (n_generated - 1) / (last - first)
                self.decode_tokens += n_generated - 1
                self.decode_seconds += last - first

    def finished(self, reason: str) -> None:
        with self.lock:
            self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1

    def error(self, status: int) -> None:
        with self.lock:
            self.errors[status] = self.errors.get(status, 0) + 1

    def render(self, host: EngineHost) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[str]) -> None:
            out.extend([f"# HELP fastar:{name} {help}", f"# TYPE fastar:{name} {kind}"])
            out.extend(f"fastar:{s}" for s in samples)

        with self.lock:
            metric(
                "prompt_tokens_total",
                "counter",
                "Prompt tokens of finished requests.",
                [f"prompt_tokens_total {self.prompt_tokens}"],
            )
            metric(
                "generation_tokens_total",
                "counter",
                "Generated tokens.",
                [f"generation_tokens_total {self.generation_tokens}"],
            )
            metric(
                "prompt_tokens_cached_total",
                "counter",
                "Prompt tokens reused from a session's state.",
                [f"prompt_tokens_cached_total {self.cached_tokens}"],
            )
            metric(
                "request_success_total",
                "counter",
                "Finished requests by finish reason.",
                [f'request_success_total{{finished_reason="{r}"}} {n}' for r, n in sorted(self.finish_reasons.items())],
            )
            metric(
                "request_errors_total",
                "counter",
                "Error responses by HTTP status.",
                [f'request_errors_total{{status="{s}"}} {n}' for s, n in sorted(self.errors.items())],
            )
            metric(
                "generation_tokens_per_second",
                "gauge",
                "Decode speed of the last request.",
                [f"generation_tokens_per_second {self.last_tps:.3f}"],
            )
            avg = self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0
            metric(
                "avg_generation_tokens_per_second",
                "gauge",
                "Decode speed over all requests.",
                [f"avg_generation_tokens_per_second {avg:.3f}"],
            )
            metric(
                "time_to_first_token_seconds",
                "histogram",
                "Time from arrival to the first token.",
                [line[len("fastar:") :] for line in self.ttft.lines("fastar:time_to_first_token_seconds")],
            )
            metric(
                "e2e_request_latency_seconds",
                "histogram",
                "Time from arrival to the last token.",
                [line[len("fastar:") :] for line in self.latency.lines("fastar:e2e_request_latency_seconds")],
            )
        metric(
            "num_requests_running",
            "gauge",
            "Requests being generated.",
            [f"num_requests_running {int(host.current is not None)}"],
        )
        metric(
            "num_requests_waiting",
            "gauge",
            "Requests waiting in the queue.",
            [f"num_requests_waiting {host.num_waiting()}"],
        )
        metric(
            "model_load_progress",
            "gauge",
            "Fraction of the model loaded.",
            [f"model_load_progress {host.progress():.4f}"],
        )
        if host.ready.is_set():
            try:
                stats = host.engine.stats()
            except Exception:
                log.exception("engine.stats() failed")
                stats = {}
            flat: dict[str, float] = {}
            for key, value in stats.items():
                items = value.items() if isinstance(value, dict) else [("", value)]
                for sub, v in items:
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        flat[_metric_name(f"{key}_{sub}" if sub else key)] = v
            for key, value in sorted(flat.items()):
                metric(
                    f"engine_{key}",
                    "gauge",
                    f"engine.stats()['{key}'] (expert cache, prefill, decode).",
                    [f"engine_{key} {value}"],
                )
        return "\n".join(out) + "\n"
