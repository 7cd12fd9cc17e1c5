"""The engine's routed-expert pager: the RAM-budgeted expert cache `load`'s options ask for, its warm-up at
start, and the usage profile saved at close for the next start to warm from.

Owns: `make_expert_cache` (the budget, "auto" or given, and O_DIRECT where the file system allows) and
`ExpertWarming` (`Engine.warm_experts` / `warm_status`, and the profile written when the engine closes).
Does not own: reading, slots and eviction (`fastar.weights.expert_cache`), the background warm-up thread and the
profile's file (`fastar.weights.warmup`), when to warm (`load(warm_experts=)` as the cache is made, which `serve`
and `chat` ask for; or `Engine.warm_experts` later).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import parse_size
from ..contracts import PagedSource

if TYPE_CHECKING:  # the pager is imported when an engine first pages (an engine over a mapped file never does)
    from ..weights.expert_cache import ExpertCache
    from ..weights.warmup import ExpertWarmup

log = logging.getLogger("fastar.engine")


def make_expert_cache(
    source: PagedSource,
    ram_budget: int | str,
    cache_policy: str,
    direct_io: bool | None,
    verify: bool,
    extra_bytes: int = 0,
) -> ExpertCache:
    """Expert virtual memory: routed experts paged from `source` into a RAM slab of `ram_budget` bytes ("auto":
    available memory less the resident weights, `extra_bytes` and a margin)."""
    from ..weights.expert_cache import ExpertCache
    from ..weights.expert_store import default_budget

    budget = parse_size(ram_budget)
    budget = default_budget(source, extra_bytes=extra_bytes) if budget is None else budget
    if direct_io is None:
        # O_DIRECT keeps the page cache from holding a second copy of what the slab holds (which would also push
        # the memory-mapped resident weights out of RAM), and measured faster per reader (docs/EXPERT_MEMORY.md);
        # where the filesystem does not support it, buffered reads.
        direct_io = source.supports_direct_io
    return ExpertCache(source, budget, direct=direct_io, policy=cache_policy, verify=verify)


class ExpertWarming:
    """One engine's expert warm-up: started at most once, stopped (and its usage profile saved) at close."""

    def __init__(self, cache: ExpertCache | None, fingerprint: Callable[[], str]) -> None:
        self.cache = cache
        self.fingerprint = fingerprint  # the weights' identity, so a profile is never read for another model
        self.warmup: ExpertWarmup | None = None
        self.profile_path: Path | None = None  # where `close` saves the expert usage profile

    def start(self, profile_dir: str | os.PathLike | None = None) -> None:
        """Start reading the cache's budget's worth of experts in the background; with `profile_dir`, the experts
        the cache held when this model's engine last closed come first, then the file order. Nothing to do without
        an expert cache, or when already started."""
        if self.cache is None or self.warmup is not None:
            return
        from ..weights import warmup

        order = None
        if profile_dir is not None:
            self.profile_path = Path(profile_dir) / f"hot-experts-{self.fingerprint()[:16]}.json"
            order = warmup.load_profile(self.cache, self.profile_path, self.fingerprint())
        self.warmup = warmup.ExpertWarmup(self.cache, order)

    def status(self) -> dict:
        """{"status": "off"} without a warm-up, else `ExpertWarmup.status()` (loading / ready, experts loaded of
        the target, progress, source)."""
        return {"status": "off"} if self.warmup is None else self.warmup.status()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the warm-up to finish; True once it has (or when none was started)."""
        return True if self.warmup is None else self.warmup.wait(timeout)

    def close(self, save: bool = True) -> None:
        """Stop the warm-up and (`save`) write the usage profile the next start warms from (before the cache
        closes); a load that failed saves none."""
        if self.warmup is not None:
            self.warmup.stop()
        if save and self.cache is not None and self.profile_path is not None:
            from ..weights import warmup

            try:
                warmup.save_profile(self.cache, self.profile_path, self.fingerprint())
            except OSError as err:  # its reason alone: the temporary name it names is gone
                log.warning(
                    "could not save the expert usage profile %s (%s): nothing was written",
                    self.profile_path,
                    err.strerror or err,
                )
