"""The engine side of the server: the one worker thread that owns the engine, and what it keeps.

Owns:
  * `EngineHost`: loads the engine in the background (reporting progress), then makes the engine's step
    scheduler (`engine.scheduler(...)`: continuous batching, prefix reuse from RAM and disk, the bounded queue)
    and runs it on the single worker thread. Handler threads only `submit` a `Job`: the scheduler checks and
    queues it (a full queue is a 503 with Retry-After) and the worker streams its chunks back on the job's
    own event queue. Nothing else ever calls the engine's generation (ds4 and mlx-lm keep one worker too).

The engine contract used here: `scheduler(max_batch=, max_queue=, keep_states=, prefix_cache=, prefix_cache_size=,
prefill_share=)` -> an object with `submit_choices(ids, [params], on_chunk=[...], on_error=[...], on_progress=,
cancel=[...])` (one prompt, one or more choices; raising `QueueFull` with `retry_after`, or a ValueError for a bad
prompt), `run(stop_event, after_step=)` (`after_step(idle)`: called between steps, where the worker hands freed heap
memory back to the OS: `fastar.serve.heap`), `idle`, `metrics()` and `flush()` (pending prompt-cache writes, at
shutdown); plus `stats()`, `tokenizer`, `context_length`, `load_progress()`, `warm_experts(profile_dir)` (started
once the engine is loaded; /health reports `warm_status()`), `compile_grammar(grammar)` (the routes, for constrained
decoding) and `close()`.

Does not own: HTTP or the OpenAI shapes (`fastar.serve.server`, `fastar.serve.shapes`), what /metrics renders
(`fastar.serve.metrics`). Never imports torch.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fastar.engine.pacing import MAX_STALL
from fastar.errors import FastarError, QueueFull
from fastar.serve.api_error import APIError
from fastar.serve.heap import HeapTrimmer

if TYPE_CHECKING:  # fastar.engine.sampling imports torch; the server only passes the object through
    from fastar.engine.sampling import SamplingParams

log = logging.getLogger("fastar.serve")

SHUTDOWN_MESSAGE = "the server is shutting down"


@dataclass(eq=False)
class Job:
    """One generation request between a handler thread and the worker.

    Events on `events`: ("chunk", GenerationChunk)*, then optionally ("error", (status, message[, param])), then always
    ("end", cached_prompt_tokens | None). Setting `cancel` stops the request at the next step."""

    prompt_ids: list[int]
    params: SamplingParams
    cancel: threading.Event = field(default_factory=threading.Event)
    # Anything with a thread-safe put(); the HTTP handlers pass one that lands on their event loop.
    events: Any = field(default_factory=queue.Queue)
    created: float = field(default_factory=time.monotonic)
    progress: tuple[int, int] | None = None  # (prefilled, total) while the prompt is being processed
    generated: int = 0
    first_token: float | None = None
    last_token: float | None = None
    choice: int = 0  # its index among the choices of its prompt (`submit_choices`); only choice 0 counts the prompt


class GenerationMetrics(Protocol):
    """What the worker reports each finished generation to (`fastar.serve.metrics.Metrics`)."""

    def generation(
        self, job: Job, n_generated: int, first: float | None, last: float | None, cached: int | None
    ) -> None: ...


@dataclass(frozen=True)
class Batching:
    """How the worker batches: `fastar serve`'s --max-batch, --max-queue, --max-sessions, --prompt-cache*,
    --prefill-share and --max-stall."""

    max_batch: int = 8  # sequences decoded together in one step
    max_queue: int = 16  # requests waiting beyond those; more get 503
    keep_states: int = 4  # finished requests' states kept in RAM for prefix reuse
    prompt_cache: str | None = None  # folder of prefix states on disk (None: off)
    prompt_cache_size: int | str = "20G"
    prefill_share: float = 0.5  # the part of the time prefill chunks may take while others decode
    max_stall: float = MAX_STALL  # seconds the others wait at most for a step while a short prompt prefills

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_queue < 1 or self.keep_states < 0:
            raise ValueError(
                f"max_batch and max_queue must be >= 1 and keep_states >= 0 "
                f"(got {self.max_batch}, {self.max_queue}, {self.keep_states})"
            )


def load_error(err: BaseException) -> str:
    """One line for a failed load: a FastarError's message or an OSError's path and reason, as `fastar run` says
    them (the class name is for bugs, which are logged with their traceback)."""
    if isinstance(err, FastarError):
        return str(err)
    if isinstance(err, OSError):
        return f"{err.filename}: {err.strerror}" if err.filename and err.strerror else str(err.strerror or err)
    return f"{type(err).__name__}: {err}"


class EngineHost:
    """Loads the engine off the request path, then owns it through one worker thread running its scheduler."""

    def __init__(
        self,
        factory: Callable[..., Any],
        batching: Batching,
        metrics: GenerationMetrics,
        heap: HeapTrimmer | None = None,
    ) -> None:
        self.factory = factory
        self.batching = batching
        self.metrics = metrics
        self.heap = heap if heap is not None else HeapTrimmer()  # freed memory back to the OS between steps
        self.engine: Any = None
        self.scheduler: Any = None
        self.error: str | None = None
        self.user_error = False  # the load failed on the user's input (a FastarError or OSError), not a bug
        self.ready = threading.Event()
        self._settled = threading.Event()  # loaded or failed
        self._stopping = threading.Event()  # no new requests; running ones are being cancelled
        self._halt = threading.Event()  # the worker's loop ends
        self._loading: Any = None
        self._progress = 0.0
        self._worker: threading.Thread | None = None
        self._jobs: set[Job] = set()  # submitted and not yet ended
        self._jobs_lock = threading.Lock()

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
            while engine.load_progress() < 1.0 and not self._stopping.is_set():
                time.sleep(0.1)
            b = self.batching
            self.scheduler = engine.scheduler(
                max_batch=b.max_batch,
                max_queue=b.max_queue,
                keep_states=b.keep_states,
                prefix_cache=b.prompt_cache,
                prefix_cache_size=b.prompt_cache_size,
                prefill_share=b.prefill_share,
                max_stall=b.max_stall,
            )
            self.engine = engine
            on_ready(engine)
            self._warm(engine)
        except BaseException as err:  # noqa: BLE001 - reported through /health, and by serve() as the exit reason
            self.user_error = isinstance(err, (FastarError, OSError))  # the user's to fix, in one line
            if not self.user_error:
                log.exception("loading the model failed")
            self.error = load_error(err)
            self._settled.set()
            return
        self._worker = threading.Thread(target=self._run, name="fastar-worker", daemon=True)
        self._worker.start()
        self.ready.set()
        self._settled.set()

    def _warm(self, engine: Any) -> None:
        """The budget's worth of experts read into RAM behind the requests, so the first ones run warm too. Only a
        head start: a warm-up that cannot start (an unreadable profile folder) is logged, and requests are served."""
        try:
            engine.warm_experts(self.batching.prompt_cache)
        except Exception as err:  # noqa: BLE001 - the server serves without it
            log.warning("the expert cache's warm-up did not start: %s: %s", type(err).__name__, err)

    def progress(self) -> float:
        if self.ready.is_set():
            return 1.0
        engine = self._loading
        if engine is not None:
            try:
                return float(engine.load_progress())
            except Exception:
                pass
        return self._progress

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._settled.wait(timeout)
        if self.error is not None:  # a bad model file: the line `fastar run` gives for it
            raise FastarError(self.error if self.user_error else f"loading the model failed: {self.error}")
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

    # ---- submitting, and the worker ---------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Hand `job` to the scheduler (from a handler thread). Raises APIError: 503 while shutting down or when
        the queue is full (with a Retry-After header), 400 for a prompt the engine refuses."""
        self.submit_choices([job])

    def submit_choices(self, jobs: list[Job]) -> None:
        """Hand the choices of one prompt (`n`, `best_of`; the same `prompt_ids`) to the scheduler at once: it
        prefills the prompt once and forks it for each. Raises as `submit` does (then none was queued)."""
        if self._stopping.is_set():
            raise APIError(503, SHUTDOWN_MESSAGE, "unavailable_error", code="shutting_down")
        for i, job in enumerate(jobs):
            job.choice = i
        with self._jobs_lock:
            self._jobs.update(jobs)
        first = jobs[0]
        try:
            self.require_engine()
            self.scheduler.submit_choices(
                first.prompt_ids,
                [job.params for job in jobs],
                on_chunk=[lambda chunk, job=job: self._on_chunk(job, chunk) for job in jobs],
                on_error=[lambda err, job=job: self._on_error(job, err) for job in jobs],
                on_progress=lambda done, total: setattr(first, "progress", (done, total)),
                cancel=[job.cancel for job in jobs],
            )
        except QueueFull as err:
            self._forget_all(jobs)
            raise APIError(
                503,
                f"server busy: {err}; retry later",
                "unavailable_error",
                code="queue_full",
                headers={"Retry-After": str(err.retry_after)},
            ) from None
        except ValueError as err:  # PromptError / SamplingError: the request itself is wrong
            self._forget_all(jobs)
            raise APIError(400, str(err), "invalid_request_error", code="invalid_prompt") from None
        except BaseException:
            self._forget_all(jobs)
            raise

    def _forget_all(self, jobs: list[Job]) -> None:
        for job in jobs:
            self._forget(job)

    def _forget(self, job: Job) -> bool:
        with self._jobs_lock:
            if job not in self._jobs:
                return False
            self._jobs.discard(job)
            return True

    def _on_chunk(self, job: Job, chunk: Any) -> None:
        if chunk.token is not None:
            job.last_token = time.monotonic()
            job.first_token = job.first_token or job.last_token
            job.generated += 1
        job.progress = None
        job.events.put(("chunk", chunk))
        if chunk.finish_reason is None:
            return
        if self._stopping.is_set() and chunk.finish_reason == "cancelled":
            # Cut short by shutdown: say so, so a client never takes the truncated text for a full reply.
            job.events.put(("error", (503, SHUTDOWN_MESSAGE)))
        usage = chunk.usage if isinstance(chunk.usage, dict) else {}
        self._end(job, usage.get("cached_tokens"))

    def _on_error(self, job: Job, err: BaseException) -> None:
        # A ValueError before any token is the engine refusing the request: the client's 400.
        status = 400 if isinstance(err, ValueError) and not job.generated else 500
        message = f"{'' if status == 400 else 'generation failed: '}{err}"
        param = err.param if status == 400 and isinstance(err, FastarError) else None
        job.events.put(("error", (status, message, param)))
        self._end(job, None)

    def _end(self, job: Job, cached: int | None) -> None:
        if self._forget(job):
            self.metrics.generation(job, job.generated, job.first_token, job.last_token, cached)
            job.events.put(("end", cached))

    def _run(self) -> None:
        while not self._halt.is_set():
            try:
                self.scheduler.run(self._halt, after_step=self.heap.after_step)
            except FastarError as err:  # a known failure (an expert failing its checksum): its one line says it
                log.error("a generation step failed: %s", err)
            except Exception:  # its requests got the error; the worker goes on, or every later request would hang
                log.exception("a generation step failed")

    def num_running(self) -> int:
        """Requests submitted and not yet ended (queued or active)."""
        with self._jobs_lock:
            return len(self._jobs)

    def num_waiting(self) -> int:
        """Requests queued and not yet admitted to the batch."""
        return self.batch_metrics().get("queued_requests", 0)

    def batch_metrics(self) -> dict:
        return self.scheduler.metrics() if self.ready.is_set() else {}

    def shutdown(self) -> None:
        """Refuse new requests, cancel the others (each gets a 503 `shutting_down` error), stop the worker."""
        self._stopping.set()
        with self._jobs_lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel.set()
        deadline = time.monotonic() + 10
        while self.num_running() and self._worker is not None and self._worker.is_alive():
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        for job in jobs:  # any the worker never reached (it died, or never started)
            if self._forget(job):
                job.events.put(("error", (503, SHUTDOWN_MESSAGE)))
                job.events.put(("end", None))
        self._halt.set()
        if self._worker is not None:
            self._worker.join(timeout=10)
            if not self._worker.is_alive():
                self.scheduler.flush()  # prompt states still being written: a restart finds them
            if not self._worker.is_alive() and self.engine is not None:
                self.engine.close()
