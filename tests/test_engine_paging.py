"""The engine over the expert pager: outputs never depend on the RAM budget, the policy or prefetching."""
from __future__ import annotations

import numpy as np
import pytest

from fastar.convert.hf import convert
from fastar.engine.engine import load


@pytest.fixture(scope="module")
def tiny_fst(tiny_ckpt, tmp_path_factory):
    return convert(tiny_ckpt, tmp_path_factory.mktemp("paging") / "t.fst", progress=False)


TOKENS = [int(t) for t in np.random.default_rng(3).integers(3, 1000, 150)]


def test_logits_independent_of_budget_and_prefetch(tiny_fst):
    mapped = load(tiny_fst, ram_budget=None)  # no pager: experts straight from the mapping
    assert mapped.expert_cache is None
    want = mapped.logits(TOKENS)
    stride = mapped.source.expert_stride
    for kw in ({"ram_budget": 2 * stride}, {"ram_budget": "auto"}, {"ram_budget": 2 * stride, "lookahead": True},
               {"ram_budget": 5 * stride, "cache_policy": "lru", "direct_io": True}):
        e = load(tiny_fst, **kw)
        assert e.expert_cache is not None and e.expert_cache.budget_bytes <= max(2 * stride, e.expert_cache.budget_bytes)
        np.testing.assert_array_equal(e.logits(TOKENS), want, err_msg=str(kw))
        s = e.stats()
        assert s["expert_cache_misses"] > 0
        if kw.get("ram_budget") == 2 * stride:
            assert e.expert_cache.n_slots == 2  # the budget holds: two records, never more


def test_greedy_tokens_independent_of_budget(tiny_fst):
    a = load(tiny_fst, ram_budget=None).generate_tokens(TOKENS[:20], 24, ignore_eos=True)
    b = load(tiny_fst, ram_budget="300K", lookahead=True).generate_tokens(TOKENS[:20], 24, ignore_eos=True)
    assert a == b and len(a) == 24


def test_hash_layers_prefetched_exactly(tiny_fst):
    e = load(tiny_fst, ram_budget="auto")
    e.logits(TOKENS[:40])
    s = e.expert_cache.stats()
    h = s["sources"]["hash"]
    assert h["issued"] > 0 and h["used"] == h["issued"] and h["wasted_bytes"] == 0, s  # exact: nothing wasted
