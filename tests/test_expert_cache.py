"""Expert cache: eviction order, pinning, budget, read-once, byte equality, prefetch accounting, errors under
a file truncated while the cache runs, and the device tier (GPU only). CPU, small synthetic files."""

from __future__ import annotations

import collections
import os
import re
import shutil
import threading
import time

import numpy as np
import psutil
import pytest
from synth_widths import SMALL

from fastar.bench.cache import simulate
from fastar.config import parse_size
from fastar.errors import FastarError, FormatError
from fastar.format.reader import FstFile
from fastar.synth import routing_trace, synth
from fastar.weights.expert_cache import CacheFullError, ExpertCache
from fastar.weights.expert_store import POLICIES, LRFUPolicy, LRUPolicy

TIMEOUT = 20.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """4 layers + MTP, 8 experts of 16 KiB (hidden 128, inter 64)."""
    return synth(
        tmp_path_factory.mktemp("fst") / "tiny.fst", layers=4, experts=8, vocab=512, hidden=128, inter=64, **SMALL
    )


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    """2 layers + MTP, 64 experts of ~0.8 MB (hidden 1024, inter 512): big enough for RSS measurements."""
    return synth(
        tmp_path_factory.mktemp("fst") / "medium.fst", layers=2, experts=64, vocab=512, hidden=1024, inter=512, **SMALL
    )


@pytest.fixture
def fst(tiny):
    f = FstFile(tiny)
    yield f
    f.close()


def same(weights, ref) -> bool:
    return all(np.array_equal(a, b) for a, b in zip(weights, ref))


def run_with_timeout(fn, timeout: float = TIMEOUT):
    """Run fn in a thread; return (result, exception); fail the test on a hang."""
    out: dict = {}

    def target():
        try:
            out["r"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["e"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"hung for {timeout} s"
    return out.get("r"), out.get("e")


def slow_reads(cache: ExpertCache, delay: float) -> collections.Counter:
    """Make every read of `cache` take `delay` seconds longer; count reads per (layer, expert)."""
    counts: collections.Counter = collections.Counter()
    real = cache._reader.read

    def read(layer, e, buf):
        counts[(layer, e)] += 1
        time.sleep(delay)
        real(layer, e, buf)

    cache._reader.read = read
    return counts


# --- eviction and pinning ----------------------------------------------------------------------------------


def test_lru_exact_eviction_order(fst):
    rng = np.random.default_rng(0)
    n = 5
    with ExpertCache(fst, n * fst.expert_stride, io_threads=1, policy="lru") as c:
        model: collections.OrderedDict = collections.OrderedDict()
        for _ in range(300):
            key = (int(rng.integers(0, 5)), int(rng.integers(0, 8)))
            with c.acquire(*key[:1], [key[1]]):
                pass
            if key in model:
                model.move_to_end(key)
            else:
                if len(model) == n:
                    model.popitem(last=False)
                model[key] = True
            assert c.resident() == set(model), "resident set differs from an exact LRU"


def test_lru_policy_order_explicit():
    p = LRUPolicy(10)
    for k in (3, 1, 4, 1, 5):
        p.access(k)
    keys = np.array([3, 1, 4, 5])
    assert keys[p.victim(keys)] == 3
    p.access(3)
    assert keys[p.victim(keys)] == 4


def test_lrfu_keeps_the_popular_outside_the_window():
    p = LRFUPolicy(10, half_life=100.0, window=2)
    for k in (1, 1, 1, 2, 3, 4):  # 1 popular, then one-offs; 3 and 4 are inside the window
        p.access(k)
    keys = np.array([1, 2, 3, 4])
    assert keys[p.victim(keys)] == 2  # outside the window, lowest score
    recent = np.array([4, 3])
    assert recent[p.victim(recent)] == 3  # all inside the window: least recent
    q = LRFUPolicy(10, half_life=1e-3)  # a tiny half-life is LRU
    for k in (1, 1, 1, 2):
        q.access(k)
    assert q.victim(np.array([1, 2])) == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_simulator_matches_cache(fst, policy):
    trace = routing_trace(40, 5, 8, 3, hash_layers=2, zipf=0.9, locality=0.3, vocab=512, seed=1)
    n = 9
    with ExpertCache(fst, n * fst.expert_stride, io_threads=1, policy=policy) as c:
        for t in range(trace.shape[0]):
            for layer in range(trace.shape[1]):
                c.acquire(layer, trace[t, layer]).release()
        st = c.stats()
    sim = simulate(trace, 8, n, policy, half_life=c.policy_half_life, window=c.policy_window)
    assert (st["hits"], st["misses"], st["evictions"]) == (sim["hits"], sim["misses"], sim["evictions"])


def test_pinned_experts_are_never_evicted(fst):
    with ExpertCache(fst, 3 * fst.expert_stride, io_threads=1, policy="lru") as c:
        with c.acquire(0, [1, 2]) as pinned:
            for e in range(8):  # every other expert goes through the one free slot
                assert same(c.get(1, e), fst.expert(1, e))
            assert {(0, 1), (0, 2)} <= c.resident()
            assert same(pinned[0].weights, fst.expert(0, 1)) and same(pinned[1].weights, fst.expert(0, 2))
            with pytest.raises(CacheFullError, match=r"budget of .* MB \(3 slots"):
                c.acquire(2, [0, 1])
        c.acquire(2, [0, 1, 3]).release()  # released: all three slots usable again
        assert c.stats()["pinned"] == 0


def test_get_overflows_to_transient_buffer(fst):
    with ExpertCache(fst, 2 * fst.expert_stride, io_threads=1) as c:
        ws = [c.get(3, e) for e in range(8)]  # a whole layer held at once with room for 2
        assert all(same(w, fst.expert(3, e)) for e, w in enumerate(ws))
        st = c.stats()
        assert st["transient_reads"] == 6 and st["resident_bytes"] <= c.budget_bytes
        c.get(4, 0)  # another layer: the implicit pins of layer 3 go
        assert c.stats()["pinned"] == 1


def test_iter_ready_streams_through_one_slot(fst):
    with ExpertCache(fst, 1 * fst.expert_stride, io_threads=2) as c:
        got = []
        for h in c.iter_ready(2, [7, 3, 3, 5, 0, 1]):
            assert same(h.weights, fst.expert(2, h.expert))
            got.append(h.expert)
        assert sorted(got) == [0, 1, 3, 5, 7] and c.stats()["pinned"] == 0


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_iter_ready_with_prefetch_in_flight_yields_each_once(fst, slots):
    for rep in range(5):
        with ExpertCache(fst, slots * fst.expert_stride, io_threads=2) as c:
            slow_reads(c, 0.002 * rep)
            c.prefetch(1, range(8))
            got = [h.expert for h in c.iter_ready(1, range(8))]
            assert sorted(got) == list(range(8)), got
            assert c.wait_idle(TIMEOUT) and c.stats()["pinned"] == 0


def test_iter_ready_expert_arriving_meanwhile_is_yielded_once(fst):
    with ExpertCache(fst, 3 * fst.expert_stride, io_threads=1) as c:
        other = c.acquire(0, [7])  # one slot pinned elsewhere: iter_ready may claim two at a time
        got = []
        for h in c.iter_ready(2, [1, 2, 3]):
            got.append(h.expert)
            if len(got) == 1:  # while expert 3 waits its turn, someone else brings it in
                other.release()
                c.prefetch(2, [3])
                assert c.wait_idle(TIMEOUT)
        assert sorted(got) == [1, 2, 3], got


def test_iter_ready_closed_early_releases_everything(fst):
    with ExpertCache(fst, 3 * fst.expert_stride) as c:
        slow_reads(c, 0.05)
        it = c.iter_ready(1, range(8))
        first = next(it)
        assert same(first.weights, fst.expert(1, first.expert))
        it.close()  # abandoned mid-layer: the yielded pin and the outstanding claims go
        assert c.wait_idle(TIMEOUT) and c.stats()["pinned"] == 0
        c.acquire(2, [0, 1, 2]).release()  # the whole budget is usable again


@pytest.mark.parametrize("slots", [2, 5, 12])
def test_iter_ready_batches(fst, slots):
    """batch=True: what is resident comes in one list (pinned together), the rest in lists as it lands; every
    expert once, correct bytes, nothing left pinned; an abandoned iteration releases its batch."""
    with ExpertCache(fst, slots * fst.expert_stride, io_threads=2) as c:
        c.acquire(3, [0, 1]).release()  # resident now
        slow_reads(c, 0.002)
        batches = []
        for hs in c.iter_ready(3, [1, 0, 4, 5, 6, 1], batch=True):
            assert all(h._live and same(h.weights, fst.expert(3, h.expert)) for h in hs)
            assert c.stats()["pinned"] >= len(hs)  # and the claims of reads in flight
            batches.append([h.expert for h in hs])
        assert sorted(batches[0][:2]) == [0, 1] and sorted(e for b in batches for e in b) == [0, 1, 4, 5, 6]
        assert c.wait_idle(TIMEOUT) and c.stats()["pinned"] == 0
        c.acquire(3, [4, 5]).release()
        it = c.iter_ready(3, [4, 5], batch=True)
        assert sorted(h.expert for h in next(it)) == [4, 5]  # all resident: one batch
        it.close()
        assert c.stats()["pinned"] == 0
        got = [[e for e, _ in b] for b in c.each_batch(3, [5, 4])]
        assert got == [[5, 4]] and c.stats()["pinned"] == 0


def test_thread_exit_releases_implicit_pins(fst):
    with ExpertCache(fst, 3 * fst.expert_stride) as c:
        t = threading.Thread(target=lambda: c.get(1, 1))
        t.start()
        t.join(TIMEOUT)
        assert c.stats()["pinned"] == 0
        c.get(2, 2)
        assert c.stats()["pinned"] == 1  # this thread's implicit pin, until it turns to another layer
        c.release_all()
        assert c.stats()["pinned"] == 0


def test_iter_ready_yields_resident_first(fst):
    with ExpertCache(fst, 8 * fst.expert_stride) as c:
        c.acquire(1, [4, 6]).release()
        slow_reads(c, 0.05)
        order = [h.expert for h in c.iter_ready(1, [0, 4, 2, 6])]
        assert set(order[:2]) == {4, 6} and sorted(order) == [0, 2, 4, 6]


def test_budget_never_exceeded(fst):
    trace = routing_trace(60, 5, 8, 3, hash_layers=2, vocab=512, seed=3)
    for policy in POLICIES:
        with ExpertCache(fst, 4 * fst.expert_stride, policy=policy) as c:
            for t in range(trace.shape[0]):
                for layer in range(5):
                    c.prefetch((layer + 1) % 5, trace[t, (layer + 1) % 5])
                    for h in c.iter_ready(layer, trace[t, layer]):
                        assert c.stats()["resident_bytes"] <= c.budget_bytes
            assert c.stats()["resident"] <= 4


@pytest.mark.parametrize("direct", [False, True])
def test_rss_growth_bounded(medium, direct):
    budget = 24 << 20
    proc = psutil.Process()
    with FstFile(medium) as f, ExpertCache(f, budget, direct=direct) as c:
        rss0 = proc.memory_info().rss
        rng = np.random.default_rng(0)
        for _ in range(150):  # ~5x the budget in distinct experts
            layer = int(rng.integers(0, 3))
            for h in c.iter_ready(layer, rng.choice(64, 6, replace=False)):
                h.weights.w1.sum()
        growth = proc.memory_info().rss - rss0
        assert c.stats()["bytes_read"] > 4 * budget
    assert growth < budget + (16 << 20), f"RSS grew {growth / 1e6:.1f} MB for a {budget / 1e6:.0f} MB budget"


# --- concurrency -------------------------------------------------------------------------------------------


def test_concurrent_requests_read_once(fst):
    with ExpertCache(fst, 4 * fst.expert_stride, io_threads=2) as c:
        counts = slow_reads(c, 0.2)
        barrier = threading.Barrier(8)
        results = [None] * 8

        def worker(i):
            barrier.wait()
            results[i] = [a.copy() for a in c.get(2, 5)]

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert counts[(2, 5)] == 1 and c.stats()["reads"] == 1
        assert all(same(r, fst.expert(2, 5)) for r in results)


def test_prefetch_in_flight_joined_by_get(fst):
    with ExpertCache(fst, 4 * fst.expert_stride) as c:
        counts = slow_reads(c, 0.2)
        assert c.prefetch(1, [3]) == 1
        time.sleep(0.05)
        assert same(c.get(1, 3), fst.expert(1, 3))
        st = c.stats()
        assert counts[(1, 3)] == 1 and st["sources"]["manual"]["late"] == 1 and st["prefetch_used"] == 1


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("direct", [False, True])
def test_bytes_equal_file(fst, policy, direct):
    rng = np.random.default_rng(7)
    with ExpertCache(fst, 5 * fst.expert_stride, direct=direct, policy=policy) as c:
        for step in range(40):
            layer = int(rng.integers(0, 5))
            ids = rng.choice(8, 3, replace=False)
            if step % 3 == 0:
                with c.acquire(layer, ids) as hs:
                    assert all(same(h.weights, fst.expert(layer, int(e))) for h, e in zip(hs, ids))
            elif step % 3 == 1:
                for h in c.iter_ready(layer, ids):
                    assert same(h.weights, fst.expert(layer, h.expert))
            else:
                c.prefetch(layer, ids)
                assert all(same(c.get(layer, int(e)), fst.expert(layer, int(e))) for e in ids)


def test_loader_stress_many_threads_jittered_reads(fst):
    """The loader under stress: 4 threads make random requests (iter_ready in batches and one by one, acquire, get,
    prefetch) on a 6-slot cache whose reads take random times and land in any order, with hash-style prefetches
    racing them; every handle's bytes, checked while pinned, are the file's record for that expert, nothing hangs,
    and no pin is left when the threads are done."""
    rng0 = np.random.default_rng(11)
    delays = iter(rng0.uniform(0, 0.004, 100000).tolist())
    errors: list = []
    full = [0]
    with ExpertCache(fst, 6 * fst.expert_stride, io_threads=2) as c:
        read = c._reader.read

        def jittered(layer, e, buf):
            time.sleep(next(delays))
            read(layer, e, buf)

        c._reader.read = jittered

        def worker(seed):
            rng = np.random.default_rng(seed)
            try:
                for step in range(60):
                    layer = int(rng.integers(0, 5))
                    ids = rng.choice(8, int(rng.integers(1, 4)), replace=False).tolist()
                    kind = step % 4
                    try:
                        if kind == 0:
                            for hs in c.iter_ready(layer, ids, batch=True):
                                assert all(same(h.weights, fst.expert(layer, h.expert)) for h in hs)
                        elif kind == 1:
                            for h in c.iter_ready(layer, ids):
                                assert same(h.weights, fst.expert(layer, h.expert))
                        elif kind == 2:
                            with c.acquire(layer, ids) as hs:
                                assert all(same(h.weights, fst.expert(layer, e)) for h, e in zip(hs, ids))
                        else:
                            c.prefetch((layer + 1) % 5, rng.choice(8, 3, replace=False), source="hash")
                            assert all(same(c.get(layer, e), fst.expert(layer, e)) for e in ids)
                    except CacheFullError:
                        full[0] += 1  # the other threads pin every slot: the documented answer, not a failure
                c.release_all()
            except BaseException as ex:  # noqa: BLE001 - reported by the test thread
                errors.append(ex)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a request hung"
        assert not errors, repr(errors[0])
        assert c.wait_idle(TIMEOUT)
        st = c.stats()
        assert st["pinned"] == 0 and st["reads"] > 100 and full[0] < 60, (st, full)


def test_outputs_do_not_depend_on_budget(fst):
    """A reference FP4 expert computation over a trace gives identical results with room for 2 or for all."""
    from fastar.quant.reference import fp4_decode

    trace = routing_trace(6, 5, 8, 3, hash_layers=2, vocab=512, seed=5)
    x = np.random.default_rng(0).standard_normal((4, 128)).astype(np.float32)

    def run(budget_slots):
        out = []
        with ExpertCache(fst, budget_slots * fst.expert_stride) as c:
            for t in range(trace.shape[0]):
                for layer in range(5):
                    c.prefetch(layer, trace[t, (layer + 1) % 5])
                    for e in np.unique(trace[t, layer]):
                        w = c.get(layer, int(e))
                        h = (x @ fp4_decode(w.w1, w.w1_scale).T) * (x @ fp4_decode(w.w3, w.w3_scale).T)
                        out.append(h @ fp4_decode(w.w2, w.w2_scale).T)
        return np.stack(out)

    small, full = run(2), run(40)
    assert np.isfinite(full).all() and np.array_equal(small, full)


def test_model_logits_do_not_depend_on_budget(tiny):
    torch = pytest.importorskip("torch")
    model_mod = pytest.importorskip("fastar.model.deepseek_v4")
    with FstFile(tiny) as f:
        logits = []
        for slots in (2, 40):
            with ExpertCache(f, slots * f.expert_stride) as c:
                m = model_mod.DeepseekV4(f, experts=c)
                logits.append(m.forward(list(range(1, 20)), m.new_state())[0])
        assert torch.isfinite(logits[0]).all() and torch.equal(logits[0], logits[1])


# --- prefetch accounting -----------------------------------------------------------------------------------


def test_prefetch_used_and_wasted(fst):
    stride = fst.expert_stride
    with ExpertCache(fst, 4 * stride, io_threads=1, policy="lru") as c:
        assert c.prefetch(3, [0, 1, 2], source="lookahead") == 3
        assert c.wait_idle(TIMEOUT)
        c.acquire(3, [0, 1]).release()  # 2 used, 1 (expert 2) mispredicted
        for e in range(4, 8):  # next layers push the unused one out
            c.acquire(4, [e]).release()
        st = c.stats()
        la = st["sources"]["lookahead"]
        assert la["issued"] == 3 and la["used"] == 2 and la["wasted_bytes"] == stride
        assert st["prefetch_wasted_bytes"] == stride and st["hits"] >= 2


def test_hash_prefetch_is_exact(fst):
    tables = {layer: fst.tensor(f"layers.{layer}.ffn.gate.tid2eid") for layer in range(3)}
    tokens = [5, 17, 300]
    with ExpertCache(fst, 40 * fst.expert_stride) as c:
        issued = c.prefetch_tokens(tokens, tables)
        for layer, tab in tables.items():
            c.acquire(layer, np.unique(tab[tokens])).release()
        st = c.stats()
        h = st["sources"]["hash"]
        assert issued == h["issued"] == h["used"] and h["wasted_bytes"] == 0 and st["misses"] == h["late"]


def test_stats_and_reset(fst):
    with ExpertCache(fst, 4 * fst.expert_stride) as c:
        t0 = time.perf_counter()
        c.acquire(0, [1, 2]).release()
        c.acquire(0, [1]).release()
        wall = time.perf_counter() - t0
        st = c.stats()
        assert (st["hits"], st["misses"], st["reads"]) == (1, 2, 2)
        assert st["bytes_read"] == 2 * fst.expert_stride and st["hit_rate"] == pytest.approx(1 / 3)
        # the time any read was in flight (the loaders together): within the wall time, unlike read_s's sum
        assert 0 < st["read_busy_s"] <= wall
        assert st["served_GBps"] == pytest.approx(st["bytes_read"] / st["read_busy_s"] / 1e9)
        c.reset_stats()
        assert c.stats()["hits"] == 0 and c.stats()["resident"] == 2 and c.stats()["read_busy_s"] == 0


def test_default_budget_from_available_memory(fst):
    with ExpertCache(fst) as c:
        assert c.n_slots >= min(fst.config.num_experts_per_tok + 2, 40)
        assert c.budget_bytes <= psutil.virtual_memory().available


def test_bench_cache_smoke(tiny):
    from fastar.bench.cache import bench_cache
    from fastar.synth import lookahead_trace

    trace = routing_trace(12, 5, 8, 3, hash_layers=3, vocab=512, seed=2)
    stride = FstFile(tiny).expert_stride
    r = bench_cache(
        tiny,
        [6 * stride],
        trace,
        prefetch=lookahead_trace(trace, 8, hash_layers=3),
        warmup_tokens=4,
        timed_tokens=8,
        disk_records=2,
    )
    assert r["disk"]["pagecache_GBps"] > 0 and len(r["simulated"]) == 4
    modes = {(x["mode"], x["policy"], x["prefetch"]) for x in r["runs"]}
    assert ("mmap", None, False) in modes and ("direct", "lrfu", True) in modes and ("pread", "lru", False) in modes
    for x in r["runs"]:
        if x["mode"] != "mmap":
            assert x["hits"] + x["misses"] > 0 and x["budget_bytes"] == 6 * stride and x["read_errors"] == 0


# --- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [False, True])
def test_truncated_file_under_running_cache(tiny, tmp_path, direct):
    path = tmp_path / "t.fst"
    shutil.copyfile(tiny, path)
    f = FstFile(path)
    c = ExpertCache(f, 6 * f.expert_stride, direct=direct)
    try:
        ok = [a.copy() for a in c.get(0, 1)]
        cut = f.expert_offset(3, 0) + 100  # layer 3 onwards are gone
        os.truncate(path, cut)
        # resident data keeps being served, and is still right
        _, err = run_with_timeout(lambda: [a.copy() for a in c.get(0, 1)])
        assert err is None and same(ok, f.expert(0, 1))
        # demand read, prefetch + get from another thread, iter_ready: each a clear error naming the expert
        _, err = run_with_timeout(lambda: c.acquire(3, [2]))
        assert isinstance(err, FormatError) and "(layer 3, id 2)" in str(err)
        c.prefetch(4, [6])
        _, err = run_with_timeout(lambda: c.get(4, 6))
        assert isinstance(err, FormatError) and "(layer 4, id 6)" in str(err)
        _, err = run_with_timeout(lambda: [h.expert for h in c.iter_ready(3, [5])])
        assert isinstance(err, FormatError) and "(layer 3, id 5)" in str(err)
        c.release_all()  # the helper threads' implicit pins went with them
        assert c.stats()["read_errors"] >= 3 and (3, 2) not in c.resident() and c.stats()["pinned"] == 0
        # the cache still serves what the file still has
        r, err = run_with_timeout(lambda: [a.copy() for a in c.get(1, 4)])
        assert err is None and same(r, f.expert(1, 4))
    finally:
        c.close()
        f.close()


def test_corrupt_record_detected_with_verify(tiny, tmp_path):
    path = tmp_path / "c.fst"
    shutil.copyfile(tiny, path)
    with FstFile(path) as f:
        off = f.expert_offset(2, 3)
    with open(path, "r+b") as fh:
        fh.seek(off + 10)
        fh.write(b"\xaa\x55")
    with FstFile(path) as f, ExpertCache(f, 4 * f.expert_stride, verify=True) as c:
        _, err = run_with_timeout(lambda: c.get(2, 3))
        assert isinstance(err, FormatError) and "(layer 2, id 3)" in str(err) and "checksum" in str(err)
        assert same(c.get(2, 4), f.expert(2, 4))


def test_close_wakes_waiters(fst):
    c = ExpertCache(fst, 4 * fst.expert_stride)
    slow_reads(c, 0.5)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", run_with_timeout(lambda: c.get(1, 1))))
    t.start()
    time.sleep(0.1)
    c.close()
    t.join(TIMEOUT)
    _, err = box["r"]
    assert err is None or isinstance(err, FastarError)


def test_bad_arguments(fst):
    with pytest.raises(ValueError, match="smaller than one expert") as err:
        ExpertCache(fst, 100)
    # the size it suggests is one a user can type, and enough
    suggested = re.search(r"give at least ram_budget='(\d+M)' \(\d+ bytes\)", str(err.value))
    assert suggested, err.value
    with ExpertCache(fst, parse_size(suggested[1])) as c:
        assert c.n_slots >= 1
    with pytest.raises(ValueError, match="unknown expert cache policy"):
        ExpertCache(fst, 4 * fst.expert_stride, policy="fifo")
    with ExpertCache(fst, 4 * fst.expert_stride) as c, pytest.raises(ValueError, match=r"no expert \(layer 9, id 0\)"):
        c.get(9, 0)


# --- device tier -------------------------------------------------------------------------------------------


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
def test_device_tier_bytes_and_eviction(fst):
    import torch

    from fastar.weights.device_cache import DeviceExpertCache, slot_bytes

    with ExpertCache(fst, 6 * fst.expert_stride) as ram:
        dev = DeviceExpertCache(ram, fst.config, 3 * slot_bytes(fst.config), "cuda")
        for layer in range(5):
            for e in (0, 3, 5):
                w = dev.get(layer, e)
                assert all(t.is_cuda for t in w)
                assert all(np.array_equal(t.cpu().numpy(), r) for t, r in zip(w, fst.expert(layer, e)))
        torch.cuda.synchronize()
        st = dev.stats()
        assert st["misses"] == 15 and st["n_slots"] == 3
        with pytest.raises(CacheFullError):
            for e in range(4):
                dev.get(0, e)


@pytest.mark.parametrize("policy", POLICIES)
def test_scan_keeps_what_the_loop_needs_next(fst, policy):
    """A prefill pass asks for every expert of every layer in turn, pass after pass (a loop over 5 x 8 = 40
    records through 16 slots). The policies evict what the loop needs soonest and read all 40 per pass; a scan
    takes the slot used last, so the other records stay resident and a pass reads far fewer."""
    reads = {}
    for scan in (False, True):
        with ExpertCache(fst, 16 * fst.expert_stride, policy=policy, io_threads=1) as c:
            for _ in range(3):
                c.reset_stats()
                for layer in range(5):
                    got = [e for b in c.each_batch(layer, range(8), scan=scan) for e, _ in b]
                    assert sorted(got) == list(range(8))
            reads[scan] = c.stats()["reads"]  # the third pass
    # no cache does better than 40 - 16 = 24 reads a pass (16 records can be kept); a scan gets that (24 in repeated
    # runs), with a little room for the loader thread's timing
    assert reads[False] == 40 and reads[True] <= 26, reads


def _kernel_populates() -> bool:
    """Whether this Linux has madvise(MADV_POPULATE_WRITE) (5.14 and later), which `ExpertSlab.commit` uses."""
    import platform

    major, minor = (int(v) for v in platform.release().split(".")[:2])
    return (major, minor) >= (5, 14)


def test_slab_commit_faults_pages_in_without_changing_them():
    """`ExpertSlab.commit` (run by every cache on its own thread from the start) makes the slab resident without
    writing to it, so a reader filling a slot meanwhile loses nothing; a set `stop` ends it early."""
    import threading

    import psutil

    from fastar.weights.expert_store import ExpertSlab

    slab = ExpertSlab(16, 4 << 20)
    slot = np.frombuffer(slab.view(3), np.uint8)
    slot[:] = np.arange(slot.size, dtype=np.uint64).astype(np.uint8)  # a slot already filled
    proc = psutil.Process()
    before = proc.memory_info().rss
    stopped = threading.Event()
    stopped.set()
    assert slab.commit(stopped) is False and proc.memory_info().rss - before < 16 << 20  # stopped: nothing done
    assert slab.commit(threading.Event()) is _kernel_populates()
    if _kernel_populates():
        assert proc.memory_info().rss - before >= 48 << 20  # the other 15 slots' 60 MB came in
    assert np.array_equal(slot, np.arange(slot.size, dtype=np.uint64).astype(np.uint8))
    del slot
    slab.close()


def test_cache_reports_its_slab_committed(fst):
    """The cache commits its slab on a thread started with it; `wait_committed` says how long that took (None
    where the kernel cannot)."""
    with ExpertCache(fst, ram_budget_bytes=4 * fst.expert_stride) as cache:
        s = cache.wait_committed(timeout=60)
        assert (s is not None and s >= 0) is _kernel_populates()
        assert cache.get(0, 1) is not None


def test_claiming_a_starved_scan_prefetch_wakes_the_loader(fst):
    """A scan prefetch finds no slot it may take (none of the scanned layer's records is evictable): it waits and the
    loader sleeps until a pin is released. Claiming that read (it becomes a demand read, which may evict anything)
    must wake the loader, or the claimant waits forever: a paged prefill prefetches the hash layers' experts at
    the start of a span, and claims the first layer's behind them."""
    with ExpertCache(fst, 4 * fst.expert_stride, io_threads=1, policy="lru") as c:
        assert [e for b in c.each_batch(2, range(4)) for e, _ in b] == [0, 1, 2, 3]  # layer 2 fills the 4 slots
        assert list(c.each_batch(1, [])) == []  # the scan has moved on to layer 1, none of whose records is held
        assert c.prefetch(0, range(4), scan=True) == 4
        deadline = time.monotonic() + TIMEOUT
        while not c._starved and time.monotonic() < deadline:  # the loader has tried, found no slot, and sleeps
            time.sleep(0.01)
        assert c._starved
        got, done = [], threading.Event()

        def claim():
            got.extend(e for b in c.each_batch(0, range(4), scan=True) for e, _ in b)
            done.set()

        threading.Thread(target=claim, daemon=True).start()
        assert done.wait(TIMEOUT) and sorted(got) == [0, 1, 2, 3]


def test_each_batch_of_a_layer_all_in_a_budget_that_holds_the_bank(fst):
    """With the budget holding every record and a layer all in, `each_batch` hands out that layer's experts in one
    list without pins, counting the hits and the prefetches' first uses exactly as the pinned path does on a budget
    one record short of the bank; bad ids are refused the same."""
    bank = fst.bank["slots"] * fst.bank["experts"]
    calls = [(2, [5, 1, 5, 7]), (2, [5, 0]), (3, [2]), (2, list(range(8)))]
    seen = {}
    for slots in (bank, bank - 1):
        with ExpertCache(fst, slots * fst.expert_stride) as c:
            assert c.prefetch(2, range(8), source="hash") == 8 and c.wait_idle(TIMEOUT)
            c.acquire(3, range(8)).release()
            before = c.stats()
            got = []
            for layer, ids in calls:
                for batch in c.each_batch(layer, ids):
                    assert all(same(w, fst.expert(layer, e)) for e, w in batch)
                    got.append([e for e, _ in batch])
                    if slots == bank:
                        assert c.stats()["pinned"] == 0  # nothing can be evicted: no pins
            after = c.stats()
            assert after["pinned"] == 0 and after["misses"] == before["misses"]
            seen[slots] = (got, after["hits"] - before["hits"], after["sources"]["hash"]["used"])
            with pytest.raises(ValueError, match="no expert"):
                list(c.each_batch(2, [8]))
    assert seen[bank] == seen[bank - 1]
    assert seen[bank] == ([[5, 1, 7], [5, 0], [2], list(range(8))], 14, 8)


@pytest.mark.parametrize("policy", POLICIES)
def test_each_batch_of_resident_experts_counts_as_the_handles_do(fst, policy):
    """A layer all resident comes from `each_batch` in one list pinned at once (`resident_batch`), changing the cache's
    state exactly as the handles of `iter_ready(batch=True)` do: the same resident sets step by step, the same hits,
    evictions and prefetch uses, the same recency and policy scores. (Each step first reads what is missing with
    `acquire`, so that which record a read evicts does not depend on when the reads land.)"""
    trace = routing_trace(30, 5, 8, 3, hash_layers=2, zipf=0.9, locality=0.5, vocab=512, seed=4)
    caches = [ExpertCache(fst, 12 * fst.expert_stride, io_threads=1, policy=policy) for _ in range(2)]
    try:
        for t in range(trace.shape[0]):
            for layer in range(trace.shape[1]):
                ids = [int(e) for e in dict.fromkeys(trace[t, layer])]
                nxt = (layer + 1) % trace.shape[1]
                for c in caches:  # a lookahead guess (the next layer's row of the next token), landed before use
                    c.prefetch(nxt, trace[(t + 1) % trace.shape[0], nxt][:2], source="lookahead")
                    assert c.wait_idle(TIMEOUT)
                    while missing := [e for e in ids if (layer, e) not in c.resident()]:  # a read may evict another
                        c.acquire(layer, missing).release()
                fast, slow = caches
                got = [[(e, same(w, fst.expert(layer, e))) for e, w in b] for b in fast.each_batch(layer, ids)]
                want = [[(h.expert, same(h.weights, fst.expert(layer, h.expert))) for h in hs]
                        for hs in slow.iter_ready(layer, ids, batch=True)]  # fmt: skip
                assert got == want == [[(e, True) for e in ids]]
                assert fast.resident() == slow.resident() and fast.stats()["pinned"] == 0
        a, b = (c.stats() for c in caches)
        for k in ("hits", "misses", "evictions", "sources"):
            assert a[k] == b[k], k
        assert a["sources"]["lookahead"]["used"] > 0 and a["evictions"] > 0
        assert np.array_equal(caches[0].policy.last, caches[1].policy.last)
        if policy == "lrfu":
            assert np.array_equal(caches[0].policy.score, caches[1].policy.score)
        assert np.array_equal(caches[0]._last_use, caches[1]._last_use)
    finally:
        for c in caches:
            c.close()


def test_each_batch_of_resident_experts_keeps_them_pinned_until_the_next_step(fst):
    """While the list of a resident layer is in use its slots are pinned: reads for other layers evict only what
    nobody holds, and a request that would need the held slots is refused; the next step of the iteration gives
    them back."""
    with ExpertCache(fst, 8 * fst.expert_stride, io_threads=1, policy="lru") as c:
        c.acquire(1, range(6)).release()
        it = c.each_batch(1, [5, 0, 3, 1, 4, 2])
        batch = next(it)
        assert [e for e, _ in batch] == [5, 0, 3, 1, 4, 2] and c.stats()["pinned"] == 6
        for e in range(8):  # every expert of layer 2 through the 2 slots left
            c.acquire(2, [e]).release()
        assert {(1, e) for e in range(6)} <= c.resident()
        assert all(same(w, fst.expert(1, e)) for e, w in batch)
        with pytest.raises(CacheFullError, match=r"\(8 slots"):
            c.acquire(3, [0, 1, 2])
        assert list(it) == [] and c.stats()["pinned"] == 0
        c.acquire(3, range(8)).release()  # released: the whole budget is usable again


def test_each_batch_claims_a_layer_together_and_gives_everything_back(fst):
    """With some of a layer's experts missing, `each_batch` pins the resident ones and starts the reads together: the
    resident come first in one list, the reads as they land, each once with its bytes; run through or closed early,
    every pin and claim goes back; a failed read is the requester's error and leaves nothing pinned."""
    with ExpertCache(fst, 8 * fst.expert_stride, io_threads=2) as c:
        c.acquire(2, [1, 3]).release()
        counts = slow_reads(c, 0.02)
        it = c.each_batch(2, [3, 0, 1, 5])
        first = next(it)
        assert [e for e, _ in first] == [3, 1] and c.stats()["pinned"] >= 2
        rest = [p for b in it for p in b]
        assert sorted(e for e, _ in rest) == [0, 5] and all(same(w, fst.expert(2, e)) for e, w in first + rest)
        assert c.stats()["pinned"] == 0 and counts == {(2, 0): 1, (2, 5): 1}
        it = c.each_batch(3, [0, 1, 2, 4])
        assert all(same(w, fst.expert(3, e)) for e, w in next(it))  # the first read landed
        it.close()  # abandoned: its pins and the claims on the reads still in flight go
        assert c.wait_idle(TIMEOUT) and c.stats()["pinned"] == 0
        slow = c._reader.read

        def read(layer, e, buf):
            if (layer, e) == (4, 1):
                raise OSError("device gone")
            slow(layer, e, buf)

        c._reader.read = read
        with pytest.raises(FormatError, match=r"expert \(layer 4, id 1\)"):
            for _ in c.each_batch(4, [0, 1, 2]):
                pass
        assert c.wait_idle(TIMEOUT) and c.stats()["pinned"] == 0
        c._reader.read = slow
        c.acquire(4, range(8)).release()  # the whole budget is usable again
