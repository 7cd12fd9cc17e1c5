"""What the batching tests (engine scheduler, drafting in it, the batch server) share: the skip for builds whose
kernels do not promise batch invariance, and seeded random prompts."""

from __future__ import annotations

import pytest
import torch


def needs_invariant_kernels():
    from fastar.quant import kernels, linear

    if linear._kernels() is None or kernels.get_isa() == "scalar":
        pytest.skip("batch invariance is a promise of the C kernels' SIMD dot path")


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(2, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
