"""Warming the expert cache at start: the hot experts read into RAM in the background while requests are served.

Owns: `ExpertWarmup` (a background thread that fills the `ExpertCache`'s free slots with the budget's worth of
experts, a few reads at a time, and reports loading / ready with progress), and the saved usage profile it can
follow (`save_profile`: the experts the cache holds when the server stops, which its eviction policy kept as the
most used; `load_profile`: them first, then the rest in file order).
Does not own: reading, slots and eviction (`expert_cache`), when to warm (the server and `chat` start it once the
engine is loaded, `fastar.engine.engine.Engine.warm_experts`).

Why a few reads at a time: the cache serves demand reads before prefetches, but a prefetch queue holding the whole
budget would still stand in front of the decode step's own prefetches (hash-routed layers, lookahead) for minutes.
So the warm-up queues `CHUNK` records, waits until the cache's reads are idle, and queues the next. It stops early
when the cache has no free slot left (requests filled it: their experts are hotter than any guess), and never
evicts anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path

from ..errors import FastarError
from .expert_cache import ExpertCache

log = logging.getLogger("fastar.warmup")

CHUNK = 8  # records queued at once (the cache has 2 loader threads)
PROFILE_VERSION = 1


def file_order(cache: ExpertCache) -> list[tuple[int, int]]:
    """Every (layer slot, expert) in the order the records lie in the file."""
    return [(layer, e) for layer in range(cache.num_layers) for e in range(cache.num_experts)]


def save_profile(cache: ExpertCache, path: str | os.PathLike, fingerprint: str) -> int:
    """Write the experts resident now (what the eviction policy kept) as the usage profile for the next start;
    `fingerprint` names the model it belongs to. -> how many. Written to a temporary name of this process and
    thread, then renamed; a write or rename that fails (a full disk, a folder in the way) removes it and raises."""
    held = sorted(cache.resident())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.partial")
    try:
        tmp.write_text(json.dumps({"version": PROFILE_VERSION, "model": fingerprint, "experts": held}))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    return len(held)


def load_profile(cache: ExpertCache, path: str | os.PathLike, fingerprint: str) -> list[tuple[int, int]] | None:
    """The warm order from a saved profile: its experts first, then the others in file order. None where there is
    no profile, or it belongs to another model or format (then the warm-up follows the file order)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as err:  # RecursionError: nested too deep to decode
        log.warning("ignoring the expert usage profile %s: %s", path, err)
        return None
    if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION or data.get("model") != fingerprint:
        return None
    experts = data.get("experts")
    first = []
    for item in experts if isinstance(experts, list) else []:  # damaged entries are left out, never an error
        if (
            isinstance(item, list)
            and len(item) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in item)
            and 0 <= item[0] < cache.num_layers
            and 0 <= item[1] < cache.num_experts
        ):
            first.append((item[0], item[1]))
    first = list(dict.fromkeys(first))
    seen = set(first)
    return first + [k for k in file_order(cache) if k not in seen]


class ExpertWarmup:
    """Reads the first `cache.n_slots` experts of `order` (default: file order) into the cache on its own thread.

    `status()` -> {"status": "loading" | "ready" | "stopped" | "failed", "experts_loaded", "experts_target",
    "progress" (0..1), "source" ("profile" or "file order"), "seconds"}. `stop()` ends it (before the cache
    closes)."""

    def __init__(self, cache: ExpertCache, order: list[tuple[int, int]] | None = None, source: str = "") -> None:
        self.cache = cache
        self.source = source or ("profile" if order is not None else "file order")
        keys = order if order is not None else file_order(cache)
        self.target = keys[: cache.n_slots]
        self.loaded = 0
        self.state = "loading"
        self.error: str | None = None
        self.seconds: float | None = None
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastar-expert-warmup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        cache = self.cache
        try:
            i = 0
            while i < len(self.target):
                if self._stop.is_set():
                    self.state = "stopped"
                    return
                free = cache.free_slots()
                if not free:  # requests took the rest: what they use is hotter than a guess
                    break
                part = self.target[i : i + min(CHUNK, free)]
                by_layer: dict[int, list[int]] = {}
                for layer, e in part:
                    by_layer.setdefault(layer, []).append(e)
                for layer, ids in by_layer.items():
                    cache.prefetch(layer, ids)
                while not cache.wait_idle(0.1):
                    if self._stop.is_set():
                        self.state = "stopped"
                        return
                i += len(part)
                self.loaded = i
            self.state = "ready"
        except FastarError as err:  # the cache closed, or a record failed to read: requests still run
            self.state, self.error = "failed", str(err)
            log.warning("warming the expert cache stopped: %s", err)
        finally:
            self.seconds = time.perf_counter() - self._t0

    def status(self) -> dict:
        n = len(self.target)
        progress = 1.0 if self.state == "ready" or not n else self.loaded / n
        d = {
            "status": self.state,
            "experts_loaded": self.loaded,
            "experts_target": n,
            "progress": round(progress, 4),
            "source": self.source,
            "seconds": round(self.seconds if self.seconds is not None else time.perf_counter() - self._t0, 3),
        }
        if self.error is not None:
            d["error"] = self.error
        return d

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the warm-up has ended (ready, stopped or failed); False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
