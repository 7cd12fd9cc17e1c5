"""The MoE router in one C call after its product: `deepseek_v4.MoE.route`'s numbers bit for bit, as numpy arrays.

A decode step routes once per layer, and on a step that streams gigabytes of weights every op between the kernels
runs from cold caches (a torch op then costs tens of microseconds, not one or two: the reference's softplus and
square root alone took ~150 us a layer). The reference `MoE.route` runs eight ops after the router's product; here
they are one C call (`route_weights` with `softplus=True`, fastar/quant/csrc/route.c): the scores (the same C
routine `ops.sqrtsoftplus` calls), the top-k of a scored layer (`ops.topk_ordered`'s order and ties) or the hash
table's lookup, the gather of the picked scores, their total, the division and the scaling, the same float32
operations in the same order.

Owns: `FusedRouter`, built once per MoE layer over its router weights.
Does not own: the routing math and its reference (`deepseek_v4.MoE.route`, tests/test_route_fused.py compares
the two), the scores' function (`ops.sqrtsoftplus`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..quant import kernels
from ..quant.linear import Linear
from . import ops

MAX_K = 7  # route.c's ROUTE_MAX_K: torch sums rows shorter than 8 values in the order route.c reproduces


@functools.cache
def torch_sums_as_route_c(k: int) -> bool:
    """Whether this torch sums a row of k float32 values (`sum(dim=-1)` of a [T, k] tensor) in the order route.c
    follows: checked once per k on random rows against the C call, whose weights differ in their last bits from
    torch's wherever the order differs (a torch whose reduction changed then keeps the reference path)."""
    if kernels.extension is None or not 1 <= k <= MAX_K:
        return False
    g = torch.Generator().manual_seed(k)
    scores = (torch.rand(256, 4 * k, generator=g) * torch.exp(torch.randn(256, 4 * k, generator=g) * 4)).contiguous()
    idx = torch.stack([torch.randperm(4 * k, generator=g)[:k] for _ in range(256)])
    w = scores.gather(1, idx)
    want = w.div_(w.sum(dim=-1, keepdim=True)).mul_(1.5)
    got = np.empty((256, k), np.float32)
    kernels.extension.route_weights(scores.numpy(), idx.numpy(), 0.0, 1.5, got)
    return bool(np.array_equal(got.view(np.int32), want.numpy().view(np.int32)))


class FusedRouter:
    """A MoE layer's router (`MoE.route`) with its weights bound once: -> (expert ids [T, k] int64, routing weights
    [T, k] float32) as numpy arrays, the bits `MoE.route` returns as tensors, each row's (id, weight) pairs in
    ascending id order (a stable sort, after the weights' total took them in the reference's order): what
    `moe_fused.routed_sum(by_expert=True)` takes, which groups the routes by expert either way."""

    def __init__(
        self, gate: Linear, bias: torch.Tensor | None, table: torch.Tensor | None, k: int, scale: float, eps: float
    ) -> None:
        self.gate, self.k, self.scale, self.eps = gate, k, float(scale), float(eps)
        self.bias = None if bias is None else np.ascontiguousarray(bias.numpy(), np.float32)  # [E]
        self.table = None if table is None else np.ascontiguousarray(table.numpy(), np.int64)  # [V, k]
        w, s = gate.kernel_operands() or (None, None)
        self.gate_w = w if s is None else None  # the BF16 router weight's bits (an FP8 router: through `gate`)
        self._logits: dict[int, np.ndarray] = {}  # the product's rows by row count, made the scores in place
        self._outs: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # (ids, weights) by row count: see `__call__`

    @classmethod
    def build(
        cls, gate: Linear, bias: torch.Tensor | None, table: torch.Tensor | None, k: int, scale: float, official: bool
    ) -> FusedRouter | None:
        """Over a layer's router (`bias` for a scored layer, `table` [V, k] for a hash-routed one), or None where the
        C call does not give the reference's bits (no build, k past `MAX_K` or torch summing otherwise, a bias not
        float32) or the weights are not on the CPU. `official`: DeepSeek's routing (no 1e-20 added to the total)."""
        on_cpu = all(t is None or t.is_cpu for t in (bias, table))
        if bias is not None and bias.dtype is not torch.float32:
            return None
        if not (on_cpu and gate.kernel_operands() is not None and torch_sums_as_route_c(k)):
            return None
        return cls(gate, bias, table, k, scale, 0.0 if official else 1e-20)

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, xa: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """`MoE.route(x, ids)` for x [T, d] (float32, CPU) and the tokens ids [T], as numpy arrays; None where the
        ops would take their torch paths (`ops.c_arrays` decides), the caller then routes in torch. `xa`: x's array
        (float32, C-contiguous) where the caller has made it: the router's product then runs on it directly (the
        C call `Linear`'s product makes, `Linear.kernel_operands`: the same bits). The arrays are this layer's, one
        pair per row count, valid until it routes that many rows again (the MoE consumes them at once)."""
        if not ops.c_enabled() or (xa is None and (x.dtype is not torch.float32 or not x.is_cpu)):
            return None
        T = x.shape[0] if xa is None else xa.shape[0]
        if xa is not None and self.gate_w is not None:
            scores = self._logits.get(T)
            if scores is None:
                scores = self._logits[T] = np.empty((T, self.gate_w.shape[0]), np.float32)
            kernels.extension.bf16_matmul(xa, self.gate_w, scores)
        else:
            scores = self.gate(x).numpy()  # [T, E]: a new array of the product's, made the scores in place below
        outs = self._outs.get(T)
        if outs is None:
            outs = self._outs[T] = (np.empty((T, self.k), np.int64), np.empty((T, self.k), np.float32))
        idx, wts = outs
        ext = kernels.extension
        if self.table is not None:
            tok = np.ascontiguousarray(ids.numpy(), np.int64)  # no copy for a step's int64 ids
            # positional (ids, table, bias, softplus, by_expert): no keyword dict to build and parse per layer
            ext.route_weights(scores, idx, self.eps, self.scale, wts, tok, self.table, None, True, True)
        else:  # the bias is for the selection only, as in the reference
            ext.route_weights(scores, idx, self.eps, self.scale, wts, None, None, self.bias, True, True)
        return outs
