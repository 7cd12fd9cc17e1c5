"""The lightning indexer's scores in C (csrc/attn_prefill.c) against their torch reference (ops.index_scores_torch):
equal within float32 rounding, the same visibility (-inf) pattern, and batch- and thread-invariant bit for bit."""

from __future__ import annotations

import pytest
import torch

from fastar.model import ops
from fastar.quant import kernels as K


def _case(T: int, E: int, Hi: int, Di: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, Hi, Di, generator=g), torch.randn(T, Hi, generator=g), torch.randn(E, Di, generator=g)


def _c_scores(q, w, keys, p0) -> torch.Tensor:
    if K.extension is None:
        pytest.skip("the C extension is not built")
    out = torch.empty(q.shape[0], keys.shape[0])
    if not K.extension.index_scores(q.numpy(), w.numpy(), keys.numpy(), p0, q.shape[-1] ** -0.5, out.numpy()):
        pytest.skip(f"no index-score kernel for ISA {K.extension.get_isa()} (AVX-512 only; torch runs elsewhere)")
    return out


@pytest.mark.parametrize(
    "T,E,Hi,Di,p0",
    [(1, 300, 64, 128, 1203), (40, 77, 16, 128, 160), (9, 33, 5, 20, 100), (3, 5, 3, 7, 0), (128, 1100, 64, 128, 4300)],
)
def test_c_index_scores_match_torch(T, E, Hi, Di, p0):
    q, w, keys = _case(T, E, Hi, Di, T + E)
    ref = ops.index_scores_torch(q, w, keys, p0)
    out = _c_scores(q, w, keys, p0)
    seen = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), seen) and (out[~seen] == float("-inf")).all()
    if seen.any():
        scale = ref[seen].abs().max()
        assert ((out[seen] - ref[seen]).abs() <= 1e-5 * scale).all()
    assert torch.equal(ops.index_scores(q, w, keys, p0), out)  # the model's entry point takes the C path


def test_c_index_scores_are_batch_and_thread_invariant():
    q, w, keys = _case(24, 130, 16, 64, 3)
    p0 = 500
    chunk = _c_scores(q, w, keys, p0)
    alone = torch.cat([_c_scores(q[t : t + 1], w[t : t + 1], keys, p0 + t) for t in range(24)])
    assert torch.equal(chunk, alone)
    before = K.extension.get_num_threads()
    try:
        K.extension.set_num_threads(1)
        assert torch.equal(_c_scores(q, w, keys, p0), chunk)
    finally:
        K.extension.set_num_threads(before)


def test_c_index_scores_reject_bad_shapes():
    q, w, keys = _case(4, 10, 3, 8, 0)
    if K.extension is None:
        pytest.skip("the C extension is not built")
    out = torch.empty(4, 10)
    with pytest.raises(ValueError, match="keys"):
        K.extension.index_scores(q.numpy(), w.numpy(), keys[:, :7].contiguous().numpy(), 0, 1.0, out.numpy())
    with pytest.raises(ValueError, match="out"):
        K.extension.index_scores(q.numpy(), w.numpy(), keys.numpy(), 0, 1.0, torch.empty(4, 9).numpy())


# --- the indexer's top-k (index_topk in C against index_topk_torch) ------------------------------------------


def _scores(T: int, E: int, p0: int, seed: int) -> torch.Tensor:
    """Random scores [T, E] with the visibility mask of queries at p0.. (-inf where not visible), as index_scores."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(T, E, generator=g)
    visible = torch.arange(p0 + 1, p0 + T + 1)[:, None] // 4
    return s.masked_fill(torch.arange(E)[None, :] >= visible, float("-inf"))


@pytest.mark.parametrize(
    "T,E,k,p0",
    [(1, 300, 64, 1203), (40, 700, 512, 2040), (128, 4000, 512, 15000), (9, 33, 5, 100), (3, 5, 4, 0), (7, 20, 20, 60)],
)
def test_c_index_topk_matches_torch(T, E, k, p0):
    if K.extension is None:
        pytest.skip("the C extension is not built")
    score = _scores(T, E, p0, T + E)
    ref = ops.index_topk_torch(score, p0, k)
    out = ops.index_topk(score, p0, k)
    assert out.dtype == torch.int64 and out.shape == (T, k)
    assert torch.equal(out, ref)
    for t in range(T):  # each row: ascending visible ids, then -1, and the picks hold the row's best scores
        row = out[t][out[t] >= 0]
        assert (row[1:] > row[:-1]).all() and (out[t][len(row) :] == -1).all()
        seen = min(E, (p0 + t + 1) // 4)
        assert len(row) == min(k, seen) and (row < seen).all()
        if len(row) < seen:
            rest = torch.ones(seen, dtype=torch.bool)
            rest[row] = False
            assert score[t, row].min() > score[t, :seen][rest].max()


def test_c_index_topk_breaks_ties_towards_the_lower_entry_and_is_batch_invariant():
    if K.extension is None:
        pytest.skip("the C extension is not built")
    score = torch.zeros(6, 40)  # all tied: the lowest ids win
    score[:, 30] = 1.0
    score[:, 5] = -0.0  # -0 ranks below +0
    out = ops.index_topk(score, 150, 4)
    assert out.tolist() == [[0, 1, 2, 30]] * 6
    s = _scores(50, 900, 3000, 1)
    chunk = ops.index_topk(s, 3000, 256)
    assert torch.equal(chunk, torch.cat([ops.index_topk(s[t : t + 1], 3000 + t, 256) for t in range(50)]))
    with pytest.raises(ValueError, match="index_topk needs"):
        K.extension.index_topk(s.numpy(), 0, torch.empty(49, 4, dtype=torch.int64).numpy())


@pytest.mark.parametrize("T,E,Hi,Di,p0", [(1, 300, 64, 128, 1203), (40, 77, 16, 128, 160), (128, 1100, 64, 128, 4300)])
def test_c_index_scores_on_fp4_rounded_inputs_match_torch_and_stay_batch_invariant(T, E, Hi, Di, p0):
    """Official numerics round index queries and keys to FP4 (bfloat16 values): the declared `fp4` path
    (vdpbf16ps where the CPU has AVX512_BF16) stays within the same bound of the torch reference."""
    q, w, keys = _case(T, E, Hi, Di, 7 * T + E)
    q, keys = ops.fp4_quant_sim(q, 32), ops.fp4_quant_sim(keys, 32)
    ref = ops.index_scores_torch(q, w, keys, p0)
    out = ops.index_scores(q, w, keys, p0, fp4=True)
    seen = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out), seen) and (out[~seen] == float("-inf")).all()
    assert ((out[seen] - ref[seen]).abs() <= 1e-5 * ref[seen].abs().max()).all()
    alone = torch.cat([ops.index_scores(q[t : t + 1], w[t : t + 1], keys, p0 + t, fp4=True) for t in range(T)])
    assert torch.equal(out, alone)


def test_c_index_scores_refuse_an_fp4_declaration_that_is_false():
    if K.extension is None:
        pytest.skip("the C extension is not built")
    q, w, keys = _case(4, 40, 3, 8, 0)
    with pytest.raises(ValueError, match="not all bfloat16"):
        K.extension.index_scores(q.numpy(), w.numpy(), keys.numpy(), 200, 1.0, torch.empty(4, 40).numpy(), True)


@pytest.mark.parametrize("T,E,Hi,p0", [(1, 300, 64, 1203), (1, 7500, 64, 30003), (3, 77, 16, 160), (2, 33, 5, 130)])
def test_index_scores_over_packed_keys_equal_the_decoded_ones(T, E, Hi, p0):
    """`index_scores_fp4` (keys as the decode state stores them, decoded inside the kernel) gives the bits of
    `index_scores(..., fp4=True)` over the decoded keys, a NaN block (a stored non-finite key) included; where it has
    no kernel (no vdpbf16ps) it says so (None) and the caller decodes."""
    from fastar.model.state import RowFormat

    fmt = RowFormat("fp4", 128)
    q, w, keys = _case(T, E, Hi, 128, 3 * T + E)
    # block scales over the whole UE8M0 range: 2^-126 (results below bfloat16's normals) to 2^125, most moderate
    mag = torch.cat(
        [torch.tensor([6 * 2.0**-126, 6 * 2.0**-118, 6 * 2.0**-110, 2.0**120, 2.0**127]), torch.logspace(-3, 3, E - 5)]
    )
    q, keys = ops.fp4_quant_sim(q, 32), ops.fp4_quant_sim(keys / keys.abs().amax(1, keepdim=True) * mag[:, None], 32)
    keys[E // 2, 40] = float("nan")
    rows = fmt.encode(keys)
    want = ops.index_scores(q, w, fmt.decode(rows), p0, fp4=True)
    got = ops.index_scores_fp4(q, w, rows, p0)
    if got is None:
        assert ops._C is None or "avx512bf16" not in K.cpu_features()["usable_isas"]
        return
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    K.set_isa("avx512")  # no vdpbf16ps: the packed kernel declines, the unpacked one runs
    try:
        assert ops.index_scores_fp4(q, w, rows, p0) is None
    finally:
        K.set_isa("auto")
    with pytest.raises(ValueError, match="rows"):
        K.extension.index_scores_fp4(q.numpy(), w.numpy(), rows[:, 1:].numpy(), p0, 1.0, torch.empty(T, E).numpy())
