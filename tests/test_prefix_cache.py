"""The prefix cache on disk: lookup of the longest stored prefix, the scheduler prefilling only the tail after a
restart, corrupt files skipped (logged once) and removed, another model's files never read, LRU eviction under the
size cap, atomic writes. Crashes, damaged files, a full disk and shared folders: test_prefix_cache_faults.py."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch
from batch_helpers import prefilled, prompt

from fastar.engine.engine import load
from fastar.engine.prefix_cache import PrefixCache
from fastar.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def eng(tiny_ckpt):
    return load(tiny_ckpt)


def continues_alike(eng, state, ids) -> bool:
    """Whether `state` and a prefill of `ids` give bit-identical logits for the same next tokens."""
    fresh = prefilled(eng, ids)
    if state.length != fresh.length:
        return False
    a, b = (eng.model.forward([3, 4, 5], s, all_logits=True)[0] for s in (state, fresh))
    return torch.equal(a, b)


def test_lookup_finds_the_longest_stored_prefix(eng, tmp_path):
    cache = eng.open_prefix_cache(tmp_path, "1G")
    ids = prompt(0, 40)
    for n in (10, 25):
        cache.store(ids[:n], prefilled(eng, ids[:n]))
    state, n = cache.lookup(ids + [7], limit=40)
    assert n == 25 and continues_alike(eng, state, ids[:25])
    state, n = cache.lookup(ids[:25], limit=24)  # the same prompt again: its last token must run
    assert n == 24 and state.length == 24
    assert cache.lookup(ids[:12] + [1, 2, 3], limit=14)[1] == 10
    assert cache.lookup(prompt(1, 40), limit=39) is None
    assert cache.stats()["hits"] == 3 and cache.stats()["misses"] == 1


def test_restarted_scheduler_prefills_only_the_tail(eng, tmp_path):
    """A conversation's first turn through one scheduler, its second (prompt + reply + new message) through a
    new scheduler on the same folder (a restart): it loads the state saved at the end of the reply and runs only
    the new tokens; its tokens equal `Engine.stream` continuing one session (the same reuse, the same chunks)."""
    first, p = prompt(2, 30), SamplingParams(max_tokens=12, ignore_eos=True)
    sched = eng.scheduler(prefix_cache=tmp_path)
    h = sched.submit(first, p)
    sched.run_until_idle()
    reply = [c.token for c in h]
    second = first + reply + prompt(3, 9)

    restarted = eng.scheduler(prefix_cache=tmp_path)
    before = eng.stats()["prefill_tokens_computed"]
    h = restarted.submit(second, p)
    restarted.run_until_idle()
    got = list(h)
    computed = eng.stats()["prefill_tokens_computed"] - before
    assert got[-1].usage["cached_tokens"] == len(first) + len(reply) - 1
    assert computed == len(second) - got[-1].usage["cached_tokens"] == 10
    assert restarted.metrics()["prefix_cache_hits"] == 1

    s = eng.open_session()
    assert [c.token for c in eng.stream(first, p, session=s)] == reply
    ref = list(eng.stream(second, p, session=s))
    assert [c.token for c in got] == [c.token for c in ref] and got[-1].usage == ref[-1].usage


def test_corrupt_and_foreign_files_are_skipped_logged_once_and_removed(eng, tmp_path, caplog):
    ids = prompt(4, 20)
    cache = eng.open_prefix_cache(tmp_path, "1G")
    good = cache.store(ids[:8], prefilled(eng, ids[:8]))
    bad = cache.store(ids[:16], prefilled(eng, ids[:16]))
    raw = bytearray(bad.read_bytes())
    raw[-5] ^= 0x40  # one flipped bit in the state
    bad.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="fastar.prefix_cache"):
        for _ in range(2):
            state, n = cache.lookup(ids, limit=19)
            assert n == 8  # the corrupt longer prefix is not trusted: the shorter good one is used
    assert [r.getMessage() for r in caplog.records] == [
        f"prefix cache: skipping {bad}: its tokens or checksum do not match; removed"
    ]
    assert not bad.exists() and cache.stats()["rejected"] == 1
    foreign = PrefixCache(tmp_path, "another model", 1 << 30)  # another model's names: it finds nothing
    assert foreign.lookup(ids, limit=19) is None and good.exists()
    (tmp_path / f"8-{'0' * 64}.fpc").write_bytes(b"garbage")  # no prompt's name: never read
    truncated = tmp_path / good.name
    truncated.write_bytes(good.read_bytes()[:100])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastar.prefix_cache"):
        assert cache.lookup(ids, limit=19) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"prefix cache: skipping {truncated}: truncated (its header is cut short); removed"
    ]
    assert not truncated.exists() and cache.stats()["rejected"] == 2


def test_lru_eviction_under_the_size_cap(eng, tmp_path):
    ids = [prompt(10 + i, 12) for i in range(3)]
    states = [prefilled(eng, x) for x in ids]
    probe = PrefixCache(tmp_path / "probe", "f", 1 << 30)
    one = probe.store(ids[0], states[0]).stat().st_size
    cache = PrefixCache(tmp_path / "c", "f", int(2.5 * one))
    paths = [cache.store(ids[0], states[0]), cache.store(ids[1], states[1])]
    old = paths[0].stat().st_mtime_ns
    os.utime(paths[1], ns=(old - 10**9, old - 10**9))  # make the second older ...
    assert cache.lookup(ids[0] + [5], limit=12) is not None  # ... and touch the first
    cache.store(ids[2], states[2])
    assert paths[0].exists() and not paths[1].exists() and cache.stats()["evictions"] == 1
    assert cache.size() <= int(2.5 * one)
    tiny = PrefixCache(tmp_path / "t", "f", 100)
    assert tiny.store(ids[0], states[0]) is None and tiny.size() == 0  # bigger than the whole cap: not stored


def test_writes_are_atomic(eng, tmp_path, monkeypatch, caplog):
    """A write that fails leaves neither a half-written file nor its temporary file; the store is dropped (None)
    with one log line, and the caller goes on."""
    cache = PrefixCache(tmp_path, "f", 1 << 30)
    ids = prompt(20, 6)

    def fail(*a):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "replace", fail)
    with caplog.at_level(logging.WARNING, logger="fastar.prefix_cache"):
        assert cache.store(ids, prefilled(eng, ids)) is None
        assert cache.store(ids[:5], prefilled(eng, ids[:5])) is None
    assert list(tmp_path.iterdir()) == []  # no half-written file, no temp left behind
    assert len(caplog.records) == 1 and "cannot write" in caplog.records[0].getMessage()
    with pytest.raises(ValueError, match="does not hold"):
        cache.store(ids + [1], prefilled(eng, ids))


class FakeState:
    """The state surface PrefixMemory uses: length, truncate (bounded by max_rollback), snapshot, nbytes."""

    def __init__(self, n: int, max_rollback: int = 1000) -> None:
        self.length, self.max_rollback, self.copies = n, max_rollback, 0

    def truncate(self, p: int) -> None:
        from fastar.model.state import StateError

        if self.length - p > self.max_rollback:
            raise StateError("rolled back too far")
        self.length = p

    def snapshot(self):
        self.copies += 1
        return FakeState(self.length, self.max_rollback)

    def nbytes(self) -> int:
        return 4 * self.length


def test_prefix_memory_hands_over_its_own_conversation_and_copies_a_shared_prefix():
    from fastar.engine.prefix_cache import PrefixMemory

    mem = PrefixMemory(capacity=2, min_shared=4)
    system = list(range(100, 110))
    a, b = FakeState(14), FakeState(13)
    mem.put(system + [1, 2, 3, 4], a, prompt_len=12)
    mem.put(system + [5, 6, 7], b, prompt_len=11)
    # A continues (its prompt + reply + more): A's own state, handed over and not copied
    assert mem.match(system + [1, 2, 3, 4, 9, 9], limit=15) == 14 and len(mem) == 2  # match takes nothing
    state, n = mem.take(system + [1, 2, 3, 4, 9, 9], limit=15)
    assert state is a and n == 14 and len(mem) == 1
    # a new conversation sharing the 10-token system prompt with B: a copy, rolled back; B stays kept
    state, n = mem.take(system + [8], limit=10)
    assert state is not b and n == 10 and state.length == 10 and b.length == 13 and len(mem) == 1
    # regenerate B's reply (same prompt, limit len - 1): B itself, rolled back into its prompt
    state, n = mem.take(system + [5], limit=10)
    assert state is b and n == 10
    assert mem.take([1, 2, 3], limit=2) is None  # nothing shared
    mem.put(system[:3], FakeState(3), prompt_len=3)
    assert mem.take(system[:2] + [0], limit=2) is None  # 2 shared tokens of another prompt: below min_shared
    assert (mem.hits, mem.misses) == (3, 2)


def test_prefix_memory_takes_the_best_state_it_can_use():
    """A longer match that can be neither handed over (another conversation) nor copied (below `min_shared`) does
    not hide a shorter one that continues its own conversation; at equal length a hand-over beats a copy."""
    from fastar.engine.prefix_cache import PrefixMemory

    mem = PrefixMemory(capacity=3, min_shared=64)
    own, other = FakeState(8), FakeState(10)
    mem.put([1, 2, 3, 4, 5, 7, 8, 8], own, prompt_len=5)  # the conversation continued: its prompt's 5 tokens
    mem.put([1, 2, 3, 4, 5, 6, 50, 51, 52, 53], other, prompt_len=10)  # 6 tokens shared, most recent
    assert mem.take([1, 2, 3, 4, 5, 6, 9], limit=6) == (own, 5) and own.copies == 0
    mem = PrefixMemory(capacity=3, min_shared=2)
    own, other = FakeState(6), FakeState(6)
    mem.put([1, 2, 3, 8, 8, 8], own, prompt_len=3)
    mem.put([1, 2, 3, 9, 9, 9], other, prompt_len=6)  # the same 3 tokens shared, more recent: a copy
    state, n = mem.take([1, 2, 3, 4], limit=3)
    assert state is own and n == 3 and other.copies == 0


def test_prefix_memory_evicts_the_least_recent_and_skips_states_that_cannot_roll_back():
    from fastar.engine.prefix_cache import PrefixMemory

    mem = PrefixMemory(capacity=2, min_shared=1)
    for i in range(3):
        mem.put([i, i, i], FakeState(3), prompt_len=3)
    assert len(mem) == 2 and mem.take([0, 0, 0, 1], limit=3) is None  # the oldest went
    mem.put([7] * 50, FakeState(50, max_rollback=5), prompt_len=10)
    assert mem.take([7] * 10 + [1], limit=10) is None  # 40 positions back: beyond its rollback
    assert PrefixMemory(0).take([1], 1) is None


def test_background_writes_land_after_flush_and_are_then_found(eng, tmp_path):
    """The scheduler's cache writes on its own thread: `store` returns once the state is serialized (the state
    may change afterwards without changing the file), `flush` waits for the file."""
    ids = prompt(11, 24)
    cache = eng.open_prefix_cache(tmp_path, "1G", background=True)
    state = prefilled(eng, ids)
    path = cache.store(ids, state)
    eng.model.forward([5, 6], state, all_logits=False)  # the live state moves on at once
    cache.flush()
    assert path.exists() and cache.stats()["stores"] == 1
    got, n = eng.open_prefix_cache(tmp_path, "1G").lookup(ids + [9], limit=24)
    assert n == 24 and continues_alike(eng, got, ids)
    assert cache.store(ids, prefilled(eng, ids)) == path and cache.stats()["stores"] == 1  # already there


@pytest.mark.parametrize("background", [False, True])
def test_store_keep_saves_the_state_rolled_back_and_keeps_the_live_one(eng, tmp_path, background):
    """`store(ids, state, keep=n)` saves the state of ids[:n] under their key (what follows from it is bit for bit
    what follows a prefill of those tokens), and leaves the live state as it was; where the state cannot roll back
    that far it saves the whole."""
    ids = prompt(12, 30)
    cache = eng.open_prefix_cache(tmp_path, "1G", background=background)
    state = prefilled(eng, ids)
    live = state.to_bytes()
    path = cache.store(ids, state, keep=29)
    cache.flush()
    assert path.name.startswith("29-") and state.to_bytes() == live
    assert cache.store(ids, state, keep=29) == path and cache.stats()["stores"] == 1  # stored already
    got, n = eng.open_prefix_cache(tmp_path, "1G").lookup(ids[:29] + [3, 4], limit=30)
    assert n == 29 and continues_alike(eng, got, ids[:29])

    short = eng.model.new_state()
    short.max_rollback = 2  # it keeps the rows for 2 positions back only
    eng.model.forward(ids, short, all_logits=False)
    path = cache.store(ids, short, keep=20)  # 10 positions back: beyond its rollback
    cache.flush()
    assert path.name.startswith("30-")


def test_stored_states_drop_the_rows_kept_for_long_rollbacks(eng, tmp_path):
    """A live state keeps rows for rolling back `max_rollback` positions; the file keeps those for one (what
    `lookup` may roll back), so it is far smaller, and what follows from it is unchanged."""
    ids = prompt(13, 120)  # far past the tiny model's 8-token window and its compressors' windows
    state = prefilled(eng, ids)
    live = state.nbytes()
    cache = eng.open_prefix_cache(tmp_path, "1G")
    path = cache.store(ids, state)
    assert state.nbytes() == live  # the live state keeps its rows
    assert path.stat().st_size < live / 2
    got, n = cache.lookup(ids, limit=119)  # the same prompt again: rolled back one position
    assert n == 119 and continues_alike(eng, got, ids[:119])
    got, n = cache.lookup(ids + [9, 9], limit=121)
    assert n == 120 and continues_alike(eng, got, ids)
