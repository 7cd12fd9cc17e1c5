"""Attention: the C kernel behind `deepseek_v4.attend` against its torch reference `attend_torch` (on masks built
as the model built them before the kernel), on every instruction set this CPU runs; batch invariance (a chunk of
queries gives each query bit-identical rows to a call of its own, for any thread count); the torch fallback
(no extension, other dtypes), also through the whole tiny model; and the kernel's argument checks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastar.model import deepseek_v4 as M
from fastar.model import ops
from fastar.quant import kernels as K

C = ops._C
ISAS = K.cpu_features()["usable_isas"] if C is not None else []

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(params=ISAS)
def isa(request):
    K.set_isa(request.param)
    yield request.param
    K.set_isa("auto")


def reference(q, keys, k0, p0, window, comp, comp_idx, ratio, sinks, scale):
    """`attend_torch` on the masks `Attention._attend` built: window key j of query p iff p - W < k0 + j <= p;
    entry e (without comp_idx) iff e < (p + 1) // ratio."""
    pos = torch.arange(p0, p0 + q.shape[0])
    kpos = torch.arange(k0, k0 + keys.shape[0])
    key_mask = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - window)
    comp_mask = None
    if comp is not None and comp_idx is None:
        comp_mask = torch.arange(comp.shape[0])[None, :] < (pos + 1)[:, None] // ratio
    return M.attend_torch(q, keys, key_mask, comp, comp_mask, comp_idx, sinks, scale)


def picks(T: int, p0: int, k: int, ratio: int, g: torch.Generator) -> torch.Tensor:
    """Indexer-like entry ids [T, k]: distinct visible entries (e < (p+1)//ratio) in random order, -1 for the rest."""
    rows = []
    for t in range(T):
        seen = (p0 + t + 1) // ratio
        ids = torch.randperm(seen, generator=g)[:k].tolist()
        rows.append(ids + [-1] * (k - len(ids)))
    return torch.tensor(rows, dtype=torch.int64)


def inputs(T, H, D, window, p0, ratio, k=0, seed=0, wide=3.0):
    """A chunk's arguments as `Attention._attend` passes them: keys from the first query's window start to the
    chunk's end, entries closed by the chunk's end; comp_idx [T, k] when k > 0. `wide` scales q (peakier)."""
    g = torch.Generator().manual_seed(seed)
    k0 = max(0, p0 - window + 1)
    q = torch.randn(T, H, D, generator=g) * wide
    keys = torch.randn(p0 + T - k0, D, generator=g)
    comp = torch.randn((p0 + T) // ratio, D, generator=g) if ratio else None
    comp_idx = picks(T, p0, k, ratio, g) if k else None
    sinks = torch.randn(H, generator=g)
    return q, keys, k0, p0, window, comp, comp_idx, ratio, sinks, D**-0.5


CASES = {  # T, H, D, window, p0, ratio, k
    "decode-flash-ratio4": (1, 64, 512, 128, 300, 4, 0),  # 128 keys + 75 entries
    "decode-flash-ratio128": (1, 64, 512, 128, 1000, 128, 0),
    "decode-flash-picks": (1, 64, 512, 128, 2100, 4, 512),
    "chunk8-picks": (8, 8, 128, 16, 50, 4, 6),  # fewer visible entries than picks early on: -1s
    "chunk40-window-edge": (40, 16, 72, 16, 100, 128, 0),  # keys masked on both sides; entry 0 opens at 127
    "chunk40-ratio4": (40, 8, 64, 16, 3, 4, 0),  # starts before the window fills
    "no-compressed-entries": (8, 4, 33, 8, 20, 0, 0),  # ragged D
    "first-token": (1, 4, 40, 8, 0, 4, 0),  # one key, no entry closed yet (comp is [0, D])
    "window-one": (5, 3, 16, 1, 9, 0, 0),
}


@pytest.mark.parametrize("case", CASES)
def test_attend_matches_torch_reference(isa, case):
    args = inputs(*CASES[case])
    got = M.attend(*args)
    assert got.shape == args[0].shape and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(*args))


def test_sink_and_one_key(isa):
    """A query that sees only its own key (window 1) and no entry (all picks -1): out = key * e^z / (e^z + e^s)."""
    q, keys, k0, p0, _, comp, _, _, sinks, scale = inputs(3, 4, 32, 1, 7, 4, seed=3)
    idx = torch.full((3, 2), -1, dtype=torch.int64)
    got = M.attend(q, keys, k0, p0, 1, comp, idx, 4, sinks, scale)
    z = torch.einsum("thd,td->th", q, keys[-3:]) * scale  # [T, H]
    w = torch.sigmoid(z - sinks)  # e^z / (e^z + e^sink)
    torch.testing.assert_close(got, w[..., None] * keys[-3:, None, :])
    torch.testing.assert_close(got, reference(q, keys, k0, p0, 1, comp, idx, 4, sinks, scale))


def test_nan_key_poisons_the_queries_that_see_it(isa):
    """A NaN in a key makes every output of the queries whose window holds it NaN (as torch's softmax makes their
    rows), and no other (the kernel reads only visible rows; the masked torch product also multiplies the hidden
    ones by 0). AVX-512's exp once clamped a NaN logit to e^-110, leaving those rows mostly finite."""
    args = list(inputs(6, 8, 64, 4, 20, 0))
    keys, k0 = args[1].clone(), args[2]
    keys[21 - k0, 5] = float("nan")  # position 21: seen by the queries at 21..24 (window 4)
    args[1] = keys
    got = M.attend(*args)
    assert got[1:5].isnan().all() and not got[[0, 5]].isnan().any()
    assert reference(*args)[1:5].isnan().all()


@pytest.mark.parametrize("D,k", [(64, 0), (40, 5), (512, 0)])
def test_chunk_is_bit_identical_to_one_query_at_a_time(isa, D, k):
    """Each query of a chunk (T = 2, 8, 40) computes its rows as a one-query call with only its own window keys and
    closed entries does (decode), whatever the thread count."""
    H, W, ratio, p0 = 16, 16, 4, 37
    q, keys, k0, _, _, comp, comp_idx, _, sinks, scale = inputs(40, H, D, W, p0, ratio, k, seed=D + k)
    kv = torch.cat([torch.randn(k0, D), keys])  # rows by position 0..p0+40
    alone = []
    for t in range(40):
        p = p0 + t
        a = max(0, p - W + 1)
        idx = None if comp_idx is None else comp_idx[t : t + 1]
        alone.append(M.attend(q[t : t + 1], kv[a : p + 1], a, p, W, comp[: (p + 1) // ratio], idx, ratio, sinks, scale))
    alone = torch.cat(alone)
    threads = K.get_num_threads()
    try:
        for n in {1, 2, threads}:
            K.set_num_threads(n)
            for T in (2, 8, 40):
                idx = None if comp_idx is None else comp_idx[:T]
                kT, cT = kv[k0 : p0 + T], comp[: (p0 + T) // ratio]
                assert torch.equal(M.attend(q[:T], kT, k0, p0, W, cT, idx, ratio, sinks, scale), alone[:T]), (n, T)
    finally:
        K.set_num_threads(threads)


def test_torch_fallback(monkeypatch):
    """Without the extension, and for inputs the kernel does not take (float64), `attend` is `attend_torch`."""
    args = inputs(8, 8, 64, 16, 30, 4, 3, seed=5)
    fast = M.attend(*args)
    as64 = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    got64 = M.attend(*as64)
    assert got64.dtype == torch.float64
    torch.testing.assert_close(got64, reference(*as64))
    monkeypatch.setattr(ops, "attend_c", lambda *a: None)
    slow = M.attend(*args)
    assert torch.equal(slow, reference(*args))
    torch.testing.assert_close(fast, slow)


def test_model_logits_with_and_without_the_kernel(tiny_ckpt, monkeypatch):
    """The tiny model (prefill in window-long pieces, then decode steps) with the C attention and with the torch
    one agree to the model tests' tolerance."""
    from fastar.engine.engine import load

    if C is None:
        pytest.skip("C extension not built")
    ids = torch.randint(0, 1024, (150,), generator=torch.Generator().manual_seed(4)).tolist()
    eng = load(tiny_ckpt, numerics="reference")
    fast = eng.logits(ids)
    monkeypatch.setattr(ops, "attend_c", lambda *a: None)
    slow = eng.logits(ids)
    assert np.abs(fast - slow).max() <= 1e-4


@pytest.mark.skipif(C is None, reason="C extension not built")
def test_kernel_rejects_bad_arguments():
    T, H, D, E = 2, 4, 32, 3
    f32 = np.float32
    ok = dict(
        q=np.zeros((T, H, D), f32),
        keys=np.zeros((5, D), f32),
        k0=0,
        p0=3,
        window=4,
        comp=np.zeros((E, D), f32),
        comp_idx=np.array([[0, -1], [2, 1]], np.int64),
        ratio=4,
        sinks=np.zeros(H, f32),
        scale=0.1,
        out=np.zeros((T, H, D), f32),
    )
    C.attend(**ok)
    C.attend(**{**ok, "comp_idx": None})
    C.attend(**{**ok, "comp_idx": None, "comp": None, "ratio": 0})
    readonly = np.zeros((T, H, D), f32)
    readonly.flags.writeable = False
    bad = [
        (dict(q=np.zeros((T, H * D), f32)), ValueError, "q must be 3-D"),
        (dict(keys=np.zeros((5, D + 1), f32)), ValueError, "keys has shape"),
        (dict(keys=np.zeros((5, 2 * D), f32)[:, ::2]), ValueError, "keys must be C-contiguous"),
        (dict(out=np.zeros((T, H, D + 1), f32)), ValueError, "out has shape"),
        (dict(out=readonly), ValueError, "out must be writable"),
        (dict(out=ok["q"]), ValueError, "overlap"),
        (dict(sinks=np.zeros(H + 1, f32)), ValueError, "sinks has 5 entries"),
        (dict(comp=np.zeros((E, 2 * D), f32)), ValueError, "comp has shape"),
        (dict(comp_idx=np.zeros((T + 1, 2), np.int64)), ValueError, "comp_idx has shape"),
        (dict(comp_idx=np.full((T, 2), E, np.int64)), ValueError, r"comp_idx\[0, 0\] = 3 is not an entry"),
        (dict(comp=None), ValueError, "comp_idx needs comp"),
        (dict(comp_idx=None, ratio=0), ValueError, "ratio"),
        (dict(window=0), ValueError, "window"),
        (dict(k0=-1), ValueError, "k0"),
        (dict(q=np.zeros((T, H, D), np.float64)), TypeError, "q must be float32"),
        (dict(sinks=np.zeros(H, np.float16)), TypeError, "sinks must be float32"),
        (dict(comp_idx=np.zeros((T, 2), np.int32)), TypeError, "comp_idx must be int64"),
        (dict(keys=torch.zeros(5, D)), TypeError, "keys must be a numpy array"),
    ]
    for change, exc, match in bad:
        with pytest.raises(exc, match=match):
            C.attend(**{**ok, **change})
