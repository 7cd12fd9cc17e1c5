"""The int8 screened LM head's kernels (fastar.quant.kernels.head_i8_build, head_i8_dot, gather_rows) against plain
numpy references: every instruction set this CPU runs and the numpy fallback, extreme values (+-127 and -128, all-zero
rows, rows with infinities or NaN, bfloat16 subnormals, the largest bfloat16, exact halves), 1 to 9 tokens and more,
small and odd sizes, the largest K whose sums stay exact, and bad arguments.
"""

from __future__ import annotations

import numpy as np
import pytest

from fastar.quant import kernels as K

ISAS = K.cpu_features()["usable_isas"] if K.available() else []


def bf16_values(w: np.ndarray) -> np.ndarray:
    return (w.astype(np.uint32) << 16).view(np.float32)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, truncated (any bit pattern is a valid weight here)."""
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def ref_build(w: np.ndarray):
    """head_i8_build's contract, one row at a time."""
    v, k = w.shape
    q = np.zeros((v, k), np.int8)
    scale = np.zeros(v, np.float32)
    wnorm = np.zeros(v)
    dnorm = np.zeros(v)
    for i in range(v):
        row = bf16_values(w[i])
        if not np.isfinite(row).all():
            wnorm[i] = dnorm[i] = np.inf
            continue
        amax = np.abs(row).max(initial=np.float32(0))
        if amax == 0:
            continue
        s = np.float32(amax / np.float32(127))
        q[i] = np.clip(np.rint(row / s), -127, 127).astype(np.int8)
        scale[i] = s
        wnorm[i] = np.sqrt(np.sum(row.astype(np.float64) ** 2))
        dnorm[i] = np.sqrt(np.sum((row.astype(np.float64) - q[i].astype(np.float64) * np.float64(s)) ** 2))
    return q, scale, wnorm, dnorm, q.sum(axis=1, dtype=np.int64)


def special_weights(rng, k: int) -> np.ndarray:
    """Rows of every awkward kind, then random rows at assorted magnitudes."""
    rows = [
        np.zeros(k, np.uint16),  # all +0
        np.full(k, 0x8000, np.uint16),  # all -0
        to_bf16(rng.standard_normal(k)),  # ordinary
        to_bf16(rng.standard_normal(k) * 2.0**-100),  # small normals
        (rng.integers(1, 0x80, k) | (rng.integers(0, 2, k) << 15)).astype(np.uint16),  # subnormals only
        np.where(rng.random(k) < 0.5, 0x7F7F, 0xFF7F).astype(np.uint16),  # +-the largest bfloat16
        np.where(np.arange(k) == k // 2, 0x7F7F, to_bf16(rng.standard_normal(k))).astype(np.uint16),  # one huge
        np.where(np.arange(k) == 0, 0x0001, 0).astype(np.uint16),  # one subnormal, the smallest
        to_bf16(np.resize(np.array([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5], np.float32), k)),  # halves
        np.where(np.arange(k) == k - 1, 0x7F80, to_bf16(rng.standard_normal(k))).astype(np.uint16),  # +inf
        np.where(np.arange(k) == 0, 0xFF80, 0).astype(np.uint16),  # -inf and zeros
        np.where(np.arange(k) == k // 3, 0x7FC1, to_bf16(rng.standard_normal(k))).astype(np.uint16),  # NaN
    ]
    rand = to_bf16(rng.standard_normal((7, k)) * 2.0 ** rng.integers(-60, 60, (7, 1)))
    return np.ascontiguousarray(np.vstack([np.stack(rows), rand]))


@pytest.mark.parametrize("k", [1, 7, 64, 100, 4096])
def test_build_matches_the_reference(kernel_backend, k):
    rng = np.random.default_rng(k)
    w = special_weights(rng, k)
    tiles, scale, wnorm, dnorm, rowsum = K.head_i8_build(w)
    rq, rscale, rw, rd, rsum = ref_build(w)
    assert np.array_equal(tiles, K.head_i8_tiles(rq, len(w)))
    q = K.head_i8_rows(tiles)
    assert np.array_equal(q, rq)
    assert np.array_equal(scale.view(np.uint32), rscale.view(np.uint32))
    assert np.array_equal(rowsum, rsum)
    for got, want in ((wnorm, rw), (dnorm, rd)):
        assert np.array_equal(np.isinf(got), np.isinf(want))
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[fin], want[fin], rtol=1e-13, atol=0)
    # the facts the screen relies on: infinite norms exactly on the non-finite rows, |w - q s| <= s / 2 elsewhere
    # (amax / 127 rounded may clamp the largest value by a hair: at most that hair more)
    finite = np.isfinite(bf16_values(w)).all(axis=1)
    assert np.array_equal(np.isinf(dnorm), ~finite) and np.array_equal(np.isinf(wnorm), ~finite)
    err = np.abs(bf16_values(w[finite]).astype(np.float64) - q[finite] * scale[finite, None].astype(np.float64))
    assert np.all(err <= scale[finite, None].astype(np.float64) * (0.5 + 2.0**-8))


def test_build_halves_round_to_even(kernel_backend):
    w = to_bf16(np.array([[127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5]], np.float32))
    q = K.head_i8_build(w)[0]
    assert q.tolist() == [[127, 2, -4, 0, 0, 2, 126, -126]]


def test_build_writes_the_given_arrays_across_chunks(kernel_backend):
    rng = np.random.default_rng(1)
    for v, k in ((300, 1000), (302, 1024)):  # several pool chunks, plain rows; then tiles and two plain rows after them
        w = to_bf16(rng.standard_normal((v, k)))
        outs = (np.empty((v, k), np.int8), np.empty(v, np.float32), np.empty(v), np.empty(v), np.empty(v, np.int32))
        got = K.head_i8_build(w, *outs)
        assert all(a is b for a, b in zip(got, outs))
        rq, rscale, *_ = ref_build(w)
        assert np.array_equal(K.head_i8_rows(outs[0]), rq) and np.array_equal(outs[1], rscale)


@pytest.mark.parametrize("v, k", [(1, 64), (4, 64), (7, 128), (9, 100), (130, 4096)])
def test_the_tiled_layout(v, k):
    """Rows in whole groups of 4 side by side per 64 columns (row 4g + i's columns [64 j, 64 j + 64) at byte
    4g k + 256 j + 64 i), the rest plain; nothing tiled where k % 64 != 0; head_i8_rows undoes it, also by blocks."""
    rows = np.random.default_rng(v * k).integers(-128, 128, (v, k), dtype=np.int8)
    tiles = K.head_i8_tiles(rows, v)
    flat = tiles.reshape(-1)
    for r in range(v):
        for j in range(k // 64):
            at = (r // 4 * 4 * k + 256 * j + 64 * (r % 4)) if k % 64 == 0 and r < v // 4 * 4 else r * k + 64 * j
            assert np.array_equal(flat[at : at + 64], rows[r, 64 * j : 64 * j + 64])
    assert np.array_equal(K.head_i8_rows(tiles), rows)
    assert np.array_equal(np.vstack([K.head_i8_rows(tiles[r0 : r0 + 4], v, r0) for r0 in range(0, v, 4)]), rows)


def ref_dot(xq: np.ndarray, q: np.ndarray) -> np.ndarray:
    return xq.astype(np.int64) @ q.astype(np.int64).T


@pytest.mark.parametrize("k", [64, 128, 192, 4096])
@pytest.mark.parametrize("v", [1, 5, 37, 130])
def test_dot_is_exact(kernel_backend, k, v):
    rng = np.random.default_rng(k * 1000 + v)
    q = rng.integers(-127, 128, (v, k), dtype=np.int8)
    q[0, : k // 2] = 127
    q[-1, k // 2 :] = -127
    rowsum = q.sum(axis=1, dtype=np.int32)
    for t in list(range(1, 10)) + [17]:
        xq = rng.integers(-127, 128, (t, k), dtype=np.int8)
        xq[0] = -127
        out = K.head_i8_dot(xq, K.head_i8_tiles(q, v), rowsum)
        assert out.dtype == np.int32 and out.shape == (t, v)
        assert np.array_equal(out, ref_dot(xq, q)), f"T={t}"


def test_dot_extremes_at_the_largest_k(kernel_backend):
    """128^2 K at K = HEAD_I8_MAX_K is just below 2^31: every path stays exact with every int8 value, -128 too."""
    k = K.HEAD_I8_MAX_K
    q = np.stack([np.full(k, -128, np.int8), np.full(k, 127, np.int8), np.full(k, -127, np.int8)])
    xq = np.stack([np.full(k, -128, np.int8), np.full(k, 127, np.int8), np.full(k, -127, np.int8)])
    out = K.head_i8_dot(xq, q, q.sum(axis=1, dtype=np.int32))
    want = ref_dot(xq, q)
    assert want.max() == 128 * 128 * k and want.max() < 2**31
    assert np.array_equal(out, want)


def test_dot_vector_and_given_out(kernel_backend):
    rng = np.random.default_rng(3)
    q = rng.integers(-127, 128, (11, 128), dtype=np.int8)
    x = rng.integers(-127, 128, 128, dtype=np.int8)
    rowsum = q.sum(axis=1, dtype=np.int32)
    y = K.head_i8_dot(x, K.head_i8_tiles(q, 11), rowsum)
    assert y.shape == (11,) and np.array_equal(y, ref_dot(x[None], q)[0])
    out = np.full((2, 11), 7, np.int32)
    assert K.head_i8_dot(np.stack([x, -x]), K.head_i8_tiles(q, 11), rowsum, out) is out
    assert np.array_equal(out, ref_dot(np.stack([x, -x]), q))


def test_dot_of_the_built_head(kernel_backend):
    rng = np.random.default_rng(4)
    w = special_weights(rng, 192)
    q, _, _, _, rowsum = K.head_i8_build(w)
    xq = rng.integers(-127, 128, (3, 192), dtype=np.int8)
    assert np.array_equal(K.head_i8_dot(xq, q, rowsum), ref_dot(xq, K.head_i8_rows(q)))


def test_dot_is_the_same_for_any_thread_count():
    if not K.available():
        pytest.skip("no C extension")
    rng = np.random.default_rng(5)
    q = rng.integers(-128, 128, (9001, 64), dtype=np.int8)  # several sub-blocks and chunks
    xq = rng.integers(-128, 128, (10, 64), dtype=np.int8)
    rowsum = q.sum(axis=1, dtype=np.int32)
    want = ref_dot(xq, q)
    n0 = K.get_num_threads()
    try:
        for n in (1, 2, 3):
            K.set_num_threads(n)
            assert np.array_equal(K.head_i8_dot(xq, K.head_i8_tiles(q, 9001), rowsum), want), f"{n} threads"
    finally:
        K.set_num_threads(n0)


def test_head_i8_path_per_isa():
    if not K.available():
        assert K.head_i8_path() == "numpy"
        return
    f = K.cpu_features()
    vnni = "avx512vnni" if f["avx512vnni"] else "avx2"
    sdot = "neon-dotprod" if f["dotprod"] else "portable"
    want = {"avx512bf16": vnni, "avx512": vnni, "avx2": "avx2", "neon-bf16": sdot, "neon": sdot, "scalar": "portable"}
    try:
        for isa in ISAS:
            K.set_isa(isa)
            assert K.head_i8_path() == want[isa], isa
    finally:
        K.set_isa("auto")


@pytest.mark.parametrize("u", [0, 1, 6, 300])
def test_gather_rows(kernel_backend, u):
    rng = np.random.default_rng(u)
    w = rng.integers(0, 2**16, (257, 96), dtype=np.uint16)
    idx = rng.integers(0, 257, u).astype(np.int64)
    if u:
        idx[0] = 256
    out = K.gather_rows(w, idx)
    assert out.dtype == np.uint16 and np.array_equal(out, w[idx])
    given = np.zeros((u, 96), np.uint16)
    assert K.gather_rows(w, idx, given) is given and np.array_equal(given, w[idx])


def test_torch_bfloat16_weights():
    torch = pytest.importorskip("torch")
    t = torch.randn(5, 64).to(torch.bfloat16)
    bits = t.view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(K.head_i8_rows(K.head_i8_build(t)[0]), ref_build(bits)[0])
    assert np.array_equal(K.gather_rows(t, np.array([4, 0], np.int64)), bits[[4, 0]])


def test_bad_arguments(kernel_backend):
    rng = np.random.default_rng(6)
    w = to_bf16(rng.standard_normal((4, 64)))
    q = rng.integers(-127, 128, (4, 64), dtype=np.int8)
    rowsum = q.sum(axis=1, dtype=np.int32)
    x = np.zeros((2, 64), np.int8)
    with pytest.raises(TypeError, match="w must be uint16"):
        K.head_i8_build(w.astype(np.int16))
    with pytest.raises(ValueError, match="q has shape"):
        K.head_i8_build(w, q=np.empty((4, 63), np.int8))
    with pytest.raises(TypeError, match="scale must be float32"):
        K.head_i8_build(w, scale=np.empty(4, np.float64))
    with pytest.raises(ValueError, match="rowsum has 3 entries"):
        K.head_i8_build(w, rowsum=np.empty(3, np.int32))
    with pytest.raises(ValueError, match="xq has 100 columns, expected a multiple of 64"):
        K.head_i8_dot(np.zeros((1, 100), np.int8), np.zeros((4, 100), np.int8), rowsum)
    with pytest.raises(TypeError, match="xq must be int8"):
        K.head_i8_dot(x.astype(np.uint8), q, rowsum)
    with pytest.raises(TypeError, match="rowsum must be int32"):
        K.head_i8_dot(x, q, rowsum.astype(np.int64))
    with pytest.raises(ValueError, match="q has shape"):
        K.head_i8_dot(x, q[:, :32].copy(), rowsum)
    with pytest.raises(ValueError, match="rowsum has 3 entries"):
        K.head_i8_dot(x, q, rowsum[:3].copy())
    with pytest.raises(ValueError, match="out has shape"):
        K.head_i8_dot(x, q, rowsum, np.empty((2, 5), np.int32))
    with pytest.raises(ValueError, match="C-contiguous"):
        K.head_i8_dot(np.zeros((64, 2), np.int8).T, q, rowsum)
    with pytest.raises(ValueError, match=r"idx\[1\] = 4 is not a row of w's 4"):
        K.gather_rows(w, np.array([0, 4], np.int64))
    with pytest.raises(ValueError, match=r"idx\[0\] = -1 is not a row"):
        K.gather_rows(w, np.array([-1], np.int64))
    with pytest.raises(TypeError, match="idx must be int64"):
        K.gather_rows(w, np.array([0], np.int32))
    with pytest.raises(ValueError, match="out has shape"):
        K.gather_rows(w, np.array([0], np.int64), np.empty((1, 63), np.uint16))


def test_outputs_must_not_overlap_inputs():
    if not K.available():
        pytest.skip("no C extension")
    q = np.zeros((4, 64), np.int8)
    buf = np.zeros(4 * 64 + 16, np.int32)
    with pytest.raises(ValueError, match="must not overlap"):
        K.head_i8_dot(q.view(np.int8)[:1], q, buf[:4], buf[:4].reshape(1, 4))
    w = np.zeros((4, 64), np.uint16)
    with pytest.raises(ValueError, match="must not overlap"):
        K.gather_rows(w, np.array([0], np.int64), w[1:2])
