"""What /metrics serves, as Prometheus text (the `fastar:` prefix, as vLLM uses `vllm:`).

Owns `Metrics`: the server's counters (prompt, generated and cached tokens, finish reasons, errors by status,
decode speed) and histograms (`Histogram`: time to first token, end-to-end latency), rendered with the
scheduler's `metrics()` (active and queued requests, batch sizes, step time, tokens/s per sequence, prefill
progress, prefix reuse, draft steps) and every numeric `engine.stats()` entry (speculative decoding's `draft_*`
among them).

Does not own: the counters the scheduler and the engine keep (`fastar.engine.scheduler`, `Engine.stats`), the
worker that runs them (`fastar.serve.worker`). Never imports torch.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastar.serve.worker import EngineHost, Job

log = logging.getLogger("fastar.serve")


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
    last = b["step_seconds_last"]
    metric(
        "step_seconds_last",
        "gauge",
        "Duration of the last step (no sample before the first).",
        [] if last is None else [f"step_seconds_last {last:.6f}"],
    )
    rates = b["tokens_per_s_per_sequence"]
    metric(
        "sequence_tokens_per_second",
        "gauge",
        "Decode speed of each active sequence (by its place in the batch).",
        [f'sequence_tokens_per_second{{slot="{i}"}} {r:.3f}' for i, r in enumerate(rates)],
    )
    mean = b["tokens_per_s_per_sequence_finished_mean"]
    metric(
        "sequence_tokens_per_second_finished_mean",
        "gauge",
        "Mean decode speed of recently finished sequences that decoded (more than one token; no sample before one).",
        [] if mean is None else [f"sequence_tokens_per_second_finished_mean {mean:.3f}"],
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


# engine.stats()' rates (as /metrics names them) and the counts they divide by: a rate is exported only once one of
# its counts is above 0. Before (no request yet, or only prefills for the decode rate, no draft for the draft's) the
# stats say 0.0, which reads as a measured standstill; with no sample the gauge is absent, as Prometheus has it.
ENGINE_RATES = {
    "prefill_tokens_per_s": ("prefill_seconds",),
    "decode_tokens_per_s": ("decode_seconds",),
    "draft_acceptance_rate": ("draft_tokens_verified",),
    "draft_tokens_per_pass": ("draft_verify_passes",),
    "expert_cache_hit_rate": ("expert_cache_hits", "expert_cache_misses"),
    "device_pool_hit_rate": ("device_pool_hits", "device_pool_misses"),
    "expert_cache_read_GBps": ("expert_cache_read_s",),
    "expert_cache_served_GBps": ("expert_cache_read_busy_s",),
}


def _metric_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key).strip("_")


def engine_gauges(stats: dict) -> dict[str, float]:
    """`engine.stats()` as /metrics exports it: its numbers by metric name (a nested dict's as `key_sub`), less a
    rate over nothing yet (`ENGINE_RATES`)."""
    flat: dict[str, float] = {}
    for key, value in stats.items():
        items = value.items() if isinstance(value, dict) else [("", value)]
        for sub, v in items:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                flat[_metric_name(f"{key}_{sub}" if sub else key)] = v
    return {k: v for k, v in flat.items() if k not in ENGINE_RATES or any(flat.get(c, 0) > 0 for c in ENGINE_RATES[k])}


class Metrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.decode_tokens = 0
        self.decode_seconds = 0.0
        self.last_tps: float | None = None  # None until a request decodes (a one-token reply has no decode speed)
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
            metric(  # the rates have no sample before a request decoded: a 0 would read as a measured standstill
                "generation_tokens_per_second",
                "gauge",
                "Decode speed of the last request that decoded (more than one token; no sample before one).",
                [] if self.last_tps is None else [f"generation_tokens_per_second {self.last_tps:.3f}"],
            )
            metric(
                "avg_generation_tokens_per_second",
                "gauge",
                "Decode speed over all requests that decoded (no sample before one).",
                [f"avg_generation_tokens_per_second {self.decode_tokens / self.decode_seconds:.3f}"]
                if self.decode_seconds
                else [],
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
        metric(
            "heap_trims_total",
            "counter",
            "Freed heap memory handed back to the OS (malloc_trim: the worker idle or every 10 s busy, a long prompt).",
            [f"heap_trims_total {host.heap.trims}"],
        )
        metric(
            "heap_trim_seconds_total",
            "counter",
            "Time the worker spent handing freed heap memory back to the OS.",
            [f"heap_trim_seconds_total {host.heap.seconds:.6f}"],
        )
        if host.ready.is_set():
            try:
                stats = host.engine.stats()
            except Exception:
                log.exception("engine.stats() failed")
                stats = {}
            for key, value in sorted(engine_gauges(stats).items()):
                metric(
                    f"engine_{key}",
                    "gauge",
                    f"engine.stats()['{key}'] (expert cache, prefill, decode).",
                    [f"engine_{key} {value}"],
                )
        return "\n".join(out) + "\n"
