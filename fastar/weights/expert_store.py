"""Expert store: where a routed expert's bytes sit, how they get there from the `.fst`, which to evict, and how
fast all of it is.

Owns:
- `ExpertSlab`: the RAM tier's memory. One anonymous mapping of `n_slots x stride` bytes made once; its size IS
  the byte budget (nothing is allocated per miss). Slots are page-aligned, so O_DIRECT reads land in them.
- `ExpertReader`: one record from the file into a slot by `pread`, buffered or O_DIRECT. A short read or an I/O
  error becomes a `FormatError` naming the expert; a short read is never served as data.
- Eviction policies over the whole key space (layer slot x expert id, 11,008 keys for Flash), so they keep the
  history of experts that are not resident: `LRUPolicy` (exact LRU) and `LRFUPolicy` (recency window, then
  frequency with decay; the default, chosen by the measurements in docs/EXPERT_MEMORY.md).
- `simulate`: replays a routing trace against a policy without I/O, by the cache's own rules.
- `default_budget`: the RAM budget derived from available memory.
- `DeviceExpertCache`: the GPU tier (a fixed pool of device slots fed from pinned staging buffers).
- `MmapExperts`: the plain-mmap baseline provider (page cache only, no budget), for benchmarks.
- `measure_disk`, `bench_cache`: the cache measured against the disk in the same run.
Does not own: pinning, loader threads, prefetch and statistics (`expert_cache.py`); routing (the model).
"""
from __future__ import annotations

import collections
import mmap
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import FastarError, FormatError
from ..format.reader import FstFile
from .source import ExpertWeights

GiB = 1 << 30


# --- memory ----------------------------------------------------------------------------------------------------

class ExpertSlab:
    """`n_slots` page-aligned buffers of `stride` bytes in one anonymous mapping, allocated once.

    Pages are committed lazily by the kernel as slots are first written, so resident memory grows to at most
    the slab size and never beyond it.
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

    def view(self, slot: int) -> memoryview:
        """Writable bytes of one slot (for the reader)."""
        return self._mv[slot * self.stride:(slot + 1) * self.stride]

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
                warnings.warn(f"{fst.path}: O_DIRECT is not supported here; reading through the page cache")
        self.direct = self.fd is not None

    def read(self, layer: int, e: int, buf: memoryview) -> None:
        """Fill `buf` (>= stride bytes, page-aligned when direct) with record (layer, e) or raise FormatError."""
        try:
            self.fst.read_expert_into(layer, e, buf, fd=self.fd)
        except FormatError:
            raise
        except OSError as err:
            raise FormatError(f"{self.fst.path}: cannot read expert (layer {layer}, id {e}): "
                              f"{err.strerror or err}") from None
        except ValueError as err:  # the reader's mapping/descriptor was closed under us
            raise FormatError(f"{self.fst.path}: cannot read expert (layer {layer}, id {e}): {err}") from None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def drop_page_cache(path: str | os.PathLike) -> None:
    """Ask the kernel to forget the file's clean cached pages (no root needed), for honest cold-read timing."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def default_budget(fst: FstFile, margin_bytes: int | None = None) -> int:
    """RAM budget for experts: available memory minus the resident weights minus a safety margin.

    The margin (default max(2 GiB, 10% of RAM)) leaves room for activations, the KV cache, the Python heap and
    the page cache the resident tensors are mapped through. Never below `top_k + 2` slots (a layer can always
    be computed), never above the whole bank.
    """
    import psutil

    vm = psutil.virtual_memory()
    margin = max(2 * GiB, vm.total // 10) if margin_bytes is None else margin_bytes
    bank = fst.bank
    resident = getattr(fst, "resident_bytes", None)  # the resident tensors, touched every token
    resident = fst.bank["offset"] if resident is None else resident  # .fst-like: everything before the bank
    stride = bank["stride"]
    floor = (fst.config.num_experts_per_tok + 2) * stride
    total = bank["slots"] * bank["experts"] * stride
    return int(min(total, max(floor, vm.available - resident - margin)) // stride * stride)


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

    def access(self, k: int) -> None:
        self.tick += 1
        self.last[k] = self.tick

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

    def access(self, k: int) -> None:
        self.tick += 1
        self.last[k] = self.tick
        x = (self.tick - self.base) * self.inv_h
        if x > 512.0:  # keep 2^x far from float64 overflow (2^1024)
            self.score *= 2.0 ** -x
            self.base, x = self.tick, 0.0
        self.score[k] += 2.0 ** x

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


def simulate(trace: np.ndarray, experts: int, n_slots: int, policy: str = DEFAULT_POLICY,
             half_life: float | None = None, prefetch: np.ndarray | None = None, window: int = 0) -> dict:
    """Replay `trace` [tokens, layers, k] against a cache of `n_slots` without I/O; the cache's own rules.

    Each (token, layer) step requests its unique experts together (they are pinned for the layer, so never
    victims of each other). `prefetch` [tokens, layers, k'] (ids, -1 = none) are loaded before the step and
    shielded until it, like `ExpertCache.prefetch`. Returns hits, misses, hit_rate, prefetch_loads and
    prefetch_used.
    """
    T, L, _ = trace.shape
    pol = make_policy(policy, L * experts, half_life, window)
    slot_key = np.full(n_slots, -1, np.int64)
    key_slot: dict[int, int] = {}
    unused = np.zeros(n_slots, bool)  # loaded by prefetch, not used yet
    hits = misses = evictions = pf_loads = pf_used = 0

    def load(k: int, shield: np.ndarray) -> int | None:
        nonlocal evictions
        free = np.flatnonzero(slot_key < 0)
        if free.size:
            s = int(free[0])
        else:
            cand = np.flatnonzero(~shield)
            if cand.size == 0:
                return None
            s = int(cand[pol.victim(slot_key[cand])])
            del key_slot[int(slot_key[s])]
            evictions += 1
        slot_key[s], key_slot[k] = k, s
        return s

    for t in range(T):
        for layer in range(L):
            if prefetch is not None:
                shield = np.zeros(n_slots, bool)
                for e in np.unique(prefetch[t, layer]):
                    k = layer * experts + int(e)
                    if e >= 0 and k not in key_slot:
                        s = load(k, shield)
                        if s is None:
                            break
                        shield[s] = unused[s] = True
                        pf_loads += 1
            want = [layer * experts + int(e) for e in np.unique(trace[t, layer])]
            pinned = np.zeros(n_slots, bool)
            missing = []
            for k in want:  # like ExpertCache: count every access first, then load the misses
                pol.access(k)
                s = key_slot.get(k)
                if s is None:
                    missing.append(k)
                    continue
                hits += 1
                pinned[s] = True
                pf_used += bool(unused[s])
                unused[s] = False
            misses += len(missing)
            for k in missing:
                s = load(k, pinned)
                if s is None:  # budget smaller than the layer's experts: streamed, nothing kept
                    continue
                pinned[s], unused[s] = True, False
    n = hits + misses
    return {"policy": policy, "n_slots": n_slots, "hits": hits, "misses": misses, "evictions": evictions,
            "hit_rate": hits / n if n else 0.0, "prefetch_loads": pf_loads, "prefetch_used": pf_used}


# --- baseline --------------------------------------------------------------------------------------------------

class MmapExperts:
    """Baseline provider: zero-copy views of the file's mapping, paged by the kernel (no budget, no control).

    `prefetch` is `madvise(WILLNEED)`. A file truncated under it kills the process with SIGBUS on access, which
    is one reason the cache reads with pread instead.
    """

    def __init__(self, fst: FstFile) -> None:
        self.fst = fst

    def get(self, layer: int, e: int) -> ExpertWeights:
        return self.fst.expert(layer, e)

    def prefetch(self, layer: int, ids, source: str = "manual") -> None:
        mm, stride = self.fst._mm, self.fst.expert_stride
        for e in ids:
            mm.madvise(mmap.MADV_WILLNEED, self.fst.expert_offset(layer, int(e)), stride)


class CacheFullError(FastarError):
    """Every slot of a tier's budget is pinned and a request needs more."""


# --- device tier -----------------------------------------------------------------------------------------------

class DeviceExpertCache:
    """GPU tier over a RAM tier (`ExpertCache`): a fixed pool of expert slots in device memory, LRU, filled
    through pinned host staging buffers on a side stream. A drop-in provider: `get(layer, e)` returns
    `ExpertWeights` of uint8 CUDA tensors, valid until the caller asks for another layer.

    Ordering without host syncs: the compute stream waits on each copy's event; a slot is overwritten only after
    the side stream has waited for the event recorded on the compute stream when the slot's layer ended; a
    staging buffer is refilled only after its previous copy finished (the one host wait, two copies back).
    """

    def __init__(self, ram, budget_bytes: int, device: str = "cuda", staging: int = 2) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("the device expert tier needs CUDA (torch.cuda.is_available() is false)")
        self.torch, self.ram, self.stride = torch, ram, ram.stride
        self.n_slots = int(budget_bytes) // self.stride
        if self.n_slots < 1:
            raise ValueError(f"device expert budget {budget_bytes} B is smaller than one expert ({self.stride} B)")
        self.device = torch.device(device)
        self.sections = ram.fst.bank["sections"]
        self.pool = torch.empty((self.n_slots, self.stride), dtype=torch.uint8, device=self.device)
        self.staging = [torch.empty(self.stride, dtype=torch.uint8, pin_memory=True) for _ in range(staging)]
        self._staging_np = [t.numpy() for t in self.staging]
        self._staging_ev: list = [None] * staging
        self._slot_ev: list = [None] * self.n_slots
        self._next = 0
        self.stream = torch.cuda.Stream(self.device)
        self._lru: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._free = list(range(self.n_slots - 1, -1, -1))
        self._layer: int | None = None
        self._in_use: dict[int, int] = {}
        self.hits = self.misses = self.bytes_copied = 0

    def get(self, layer: int, e: int) -> ExpertWeights:
        if layer != self._layer:
            self.end_layer()
            self._layer = layer
        slot = self._in_use.get(e)
        if slot is None:
            k = layer * self.ram.num_experts + e
            slot = self._lru.get(k)
            if slot is not None:
                self._lru.move_to_end(k)
                self.hits += 1
            else:
                slot = self._load(layer, e, k)
                self.misses += 1
            self._in_use[e] = slot
        row = self.pool[slot]
        return ExpertWeights(*(row[s["offset"]:s["offset"] + s["nbytes"]].view(*s["shape"]) for s in self.sections))

    def prefetch(self, layer: int, ids, source: str = "manual") -> int:
        """Reads into the RAM tier; the host-to-device copy happens at `get` (it is ~50x faster than the disk)."""
        return self.ram.prefetch(layer, ids, source)

    def end_layer(self) -> None:
        """Mark the current layer's slots reusable once the compute stream has passed this point."""
        if self._in_use:
            ev = self.torch.cuda.Event()
            ev.record(self.torch.cuda.current_stream(self.device))
            for s in self._in_use.values():
                self._slot_ev[s] = ev
            self._in_use = {}

    def _victim(self) -> int:
        if self._free:
            return self._free.pop()
        used = set(self._in_use.values())
        for k, s in self._lru.items():
            if s not in used:
                del self._lru[k]
                return s
        raise CacheFullError(f"device expert budget ({self.n_slots} slots of {self.stride} B) is full with layer "
                             f"{self._layer}'s experts; raise it")

    def _load(self, layer: int, e: int, k: int) -> int:
        torch = self.torch
        slot = self._victim()
        i, self._next = self._next, (self._next + 1) % len(self.staging)
        if self._staging_ev[i] is not None:
            self._staging_ev[i].synchronize()
        with self.ram.acquire(layer, [e]) as hs:  # pinned in RAM only for the memcpy into staging
            self._staging_np[i][:] = np.frombuffer(hs[0].buffer, np.uint8)
        with torch.cuda.stream(self.stream):
            if self._slot_ev[slot] is not None:
                self.stream.wait_event(self._slot_ev[slot])
            self.pool[slot].copy_(self.staging[i], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self._staging_ev[i] = ev
        torch.cuda.current_stream(self.device).wait_event(ev)
        self._lru[k] = slot
        self.bytes_copied += self.stride
        return slot

    def stats(self) -> dict:
        n = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "hit_rate": self.hits / n if n else 0.0,
                "bytes_copied": self.bytes_copied, "n_slots": self.n_slots, "budget_bytes": self.n_slots * self.stride}


# --- measurement -----------------------------------------------------------------------------------------------

def measure_disk(fst: FstFile, records: int = 48, seed: int = 0) -> dict:
    """Read bandwidth for whole expert records, measured now, three ways on `records` random records each:
    O_DIRECT `pread` (the disk itself), buffered `pread` with the file's page cache dropped first (disk plus
    readahead plus a copy), and first touch of every page through the mapping (page faults and readahead);
    plus buffered re-reads of one record (a page-cache hit: the copy cost)."""
    b = fst.bank
    stride = fst.expert_stride
    n_rec = b["slots"] * b["experts"]
    picks = [divmod(int(i), b["experts"]) for i in
             np.random.default_rng(seed).choice(n_rec, min(4 * records, n_rec), replace=False)]
    sets = [picks[k::4] for k in range(4)]  # disjoint records per method
    buf = anonymous_buffer(stride)
    out: dict = {}

    def timed(name: str, keys, read) -> None:
        times = []
        for slot, e in keys:
            t0 = time.perf_counter()
            read(slot, e)
            times.append(time.perf_counter() - t0)
        out[f"{name}_GBps"] = len(times) * stride / sum(times) / 1e9
        out[f"{name}_p50_ms"] = float(np.median(times)) * 1e3

    drop_page_cache(fst.path)
    fd = fst.open_direct()
    if fd is not None:
        try:
            timed("direct", sets[0], lambda s, e: fst.read_expert_into(s, e, buf, fd=fd))
        finally:
            os.close(fd)
        # two readers at once, as the cache's loader threads do (some disks only reach their rate in parallel)
        drop_page_cache(fst.path)
        fds, bufs = [fst.open_direct() for _ in range(2)], [buf, anonymous_buffer(stride)]
        keys = sets[3]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda i: [fst.read_expert_into(*k, bufs[i], fd=fds[i]) for k in keys[i::2]], (0, 1)))
        out["direct_2threads_GBps"] = len(keys) * stride / (time.perf_counter() - t0) / 1e9
        for f in fds:
            os.close(f)
    drop_page_cache(fst.path)
    timed("buffered_cold", sets[1], lambda s, e: fst.read_expert_into(s, e, buf))
    drop_page_cache(fst.path)
    fd = os.open(fst.path, os.O_RDONLY)  # a mapping of its own: pages mapped here must not outlive the probe
    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    os.close(fd)
    try:
        timed("mmap_cold", sets[2], lambda s, e: _touch(memoryview(mm)[fst.expert_offset(s, e):][:stride]))
    finally:
        mm.close()
    slot, e = picks[0]
    fst.read_expert_into(slot, e, buf)  # warm
    timed("pagecache", [(slot, e)] * 8, lambda s, e: fst.read_expert_into(s, e, buf))
    out["records"] = len(sets[0])
    return out


def _touch(buf) -> int:
    """Compute stand-in: one pass over the record's bytes (what a fused kernel reads, ~1 ms per Flash expert)."""
    mv = memoryview(buf).cast("B")
    return int(np.frombuffer(mv, np.uint64, count=len(mv) // 8).sum())


def _cached_kb() -> int:
    with open("/proc/meminfo") as f:
        return next((int(line.split()[1]) for line in f if line.startswith("Cached:")), 0)


def _replay(cache, trace: np.ndarray, prefetch: np.ndarray | None, hash_layers: int, touch: bool,
            dense_s: float, cold: str | os.PathLike | None) -> float:
    """The decode loop's shape. Per token: the hash layers' experts are prefetched exactly at its start; before
    each layer's dense part runs (`dense_s` of sleep: attention etc., in kernels that release the GIL) the next
    layer's predicted experts are prefetched (lookahead); then the layer streams its experts, each touched once
    as a kernel would. `cold`: drop the file's page cache every token (a model much larger than RAM); returns
    the seconds spent dropping, which are the emulation's and not the cache's."""
    T, L, _ = trace.shape
    streaming = hasattr(cache, "iter_ready")
    overhead = 0.0
    for t in range(T):
        if cold is not None:
            t0 = time.perf_counter()
            drop_page_cache(cold)
            overhead += time.perf_counter() - t0
        for layer in range(min(hash_layers, L) if prefetch is not None else 0):
            cache.prefetch(layer, prefetch[t, layer][prefetch[t, layer] >= 0], source="hash")
        for layer in range(L):
            nxt = layer + 1
            if prefetch is not None and hash_layers <= nxt < L:
                cache.prefetch(nxt, prefetch[t, nxt][prefetch[t, nxt] >= 0], source="lookahead")
            time.sleep(dense_s)
            ids = np.unique(trace[t, layer])
            if streaming:
                for h in cache.iter_ready(layer, ids):
                    if touch:
                        _touch(h.buffer)
            else:
                for e in ids:
                    w = cache.get(layer, int(e))
                    for a in w if touch else ():
                        _touch(a)
    if hasattr(cache, "release_all"):
        cache.release_all()
    return overhead


def bench_cache(fst_path: str | os.PathLike, budgets: list[int], trace: np.ndarray, *,
                policies: tuple[str, ...] = POLICIES, modes: tuple[str, ...] = ("direct", "pread", "mmap"),
                prefetch: np.ndarray | None = None, hash_layers: int = 3, warmup_tokens: int = 0,
                timed_tokens: int | None = None, dense_s: float = 0.0, cold: bool = False, io_threads: int = 2,
                touch: bool = True, disk_records: int = 48, log=None) -> dict:
    """Measure the expert cache on `fst_path` with routing `trace` [tokens, layers, k].

    Returns a dict:
      "disk": `measure_disk` (O_DIRECT GB/s of whole records, page-cache pread GB/s), measured in this run;
      "simulated": hit rate of every policy x budget (x with/without `prefetch`) over the whole trace, no I/O;
      "runs": timed replays for each budget x mode x policy (x prefetch): the page cache is dropped, then
        `warmup_tokens` are replayed untimed, then `timed_tokens` timed. Each run has the cache's `stats()`,
        wall time, tokens/s, effective GB/s (bytes read / wall) and its ratio to the disk's O_DIRECT bandwidth,
        RSS growth over the timed part, page-cache growth over the whole run. Mode "mmap" is the no-budget
        baseline (once per prefetch setting).
    `dense_s` sleeps per layer for the non-expert compute; `cold` drops the page cache every token.
    """
    import psutil

    from .expert_cache import ExpertCache

    say = log or (lambda *_: None)
    fst = FstFile(fst_path)
    experts = fst.bank["experts"]
    res: dict = {"file": str(fst_path), "stride": fst.expert_stride, "trace_shape": list(trace.shape),
                 "dense_s": dense_s, "cold": cold}
    res["disk"] = disk = measure_disk(fst, disk_records)
    say(f"disk: {disk}")
    pfs = [None, prefetch] if prefetch is not None else [None]
    sims = []
    for budget in budgets:
        n = budget // fst.expert_stride
        for pol in policies:
            for pf in pfs:
                hl, win = lrfu_params(n, trace.shape[1], trace.shape[2])
                r = simulate(trace, experts, n, pol, half_life=hl, prefetch=pf, window=win)
                r.update(budget_bytes=budget, prefetch=pf is not None)
                sims.append(r)
                say(f"simulated {pol} {budget / GiB:.2f} GiB prefetch={pf is not None}: hit {r['hit_rate']:.3f}")
    res["simulated"] = sims
    end = warmup_tokens + (timed_tokens or trace.shape[0] - warmup_tokens)
    runs = []
    proc = psutil.Process()
    plan = [(None, "mmap", None, pf) for pf in pfs] if "mmap" in modes else []
    plan += [(b, m, p, pf) for b in budgets for m in modes if m != "mmap" for p in policies for pf in pfs]
    for budget, mode, pol, pf in plan:
        drop_page_cache(fst_path)
        cached0 = _cached_kb()  # page-cache growth over the whole run: the second copy buffered reads keep
        cold_path = fst_path if cold and mode != "direct" else None
        pw = None if pf is None else pf[:warmup_tokens]
        pt = None if pf is None else pf[warmup_tokens:end]
        if mode == "mmap":
            import resource

            # its own mapping, closed after the run: mapped pages are immune to the page-cache drops that
            # the other modes' measurements rely on
            cache = MmapExperts(FstFile(fst_path))
            _replay(cache, trace[:warmup_tokens], pw, hash_layers, touch, dense_s, cold_path)
            maj0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        else:
            cache = ExpertCache(fst, budget, io_threads=io_threads, direct=(mode == "direct"), policy=pol)
            _replay(cache, trace[:warmup_tokens], pw, hash_layers, touch, dense_s, cold_path)
            cache.wait_idle()
            cache.reset_stats()
        rss0 = proc.memory_info().rss
        t0 = time.perf_counter()
        wall = -_replay(cache, trace[warmup_tokens:end], pt, hash_layers, touch, dense_s, cold_path)
        wall += time.perf_counter() - t0
        if mode == "mmap":
            st = {"major_faults": resource.getrusage(resource.RUSAGE_SELF).ru_majflt - maj0}
        else:
            st = cache.stats()
        run = {"mode": mode, "policy": pol, "budget_bytes": budget, "prefetch": pf is not None,
               "tokens": end - warmup_tokens, "wall_s": wall, "tokens_per_s": (end - warmup_tokens) / wall,
               "rss_bytes": proc.memory_info().rss, "rss_growth_bytes": proc.memory_info().rss - rss0,
               "pagecache_growth_bytes": (_cached_kb() - cached0) * 1024, **st}
        cache.fst.close() if mode == "mmap" else cache.close()
        if "bytes_read" in st:
            run["stall_fraction"] = st["stall_s"] / wall
            run["effective_GBps"] = st["bytes_read"] / wall / 1e9
            if "direct_GBps" in disk:
                run["vs_disk"] = run["effective_GBps"] / max(disk["direct_GBps"], disk["direct_2threads_GBps"])
        runs.append(run)
        say(f"run {mode} {pol} {None if budget is None else round(budget / GiB, 2)} GiB prefetch={pf is not None}: "
            + ", ".join(f"{k}={run[k]:.3g}" for k in ("wall_s", "tokens_per_s", "hit_rate", "stall_fraction",
                                                       "effective_GBps", "vs_disk", "prefetch_used",
                                                       "prefetch_wasted_bytes", "major_faults",
                                                       "pagecache_growth_bytes") if k in run))
    res["runs"] = runs
    res["disk_end"] = measure_disk(fst, disk_records, seed=1)  # the disk drifts: bracket the runs
    say(f"disk at the end: {res['disk_end']}")
    fst.close()
    return res
