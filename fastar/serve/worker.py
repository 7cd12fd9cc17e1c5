"""The engine side of the server: the one worker thread that owns the engine, and what it keeps.

Owns:
  * `EngineHost`: loads the engine in the background (reporting progress), then makes the engine's step
    scheduler (`engine.scheduler(...)`: continuous batching, prefix reuse from RAM and disk, the bounded queue)
    and runs it on the single worker thread. Handler threads only `submit` a `Job`: the scheduler checks and
    queues it (a full queue is a 503 with Retry-After) and the worker streams its chunks back on the job's
    own event queue. Nothing else ever calls the engine's generation (ds4 and mlx-lm keep one worker too).
  * `Metrics`: counters and histograms rendered as Prometheus text, the scheduler's `metrics()` (active and
    queued requests, batch sizes, step time, tokens/s per sequence, prefill progress, prefix reuse, draft steps)
    and every numeric `engine.stats()` entry (speculative decoding's `draft_*` among them).

The engine contract used here: `scheduler(max_batch=, max_queue=, keep_states=, prefix_cache=,
prefix_cache_size=)` -> an object with `submit_choices(ids, [params], on_chunk=[...], on_error=[...], on_progress=,
cancel=[...])` (one prompt, one or more choices; raising `QueueFull` with `retry_after`, or a ValueError for a bad
prompt), `run(stop_event)`, `idle`,
`metrics()` and `flush()` (pending prompt-cache writes, at shutdown); plus `stats()`, `tokenizer`,
`context_length`, `load_progress()`, `warm_experts(profile_dir)` (started once the engine is loaded; /health
reports `warm_status()`), `compile_grammar(grammar)` (the routes, for constrained decoding) and `close()`.

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

from fastar.errors import FastarError, QueueFull
from fastar.serve.protocol import APIError

if TYPE_CHECKING:  # fastar.engine.sampling imports torch; the server only passes the object through
    from fastar.engine.sampling import SamplingParams

log = logging.getLogger("fastar.serve")

SHUTDOWN_MESSAGE = "the server is shutting down"


@dataclass(eq=False)
class Job:
    """One generation request between a handler thread and the worker.

    Events on `events`: ("chunk", GenerationChunk)*, then optionally ("error", (status, message)), then always
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


@dataclass(frozen=True)
class Batching:
    """How the worker batches: `fastar serve`'s --max-batch, --max-queue, --max-sessions and --prompt-cache*."""

    max_batch: int = 8  # sequences decoded together in one step
    max_queue: int = 16  # requests waiting beyond those; more get 503
    keep_states: int = 4  # finished requests' states kept in RAM for prefix reuse
    prompt_cache: str | None = None  # folder of prefix states on disk (None: off)
    prompt_cache_size: int | str = "20G"

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_queue < 1 or self.keep_states < 0:
            raise ValueError(
                f"max_batch and max_queue must be >= 1 and keep_states >= 0 "
                f"(got {self.max_batch}, {self.max_queue}, {self.keep_states})"
            )


class EngineHost:
    """Loads the engine off the request path, then owns it through one worker thread running its scheduler."""

    def __init__(self, factory: Callable[..., Any], batching: Batching, metrics: Metrics) -> None:
        self.factory = factory
        self.batching = batching
        self.metrics = metrics
        self.engine: Any = None
        self.scheduler: Any = None
        self.error: str | None = None
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
            )
            self.engine = engine
            on_ready(engine)
            self._warm(engine)
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
        job.events.put(("error", (status, f"{'' if status == 400 else 'generation failed: '}{err}")))
        self._end(job, None)

    def _end(self, job: Job, cached: int | None) -> None:
        if self._forget(job):
            self.metrics.generation(job, job.generated, job.first_token, job.last_token, cached)
            job.events.put(("end", cached))

    def _run(self) -> None:
        while not self._halt.is_set():
            try:
                self.scheduler.run(self._halt)
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


def _batch_lines(metric: Callable[[str, str, str, list[str]], None], b: dict) -> None:
    """The scheduler's `metrics()` as Prometheus samples."""
    metric(
        "num_requests_decoding",
        "gauge",
        "Active sequences past their prompt.",
        [f"num_requests_decoding {b['decoding_sequences']}"],
    )
    hist, total = [], 0
    for size, calls in sorted(b["batch_size_histogram"].items()):  # calls per batch size -> cumulative buckets
        total += calls
        hist.append(f'batch_size_bucket{{le="{size}"}} {total}')
    steps = sum(size * n for size, n in b["batch_size_histogram"].items())
    metric(
        "batch_size",
        "histogram",
        "Sequences decoded per model call.",
        [*hist, f'batch_size_bucket{{le="+Inf"}} {total}', f"batch_size_sum {steps}", f"batch_size_count {total}"],
    )
    metric("steps_total", "counter", "Scheduler steps run.", [f"steps_total {b['steps']}"])
    metric(
        "draft_steps_total",
        "counter",
        "Steps that decoded a lone sequence (greedy, or sampled without a seed) with a draft/verify pass "
        "(engine_draft_* count the tokens).",
        [f"draft_steps_total {b['draft_steps']}"],
    )
    metric(
        "sampled_draft_steps_total",
        "counter",
        "Draft/verify steps of a sampled request (speculative sampling).",
        [f"sampled_draft_steps_total {b['sampled_draft_steps']}"],
    )
    metric(
        "prefix_cache_disk_loading",
        "gauge",
        "Requests waiting for their prefix state to be read from disk (off the worker thread).",
        [f"prefix_cache_disk_loading {b['prefix_disk_loading']}"],
    )
    metric(
        "step_seconds_total",
        "counter",
        "Time spent in scheduler steps.",
        [f"step_seconds_total {b['step_seconds_total']:.6f}"],
    )
    metric(
        "step_seconds_last", "gauge", "Duration of the last step.", [f"step_seconds_last {b['step_seconds_last']:.6f}"]
    )
    rates = b["tokens_per_s_per_sequence"]
    metric(
        "sequence_tokens_per_second",
        "gauge",
        "Decode speed of each active sequence (by its place in the batch).",
        [f'sequence_tokens_per_second{{slot="{i}"}} {r:.3f}' for i, r in enumerate(rates)],
    )
    metric(
        "sequence_tokens_per_second_finished_mean",
        "gauge",
        "Mean decode speed of recently finished sequences.",
        [f"sequence_tokens_per_second_finished_mean {b['tokens_per_s_per_sequence_finished_mean']:.3f}"],
    )
    progress = b["prefill_progress"]
    metric(
        "prefill_tokens_done",
        "gauge",
        "Prompt tokens processed so far, per prompt being prefilled (cached ones included).",
        [f'prefill_tokens_done{{slot="{i}"}} {done}' for i, (done, _) in enumerate(progress)],
    )
    metric(
        "prefill_tokens_total",
        "gauge",
        "Prompt tokens in all, per prompt being prefilled.",
        [f'prefill_tokens_total{{slot="{i}"}} {total}' for i, (_, total) in enumerate(progress)],
    )
    for where in ("memory", "disk"):
        for what in ("hits", "misses"):
            metric(
                f"prefix_cache_{where}_{what}_total",
                "counter",
                f"Prompts that did (hits) or did not (misses) start from a prefix state kept in {where}.",
                [f"prefix_cache_{where}_{what}_total {b[f'prefix_{where}_{what}']}"],
            )
    for what, help in (
        ("stores", "Prefix states written to the --prompt-cache folder by this server."),
        ("evictions", "Prefix states this server evicted from the folder to keep it under --prompt-cache-size."),
        (
            "rejected",
            "Prefix state files refused (damaged, truncated, another format version, not a state) and removed.",
        ),
    ):
        metric(
            f"prefix_cache_disk_{what}_total",
            "counter",
            help,
            [f"prefix_cache_disk_{what}_total {b[f'prefix_disk_{what}']}"],
        )
    metric(
        "prefix_cache_disk_writes_paused",
        "gauge",
        "1 while a full disk pauses writing prefix states (until it has room again), else 0.",
        [f"prefix_cache_disk_writes_paused {b['prefix_disk_writes_paused']}"],
    )
    metric(
        "prefix_cache_disk_bytes",
        "gauge",
        "Bytes of prefix states in the --prompt-cache folder.",
        [f"prefix_cache_disk_bytes {b['prefix_disk_bytes']}"],
    )
    metric(
        "prefix_cache_memory_states",
        "gauge",
        "Finished requests' states kept in RAM for prefix reuse.",
        [f"prefix_cache_memory_states {b['prefix_memory_states']}"],
    )
    metric(
        "requests_rejected_total",
        "counter",
        "Requests refused with 503 because the queue was full.",
        [f"requests_rejected_total {b['requests_rejected']}"],
    )


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
            if job.choice == 0:  # a prompt shared by several choices: counted once, with its cached part
                self.prompt_tokens += len(job.prompt_ids)
                self.cached_tokens += cached or 0
            self.generation_tokens += n_generated
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
        b = host.batch_metrics()
        metric(
            "num_requests_running",
            "gauge",
            "Requests being prefilled or decoded (one batch).",
            [f"num_requests_running {b.get('active_sequences', 0)}"],
        )
        metric(
            "num_requests_waiting",
            "gauge",
            "Requests waiting in the queue.",
            [f"num_requests_waiting {b.get('queued_requests', 0)}"],
        )
        if b:
            _batch_lines(metric, b)
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
