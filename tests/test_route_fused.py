"""The MoE router's C path (`fastar.model.route_fused`, C: route.c / bind_route.c) against `deepseek_v4.MoE.route`,
bit for bit: hash-routed and scored layers, both numerics, 1 to 16 rows, router widths that are and are not
multiples of 64; whole decode steps with it against the torch router, and batched rows against solo decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from synth_widths import SMALL

from fastar.engine.engine import load
from fastar.model import route_fused
from fastar.quant import kernels
from fastar.synth import synth

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not kernels.available(), reason="the C router needs the C kernels"),
]


@pytest.fixture(scope="module", params=[8, 64], ids=["E8", "E64"])
def model_path(request, tmp_path_factory):
    """5 layers (3 hash-routed) of E experts, top-6: E = 64 takes `router_scores`' one-call path, E = 8 its
    token-by-token one."""
    return synth(
        tmp_path_factory.mktemp("fst") / f"route{request.param}.fst",
        layers=5,
        experts=request.param,
        vocab=512,
        hidden=128,
        inter=64,
        **SMALL,
    )


def _inputs(d: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g) * torch.exp(torch.randn(T, 1, generator=g))  # rows of different scales
    return x, torch.randint(0, 512, (T,), generator=g)


@pytest.mark.parametrize("numerics", ["official", "reference"])
def test_route_c_equals_route(model_path, numerics):
    """`MoE.route_c` gives the expert ids and the weights' bits `MoE.route` gives, on every layer, for 1 to 16 rows
    and many inputs: each row's (id, weight) pairs in ascending id order, the reference's rows stably sorted by id."""
    with load(model_path, numerics=numerics, ram_budget=None) as eng:
        kinds = set()
        for moe in (b.ffn for b in eng.model.layers):
            assert moe.router is not None
            kinds.add(moe.is_hash)
            for T in (1, 2, 3, 4, 5, 6, 7, 8, 16):
                for seed in range(6):
                    x, ids = _inputs(moe.gate.in_features, T, seed=100 * T + seed + 7 * moe.layer)
                    want_idx, want = moe.route(x, ids)
                    order = torch.sort(want_idx, dim=-1, stable=True).indices  # by id; a repeated id in slot order
                    want_idx, want = want_idx.gather(1, order), want.gather(1, order)
                    for xa in (None, x.numpy()):  # x's array handed over (`MoE.__call__`): the router's product on it
                        idx, got = moe.route_c(x, ids, xa)
                        assert idx.dtype == np.int64 and got.dtype == np.float32
                        assert np.array_equal(idx, want_idx.numpy()), (moe.layer, T, seed)
                        assert np.array_equal(got.view(np.int32), want.numpy().view(np.int32)), (moe.layer, T, seed)
        assert kinds == {True, False}  # hash-routed and scored layers both checked


def _decode(eng, prompts: list[list[int]], n: int, batched: bool) -> list[torch.Tensor]:
    """Greedy decode of each prompt, the rows stepped together (`forward_rows`) or each alone: the logits."""
    states = [eng.new_state() for _ in prompts]
    last = [eng.prefill(p, s)[-1] for p, s in zip(prompts, states)]
    out = [torch.stack(last)]
    for _ in range(n):
        toks = [int(row.argmax()) for row in out[-1]]
        if batched:
            out.append(eng.model.forward_rows(toks, states).clone())
        else:
            out.append(torch.cat([eng.model.forward_rows([t], [s]).clone() for t, s in zip(toks, states)]))
    return out


@pytest.mark.parametrize("numerics", ["official", "reference"])
def test_decode_with_the_c_router_equals_the_torch_router(model_path, numerics):
    """Decode steps of 1 to 8 rows with the C router give the logits the torch router gives, and
    each batched row equals that sequence decoded alone (batch invariance), in both numerics."""
    prompts = [[5 + 7 * r, 17, 300 - r, 41, 9 + r][: 2 + r % 4] for r in range(8)]
    with load(model_path, numerics=numerics, ram_budget=None) as ref:
        for b in ref.model.layers:
            b.ffn.router = None
        want = {R: _decode(ref, prompts[:R], 4, batched=True) for R in (1, 3, 8)}
    with load(model_path, numerics=numerics, ram_budget=None) as eng:
        assert all(b.ffn.router is not None for b in eng.model.layers)
        for R in (1, 3, 8):
            got = _decode(eng, prompts[:R], 4, batched=True)
            for g, w in zip(got, want[R]):
                assert torch.equal(g, w), R
        solo = _decode(eng, prompts, 4, batched=False)
        for g, w in zip(solo, want[8]):
            assert torch.equal(g, w)


def test_torch_sums_short_rows_as_route_c():
    """On this torch the C weights take effect for every top-k up to `MAX_K` (Flash's is 6), and not past it."""
    assert all(route_fused.torch_sums_as_route_c(k) for k in range(1, route_fused.MAX_K + 1))
    assert not route_fused.torch_sums_as_route_c(route_fused.MAX_K + 1)


def test_route_weights_refuses_bad_inputs():
    ext = kernels.extension
    scores = np.ones((2, 8), np.float32)
    idx = np.zeros((2, 3), np.int64)
    out = np.empty((2, 3), np.float32)
    ext.route_weights(scores, idx, 0.0, 1.0, out)
    assert np.array_equal(out, np.full((2, 3), np.float32(1 / 3)))
    with pytest.raises(ValueError, match=r"idx\[1, 2\] = 8 is not an expert"):
        ext.route_weights(scores, np.array([[0, 1, 2], [3, 4, 8]], np.int64), 0.0, 1.0, out)
    with pytest.raises(ValueError, match="expected 1 to 7"):
        ext.route_weights(
            np.ones((2, 16), np.float32), np.zeros((2, 8), np.int64), 0.0, 1.0, np.empty((2, 8), np.float32)
        )
    with pytest.raises(ValueError, match="out"):
        ext.route_weights(scores, idx, 0.0, 1.0, np.empty((2, 4), np.float32))
    with pytest.raises(TypeError, match="idx"):
        ext.route_weights(scores, idx.astype(np.int32), 0.0, 1.0, out)
    table = np.arange(30, dtype=np.int64).reshape(10, 3) % 8
    ext.route_weights(scores, idx, 0.0, 1.0, out, np.array([2, 9], np.int64), table)
    assert np.array_equal(idx, table[[2, 9]])
    with pytest.raises(ValueError, match=r"ids\[1\] = 10 is outside the table's 10 tokens"):
        ext.route_weights(scores, idx, 0.0, 1.0, out, np.array([2, 10], np.int64), table)
    with pytest.raises(ValueError, match="both"):
        ext.route_weights(scores, idx, 0.0, 1.0, out, np.array([2, 9], np.int64))


def test_route_topk_picks_as_the_stable_descending_sort():
    """`route_weights` with a bias picks `ops.topk_ordered`'s experts in its order (the k largest of scores + bias,
    descending, a tie to the lower id, NaN above every number), on rows full of ties, NaNs and signed zeros, for every
    k it takes; and with softplus=True the scores it leaves are `ops.sqrtsoftplus`'s bits."""
    from fastar.model import ops

    ext = kernels.extension
    g = torch.Generator().manual_seed(5)
    for E in (7, 8, 16, 64, 256):
        for k in range(1, min(E, route_fused.MAX_K) + 1):
            scores = torch.randint(0, 4, (32, E), generator=g).float() * 0.5  # many ties
            scores[::3] = torch.randn(11, E, generator=g)
            scores[1, : E // 2] = float("nan")
            scores[2, ::2] = -0.0
            scores[2, 1::2] = 0.0
            bias = torch.randint(-1, 2, (E,), generator=g).float() * 0.25
            idx, out = np.empty((32, k), np.int64), np.empty((32, k), np.float32)
            ext.route_weights(scores.numpy(), idx, 0.0, 1.0, out, bias=bias.numpy())
            want = ops.topk_ordered(scores + bias, k)
            assert np.array_equal(idx, want.numpy()), (E, k)
            logits = torch.randn(4, E, generator=g) * 8
            got = logits.numpy().copy()
            ext.route_weights(got, idx[:4], 0.0, 1.0, out[:4], bias=bias.numpy(), softplus=True)
            assert np.array_equal(got.view(np.int32), ops.sqrtsoftplus(logits).numpy().view(np.int32)), (E, k)
            assert np.array_equal(idx[:4], ops.topk_ordered(ops.sqrtsoftplus(logits) + bias, k).numpy())


def test_route_weights_refuses_bad_bias():
    ext = kernels.extension
    scores, idx, out = np.ones((2, 8), np.float32), np.zeros((2, 3), np.int64), np.empty((2, 3), np.float32)
    with pytest.raises(ValueError, match="bias has 7 values, expected 8"):
        ext.route_weights(scores, idx, 0.0, 1.0, out, bias=np.zeros(7, np.float32))
    with pytest.raises(TypeError, match="bias must be float32"):
        ext.route_weights(scores, idx, 0.0, 1.0, out, bias=np.zeros(8, np.float64))
    with pytest.raises(ValueError, match="not both"):
        ext.route_weights(
            scores, idx, 0.0, 1.0, out, np.zeros(2, np.int64), np.zeros((4, 3), np.int64), np.zeros(8, np.float32)
        )
    with pytest.raises(ValueError, match="idx picks 3 experts of scores' 2"):
        ext.route_weights(np.ones((2, 2), np.float32), idx, 0.0, 1.0, out, bias=np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="scores must be writable"):
        ro = np.ones((2, 8), np.float32)
        ro.flags.writeable = False
        ext.route_weights(ro, idx, 0.0, 1.0, out, bias=np.zeros(8, np.float32), softplus=True)


def test_route_by_expert_orders_each_row_stably():
    """`route_weights(by_expert=True)`: each row's ids ascending with their weights beside them, a repeated id (a hash
    table may repeat one) in its slots' order; the weights themselves as without it (their total in table order)."""
    ext = kernels.extension
    g = torch.Generator().manual_seed(8)
    scores = (torch.rand(6, 16, generator=g) + 0.1).numpy()
    table = np.array([[5, 3, 5, 0, 9, 3], [1, 2, 3, 4, 5, 6], [15, 14, 13, 12, 11, 10]], np.int64)
    tok = np.array([0, 1, 2, 0, 2, 1], np.int64)
    plain_idx, plain = np.empty((6, 6), np.int64), np.empty((6, 6), np.float32)
    ext.route_weights(scores, plain_idx, 0.0, 1.5, plain, tok, table)
    idx, got = np.empty((6, 6), np.int64), np.empty((6, 6), np.float32)
    ext.route_weights(scores, idx, 0.0, 1.5, got, tok, table, by_expert=True)
    order = np.argsort(plain_idx, axis=1, kind="stable")
    assert np.array_equal(idx, np.take_along_axis(plain_idx, order, 1))
    assert np.array_equal(got.view(np.int32), np.take_along_axis(plain, order, 1).view(np.int32))
    assert list(idx[0]) == [0, 3, 3, 5, 5, 9] and got[0, 1] == plain[0, 1] and got[0, 3] == plain[0, 0]
