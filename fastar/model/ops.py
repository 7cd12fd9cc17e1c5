"""Small pure tensor functions shared by the DeepSeek-V4 model and its tests.

Owns: RMSNorm, the router score, RoPE/YaRN frequencies and (inverse) interleaved RoPE, attention's C call, the mHC
collapse, mix back and Sinkhorn projection, the Walsh-Hadamard transform, the activation quantization simulations of
DeepSeek's inference code (FP8 e4m3 and FP4 e2m1 with power-of-two scales), the clamped SwiGLU, and how small chunks
are split for batch invariance (`SMALL_CHUNK`, `token_slices`, `per_token`). Every function is stateless and works
on float32 torch tensors; each math function has a closed-form test in tests/test_model_ops.py (the batch-invariance
helpers are tested through the model, tests/test_model.py; the mHC's C twins against their torch references in
tests/test_mhc.py).
Does not own: weights or weight formats (`fastar.quant`), model structure (`fastar.model.deepseek_v4`).
"""

from __future__ import annotations

import contextlib
import math
import threading

import numpy as np
import torch
import torch.nn.functional as F

from ..quant.kernels import extension as _C  # fast twins of the `..._torch` functions below (None: not built)

FP8_MAX = 448.0
FP4_MAX = 6.0

_scope = threading.local()  # `torch_only()`: this thread's ops take their torch paths
_open_scopes = [0]  # `torch_only()` scopes open in any thread: while none is (the usual case), no thread-local lookup
_scopes_lock = threading.Lock()


@contextlib.contextmanager
def torch_only():
    """Within it, this thread's ops run their `..._torch` references even on CPU tensors (the C twins are skipped):
    the accelerator tier's `torch:cpu` mode runs on the CPU exactly the torch code a CUDA device runs."""
    before = getattr(_scope, "torch_only", False)
    _scope.torch_only = True
    with _scopes_lock:
        _open_scopes[0] += 1
    try:
        yield
    finally:
        _scope.torch_only = before
        with _scopes_lock:
            _open_scopes[0] -= 1


# --- norms and activations ----------------------------------------------------------------------------------


def c_enabled() -> bool:
    """Whether this thread's ops take their C paths: the extension is built and no `torch_only()` scope is open here
    (what `c_arrays` checks first, for a caller that hands the C calls arrays of its own)."""
    return _C is not None and not (_open_scopes[0] and getattr(_scope, "torch_only", False))


# Tensors over arrays of their owner's, made once and kept (a decode step's buffers) -> (the tensor, its array):
# `c_arrays` hands their arrays back without a check or a conversion (id(t) cannot be reused: the entry holds t).
_BUFFERS: dict[int, tuple[torch.Tensor, np.ndarray]] = {}


def buffer_tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor over a float32 C-contiguous array that its owner keeps for the process's life (a buffer reused by
    every decode step), registered for `c_arrays`: from the cold caches a step leaves, checking and converting a
    tensor costs tens of microseconds, and a step hands the same buffers to several C calls. The owner must keep
    the array's shape and never hand the tensor to autograd."""
    if a.dtype != np.float32 or not a.flags.c_contiguous or not a.size:
        raise ValueError(f"buffer_tensor takes a non-empty float32 C-contiguous array, got {a.dtype} {a.shape}")
    t = torch.from_numpy(a)
    _BUFFERS[id(t)] = (t, a)
    return t


def buffer_array(t: torch.Tensor) -> np.ndarray | None:
    """A `buffer_tensor`'s array (None for any other tensor), whatever the scope: for a caller whose C path does not
    depend on `c_enabled` and would check the tensor's dtype, device and layout itself."""
    known = _BUFFERS.get(id(t))
    return known[1] if known is not None and known[0] is t else None


def forget_buffer(t: torch.Tensor) -> None:
    """Takes a `buffer_tensor` off the register (its owner replaces it): `c_arrays` then checks it as any tensor."""
    known = _BUFFERS.get(id(t))
    if known is not None and known[0] is t:
        del _BUFFERS[id(t)]


def c_arrays(*ts: torch.Tensor) -> list | None:
    """Row-major numpy views of the tensors for the C extension (a copy only where one is not contiguous), or None
    when it cannot take them (not built; not float32 on the CPU; autograd; empty). The C calls reshape on the numpy
    side: a few microseconds less per call than torch views, which is most of a small op's cost at decode. A
    `buffer_tensor`'s array comes back as registered."""
    if not c_enabled():
        return None
    out = []
    for t in ts:
        known = _BUFFERS.get(id(t))
        if known is not None and known[0] is t:
            out.append(known[1])
            continue
        if t.dtype is not torch.float32 or not t.is_cpu or t.requires_grad or not t.dim() or not t.numel():
            return None
        out.append(t.numpy() if t.is_contiguous() else t.contiguous().numpy())
    return out


def _rows(a):
    """A numpy array as [rows, last dim]."""
    return a.reshape(-1, a.shape[-1])


def _like(a, shape) -> tuple:
    """A new float32 array shaped as the numpy array `a`, and the torch tensor over it shaped `shape`."""
    o = np.empty(a.shape, np.float32)
    return o, torch.from_numpy(o.reshape(shape))


def _into(x: torch.Tensor, a, overwrite: bool) -> tuple:
    """Where a row op of x (`a`: its `c_arrays` view) writes: x's own memory when the caller may lose x
    (`overwrite`) and `a` is that memory (x contiguous: no copy was made), else a new array (`_like`). At a
    512-token chunk a query's [T, H, D] is 67 MB: a new one per op was written, and read, in full."""
    if overwrite and x.is_contiguous() and a.ctypes.data == x.data_ptr():
        return _rows(a), x
    return _like(_rows(a), x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, overwrite: bool = False) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dim, in float32; `weight=None` is the weightless norm.
    In the C extension when built (one call; per row in a fixed order; equal to `rms_norm_torch` within float32
    rounding, tested). `overwrite`: the caller needs only the result, so x's memory may hold it (`_into`)."""
    args = c_arrays(x) if weight is None else c_arrays(x, weight)
    if args is not None and (weight is None or weight.shape == x.shape[-1:]):
        o, out = _into(x, args[0], overwrite)
        _C.rms_norm(_rows(args[0]), None if weight is None else args[1], float(eps), o)
        return out
    return rms_norm_torch(x, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`rms_norm` in torch: the reference the C version is tested against."""
    x = x.float()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else weight * y


def sqrtsoftplus(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's router score `sqrt(softplus(x))`. In the C extension when built: each value on its own through the
    C library's expf, log1pf and sqrtf, as torch's scalar code writes softplus (`x > 20 ? x : log1p(exp(x))`), so the
    same bits whatever the batch; torch's SIMD path (Sleef) differs from it by up to 1 ulp, and flushes results below
    ~1e-45 to 0 (tested against `sqrtsoftplus_torch`)."""
    args = c_arrays(x)
    if args is not None:
        o, out = _like(args[0], x.shape)
        _C.sqrtsoftplus(args[0], o)
        return out
    return sqrtsoftplus_torch(x)


def sqrtsoftplus_torch(x: torch.Tensor) -> torch.Tensor:
    """`sqrtsoftplus` in torch: the reference the C version is tested against."""
    return F.softplus(x).sqrt()


def topk_ordered(x: torch.Tensor, k: int) -> torch.Tensor:
    """The ids [..., k] of the k largest values of x [..., E] along its last dim, in descending order, a tie to the
    lower id and NaN above every number (torch's stable descending sort, its first k): the MoE router's top-k, whose
    order its weights' total follows (route.c's `route_topk_rows` picks the same)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def limited_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """`silu(min(gate, limit)) * clamp(up, -limit, limit)`; limit <= 0 disables the clamp. In the C extension when
    built (its exp is within 2 ulp of torch's; tested against `limited_swiglu_torch`)."""
    args = c_arrays(gate, up)
    if args is not None and gate.shape == up.shape:
        g, u = map(_rows, args)
        o, out = _like(g, gate.shape)
        _C.swiglu(g, u, float(limit), o)
        return out
    return limited_swiglu_torch(gate, up, limit)


def limited_swiglu_torch(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """`limited_swiglu` in torch: the reference the C version is tested against."""
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


# --- rotary embeddings ----------------------------------------------------------------------------------------


def rope_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """Plain RoPE frequencies `theta^(-2i/dim)`, i = 0..dim/2-1 (float32, as transformers computes them)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def yarn_inv_freq(
    dim: int, theta: float, factor: float, beta_fast: float, beta_slow: float, original_max: int
) -> torch.Tensor:
    """YaRN frequencies: `f/factor` below the `beta_slow` correction dim, `f` above `beta_fast`, linear ramp
    between (no mscale: DeepSeek-V4 leaves cos/sin and the softmax scale unscaled)."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 1 = interpolate
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return (1.0 / (factor * pos)) * ramp + (1.0 / pos) * (1 - ramp)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of `position * f_i`: [T, r/2] each (one angle per interleaved pair)."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, r/2]
    return angles.cos(), angles.sin()


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inverse: bool = False,
    overwrite: bool = False,
    bf16: bool = False,
) -> torch.Tensor:
    """Rotate the trailing `2*cos.shape[-1]` dims of x as interleaved pairs (2i, 2i+1); the leading dims pass.

    x: [T, ..., D] with T matching cos/sin [T, r/2]. `inverse=True` rotates by the negated angle. In the C
    extension when built (the same rounded products and sums: bit-identical to `apply_rope_torch`, tested).
    `overwrite`: the caller needs only the result, so x's memory may hold it (`_into`: then only the rotated dims
    are written, the leading ones are not copied). `bf16`: then every element rounded to the nearest bfloat16, kept
    in float32 (`.to(torch.bfloat16).float()`), in the same pass.
    """
    args = c_arrays(x, cos, sin)
    if (
        args is not None
        and x.dim() >= 2
        and x.shape[0] == cos.shape[0]
        and cos.shape == sin.shape
        and cos.dim() == 2
        and 2 * cos.shape[1] <= x.shape[-1]
    ):
        o, out = _into(x, args[0], overwrite)
        _C.rope(_rows(args[0]), args[1], args[2], inverse, o, bf16)
        return out
    y = apply_rope_torch(x, cos, sin, inverse)
    return y.to(torch.bfloat16).float() if bf16 else y


def apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`apply_rope` in torch: the reference the C version is tested against."""
    half = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        s = -s
    nope, rope = x[..., : -2 * half], x[..., -2 * half :]
    even, odd = rope[..., 0::2], rope[..., 1::2]  # [T, ..., r/2]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat([nope, rotated], dim=-1)


# --- attention ----------------------------------------------------------------------------------------------


def attend_c(
    q: torch.Tensor,
    keys: torch.Tensor,
    k0: int,
    p0: int,
    window: int,
    comp: torch.Tensor | None,
    comp_idx: torch.Tensor | None,
    ratio: int,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """`fastar.model.deepseek_v4.attend` as one C call over the kernels' pool (the arguments and math are its), or
    None when the C extension cannot take these tensors (the caller then runs `attend_torch`)."""
    args = c_arrays(q, keys, sinks) if comp is None else c_arrays(q, keys, sinks, comp)
    if args is None or (comp_idx is not None and comp_idx.dtype != torch.int64):
        return None
    o, out = _like(args[0], q.shape)
    _C.attend(
        args[0],
        args[1],
        k0,
        p0,
        window,
        None if comp is None else args[3],
        None if comp_idx is None else comp_idx.contiguous().numpy(),
        ratio,
        args[2],
        scale,
        o,
    )
    return out


SCORE_BLOCK = 1 << 24  # indexer score elements (query x head x entry) torch computes at once


def index_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, p0: int, fp4: bool = False
) -> torch.Tensor:
    """The lightning indexer's scores `sum_h w_h relu(q_h . k_e) / sqrt(Di)` of queries q [T, Hi, Di] (head weights
    [T, Hi]) at positions p0.. over index keys [E, Di] -> [T, E], -inf for entries the query cannot see yet
    (e >= (p + 1) // 4). One C call over the kernels' pool when the extension is built and the ISA is AVX-512 (each
    (query, entry) summed in one fixed order: batch-invariant; equal to `index_scores_torch` within float32
    rounding, tested; ~7x faster than it on 128 queries x 16k keys here), else `index_scores_torch`. `fp4`: the
    caller declares q and keys FP4-rounded (official numerics), so bfloat16 values: the C kernel checks that and
    then runs on vdpbf16ps where the CPU has it (exact products, ~2x the FP32 kernel; same bound)."""
    args = c_arrays(q, weights, keys)
    if args is not None and q.dim() == 3:
        out = torch.empty(q.shape[0], keys.shape[0])
        if _C.index_scores(*args, p0, float(q.shape[-1] ** -0.5), out.numpy(), fp4):
            return out
    return index_scores_torch(q, weights, keys, p0)


def index_scores_fp4(q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, p0: int) -> torch.Tensor | None:
    """`index_scores(q, weights, keys, p0, fp4=True)` over keys still packed as the decode state stores them (rows
    uint8 [E, 17 Di / 32]: FP4 e2m1 codes and UE8M0 block scales, `fastar.model.state.RowFormat` "fp4"): one C call
    that decodes each key inside the kernel exactly as the state's decode does, so the same scores without a float32
    copy of every key (at long contexts the copy cost as much as the scoring). None where that kernel does not run
    (no extension, no vdpbf16ps): the caller then decodes the rows and calls `index_scores`."""
    args = c_arrays(q, weights)
    if args is None or q.dim() != 3 or rows.dtype != torch.uint8 or not rows.is_cpu:
        return None
    out = torch.empty(q.shape[0], rows.shape[0])
    if _C.index_scores_fp4(*args, rows.contiguous().numpy(), p0, float(q.shape[-1] ** -0.5), out.numpy()):
        return out
    return None


def index_scores_torch(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, p0: int) -> torch.Tensor:
    """`index_scores` in torch: the reference the C version is tested against (queries in blocks that bound the
    [t, Hi, E] temporary)."""
    T, Hi, Di = q.shape
    E = keys.shape[0]
    score = torch.empty(T, E)
    step = max(1, SCORE_BLOCK // max(1, Hi * E))
    for a in range(0, T, step):
        s = torch.einsum("thd,ed->the", q[a : a + step], keys).relu() * Di**-0.5  # [t, Hi, E]
        score[a : a + step] = (s * weights[a : a + step, :, None]).sum(dim=1)  # [t, E]
    visible = torch.arange(p0 + 1, p0 + T + 1)[:, None] // 4  # entries e < (p+1)//4 are closed for query p
    return score.masked_fill(torch.arange(E)[None, :] >= visible, float("-inf"))


def index_topk(score: torch.Tensor, p0: int, k: int) -> torch.Tensor:
    """The indexer's picks: for each query t (at position p0 + t) of the scores [T, E], the ids of the k
    best-scored entries it sees (e < (p0 + t + 1) // 4), ascending, then -1 where it sees fewer -> int64 [T, k].
    One C call over the kernels' pool when the extension is built (a quickselect per query: O(E) instead of a
    sort; each query's picks depend on its row only; the same picks as `index_topk_torch` unless two visible
    scores tie at the k-th place, where the C version takes the lower entry and torch's choice is open)."""
    args = c_arrays(score)
    if args is not None and score.dim() == 2 and k >= 1:
        out = torch.empty(score.shape[0], k, dtype=torch.int64)
        _C.index_topk(args[0], p0, out.numpy())
        return out
    return index_topk_torch(score, p0, k)


def index_topk_torch(score: torch.Tensor, p0: int, k: int) -> torch.Tensor:
    """`index_topk` in torch (`topk`, the invisible picks to -1, then each row sorted ascending with the -1s last):
    the reference the C version is tested against."""
    T, E = score.shape
    idx = score.topk(k, dim=-1).indices  # [T, k]
    visible = torch.arange(p0 + 1, p0 + T + 1, device=score.device)[:, None] // 4  # [T, 1]
    idx = torch.where(idx < visible, idx, E).sort(dim=-1).values  # E: past every real entry
    return torch.where(idx < E, idx, -1)


def picked_entries(picks: torch.Tensor, n_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries the indexer's picks [T, k] (`index_topk`: each row ascending and distinct, -1 last) name: their ids
    [U] ascending without repeats, and the picks as places in that list (-1 kept), so attention decodes each picked
    entry once. One query (decode) needs no dedupe: its picks are that list; several mark an array over the
    `n_entries` entries (torch.unique's order, without its sort)."""
    used = picks >= 0
    if picks.shape[0] == 1:
        k = picks.shape[1]
        return picks[0, : int(used.sum())], torch.where(used, torch.arange(k), -1)
    mark = torch.zeros(n_entries, dtype=torch.bool, device=picks.device)  # picked by some query
    mark[picks[used]] = True
    ids = mark.nonzero().squeeze(1)  # [U] ascending
    where = mark.cumsum(0) - 1  # entry id -> its place in ids
    return ids, torch.where(used, where[picks.clamp(min=0)], -1)


def compress_pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The compressor's pooling of n closed windows: per feature, a softmax over the window's M gate rows weighs its
    kv rows. kv, gate [n, M, hd] (a -inf gate row weighs 0) -> [n, hd]. One C call over the kernels' pool when the
    extension is built (each window in one fixed order: the same whichever chunk closes it; equal to
    `compress_pool_torch` within float32 rounding, tested), else `compress_pool_torch`."""
    args = c_arrays(kv, gate)
    if args is not None and kv.dim() == 3 and kv.shape == gate.shape:
        out = torch.empty(kv.shape[0], kv.shape[2])
        _C.compress_pool(args[0], args[1], out.numpy())
        return out
    return compress_pool_torch(kv, gate)


def compress_pool_torch(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """`compress_pool` in torch: the reference the C version is tested against."""
    return (kv * gate.softmax(dim=1)).sum(dim=1)


# --- hyper-connections ----------------------------------------------------------------------------------------


def hc_pre(
    X: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    hc_eps: float,
    eps: float,
    norm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC collapse at a layer site: streams X [T, n, d] -> (u [T, d], post [T, n], comb [T, n, n]). fn
    [(2+n)*n, n*d], base [(2+n)*n], scale [3]; see `hc_pre_torch`. In the C extension when built: one call instead
    of dozens of small torch ops, equal to `hc_pre_torch` within float32 rounding, and batch-invariant by
    construction (each token's sums in one fixed order), so it needs no `per_token` (tested). `norm` [d]: u comes
    back as `rms_norm(u, norm, eps)` (the sub-layer's input norm; in the same C call, the same bits)."""
    T, n, d = X.shape
    args = c_arrays(X, fn, base, scale) if norm is None else c_arrays(X, fn, base, scale, norm)
    if args is not None and n <= 16 and iters >= 1 and (norm is None or norm.shape == (d,)):
        u, post, comb = torch.empty(T, d), torch.empty(T, n), torch.empty(T, n, n)
        _C.hc_pre(
            args[0].reshape(T, n * d),
            *args[1:4],
            n,
            iters,
            float(hc_eps),
            float(eps),
            u.numpy(),
            post.numpy(),
            comb.numpy().reshape(T, n * n),
            norm=None if norm is None else args[4],
            norm_eps=float(eps),
        )
        return u, post, comb
    u, post, comb = hc_pre_torch(X, fn, base, scale, iters, hc_eps, eps)
    return (u if norm is None else rms_norm(u, norm, eps)), post, comb


def hc_pre_torch(
    X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_pre` in torch, the reference: m = rms_norm(flattened X) @ fn.T (norm then product, as transformers),
    pre = sigmoid(m[:n] s0 + b) + hc_eps, post = 2 sigmoid(m[n:2n] s1 + b), comb = sinkhorn(m[2n:] s2 + b as n x n),
    u = sum_k pre_k X_k. The product and the sigmoids of n values per token run token by token in small chunks
    (`per_token`)."""
    T, n, _ = X.shape

    def mix(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m = rms_norm(x, None, eps) @ fn.T  # [t, (2+n)*n]
        pre = torch.sigmoid(m[:, :n] * scale[0] + base[:n]) + hc_eps  # [t, n]
        post = 2 * torch.sigmoid(m[:, n : 2 * n] * scale[1] + base[n : 2 * n])  # [t, n]
        comb = (m[:, 2 * n :] * scale[2] + base[2 * n :]).view(-1, n, n)  # [t, n, n]
        return pre, post, comb

    pre, post, comb = per_token(mix, X.reshape(T, -1))
    return (pre[:, :, None] * X).sum(1), post, sinkhorn_torch(comb, iters, hc_eps)


def hc_head(
    X: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    eps: float,
    norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """The final mHC collapse (no post, no Sinkhorn): streams X [T, n, d] -> [T, d] with fn [n, n*d], base [n],
    scale [1]; see `hc_head_torch`. In the C extension when built, as `hc_pre` (`norm`: the final norm too)."""
    T, n, d = X.shape
    args = c_arrays(X, fn, base, scale) if norm is None else c_arrays(X, fn, base, scale, norm)
    if args is not None and n <= 16 and (norm is None or norm.shape == (d,)):
        u = torch.empty(T, d)
        _C.hc_pre(
            args[0].reshape(T, n * d),
            *args[1:4],
            n,
            1,
            float(hc_eps),
            float(eps),
            u.numpy(),
            norm=None if norm is None else args[4],
            norm_eps=float(eps),
        )
        return u
    u = hc_head_torch(X, fn, base, scale, hc_eps, eps)
    return u if norm is None else rms_norm(u, norm, eps)


def hc_head_torch(
    X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, eps: float
) -> torch.Tensor:
    """`hc_head` in torch, the reference: pre = sigmoid((rms_norm(flattened X) @ fn.T) s + b) + hc_eps (per token in
    small chunks, as `hc_pre_torch`), u = sum_k pre_k X_k."""
    T = X.shape[0]
    pre = per_token(
        lambda x: torch.sigmoid((rms_norm(x, None, eps) @ fn.T) * scale + base) + hc_eps, X.reshape(T, -1)
    )  # [T, n]
    return (pre[:, :, None] * X).sum(1)


def hc_post(f: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC mix back: new streams X'_k = post_k f + sum_j comb[j, k] X_j (the first index of comb sums) from the
    sub-layer output f [T, d], streams X [T, n, d], post [T, n], comb [T, n, n] -> [T, n, d]. In the C extension
    when built (equal to `hc_post_torch` within float32 rounding, tested)."""
    T, n, d = X.shape
    args = c_arrays(f, X, post, comb)
    if args is not None:
        out = np.empty((T, n, d), np.float32)  # numpy, then one tensor over it: fewer torch calls at decode
        _C.hc_post(args[0], args[1].reshape(T, n * d), args[2], args[3].reshape(T, n * n), out.reshape(T, n * d))
        return torch.from_numpy(out)
    return hc_post_torch(f, X, post, comb)


def hc_post_torch(f: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`hc_post` in torch, the reference."""
    return post[:, :, None] * f[:, None, :] + comb.transpose(1, 2) @ X  # [T, n, d]


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """mHC residual mixing matrix: row softmax + eps, then alternate column/row normalisation (`iters` column
    steps in all), ending on a column step. logits [..., n, n] -> doubly-stochastic [..., n, n]. In the C
    extension when built (one call instead of ~80 small torch ops; equal to `sinkhorn_torch` within float32
    rounding, tested)."""
    n = logits.shape[-1]
    args = c_arrays(logits)
    if args is not None and n <= 16 and iters >= 1:
        flat = args[0].reshape(-1, n * n)
        o, out = _like(flat, logits.shape)
        _C.sinkhorn(flat, n, iters, float(eps), o)
        return out
    return sinkhorn_torch(logits, iters, eps)


def sinkhorn_torch(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`sinkhorn` in torch: the reference the C version is tested against."""
    m = torch.softmax(logits, dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


# --- DeepSeek's activation-quantization simulation ------------------------------------------------------------


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform (Sylvester order, scale n^-1/2) over the last dim (a power of 2). One C
    call when the extension is built (the same butterflies in the same order: bit-identical to `hadamard_torch`,
    tested; the torch one is ~30 small ops, a third of a millisecond on a decode step's index queries)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"hadamard needs a power-of-two size, got {n}")
    args = c_arrays(x)
    if args is not None:
        o, out = _like(_rows(args[0]), x.shape)
        _C.hadamard(_rows(args[0]), float(np.float32(n**-0.5)), o)
        return out
    return hadamard_torch(x)


def hadamard_torch(x: torch.Tensor) -> torch.Tensor:
    """`hadamard` in torch: the reference the C version is tested against."""
    n = x.shape[-1]
    y = x.float().reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(x.shape) * n**-0.5


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= v (v > 0), exactly (no log2 rounding)."""
    mant, exp = torch.frexp(v)  # v = mant * 2^exp, mant in [0.5, 1)
    return torch.ldexp(torch.ones_like(v), torch.where(mant == 0.5, exp - 1, exp))


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """x [..., K] -> [..., ceil(K/block), block] zero-padded (zeros never raise a block's amax)."""
    k = x.shape[-1]
    pad = -k % block
    xf = x.float()
    if pad:
        xf = F.pad(xf, (0, pad))
    return xf.unflatten(-1, (-1, block)), k


def fp8_quant_sim(x: torch.Tensor, block: int) -> torch.Tensor:
    """Quantize-dequantize to FP8 e4m3 per `block` values of the last dim with UE8M0 (power-of-two) scales:
    `s = 2^ceil(log2(max(amax, 1e-4) / 448))`, `e4m3(clamp(x/s)) * s` (DeepSeek's `act_quant`). Runs in the C
    extension when it is built (bit-identical to `fp8_quant_sim_torch`, tested; ~10x faster on one token)."""
    args = c_arrays(x)
    if args is not None:
        o, out = _like(_rows(args[0]), x.shape)
        _C.fp8_act_quant(_rows(args[0]), block, o)
        return out
    return fp8_quant_sim_torch(x, block)


def fp8_quant_sim_torch(x: torch.Tensor, block: int) -> torch.Tensor:
    """`fp8_quant_sim` in torch: the reference the C version is tested against."""
    g, k = _blocks(x, block)
    s = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(1e-4) / FP8_MAX)
    q = (g / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * s).flatten(-2)[..., :k]


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Nearest FP4 e2m1 value (grid 0, .5, 1, 1.5, 2, 3, 4, 6), ties to the even code, saturating at 6."""
    a = v.abs().clamp(max=FP4_MAX)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, v)


def fp4_quant_sim(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Quantize-dequantize to FP4 e2m1 per `block` values with power-of-two scales
    `s = 2^ceil(log2(max(amax, 6*2^-126) / 6))` (DeepSeek's `fp4_act_quant`). One C call when the extension is built
    (bit-identical to `fp4_quant_sim_torch`, tested)."""
    args = c_arrays(x)
    if args is not None and block >= 1:
        o, out = _like(_rows(args[0]), x.shape)
        _C.fp4_act_quant(_rows(args[0]), block, o)
        return out
    return fp4_quant_sim_torch(x, block)


def fp4_quant_sim_torch(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """`fp4_quant_sim` in torch: the reference the C version is tested against."""
    g, k = _blocks(x, block)
    s = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-126) / FP4_MAX)
    return (e2m1_round((g / s).clamp(-FP4_MAX, FP4_MAX)) * s).flatten(-2)[..., :k]


# --- batch invariance ----------------------------------------------------------------------------------------

SMALL_CHUNK = 8  # = the C kernels' dot path (DOT_MAX): up to this many tokens a product sums as for one token


def token_slices(T: int, block: int | None = None) -> list[slice]:
    """The pieces in which a chunk of T tokens runs an op whose per-token result could follow the chunk's shape:
    one token each while T <= SMALL_CHUNK, so each token sees exactly the shapes of a one-token decode step and
    gets bit-identical results (a speculative verify pass then reproduces plain decoding); beyond, the whole chunk
    at once (prefill). Such ops: torch products (BLAS picks kernels and summation orders by shape), reductions
    over masked rows whose length follows the chunk, and transcendental functions (sigmoid, softplus, SiLU) on a
    few values per token (their SIMD and scalar paths round differently, and which one a token's values take
    depends on where they fall in the flattened chunk; widths that are multiples of 32 always take the SIMD one).
    `block`: longer chunks in pieces of that many tokens instead (attention: a piece's queries see only the
    window behind it, so the work grows with T, not T^2)."""
    if T <= SMALL_CHUNK:
        return [slice(t, t + 1) for t in range(T)]
    return [slice(a, min(a + block, T)) for a in range(0, T, block)] if block else [slice(0, T)]


def per_token(f, *xs: torch.Tensor):
    """f(*xs) for a token-wise f of tensors [T, ...] (returning a tensor or a tuple of them), run over
    `token_slices(T)` of the first dim and concatenated."""
    parts = token_slices(xs[0].shape[0])
    if len(parts) == 1:
        return f(*xs)
    outs = [f(*(x[s] for x in xs)) for s in parts]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(o) for o in zip(*outs))
    return torch.cat(outs)
