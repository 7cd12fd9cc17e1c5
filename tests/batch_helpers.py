"""What the batching tests (engine scheduler, drafting in it, the batch server) share: the skip for builds whose
kernels do not promise batch invariance, seeded random prompts, and a request run alone through `Engine.stream`
beside the check that two runs' chunks are equal."""

from __future__ import annotations

import pytest
import torch


def needs_invariant_kernels():
    from fastar.quant import kernels, linear

    if linear._kernels() is None or kernels.get_isa() == "scalar":
        pytest.skip("batch invariance is a promise of the C kernels' SIMD dot path")


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(2, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefilled(eng, ids):
    """A fresh decode state with `ids` prefilled (no logits kept)."""
    s = eng.model.new_state()
    eng.model.forward(ids, s, all_logits=False)
    return s


def solo(eng, ids, params):
    return list(eng.stream(ids, params, session=eng.open_session()))


def same_chunks(a, b):
    assert [c.token for c in a] == [c.token for c in b]
    assert [c.text for c in a] == [c.text for c in b]
    assert [c.logprob for c in a] == [c.logprob for c in b]
    assert [c.top_logprobs for c in a] == [c.top_logprobs for c in b]
    assert a[-1].finish_reason == b[-1].finish_reason and a[-1].usage == b[-1].usage
