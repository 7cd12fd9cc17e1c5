"""Fast fused dequantize-and-multiply CPU kernels, exact to `fastar.quant.reference` up to float32 summation order.

Owns: the Python face of the C extension `fastar.quant._kernels` (built by setup.py from `quant/csrc/`):
`fp4_matmul`, `fp8_matmul`, `bf16_matmul`, the fused routed expert `expert_ffn` (optionally with the
official numerics' FP8 activation quantization inside), a layer's experts at once (`experts_ffn`),
`fp8_act_quant`, the int8 copy of the LM head that screens greedy decoding (`head_i8_build`, its exact integer
products `head_i8_dot`, and `gather_rows` for the candidates' exact rows), thread-count and instruction-set
controls, and a numpy fallback with identical semantics
for when the extension is missing (`available()` is then False; results stay correct, only slow).
Does not own: the choice of numerics (the model's) nor weight paging.

Every product takes the checkpoint's own layouts, never a widened copy (see reference.py):
- FP4 weight [N, K/2] uint8 (low nibble = even column) + UE8M0 scale [N, K/32] uint8;
- FP8 e4m3 weight [N, K] uint8 + UE8M0 scale [ceil(N/128), ceil(K/128)] uint8;
- BF16 weight [N, K] as uint16 bit patterns.
Activations x are float32 [T, K] (or [K], giving [N]); the result is float32 [T, N] = x @ W.T, computed with
fp32 activations and fp32 accumulation. Inputs may be numpy arrays or CPU torch tensors (viewed, not copied;
torch bfloat16 is read as its uint16 bits). Bad dtypes raise TypeError; bad shapes, strides or aliasing raise
ValueError. Nothing is converted silently: a non-contiguous or float64 input is an error, not a copy.
The C kernels release the GIL and run on a persistent thread pool (default: the CPUs this process may use,
or FASTAR_THREADS); results are bit-identical for any thread count. On CPUs with AVX512_BF16 (isa 'avx512bf16'),
FP8/FP4 products of up to 8 tokens whose x values are all exact bfloat16s (as the official numerics' FP8-quantized
activations are) multiply with vdpbf16ps: still exact products, only the float32 summation order differs; the
choice is made per call, so every token of a call takes the same path.
"""

from __future__ import annotations

import numpy as np

from . import reference as ref

try:  # the compiled extension is optional: without it every function below still works, slowly
    from . import _kernels as _C
except ImportError:  # pragma: no cover - exercised only on machines without a C build
    _C = None

# The extension module itself, for the model's row ops (`fastar.model.ops`): at decode a call there costs a few
# microseconds, so ops validates its tensors once and calls these entry points directly. None without a build.
extension = _C

__all__ = [
    "available",
    "extension",
    "cpu_features",
    "set_num_threads",
    "keep_freed_memory",
    "get_num_threads",
    "set_isa",
    "get_isa",
    "fp4_matmul",
    "fp8_matmul",
    "bf16_matmul",
    "expert_ffn",
    "experts_ffn",
    "fp8_act_quant",
    "head_i8_build",
    "head_i8_rows",
    "head_i8_tiles",
    "head_i8_dot",
    "head_i8_path",
    "gather_rows",
]


def available() -> bool:
    """True when the compiled kernels are in use (False: the numpy fallback answers every call)."""
    return _C is not None


def cpu_features() -> dict:
    """What this CPU offers the kernels: {'avx2', 'fma', 'f16c', 'avx512f', 'avx512bw', 'avx512vl', 'avx512vbmi',
    'avx512bf16', 'avx512vnni' (x86-64), 'asimd', 'bf16', 'dotprod' (AArch64): bool, 'isa': the instruction set in use,
    'usable_isas': list}. Without the extension, isa is 'numpy'."""
    if _C is None:
        return {
            "avx2": False,
            "fma": False,
            "f16c": False,
            "avx512f": False,
            "avx512bw": False,
            "avx512vl": False,
            "avx512vbmi": False,
            "avx512bf16": False,
            "avx512vnni": False,
            "asimd": False,
            "bf16": False,
            "dotprod": False,
            "isa": "numpy",
            "usable_isas": [],
        }
    return _C.cpu_features()


def set_num_threads(n: int) -> None:
    """Resize the kernels' thread pool (the calling thread counts as one)."""
    n = int(n)
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    if _C is not None:
        _C.set_num_threads(n)


def keep_freed_memory() -> bool:
    """Have the process's malloc (glibc) keep freed memory for reuse rather than return it to the OS, so a prefill
    chunk's large temporaries are not page-faulted and zeroed anew every chunk (process-wide; bindings.c says
    how). False, changing nothing, without the extension or on another malloc."""
    return bool(_C is not None and _C.keep_freed_memory())


def get_num_threads() -> int:
    """Threads the kernels use: default = CPUs in this process's affinity mask (or FASTAR_THREADS)."""
    if _C is None:
        return 1
    return _C.get_num_threads()


def pool_test_delays(worker_us: int, caller_us: int) -> None:
    """Test hooks of the thread pool (0, 0 = off, the default): a worker sleeps `worker_us` after reading the claim
    counter and a caller sleeps `caller_us` before publishing a job, widening the windows in which a late worker
    meets the next job (tests/test_kernels.py and scripts/exactness_stress.py use them; never set in production)."""
    if _C is not None:
        _C._pool_test_delays(int(worker_us), int(caller_us))


def x_prep_isa(on: bool) -> bool:
    """The dot path's preparation of x (the scan that picks the path, the permuted bfloat16 copy) on the ISA's
    vectorized routines (on, the default) or on dispatch.c's portable loops, their reference. Returns the previous
    setting. A knob for tests, never turned off in production."""
    return bool(_C._x_prep_isa(bool(on))) if _C is not None else True


def fp8_fold(on: bool) -> bool:
    """The FP8 bf16 dot path's folding of the weight scales into x (on by default; off: the scales are applied per
    128-column block). Returns the previous setting. A knob for tests and A/B runs, never turned off in production."""
    return bool(_C._fp8_fold(bool(on))) if _C is not None else True


def readahead(mb: int) -> int:
    """The weight readahead's cap (csrc/readahead.c): how many MB of the next product's weights the pool's idle worker
    prefetches while the caller is between kernels (8 by default, or FASTAR_READAHEAD_MB; 0 turns it off). Returns
    the previous cap. Results are the same bits either way; a knob for tests and A/B runs."""
    return int(_C._readahead(int(mb))) if _C is not None else 0


def readahead_stats() -> tuple[int, int]:
    """(prefetches the weight readahead requested, bytes the pool's worker prefetched) since the process started."""
    return tuple(_C._readahead_stats()) if _C is not None else (0, 0)


def pool_probe(counts: np.ndarray, spin_us: float = 0.0) -> None:
    """One pool job of len(counts) chunks, chunk i spinning `spin_us` then adding 1 to counts[i] (int64): after it
    returns every count is exactly 1 if each chunk ran once and before the job ended (a test of the pool)."""
    if _C is None:
        counts += 1
        return
    _C._pool_probe(counts, float(spin_us))


def set_isa(name: str) -> None:
    """Force 'avx512bf16', 'avx512' (the same without the bf16 dot path), 'avx2' (x86-64), 'neon-bf16', 'neon'
    (AArch64) or 'scalar' (tests, benchmarks), or 'auto' for the best this CPU runs."""
    if _C is not None:
        _C.set_isa(name)


def get_isa() -> str:
    """The instruction set the kernels run ('numpy' for the fallback)."""
    return _C.get_isa() if _C is not None else "numpy"


# --- argument plumbing ----------------------------------------------------------------------------------


def _array(a, name: str) -> np.ndarray:
    """numpy view of a numpy array or CPU torch tensor (bfloat16 -> its uint16 bits); never copies."""
    if isinstance(a, np.ndarray):
        return a
    mod = type(a).__module__
    if mod.startswith("torch"):
        if a.device.type != "cpu":
            raise TypeError(f"{name} must be on the CPU, got a tensor on {a.device}")
        a = a.detach()
        if str(a.dtype) == "torch.bfloat16":
            import torch  # noqa: PLC0415 (only reached when the caller already uses torch)

            return a.view(torch.int16).numpy().view(np.uint16)
        return a.numpy()
    raise TypeError(f"{name} must be a numpy array or a CPU torch tensor, got {type(a).__name__}")


def _check(a: np.ndarray, name: str, dtype, ndim: int) -> None:
    """The fallback's version of the C checks (same exception types)."""
    if a.dtype != dtype:
        raise TypeError(f"{name} must be {np.dtype(dtype).name}, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {a.ndim}-D")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (row-major, no strides); use np.ascontiguousarray")


def _shape(a: np.ndarray, name: str, want: tuple[int, int]) -> None:
    if a.shape != want:
        raise ValueError(f"{name} has shape {a.shape}, expected {want}")


def _rows(x, w, out, dtype):
    """A product's x and out as 2-D arrays: x [T, K] or one row [K], out [T, N] (N = w's rows) or, for one row, [N];
    out made (of dtype) when None. -> (vector, x2, out, out2, t, n)."""
    vector = isinstance(x, np.ndarray) and x.ndim == 1
    x2 = x.reshape(1, -1) if vector else x
    t, n = (x2.shape[0] if x2.ndim == 2 else 0), (w.shape[0] if w.ndim == 2 else 0)
    if out is None:
        out2 = np.empty((t, n), dtype)
    else:
        out = _array(out, "out")
        out2 = out.reshape(1, -1) if (vector and out.ndim == 1) else out
    return vector, x2, out, out2, t, n


def _result(vector: bool, out, out2) -> np.ndarray:
    """What a product returns: the caller's out, or the one made, as [N] for one row."""
    res = out if out is not None else out2
    return res.reshape(-1) if (vector and res.ndim == 2) else res


def _product(kind: str, x, w, s, out, numpy_dequant, groups: int = 1):
    x, w = _array(x, "x"), _array(w, "w")
    s = None if s is None else _array(s, "s")
    accumulate = out is not None
    vector, x2, out, out2, t, n = _rows(x, w, out, np.float32)
    if _C is not None:
        args = (x2, w, out2) if s is None else (x2, w, s, out2)
        getattr(_C, kind)(*args, accumulate=accumulate, groups=groups)
    elif groups != 1:  # block-diagonal: each group's slice of x against its rows, through the plain fallback
        if groups < 1 or x2.shape[1] % groups or n % groups or (kind == "fp8_matmul" and (n // groups) % 128):
            raise ValueError(
                f"groups={groups} needs x.shape[1] and w.shape[0] to be multiples of it"
                + (", and 128 to divide w.shape[0] / groups" if kind == "fp8_matmul" else "")
            )
        k, r = x2.shape[1] // groups, n // groups
        sub = {"fp4_matmul": fp4_matmul, "fp8_matmul": fp8_matmul}.get(kind)
        parts = []
        for g in range(groups):
            xg = np.ascontiguousarray(x2[:, g * k : (g + 1) * k])
            if sub is fp8_matmul:
                parts.append(sub(xg, w[g * r : (g + 1) * r], s[g * r // 128 : (g + 1) * r // 128]))
            elif sub is fp4_matmul:
                parts.append(sub(xg, w[g * r : (g + 1) * r], s[g * r : (g + 1) * r]))
            else:
                parts.append(bf16_matmul(xg, w[g * r : (g + 1) * r]))
        y = np.concatenate(parts, axis=1)
        _shape(out2, "out", y.shape)
        if accumulate:
            out2 += y
        else:
            out2[...] = y
    else:
        _check(x2, "x", np.float32, 2)
        _check(w, "w", np.uint16 if s is None else np.uint8, 2)
        _check(out2, "out", np.float32, 2)
        if s is not None:
            _check(s, "s", np.uint8, 2)
        _shape(out2, "out", (t, n))
        y = (x2 @ numpy_dequant(x2.shape[1]).T).astype(np.float32)
        if accumulate:
            out2 += y
        else:
            out2[...] = y
    return _result(vector, out, out2)


# --- products ---------------------------------------------------------------------------------------------


def fp4_matmul(x, w, s, out=None, groups: int = 1) -> np.ndarray:
    """x [T, K] float32 @ FP4 weight [N, K/2] with UE8M0 scales [N, K/32] -> [T, N] float32.

    Twin of `reference.fp4_decode`: equals x @ fp4_decode(w, s).T up to float32 summation order. K must be a
    multiple of 32. With `out` ([T, N] float32) the product is ADDED into it (out += x @ W.T) and out returned.
    """

    def dequant(k: int) -> np.ndarray:
        if k % ref.FP4_GROUP:
            raise ValueError(f"FP4 needs K (x.shape[1] = {k}) to be a multiple of {ref.FP4_GROUP}")
        _shape(w, "w", (w.shape[0], k // 2))
        return ref.fp4_decode(w, s)

    w = _array(w, "w")
    return _product("fp4_matmul", x, w, s, out, dequant, groups)


def fp8_matmul(x, w, s, out=None, groups: int = 1) -> np.ndarray:
    """x [T, K] float32 @ FP8 e4m3 weight [N, K] with 128x128 UE8M0 block scales -> [T, N] float32.

    Twin of `reference.fp8_block_dequant`: equals x @ fp8_block_dequant(w, s).T up to summation order (NaN
    codes make their row NaN, as there). With `out` the product is ADDED into it and out returned.
    `groups` = G > 1: block-diagonal, x [T, G*K], w [G*R, K] (R a multiple of 128), out [T, G*R] with group g's
    columns = x[:, g*K:(g+1)*K] @ w[g*R:(g+1)*R].T; one call, one pool job (the same for fp4/bf16_matmul).
    """

    def dequant(k: int) -> np.ndarray:
        _shape(w, "w", (w.shape[0], k))
        return ref.fp8_block_dequant(w, s)

    w = _array(w, "w")
    return _product("fp8_matmul", x, w, s, out, dequant, groups)


def bf16_matmul(x, w, out=None, groups: int = 1) -> np.ndarray:
    """x [T, K] float32 @ BF16 weight [N, K] (uint16 bits or torch bfloat16) -> [T, N] float32.

    Twin of `reference.bf16_decode`: equals x @ bf16_decode(w).T up to summation order. With `out` the
    product is ADDED into it and out returned.
    """

    def dequant(k: int) -> np.ndarray:
        _shape(w, "w", (w.shape[0], k))
        return ref.bf16_decode(w)

    w = _array(w, "w")
    return _product("bf16_matmul", x, w, None, out, dequant, groups)


def swiglu_limited(gate: np.ndarray, up: np.ndarray, limit: float) -> np.ndarray:
    """silu(min(gate, l)) * clamp(up, -l, l) in float32; limit <= 0 means no clamp (DeepSeek's swiglu_limit=0)."""
    gate = np.asarray(gate, np.float32)
    up = np.asarray(up, np.float32)
    if limit > 0:
        lim = np.float32(limit)
        gate = np.minimum(gate, lim)
        up = np.clip(up, -lim, lim)
    with np.errstate(over="ignore"):
        return (gate / (np.float32(1) + np.exp(-gate)) * up).astype(np.float32)


def experts_ffn(x, experts, rows, offsets, route_w, limit: float, out, act_block: int = 0) -> np.ndarray:
    """A layer's routed experts in one call: `expert_ffn` for each, outputs added into `out` expert after expert.

    experts: E tuples (w1, s1, w3, s3, w2, s2); expert e takes the tokens rows[offsets[e]:offsets[e+1]] of x [T, D]
    (int64, at least one each) with routing weights route_w[offsets[e]:offsets[e+1]]. Bit-identical to E
    `expert_ffn` calls whose outputs are added to out[rows] in the given order; with the C kernels, two pool jobs
    (every expert's gate/up rows, then every down row) instead of 2E. Returns out.
    """
    x, out = _array(x, "x"), _array(out, "out")
    rows, offsets = np.ascontiguousarray(rows, np.int64), np.ascontiguousarray(offsets, np.int64)
    route_w = np.ascontiguousarray(_array(route_w, "route_w"), np.float32)
    if _C is not None:
        arrays = [
            ew if all(type(a) is np.ndarray for a in ew) else tuple(_array(a, "expert weight") for a in ew)
            for ew in experts
        ]
        _C.experts_ffn(x, arrays, rows, offsets, route_w, float(limit), out, int(act_block))
        return out
    if len(offsets) != len(experts) + 1 or offsets[0] != 0 or offsets[-1] != len(rows) or (np.diff(offsets) <= 0).any():
        raise ValueError("offsets must have E+1 increasing entries from 0 to len(rows) (every expert has a token)")
    for e, ew in enumerate(experts):
        tok = rows[offsets[e] : offsets[e + 1]]
        y = expert_ffn(
            np.ascontiguousarray(x[tok]),
            *ew,
            route_w[offsets[e] : offsets[e + 1]],
            limit,
            np.zeros((len(tok), x.shape[1]), np.float32),
            act_block,
        )
        out[tok] += y  # the tokens of one expert are distinct
    return out


def fp8_act_quant(x, block: int = 128, out=None) -> np.ndarray:
    """DeepSeek's FP8 activation quant-dequant of float32 x [R, K] per `block` values (`reference.fp8_act_quant`,
    bit-identical); `out` may be x itself."""
    x = _array(x, "x")
    if _C is not None:
        out = np.empty_like(x) if out is None else _array(out, "out")
        _C.fp8_act_quant(x, int(block), out)
        return out
    _check(x, "x", np.float32, 2)
    r = ref.fp8_act_quant(x, block)
    if out is None:
        return r
    out = _array(out, "out")
    out[...] = r
    return out


def expert_ffn(x, w1, s1, w3, s3, w2, s2, route_w, limit: float, out, act_block: int = 0) -> np.ndarray:
    """One routed FP4 expert, fused: out[t] += route_w[t] * swiglu(x[t]) @ W2.T, accumulated into `out`.

    x [T, D] float32; w1/w3 (gate/up) FP4 [I, D/2] + scales [I, D/32]; w2 (down) FP4 [D, I/2] + [D, I/32];
    route_w [T] float32; out [T, D] float32 (added to, so start from zeros or from other experts' sum).
    gate = x W1^T, up = x W3^T, h = silu(min(gate, limit)) * clamp(up, -limit, limit) * route_w[t]
    (limit <= 0: no clamp), out += h W2^T. Twin: `reference.fp4_decode` of each weight composed with
    `swiglu_limited`; the routing weight is applied before the down projection (DeepSeek's order).
    act_block > 0: the official numerics' FP8 activation quantization (`fp8_act_quant`) of x and of h.
    """
    arrs = [
        _array(a, nm)
        for a, nm in (
            (x, "x"),
            (w1, "w1"),
            (s1, "s1"),
            (w3, "w3"),
            (s3, "s3"),
            (w2, "w2"),
            (s2, "s2"),
            (route_w, "route_w"),
            (out, "out"),
        )
    ]
    if _C is not None:
        _C.expert_ffn(*arrs[:8], float(limit), arrs[8], int(act_block))
        return arrs[8]
    x, w1, s1, w3, s3, w2, s2, route_w, out = arrs
    for a, nm, dt, nd in ((x, "x", np.float32, 2), (route_w, "route_w", np.float32, 1), (out, "out", np.float32, 2)):
        _check(a, nm, dt, nd)
    _shape(out, "out", x.shape)
    if route_w.shape != (x.shape[0],):
        raise ValueError(f"route_w has shape {route_w.shape}, expected ({x.shape[0]},)")
    q = (lambda a: np.ascontiguousarray(ref.fp8_act_quant(a, act_block))) if act_block else (lambda a: a)
    gate = fp4_matmul(q(x), w1, s1)
    up = fp4_matmul(q(x), w3, s3)
    h = swiglu_limited(gate, up, limit) * route_w[:, None]
    out += fp4_matmul(q(h.astype(np.float32)), w2, s2)
    return out


# --- the int8 screened LM head ----------------------------------------------------------------------------

HEAD_I8_MAX_K = 131008  # head_i8_dot's largest K: |sum x q| <= 128^2 K stays an exact int32 (and K % 64 == 0)


def head_i8_build(w, q=None, scale=None, wnorm=None, dnorm=None, rowsum=None):
    """The int8 copy of a bfloat16 weight w [V, K] (uint16 bits or torch bfloat16), row by row, for a screened
    greedy LM head. Returns (q int8 [V, K] in tiles of 4 rows where K % 64 == 0: `head_i8_tiles`, `head_i8_rows`;
    scale float32 [V], wnorm float64 [V], dnorm float64 [V], rowsum int32 [V]), written into the arrays given (each
    None is allocated). Per row:
    - some value infinite or NaN: q = 0, scale = 0, wnorm = dnorm = +inf, rowsum = 0 (always recompute it exactly);
    - else amax = max |w|; amax = 0: everything 0;
    - else s = amax / 127 (float32), q = round-half-even(w / s) (a float32 quotient) clamped to [-127, 127],
      wnorm = ||w||, dnorm = ||w - q s|| (float64 sums of exact terms; dnorm is the q stored), rowsum = sum q.
    The float32 steps run in IEEE's default environment (no flush of subnormals) whatever the caller's."""
    w = _array(w, "w")
    _check(w, "w", np.uint16, 2)
    v, k = w.shape
    outs = [
        np.empty(shape, dtype) if a is None else _array(a, name)
        for a, name, shape, dtype in (
            (q, "q", (v, k), np.int8),
            (scale, "scale", (v,), np.float32),
            (wnorm, "wnorm", (v,), np.float64),
            (dnorm, "dnorm", (v,), np.float64),
            (rowsum, "rowsum", (v,), np.int32),
        )
    ]
    if _C is not None:
        _C.head_i8_build(w, *outs)
        return tuple(outs)
    q, scale, wnorm, dnorm, rowsum = outs
    _check(q, "q", np.int8, 2)
    _shape(q, "q", (v, k))
    for a, name, dtype in (
        (scale, "scale", np.float32),
        (wnorm, "wnorm", np.float64),
        (dnorm, "dnorm", np.float64),
        (rowsum, "rowsum", np.int32),
    ):
        _check(a, name, dtype, 1)
        if a.shape != (v,):
            raise ValueError(f"{name} has {a.shape[0]} entries, expected {v} = w.shape[0]")
    for r0 in range(0, v, 4096):  # row blocks: a float copy of the whole head would be 2 GB
        r1 = min(v, r0 + 4096)
        wf = (w[r0:r1].astype(np.uint32) << 16).view(np.float32)
        ok = np.isfinite(wf).all(axis=1)
        amax = np.where(ok, np.abs(np.where(np.isfinite(wf), wf, 0)).max(axis=1, initial=0), 0).astype(np.float32)
        s = amax / np.float32(127)
        nz = s > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            qf = np.clip(np.rint(wf / np.where(nz, s, 1)[:, None]), -127, 127)
        qb = np.where(nz[:, None], qf, 0).astype(np.int8)
        w64 = np.where(ok[:, None], wf, 0).astype(np.float64)
        q[r0:r1] = head_i8_tiles(qb, v, r0)
        scale[r0:r1] = s
        wnorm[r0:r1] = np.where(ok, np.sqrt((w64 * w64).sum(axis=1)), np.inf)
        d = w64 - qb * s.astype(np.float64)[:, None]
        dnorm[r0:r1] = np.where(ok, np.sqrt((d * d).sum(axis=1)), np.inf)
        rowsum[r0:r1] = qb.sum(axis=1, dtype=np.int32)
    return tuple(outs)


HEAD_I8_TILE_ROWS = 4  # rows per tile of head_i8_build's layout


def _tiled_rows(v: int, k: int, r0: int, n: int) -> int:
    """How many of rows [r0, r0 + n) of a [v, k] int8 head are tiled (r0 a multiple of the tile's rows)."""
    return 0 if k % 64 else max(0, min(r0 + n, v // HEAD_I8_TILE_ROWS * HEAD_I8_TILE_ROWS) - r0)


def head_i8_tiles(rows: np.ndarray, v: int, r0: int = 0) -> np.ndarray:
    """Plain int8 rows [n, k] (rows r0.. of a [v, k] head, r0 a multiple of 4) in `head_i8_build`'s layout: where
    k % 64 == 0, each whole group of 4 rows stored as tiles (row 4g + i's columns [64 j, 64 j + 64) at 256 j + 64 i of
    the group's 4 k bytes), the rows after the last whole group of the head as they are."""
    n, k = rows.shape
    t = _tiled_rows(v, k, r0, n)
    out = rows.copy()
    out[:t] = rows[:t].reshape(t // 4, 4, k // 64, 64).transpose(0, 2, 1, 3).reshape(t, k)
    return out


def head_i8_rows(q: np.ndarray, v: int | None = None, r0: int = 0) -> np.ndarray:
    """`head_i8_tiles` undone: rows r0.. of a [v, k] head in `head_i8_build`'s layout (v: q's rows) as plain rows."""
    n, k = q.shape
    t = _tiled_rows(n if v is None else v, k, r0, n)
    out = q.copy()
    out[:t] = q[:t].reshape(t // 4, k // 64, 4, 64).transpose(0, 2, 1, 3).reshape(t, k)
    return out


def head_i8_dot(xq, q, rowsum, out=None) -> np.ndarray:
    """Exact integer products of int8 activations with the int8 head: out[t, i] = sum_k xq[t, k] q[i, k] (int32, no
    saturation for any int8 values). xq int8 [T, K] (or [K], giving [V]); q int8 [V, K] in `head_i8_build`'s layout
    (tiles of 4 rows: q[i] above is row i of `head_i8_rows(q)`) and rowsum int32 [V] its row sums (the AVX-512 VNNI
    path uses them); K a multiple of 64 up to HEAD_I8_MAX_K. The weights are read once per 4 tokens. `out` int32
    [T, V] is written (not added to)."""
    xq, q, rowsum = _array(xq, "xq"), _array(q, "q"), _array(rowsum, "rowsum")
    vector, x2, out, out2, t, v = _rows(xq, q, out, np.int32)
    if _C is not None:
        _C.head_i8_dot(x2, q, rowsum, out2)
    else:
        _check(x2, "xq", np.int8, 2)
        _check(q, "q", np.int8, 2)
        _check(rowsum, "rowsum", np.int32, 1)
        _check(out2, "out", np.int32, 2)
        k = x2.shape[1]
        if k % 64 or k > HEAD_I8_MAX_K:
            raise ValueError(f"xq has {k} columns, expected a multiple of 64 up to {HEAD_I8_MAX_K}")
        _shape(q, "q", (v, k))
        if rowsum.shape != (v,):
            raise ValueError(f"rowsum has {rowsum.shape[0]} entries, expected {v} = q.shape[0]")
        _shape(out2, "out", (t, v))
        x32 = x2.astype(np.int32)
        for r0 in range(0, v, 4096):
            out2[:, r0 : r0 + 4096] = x32 @ head_i8_rows(q[r0 : r0 + 4096], v, r0).astype(np.int32).T
    return _result(vector, out, out2)


def head_i8_path() -> str:
    """How `head_i8_dot` runs under the instruction set in use: 'avx512vnni', 'avx2', 'portable' (or 'numpy')."""
    return _C._head_i8_path() if _C is not None else "numpy"


def gather_rows(w, idx, out=None) -> np.ndarray:
    """out[j] = w[idx[j]]: the rows idx (int64 [U], each in [0, V)) of a bfloat16 weight w [V, K] (uint16 bits or
    torch bfloat16) into out uint16 [U, K], copied over the thread pool (the screened head's candidate rows, for
    `bf16_matmul`)."""
    w, idx = _array(w, "w"), _array(idx, "idx")
    if out is None:
        _check(w, "w", np.uint16, 2)
        out = np.empty((idx.shape[0] if idx.ndim == 1 else 0, w.shape[1]), np.uint16)
    else:
        out = _array(out, "out")
    if _C is not None:
        _C.gather_rows(w, idx, out)
        return out
    _check(w, "w", np.uint16, 2)
    _check(idx, "idx", np.int64, 1)
    _check(out, "out", np.uint16, 2)
    _shape(out, "out", (idx.shape[0], w.shape[1]))
    bad = np.flatnonzero((idx < 0) | (idx >= w.shape[0]))
    if bad.size:
        j = int(bad[0])
        raise ValueError(f"idx[{j}] = {int(idx[j])} is not a row of w's {w.shape[0]}")
    np.take(w, idx, axis=0, out=out)
    return out
