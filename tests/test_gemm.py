"""The bfloat16 tile path (prefill GEMM, gemm_avx512bf16.c) against the reference and the FP32 tile path it sits
beside: for T > 8 tokens whose every x is an exact bfloat16 (FP8-quantized activations), FP4 and FP8 products run
on vdpbf16ps. Both paths sum exact products in float32, so they differ only in summation order; a token's outputs
do not depend on T, on its place in the batch, or on the thread count; a call whose x does not qualify gives the
FP32 tile path's result bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_kernels import ISAS, assert_close, exact_x, expert_case, fp4_weights, fp8_weights, on_both_paths

from fastar.quant import kernels as K
from fastar.quant import reference as R


@pytest.fixture
def bf16_isa():
    """avx512bf16, the one ISA with a bf16 tile path (NEON-BF16's bf16 path is the dot path's: test_kernels)."""
    if "avx512bf16" not in ISAS:
        pytest.skip("no AVX512_BF16 + AVX512_VBMI on this CPU (or the C extension is not built)")
    K.set_isa("avx512bf16")
    yield
    K.set_isa("auto")


# (T, N, K): T past the dot path, N off the 32-row tile, K ragged against the 128-column tile (FP8: odd K too)
FP8_SHAPES = [
    (9, 37, 96),
    (16, 33, 32),
    (17, 130, 160),
    (40, 61, 288),
    (13, 200, 130),
    (33, 131, 257),
    (20, 77, 1000),
    (12, 40, 4200),
    (64, 64, 4096),
    (100, 45, 1056),
    (9, 1, 1),
]
FP4_SHAPES = [
    (9, 37, 96),
    (16, 33, 32),
    (17, 130, 160),
    (40, 61, 288),
    (100, 45, 1056),
    (23, 19, 4128),
    (64, 64, 4096),
    (11, 300, 224),
]


@pytest.mark.parametrize("t,n,k", FP8_SHAPES)
def test_tile_bf16_fp8_matches_reference(bf16_isa, t, n, k):
    rng = np.random.default_rng(t * 1000 + n + k)
    x = exact_x(rng, t, k)
    w, s = fp8_weights(rng, n, k)
    got, fp32 = on_both_paths(lambda: K.fp8_matmul(x, w, s))
    assert_close(got, x, R.fp8_block_dequant(w, s))
    assert_close(fp32, x, R.fp8_block_dequant(w, s))
    if k >= 1000:  # long sums: the other summation order shows, so the bf16 tile path was taken
        assert not np.array_equal(got, fp32)


@pytest.mark.parametrize("t,n,k", FP4_SHAPES)
def test_tile_bf16_fp4_matches_reference(bf16_isa, t, n, k):
    rng = np.random.default_rng(t * 1000 + n + k)
    x = exact_x(rng, t, k, 3.0)
    w, s = fp4_weights(rng, n, k)
    got, fp32 = on_both_paths(lambda: K.fp4_matmul(x, w, s))
    assert_close(got, x, R.fp4_decode(w, s))
    if k >= 1000:
        assert not np.array_equal(got, fp32)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_tile_bf16_fp8_special_values(bf16_isa):
    """NaN codes and NaN scales poison what the FP32 tile path poisons; denormal, tiny and huge scales stay exact;
    e4m3 denormals and +-448 decode exactly."""
    rng = np.random.default_rng(4)
    for t in (9, 17, 30):
        n, k = 260, 300
        x = exact_x(rng, t, k)
        w, s = fp8_weights(rng, n, k)
        s[0, 0], s[0, 1], s[1, 2], s[2, 0], s[1, 0] = 0, 1, 247, 255, 254
        w[5, 17] = 0x7F
        w[131, :] = rng.choice(np.array([0x00, 0x01, 0x07, 0x80, 0x81, 0x7E, 0xFE], np.uint8), k)
        w[128:256, 256:] &= 0x8F
        w[128:256, :128] &= 0x87
        w[130, 299] = 0xFF
        got, fp32 = on_both_paths(lambda: K.fp8_matmul(x, w, s))  # noqa: B023 (called at once)
        assert_close(got, x, R.fp8_block_dequant(w, s))
        assert np.array_equal(np.isnan(got), np.isnan(fp32)) and np.array_equal(np.isinf(got), np.isinf(fp32))
        assert np.isnan(got[:, 5]).all() and np.isnan(got[:, 130]).all() and np.isnan(got[:, 256:]).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_tile_bf16_fp4_special_scales(bf16_isa):
    rng = np.random.default_rng(8)
    for t in (9, 20):
        n, k = 70, 192
        x = exact_x(rng, t, k)
        w, s = fp4_weights(rng, n, k)
        s[:10] = rng.choice(np.array([0, 1, 2, 3, 9], np.uint8), s[:10].shape)  # denormal-range weights
        s[10:20] = rng.integers(140, 160, s[10:20].shape, dtype=np.uint8)
        s[20, 3], s[33, 0] = 255, 0
        w[40:45], w[45:50] = 0x77, 0xFF
        got, fp32 = on_both_paths(lambda: K.fp4_matmul(x, w, s))  # noqa: B023
        assert_close(got, x, R.fp4_decode(w, s))
        assert np.array_equal(np.isnan(got), np.isnan(fp32)) and np.isnan(got[:, 20]).all()
        assert np.all(np.abs(got[:, :10]) > 0) or np.any(R.fp4_decode(w[:10], s[:10]) == 0)  # not flushed


def test_tile_bf16_fp4_folds_scales_per_tile(bf16_isa):
    """FP4 tiles whose every scale is within 2^-54 ... 2^38 get their scales folded into the bfloat16 weights (one
    running sum per token and row); a tile with any scale outside keeps them in float32, on its own: rows of other
    row tiles keep their bits, and both kinds match the reference, at both ends of the range and just past them."""
    rng = np.random.default_rng(31)
    t, n, k = 30, 100, 1024
    x = exact_x(rng, t, k)
    w, s = fp4_weights(rng, n, k)
    base = K.fp4_matmul(x, w, s)
    assert_close(base, x, R.fp4_decode(w, s))
    for lo, hi in ((73, 80), (160, 165), (66, 73), (165, 172), (0, 140)):
        s2 = s.copy()
        s2[:32, 4:8] = rng.integers(lo, hi + 1, (32, 4), dtype=np.uint8)  # row tile 0, k-block 1
        s2[5, 6] = hi  # the range's end, or a scale past it
        xs = x * np.float32(2.0**-40) if hi >= 160 else x  # keep the sums of huge scales finite
        with np.errstate(over="ignore", invalid="ignore"):
            got = K.fp4_matmul(xs, w, s2)
            assert_close(got, xs, R.fp4_decode(w, s2))
        if hi < 160:
            assert np.array_equal(got[:, 32:], base[:, 32:]), (lo, hi)  # other row tiles: untouched bits
            assert np.array_equal(K.fp4_matmul(np.ascontiguousarray(x[7:20]), w, s2), got[7:20])


@pytest.mark.parametrize("k", [64, 128, 160])
def test_tile_bf16_fp4_fold_is_decided_per_row_tile(bf16_isa, k):
    """Whether a tile's scales fold is decided from its own rows' scales only, in a full 128-column tile (one scale
    dword per row) and in a short last one (k = 64: 2 groups; k = 160: a full tile, then 1 group), rows past N
    (the last row tile has 4) included: a tile folds exactly when the unfolded order (forced for a whole call by a
    tiny x in it) gives other bits, and a scale just below the range in one row of each of its k-blocks unfolds
    that row tile only."""
    rng = np.random.default_rng(40 + k)
    t, n = 30, 100
    x = exact_x(rng, t, k)
    w, s = fp4_weights(rng, n, k, scales=(73, 121))  # spread: folding changes the rounding of the sums
    tiny = np.concatenate([x, x[:1] * np.float32(2.0**-80)])  # a nonzero below 2^-64: no tile of the call folds

    def folded_and_unfolded(s2):
        got = K.fp4_matmul(x, w, s2)
        assert_close(got, x, R.fp4_decode(w, s2))
        return got, K.fp4_matmul(tiny, w, s2)[:t]

    got, unf = folded_and_unfolded(s)
    for r0 in range(0, n, 32):  # every row tile folded: other bits than the unfolded order somewhere
        assert not np.array_equal(got[:, r0 : r0 + 32], unf[:, r0 : r0 + 32]), r0
    s2 = s.copy()
    s2[37, [*range(0, k // 32, 4), k // 32 - 1]] = 72  # row tile 1, each k-block's first and the last group
    got2, unf2 = folded_and_unfolded(s2)
    assert np.array_equal(got2[:, 32:64], unf2[:, 32:64])  # that row tile unfolded
    for r0 in (0, 64, 96):
        assert np.array_equal(got2[:, r0 : r0 + 32], got[:, r0 : r0 + 32]), r0  # the others as before


def test_tile_bf16_fp4_tiny_x_keeps_scales_apart(bf16_isa):
    """x below 2^-64 in a call (still an exact bfloat16 above x_kind's 2^-110) keeps every FP4 scale in float32: folded,
    2^-80 x 2^-54-scaled products would be float32 denormals that vdpbf16ps flushes to zero. Such a call's other
    tokens then get the unfolded summation order (the one case where a batch-mate changes a token's bits)."""
    rng = np.random.default_rng(32)
    t, n, k = 20, 64, 1024
    x = exact_x(rng, t, k)
    w, s = fp4_weights(rng, n, k, scales=(73, 121))  # spread: folding changes the rounding of the sums
    x[4] *= np.float32(2.0**-80)  # still exact bfloat16s, all above 2^-110
    assert np.abs(x[4][x[4] != 0]).min() >= 2.0**-110
    got = K.fp4_matmul(x, w, s)
    assert_close(got, x, R.fp4_decode(w, s))
    assert np.count_nonzero(got[4]) > n // 2  # not flushed
    normal = np.ascontiguousarray(np.delete(x, 4, axis=0))
    alone = K.fp4_matmul(normal, w, s)
    assert_close(alone, normal, R.fp4_decode(w, s))
    assert not np.array_equal(alone, np.delete(got, 4, axis=0))  # folded without the tiny token: another order


@pytest.mark.parametrize("t", [13, 24, 25, 523])
def test_tile_bf16_token_groups(bf16_isa, t):
    """x is copied in groups of 12 tokens; ragged last groups and panels: every token as in a call of its own block."""
    rng = np.random.default_rng(t)
    k = 384
    x = exact_x(rng, t, k)
    w4, s4 = fp4_weights(rng, 40, k)
    w8, s8 = fp8_weights(rng, 40, k - 1)
    x8 = np.ascontiguousarray(x[:, : k - 1])
    for product, xa, deq in (
        (lambda a: K.fp4_matmul(a, w4, s4), x, R.fp4_decode(w4, s4)),
        (lambda a: K.fp8_matmul(a, w8, s8), x8, R.fp8_block_dequant(w8, s8)),
    ):
        full = product(xa)
        assert_close(full, xa, deq)
        assert np.array_equal(product(np.ascontiguousarray(xa[t - 9 :])), full[t - 9 :])


@pytest.mark.parametrize("k", [512, 4096])
def test_tile_bf16_is_batch_invariant(bf16_isa, k):
    """A token's outputs on the tile path are the same in every chunk of more than 8 tokens and at every place."""
    rng = np.random.default_rng(k + 3)
    x = exact_x(rng, 40, k)
    w4, s4 = fp4_weights(rng, 70, k)
    w8, s8 = fp8_weights(rng, 70, k)
    for product in (lambda a: K.fp4_matmul(a, w4, s4), lambda a: K.fp8_matmul(a, w8, s8)):
        full = product(x)
        for t0, t1 in ((0, 9), (0, 13), (5, 40), (17, 35), (3, 29)):
            assert np.array_equal(product(np.ascontiguousarray(x[t0:t1])), full[t0:t1]), (t0, t1)


def test_tile_bf16_panels_do_not_change_results(bf16_isa):
    """Past 512 tokens a call runs in token panels, and past ~1 MB of x in K panels that continue each row's running
    sum from out: the results still match the reference, every token's outputs are those it gets in a small call,
    and adding into zeros gives the plain product bit for bit (each panel resumes the sum exactly where the last one
    stored it)."""
    rng = np.random.default_rng(21)
    t, n, k = 1100, 70, 3000  # 3 token panels of ~367 tokens, 3 K panels of 1408 columns, ragged tiles
    x = exact_x(rng, t, k)
    w4, s4 = fp4_weights(rng, n, k - k % 32)
    w8, s8 = fp8_weights(rng, n, k)
    x4 = np.ascontiguousarray(x[:, : k - k % 32])
    for product, xa, deq in (
        (lambda a, **kw: K.fp8_matmul(a, w8, s8, **kw), x, R.fp8_block_dequant(w8, s8)),
        (lambda a, **kw: K.fp4_matmul(a, w4, s4, **kw), x4, R.fp4_decode(w4, s4)),
    ):
        full = product(xa)
        assert_close(full, xa, deq)
        for t0, t1 in ((0, 9), (500, 530), (360, 380), (1090, 1100)):
            assert np.array_equal(product(np.ascontiguousarray(xa[t0:t1])), full[t0:t1]), (t0, t1)
        assert np.array_equal(product(xa, out=np.zeros((t, n), np.float32)), full)


def test_tile_bf16_thread_count_does_not_change_results(bf16_isa):
    rng = np.random.default_rng(11)
    x = exact_x(rng, 37, 1024)
    w4, s4 = fp4_weights(rng, 300, 1024)
    w8, s8 = fp8_weights(rng, 300, 1024)
    before = K.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            K.set_num_threads(n)
            results.append((K.fp4_matmul(x, w4, s4), K.fp8_matmul(x, w8, s8)))
        for r in results[1:]:
            assert np.array_equal(r[0], results[0][0]) and np.array_equal(r[1], results[0][1])
    finally:
        K.set_num_threads(before)


def test_tile_bf16_only_for_exact_x(bf16_isa):
    """x that is not all bfloat16 (the reference numerics, wo_a's input) keeps the FP32 tile path bit for bit."""
    rng = np.random.default_rng(12)
    x = exact_x(rng, 20, 1024)
    x[7, 3] += 2.0**-20 * abs(x[7, 3]) + 2.0**-30  # one inexact value
    w8, s8 = fp8_weights(rng, 90, 1024)
    got, fp32 = on_both_paths(lambda: K.fp8_matmul(x, w8, s8))
    assert np.array_equal(got, fp32)


def test_tile_bf16_grouped_takes_one_path(bf16_isa):
    """A grouped product (wo_a's) past 8 tokens copies each group's x to bfloat16 straight from the call's x: with
    every x exact, each group equals its own product on the bf16 tile path; one inexact x in one group sends every
    group to the FP32 tile path (one path per call), bit for bit."""
    rng = np.random.default_rng(14)
    t, g, r, k = 20, 4, 128, 1024
    x = exact_x(rng, t, g * k)
    w8, s8 = fp8_weights(rng, g * r, k)
    got, fp32 = on_both_paths(lambda: K.fp8_matmul(x, w8, s8, groups=g))
    for i in range(g):
        one = K.fp8_matmul(np.ascontiguousarray(x[:, i * k : (i + 1) * k]), w8[i * r : (i + 1) * r], s8[i : i + 1])
        assert np.array_equal(got[:, i * r : (i + 1) * r], one), i
    assert not np.array_equal(got, fp32)
    x[11, 2 * k + 5] += 2.0**-20 * abs(x[11, 2 * k + 5]) + 2.0**-30  # one inexact value, in group 2
    got, fp32 = on_both_paths(lambda: K.fp8_matmul(x, w8, s8, groups=g))
    assert np.array_equal(got, fp32)


def test_tile_bf16_accumulates(bf16_isa):
    rng = np.random.default_rng(13)
    x = exact_x(rng, 19, 640)
    w8, s8 = fp8_weights(rng, 100, 640)
    w4, s4 = fp4_weights(rng, 100, 640)
    base = rng.standard_normal((19, 100)).astype(np.float32)
    for product in (lambda a, **kw: K.fp8_matmul(a, w8, s8, **kw), lambda a, **kw: K.fp4_matmul(a, w4, s4, **kw)):
        plain = product(x)
        acc = product(x, out=base.copy())
        # out += the tile sums: one rounding per 128-column tile, so compare within float32 rounding
        np.testing.assert_allclose(acc, base + plain, rtol=1e-5, atol=1e-5 * float(np.abs(plain).max()))


@pytest.mark.parametrize("t", [12, 40])
def test_tile_bf16_expert_ffn(bf16_isa, t):
    """A routed expert with more than 8 tokens and act_block=128: its three products take the tile path on bf16 and
    the result is their composition."""
    d = 256
    _, x, (w1, s1, w3, s3, w2, s2), rw = expert_case(90 + t, t, d, 384, 3.0)
    out = K.expert_ffn(x, w1, s1, w3, s3, w2, s2, rw, 10.0, np.zeros((t, d), np.float32), act_block=128)
    xq = K.fp8_act_quant(x, 128)
    h = (K.swiglu_limited(K.fp4_matmul(xq, w1, s1), K.fp4_matmul(xq, w3, s3), 10.0) * rw[:, None]).astype(np.float32)
    want = K.fp4_matmul(K.fp8_act_quant(h, 128), w2, s2)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_bf16_dot_peak_probe(bf16_isa):
    s, flops = K._C.bf16_dot_peak(10_000)
    assert s > 0 and flops == 8 * K.get_num_threads() * 10_000 * 12 * 64


def test_prefill_products_benchmark_reports_both_paths(bf16_isa):
    from fastar.bench.kernels import prefill_products

    rows = prefill_products(tokens=16, rounds=1)
    assert {(r["product"], r["path"]) for r in rows} == {
        (p, i)
        for p in ("fp8 4096x4096", "fp8 4096x8192", "fp4 2048x4096", "fp4 4096x2048")
        for i in ("avx512bf16", "avx512")
    }
    assert all(
        r["gflops_per_cpu_s"] > 0 and r["fraction"] == r["gflops_per_cpu_s"] / r["peak_gflops_per_cpu_s"] for r in rows
    )
    assert K.get_isa() == "avx512bf16"  # restored ("auto" picks it on this CPU)
