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
