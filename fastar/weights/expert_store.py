"""Expert store: where a routed expert's bytes sit, how they get there from the `.fst`, and which to evict.

Owns:
- `ExpertSlab`: the RAM tier's memory. One anonymous mapping of `n_slots x stride` bytes made once; its size IS
  the byte budget (nothing is allocated per miss). Slots are page-aligned, so O_DIRECT reads land in them.
- `ExpertReader`: one record from the file into a slot by `pread`, buffered or O_DIRECT. A short read or an I/O
  error becomes a `FormatError` naming the expert; a short read is never served as data.
- Eviction policies over the whole key space (layer slot x expert id, 11,008 keys for Flash), so they keep the
  history of experts that are not resident: `LRUPolicy` (exact LRU) and `LRFUPolicy` (recency window, then
  frequency with decay; the default, chosen by the measurements in docs/EXPERT_MEMORY.md).
- `default_budget`: the RAM budget derived from available memory.
- `CacheFullError`: every slot of a tier's budget is pinned.
Does not own: pinning, loader threads, prefetch and statistics (`expert_cache.py`); the GPU tier
(`device_cache.py`); routing (the model); the trace simulator, the mmap baseline and the disk and cache
measurements (`fastar.bench.cache`).
"""

from __future__ import annotations

import mmap
import os
import warnings

import numpy as np

from ..contracts import PagedSource
from ..errors import FastarError, FormatError
from ..format.reader import FstFile

GiB = 1 << 30


# --- memory ----------------------------------------------------------------------------------------------------


class ExpertSlab:
    """`n_slots` page-aligned buffers of `stride` bytes in one anonymous mapping, allocated once.

    Resident memory never grows beyond the slab. Its pages are faulted in by `commit`, which the cache runs on a
    thread of its own as soon as it is made (where the kernel cannot, as slots are first written).
    """

    def __init__(self, n_slots: int, stride: int) -> None:
        if n_slots < 1:
            raise ValueError(f"an expert slab needs at least one slot, got {n_slots}")
        if stride % mmap.PAGESIZE:
            raise ValueError(f"expert stride {stride} is not a multiple of the page size")
        self.n_slots, self.stride = n_slots, stride
        self._mm = mmap.mmap(-1, n_slots * stride, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:  # fewer TLB misses when the kernels stream a 13 MB record; harmless where THP is off
            self._mm.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass
        self._mv = memoryview(self._mm)

    MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without changing what they hold
    COMMIT_STEP = 256 << 20

    def commit(self, stop) -> bool:
        """Faults the whole slab in (`madvise(MADV_POPULATE_WRITE)`, a step at a time until `stop` is set), without
        changing any byte, so it is safe beside the readers filling slots. A fresh page costs the kernel a fault and
        a zeroing (and, under a VM, the host's backing): ~2 s per GB was measured here on a full machine, time a
        prefill would otherwise spend in the kernel the first time it fills each slot. -> True once every page is in;
        False when `stop` came first or the kernel lacks the call (pages then come in as slots are first written,
        as before)."""
        size = self.n_slots * self.stride
        for a in range(0, size, self.COMMIT_STEP):
            if stop.is_set():
                return False
            try:
                self._mm.madvise(self.MADV_POPULATE_WRITE, a, min(self.COMMIT_STEP, size - a))
            except (OSError, ValueError):  # an older kernel (EINVAL), or the slab closed under us
                return False
        return True

    def view(self, slot: int) -> memoryview:
        """Writable bytes of one slot (for the reader)."""
        return self._mv[slot * self.stride : (slot + 1) * self.stride]

    def close(self) -> None:
        self._mv.release()
        try:
            self._mm.close()
        except BufferError:  # arrays handed out still alive: the mapping goes when they do
            pass


def anonymous_buffer(nbytes: int) -> memoryview:
    """A fresh page-aligned buffer (valid for O_DIRECT), freed when the last view of it goes."""
    return memoryview(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


# --- I/O -------------------------------------------------------------------------------------------------------


class ExpertReader:
    """Reads expert records from an open `FstFile` into caller buffers; thread-safe (pread has no file offset).

    `direct=True` opens a second descriptor with O_DIRECT so the OS page cache does not keep a second copy of
    what the slab already holds; where the file system refuses O_DIRECT it warns and reads buffered.
    """

    def __init__(self, fst: FstFile, direct: bool = False) -> None:
        self.fst = fst
        self.fd: int | None = None
        if direct:
            self.fd = fst.open_direct()
            if self.fd is None:
                warnings.warn(
                    f"{fst.path}: O_DIRECT is not supported here; reading through the page cache", stacklevel=2
                )
        self.direct = self.fd is not None

    def read(self, layer: int, e: int, buf: memoryview) -> None:
        """Fill `buf` (>= stride bytes, page-aligned when direct) with record (layer, e) or raise FormatError."""
        try:
            self.fst.read_expert_into(layer, e, buf, fd=self.fd)
        except FormatError:
            raise
        except OSError as err:
            raise FormatError(
                f"{self.fst.path}: cannot read expert (layer {layer}, id {e}): {err.strerror or err}"
            ) from None
        except ValueError as err:  # the reader's mapping/descriptor was closed under us
            raise FormatError(f"{self.fst.path}: cannot read expert (layer {layer}, id {e}): {err}") from None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def default_budget(fst: PagedSource, margin_bytes: int | None = None, extra_bytes: int = 0) -> int:
    """RAM budget for experts: available memory minus the resident weights (and `extra_bytes` the engine keeps
    beside them: the LM head's int8 copy) minus a safety margin.

    The margin (default max(2 GiB, 10% of RAM)) leaves room for activations, the KV cache, the Python heap and
    the page cache the resident tensors are mapped through. Never below `top_k + 2` slots (a layer can always
    be computed), never above the whole bank.
    """
    import psutil

    vm = psutil.virtual_memory()
    margin = max(2 * GiB, vm.total // 10) if margin_bytes is None else margin_bytes
    bank = fst.bank
    resident = fst.resident_bytes  # the resident tensors, touched every token
    stride = bank["stride"]
    floor = (fst.config.num_experts_per_tok + 2) * stride
    total = bank["slots"] * bank["experts"] * stride
    return int(min(total, max(floor, vm.available - resident - extra_bytes - margin)) // stride * stride)


# --- eviction policies -----------------------------------------------------------------------------------------
# A policy sees every access (hit or miss) to a key k = layer * experts + e and scores keys; the cache evicts
# the evictable resident slot with the lowest score. Keeping state for all keys (tiny: 11,008 floats) means a
# popular expert that was evicted comes back with its history, which is what lets frequency beat recency here.


class LRUPolicy:
    """Exact least-recently-used: score = time of the last access."""

    name = "lru"

    def __init__(self, n_keys: int) -> None:
        self.tick = 0
        self.last = np.zeros(n_keys, np.float64)
        self._last = memoryview(self.last)  # element access without numpy scalars (see LRFUPolicy)

    def access(self, k: int) -> None:
        self.tick += 1
        self._last[k] = self.tick

    def victim(self, keys: np.ndarray) -> int:
        """Index into `keys` of the one to evict."""
        return int(np.argmin(self.last[keys]))


class LRFUPolicy:
    """Frequency with decay behind a recency window.

    Keys accessed within the last `window` accesses (the cache sets one decode token: layers x top-k) are evicted
    only when nothing else is left, so the next token's repeats hit. Among the rest the victim has the lowest
    LRFU score (Lee et al. 2001), sum over past accesses of 2^(-age/half_life), age in accesses: popular experts
    survive a cold spell, and a change of topic fades out within a few half-lives. Stored as sum
    2^((t_i - base)/h) and rescaled when the exponent grows, so there is no per-access decay pass.
    """

    name = "lrfu"

    def __init__(self, n_keys: int, half_life: float = 4096.0, window: int = 0) -> None:
        self.tick = 0
        self.base = 0
        self.inv_h = 1.0 / half_life
        self.window = window
        self.score = np.zeros(n_keys, np.float64)
        self.last = np.zeros(n_keys, np.int64)
        # the same memory element by element: an access (a decode step makes layers x top-k of them) then costs no
        # numpy scalars, ~3x less from the cold caches a step leaves; the arrays are only ever changed in place
        self._score, self._last = memoryview(self.score), memoryview(self.last)

    def access(self, k: int) -> None:
        self.tick += 1
        self._last[k] = self.tick
        x = (self.tick - self.base) * self.inv_h
        if x > 512.0:  # keep 2^x far from float64 overflow (2^1024)
            self.score *= 2.0**-x
            self.base, x = self.tick, 0.0
        self._score[k] += 2.0**x  # the same float64 addition as numpy's

    def victim(self, keys: np.ndarray) -> int:
        if self.window:
            old = np.flatnonzero(self.last[keys] <= self.tick - self.window)
            if old.size:
                return int(old[np.argmin(self.score[keys[old]])])
            return int(np.argmin(self.last[keys]))
        return int(np.argmin(self.score[keys]))


POLICIES = ("lru", "lrfu")
DEFAULT_POLICY = "lrfu"


def lrfu_params(n_slots: int, num_layers: int, top_k: int) -> tuple[float, int]:
    """(half_life, window) measured best on routing traces (docs/EXPERT_MEMORY.md): decay over ~8 cache
    turnovers; protect one decode token's experts (layers x top_k accesses), but only when the budget holds
    more than that -- a window covering the whole cache is LRU, which gets nothing on a cyclic layer scan."""
    window = num_layers * top_k
    return 8.0 * n_slots, (window if n_slots >= window else 0)


def make_policy(name: str, n_keys: int, half_life: float | None = None, window: int = 0):
    if name == "lru":
        return LRUPolicy(n_keys)
    if name == "lrfu":
        return LRFUPolicy(n_keys, 4096.0 if half_life is None else half_life, window)
    raise ValueError(f"unknown expert cache policy {name!r}; choose from {POLICIES}")


class CacheFullError(FastarError):
    """Every slot of a tier's budget is pinned and a request needs more."""
