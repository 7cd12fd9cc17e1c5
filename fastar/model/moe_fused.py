"""The MoE block's fused paths: `deepseek_v4.MoE`'s numbers bit for bit, in fewer Python, numpy and torch calls.

A decode step runs the MoE once per layer (43 times a token), and what runs between its kernels (the routed
experts' bookkeeping, the shared expert's wrappers) is paid every time; on a step that streams gigabytes of
weights that glue also runs from cold caches, so each call saved counts several times over.

Owns:
- `router_scores`: the router's sqrt(softplus) scores of a decode step's rows in one call where that gives each
  row's bits (the torch reference's path; the C router computes its scores inside its one call, `route_fused`).
- `routed_sum`: a layer's routed experts as the provider yields them (`ExpertProvider.each_batch`: what is
  present, then what arrives), each batch in one fused kernel call (`experts_ffn`), summed in the fixed order of
  the expert ids: bit-identical to `expert_ffn` per expert followed by `index_add_` in that order, however the
  experts arrive.
- `SharedExpert`: the shared expert (FP8 activation rounding, the stacked gate/up product, the clamped SwiGLU,
  rounding again, the down product) as one C call (`shared_ffn`, fastar/quant/csrc/experts.c).
Does not own: the MoE's math and its reference paths (`deepseek_v4.MoE`: the per-expert loop and `_shared`, which
these are tested against, tests/test_moe_fused.py), the kernels (`fastar.quant.kernels`), paging
(`fastar.weights`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..contracts import ExpertProvider
from ..quant import kernels
from ..quant.linear import Linear
from . import ops


def router_scores(logits: torch.Tensor) -> torch.Tensor:
    """`ops.per_token(ops.sqrtsoftplus, logits)` for router logits [T, E], in one call over all T rows where that gives
    each row's bits: always on the C path (each value on its own), and on torch's where E is a multiple of 64.
    `per_token` runs a decode step's rows one by one because torch's elementwise loops take 2 vectors at a time and
    leave the tail to other code, which rounds softplus differently, so which values take which path would depend on
    the chunk's shape; with E a multiple of 64 (2 vectors of up to 32 floats) every value takes the vector path both
    ways (tests/test_moe_fused.py compares the two)."""
    if logits.dim() == 2 and (logits.shape[1] % 64 == 0 or ops.c_arrays(logits) is not None):
        return ops.sqrtsoftplus(logits)
    return ops.per_token(ops.sqrtsoftplus, logits)


SMALL_ROUTES = 64  # routes (tokens x k) up to which `routed_sum` groups them in Python rather than numpy


def routed_sum(
    x: torch.Tensor | np.ndarray,
    routed: np.ndarray,
    wts: torch.Tensor | np.ndarray,
    experts: ExpertProvider,
    layer: int,
    limit: float,
    act_block: int,
    out: np.ndarray | None = None,
    by_expert: bool = False,
) -> np.ndarray:
    """The routed experts' sum [T, D] (numpy; into `out` where given, float32 [T, D], zeroed first) for x [T, D]
    (float32, CPU, contiguous; a tensor or its array), routed [T, k] expert ids and wts [T, k] routing weights
    (float32, a tensor or numpy), with the fused kernel (`kernels.extension` must be built; `act_block`: the FP8
    activation block of the official numerics, 0 for none; the routing weight is applied before w2). `by_expert`:
    each row of `routed` is in ascending expert order already (`route_fused.FusedRouter`'s rows), so a lone token's
    routes need no sorting.

    Routes are grouped by expert in ascending id order (`np.unique`'s, the MoE's `wanted` order) and within an
    expert in row-major (token, slot) order (`np.nonzero`'s). When the provider's first batch holds every expert,
    one call adds each route's output into its token's row expert after expert, as `experts_ffn` does. Otherwise
    each batch runs as one call writing each route's output into a row of its own of a zeroed scratch (0 + y, what
    `expert_ffn` returns), and once all have arrived the scratch rows are added into the tokens' rows in route
    order, one row after another (for one token one `np.add.reduce` over the scratch from 0, which adds its rows in
    that order): per output element the same additions in the same order as the per-expert path's `index_add_`s."""
    ext = kernels.extension
    T, k = routed.shape
    wn = wts if isinstance(wts, np.ndarray) else wts.numpy()  # `route_fused` gives numpy, `MoE.route` a tensor
    one = routed[0].tolist() if T == 1 else None
    if one is not None and by_expert and len(set(one)) == k:  # a decode row, k distinct experts, in order
        wanted, (rows, offsets), rw = one, _one_token(k), wn[0]
    elif one is not None and len(set(one)) == k:  # a decode row, k distinct experts: in Python, on k numbers
        at = sorted(range(k), key=one.__getitem__)  # its slots by expert id
        wanted = [one[j] for j in at]
        rows, offsets = _one_token(k)
        rw = wn[0, at]
    elif T * k <= SMALL_ROUTES:  # a decode step's rows: grouped in Python, a few numpy calls fewer
        flat = routed.reshape(-1).tolist()
        at = sorted(range(len(flat)), key=flat.__getitem__)  # stable, as argsort(kind="stable") below
        wanted, starts = [], []
        for j, a in enumerate(at):
            if not wanted or flat[a] != wanted[-1]:
                wanted.append(flat[a])
                starts.append(j)
        offsets = np.array([*starts, len(at)], np.int64)
        rows = np.array([a // k for a in at], np.int64)
        rw = wn.reshape(-1)[at]
    else:
        flat = routed.reshape(-1)
        at = flat.argsort(kind="stable")  # the routes by expert, each expert's in row-major order
        by_expert = flat[at]
        starts = np.flatnonzero(np.concatenate(([True], by_expert[1:] != by_expert[:-1])))
        wanted = by_expert[starts].tolist()
        offsets = np.append(starts, len(flat))
        rows = at // k  # each route's token
        rw = np.ascontiguousarray(wn.reshape(-1)[at])  # each route's weight
    xn = x if isinstance(x, np.ndarray) else x.numpy()
    if out is None:
        out = np.empty((T, xn.shape[1]), np.float32)
    scratch = xr = pos = None
    for batch in experts.each_batch(layer, wanted):
        if not batch:
            continue
        have = dict(batch)
        if scratch is None and len(have) == len(wanted):  # all at once: straight into out, zeroed by the call (zero)
            ext.experts_ffn(xn, [have[e] for e in wanted], rows, offsets, rw, float(limit), out, act_block, True)
            return out
        if scratch is None:
            xr = xn[rows]  # [M, D]: route j's input in row j, so its output gets row j of the scratch
            scratch = np.zeros_like(xr)
            pos = {e: i for i, e in enumerate(wanted)}
        idx = sorted(pos[e] for e in have)
        if len(wanted) == len(rw):  # one route per expert (a decode row): route i is expert i's
            sel, offs = np.array(idx, np.int64), _one_token(len(idx))[1]
        else:
            sel = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in idx])
            counts = offsets[1:][idx] - offsets[:-1][idx]
            offs = np.concatenate(([0], np.cumsum(counts)))
        ext.experts_ffn(xr, [have[wanted[i]] for i in idx], sel, offs, rw[sel], float(limit), scratch, act_block)
    if scratch is not None and T == 1:  # every route's token is row 0: 0 + y0 + y1 + ... in route order, one call
        np.add.reduce(scratch, axis=0, out=out[0], initial=0.0)  # (a row after another, as the loop below)
        return out
    out.fill(0.0)
    if scratch is not None:
        for r, y in zip(rows.tolist(), scratch):  # in route order (np.add.at would too, ~50x slower)
            out[r] += y
    return out


_ONE_TOKEN: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _one_token(k: int) -> tuple[np.ndarray, np.ndarray]:
    """The routes' tokens (all 0) and the experts' offsets (one route each) of one token routed to k distinct
    experts: the same for every call, made once (read-only)."""
    got = _ONE_TOKEN.get(k)
    if got is None:
        got = np.zeros(k, np.int64), np.arange(k + 1, dtype=np.int64)
        for a in got:
            a.flags.writeable = False
        _ONE_TOKEN[k] = got
    return got


class SharedExpert:
    """A layer's shared expert as one C call (`kernels.extension.shared_ffn`): FP8 activation rounding of x, the
    stacked gate/up product, the clamped SwiGLU, rounding again, the down product; the same C routines on the same
    values as `MoE.shared_reference`'s wrappers call one by one (`ops.fp8_quant_sim`, `Linear.__call__`,
    `ops.limited_swiglu`), so the same bits."""

    def __init__(self, up: tuple, down: tuple, limit: float, act_block: int) -> None:
        self.up, self.down, self.limit, self.act_block = up, down, float(limit), act_block

    @classmethod
    def build(cls, up: Linear | None, down: Linear, limit: float, act_block: int) -> SharedExpert | None:
        """Over `up` (w1 and w3 stacked by rows) and `down` (w2), or None where either has no C product."""
        ops_up = None if up is None else up.kernel_operands()
        ops_down = down.kernel_operands()
        if ops_up is None or ops_down is None:
            return None
        return cls(ops_up, ops_down, limit, act_block)

    def __call__(
        self,
        x: torch.Tensor,
        into: np.ndarray | None = None,
        xa: np.ndarray | None = None,
        result: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The shared expert's output [T, D] for x [T, D]; with `into` (float32 [T, D], the routed experts' sum) added
        into it instead (`into + output`, element by element) and returned as a tensor. None, having done nothing,
        where the reference's wrappers would not take their C paths (`ops.c_arrays` decides: no build, a tensor not
        float32 on the CPU, `ops.torch_only()`). `xa`: x's array (float32, C-contiguous, 2-D) where the caller has
        made it (`MoE.__call__`): only the scope is checked then. `result`: a tensor over `into` to return instead of
        a new one (a registered buffer, `ops.buffer_tensor`)."""
        if xa is not None:
            args = [xa] if ops.c_enabled() else None
        else:
            args = ops.c_arrays(x) if x.dim() == 2 else None
        if args is None:
            return None
        out = np.empty(args[0].shape, np.float32) if into is None else into
        (w13, s13), (w2, s2) = self.up, self.down
        kernels.extension.shared_ffn(args[0], w13, s13, w2, s2, self.limit, self.act_block, out, into is not None)
        return result if result is not None and into is not None else torch.from_numpy(out)
