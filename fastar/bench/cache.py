"""The expert cache measured: a policy simulator, the plain-mmap baseline, disk probes and trace replays.

Owns:
- `simulate`: replays a routing trace against a policy without I/O, by the cache's own rules.
- `MmapExperts`: the plain-mmap baseline provider (page cache only, no budget).
- `drop_page_cache`, `measure_disk`: the disk's read bandwidth, measured now (cold page cache).
- `bench_cache`: the cache against the disk in the same run, over a routing trace.
Does not own: the cache itself (`fastar.weights.expert_cache`, `fastar.weights.expert_store`). Design and
measurements: docs/EXPERT_MEMORY.md.
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..contracts import ExpertWeights
from ..format.reader import FstFile
from ..weights.expert_cache import ExpertCache
from ..weights.expert_store import DEFAULT_POLICY, POLICIES, GiB, anonymous_buffer, lrfu_params, make_policy


def drop_page_cache(path: str | os.PathLike) -> None:
    """Ask the kernel to forget the file's clean cached pages (no root needed), for honest cold-read timing."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def simulate(
    trace: np.ndarray,
    experts: int,
    n_slots: int,
    policy: str = DEFAULT_POLICY,
    half_life: float | None = None,
    prefetch: np.ndarray | None = None,
    window: int = 0,
) -> dict:
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
    return {
        "policy": policy,
        "n_slots": n_slots,
        "hits": hits,
        "misses": misses,
        "evictions": evictions,
        "hit_rate": hits / n if n else 0.0,
        "prefetch_loads": pf_loads,
        "prefetch_used": pf_used,
    }


class MmapExperts:
    """Baseline provider: zero-copy views of the file's mapping, paged by the kernel (no budget, no control).

    `prefetch` is `madvise(WILLNEED)`. A file truncated under it kills the process with SIGBUS on access, which
    is one reason the cache reads with pread instead.
    """

    pages = True

    def __init__(self, fst: FstFile) -> None:
        self.fst = fst

    def stats(self) -> dict:
        return {}  # the kernel pages: nothing is counted here

    def get(self, layer: int, e: int) -> ExpertWeights:
        return self.fst.expert(layer, e)

    def prefetch(self, layer: int, ids, source: str = "manual", *, scan: bool = False) -> int:
        mm, stride = self.fst._mm, self.fst.expert_stride
        n = 0
        for e in ids:
            mm.madvise(mmap.MADV_WILLNEED, self.fst.expert_offset(layer, int(e)), stride)
            n += 1
        return n

    def prefetch_tokens(self, token_ids, tid2eid) -> int:
        tok = np.asarray(list(token_ids), np.int64)
        return sum(self.prefetch(layer, np.unique(np.asarray(t)[tok]), "hash") for layer, t in tid2eid.items())

    def each_batch(self, layer: int, ids: list[int], *, scan: bool = False):
        yield [(e, self.get(layer, e)) for e in ids]


def measure_disk(fst: FstFile, records: int = 48, seed: int = 0) -> dict:
    """Read bandwidth for whole expert records, measured now, three ways on `records` random records each:
    O_DIRECT `pread` (the disk itself), buffered `pread` with the file's page cache dropped first (disk plus
    readahead plus a copy), and first touch of every page through the mapping (page faults and readahead);
    plus buffered re-reads of one record (a page-cache hit: the copy cost)."""
    b = fst.bank
    stride = fst.expert_stride
    n_rec = b["slots"] * b["experts"]
    picks = [
        divmod(int(i), b["experts"])
        for i in np.random.default_rng(seed).choice(n_rec, min(4 * records, n_rec), replace=False)
    ]
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
        timed("mmap_cold", sets[2], lambda s, e: _touch(memoryview(mm)[fst.expert_offset(s, e) :][:stride]))
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


def _replay(
    cache: ExpertCache | MmapExperts,
    trace: np.ndarray,
    prefetch: np.ndarray | None,
    hash_layers: int,
    touch: bool,
    dense_s: float,
    cold: str | os.PathLike | None,
) -> float:
    """The decode loop's shape. Per token: the hash layers' experts are prefetched exactly at its start; before
    each layer's dense part runs (`dense_s` of sleep: attention etc., in kernels that release the GIL) the next
    layer's predicted experts are prefetched (lookahead); then the layer streams its experts, each touched once
    as a kernel would. `cold`: drop the file's page cache every token (a model much larger than RAM); returns
    the seconds spent dropping, which are the emulation's and not the cache's."""
    T, L, _ = trace.shape
    streaming = isinstance(cache, ExpertCache)  # handles as records land; the mapping: one expert at a time
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
    if streaming:
        cache.release_all()
    return overhead


def bench_cache(
    fst_path: str | os.PathLike,
    budgets: list[int],
    trace: np.ndarray,
    *,
    policies: tuple[str, ...] = POLICIES,
    modes: tuple[str, ...] = ("direct", "pread", "mmap"),
    prefetch: np.ndarray | None = None,
    hash_layers: int = 3,
    warmup_tokens: int = 0,
    timed_tokens: int | None = None,
    dense_s: float = 0.0,
    cold: bool = False,
    io_threads: int = 2,
    touch: bool = True,
    disk_records: int = 48,
    log=None,
) -> dict:
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

    say = log or (lambda *_: None)
    fst = FstFile(fst_path)
    experts = fst.bank["experts"]
    res: dict = {
        "file": str(fst_path),
        "stride": fst.expert_stride,
        "trace_shape": list(trace.shape),
        "dense_s": dense_s,
        "cold": cold,
    }
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
        run = {
            "mode": mode,
            "policy": pol,
            "budget_bytes": budget,
            "prefetch": pf is not None,
            "tokens": end - warmup_tokens,
            "wall_s": wall,
            "tokens_per_s": (end - warmup_tokens) / wall,
            "rss_bytes": proc.memory_info().rss,
            "rss_growth_bytes": proc.memory_info().rss - rss0,
            "pagecache_growth_bytes": (_cached_kb() - cached0) * 1024,
            **st,
        }
        cache.fst.close() if mode == "mmap" else cache.close()
        if "bytes_read" in st:
            run["stall_fraction"] = st["stall_s"] / wall
            run["effective_GBps"] = st["bytes_read"] / wall / 1e9
            if "direct_GBps" in disk:
                run["vs_disk"] = run["effective_GBps"] / max(disk["direct_GBps"], disk["direct_2threads_GBps"])
        runs.append(run)
        say(
            f"run {mode} {pol} {None if budget is None else round(budget / GiB, 2)} GiB prefetch={pf is not None}: "
            + ", ".join(
                f"{k}={run[k]:.3g}"
                for k in (
                    "wall_s",
                    "tokens_per_s",
                    "hit_rate",
                    "stall_fraction",
                    "effective_GBps",
                    "vs_disk",
                    "prefetch_used",
                    "prefetch_wasted_bytes",
                    "major_faults",
                    "pagecache_growth_bytes",
                )
                if k in run
            )
        )
    res["runs"] = runs
    res["disk_end"] = measure_disk(fst, disk_records, seed=1)  # the disk drifts: bracket the runs
    say(f"disk at the end: {res['disk_end']}")
    fst.close()
    return res
