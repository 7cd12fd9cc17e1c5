"""The mHC collapse with its weights bound (`fastar.model.hc_fused.FusedHC`) against `ops.hc_pre`, bit for bit: Flash's
widths and ragged ones, 1 to 8 rows and a prefill chunk, contiguous and strided streams; and the cases it leaves to
`ops.hc_pre` (a torch-only scope, other dtypes, shapes that do not fit its weights)."""

from __future__ import annotations

import pytest
import torch
from test_mhc import EPS, HC_EPS, ITERS, params, streams

from fastar.model import ops
from fastar.model.hc_fused import FusedHC
from fastar.quant import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C extension not built")


@pytest.mark.parametrize("n, d", [(4, 4096), (2, 40), (3, 7)])
def test_fused_pre_equals_ops_hc_pre(n, d):
    fn, base, scale = params(n, d, seed=n + d)
    fused = FusedHC.build(fn, base, scale, n, ITERS, HC_EPS, EPS)
    assert fused is not None
    g = torch.Generator().manual_seed(d)
    norms = [torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5]  # a block's two sub-layer norms
    for T in (1, 2, 3, 4, 5, 6, 7, 8, 33):
        X = streams(T, n, d, seed=T)
        for Xs in (X, X.transpose(0, 1).contiguous().transpose(0, 1)):  # contiguous and strided (same values)
            for norm in norms:
                want = ops.hc_pre(Xs, fn, base, scale, ITERS, HC_EPS, EPS, norm)
                got = fused.pre(Xs, norm)
                for g_, w in zip(got, want):
                    assert g_.shape == w.shape and torch.equal(g_, w), (T, n, d)
    assert len(fused.norms) == 2  # each norm's array made once


def test_fused_pre_leaves_other_cases_to_ops():
    n, d = 4, 64
    fn, base, scale = params(n, d, seed=1)
    fused = FusedHC.build(fn, base, scale, n, ITERS, HC_EPS, EPS)
    X, norm = streams(2, n, d, seed=2), torch.rand(d)
    with ops.torch_only():
        assert fused.pre(X, norm) is None
    assert fused.pre(X.double(), norm) is None
    assert fused.pre(streams(2, n, 2 * d, seed=2), torch.rand(2 * d)) is None  # wider than its weights
    assert fused.pre(X, torch.rand(d + 1)) is None
    assert fused.pre(X, norm.double()) is None
    assert FusedHC.build(fn, base, scale, n, 0, HC_EPS, EPS) is None  # no Sinkhorn iteration
    assert FusedHC.build(fn, base, scale, n + 1, ITERS, HC_EPS, EPS) is None  # weights of another stream count
    assert FusedHC.build(fn.double(), base, scale, n, ITERS, HC_EPS, EPS) is None
