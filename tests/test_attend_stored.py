"""A decode query's attention over its stored rows in one C call (`fastar.model.attend_fused`, C: bind_attend.c)
against `Attention._attend`'s op-by-op path (the model with `Attention.stored_attend` off): the same logits and state
bytes through prefill, batched decode, the indexer's picks over packed (official) and float32 (reference) entries,
short chunks attended a query at a time, and trimmed states; and the call's argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastar.quant import kernels, linear

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(linear._kernels() is None, reason="the fused call is a C call (not built here)"),
]


@pytest.mark.parametrize("numerics", ["official", "reference"])
@pytest.mark.parametrize("max_rollback", [None, 3])
def test_stored_attend_equals_op_by_op(tiny_fst_file, numerics, max_rollback, monkeypatch):
    """Six sequences prefilled to different positions (past 4 x index_topk: the indexer picks entries), decode steps
    of 1..6 rows, then a 3-token chunk (a verify pass: one query at a time): logits and state bytes bit for bit with
    the C call on and off; it ran, with and without the indexer's picks."""
    from fastar.model.deepseek_v4 import DeepseekV4

    fused = DeepseekV4(tiny_fst_file, numerics=numerics, max_rollback=max_rollback)
    apart = DeepseekV4(tiny_fst_file, numerics=numerics, max_rollback=max_rollback)
    for b in apart.layers:
        b.attn.stored_attend = None
    calls = {"all": 0, "picks": 0}
    real = kernels.extension.attend_stored

    def counted(*a):
        calls["all"] += 1
        calls["picks"] += a[13] is not None
        return real(*a)

    monkeypatch.setattr(kernels.extension, "attend_stored", counted)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 1024, (n,), generator=g).tolist() for n in (70, 5, 130, 19, 2, 44)]
    results = []
    for m in (fused, apart):
        states = [m.new_state() for _ in prompts]
        outs = [m.forward(p, s, all_logits=False)[0][-1:] for p, s in zip(prompts, states)]
        ids = [int(o[-1].argmax()) for o in outs]
        for n in (6, 1, 2, 3, 4, 5, 6, 6):
            outs.append(m.forward_rows(ids[:n], states[:n]))
            ids[:n] = [int(r.argmax()) for r in outs[-1]]
        outs.append(m.forward(ids[:3], states[0])[0])
        results.append((outs, [s.to_bytes() for s in states]))
        if m is fused:
            assert calls["all"] and calls["picks"]
            ran = calls["all"]
    assert calls["all"] == ran  # the reference never calls it
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)
    assert results[0][1] == results[1][1]


def test_attend_stored_refuses_bad_arguments():
    """Wrong shapes, kinds, rows and picks get one-line errors naming the problem, never a crash."""
    H, D = 2, 64
    q = np.zeros((1, H, D), np.float32)
    kv = np.zeros((10, D), np.float32)
    ent = np.zeros((3, D), np.float32)
    sinks, out = np.zeros(H, np.float32), np.zeros((1, H, D), np.float32)

    def call(**kw):
        a = dict(q=q, kv=kv, kind=-1, rope=0, first=2, n=8, k0=2, p0=9, window=8, ent=ent, ent_kind=-1, ent_rope=0)
        a.update(n_ent=2, picks=None, ratio=4, sinks=sinks, scale=0.125, out=out)
        a.update(kw)
        return kernels.extension.attend_stored(*a.values())

    call()
    call(picks=np.array([[0, 1]], np.int64))
    for kw, name in (
        (dict(q=np.zeros((2, H, D), np.float32)), "q and out"),
        (dict(sinks=np.zeros(3, np.float32)), "sinks"),
        (dict(first=5), "kv rows"),
        (dict(n=0), "kv rows"),
        (dict(kind=2), "kv kind"),
        (dict(kind=0), "kv"),  # FP8 rows are bytes
        (dict(kind=0, kv=np.zeros((10, 8), np.uint8), rope=16), "row bytes"),
        (dict(n_ent=4), "entries"),
        (dict(picks=np.array([[1, 0]], np.int64)), "ascending"),
        (dict(picks=np.array([[0, 2]], np.int64)), "ascending"),
        (dict(picks=np.array([[-1, 1]], np.int64)), "ascending"),
        (dict(ent=None), "without the entry rows"),
        (dict(out=q), "out"),
    ):
        with pytest.raises((ValueError, TypeError), match=name):
            call(**kw)
