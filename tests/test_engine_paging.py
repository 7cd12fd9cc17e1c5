"""The engine over the expert pager: outputs never depend on the RAM budget, the policy or prefetching."""

from __future__ import annotations

import numpy as np
import pytest

from fastar.engine.engine import load
from fastar.errors import EngineClosed, FastarError

TOKENS = [int(t) for t in np.random.default_rng(3).integers(3, 1000, 150)]


def test_logits_independent_of_budget_and_prefetch(tiny_fst_path):
    mapped = load(tiny_fst_path, ram_budget=None)  # no pager: experts straight from the mapping
    assert mapped.expert_cache is None
    want = mapped.logits(TOKENS)
    stride = mapped.source.expert_stride
    for kw in (
        {"ram_budget": 2 * stride},
        {"ram_budget": "auto"},
        {"ram_budget": 2 * stride, "lookahead": True},
        {"ram_budget": 5 * stride, "cache_policy": "lru", "direct_io": True},
    ):
        e = load(tiny_fst_path, **kw)
        cache = e.expert_cache
        assert cache is not None and cache.budget_bytes <= max(2 * stride, cache.budget_bytes)
        np.testing.assert_array_equal(e.logits(TOKENS), want, err_msg=str(kw))
        s = e.stats()
        assert s["expert_cache_misses"] > 0
        if kw.get("ram_budget") == 2 * stride:
            assert e.expert_cache.n_slots == 2  # the budget holds: two records, never more


def test_greedy_tokens_independent_of_budget(tiny_fst_path):
    a = load(tiny_fst_path, ram_budget=None).generate_tokens(TOKENS[:20], 24, ignore_eos=True)
    b = load(tiny_fst_path, ram_budget="300K", lookahead=True).generate_tokens(TOKENS[:20], 24, ignore_eos=True)
    assert a == b and len(a) == 24


def test_hash_layers_prefetched_exactly(tiny_fst_path):
    e = load(tiny_fst_path, ram_budget="auto")
    e.logits(TOKENS[:40])
    s = e.expert_cache.stats()
    h = s["sources"]["hash"]
    assert h["issued"] > 0 and h["used"] == h["issued"] and h["wasted_bytes"] == 0, s  # exact: nothing wasted


def test_engine_close_stops_the_pager(tiny_fst_path):
    """`with load(...)` closes the pager (its loader threads and slab); closing again is a no-op; a closed pager
    refuses requests with a clear error instead of serving freed memory, and a closed engine says it is closed,
    with a pager or without one (no pager to stop: it would still run, but closed means closed for every engine)."""
    with load(tiny_fst_path, ram_budget="300K") as e:
        cache = e.expert_cache
        e.logits(TOKENS[:10])
        assert any(t.is_alive() for t in cache._threads)
    threads = list(cache._threads)
    assert not threads and cache._closed
    e.close()
    with pytest.raises(FastarError, match=r"expert cache of .* is closed"):
        cache.get(0, 0)
    mapped = load(tiny_fst_path, ram_budget=None)
    mapped.close()
    for engine in (e, mapped):
        with pytest.raises(EngineClosed, match=r"^this engine is closed"):
            engine.logits(TOKENS[:10])


def test_checkpoint_directory_paged_through_the_same_cache(tiny_ckpt, tiny_fst_path):
    """Straight from the HF snapshot: experts read from the shards by byte range into the same budgeted cache."""
    d = load(tiny_ckpt, ram_budget="400K")
    assert d.expert_cache is not None and not d.expert_cache.direct
    assert d.expert_cache.budget_bytes <= 400 * 1024
    np.testing.assert_array_equal(d.logits(TOKENS[:60]), load(tiny_fst_path, ram_budget=None).logits(TOKENS[:60]))
    assert d.stats()["expert_cache_misses"] > 0


def test_bench_compares_sources(tiny_ckpt, tiny_fst_path):
    import json
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastar",
            "bench",
            "-m",
            str(tiny_fst_path),
            "--compare",
            str(tiny_ckpt),
            "--json",
            "--ram-budget",
            "400K",
            "--prompt-tokens",
            "4",
            "--decode-tokens",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["compare"]["decode_tok_s"] > 0 and out["decode_ratio_vs_compare"] > 0


def test_paged_prefill_span_reads_each_expert_once_and_changes_no_bit(tiny_fst_path):
    """With the bank larger than the budget a prefill forward takes a span of several chunks: its logits are
    bit for bit those of the chunks one by one (mapped experts, no pager), however the budget and arrivals go,
    and it reads each (layer, expert) it needs at most once, where chunk by chunk reads again and again."""
    want = load(tiny_fst_path, ram_budget=None, prefill_chunk=16).logits(TOKENS)
    stride = load(tiny_fst_path, ram_budget=None).source.expert_stride
    for slots in (3, 12):
        e = load(tiny_fst_path, ram_budget=slots * stride, prefill_chunk=16)
        cache = e.expert_cache
        assert e.prefill_span >= len(TOKENS) > e.prefill_chunk  # the bank (6 x 8 records) does not fit
        cache.reset_stats()
        np.testing.assert_array_equal(e.logits(TOKENS), want, err_msg=f"{slots} slots")
        s = cache.stats()
        assert s["reads"] <= cache.num_layers * cache.num_experts, s  # once per record at most
        state = e.new_state()  # the same prompt chunk by chunk, each chunk its own forward
        cache.reset_stats()
        for a in range(0, len(TOKENS), 16):
            e.model.forward(TOKENS[a : a + 16], state)
        assert cache.stats()["reads"] > s["reads"]
        np.testing.assert_array_equal(e.prefill(TOKENS, e.new_state()).numpy(), want[-1:])
    one = load(tiny_fst_path, ram_budget=3 * stride)  # a prompt within one chunk is a span of one piece: still the same
    assert one.paged_chunk == one.prefill_chunk > len(TOKENS)
    np.testing.assert_array_equal(one.logits(TOKENS), load(tiny_fst_path, ram_budget=None).logits(TOKENS))
