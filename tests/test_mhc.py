"""The mHC's C calls (fastar.quant._kernels.hc_pre / hc_post, through fastar.model.ops) against their torch
references, on every instruction set this CPU runs: equal within float32 rounding, batch-invariant bit for bit
(a token alone, inside a chunk, at any place in it, on any thread count), and strict about their arguments."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastar.model import ops
from fastar.quant import kernels as K

pytestmark = pytest.mark.skipif(not K.available(), reason="C extension not built")

ISAS = K.cpu_features()["usable_isas"] if K.available() else []
ITERS, HC_EPS, EPS = 20, 1e-6, 1e-6
SHAPES = [(4, 4096), (2, 40), (3, 7)]  # Flash's (n, d); ragged widths exercise the column tails


@pytest.fixture(params=ISAS)
def isa(request):
    K.set_isa(request.param)
    yield request.param
    K.set_isa("auto")


def params(n: int, d: int, seed: int, head: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fn, base, scale at about the magnitudes of the checkpoint's (small fn rows, O(1) biases)."""
    g = torch.Generator().manual_seed(seed)
    R = n if head else (2 + n) * n
    fn = torch.randn(R, n * d, generator=g) * 0.02
    base = torch.randn(R, generator=g) * 0.5
    scale = torch.tensor([0.4]) if head else torch.tensor([0.4, 0.3, 0.2])
    return fn, base, scale


def streams(T: int, n: int, d: int, seed: int) -> torch.Tensor:
    """Residual streams [T, n, d]: O(1) values, a few outlier channels and a per-token scale over two decades."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(T, n, d, generator=g)
    X[:, :, : max(1, d // 100)] *= 30
    return X * torch.logspace(-1, 1, T)[:, None, None]


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    """Within float32 rounding of a sum: |got - want| <= rtol * max|want| per token."""
    scale = want.reshape(want.shape[0], -1).abs().amax(1).clamp_min(1e-30)
    err = (got - want).reshape(want.shape[0], -1).abs().amax(1)
    assert (err <= rtol * scale).all(), (err / scale).max().item()


@pytest.mark.parametrize("n,d", SHAPES)
@pytest.mark.parametrize("T", [1, 3, 8, 40])
def test_hc_pre_and_head_match_torch(isa, T, n, d):
    X = streams(T, n, d, T)
    fn, base, scale = params(n, d, 1)
    for got, want in zip(
        ops.hc_pre(X, fn, base, scale, ITERS, HC_EPS, EPS), ops.hc_pre_torch(X, fn, base, scale, ITERS, HC_EPS, EPS)
    ):
        assert got.shape == want.shape
        assert_close(got, want)
    fn, base, scale = params(n, d, 2, head=True)
    got, want = ops.hc_head(X, fn, base, scale, HC_EPS, EPS), ops.hc_head_torch(X, fn, base, scale, HC_EPS, EPS)
    assert got.shape == (T, d)
    assert_close(got, want)


@pytest.mark.parametrize("n,d", SHAPES)
@pytest.mark.parametrize("T", [1, 3, 8, 40])
def test_hc_pre_and_head_with_the_norm_equal_the_norm_after(isa, T, n, d):
    """`norm=` (the sub-layer's input norm in the same C call) gives the bits of `rms_norm` on the collapsed u, on
    both paths (the torch one applies the norm after), for a layer site and the head."""
    X = streams(T, n, d, T + 7)
    w = torch.rand(d, generator=torch.Generator().manual_seed(T)) + 0.5
    fn, base, scale = params(n, d, 3)
    u, post, comb = ops.hc_pre(X, fn, base, scale, ITERS, HC_EPS, EPS)
    got = ops.hc_pre(X, fn, base, scale, ITERS, HC_EPS, EPS, norm=w)
    assert torch.equal(got[0], ops.rms_norm(u, w, EPS)) and torch.equal(got[1], post) and torch.equal(got[2], comb)
    with ops.torch_only():
        ref = ops.hc_pre(X, fn, base, scale, ITERS, HC_EPS, EPS, norm=w)[0]
        assert torch.equal(ref, ops.rms_norm_torch(ops.hc_pre_torch(X, fn, base, scale, ITERS, HC_EPS, EPS)[0], w, EPS))
    fn, base, scale = params(n, d, 4, head=True)
    want = ops.rms_norm(ops.hc_head(X, fn, base, scale, HC_EPS, EPS), w, EPS)
    assert torch.equal(ops.hc_head(X, fn, base, scale, HC_EPS, EPS, norm=w), want)


@pytest.mark.parametrize("n,d", SHAPES)
@pytest.mark.parametrize("T", [1, 3, 8, 40])
def test_hc_post_matches_torch(isa, T, n, d):
    X = streams(T, n, d, T)
    _, post, comb = ops.hc_pre_torch(X, *params(n, d, 1), ITERS, HC_EPS, EPS)
    f = torch.randn(T, d) * 3
    got, want = ops.hc_post(f, X, post, comb), ops.hc_post_torch(f, X, post, comb)
    assert got.shape == (T, n, d)
    assert_close(got, want)


def test_comb_is_doubly_stochastic_and_weights_in_range():
    n, d = 4, 64
    u, post, comb = ops.hc_pre(streams(5, n, d, 0), *params(n, d, 3), ITERS, HC_EPS, EPS)
    assert torch.allclose(comb.sum(1), torch.ones(5, n), atol=1e-5)  # columns (the last step)
    assert torch.allclose(comb.sum(2), torch.ones(5, n), atol=1e-3)
    assert ((post > 0) & (post < 2)).all()


def run_all(X: torch.Tensor, f: torch.Tensor, pre_params, head_params) -> list[torch.Tensor]:
    u, post, comb = ops.hc_pre(X, *pre_params, ITERS, HC_EPS, EPS)
    return [u, post, comb, ops.hc_head(X, *head_params, HC_EPS, EPS), ops.hc_post(f, X, post, comb)]


@pytest.mark.parametrize("n,d", SHAPES)
def test_c_calls_are_batch_invariant(isa, n, d):
    """A token's results are bit-identical alone, in a chunk of 2..8 or 40 at any place, and on 1 or 2 threads:
    the property that lets a verify pass reproduce decoding (tests/test_model.py checks the whole model)."""
    T = 40
    X, f = streams(T, n, d, 7), torch.randn(T, d)
    pp, hp = params(n, d, 4), params(n, d, 5, head=True)
    alone = [run_all(X[t : t + 1], f[t : t + 1], pp, hp) for t in range(T)]
    chunks = [(0, 40)] + [(a, a + c) for c in range(2, 9) for a in (0, 5, 31)]
    before = K.get_num_threads()
    try:
        for threads in (1, 2):
            K.set_num_threads(threads)
            for a, b in chunks:
                got = run_all(X[a:b], f[a:b], pp, hp)
                for i, g in enumerate(got):
                    assert torch.equal(g, torch.cat([alone[t][i] for t in range(a, b)])), (threads, a, b, i)
    finally:
        K.set_num_threads(before)


def test_falls_back_to_torch(monkeypatch):
    """Without the extension ops gives the torch references."""
    n, d = 2, 40
    X, f = streams(3, n, d, 1), torch.randn(3, d)
    pp, hp = params(n, d, 1), params(n, d, 2, head=True)
    monkeypatch.setattr(ops, "_C", None)
    u, post, comb = ops.hc_pre(X, *pp, ITERS, HC_EPS, EPS)
    for got, want in zip((u, post, comb), ops.hc_pre_torch(X, *pp, ITERS, HC_EPS, EPS)):
        assert torch.equal(got, want)
    assert torch.equal(ops.hc_head(X, *hp, HC_EPS, EPS), ops.hc_head_torch(X, *hp, HC_EPS, EPS))
    assert torch.equal(ops.hc_post(f, X, post, comb), ops.hc_post_torch(f, X, post, comb))


def test_strided_streams_are_taken_as_their_values():
    """The first layer's streams are one embedding expanded n times (stride 0): same results as a dense copy."""
    n, d = 4, 64
    X = torch.randn(3, 1, d).expand(3, n, d)
    pp, f = params(n, d, 1), torch.randn(3, d)
    for a, b in zip(ops.hc_pre(X, *pp, ITERS, HC_EPS, EPS), ops.hc_pre(X.contiguous(), *pp, ITERS, HC_EPS, EPS)):
        assert torch.equal(a, b)
    _, post, comb = ops.hc_pre(X, *pp, ITERS, HC_EPS, EPS)
    assert torch.equal(ops.hc_post(f, X, post.T.contiguous().T, comb), ops.hc_post(f, X.contiguous(), post, comb))


def test_hc_calls_check_their_arguments():
    from fastar.quant import _kernels as C

    n, d, T = 4, 32, 2
    R = (2 + n) * n
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    x, fn, base, scale, u, post, comb = z(T, n * d), z(R, n * d), z(R), z(3), z(T, d), z(T, n), z(T, n * n)
    C.hc_pre(x, fn, base, scale, n, ITERS, HC_EPS, EPS, u, post, comb)
    C.hc_pre(x, fn[:n], base[:n], scale[:1], n, 1, HC_EPS, EPS, u)  # the head
    bad = [
        (dict(fn=z(R - 1, n * d)), ValueError, r"fn has shape \(23, 128\), expected \(24, 128\)"),
        (dict(base=z(R + 1)), ValueError, "base has 25 entries"),
        (dict(scale=z(1)), ValueError, "scale 1, expected 24 .* and 3"),
        (dict(u=z(T, d + 1)), ValueError, r"u has shape \(2, 33\), expected \(2, 32\)"),
        (dict(post=z(T, n + 1)), ValueError, "post has shape"),
        (dict(comb=z(T, n)), ValueError, "comb has shape"),
        (dict(comb=None), ValueError, "post and comb must both be"),
        (dict(n=17), ValueError, "n must be in"),
        (dict(n=3), ValueError, r"x has shape \(2, 128\), expected \(T, n\*d\) with n = 3"),
        (dict(iters=0), ValueError, "iters must be"),
        (dict(x=x.astype(np.float64)), TypeError, "x must be float32"),
        (dict(fn=np.zeros((n * d, R), np.float32).T), ValueError, "fn must be C-contiguous"),
        (dict(u=x[:, :d]), ValueError, "C-contiguous"),
        (dict(u=x.reshape(-1)[: T * d].reshape(T, d)), ValueError, "u must not overlap"),
        (dict(post=u.reshape(-1)[: T * n].reshape(T, n)), ValueError, "post must not overlap"),
        (dict(norm=z(d + 1)), ValueError, r"norm has 33 values, expected 32 \(d\)"),
        (dict(norm=z(d).astype(np.float64)), TypeError, "norm must be float32"),
    ]
    args = dict(x=x, fn=fn, base=base, scale=scale, n=n, iters=ITERS, hc_eps=HC_EPS, eps=EPS, u=u, post=post, comb=comb)
    for change, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            C.hc_pre(**{**args, **change})
    with pytest.raises(ValueError, match=r"fn has shape \(24, 128\), expected \(4, 128\) .*head"):
        C.hc_pre(x, fn, base, scale, n, 1, HC_EPS, EPS, u)
    f, out = z(T, d), z(T, n * d)
    C.hc_post(f, x, post, comb, out)
    for change, msg in [
        (dict(x=z(T, n * d + 1)), "x has shape"),
        (dict(comb=z(T, n * n - 1)), "comb has shape"),
        (dict(post=z(T + 1, n)), "post has shape"),
        (dict(out=z(T, d)), "out has shape"),
        (dict(out=x), "out must not overlap"),
        (dict(post=z(T, 0)), "n >= 1"),
    ]:
        with pytest.raises(ValueError, match=msg):
            C.hc_post(**{**dict(f=f, x=x, post=post, comb=comb, out=out), **change})
