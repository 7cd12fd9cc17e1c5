"""fastar.quant.kernels against fastar.quant.reference: every kernel, every instruction set this CPU runs, the
numpy fallback, awkward shapes, extreme and special scales, bad inputs, threading and the GIL.

Tolerance: |kernel - exact| <= 1e-5 * (|x| @ |W|.T) (+ a denormal floor), where `exact` is the float64 product
of the reference's dequantized weights: the kernels differ from the reference only in float32 summation order.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from fastar.quant import kernels as K
from fastar.quant import reference as R

RTOL = 1e-5
ISAS = K.cpu_features()["usable_isas"] if K.available() else []


def assert_close(got: np.ndarray, x: np.ndarray, w_deq: np.ndarray, base: np.ndarray | None = None) -> None:
    x64, w64 = x.astype(np.float64), w_deq.astype(np.float64)
    exact = x64 @ w64.T + (0 if base is None else base)
    with np.errstate(invalid="ignore"):
        bound = RTOL * (np.abs(x64) @ np.abs(w64).T) + x.shape[1] * 2.0**-148
    nan = np.isnan(exact)
    assert np.array_equal(np.isnan(got), nan), "NaN pattern differs from the reference"
    err = np.abs(got[~nan] - exact[~nan])
    assert np.all(err <= bound[~nan]), f"max error / bound = {np.max(err / np.maximum(bound[~nan], 1e-300)):.3g}"


def fp4_weights(rng, n: int, k: int, scales=(118, 131)) -> tuple[np.ndarray, np.ndarray]:
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)  # includes +-0 and the +-6 extremes
    s = rng.integers(scales[0], scales[1], (n, k // 32), dtype=np.uint8)
    return R.fp4_pack(codes), s


def fp8_weights(rng, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    w = rng.integers(0, 256, (n, k), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0x7E  # no NaN codes (tested separately); keeps +-448 and denormals
    s = rng.integers(118, 131, (-(-n // 128), -(-k // 128)), dtype=np.uint8)
    return w, s


# --- products vs reference ------------------------------------------------------------------------------

# (T, N, K): odd T, N off every tile size, K a multiple of 32 but not of 128/256, slices with ragged ends
FP4_SHAPES = [(1, 37, 96), (3, 130, 160), (17, 61, 288), (5, 33, 32), (4, 45, 1056), (2, 19, 4128), (1, 64, 4096)]


@pytest.mark.parametrize("t,n,k", FP4_SHAPES)
def test_fp4_matches_reference(kernel_backend, t, n, k):
    rng = np.random.default_rng(t * 1000 + n + k)
    x = rng.standard_normal((t, k)).astype(np.float32)
    w, s = fp4_weights(rng, n, k)
    assert_close(K.fp4_matmul(x, w, s), x, R.fp4_decode(w, s))


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_fp4_special_scales(kernel_backend):
    """UE8M0 byte 0 (2^-127, denormal) and other tiny scales, huge ones, and 255 (NaN) in some groups."""
    rng = np.random.default_rng(7)
    for t in (1, 3, 17):
        n, k = 70, 192
        x = rng.standard_normal((t, k)).astype(np.float32)
        w, s = fp4_weights(rng, n, k)
        s[:10] = rng.choice(np.array([0, 1, 2, 3, 9], np.uint8), s[:10].shape)  # denormal-range weights
        s[10:20] = rng.integers(140, 160, s[10:20].shape, dtype=np.uint8)  # large but finite products
        s[20, 3] = 255  # NaN scale: the reference's whole row is NaN
        s[33, 0] = 0
        w[40:45] = 0x77  # +6 +6: the extremes everywhere
        w[45:50] = 0xFF  # -6 -6
        got = K.fp4_matmul(x, w, s)
        assert_close(got, x, R.fp4_decode(w, s))
        assert np.isnan(got[:, 20]).all()
        # the denormal rows are not flushed to zero
        assert np.all(np.abs(got[:, :10]) > 0) or np.any(R.fp4_decode(w[:10], s[:10]) == 0)


@pytest.mark.parametrize(
    "t,n,k", [(1, 1, 1), (1, 129, 7), (3, 200, 130), (17, 131, 257), (4, 77, 1000), (2, 40, 4200), (5, 128, 128)]
)
def test_fp8_matches_reference(kernel_backend, t, n, k):
    rng = np.random.default_rng(t * 1000 + n + k)
    x = rng.standard_normal((t, k)).astype(np.float32)
    w, s = fp8_weights(rng, n, k)
    assert_close(K.fp8_matmul(x, w, s), x, R.fp8_block_dequant(w, s))


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_fp8_special_values(kernel_backend):
    """NaN codes (0x7f, 0xff) poison their row; tiny, zero and huge block scales stay exact."""
    rng = np.random.default_rng(3)
    for t in (1, 17):
        n, k = 260, 300
        x = rng.standard_normal((t, k)).astype(np.float32)
        w, s = fp8_weights(rng, n, k)
        s[0, 0], s[0, 1], s[1, 2], s[2, 0] = 0, 1, 247, 255  # denormal, tiny, x256-overflowing, NaN scale
        w[5, 17] = 0x7F
        w[131, :] = rng.choice(np.array([0x00, 0x01, 0x07, 0x80, 0x81, 0x7E, 0xFE], np.uint8), k)  # denormals, +-448
        w[128:256, 256:] &= 0x8F  # |v| <= 2^-6 under the 2^120 scale keeps the reference finite
        w[130, 299] = 0xFF
        got = K.fp8_matmul(x, w, s)
        assert_close(got, x, R.fp8_block_dequant(w, s))
        assert np.isnan(got[:, 5]).all() and np.isnan(got[:, 130]).all()


@pytest.mark.parametrize("t,n,k", [(1, 3, 1), (3, 37, 33), (17, 50, 301), (4, 33, 1030), (2, 20, 4097)])
def test_bf16_matches_reference(kernel_backend, t, n, k):
    rng = np.random.default_rng(t * 1000 + n + k)
    x = rng.standard_normal((t, k)).astype(np.float32)
    w = R.bf16_encode(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    assert_close(K.bf16_matmul(x, w), x, R.bf16_decode(w))


def test_accumulate_and_vector_forms(kernel_backend):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w, s = fp4_weights(rng, 40, 64)
    base = rng.standard_normal((3, 40)).astype(np.float32)
    out = base.copy()
    assert K.fp4_matmul(x, w, s, out=out) is out
    assert_close(out, x, R.fp4_decode(w, s), base=base.astype(np.float64))
    y1 = K.fp4_matmul(x[1], w, s)
    assert y1.shape == (40,)
    assert_close(y1[None], x[1:2], R.fp4_decode(w, s))


def test_empty_shapes(kernel_backend):
    rng = np.random.default_rng(0)
    w, s = fp4_weights(rng, 5, 64)
    assert K.fp4_matmul(np.zeros((0, 64), np.float32), w, s).shape == (0, 5)
    w8, s8 = fp8_weights(rng, 0, 10)
    assert K.fp8_matmul(np.ones((2, 10), np.float32), w8, s8).shape == (2, 0)
    y = K.bf16_matmul(np.ones((2, 0), np.float32), np.zeros((3, 0), np.uint16))
    assert y.shape == (2, 3) and not y.any()


def test_torch_tensors_are_viewed_not_copied(kernel_backend):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    w = rng.standard_normal((20, 96)).astype(np.float32)
    wb = torch.from_numpy(w).bfloat16()  # torch bfloat16 is read as its uint16 bits
    out = torch.zeros(3, 20)
    K.bf16_matmul(torch.from_numpy(x), wb, out=out)  # accumulates into the tensor's memory
    assert_close(out.numpy(), x, wb.float().numpy())
    w4, s4 = fp4_weights(rng, 20, 96)
    y = K.fp4_matmul(torch.from_numpy(x), torch.from_numpy(w4), torch.from_numpy(s4))
    assert_close(y, x, R.fp4_decode(w4, s4))


# --- the fused expert -----------------------------------------------------------------------------------


def expert_exact(x, w1, s1, w3, s3, w2, s2, rw, limit, base):
    """float64 result and an error bound that propagates each product's float32 tolerance through the SwiGLU."""
    x64 = x.astype(np.float64)
    W1, W3, W2 = (R.fp4_decode(a, b).astype(np.float64) for a, b in ((w1, s1), (w3, s3), (w2, s2)))
    g, u = x64 @ W1.T, x64 @ W3.T
    eg, eu = RTOL * (np.abs(x64) @ np.abs(W1).T), RTOL * (np.abs(x64) @ np.abs(W3).T)
    if limit > 0:
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    sg = g / (1 + np.exp(-g))
    h = sg * u * rw[:, None]
    eh = (1.1 * np.abs(u) * eg + np.abs(sg) * eu + 1e-6 * np.abs(sg * u)) * np.abs(rw)[:, None]
    out = base + h @ W2.T
    bound = (eh + RTOL * np.abs(h)) @ np.abs(W2).T + 1e-6 * np.abs(base) + 1e-30
    return out, bound


def expert_case(seed: int, t: int, d: int, i: int, x_scale: float):
    """x [t, d], (w1, s1, w3, s3, w2, s2) of an expert of width i, routing weights [t]."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t, d)) * x_scale).astype(np.float32)
    weights = (
        *fp4_weights(rng, i, d, (124, 128)),
        *fp4_weights(rng, i, d, (124, 128)),
        *fp4_weights(rng, d, i, (120, 126)),
    )
    return rng, x, weights, rng.random(t).astype(np.float32)


@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_expert_ffn_matches_reference(kernel_backend, t, limit):
    d = 160
    rng, x, (w1, s1, w3, s3, w2, s2), rw = expert_case(t + int(limit), t, d, 96, 2.0)
    base = rng.standard_normal((t, d)).astype(np.float32)
    out = base.copy()
    K.expert_ffn(x, w1, s1, w3, s3, w2, s2, rw, limit, out)
    exact, bound = expert_exact(x, w1, s1, w3, s3, w2, s2, rw, limit, base.astype(np.float64))
    assert np.all(np.abs(out - exact) <= bound)


@pytest.mark.parametrize("t", [1, 5, 17])
def test_expert_ffn_with_activation_quant_is_the_composition(kernel_backend, t):
    """act_block=128 (official numerics) = quantize x, gate/up, SwiGLU times the routing weight, quantize, down."""
    d = 256
    _, x, (w1, s1, w3, s3, w2, s2), rw = expert_case(40 + t, t, d, 384, 3.0)
    out = np.zeros((t, d), np.float32)
    K.expert_ffn(x, w1, s1, w3, s3, w2, s2, rw, 10.0, out, act_block=128)
    xq = K.fp8_act_quant(x, 128)
    h = (K.swiglu_limited(K.fp4_matmul(xq, w1, s1), K.fp4_matmul(xq, w3, s3), 10.0) * rw[:, None]).astype(np.float32)
    want = K.fp4_matmul(K.fp8_act_quant(h, 128), w2, s2)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    assert not np.allclose(out, K.expert_ffn(x, w1, s1, w3, s3, w2, s2, rw, 10.0, np.zeros_like(out)), rtol=1e-4)


@pytest.mark.parametrize("act_block", [0, 128])
def test_experts_ffn_equals_expert_ffn_then_index_add(kernel_backend, act_block):
    """A layer's experts in one call: bit-identical to expert_ffn per expert with the outputs added in the given
    order (single tokens, shared tokens, a tile-path expert with more than 8 tokens)."""
    rng = np.random.default_rng(31 + act_block)
    t, d, i = 12, 160, 96
    x = (rng.standard_normal((t, d)) * 2).astype(np.float32)
    experts = [expert_case(40 + e, 1, d, i, 1.0)[2] for e in range(4)]
    token_sets = [np.array([3]), np.array([0, 3, 7]), np.arange(t), np.array([5, 11])]
    rows = np.concatenate(token_sets)
    offsets = np.cumsum([0] + [len(s_) for s_ in token_sets])
    route_w = rng.random(len(rows)).astype(np.float32)
    base = rng.standard_normal((t, d)).astype(np.float32)
    want = base.copy()
    for e, tok in enumerate(token_sets):
        y = K.expert_ffn(
            np.ascontiguousarray(x[tok]),
            *experts[e],
            route_w[offsets[e] : offsets[e + 1]],
            10.0,
            np.zeros((len(tok), d), np.float32),
            act_block=act_block,
        )
        want[tok] += y
    got = K.experts_ffn(x, experts, rows, offsets, route_w, 10.0, base.copy(), act_block=act_block)
    np.testing.assert_array_equal(got, want)


def test_experts_ffn_bad_inputs():
    x = np.zeros((2, 64), np.float32)
    ex = expert_case(1, 1, 64, 32, 1.0)[2]
    ok = dict(rows=np.array([0, 1]), offsets=np.array([0, 2]), route_w=np.ones(2, np.float32))
    with pytest.raises(ValueError, match="offsets"):
        K.experts_ffn(x, [ex], np.array([0, 1]), np.array([0, 1]), np.ones(2, np.float32), 1.0, np.zeros_like(x))
    with pytest.raises(ValueError, match="no tokens"):
        K.experts_ffn(x, [ex, ex], np.array([0, 1]), np.array([0, 2, 2]), np.ones(2, np.float32), 1.0, np.zeros_like(x))
    if K.available():
        with pytest.raises(ValueError, match="not a token"):
            K.experts_ffn(x, [ex], np.array([0, 2]), ok["offsets"], ok["route_w"], 1.0, np.zeros_like(x))
        with pytest.raises(ValueError, match="w2"):
            K.experts_ffn(x, [ex[:4] + (ex[4][:10], ex[5])], **ok, limit=1.0, out=np.zeros_like(x))
        with pytest.raises(ValueError, match="6"):
            K.experts_ffn(x, [ex[:5]], **ok, limit=1.0, out=np.zeros_like(x))


def test_fp8_act_quant_backends_agree():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 1000)) * np.logspace(-6, 4, 1000)).astype(np.float32)
    x[1, 7], x[2, 300] = np.nan, np.inf
    want = R.fp8_act_quant(x, 128)
    got = K.fp8_act_quant(x, 128)
    assert np.array_equal(got, want, equal_nan=True)


def test_expert_ffn_bad_inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    w1, s1 = fp4_weights(rng, 32, 64)
    w2, s2 = fp4_weights(rng, 64, 32)
    rw, out = np.ones(2, np.float32), np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="w3"):
        K.expert_ffn(x, w1, s1, w1[:16], s1[:16], w2, s2, rw, 10.0, out)
    with pytest.raises(ValueError, match="route_w"):
        K.expert_ffn(x, w1, s1, w1, s1, w2, s2, np.ones(3, np.float32), 10.0, out)
    with pytest.raises(TypeError, match="out"):
        K.expert_ffn(x, w1, s1, w1, s1, w2, s2, rw, 10.0, out.astype(np.float64))
    ro = out.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        K.expert_ffn(x, w1, s1, w1, s1, w2, s2, rw, 10.0, ro)


# --- bad inputs -----------------------------------------------------------------------------------------


def test_bad_inputs_raise(kernel_backend):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w, s = fp4_weights(rng, 40, 64)
    with pytest.raises(TypeError, match="float32"):
        K.fp4_matmul(x.astype(np.float64), w, s)
    with pytest.raises(TypeError, match="uint8"):
        K.fp4_matmul(x, w.astype(np.int16), s)
    with pytest.raises(ValueError, match="contiguous"):
        K.fp4_matmul(np.asfortranarray(x), w, s)
    with pytest.raises(ValueError):
        K.fp4_matmul(x, w[:, :16], s)  # K/2 mismatch
    with pytest.raises(ValueError):
        K.fp4_matmul(x, w, s[:, :1])  # scale shape
    with pytest.raises(ValueError, match="multiple of 32"):
        K.fp4_matmul(x[:, :48].copy(), w[:, :24].copy(), s[:, :1].copy())
    with pytest.raises(ValueError):
        K.fp4_matmul(x, w, s, out=np.zeros((3, 41), np.float32))
    with pytest.raises(TypeError):
        K.fp4_matmul([[1.0]], w, s)
    w8, s8 = fp8_weights(rng, 40, 64)
    with pytest.raises(ValueError):
        K.fp8_matmul(x, w8, s8[:, :0])
    with pytest.raises(TypeError, match="uint16"):
        K.bf16_matmul(x, w8)


@pytest.mark.skipif(not K.available(), reason="C extension not built")
def test_c_only_checks():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 40)).astype(np.float32)
    w, s = fp8_weights(rng, 40, 40)
    with pytest.raises(ValueError, match="overlap"):
        K.fp8_matmul(x, w, s, out=x)
    with pytest.raises(ValueError, match="unknown ISA"):
        K.set_isa("sse9")
    with pytest.raises(ValueError):
        K.set_num_threads(0)


# --- threads and the GIL --------------------------------------------------------------------------------


@pytest.mark.skipif(not K.available(), reason="C extension not built")
@pytest.mark.parametrize("quantized", [False, True])  # True: FP8-quantized x (the bf16 dot path where there is one)
@pytest.mark.parametrize("isa", ISAS)
def test_thread_count_does_not_change_results(isa, quantized):
    rng = np.random.default_rng(5)
    K.set_isa(isa)
    before = K.get_num_threads()
    try:
        for t in (1, 3, 8, 17):
            x = exact_x(rng, t, 512) if quantized else rng.standard_normal((t, 512)).astype(np.float32)
            w, s = fp4_weights(rng, 300, 512)
            w8, s8 = fp8_weights(rng, 300, 512)
            results = []
            for n in (1, 2, 3):
                K.set_num_threads(n)
                results.append((K.fp4_matmul(x, w, s), K.fp8_matmul(x, w8, s8)))
            for r in results[1:]:
                assert np.array_equal(r[0], results[0][0]) and np.array_equal(r[1], results[0][1])
    finally:
        K.set_num_threads(before)
        K.set_isa("auto")


@pytest.mark.parametrize("k", [512, 992, 4096, 8192])
@pytest.mark.parametrize("isa", ISAS)  # a promise of every dot path, the portable one included
def test_small_batches_are_batch_invariant(isa, k):
    """A token's outputs do not depend on how many tokens share the call (up to the dot path's 8): a speculative
    verify pass reproduces plain decode bit for bit."""
    K.set_isa(isa)
    rng = np.random.default_rng(k)
    x = rng.standard_normal((8, k)).astype(np.float32)
    w4, s4 = fp4_weights(rng, 70, k)
    w8, s8 = fp8_weights(rng, 70, k)
    wb = (rng.standard_normal((70, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    for product in (
        lambda a: K.fp4_matmul(a, w4, s4),
        lambda a: K.fp8_matmul(a, w8, s8),
        lambda a: K.bf16_matmul(a, wb),
    ):
        alone = np.concatenate([product(x[t : t + 1]) for t in range(8)])
        for T in range(2, 9):
            assert np.array_equal(product(x[:T]), alone[:T]), T
    K.set_isa("auto")


@pytest.mark.parametrize("n, k", [(37, 1000), (9, 4096), (1, 96)])
@pytest.mark.parametrize("isa", ISAS)
def test_bf16_weights_several_tokens_match_each_token_alone(isa, n, k):
    """BF16 weights (the LM head of a batched decode step) with 2-8 tokens take rows four at a time (each load of x
    then serves four rows; 5-8 tokens in two halves over the same rows); every (row, token) must still be summed as
    the one-token call sums it: a row count that leaves rows over (they go alone), a K that is not a multiple of 32
    (masked tail), one row."""
    K.set_isa(isa)
    try:
        rng = np.random.default_rng(n * k)
        x = rng.standard_normal((8, k)).astype(np.float32)
        wb = (rng.standard_normal((n, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        alone = np.concatenate([K.bf16_matmul(x[t : t + 1], wb) for t in range(8)])
        for T in range(2, 9):
            assert np.array_equal(K.bf16_matmul(x[:T], wb).view(np.uint32), alone[:T].view(np.uint32)), T
        assert_close(alone, x, R.bf16_decode(wb))
    finally:
        K.set_isa("auto")


@pytest.mark.parametrize(
    "n, k", [(13, 511), (13, 512), (21, 513), (6, 1040), (7, 1555), (300, 200), (3, 17), (1100, 600)]
)
@pytest.mark.parametrize("isa", ISAS)
def test_bf16_weights_any_batch_place_and_block_boundary(isa, n, k):
    """The BF16-weight dot path walks a block of rows K block by K block (512 columns): on AVX-512 at every T, 1 or 4
    rows at a time (5-8 tokens in two halves over the same 4 rows), on AVX2 at 2-8 tokens, 1 or 2 rows and 2 tokens
    at a time (1 token along whole rows); a (row, token) sum must
    come out the same at every T, at every place in the batch, across K block boundaries (K one below, at and one
    above a block, K not a multiple of 32 or of 16, 1555 = 512 + 1043 stretches) and for row counts
    that leave 1-3 rows over (13 = 8 + 4 + 1, 21 = 2 x 8 + 4 + 1, 6 = 4 + 1 + 1, 7 = 4 + 3 x 1, 300 rows over threads),
    and whether or not the kernel copies x into K-block order (only for chunks of rows that make the copy cheap: the
    1100-row product's, at the lower T)."""
    K.set_isa(isa)
    try:
        rng = np.random.default_rng(n + k)
        x = rng.standard_normal((8, k)).astype(np.float32)
        wb = (rng.standard_normal((n, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        alone = np.concatenate([K.bf16_matmul(x[t : t + 1], wb) for t in range(8)]).view(np.uint32)
        for T in range(1, 9):
            for first in sorted({0, 8 - T, (8 - T) // 2}):
                got = K.bf16_matmul(x[first : first + T], wb).view(np.uint32)
                assert np.array_equal(got, alone[first : first + T]), (T, first)
        order = rng.permutation(8)
        assert np.array_equal(K.bf16_matmul(x[order], wb).view(np.uint32), alone[order])
        assert_close(alone.view(np.float32), x, R.bf16_decode(wb))
    finally:
        K.set_isa("auto")


# --- the bf16 dot path (AVX512_BF16 on x86-64, FEAT_BF16 on AArch64) ------------------------------------------
# For T <= 8, a product whose every x is an exact bfloat16 (as FP8-quantized activations are) multiplies with
# vdpbf16ps / BFMLALB+T; any other x takes the FP32 dot path. Both are exact products summed in float32, so they
# differ only in summation order; a call that does not qualify gives exactly the FP32 ISA's result ("avx512",
# "neon"). Both bf16 ISAs run FP4 and FP8 weights on it (BF16 weights take the FP32 path).

# bf16 ISA -> the FP32 ISA it falls back to
BF16_PATHS = {"avx512bf16": "avx512", "neon-bf16": "neon"}
BF16_ISA = next((i for i in BF16_PATHS if i in ISAS), None)


@pytest.fixture
def bf16_isa():
    """This CPU's bf16 dot path ISA (avx512bf16 or neon-bf16) for the test; skipped where the CPU (or build) has
    neither."""
    if BF16_ISA is None:
        pytest.skip("no AVX512_BF16 + AVX512_VBMI nor FEAT_BF16 on this CPU (or the C extension is not built)")
    K.set_isa(BF16_ISA)
    yield BF16_ISA
    K.set_isa("auto")


def exact_x(rng, t: int, k: int, scale: float = 1.0) -> np.ndarray:
    """x as the official numerics hand it to a product: FP8-quantized per 128 values (exact bfloat16s)."""
    return np.ascontiguousarray(R.fp8_act_quant((rng.standard_normal((t, k)) * scale).astype(np.float32), 128))


def on_both_paths(product):
    """(product() on the bf16 dot path ISA, product() on the FP32 one); the test's ISA is restored after."""
    K.set_isa(BF16_ISA)
    a = product()
    K.set_isa(BF16_PATHS[BF16_ISA])
    b = product()
    K.set_isa(BF16_ISA)
    return a, b


def test_cpu_features_report_the_bf16_path():
    f = K.cpu_features()
    assert {"avx512bf16", "avx512vbmi"} <= f.keys()
    if K.available() and f["avx512bf16"] and f["avx512vbmi"] and f["avx512bw"]:
        assert f["usable_isas"][0] == "avx512bf16"
        # the default unless FASTAR_ISA forces a usable one (as a run of the suite on a narrower path does)
        forced = os.environ.get("FASTAR_ISA", "")
        assert K.get_isa() == (forced if forced in f["usable_isas"] else "avx512bf16")


def test_set_isa_names_every_isa_of_this_build():
    if not K.available():
        pytest.skip("needs the compiled kernels")
    with pytest.raises(ValueError, match=r"unknown ISA 'nope' \(.*scalar or auto\)") as e:
        K.set_isa("nope")
    for isa in K.cpu_features()["usable_isas"]:
        assert isa in str(e.value)


@pytest.mark.parametrize(
    "t,n,k",
    [
        (1, 1, 1),
        (1, 129, 7),
        (2, 70, 4096),
        (3, 200, 130),
        (4, 77, 1000),
        (5, 40, 4200),
        (6, 128, 128),
        (7, 33, 257),
        (8, 64, 1024),
    ],
)
def test_bf16_path_fp8_matches_reference(bf16_isa, t, n, k):
    rng = np.random.default_rng(t * 1000 + n + k)
    x = exact_x(rng, t, k)
    w, s = fp8_weights(rng, n, k)
    got, fp32 = on_both_paths(lambda: K.fp8_matmul(x, w, s))
    assert_close(got, x, R.fp8_block_dequant(w, s))
    assert_close(fp32, x, R.fp8_block_dequant(w, s))
    if k >= 1000:  # long sums: the other summation order shows in the last bits, so the bf16 path was taken
        assert not np.array_equal(got, fp32)


@pytest.mark.parametrize(
    "t,n,k",
    [
        (1, 37, 96),
        (3, 130, 160),
        (8, 61, 288),
        (5, 33, 32),
        (4, 45, 1056),
        (2, 19, 4128),
        (1, 64, 4096),
        (6, 50, 2048),
        (7, 21, 224),
    ],
)
def test_bf16_path_fp4_matches_reference(bf16_isa, t, n, k):
    rng = np.random.default_rng(t * 1000 + n + k)
    x = exact_x(rng, t, k, 3.0)
    w, s = fp4_weights(rng, n, k)
    got, fp32 = on_both_paths(lambda: K.fp4_matmul(x, w, s))
    assert_close(got, x, R.fp4_decode(w, s))
    if k >= 1000:
        assert not np.array_equal(got, fp32)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_bf16_path_fp8_special_values(bf16_isa):
    """NaN codes (0x7f, 0xff) and NaN scales poison exactly the outputs the FP32 path poisons; scale bytes 0 (a
    denormal 2^-127), 1, 247 (x256 overflows on the FP32 path), 254 (2^127) stay exact; e4m3 denormals and +-448."""
    rng = np.random.default_rng(4)
    for t in (1, 3, 8):
        n, k = 260, 300
        x = exact_x(rng, t, k)
        w, s = fp8_weights(rng, n, k)
        s[0, 0], s[0, 1], s[1, 2], s[2, 0], s[1, 0] = 0, 1, 247, 255, 254
        w[5, 17] = 0x7F
        w[131, :] = rng.choice(np.array([0x00, 0x01, 0x07, 0x80, 0x81, 0x7E, 0xFE], np.uint8), k)
        w[128:256, 256:] &= 0x8F  # |v| <= 2^-6 under the 2^120 scale keeps the reference finite
        w[128:256, :128] &= 0x87  # and denormals only under 2^127
        w[130, 299] = 0xFF
        got, fp32 = on_both_paths(lambda: K.fp8_matmul(x, w, s))
        assert_close(got, x, R.fp8_block_dequant(w, s))
        assert np.array_equal(np.isnan(got), np.isnan(fp32)) and np.array_equal(np.isinf(got), np.isinf(fp32))
        assert np.isnan(got[:, 5]).all() and np.isnan(got[:, 130]).all() and np.isnan(got[:, 256:]).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_bf16_path_fp4_special_scales(bf16_isa):
    rng = np.random.default_rng(8)
    for t in (1, 4, 8):
        n, k = 70, 192
        x = exact_x(rng, t, k)
        w, s = fp4_weights(rng, n, k)
        s[:10] = rng.choice(np.array([0, 1, 2, 3, 9], np.uint8), s[:10].shape)
        s[10:20] = rng.integers(140, 160, s[10:20].shape, dtype=np.uint8)
        s[20, 3], s[33, 0] = 255, 0  # NaN, the denormal 2^-127
        w[40:45], w[45:50] = 0x77, 0xFF
        got, fp32 = on_both_paths(lambda: K.fp4_matmul(x, w, s))
        assert_close(got, x, R.fp4_decode(w, s))
        assert np.array_equal(np.isnan(got), np.isnan(fp32)) and np.isnan(got[:, 20]).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered", "ignore:overflow encountered")
@pytest.mark.parametrize("bad", ["tiny", "denormal", "huge", "inf", "nan"])
def test_bf16_path_is_chosen_per_call(bf16_isa, bad):
    """One token outside [2^-94, 2^65) (and not zero) sends the whole call to the FP32 path: the result equals the
    FP32 ISA's bit for bit."""
    rng = np.random.default_rng(6)
    x = exact_x(rng, 5, 1024)
    x[3, 100] = {"tiny": 2.0**-120, "denormal": 1e-40, "huge": 2.0**70, "inf": np.inf, "nan": np.nan}[bad]
    w8, s8 = fp8_weights(rng, 90, 1024)
    w4, s4 = fp4_weights(rng, 90, 1024)
    for product in (lambda a: K.fp8_matmul(a, w8, s8), lambda a: K.fp4_matmul(a, w4, s4)):
        got, fp32 = on_both_paths(lambda: product(x))  # noqa: B023 (called at once)
        assert np.array_equal(got, fp32, equal_nan=True)
        others = np.ascontiguousarray(x[:3])  # without that token the call takes the bf16 path
        got, fp32 = on_both_paths(lambda: product(others))  # noqa: B023
        assert not np.array_equal(got, fp32)
        x0 = x.copy()
        x0[3, 100] = 0.0  # zeros qualify
        got, fp32 = on_both_paths(lambda: product(x0))  # noqa: B023
        assert not np.array_equal(got, fp32)


@pytest.mark.parametrize(
    "exact, value, bf16",
    [
        (True, 2.0**-110, True),  # exponent field 17: the exact range's bottom
        (True, 2.0**-111, False),
        (True, 1.5 * 2.0**64, True),  # field 191: its top
        (True, 2.0**65, False),
        (False, 2.0**-94, True),  # field 33: the split range's bottom (x not all bfloat16)
        (False, 2.0**-95, False),
    ],
)
def test_bf16_path_range_ends_at_a_ragged_end(bf16_isa, exact, value, bf16):
    """The per-call choice at the ends of the exact and split ranges, the deciding value in the last column of a
    ragged K (past the last whole 16 and 128 columns the scan and the bfloat16 copy of x read in): the bf16 path
    (which differs from the FP32 path in summation order) or the FP32 path, bit for bit."""
    rng = np.random.default_rng(7)
    for k, product in (
        (1000, lambda a, w, s: K.fp8_matmul(a, w, s)),
        (992, lambda a, w, s: K.fp4_matmul(a, w, s)),
    ):
        x = exact_x(rng, 3, k) if exact else (rng.standard_normal((3, k)) * 3).astype(np.float32)
        x[2, k - 1] = value
        w, s = fp8_weights(rng, 90, k) if k == 1000 else fp4_weights(rng, 90, k)
        got, fp32 = on_both_paths(lambda: product(x, w, s))  # noqa: B023 (called at once)
        assert np.array_equal(got, fp32) != bf16, (k, value)


@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("kind", ["exact", "split", "none"])
def test_vectorized_x_preparation_equals_its_portable_reference(bf16_isa, t, kind):
    """The ISA's x scan and permuted bfloat16 copy (x_scan, x_bf16) against dispatch.c's portable loops: the same
    path chosen and the same bits, for plain and grouped FP8 / FP4 products with ragged K (exact x, x split in three,
    x the FP32 path must take)."""
    rng = np.random.default_rng(11 + t)

    def x_of(k):
        x = exact_x(rng, t, k) if kind == "exact" else (rng.standard_normal((t, k)) * 3).astype(np.float32)
        if kind == "none":
            x[t - 1, k - 1] = 2.0**-120  # outside the split range: the FP32 path
        return x

    cases = []
    for k in (1000, 4096):
        w, s = fp8_weights(rng, 90, k)
        cases.append((x_of(k), lambda x, w=w, s=s: K.fp8_matmul(x, w, s)))
    w, s = fp4_weights(rng, 70, 992)
    cases.append((x_of(992), lambda x, w=w, s=s: K.fp4_matmul(x, w, s)))
    w, s = fp8_weights(rng, 4 * 128, 640)  # grouped: 4 groups of 128 rows, each over its 640 columns of x
    cases.append((x_of(4 * 640), lambda x, w=w, s=s: K.fp8_matmul(x, w, s, groups=4)))
    for x, product in cases:
        vectorized = product(x)
        was = K.x_prep_isa(False)
        try:
            portable = product(x)
        finally:
            K.x_prep_isa(was)
        assert np.array_equal(vectorized, portable, equal_nan=True), (x.shape, kind)


@pytest.mark.parametrize("t", [1, 2, 3, 5, 8])
def test_bf16_path_splits_x_that_is_not_bf16(bf16_isa, t):
    """Arbitrary float32 x (the unquantized wo_a input, the reference numerics) runs on the bf16 path as three
    exact bfloat16 parts: as close to the reference as the FP32 path, and every token's outputs are bit-identical
    alone and in any batch, bf16-exact batch-mates included (an exact token's parts are (x, 0, 0))."""
    rng = np.random.default_rng(20 + t)
    k = 1056
    x = (rng.standard_normal((t, k)) * 3).astype(np.float32)
    x[0, :5] = [0.0, 2.0**-93, -(2.0**64), 1.0 + 2.0**-23, -(1.0 + 2.0**-9)]  # range ends, every bit used
    if t > 1:
        x[1] = exact_x(rng, 1, k)[0]
    w8, s8 = fp8_weights(rng, 70, k)
    w4, s4 = fp4_weights(rng, 70, k)
    for product, deq in (
        (lambda a: K.fp8_matmul(a, w8, s8), R.fp8_block_dequant(w8, s8)),
        (lambda a: K.fp4_matmul(a, w4, s4), R.fp4_decode(w4, s4)),
    ):
        got, fp32 = on_both_paths(lambda: product(x))  # noqa: B023 (called at once)
        assert_close(got, x, deq)
        assert not np.array_equal(got, fp32)  # the bf16 path was taken: the other summation order shows
        for i in range(t):
            alone = product(np.ascontiguousarray(x[i : i + 1]))  # noqa: B023
            assert np.array_equal(alone[0], got[i])
    base = rng.standard_normal((t, 70)).astype(np.float32)
    acc = K.fp8_matmul(x, w8, s8, out=base.copy())  # the accumulating form adds the same sum
    np.testing.assert_array_equal(acc, base + K.fp8_matmul(x, w8, s8))


@pytest.mark.parametrize("t", [1, 2, 5, 8])
def test_bf16_path_expert_ffn(bf16_isa, t):
    """act_block=128: gate/up see the quantized x and down the quantized mid activation, both exact bfloat16s, so all
    three products take the bf16 path (the result is the composition of bf16-path products); without the
    activation quantization x is arbitrary and the expert equals the FP32 path's bit for bit."""
    d = 256
    _, x, (w1, s1, w3, s3, w2, s2), rw = expert_case(70 + t, t, d, 384, 3.0)
    run = lambda ab: K.expert_ffn(x, w1, s1, w3, s3, w2, s2, rw, 10.0, np.zeros((t, d), np.float32), act_block=ab)  # noqa: E731
    out, fp32 = on_both_paths(lambda: run(128))
    xq = K.fp8_act_quant(x, 128)
    h = (K.swiglu_limited(K.fp4_matmul(xq, w1, s1), K.fp4_matmul(xq, w3, s3), 10.0) * rw[:, None]).astype(np.float32)
    want = K.fp4_matmul(K.fp8_act_quant(h, 128), w2, s2)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    np.testing.assert_allclose(out, fp32, rtol=0, atol=0.05 * float(np.abs(fp32).max()))  # mid quantization may flip
    assert not np.array_equal(out, fp32)
    plain, fp32_plain = on_both_paths(lambda: run(0))
    assert np.array_equal(plain, fp32_plain)


@pytest.mark.parametrize("k", [512, 992, 4096, 8192])
def test_bf16_path_is_batch_invariant(bf16_isa, k):
    """test_small_batches_are_batch_invariant for exact-bfloat16 x: a token's outputs on the bf16 path do not
    depend on how many tokens share the call (up to 8) nor on its place."""
    rng = np.random.default_rng(k + 1)
    x = exact_x(rng, 8, k)
    w4, s4 = fp4_weights(rng, 70, k)
    w8, s8 = fp8_weights(rng, 70, k)
    for product in (lambda a: K.fp4_matmul(a, w4, s4), lambda a: K.fp8_matmul(a, w8, s8)):
        alone = np.concatenate([product(x[t : t + 1]) for t in range(8)])
        for T in range(2, 9):
            assert np.array_equal(product(x[:T]), alone[:T]), T
            assert np.array_equal(product(x[8 - T :]), alone[8 - T :]), T


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_path_row_pairs_are_batch_invariant_at_the_edges(bf16_isa, threads):
    """The bf16 dot path takes two FP4 weight rows at a time (one load of x serves both) and all tokens in one pass;
    FP8 rows with their scales folded into x go 4 at a time (5-8 tokens 2 at a time in one pass, or in two passes of
    4 rows where x' would not stay in L1), one at a time at a block's end: every token of every T in 1..8, at every
    place, must still equal the token alone bit for bit, with an odd row count (a lone last row), rows in two 128-row
    FP8 scale blocks, ragged K (an FP4 row ending in 1 or 3 scale groups, an FP8 row ending in a partial block), NaN
    codes, and scale bytes 0, 255 and other non-normal ones (which switch the FP4 scale decoding of a row, and keep
    FP8 rows on the per-block scales)."""
    rng = np.random.default_rng(17 + threads)
    n = 131
    cases = []
    for k in (224, 4128):
        w4, s4 = fp4_weights(rng, n, k)
        # odd rows are the second of a pair; group 2 lies in the odd last whole chunk at k = 224
        s4[3, 1], s4[5, 2], s4[60, -1], s4[129, 2] = 0, 255, 1, 254
        w4[7, :5] = 0xFF
        w8, s8 = fp8_weights(rng, n, k)
        w8[9, k - 1], w8[11, 3] = 0x7F, 0xFF
        s8n = s8.copy()  # ordinary scales: every token folds them into x (both row blocks)
        s8[0, 1], s8[1, 0] = 0, 255  # rows 128-130 all NaN; no token folds either block: the per-block scales
        cases += [(k, lambda a, w=w4, s=s4: K.fp4_matmul(a, w, s)), (k, lambda a, w=w8, s=s8: K.fp8_matmul(a, w, s))]
        cases += [(k, lambda a, w=w8, s=s8n: K.fp8_matmul(a, w, s))]
    saved = K.get_num_threads()
    try:
        K.set_num_threads(threads)
        for k, product in cases:
            x = exact_x(rng, 8, k)
            alone = np.concatenate([product(x[t : t + 1]) for t in range(8)])
            assert np.isnan(alone).any() and not np.isnan(alone).all()
            for T in range(1, 9):
                for start in range(0, 9 - T, max(1, 8 - T)):
                    got = product(x[start : start + T])
                    assert np.array_equal(got, alone[start : start + T], equal_nan=True), (k, T, start)
            ref = np.concatenate([product(x[t : t + 1]) for t in (7, 0)])  # order of calls does not matter either
            assert np.array_equal(ref, alone[[7, 0]], equal_nan=True)
    finally:
        K.set_num_threads(saved)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("t", [1, 2, 3, 5, 8])
def test_bf16_path_fp8_folds_power_of_two_scales_into_x(bf16_isa, t):
    """The FP8 scales (powers of two) folded into x: each (row, token) one chain of vdpbf16ps over the row, as close to
    the float64 product of the dequantized weights as the per-block scales, in another summation order. A token whose
    x times some scale of a row block would leave the exponent range [17, 191] (x' below 2^-110 or at 2^65 and above)
    keeps that block's per-block scales, bit for bit those of the unfolded path, alone or beside tokens that fold;
    at the range's edges it still folds."""
    rng = np.random.default_rng(40 + t)
    n, k = 300, 1000  # three row blocks, the last one partial; a ragged last column block
    x = exact_x(rng, t, k)
    w, s = fp8_weights(rng, n, k)
    w[7, 3] = 0x7F  # a NaN code poisons its row on both paths
    x[0, 5], x[0, 700] = 2.0**10, 2.0**-60  # exponent fields 137 and 67
    s[1, 0] = 127 + 54  # block (1, 0): x[0, 5] * 2^54 = 2^64, the top of the range: folds
    # block (1, 1)'s terms large enough to count beside x[0, 5]'s: else block (1, 0) alone sets token 0's sums in row
    # block 1, formed by the same chain of 4 vdpbf16ps on both paths, and the summation orders would not show
    s[1, 1] = 127 + 52
    s[2, 5] = 127 - 50  # block (2, 5): x[0, 700] * 2^-50 = 2^-110, the bottom: folds
    deq = R.fp8_block_dequant(w, s)

    def both(a, s=s):
        was = K.fp8_fold(False)
        try:
            unfolded = K.fp8_matmul(a, w, s)
        finally:
            K.fp8_fold(was)
        return K.fp8_matmul(a, w, s), unfolded

    got, unfolded = both(x)
    assert_close(got, x, deq)
    assert np.isnan(got[:, 7]).all() and np.array_equal(np.isnan(got), np.isnan(unfolded))
    for blk in range(3):  # token 0 folds every row block, the edge ones included: the other summation order shows
        rows = slice(128 * blk, 128 * (blk + 1))
        assert not np.array_equal(got[0, rows], unfolded[0, rows], equal_nan=True), blk
    for blk, col, step in ((1, 0, 1), (2, 5, -1)):  # one step past an edge: token 0 keeps that block's per-block scales
        s2 = s.copy()
        s2[blk, col] = int(s[blk, col]) + step
        got2, unfolded2 = both(x, s2)
        assert_close(got2, x, R.fp8_block_dequant(w, s2))
        rows = slice(128 * blk, 128 * (blk + 1))
        assert np.array_equal(got2[0, rows], unfolded2[0, rows], equal_nan=True)
        other = slice(0, 128)  # the token folds the other blocks
        assert not np.array_equal(got2[0, other], unfolded2[0, other], equal_nan=True)
        if t > 1:  # its batch-mates fold the block; every token is itself alone
            assert not np.array_equal(got2[1:, rows], unfolded2[1:, rows], equal_nan=True)
        for i in range(t):
            assert np.array_equal(K.fp8_matmul(np.ascontiguousarray(x[i : i + 1]), w, s2)[0], got2[i], equal_nan=True)
    s3 = s.copy()
    s3[0, 2] = 255  # a NaN scale: no token folds row block 0, whose rows are NaN on both paths
    got3, unfolded3 = both(x, s3)
    assert np.isnan(got3[:, :128]).all() and np.array_equal(got3[:, :128], unfolded3[:, :128], equal_nan=True)
    assert not np.array_equal(got3[:, 128:], unfolded3[:, 128:], equal_nan=True)


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_path_fp8_folded_passes_equal_the_one_token_chain(bf16_isa, threads):
    """The folded FP8 kernel's passes (4 rows x up to 4 tokens; 2 rows x 5-8 tokens where x' stays in L1, here at
    K = 1024, else two passes of 4 rows, here at K = 4192; a lone row at a block's or a thread's end) all form each
    (row, token) total as the same chain of vdpbf16ps: for every T in 1..8 every output equals the token's own
    one-token call bit for bit, and the old pass structure (5-8 tokens as two calls of (T + 1) // 2 and the rest) too.
    A pass that summed in another order (x' halves swapped, a chain split per row block) would differ in the last
    bits. The folded path is the one taken: without folding the same calls give other bits."""
    rng = np.random.default_rng(90 + threads)
    saved = K.get_num_threads()
    try:
        K.set_num_threads(threads)
        for n, k in ((259, 4192), (134, 1024)):  # row blocks with odd ends; a ragged last column block at 4192
            w, s = fp8_weights(rng, n, k)
            x = exact_x(rng, 8, k)
            product = lambda a, w=w, s=s: K.fp8_matmul(np.ascontiguousarray(a), w, s)  # noqa: E731
            alone = np.concatenate([product(x[t : t + 1]) for t in range(8)])
            was = K.fp8_fold(False)
            try:
                unfolded = product(x)
            finally:
                K.fp8_fold(was)
            assert not np.array_equal(alone, unfolded)
            for T in range(1, 9):
                got = product(x[:T])
                assert np.array_equal(got, alone[:T]), (n, k, T)
                if T > 4:
                    h = (T + 1) // 2
                    assert np.array_equal(got, np.concatenate([product(x[:h]), product(x[h:T])])), (n, k, T)
    finally:
        K.set_num_threads(saved)


@pytest.mark.skipif(not K.available(), reason="C extension not built")
def test_concurrent_callers_get_correct_results():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((5, 1024)).astype(np.float32)
    w, s = fp8_weights(rng, 700, 1024)
    want = K.fp8_matmul(x, w, s)
    errors = []

    def call():
        for _ in range(20):
            if not np.array_equal(K.fp8_matmul(x, w, s), want):
                errors.append(1)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors


@pytest.mark.skipif(not K.available(), reason="C extension not built")
def test_back_to_back_jobs_with_late_workers_stay_exact():
    """A thousand small pool jobs in a row, of different sizes, while two busy processes compete for the cores: a
    job completes when its chunks are done, so workers often wake after their job is over; they must never run a
    chunk twice, skip one, or take one of a later job for an earlier one (every result is checked)."""
    import subprocess
    import sys

    rng = np.random.default_rng(10)
    cases = []
    for n in (64, 200, 700):
        x = rng.standard_normal((1, 512)).astype(np.float32)
        w, s = fp8_weights(rng, n, 512)
        cases.append((x, w, s, K.fp8_matmul(x, w, s)))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    threads = K.get_num_threads()
    bad = 0
    try:
        K.set_num_threads(max(2, threads))
        for i in range(1000):
            x, w, s, want = cases[i % 3]
            bad += not np.array_equal(K.fp8_matmul(x, w, s), want)
    finally:
        for p in hogs:
            p.kill()
            p.wait()
        K.set_num_threads(threads)
    assert bad == 0


@pytest.mark.skipif(not K.available(), reason="C extension not built")
def test_a_late_worker_never_claims_a_chunk_of_the_next_job():
    """The interleaving behind a rare wrong forward pass, forced with the pool's test hooks: a worker that has just
    finished a job's last chunk reads the (exhausted) claim counter, then is held up while the caller posts the next,
    larger job. Before the fix its check saw the new job's chunk count beside the old counter, its claim succeeded,
    and it ran a chunk of the new job twice and counted it into the new job's completion (so the job could end with
    a chunk still running). Every chunk must run exactly once, and all before the job returns."""
    threads = K.get_num_threads()
    bad = []
    try:
        K.set_num_threads(2)
        K.pool_test_delays(2000, 5000)
        for i in range(30):
            for n in (2, 64):
                counts = np.zeros(n, np.int64)
                K.pool_probe(counts, 20.0)
                if not (counts == 1).all():
                    bad.append((i, n, np.bincount(counts).tolist()))
    finally:
        K.pool_test_delays(0, 0)
        K.set_num_threads(threads)
    assert not bad, (
        f"{len(bad)} of 60 jobs ran a chunk twice or returned early; (job, chunks, count histogram): {bad[:3]}"
    )


@pytest.mark.skipif(not K.available(), reason="C extension not built")
def test_gil_is_released_during_compute():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 4096)).astype(np.float32)
    w, s = fp8_weights(rng, 1024, 4096)
    before = K.get_num_threads()
    K.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        K.fp8_matmul(x, w, s)
        one = time.perf_counter() - t0
        reps = max(1, int(0.3 / max(one, 1e-4)))  # keep the kernel busy for ~0.3 s
        done = threading.Event()

        def work():
            for _ in range(reps):
                K.fp8_matmul(x, w, s)
            done.set()

        th = threading.Thread(target=work)
        ticks = 0
        th.start()
        while not done.is_set():
            ticks += 1  # only advances while the kernel thread does not hold the GIL
        th.join()
        # a held GIL lets this loop run only between calls (a handful of ticks); released, it runs throughout
        assert ticks > 10000, f"main thread advanced only {ticks} times during {reps} kernel calls"
    finally:
        K.set_num_threads(before)


@pytest.mark.skipif(not K.available(), reason="C extension not built")
def test_small_kernels_check_their_arguments():
    from fastar.quant import _kernels as C

    x = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match="shape"):
        C.fp8_act_quant(x, 32, np.empty((2, 32), np.float32))
    with pytest.raises(TypeError, match="float32"):
        C.fp8_act_quant(x.astype(np.float64), 32, np.empty((2, 64), np.float32))
    with pytest.raises(ValueError, match="positive"):
        C.fp8_act_quant(x, 0, np.empty_like(x))
    C.fp8_act_quant(x, 32, x)  # in place is allowed
    m = np.zeros((3, 16), np.float32)
    with pytest.raises(ValueError, match="overlap"):
        C.sinkhorn(m, 4, 20, 1e-6, m)
    with pytest.raises(ValueError, match="n <= 16"):
        C.sinkhorn(np.zeros((3, 15), np.float32), 4, 20, 1e-6, np.zeros((3, 15), np.float32))
    out = np.empty_like(m)
    C.sinkhorn(m, 4, 20, 1e-6, out)
    assert np.allclose(out.reshape(3, 4, 4).sum(1), 1, atol=1e-5)


@pytest.mark.parametrize("t", [1, 3, 12])
@pytest.mark.parametrize("exact", [True, False])
def test_grouped_products_equal_their_groups(kernel_backend, t, exact):
    """groups=G: one call computes G block-diagonal products (wo_a's); each group equals its own product (the same
    path is chosen for the whole call, here the one each group would take alone), and the accumulating form adds."""
    rng = np.random.default_rng(t + 10 * exact)
    g, r, k = 4, 128, 96
    x = (rng.standard_normal((t, g * k)) * 2).astype(np.float32)
    if exact:
        x = np.ascontiguousarray(R.fp8_act_quant(x, 32))
    w8, s8 = fp8_weights(rng, g * r, k)
    w4, s4 = fp4_weights(rng, g * r, k)
    wb = R.bf16_encode((rng.standard_normal((g * r, k)) * 0.1).astype(np.float32))
    cases = [
        (
            lambda a, **kw: K.fp8_matmul(a, w8, s8, **kw),
            lambda a, i: K.fp8_matmul(a, w8[i * r : (i + 1) * r], s8[i : i + 1]),
        ),
        (
            lambda a, **kw: K.fp4_matmul(a, w4, s4, **kw),
            lambda a, i: K.fp4_matmul(a, w4[i * r : (i + 1) * r], s4[i * r : (i + 1) * r]),
        ),
        (lambda a, **kw: K.bf16_matmul(a, wb, **kw), lambda a, i: K.bf16_matmul(a, wb[i * r : (i + 1) * r])),
    ]
    for grouped, one in cases:
        got = grouped(x, groups=g)
        assert got.shape == (t, g * r)
        for i in range(g):
            want = one(np.ascontiguousarray(x[:, i * k : (i + 1) * k]), i)
            np.testing.assert_array_equal(got[:, i * r : (i + 1) * r], want)
        base = rng.standard_normal((t, g * r)).astype(np.float32)
        np.testing.assert_array_equal(grouped(x, out=base.copy(), groups=g), base + got)
    with pytest.raises(ValueError, match="groups"):
        K.fp8_matmul(x, w8, s8, groups=3)  # 384 rows: not 3 groups of whole scale blocks


def test_keep_freed_memory_reuses_big_blocks():
    """After keep_freed_memory() (what the engine calls), a freed 64 MB torch tensor's block is reused by the next
    allocation of that size instead of being unmapped and page-faulted anew; before it, glibc maps each one fresh.
    In a fresh process: the setting is process-wide. Three rounds after it take fewer faults together than one
    round before it (mostly none: a round re-faulted two of its four blocks in 2 of 12 runs, cause not found)."""
    import platform
    import subprocess
    import sys

    if not K.available() or platform.libc_ver()[0] != "glibc":
        pytest.skip("a glibc malloc setting of the C extension")
    code = (
        "import resource, torch\n"
        "from fastar.quant import kernels as K\n"
        "def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "def churn():\n"
        "    for _ in range(4):\n"
        "        a = torch.empty(64 << 20, dtype=torch.uint8); a[::4096] = 1; del a\n"
        "f0 = faults(); churn(); before = faults() - f0\n"
        "ok = K.keep_freed_memory(); churn()\n"
        "after = []\n"
        "for _ in range(3): f0 = faults(); churn(); after.append(faults() - f0)\n"
        "print(ok, before, sum(after))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ok, before, after = run.stdout.split()
    assert ok == "True"
    assert int(before) >= 4 * (64 << 20) // 4096 // 2  # each fresh mapping faults its pages in
    assert int(after) < int(before)  # 3 rounds: without the setting they would take ~3x before
