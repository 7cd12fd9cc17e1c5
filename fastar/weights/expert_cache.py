"""Expert virtual memory: routed experts paged from the `.fst` on SSD into a RAM tier of fixed size, and with
CUDA into a device tier on top of it.

Owns:
- `ExpertCache`: the RAM tier. A slab of `budget // stride` slots allocated once (the slab IS the budget),
  eviction by a policy from `expert_store`, pinning (`acquire`/`release`, `ExpertHandle`), loader threads that
  overlap reads with compute (`prefetch`, `get`, `iter_ready`), one read per expert however many threads ask,
  read errors delivered to the requesting thread as `FormatError`s naming the expert, statistics.
- Prefetch helpers: exact for hash-routed layers (`prefetch_tokens`), router lookahead (`prefetch(...,
  source="lookahead")`), each with its own used/wasted accounting.
Does not own: the slab, I/O primitives and policies (`expert_store`), the device tier (`device_cache`), the
benchmark (`fastar.bench.cache`), routing math (the model computes ids). Design and measurements:
docs/EXPERT_MEMORY.md.

Threading: one lock and condition guard all state; loader threads `pread` with the lock (and the GIL) released,
so reads overlap compute. Loads someone waits for ("demand") go before prefetches; a prefetch that finds no
evictable slot is dropped, never waited for.

Lifetime of arrays: handles from `acquire`/`iter_ready` stay valid until released. `get(layer, e)` (the model's
drop-in provider call) pins implicitly: its arrays stay valid until the same thread asks for another layer or
calls `release_all()`. When pins fill the budget, `acquire` raises `CacheFullError` naming the budget, while
`get` reads into a transient buffer outside the slab (counted as `transient_reads`) so that a prefill whose
layer needs more experts than the budget holds still runs; `iter_ready` streams any number of experts through
any budget of at least one free slot.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import xxhash

from ..contracts import ExpertWeights
from ..errors import FastarError, FormatError, OptionError
from ..format.reader import FstFile
from . import expert_store as store
from .expert_store import CacheFullError
from .resident_batch import ResidentBatches

_FREE, _LOADING, _READY = 0, 1, 2
SOURCES = ("manual", "hash", "lookahead")


@dataclass(eq=False)
class _Load:
    key: int
    layer: int
    expert: int
    demand: bool
    source: int = -1  # index into SOURCES when a prefetch issued it
    claims: int = 0  # pins to hand to the slot once one is allocated
    scan: bool = False  # asked for by a prefill scan: its slot is taken from what was used last (see _alloc)
    slot: int = -1
    done: bool = False
    error: BaseException | None = None


class ExpertHandle:
    """One pinned expert: `weights` (read-only views into the slab) stay valid until `release()`."""

    __slots__ = ("layer", "expert", "weights", "buffer", "_cache", "_slot", "_live")

    def __init__(
        self, layer: int, expert: int, weights: ExpertWeights, buffer: memoryview, cache: ExpertCache | None, slot: int
    ) -> None:
        self.layer, self.expert, self.weights, self.buffer = layer, expert, weights, buffer
        self._cache, self._slot, self._live = cache, slot, True

    def release(self) -> None:
        if self._live:
            self._live = False
            if self._cache is not None:
                self._cache._unpin(self._slot)

    def __enter__(self) -> ExpertHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class ExpertHandles(list):
    """The handles of one `acquire`, in the order of the ids asked for; a context manager releasing them all."""

    def release(self) -> None:
        for h in self:
            h.release()

    def __enter__(self) -> ExpertHandles:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class _Implicit:
    """One thread's implicit `get` pins; a thread-local, so a thread that exits releases them."""

    __slots__ = ("layer", "held")

    def __init__(self) -> None:
        self.layer, self.held = -1, {}

    def release(self) -> None:
        for h in self.held.values():
            h.release()
        self.held.clear()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown or a closed cache
            pass


class ExpertCache(ResidentBatches):
    """RAM tier of routed experts over an open `.fst`: an `ExpertProvider` (`fastar.contracts`) plus the richer API.

    Args:
        fst: the open file.
        ram_budget_bytes: bytes of expert slots; None derives it from available memory (`default_budget`).
        io_threads: loader threads (the disk gains nothing from more than 2; they mostly overlap compute).
        direct: read with O_DIRECT so the page cache holds no second copy (measured faster too when the experts
            do not fit in RAM; see docs/EXPERT_MEMORY.md).
        policy: "lrfu" (recency window + frequency with decay, default) or "lru".
        half_life: LRFU half-life in accesses (default 8 x the number of slots).
        verify: check each record's xxh64 the first time it is read (~1 ms per 13 MB record; later reads of the
            same record are not checked again). On by default: a corrupt record is an error naming it, not
            garbage text.
    """

    pages = True

    def __init__(
        self,
        fst: FstFile,
        ram_budget_bytes: int | None = None,
        io_threads: int = 2,
        direct: bool = False,
        policy: str = store.DEFAULT_POLICY,
        *,
        half_life: float | None = None,
        verify: bool = True,
    ) -> None:
        if fst.bank is None:
            raise FormatError(f"{fst.path}: has no expert bank")
        self.fst, self.stride = fst, fst.expert_stride
        self.num_layers, self.num_experts = fst.bank["slots"], fst.bank["experts"]
        budget = store.default_budget(fst) if ram_budget_bytes is None else int(ram_budget_bytes)
        n_slots = min(budget // self.stride, self.num_layers * self.num_experts)
        if n_slots < 1:
            need = (fst.config.num_experts_per_tok + 2) * self.stride
            raise OptionError(  # the size as one would type it (a MiB count, rounded up), and the exact bytes
                "ram_budget",
                budget,
                f"{budget} B is smaller than one expert ({self.stride} B); give at least "
                f"{{ram_budget={-(-need // (1 << 20))}M}} ({need} bytes), or {{ram_budget=None}}",
            )
        self.n_slots, self.budget_bytes = n_slots, n_slots * self.stride
        hl, self.policy_window = store.lrfu_params(n_slots, self.num_layers, fst.config.num_experts_per_tok)
        self.policy_half_life = hl if half_life is None else float(half_life)
        self.policy = store.make_policy(
            policy, self.num_layers * self.num_experts, self.policy_half_life, self.policy_window
        )
        self._slab = store.ExpertSlab(n_slots, self.stride)
        # the slab's pages are faulted in off the worker, now, rather than by the first prompt that fills each slot
        self._commit_stop, self._paged_in, self.commit_seconds = threading.Event(), threading.Event(), None
        self._commit_thread = threading.Thread(target=self._commit, name="fastar-expert-commit", daemon=True)
        self._commit_thread.start()
        self._slot_views: dict[int, tuple] = {}  # slot -> (read-only buffer, ExpertWeights views): made once a slot
        self._reader = store.ExpertReader(fst, direct)
        self.direct, self._verify = self._reader.direct, verify
        self._digests = fst.bank.get("xxh64") if verify else None
        self._verified = np.zeros(self.num_layers * self.num_experts, bool)  # records checked once already
        # per-slot state (numpy so victim search is one vectorized pass)
        self._slot_key = np.full(n_slots, -1, np.int64)
        self._state = np.zeros(n_slots, np.int8)
        self._pins = np.zeros(n_slots, np.int32)
        self._shield = np.zeros(n_slots, bool)  # prefetched or wanted soon: evicted only as a last resort
        self._shield_epoch = np.zeros(n_slots, np.int64)
        self._unused = np.full(n_slots, -1, np.int8)  # prefetch source of a loaded, not yet used record
        self._last_use = np.zeros(n_slots, np.int64)  # tick of each slot's latest handle: a scan evicts the newest
        self._init_resident()  # element views of the arrays above (`resident_batch`)
        self._tick = 0
        self._free = list(range(n_slots - 1, -1, -1))
        self._key_slot: dict[int, int] = {}
        self._inflight: dict[int, _Load] = {}
        self._demand: collections.deque[_Load] = collections.deque()
        self._prefetch: collections.deque[_Load] = collections.deque()
        self._cur_layer, self._epoch = -1, 0
        self._holds_bank = n_slots == self.num_layers * self.num_experts  # nothing is ever evicted (`_whole_layer`)
        self._layer_ready = [0] * self.num_layers  # records of each layer resident
        self._layer_views: list[tuple | None] = [None] * self.num_layers  # `_whole_layer`'s, once a layer is in
        self._starved = False  # a loader waits for a slot to lose its last pin: only then does an unpin wake
        # the loaders (waking them for nothing costs the decode thread GIL hand-offs)
        self._cond = threading.Condition(threading.RLock())  # RLock: a thread-exit release may nest
        self._tls = threading.local()
        self._closed, self._fatal = False, None
        self._reading, self._busy_since = 0, 0.0  # loads being read now; since when at least one has been
        self.reset_stats()
        self._threads = [
            threading.Thread(target=self._worker, name=f"fastar-expert-io-{i}", daemon=True)
            for i in range(max(1, io_threads))
        ]
        for t in self._threads:
            t.start()

    # --- public API ------------------------------------------------------------------------------------------

    def get(self, layer: int, e: int) -> ExpertWeights:
        """The expert's arrays, blocking only on this expert. Valid until this thread asks for another layer."""
        held = self._implicit(layer)
        h = held.get(e)
        if h is None:
            try:
                h = self._acquire(layer, [int(e)])[0]
            except CacheFullError:
                h = self._transient(layer, int(e))
            held[e] = h
        return h.weights

    def _implicit(self, layer: int) -> dict[int, ExpertHandle]:
        """This thread's implicit `get` pins, dropped first when it turns to another layer."""
        imp = getattr(self._tls, "imp", None)
        if imp is None:
            imp = self._tls.imp = _Implicit()
        if imp.layer != layer:
            imp.release()
            imp.layer = layer
        return imp.held

    def release_all(self) -> None:
        """Release the implicit pins this thread holds through `get` (a thread's exit releases them too)."""
        imp = getattr(self._tls, "imp", None)
        if imp is not None:
            imp.release()

    def acquire(self, layer: int, ids: Iterable[int]) -> ExpertHandles:
        """Pin the experts `ids` of `layer`, reading the absent ones; returns when all are present.

        Raises CacheFullError when the budget cannot hold them all pinned at once (use `iter_ready` to stream),
        FormatError when a record cannot be read.
        """
        ids = [int(e) for e in ids]
        self._implicit(layer)
        by_e = dict(zip(dict.fromkeys(ids), self._acquire(layer, list(dict.fromkeys(ids)))))
        return ExpertHandles(by_e[e] for e in ids)

    def release(self, handles: ExpertHandle | Iterable[ExpertHandle]) -> None:
        for h in [handles] if isinstance(handles, ExpertHandle) else handles:
            h.release()

    def prefetch(self, layer: int, ids: Iterable[int], source: str = "manual", *, scan: bool = False) -> int:
        """Queue reads of the absent experts among `ids` and return at once; returns how many were queued.

        `source` ("manual", "hash", "lookahead") keys the used/wasted accounting in `stats()`; `scan`: for a
        prefill scan, slots taken as `iter_ready(scan=True)` takes them.
        """
        src = SOURCES.index(source)
        n = 0
        with self._cond:
            self._check_open()
            wanted = list(dict.fromkeys(int(x) for x in ids))
            if scan:  # what the layer has resident is wanted soon: shield it from the reads that follow
                for e in wanted:
                    s = self._key_slot.get(self._key(layer, e))
                    if s is not None and self._state[s] == _READY:
                        self._shield[s], self._shield_epoch[s] = True, self._epoch
            # a scan's prefetch takes only slots nobody holds or wants now: a read evicted before its use would be
            # read twice in one pass
            room = (
                self.n_slots - self._committed() - int(np.count_nonzero(self._shield & (self._pins == 0)))
                if scan
                else 0
            )
            for e in wanted:
                k = self._key(layer, e)
                if k in self._key_slot or k in self._inflight:
                    continue
                if scan and n >= room:
                    break
                load = _Load(k, layer, e, demand=False, source=src, scan=scan)
                self._inflight[k] = load
                self._prefetch.append(load)
                self._src[src]["issued"] += 1
                n += 1
            if n:
                self._cond.notify_all()
        return n

    def prefetch_tokens(self, token_ids: Iterable[int], tid2eid: Mapping[int, np.ndarray]) -> int:
        """Exact prefetch for hash-routed layers: `tid2eid[layer]` [vocab, k] gives the experts before they run. A layer
        all in a budget that holds the whole bank is skipped (`_whole_layer`: every prefetch would find its record)."""
        todo = [(layer, t) for layer, t in tid2eid.items() if not (self._holds_bank and self._whole_layer(layer))]
        if not todo:
            return 0
        tok = np.asarray(list(token_ids), np.int64)
        return sum(self.prefetch(layer, np.unique(np.asarray(t)[tok]), source="hash") for layer, t in todo)

    def iter_ready(self, layer: int, ids: Iterable[int], batch: bool = False, *, scan: bool = False) -> Iterator:
        """Yield handles of `layer`'s experts `ids` as each becomes present (resident ones first).

        Each yielded handle stays pinned until the next step of the iteration, so compute on the first experts
        starts before the rest arrive and any number of experts streams through a budget of one free slot.
        `batch=True` yields lists instead: every expert present at that moment at once (all resident ones first,
        then what has landed since), pinned together until the next step.
        `scan=True`: a prefill pass that will ask for (nearly) every expert of every layer in turn, a cyclic scan.
        Its reads take the slot used most recently (MRU: the record whose next use in the scan is furthest away,
        Belady's choice for a loop) instead of the policy's victim, and only 2 per loader thread are in flight
        (ahead of that they would take the previous layers' records before this layer's are used), so the other
        layers' records stay resident and a pass over a bank larger than the budget reads about bank - budget,
        not all of it (LRU and LRFU evict exactly what the loop needs next). Combine with `batch=False`: a
        batch holds its records pinned, so they cannot be the slots the next reads take.
        """
        uniq = list(dict.fromkeys(int(e) for e in ids))
        keys = {e: self._key(layer, e) for e in uniq}
        self._implicit(layer)
        ahead = 2 * len(self._threads)  # a scan's reads in flight: enough to keep the loaders busy, few enough
        # that each takes its slot from this layer's used records (the newest) rather than from the layers before
        held: list[ExpertHandle] = []
        outstanding: dict[int, _Load] = {}
        with self._cond:
            self._check_open()
            self._enter_layer(layer)
            ready, todo = collections.deque(), collections.deque()
            for e in uniq:
                self.policy.access(keys[e])
                s = self._key_slot.get(keys[e])
                if s is not None and self._state[s] == _READY:
                    self._shield[s] = True  # our own loads must not evict what we are about to use
                    self._shield_epoch[s] = self._epoch
                    ready.append(e)
                else:
                    todo.append(e)
        try:
            while ready or todo or outstanding:
                with self._cond:
                    for h in held:
                        self._unpin_locked(h._slot)
                        h._live = False
                    held = []
                    while (
                        todo
                        and self._committed() < self.n_slots
                        and (not scan or len(outstanding) < ahead + len(self._free))  # free slots evict nothing
                    ):
                        e = todo.popleft()
                        r = self._claim(keys[e], layer, e, scan)
                        if isinstance(r, _Load):
                            outstanding[e] = r
                        else:  # arrived meanwhile (someone else's read): already pinned by the claim
                            held.append(self._handle(layer, e, r))
                            if not batch:
                                break
                    while batch or not held:
                        h = self._next_ready(layer, ready, outstanding, todo, keys)
                        if h is None:
                            break
                        held.append(h)
                    if not held:
                        if not outstanding:
                            raise CacheFullError(self._full_msg(layer, 1))
                        self._wait(outstanding.values(), every=False)
                        continue
                yield list(held) if batch else held[0]
        finally:
            with self._cond:
                for h in held:
                    if h._live:
                        self._unpin_locked(h._slot)
                        h._live = False
                for load in outstanding.values():
                    self._drop_claim(load)
                if outstanding:
                    self._cond.notify_all()

    def each_batch(
        self, layer: int, ids: Iterable[int], *, scan: bool = False
    ) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """Lists of (expert id, weights): all that are present at once, then what arrives (`iter_ready(batch=True)`);
        with every expert resident, one list: the MoE then runs the layer's experts in one kernel call. `scan`:
        as `iter_ready`'s (a prefill pass over the layers). Where the budget holds the whole bank and the layer is all
        in, the list comes without pins or handles (`_whole_layer`: nothing can be evicted), the same hits counted;
        otherwise, where the budget holds them all pinned at once, claimed together in one pass and released together
        when the iteration ends (`resident_batch`: no handles), the same accesses counted."""
        if scan:  # one at a time: each record used frees its slot for the next read (see iter_ready)
            for h in self.iter_ready(layer, ids, scan=True):
                yield [(h.expert, h.weights)]
            return
        uniq = list(dict.fromkeys(map(int, ids)))
        whole = None
        if self._holds_bank and uniq:  # (a decode step asks per layer, from cold caches: the known views first)
            whole = self._layer_views[layer] if 0 <= layer < self.num_layers else None
            whole = whole if whole is not None else self._whole_layer(layer)
        if whole is not None and min(uniq) >= 0 and max(uniq) < self.num_experts:
            views, slots, unused = whole
            with self._cond:  # a hit each, and a prefetched record's first use, as `_claim` counts them
                if self._closed:
                    self._check_open()
                self._stats["hits"] += len(uniq)
                for e in uniq if unused else ():
                    if e in unused:
                        unused.discard(e)
                        if self._unused[slots[e]] >= 0:  # (unless a `get` or `acquire` used it first)
                            self._src[self._unused[slots[e]]]["used"] += 1
                            self._unused[slots[e]] = -1
            yield [(e, views[e]) for e in uniq]
            return
        if uniq and 0 <= layer < self.num_layers and min(uniq) >= 0 and max(uniq) < self.num_experts:
            self._implicit(layer)
            claimed = self._claim_layer(layer, uniq)  # pinned or claimed together (`resident_batch`)
            if claimed is not None:
                yield from self._claimed_batches(*claimed)
                return
        for hs in self.iter_ready(layer, uniq, batch=True):
            yield [(h.expert, h.weights) for h in hs]

    def _whole_layer(self, layer: int) -> tuple[list[ExpertWeights], list[int], set[int]] | None:
        """Every expert's weights and slot of `layer` once all are resident in a budget that holds the whole bank, and
        the experts among them prefetched and not used yet (no record of the layer is read any more: only fewer), else
        None. Nothing is evicted then (a record is read only into a free slot, and there is always one for a record
        not yet in), so from that point these views stay valid and need no pins, no recency and no handles: a decode
        step's `each_batch` hands them out and counts the hits (its bookkeeping otherwise costs ~100 us a layer from
        the cold caches a step leaves)."""
        got = self._layer_views[layer] if 0 <= layer < self.num_layers else None
        if got is None and 0 <= layer < self.num_layers and self._layer_ready[layer] == self.num_experts:
            with self._cond:
                slots = [self._key_slot[self._key(layer, e)] for e in range(self.num_experts)]
                views = []
                for s in slots:
                    if s not in self._slot_views:
                        buf = self._slab.view(s).toreadonly()
                        self._slot_views[s] = (buf, self.fst.expert_views(buf))
                    views.append(self._slot_views[s][1])
                unused = {e for e, s in enumerate(slots) if self._unused[s] >= 0}
                got = self._layer_views[layer] = (views, slots, unused)
        return got

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no read is queued or in flight (prefetches landed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._inflight or self._closed, timeout)

    def free_slots(self) -> int:
        """Slots holding nothing and promised to no read: what a warm-up may fill without evicting."""
        with self._cond:
            return len(self._free)

    def resident(self) -> set[tuple[int, int]]:
        """(layer, expert) of every record present in RAM now."""
        with self._cond:
            return {divmod(int(k), self.num_experts) for k in self._slot_key[self._state == _READY]}

    def stats(self) -> dict:
        """Counters since the last `reset_stats`, with derived rates (see docs/EXPERT_MEMORY.md)."""
        with self._cond:
            s = dict(self._stats)
            if self._reading:  # the stretch in flight, so far: a difference of two snapshots is exact
                s["read_busy_s"] += time.perf_counter() - self._busy_since
            s["sources"] = {SOURCES[i]: dict(d) for i, d in enumerate(self._src)}
            resident = int(np.count_nonzero(self._state == _READY))
            s.update(
                n_slots=self.n_slots,
                budget_bytes=self.budget_bytes,
                stride=self.stride,
                resident=resident,
                resident_bytes=resident * self.stride,
                pinned=int(np.count_nonzero(self._pins)),
                direct=self.direct,
                policy=self.policy.name,
            )
        n = s["hits"] + s["misses"]
        s["hit_rate"] = s["hits"] / n if n else 0.0
        s["read_GBps"] = s["bytes_read"] / s["read_s"] / 1e9 if s["read_s"] else 0.0
        # the rate the reads were served at, all loaders together: bytes over the time any read was in flight
        s["served_GBps"] = s["bytes_read"] / s["read_busy_s"] / 1e9 if s["read_busy_s"] else 0.0
        pf = s["sources"]
        s["prefetch_issued"] = sum(d["issued"] for d in pf.values())
        s["prefetch_used"] = sum(d["used"] for d in pf.values())
        s["prefetch_wasted_bytes"] = sum(d["wasted_bytes"] for d in pf.values())
        return s

    def reset_stats(self) -> None:
        with self._cond:
            self._stats = dict(
                hits=0,
                misses=0,
                reads=0,
                bytes_read=0,
                read_s=0.0,
                read_busy_s=0.0,
                stall_s=0.0,
                evictions=0,
                transient_reads=0,
                read_errors=0,
            )
            self._src = [dict(issued=0, used=0, late=0, dropped=0, wasted_bytes=0) for _ in SOURCES]
            self._busy_since = time.perf_counter()  # a read in flight now counts from here

    def _commit(self) -> None:
        t0 = time.perf_counter()
        try:
            if self._slab.commit(self._commit_stop):
                self.commit_seconds = time.perf_counter() - t0
        finally:
            self._paged_in.set()

    def wait_committed(self, timeout: float | None = None) -> float | None:
        """Waits until the slab's pages are all faulted in (`ExpertSlab.commit`, started with the cache) -> the
        seconds that took, or None where the kernel could not (or the cache closed first)."""
        self._paged_in.wait(timeout)
        return self.commit_seconds

    def close(self) -> None:
        with self._cond:
            if self._closed and not self._threads:
                return
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()
        self._threads = []
        self._commit_stop.set()
        self._commit_thread.join()
        self._reader.close()
        self._slot_views.clear()
        self._slab.close()

    def __enter__(self) -> ExpertCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- requests (all `_..._locked`/helpers below run with the lock held unless noted) -------------------------

    def _key(self, layer: int, e: int) -> int:
        if not (0 <= layer < self.num_layers and 0 <= e < self.num_experts):
            raise ValueError(
                f"no expert (layer {layer}, id {e}): the bank has {self.num_layers} layer slots x "
                f"{self.num_experts} experts"
            )
        return layer * self.num_experts + e

    def _check_open(self) -> None:
        if self._closed:
            raise FastarError(
                f"expert cache of {self.fst.path} is closed"
                + (f" after a loader failure: {self._fatal!r}" if self._fatal else "")
            )

    def _enter_layer(self, layer: int) -> None:
        """A request for a new layer means the previous one ran: its unused prefetches lose their shield."""
        if layer == self._cur_layer:
            return
        prev, self._cur_layer = self._cur_layer, layer
        self._epoch += 1
        for load in [ld for ld in self._prefetch if ld.scan and ld.layer < layer] if self._prefetch else ():
            self._prefetch.remove(load)  # a scan prefetch whose layer has passed without asking for it
            del self._inflight[load.key]
            self._src[load.source]["dropped"] += 1
        held = self._shield.nonzero()[0]  # a few slots at decode (wrong guesses), often none (the method: np.any and
        # np.flatnonzero cost ~3x more from cold caches)
        if held.size:
            stale = (self._slot_key[held] // self.num_experts == prev) | (
                self._shield_epoch[held] < self._epoch - self.num_layers
            )
            self._shield[held[stale]] = False

    def _committed(self) -> int:
        """Slots spoken for by pins: pinned slots plus queued loads that will arrive pinned."""
        return int(np.count_nonzero(self._pins)) + sum(
            1 for ld in self._inflight.values() if ld.slot < 0 and ld.claims > 0
        )

    def _full_msg(self, layer: int, need: int) -> str:
        return (
            f"expert RAM budget of {self.budget_bytes / 1e6:.1f} MB ({self.n_slots} slots of {self.stride} B) "
            f"is full: {self._committed()} slots are pinned and layer {layer} needs {need} more; raise the "
            f"budget, release handles, or stream the layer with iter_ready()"
        )

    def _claim(self, k: int, layer: int, e: int, scan: bool = False) -> int | _Load:
        """Count the access and take one pin on key k: a slot when resident, else the load that will bring it."""
        s = self._key_slot.get(k)
        if s is not None and self._state[s] == _READY:
            self._stats["hits"] += 1
            self._pins[s] += 1
            self._shield[s] = False
            if self._unused[s] >= 0:
                self._src[self._unused[s]]["used"] += 1
                self._unused[s] = -1
            return s
        self._stats["misses"] += 1
        load = self._inflight.get(k)
        if load is None:
            load = _Load(k, layer, e, demand=True, scan=scan)
            self._inflight[k] = load
            self._demand.append(load)
            self._cond.notify_all()
        elif not load.demand:  # a prefetch caught in flight: promote it so it jumps the prefetch queue
            load.demand, load.scan = True, load.scan or scan
            if load.slot < 0:
                self._prefetch.remove(load)
                self._demand.append(load)
                self._cond.notify_all()  # a loader starved on it as a scan prefetch may take a slot for it now
            self._src[load.source]["used"] += 1
            self._src[load.source]["late"] += 1
        if load.slot >= 0:
            self._pins[load.slot] += 1
        else:
            load.claims += 1
        return load

    def _drop_claim(self, load: _Load) -> None:
        if load.done:
            if load.error is None:
                self._unpin_locked(load.slot)
        elif load.slot >= 0:
            self._pins[load.slot] -= 1
        else:
            load.claims -= 1

    def _acquire(self, layer: int, uniq: list[int]) -> list[ExpertHandle]:
        keys = [self._key(layer, e) for e in uniq]
        with self._cond:
            self._check_open()
            self._enter_layer(layer)
            need = self._pins_needed(keys)
            if self._committed() + need > self.n_slots:
                raise CacheFullError(self._full_msg(layer, need))
            claims = []
            for k, e in zip(keys, uniq):
                self.policy.access(k)
                claims.append(self._claim(k, layer, e))
            loads = [c for c in claims if isinstance(c, _Load)]
            try:
                self._wait(loads, every=True)
            except BaseException:
                for c in claims:
                    self._drop_claim(c) if isinstance(c, _Load) else self._unpin_locked(c)
                raise
            bad = next((ld for ld in loads if ld.error is not None), None)
            if bad is not None:
                for c in claims:
                    if not (isinstance(c, _Load) and c.error is not None):
                        self._unpin_locked(c.slot if isinstance(c, _Load) else c)
                raise type(bad.error)(str(bad.error))  # a fresh exception per requesting thread
            return [self._handle(layer, e, c.slot if isinstance(c, _Load) else c) for e, c in zip(uniq, claims)]

    def _pins_needed(self, keys: list[int]) -> int:
        """Slots a claim of `keys` would newly commit (under the lock): those whose record holds no pin yet, resident
        or being read; `_committed()` plus this must fit the slab for every one of them to be pinned at once."""
        pins, need = self._slot_elems[0], 0
        for k in keys:
            s, ld = self._key_slot.get(k), self._inflight.get(k)
            need += not ((s is not None and pins[s] > 0) or (ld is not None and ld.slot < 0 and ld.claims))
        return need

    def _views(self, slot: int) -> tuple[memoryview, ExpertWeights]:
        """The bytes of the record in `slot` and its weights' views, made once per slot (they view the same bytes
        whichever expert the slot holds)."""
        v = self._slot_views.get(slot)
        if v is None:
            buf = self._slab.view(slot).toreadonly()
            v = self._slot_views[slot] = (buf, self.fst.expert_views(buf))
        return v

    def _handle(self, layer: int, e: int, slot: int) -> ExpertHandle:
        self._tick += 1
        self._last_use[slot] = self._tick
        buf, views = self._views(slot)
        return ExpertHandle(layer, e, views, buf, self, slot)

    def _next_ready(self, layer, ready, outstanding, todo, keys) -> ExpertHandle | None:
        """A pinned handle for iter_ready: a resident expert, else a finished load; None when none is ready."""
        while ready:
            e = ready.popleft()
            r = self._claim(keys[e], layer, e) if keys[e] in self._key_slot else None
            if r is None:  # evicted meanwhile: request it again
                todo.append(e)
            elif isinstance(r, _Load):  # evicted and being read again by someone
                outstanding[e] = r
            else:
                return self._handle(layer, e, r)
        for e, load in list(outstanding.items()):
            if load.done:
                del outstanding[e]
                if load.error is not None:
                    raise type(load.error)(str(load.error))
                return self._handle(layer, e, load.slot)
        return None

    def _wait(self, loads, every: bool) -> None:
        """Wait (counted as stall) until all / any of `loads` finished; raises if the cache closes meanwhile."""
        t0 = time.perf_counter()
        while not (all if every else any)(ld.done for ld in loads):
            self._check_open()
            self._cond.wait()
        self._stats["stall_s"] += time.perf_counter() - t0

    def _unpin(self, slot: int) -> None:
        with self._cond:
            self._unpin_locked(slot)

    def _unpin_locked(self, slot: int) -> None:
        pins = self._slot_elems[0]  # `_pins` element by element (`resident_batch`)
        assert pins[slot] > 0, f"unbalanced release of expert slot {slot}"
        pins[slot] -= 1
        if pins[slot] == 0 and self._starved:  # a loader waits for a slot to become evictable
            self._starved = False
            self._cond.notify_all()

    def _transient(self, layer: int, e: int) -> ExpertHandle:
        """Budget fully pinned under `get`: read into a fresh buffer outside the slab (unlocked)."""
        buf = store.anonymous_buffer(self.stride)
        t0 = time.perf_counter()
        self._reader.read(layer, e, buf)
        self._verify_record(layer * self.num_experts + e, layer, e, buf)
        dt = time.perf_counter() - t0
        with self._cond:
            st = self._stats
            st.update(
                misses=st["misses"] + 1,
                transient_reads=st["transient_reads"] + 1,
                stall_s=st["stall_s"] + dt,
                bytes_read=st["bytes_read"] + self.stride,
            )
        ro = buf.toreadonly()
        return ExpertHandle(layer, e, self.fst.expert_views(ro), ro, None, -1)

    # --- loader threads ----------------------------------------------------------------------------------------

    def _alloc(self, demand: bool, scan: bool = False) -> int | None:
        """A slot for a new record: a free one, else among unpinned ready slots the policy's victim, or for a
        scan's read the one used most recently, of the layer being scanned when it has one (a scan's prefetch
        takes only those: the previous layers' records are needed again before this layer's)."""
        if self._free:
            return self._free.pop()
        evictable = (self._state == _READY) & (self._pins == 0)
        if scan:
            own = np.flatnonzero(evictable & ~self._shield & (self._slot_key // self.num_experts == self._cur_layer))
            if own.size or not demand:
                return self._evict(int(own[np.argmax(self._last_use[own])])) if own.size else None
        cand = np.flatnonzero(evictable & ~self._shield)
        if cand.size == 0:
            if not demand:  # never evict a shielded (prefetched / wanted) record for a guess
                return None
            cand = np.flatnonzero(evictable)
            if cand.size == 0:
                return None
        if scan:
            s = int(cand[np.argmax(self._last_use[cand])])
        else:
            s = int(cand[self.policy.victim(self._slot_key[cand])])
        return self._evict(s)

    def _evict(self, s: int) -> int:
        del self._key_slot[int(self._slot_key[s])]
        self._layer_ready[int(self._slot_key[s]) // self.num_experts] -= 1
        if self._unused[s] >= 0:
            self._src[self._unused[s]]["wasted_bytes"] += self.stride
            self._unused[s] = -1
        self._stats["evictions"] += 1
        return s

    def _take(self) -> _Load | None:
        """The next load with a slot allocated to it, or None when the loader must wait."""
        if self._demand:
            s = self._alloc(True, self._demand[0].scan)
            if s is None:  # wait for a load to finish or a pin to go; prefetches must not overtake
                self._starved = True
                return None
            load = self._demand.popleft()
        else:
            while self._prefetch:
                load = self._prefetch.popleft()
                s = self._alloc(False, load.scan)
                if s is not None:
                    break
                if load.scan:  # waits for the scanned layer to use a record (an unpin wakes the loaders)
                    self._prefetch.appendleft(load)
                    self._starved = True
                    return None
                del self._inflight[load.key]
                self._src[load.source]["dropped"] += 1
            else:
                return None
        self._slot_key[s], self._key_slot[load.key] = load.key, s
        self._state[s], self._pins[s], self._shield[s] = _LOADING, load.claims, False
        load.slot, load.claims = s, 0
        return load

    def _worker(self) -> None:
        try:
            while True:
                with self._cond:
                    load = None
                    while not self._closed:
                        load = self._take()
                        if load is not None:
                            break
                        self._cond.wait()
                    if load is None:
                        return
                    if self._reading == 0:  # the loaders' busy time (`read_busy_s`) starts
                        self._busy_since = time.perf_counter()
                    self._reading += 1
                t0 = time.perf_counter()
                err: BaseException | None = None
                try:  # lock released: this is the part that overlaps compute
                    self._reader.read(load.layer, load.expert, self._slab.view(load.slot))
                    self._verify_record(load.key, load.layer, load.expert, self._slab.view(load.slot))
                except Exception as ex:
                    err = (
                        ex
                        if isinstance(ex, FastarError)
                        else FormatError(
                            f"{self.fst.path}: reading expert (layer {load.layer}, id {load.expert}) failed: {ex!r}"
                        )
                    )
                with self._cond:
                    self._finish(load, err, time.perf_counter() - t0)
        except BaseException as ex:  # a bug here must not leave waiters hanging
            with self._cond:
                self._fatal, self._closed = ex, True
                self._cond.notify_all()
            raise

    def _verify_record(self, key: int, layer: int, e: int, data) -> None:
        """The record's xxh64 on its first read (when verifying); later reads of it are trusted."""
        if self._digests is None or self._verified[key]:
            return
        if xxhash.xxh64_hexdigest(data) != self._digests[key]:
            raise FormatError(
                f"{self.fst.path}: expert (layer {layer}, id {e}) fails its checksum "
                f"(file corrupt or changed under the engine; load(verify=False), or --no-verify, skips this check)"
            )
        self._verified[key] = True

    def _finish(self, load: _Load, err: BaseException | None, dt: float) -> None:
        s = load.slot
        del self._inflight[load.key]
        self._reading -= 1
        if self._reading == 0:  # no read in flight: the busy stretch ends
            self._stats["read_busy_s"] += time.perf_counter() - self._busy_since
        load.done, load.error = True, err
        if err is not None:  # the slot goes back empty: a failed read is never served
            del self._key_slot[load.key]
            self._slot_key[s], self._state[s], self._pins[s] = -1, _FREE, 0
            self._free.append(s)
            self._stats["read_errors"] += 1
        else:
            self._state[s] = _READY
            self._layer_ready[load.layer] += 1
            st = self._stats
            st["reads"] += 1
            st["bytes_read"] += self.stride
            st["read_s"] += dt
            if not load.demand and load.source >= 0:
                self._unused[s] = load.source
                self._shield[s], self._shield_epoch[s] = True, self._epoch
        self._cond.notify_all()
