"""The mHC collapse with its constant operands bound once: `ops.hc_pre`'s C call, bit for bit, in fewer Python calls.

A decode step runs the collapse twice per layer (86 times a token on Flash), and from the cold caches a step leaves
each tensor-to-array conversion and allocation costs microseconds: `ops.hc_pre` checks and converts its five tensors
on every call and allocates its outputs as tensors. Here the site's weights (fn, base, scale and the sub-layer's norm)
are converted once, the outputs are numpy arrays handed back as tensors, and the same C call runs on the same
values, so the same bits (tests/test_hc_fused.py).

Owns: `FusedHC`, one per `HyperConnection` site.
Does not own: the math and its references (`ops.hc_pre`, `ops.hc_pre_torch`, `deepseek_v4.HyperConnection`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..quant import kernels
from . import ops


class FusedHC:
    """One mHC site's `ops.hc_pre(X, fn, base, scale, iters, hc_eps, eps, norm)` with fn, base and scale bound."""

    def __init__(
        self, fn: np.ndarray, base: np.ndarray, scale: np.ndarray, n: int, iters: int, hc_eps: float, eps: float
    ) -> None:
        self.fn, self.base, self.scale, self.n = fn, base, scale, n
        self.iters, self.hc_eps, self.eps = iters, float(hc_eps), float(eps)
        self.norms: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # id -> (the norm weight, kept alive; its array)

    @classmethod
    def build(
        cls, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, hc_eps: float, eps: float
    ) -> FusedHC | None:
        """Over a site's weights (fn [(2+n) n, n d], base [(2+n) n], scale [3]), or None where `ops.hc_pre` would not
        take its C path with them (no build, weights not float32 on the CPU, more than 16 streams, no Sinkhorn
        iteration)."""
        arrays = ops.c_arrays(fn, base, scale)
        R = (2 + n) * n
        if arrays is None or not 1 <= n <= 16 or iters < 1 or base.shape != (R,) or scale.shape != (3,):
            return None
        if fn.dim() != 2 or fn.shape[0] != R or fn.shape[1] % n:
            return None
        return cls(*arrays, n, iters, hc_eps, eps)

    def _norm(self, norm: torch.Tensor) -> np.ndarray | None:
        got = self.norms.get(id(norm))
        if got is None or got[0] is not norm:
            arrays = ops.c_arrays(norm)
            if arrays is None:
                return None
            got = self.norms[id(norm)] = (norm, arrays[0])
        return got[1]

    def pre(self, X: torch.Tensor, norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`ops.hc_pre(X, fn, base, scale, iters, hc_eps, eps, norm)` for streams X [T, n, d] -> (rms_norm(u, norm)
        [T, d], post [T, n], comb [T, n, n]), or None where it would take its torch path."""
        T, n, d = X.shape
        if not ops.c_enabled() or X.dtype is not torch.float32 or not X.is_cpu or n != self.n or X.requires_grad:
            return None
        if n * d != self.fn.shape[1] or norm.shape != (d,) or not T:
            return None
        na = self._norm(norm)
        if na is None:
            return None
        x = (X if X.is_contiguous() else X.contiguous()).numpy()
        u, post, comb = np.empty((T, d), np.float32), np.empty((T, n), np.float32), np.empty((T, n, n), np.float32)
        kernels.extension.hc_pre(
            x.reshape(T, n * d), self.fn, self.base, self.scale, n, self.iters, self.hc_eps, self.eps, u, post,
            comb.reshape(T, n * n), norm=na, norm_eps=self.eps,
        )  # fmt: skip
        return torch.from_numpy(u), torch.from_numpy(post), torch.from_numpy(comb)
