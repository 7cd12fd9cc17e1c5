"""The MoE block's fused paths: `deepseek_v4.MoE`'s numbers bit for bit, in fewer Python, numpy and torch calls.

A decode step runs the MoE once per layer (43 times a token), and what runs between its kernels (the routed
experts' bookkeeping, the shared expert's wrappers) is paid every time; on a step that streams gigabytes of
weights that glue also runs from cold caches, so each call saved counts several times over.

Owns:
- `routed_sum`: a layer's routed experts as the provider yields them (`ExpertProvider.each_batch`: what is
  present, then what arrives), each batch in one fused kernel call (`experts_ffn`), summed in the fixed order of
  the expert ids: bit-identical to `expert_ffn` per expert followed by `index_add_` in that order, however the
  experts arrive.
- `shared_expert`: the shared expert (FP8 activation quantization, the stacked gate/up product, the clamped SwiGLU,
  quantization again, the down product) as five direct C calls on numpy arrays.
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


def routed_sum(
    x: torch.Tensor,
    routed: np.ndarray,
    wts: torch.Tensor,
    experts: ExpertProvider,
    layer: int,
    limit: float,
    act_block: int,
) -> torch.Tensor:
    """The routed experts' sum [T, D] for x [T, D] (float32, CPU, contiguous), routed [T, k] expert ids and wts
    [T, k] routing weights (float32), with the fused kernel (`kernels.extension` must be built; `act_block`: the
    FP8 activation block of the official numerics, 0 for none; the routing weight is applied before w2).

    Routes are grouped by expert in ascending id order (`np.unique`'s, the MoE's `wanted` order) and within an
    expert in row-major (token, slot) order (`np.nonzero`'s). When the provider's first batch holds every expert,
    one call adds each route's output into its token's row expert after expert, as `experts_ffn` does. Otherwise
    each batch runs as one call writing each route's output into a row of its own of a zeroed scratch (0 + y, what
    `expert_ffn` returns), and once all have arrived the scratch rows are added into the tokens' rows in route
    order (`np.add.at` adds unbuffered, index after index): per output element the same additions in the same
    order as the per-expert path's `index_add_`s."""
    ext = kernels.extension
    T, k = routed.shape
    flat = routed.reshape(-1)
    at = flat.argsort(kind="stable")  # the routes by expert, each expert's in row-major order
    by_expert = flat[at]
    starts = np.flatnonzero(np.concatenate(([True], by_expert[1:] != by_expert[:-1])))
    wanted = by_expert[starts].tolist()
    offsets = np.append(starts, len(flat))
    rows = at // k  # each route's token
    rw = np.ascontiguousarray(wts.numpy().reshape(-1)[at])  # each route's weight
    xn = x.numpy()
    out = np.zeros((T, xn.shape[1]), np.float32)
    scratch = xr = pos = None
    for batch in experts.each_batch(layer, wanted):
        if not batch:
            continue
        have = dict(batch)
        if scratch is None and len(have) == len(wanted):  # all at once: straight into out
            ext.experts_ffn(xn, [have[e] for e in wanted], rows, offsets, rw, float(limit), out, act_block)
            return torch.from_numpy(out)
        if scratch is None:
            xr = xn[rows]  # [M, D]: route j's input in row j, so its output gets row j of the scratch
            scratch = np.zeros_like(xr)
            pos = {e: i for i, e in enumerate(wanted)}
        idx = sorted(pos[e] for e in have)
        sel = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in idx])
        counts = offsets[1:][idx] - offsets[:-1][idx]
        ext.experts_ffn(
            xr,
            [have[wanted[i]] for i in idx],
            sel,
            np.concatenate(([0], np.cumsum(counts))),
            rw[sel],
            float(limit),
            scratch,
            act_block,
        )
    if scratch is not None:
        np.add.at(out, rows, scratch)
    return torch.from_numpy(out)


def shared_expert(x: torch.Tensor, up: Linear, down: Linear, limit: float, act_block: int) -> torch.Tensor | None:
    """`w2(act(limited_swiglu(*(w1|w3)(act(x)).chunk(2))))` for x [T, D]: `up` the stacked w1 and w3, `down` w2,
    `act` the FP8 block quantization when `act_block` > 0. The same C calls on the same arrays as
    `MoE.shared_reference`'s wrappers make (`ops.fp8_quant_sim`, `Linear.__call__`, `ops.limited_swiglu`), without
    the wrappers. None where those wrappers would not take their C paths (`ops` decides: no build, a tensor not
    float32 on the CPU, `ops.torch_only()`): the caller runs the reference."""
    arrays = ops.c_arrays(x)
    if arrays is None or x.dim() != 2:
        return None
    ext, xn = kernels.extension, arrays[0]
    if act_block:
        xq = np.empty_like(xn)
        ext.fp8_act_quant(xn, act_block, xq)
        xn = xq
    gu = up(torch.from_numpy(xn)).numpy()  # [T, 2I]: gate | up
    inter = gu.shape[1] // 2
    mid = np.empty((gu.shape[0], inter), np.float32)
    ext.swiglu(np.ascontiguousarray(gu[:, :inter]), np.ascontiguousarray(gu[:, inter:]), float(limit), mid)
    if act_block:
        ext.fp8_act_quant(mid, act_block, mid)
    return down(torch.from_numpy(mid))
