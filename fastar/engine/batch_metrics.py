"""The step scheduler's counters, and the /metrics dict built from them.

Owns: `BatchMetrics`: requests by outcome, prefix hits, draft steps, the batch-size histogram (decode rows per model
call -> calls), step times, the decode rates of recently finished requests; the Retry-After a full queue answers
with; and `report`, the dict `Scheduler.metrics()` returns, from these counters and what the scheduler passes in.
Does not own: the requests, the prefix caches or the choice groups it reports on (`scheduler`, `prefix_cache`,
`choices`), nor any locking: the scheduler updates it on its worker thread, or under its lock.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque


class BatchMetrics:
    """The scheduler's counters (see the module docstring)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.batch_sizes: Counter = Counter()
        self.step_seconds = 0.0
        self.last_step_seconds = 0.0
        self.rates: deque[float] = deque(maxlen=256)  # decode tok/s of recently finished requests

    def stepped(self, dt: float) -> None:
        """A step that ran a model call took dt seconds."""
        self.counts["steps"] += 1
        self.step_seconds += dt
        self.last_step_seconds = dt

    def finished(self, req) -> None:
        """req is over: its decode rate, if it decoded more than one token."""
        n = len(req.generated)
        if n > 1 and req.last_token_at > req.first_token_at:
            self.rates.append((n - 1) / (req.last_token_at - req.first_token_at))

    def retry_after(self) -> int:
        steps = self.counts["steps"]
        mean = self.step_seconds / steps if steps else 1.0
        return max(1, math.ceil(mean * 16))

    def report(self, active: list, queued: int, memory, prefix_cache, groups) -> dict:
        """The /metrics dict (`Scheduler.metrics`): `active` the scheduler's active requests, `queued` its waiting
        ones' count, `memory` its `PrefixMemory`, `prefix_cache` its `PrefixCache` or None, `groups` its
        `ChoiceGroups`."""
        now = time.perf_counter()
        live = [  # the tokens after the first (which came out of the prefill) over the time since it
            (len(r.generated) - 1) / (now - r.first_token_at)
            for r in active
            if r.first_token_at is not None and now > r.first_token_at and len(r.generated) > 1
        ]
        steps = self.counts["steps"]
        disk = prefix_cache.stats() if prefix_cache is not None else {}
        return {
            "active_sequences": len(active),
            "queued_requests": queued,
            "decoding_sequences": sum(r.pending is not None for r in active),
            "batch_size_histogram": dict(sorted(self.batch_sizes.items())),
            "steps": steps,
            "step_seconds_total": self.step_seconds,
            # None where there is nothing to average or no step yet (/metrics then has no sample: 0 read as measured)
            "step_seconds_mean": self.step_seconds / steps if steps else None,
            "step_seconds_last": self.last_step_seconds if steps else None,
            "tokens_per_s_per_sequence": live,
            "tokens_per_s_per_sequence_finished_mean": sum(self.rates) / len(self.rates) if self.rates else None,
            "requests_submitted": self.counts["submitted"],
            "requests_finished": self.counts["finished"],
            "requests_cancelled": self.counts["cancelled"],
            "requests_rejected": self.counts["rejected"],
            "prefix_cache_hits": self.counts["cache_hits"],
            "prefix_cache_tokens": self.counts["cache_tokens"],
            "prefill_progress": [(r.done, len(r.ids)) for r in active if r.pending is None and r.state is not None],
            "prefix_memory_hits": memory.hits,
            "prefix_memory_misses": memory.misses,
            "prefix_memory_states": len(memory),
            "prefix_disk_hits": disk.get("hits", 0),
            "prefix_disk_misses": disk.get("misses", 0),
            "prefix_disk_stores": disk.get("stores", 0),
            "prefix_disk_evictions": disk.get("evictions", 0),
            "prefix_disk_rejected": disk.get("rejected", 0),
            "prefix_disk_writes_paused": disk.get("writes_paused", 0),
            "prefix_disk_bytes": disk.get("bytes", 0),
            "prefix_disk_loading": sum(r.loading is not None for r in active),
            "draft_steps": self.counts["draft_steps"],
            "sampled_draft_steps": self.counts["sampled_draft_steps"],
            "forked_states": groups.forked_states,
            "forked_states_peak": groups.forked_states_peak,
        }
