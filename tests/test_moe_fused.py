"""The MoE block's fused paths (`fastar.model.moe_fused`) against `deepseek_v4.MoE`'s reference paths, bit for bit:
the routed experts however they arrive (in one batch, one by one, in any split, read by the pager on a small
budget), on hash-routed and scored layers, in both numerics, and the shared expert."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from synth_widths import SMALL

from fastar.contracts import Unpaged
from fastar.engine.engine import load
from fastar.format.reader import FstFile
from fastar.model import moe_fused
from fastar.quant import kernels
from fastar.synth import synth

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not kernels.available(), reason="the fused paths need the C kernels"),
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """5 layers (3 hash-routed) + MTP, 8 experts of hidden 128 and inter 128, top-6: a `.fst`, so the shared
    expert's w1 and w3 stack and the pager can run it on a small budget."""
    return synth(
        tmp_path_factory.mktemp("fst") / "moe.fst", layers=5, experts=8, vocab=512, hidden=128, inter=128, **SMALL
    )


class Split(Unpaged):
    """Yields a layer's experts in the batches `split(ids)` gives (each a list of positions in ids)."""

    def __init__(self, base, split) -> None:
        self.base, self.split, self.batches = base, split, []

    def get(self, layer: int, expert: int):
        return self.base.get(layer, expert)

    def each_batch(self, layer, ids, *, scan=False):
        parts = self.split(list(ids))
        self.batches.append(len([p for p in parts if p]))
        for part in parts:
            yield [(ids[i], self.base.get(layer, ids[i])) for i in part]


SPLITS = {
    "one batch": lambda ids: [list(range(len(ids)))],
    "one by one": lambda ids: [[i] for i in range(len(ids))],
    "reversed, one by one": lambda ids: [[i] for i in reversed(range(len(ids)))],
    "empty first, then halves from the back": lambda ids: [
        [],
        list(range(len(ids) // 2, len(ids))),
        list(range(len(ids) // 2)),
    ],
    "odd then even": lambda ids: [list(range(1, len(ids), 2)), list(range(0, len(ids), 2))],
    "all but the first, then it": lambda ids: [list(range(1, len(ids))), [0]],
}


def _inputs(d: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, d, generator=g) * 2, torch.randint(0, 512, (T,), generator=g)


@pytest.mark.parametrize("numerics", ["official", "reference"])
def test_routed_sum_equals_expert_by_expert_in_any_split(model_path, numerics):
    """`routed_sum` with the experts arriving in every split above equals `MoE.routed_reference` run expert by
    expert (each its own batch: one `expert_ffn` each, `index_add_` in id order), for 1 to 16 tokens on hash-routed
    and scored layers; and `MoE.__call__` (fused) equals the reference paths end to end."""
    with load(model_path, numerics=numerics, ram_budget=None) as eng:
        base = eng.model.experts
        for moe in (b.ffn for b in eng.model.layers):
            assert moe.fused
            d = moe.gate.in_features
            for T in (1, 2, 4, 9, 16):  # 16 x 6 routes: past SMALL_ROUTES, grouped by numpy
                x, ids = _inputs(d, T, seed=T + 10 * moe.layer)
                idx, wts = moe.route(x, ids)
                moe.experts = Split(base, SPLITS["one by one"])
                want = moe.routed_reference(x, idx, wts)
                for name, split in SPLITS.items():
                    moe.experts = provider = Split(base, split)
                    got = moe_fused.routed_sum(x, idx.numpy(), wts, provider, moe.layer, moe.limit, moe.act_block)
                    assert torch.equal(torch.from_numpy(got), want), (moe.layer, moe.is_hash, T, name)
                    out = np.full((T, d), np.nan, np.float32)  # a reused buffer, whatever it held: zeroed first
                    args = (x.numpy(), idx.numpy(), wts, provider, moe.layer, moe.limit, moe.act_block, out)
                    assert moe_fused.routed_sum(*args) is out and torch.equal(torch.from_numpy(out), want)
                    # each row in ascending expert order (the C router's rows): the same sum, told so or not
                    order = torch.sort(idx, dim=-1, stable=True).indices
                    by_id = (x.numpy(), idx.gather(1, order).numpy(), wts.gather(1, order), provider, moe.layer)
                    for told in (True, False):
                        out.fill(np.nan)
                        moe_fused.routed_sum(*by_id, moe.limit, moe.act_block, out, by_expert=told)
                        assert torch.equal(torch.from_numpy(out), want), (moe.layer, T, name, told)
                moe.experts = Split(base, SPLITS["odd then even"])
                got = moe(x, ids).clone()  # (a decode step's rows come back in the layer's buffer)
                moe.experts = Split(base, SPLITS["one by one"])
                assert torch.equal(got, moe.routed_reference(x, idx, wts) + moe.shared_reference(x))
                if T <= 8:
                    assert moe(x, ids) is moe._rows_out(T)[0]  # the same registered buffer every call
            moe.experts = base


def test_routed_sum_with_a_token_routed_twice(model_path):
    """A hash table may route a token to one expert twice: both routes are summed in slot order, as the
    reference's `index_add_` with a repeated token does."""
    with load(model_path, ram_budget=None) as eng:
        moe, base = eng.model.layers[3].ffn, eng.model.experts
        x, _ = _inputs(moe.gate.in_features, 3, seed=5)
        idx = torch.tensor([[4, 4, 1, 7, 0, 2], [1, 3, 3, 3, 6, 5], [7, 6, 5, 4, 3, 2]])
        wts = torch.rand(idx.shape, generator=torch.Generator().manual_seed(1)) + 0.1
        moe.experts = Split(base, SPLITS["one by one"])
        want = moe.routed_reference(x, idx, wts)
        for name, split in SPLITS.items():
            got = moe_fused.routed_sum(x, idx.numpy(), wts, Split(base, split), moe.layer, moe.limit, moe.act_block)
            assert torch.equal(torch.from_numpy(got), want), name
        moe.experts = Split(base, SPLITS["one by one"])
        want = moe.routed_reference(x[:1], idx[:1], wts[:1])  # one token (a decode row) routed twice to expert 4
        for name, split in SPLITS.items():
            got = moe_fused.routed_sum(
                x[:1], idx[:1].numpy(), wts[:1], Split(base, split), moe.layer, moe.limit, moe.act_block
            )
            assert torch.equal(torch.from_numpy(got), want), name


@pytest.mark.parametrize("numerics", ["official", "reference"])
def test_shared_expert_equals_its_reference(model_path, numerics):
    """`SharedExpert` (one C call) against `MoE.shared_reference` (the ops and Linear wrappers), 1 to 9 rows;
    under `ops.torch_only()` it declines and the MoE takes the reference (whose torch SwiGLU rounds differently
    from the C one)."""
    from fastar.model import ops

    with load(model_path, numerics=numerics, ram_budget=None) as eng:
        for moe in (b.ffn for b in eng.model.layers):
            assert moe.shared_fused is not None
            for T in (1, 3, 9):
                x, _ = _inputs(moe.gate.in_features, T, seed=T)
                assert torch.equal(moe.shared_fused(x), moe.shared_reference(x)), (moe.layer, T)
                assert torch.equal(moe._shared(x), moe.shared_reference(x))
                routed = np.random.default_rng(T).standard_normal(x.shape).astype(np.float32)
                want = torch.from_numpy(routed) + moe.shared_reference(x)  # added into the routed sum: the same
                assert torch.equal(moe.shared_fused(x, routed.copy()), want)
                assert torch.equal(moe._shared(x, routed.copy()), want)
                assert torch.equal(moe._shared(x, routed.copy(), x.numpy()), want)  # x's array handed over
                with ops.torch_only():
                    assert moe.shared_fused(x) is None and moe.shared_fused(x, routed.copy()) is None
                    assert moe.shared_fused(x, routed.copy(), x.numpy()) is None
                    assert torch.equal(moe._shared(x), moe.shared_reference(x))
                    assert torch.equal(
                        moe._shared(x, routed.copy()), torch.from_numpy(routed) + moe.shared_reference(x)
                    )


def test_shared_ffn_refuses_bad_shapes(model_path):
    """The C entry names what is wrong instead of reading out of bounds."""
    with load(model_path, ram_budget=None) as eng:
        moe = eng.model.layers[0].ffn
        (w13, s13), (w2, s2) = moe.shared_fused.up, moe.shared_fused.down
        x = np.zeros((2, moe.gate.in_features), np.float32)
        ext = kernels.extension
        with pytest.raises(ValueError, match="w13 has shape"):
            ext.shared_ffn(x, w13[:-128], s13, w2, s2, 10.0, 128, np.zeros_like(x))
        with pytest.raises(ValueError, match="out has shape"):
            ext.shared_ffn(x, w13, s13, w2, s2, 10.0, 128, np.zeros((3, x.shape[1]), np.float32))
        with pytest.raises(ValueError, match="s2 has shape"):
            ext.shared_ffn(x, w13, s13, w2, s13, 10.0, 128, np.zeros_like(x))
        with pytest.raises(ValueError, match="act_block"):
            ext.shared_ffn(x, w13, s13, w2, s2, 10.0, -1, np.zeros_like(x))


@pytest.mark.parametrize("numerics", ["official", "reference"])
def test_decode_paged_on_a_small_budget_equals_the_reference(model_path, numerics):
    """Decoding with the pager on a budget of 8 of the 40 experts (each layer's experts arrive in several batches:
    what is resident, then each read) gives the logits the reference paths give with every expert mapped."""
    prompt = [5, 17, 300, 41, 9, 77]
    with load(model_path, numerics=numerics, ram_budget=None) as ref:
        for b in ref.model.layers:
            b.ffn.fused = False
            b.ffn._shared = b.ffn.shared_reference
        want = _decode(ref, prompt, 6)
    with FstFile(model_path) as f:
        budget = 8 * f.expert_stride
    with load(model_path, numerics=numerics, ram_budget=budget) as eng:
        cache = eng.expert_cache
        assert cache is not None and cache.n_slots == 8
        counts = []
        for b in eng.model.layers:
            b.ffn.experts = Counting(cache, counts)
        got = _decode(eng, prompt, 6)
    assert max(counts) > 1  # some layer's experts did come in several batches
    for g, w in zip(got, want):
        assert torch.equal(g, w)


class Counting:
    """The pager, counting the non-empty batches each `each_batch` yields."""

    def __init__(self, cache, counts: list[int]) -> None:
        self.cache, self.counts = cache, counts

    def each_batch(self, layer, ids, *, scan=False):
        n = 0
        for batch in self.cache.each_batch(layer, ids, scan=scan):
            n += bool(batch)
            yield batch
        self.counts.append(n)


def _decode(eng, prompt: list[int], n: int) -> list[torch.Tensor]:
    state = eng.new_state()
    logits = eng.prefill(prompt, state)
    out = [logits[-1].clone()]
    for _ in range(n):
        tok = int(out[-1].argmax())
        out.append(eng.model.forward_rows([tok], [state])[0].clone())
    return out


@pytest.mark.parametrize("numerics", ["official", "reference"])
def test_route_equals_its_formula(model_path, numerics):
    """`MoE.route` (normalized and scaled in place) equals the routing formula written out op by op, on the hash and
    the scored layers, for 1 to 9 tokens."""
    from fastar.model import ops

    with load(model_path, numerics=numerics, ram_budget=None) as eng:
        for moe in (b.ffn for b in eng.model.layers):
            for T in (1, 4, 9):
                x, ids = _inputs(moe.gate.in_features, T, seed=3 * T)
                scores = ops.per_token(ops.sqrtsoftplus, moe.gate(x))
                if moe.is_hash:
                    want_idx = moe.tid2eid[ids]
                else:
                    # the k largest in descending order, ties to the lower id: a stable descending sort's first k
                    order = torch.sort(scores + moe.bias, dim=-1, descending=True, stable=True).indices
                    want_idx = order[:, : moe.topk]
                wts = scores.gather(1, want_idx)
                wts = wts / (wts.sum(dim=-1, keepdim=True) + (0.0 if numerics == "official" else 1e-20))
                idx, got = moe.route(x, ids)
                assert torch.equal(idx, want_idx) and torch.equal(got, wts * moe.scale), (moe.layer, T)


def test_router_scores_equal_token_by_token():
    """`router_scores` on a decode step's rows at once (E a multiple of 64) equals `ops.per_token`'s row by row,
    for values across softplus's range (its threshold of 20, large negatives, tiny ones, +-0, inf and NaN)."""
    from fastar.model import ops

    g = torch.Generator().manual_seed(7)
    special = torch.tensor([0.0, -0.0, 20.0, 19.999, 20.001, -90.0, -104.0, 1e-30, float("inf"), float("-inf")])
    for E in (16, 32, 64, 128, 256):
        for T in range(1, 9):
            logits = torch.randn(T, E, generator=g) * torch.tensor([0.1, 3.0, 30.0])[torch.arange(E) % 3]
            logits.view(-1)[: len(special)] = special[: T * E]
            logits[0, -1] = float("nan")
            want = ops.per_token(ops.sqrtsoftplus, logits)
            got = moe_fused.router_scores(logits)
            assert torch.equal(got.isnan(), want.isnan()), (E, T)
            assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want)), (E, T)


def test_lookahead_guess_through_the_c_router_picks_the_torch_guess(model_path):
    """`MoE.guess` handed x's array (the C router on the newest row, one call) picks the experts the torch guess picks,
    for 1 and several rows; the hash-routed layers guess nothing either way."""
    with load(model_path, ram_budget=None) as eng:
        scored = [b.ffn for b in eng.model.layers if not b.ffn.is_hash]
        assert scored and all(m.router is not None for m in scored)
        for m in eng.model.layers[0].ffn, *scored:
            for T in (1, 3):
                x, _ = _inputs(m.gate.in_features, T, seed=10 * m.layer + T)
                got, want = m.guess(x, x.numpy()), m.guess(x)
                assert sorted(got) == sorted(want) and len(got) == (0 if m.is_hash else m.topk), (m.layer, T)
