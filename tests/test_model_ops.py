"""Closed-form tests of the model's leaf math: fastar.model.ops, the compressor and the indexer visibility rule."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from fastar.contracts import WeightSource
from fastar.model import ops
from fastar.model.deepseek_v4 import Compressor, Indexer, Numerics
from fastar.model.state import LayerState
from fastar.quant import kernels
from fastar.quant.linear import Weights
from fastar.quant.reference import FP4_VALUES, fp4_round

torch.manual_seed(0)


ISAS = kernels.cpu_features()["usable_isas"] if kernels.available() else []  # the C extension's

# --- norms, router score, SwiGLU -------------------------------------------------------------------------


def test_rms_norm_closed_form():
    x = torch.randn(3, 16)
    w = torch.rand(16) + 0.5
    expect = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(ops.rms_norm(x, w, 1e-6), expect, atol=1e-6)
    assert torch.allclose(ops.rms_norm(x, None, 1e-6), expect / w, atol=1e-6)


def test_sqrtsoftplus_and_limited_swiglu():
    z = torch.tensor([-30.0, -1.0, 0.0, 2.0, 50.0])
    assert torch.allclose(ops.sqrtsoftplus(z), torch.log1p(torch.exp(z.double())).sqrt().float(), atol=1e-6)
    gate = torch.tensor([-20.0, 0.5, 12.0])
    up = torch.tensor([-15.0, 3.0, 11.0])
    g, u = torch.tensor([-20.0, 0.5, 10.0]), torch.tensor([-10.0, 3.0, 10.0])  # gate: max only; up: both
    assert torch.allclose(ops.limited_swiglu(gate, up, 10.0), g * torch.sigmoid(g) * u, rtol=1e-6)
    assert torch.allclose(ops.limited_swiglu(gate, up, 0.0), gate * torch.sigmoid(gate) * up, rtol=1e-6)


@pytest.mark.skipif(not kernels.available(), reason="the C sqrtsoftplus needs the C kernels")
def test_sqrtsoftplus_c_against_torch():
    """The C router score: within 1 ulp of torch's (`sqrtsoftplus_torch`) and of the float64 formula wherever softplus
    is a normal float (below, the root of a subnormal e^x, or 0), the same bits for a value alone or in any batch, and
    the edge values exact (softplus's threshold of 20, +-inf, NaN)."""
    g = torch.Generator().manual_seed(11)
    x = torch.cat([torch.randn(20_000, generator=g) * s for s in (0.01, 1.0, 5.0, 40.0)])
    x = torch.cat([x, torch.tensor([0.0, -0.0, 20.0, 19.999, 20.001, -90.0, -104.0, -120.0, 1e-30, 88.0, 1e30])])
    got = ops.sqrtsoftplus(x).numpy()
    with ops.torch_only():
        ref = ops.sqrtsoftplus(x).numpy()  # the torch path
    assert np.array_equal(ref, ops.sqrtsoftplus_torch(x).numpy())
    x64 = x.double().numpy()
    normal = x64 > -87  # softplus(x) a normal float (below, it is e^x, subnormal: torch's SIMD exp flushes it to 0)
    ulp = np.abs(got.view(np.int32).astype(np.int64) - ref.view(np.int32).astype(np.int64))
    assert ulp[normal].max() <= 1
    soft = np.where(x64 > 20, x64, np.log1p(np.exp(np.minimum(x64, 20))))  # exp only where it is taken
    want = np.sqrt(soft).astype(np.float32)
    assert np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))[normal].max() <= 1
    assert np.all((got[~normal] >= 0) & (got[~normal] <= 1e-18))  # the square root of a subnormal e^x, or 0
    alone = np.concatenate([ops.sqrtsoftplus(x[i : i + 1]).numpy() for i in range(0, x.numel(), 997)])
    assert np.array_equal(alone, got[::997])
    batch = x[:7000].reshape(-1, 7)[:, :5]  # a strided batch, copied to C order
    assert np.array_equal(ops.sqrtsoftplus(batch).numpy(), got[:7000].reshape(-1, 7)[:, :5])
    edge = ops.sqrtsoftplus(torch.tensor([float("inf"), float("-inf"), float("nan"), 20.0, 20.001])).numpy()
    assert edge[0] == np.inf and edge[1] == 0.0 and np.isnan(edge[2])
    assert edge[3] == np.float32(math.sqrt(math.log1p(math.exp(20.0)))) and edge[4] == np.sqrt(np.float32(20.001))


# --- RoPE / YaRN -------------------------------------------------------------------------------------------


def test_rope_frequencies_plain():
    f = ops.rope_inv_freq(64, 10000.0)
    i = np.arange(32)
    assert np.allclose(f.numpy(), 10000.0 ** (-2 * i / 64), rtol=1e-6)


@pytest.mark.parametrize("orig", [65536, 256])
def test_yarn_frequencies_closed_form(orig):
    dim, theta, factor = 64, 160000.0, 16.0
    f = ops.yarn_inv_freq(dim, theta, factor, 32, 1, orig).double().numpy()
    base = theta ** (-np.arange(0, dim, 2) / dim)

    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    assert np.allclose(f, base / factor * ramp + base * (1 - ramp), rtol=1e-6)
    assert np.allclose(f[:low], base[:low], rtol=1e-6)  # fast-rotating pairs keep their frequency
    if high < dim // 2:
        assert np.allclose(f[high:], base[high:] / factor, rtol=1e-6)  # slow pairs are interpolated by 16


def test_yarn_matches_transformers_flash_config():
    from transformers import DeepseekV4Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = DeepseekV4Config(
        compress_ratios=[0] * 43 + [0],
        rope_scaling={
            "type": "yarn",
            "factor": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 65536,
        },
    )
    hf, scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, layer_type="compress")
    ours = ops.yarn_inv_freq(64, 160000.0, 16.0, 32.0, 1.0, 65536)
    assert scale == 1.0
    assert torch.allclose(ours, hf, rtol=1e-6, atol=0)


def test_apply_rope_rotates_interleaved_pairs_and_inverts():
    x = torch.randn(5, 3, 24)  # [T, H, D] with 8 RoPE dims at the end
    pos = torch.arange(5) * 7
    f = ops.rope_inv_freq(8, 10000.0)
    cos, sin = ops.rope_cos_sin(f, pos)
    y = ops.apply_rope(x, cos, sin)
    assert torch.equal(y[..., :16], x[..., :16])  # the leading (non-RoPE) dims pass untouched
    for i in range(4):
        a = pos.float()[:, None] * f[i]
        xe, xo = x[..., 16 + 2 * i], x[..., 17 + 2 * i]
        assert torch.allclose(y[..., 16 + 2 * i], xe * a.cos() - xo * a.sin(), atol=1e-6)
        assert torch.allclose(y[..., 17 + 2 * i], xo * a.cos() + xe * a.sin(), atol=1e-6)
    assert torch.allclose(ops.apply_rope(y, cos, sin, inverse=True), x, atol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    f = ops.rope_inv_freq(16, 10000.0)
    q, k = torch.randn(1, 16), torch.randn(1, 16)

    def score(m, n):
        cq, sq = ops.rope_cos_sin(f, torch.tensor([m]))
        ck, sk = ops.rope_cos_sin(f, torch.tensor([n]))
        return (ops.apply_rope(q, cq, sq) * ops.apply_rope(k, ck, sk)).sum()

    assert torch.allclose(score(10, 3), score(107, 100), atol=1e-5)


# --- mHC Sinkhorn ------------------------------------------------------------------------------------------


def test_sinkhorn_rows_and_columns_sum_to_one():
    # its own generator: 20 iterations leave rows within 1e-2 of 1 for most logits, not all (~8% of draws miss)
    logits = torch.randn(6, 4, 4, generator=torch.Generator().manual_seed(0)) * 2
    m = ops.sinkhorn(logits, 20, 1e-6)
    assert (m > 0).all()
    assert torch.allclose(m.sum(-2), torch.ones(6, 4), atol=1e-5)  # last step normalises columns
    assert torch.allclose(m.sum(-1), torch.ones(6, 4), atol=1e-2)  # rows: 20 iterations get close
    m = ops.sinkhorn(logits, 500, 1e-6)  # and converge to doubly stochastic
    assert torch.allclose(m.sum(-1), torch.ones(6, 4), atol=1e-5)


def test_sinkhorn_closed_form_first_step():
    logits = torch.randn(4, 4)
    one = ops.sinkhorn(logits, 1, 1e-6)  # softmax rows + eps, then a single column normalisation
    s = torch.softmax(logits, -1) + 1e-6
    assert torch.allclose(one, s / (s.sum(0, keepdim=True) + 1e-6), atol=1e-7)


def test_sinkhorn_kernel_matches_torch():
    if ops._C is None:
        pytest.skip("C extension not built")
    g = torch.Generator().manual_seed(2)
    for shape, scale in (((50, 4, 4), 3.0), ((7, 8, 8), 10.0), ((3, 2, 4, 4), 0.1)):
        logits = torch.randn(*shape, generator=g) * scale
        for iters in (1, 2, 20):
            got, want = ops.sinkhorn(logits, iters, 1e-6), ops.sinkhorn_torch(logits, iters, 1e-6)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    one = torch.randn(1, 4, 4, generator=g)  # per matrix, whatever shares the batch
    assert torch.equal(ops.sinkhorn(torch.cat([one, torch.randn(5, 4, 4)]), 20, 1e-6)[:1], ops.sinkhorn(one, 20, 1e-6))


# --- Hadamard and activation quantization ------------------------------------------------------------------


def test_hadamard_is_sylvester_and_orthonormal():
    n = 16
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    x = torch.randn(3, n)
    assert np.allclose(ops.hadamard(x).numpy(), x.numpy() @ h.T / math.sqrt(n), atol=1e-5)
    assert torch.allclose(ops.hadamard(ops.hadamard(x)), x, atol=1e-5)
    with pytest.raises(ValueError):
        ops.hadamard(torch.randn(12))


def test_pow2_ceil_exact():
    v = torch.tensor([1.0, 0.75, 2.0**-20, 3.0, 448.0, 2.0**-126])
    assert torch.equal(ops.pow2_ceil(v), torch.tensor([1.0, 1.0, 2.0**-20, 4.0, 512.0, 2.0**-126]))


def test_fp8_quant_sim_matches_e4m3_with_pow2_block_scales():
    x = torch.randn(4, 200) * torch.logspace(-3, 2, 200)  # K not a multiple of the block: last block is short
    y = ops.fp8_quant_sim(x, 64)
    for b in range(0, 200, 64):
        blk = x[:, b : b + 64].double()
        s = 2.0 ** torch.ceil(torch.log2(blk.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448))
        q = (blk / s).numpy().astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        assert np.array_equal(y[:, b : b + 64].double().numpy(), q * s.numpy())
    assert torch.equal(ops.fp8_quant_sim(y, 64), y)  # idempotent


@pytest.fixture(params=ISAS)
def isa(request):
    """Each instruction set of the C extension this CPU runs (their activation ops differ: AVX-512 has its own)."""
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa("auto")


def test_fp8_quant_sim_kernel_is_bit_identical_to_torch(isa):
    """The C activation quantizer (each ISA's) against the torch formula: every e4m3 rounding boundary and tie,
    subnormals, saturation, signed zeros, tiny blocks (the 1e-4 floor), huge ones, NaN and infinity, ragged last
    blocks."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes)]
    mids = (codes[:, None] + codes[None, :]).flatten() / 2  # every tie and far more
    steps = torch.tensor([1 - 2**-20, 1 + 2**-20, 1 - 2**-9, 1 + 2**-9])
    vals = torch.cat([codes, mids, (codes[:, None] * steps).flatten(), torch.tensor([448.0, -449.0, 1e6, -0.0])])
    g = torch.Generator().manual_seed(0)
    vals = vals[torch.randperm(len(vals), generator=g)][: len(vals) // 128 * 128].view(-1, 128)
    cases = [vals * 2.0**e for e in (-30, -9, 0, 7)]
    cases += [
        torch.randn(7, 1000, generator=g) * torch.logspace(-8, 6, 1000),
        torch.randn(3, 4096, generator=g),
        torch.full((2, 64), 3e-7),
        torch.zeros(1, 5),
    ]
    special = torch.randn(4, 256, generator=g)
    special[0, 3], special[1, 200], special[2, 0] = float("nan"), float("inf"), -float("inf")
    cases.append(special)
    for x in cases:
        for block in (128, 64, 32):
            got, want = ops.fp8_quant_sim(x, block), ops.fp8_quant_sim_torch(x, block)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)) or (
                torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
            )


def test_fp4_quant_sim_and_hadamard_kernels_are_bit_identical_to_torch():
    """The C FP4 activation rounding and Walsh-Hadamard rotation (the indexer's queries and keys) against their torch
    formulas, bit for bit: every e2m1 value and tie between neighbours at several block scales, just off them,
    saturation, signed zeros, blocks at the 6 * 2^-126 floor, subnormals, huge values, ragged last blocks; the
    rotation on rows of 32..256 values over sixty decades, strided and 3-D inputs."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    grid = torch.cat([grid, -grid])
    mids = (grid[:, None] + grid[None, :]).flatten() / 2
    near = (grid[:, None] * torch.tensor([1 - 2**-20, 1 + 2**-20, 1 - 2**-8])).flatten()
    vals = torch.cat([grid, mids, near, torch.tensor([6.0, 7.0, -100.0, -0.0])])
    g = torch.Generator().manual_seed(0)
    vals = vals[torch.randperm(len(vals), generator=g)][: len(vals) // 32 * 32].view(-1, 32)
    cases = [vals * 2.0**e for e in (-140, -126, -20, 0, 9, 100)]
    cases += [
        torch.randn(7, 1000, generator=g) * torch.logspace(-40, 30, 1000),
        torch.randn(3, 64, 128, generator=g),
        torch.full((2, 64), 1e-39),
        torch.zeros(1, 5),
        torch.randn(4, 96, generator=g)[:, ::3],
    ]
    for x in cases:
        for block in (32, 16, 7):
            got, want = ops.fp4_quant_sim(x, block), ops.fp4_quant_sim_torch(x, block)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    for n in (32, 64, 128, 256):
        x = torch.randn(5, n, generator=g) * torch.logspace(-30, 30, n)[torch.randperm(n, generator=g)]
        for xx in (x, x.view(5, 1, n).expand(5, 3, n), torch.randn(n, 2, generator=g).T):
            got, want = ops.hadamard(xx), ops.hadamard_torch(xx)
            assert got.shape == want.shape and torch.equal(got, want)
    if ops._C is not None:
        with pytest.raises(ValueError, match="power-of-two"):
            ops._C.hadamard(np.zeros((2, 12), np.float32), 1.0, np.zeros((2, 12), np.float32))
        with pytest.raises(ValueError, match="block must be positive"):
            ops._C.fp4_act_quant(np.zeros((2, 12), np.float32), 0, np.zeros((2, 12), np.float32))


def test_row_ops_in_c_match_torch(isa):
    """The C RMS norm, RoPE and SwiGLU against their torch references: RoPE bit for bit (same rounded products),
    the norm and SwiGLU within float32 rounding (sum order; exp's last bits); any row count, 2-D and 3-D inputs,
    non-contiguous ones, no weight, inverse RoPE, clamps off, NaN and infinities through SwiGLU."""
    g = torch.Generator().manual_seed(1)
    for shape in [(1, 4096), (5, 4096), (3, 64, 512), (9, 4, 96), (2, 7)]:
        x = torch.randn(shape, generator=g) * 3
        w = torch.rand(shape[-1], generator=g) + 0.5
        for wt in (w, None):
            got, want = ops.rms_norm(x, wt, 1e-6), ops.rms_norm_torch(x, wt, 1e-6)
            assert got.shape == want.shape and torch.allclose(got, want, rtol=2e-6, atol=1e-7)
        if shape[-1] >= 8:
            inv_freq = ops.rope_inv_freq(8 if shape[-1] < 64 else 64, 1e4)
            cos, sin = ops.rope_cos_sin(inv_freq, torch.arange(shape[0]) + 90)
            for inverse in (False, True):
                assert torch.equal(ops.apply_rope(x, cos, sin, inverse), ops.apply_rope_torch(x, cos, sin, inverse))
    xt = torch.randn(6, 2, 64, generator=g).transpose(0, 1)  # not contiguous
    assert torch.equal(ops.rms_norm(xt, None, 1e-6), ops.rms_norm(xt.contiguous(), None, 1e-6))
    gate, up = torch.randn(4, 2048, generator=g) * 6, torch.randn(4, 2048, generator=g) * 6
    gate[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -200.0])
    up[1, :2] = torch.tensor([float("nan"), -float("inf")])
    for limit in (7.0, 0.0):
        got, want = ops.limited_swiglu(gate, up, limit), ops.limited_swiglu_torch(gate, up, limit)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.allclose(got.nan_to_num(), want.nan_to_num(), rtol=1e-6, atol=1e-30)
    assert torch.equal(ops.rms_norm(x.double(), None, 1e-6), ops.rms_norm_torch(x.double(), None, 1e-6))  # torch's


def test_row_ops_may_overwrite_their_input(isa):
    """`overwrite=True` (the caller needs only the result): the same bits as the op on a copy; in the C extension the
    result is written into x itself where x is contiguous (the RoPE's leading dims stay as they were), and a
    non-contiguous x is left untouched (its copy takes the result). RoPE with `bf16` rounds every element after the
    rotation as torch's bfloat16 conversion does, in and out of place."""
    g = torch.Generator().manual_seed(2)
    cos, sin = ops.rope_cos_sin(ops.rope_inv_freq(64, 1e4), torch.arange(7) + 30)
    for inverse in (False, True):
        x = torch.randn(7, 4, 512, generator=g)
        want = ops.apply_rope(x.clone(), cos, sin, inverse)
        got = ops.apply_rope(x, cos, sin, inverse, overwrite=True)
        assert torch.equal(got, want) and (got.data_ptr() == x.data_ptr()) == (ops._C is not None)
    x = torch.randn(300, 64, 512, generator=g)  # enough rows for the pool; NaN, infinities and a tie to even too
    x[0, 0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1 + 2**-8, 1 + 3 * 2**-8])
    cos, sin = ops.rope_cos_sin(ops.rope_inv_freq(64, 1e4), torch.arange(300))
    want = ops.apply_rope_torch(x, cos, sin, True).to(torch.bfloat16).float()
    for overwrite in (False, True):  # rotated, then every element rounded to bfloat16 (wo_a's input)
        got = ops.apply_rope(x.clone(), cos, sin, True, overwrite=overwrite, bf16=True)
        assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())
    cos, sin = ops.rope_cos_sin(ops.rope_inv_freq(64, 1e4), torch.arange(7) + 30)
    x = torch.randn(7, 4, 512, generator=g)
    want = ops.rms_norm(x.clone(), None, 1e-6)
    got = ops.rms_norm(x, None, 1e-6, overwrite=True)
    assert torch.equal(got, want) and (got.data_ptr() == x.data_ptr()) == (ops._C is not None)
    xt = torch.randn(4, 7, 512, generator=g).transpose(0, 1)  # not contiguous: a copy takes the result
    before = xt.clone()
    assert torch.equal(ops.apply_rope(xt, cos, sin, overwrite=True), ops.apply_rope(before, cos, sin))
    assert torch.equal(ops.rms_norm(xt, None, 1e-6, overwrite=True), ops.rms_norm(before, None, 1e-6))
    assert torch.equal(xt, before)


def test_fp4_quant_sim_ties_to_even_and_matches_reference_rounding():
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -2.5])
    assert torch.equal(ops.e2m1_round(grid), torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -2.0]))
    v = torch.randn(1000) * 3
    ref = FP4_VALUES[fp4_round(v.numpy())]
    assert np.array_equal(ops.e2m1_round(v).numpy(), ref)
    x = torch.randn(2, 64)
    y = ops.fp4_quant_sim(x, 32)
    s = ops.pow2_ceil(x.view(2, 2, 32).abs().amax(-1, keepdim=True) / 6)
    assert set((y.view(2, 2, 32) / s).abs().unique().tolist()) <= set(FP4_VALUES[:8].tolist())


# --- compressor pooling and indexer visibility (tiny in-memory weights) ----------------------------------


class DictSource(WeightSource):
    """A minimal in-memory WeightSource of F32 tensors (enough for Compressor and Indexer)."""

    def __init__(self, tensors: dict[str, np.ndarray]) -> None:
        self.t = tensors

    def has(self, name):
        return name in self.t

    def dtype(self, name):
        return "F32" if self.t[name].dtype == np.float32 else "I64"

    def tensor(self, name):
        return self.t[name]


def _compressor(ratio: int, hd: int = 8, d: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    c = 2 if ratio == 4 else 1
    t = {
        "c.wkv.weight": rng.standard_normal((c * hd, d)).astype(np.float32),
        "c.wgate.weight": rng.standard_normal((c * hd, d)).astype(np.float32),
        "c.ape": rng.standard_normal((ratio, c * hd)).astype(np.float32),
        "c.norm.weight": (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32),
    }
    inv = ops.rope_inv_freq(4, 160000.0)
    return Compressor(Weights(DictSource(t), kernels=False), "c.", ratio, hd, inv, 1e-6), t, inv


def _expected_entry(t, ratio, hd, x, w, inv):
    """Closed form of entry w from token inputs x [P, d]."""
    kv = x @ torch.from_numpy(t["c.wkv.weight"]).T
    g = x @ torch.from_numpy(t["c.wgate.weight"]).T + torch.from_numpy(t["c.ape"])[torch.arange(len(x)) % ratio]
    cur = slice(w * ratio, (w + 1) * ratio)
    if ratio == 4:
        kvs, gs = [kv[cur, hd:]], [g[cur, hd:]]
        if w > 0:  # Ca half of the previous window joins
            prev = slice((w - 1) * ratio, w * ratio)
            kvs.insert(0, kv[prev, :hd])
            gs.insert(0, g[prev, :hd])
        kvw, gw = torch.cat(kvs), torch.cat(gs)
    else:
        kvw, gw = kv[cur], g[cur]
    c = (kvw * torch.softmax(gw, 0)).sum(0, keepdim=True)
    c = ops.rms_norm(c, torch.from_numpy(t["c.norm.weight"]), 1e-6)
    cos, sin = ops.rope_cos_sin(inv, torch.tensor([w * ratio]))
    return ops.apply_rope(c, cos, sin)[0]


@pytest.mark.parametrize("ratio", [4, 128])
def test_compressor_pools_at_window_boundaries(ratio):
    hd = 8
    comp, t, inv = _compressor(ratio, hd)
    P = 3 * ratio + ratio // 2
    x = torch.randn(P, 6)
    s = LayerState.new(ratio, 8, hd, 4)
    for p in range(P):  # token by token: an entry appears exactly when a window closes
        comp(x[p : p + 1], p, s.comp_kv, s.comp_gate, s.entries)
        assert s.entries.stop == (p + 1) // ratio
    for w in range(s.entries.stop):
        assert torch.allclose(s.entries.all()[w], _expected_entry(t, ratio, hd, x, w, inv), atol=1e-5)
    # any chunking gives the same entries
    s2 = LayerState.new(ratio, 8, hd, 4)
    a = 0
    for n in [ratio - 1, 2, ratio + 3, P]:
        comp(x[a : min(P, a + n)], a, s2.comp_kv, s2.comp_gate, s2.entries)
        a = min(P, a + n)
    assert torch.allclose(s2.entries.all(), s.entries.all(), atol=1e-5)


@pytest.mark.parametrize("n,M,hd", [(1, 8, 512), (128, 8, 512), (4, 128, 512), (33, 8, 128), (3, 5, 7)])
def test_compress_pool_in_c_matches_torch_and_is_window_invariant(n, M, hd, isa):
    """The C pooling against `compress_pool_torch` (within float32 rounding), with window 0's -inf Ca gates (ratio 4)
    weighing nothing, and each window pooled the same alone as among others (so whichever chunk closes it)."""
    if kernels.extension is None:
        pytest.skip("the C extension is not built")
    g = torch.Generator().manual_seed(n * M + hd)
    kv, gate = torch.randn(n, M, hd, generator=g), 3 * torch.randn(n, M, hd, generator=g)
    gate[0, : M // 2] = float("-inf")
    out, ref = ops.compress_pool(kv, gate), ops.compress_pool_torch(kv, gate)
    assert out.shape == (n, hd) and torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.cat([ops.compress_pool(kv[w : w + 1], gate[w : w + 1]) for w in range(n)]), out)
    with pytest.raises(ValueError, match="compress_pool needs gate"):
        kernels.extension.compress_pool(kv.numpy(), gate[:, :-1].contiguous().numpy(), out.numpy())


def test_indexer_visibility_rule():
    rng = np.random.default_rng(1)
    d, qr, Hi, Di = 6, 5, 8, 8
    t = {
        "i.wq_b.weight": rng.standard_normal((Hi * Di, qr)).astype(np.float32),
        "i.weights_proj.weight": rng.standard_normal((Hi, d)).astype(np.float32),
        "i.compressor.wkv.weight": rng.standard_normal((2 * Di, d)).astype(np.float32),
        "i.compressor.wgate.weight": rng.standard_normal((2 * Di, d)).astype(np.float32),
        "i.compressor.ape": rng.standard_normal((4, 2 * Di)).astype(np.float32),
        "i.compressor.norm.weight": np.ones(Di, np.float32),
    }

    class Cfg:
        index_n_heads, index_head_dim, index_topk, rms_norm_eps = Hi, Di, 3, 1e-6

    idx = Indexer(
        Weights(DictSource(t), kernels=False), "i.", Cfg, ops.rope_inv_freq(4, 160000.0), Numerics.named("reference")
    )
    T = 40
    s = LayerState.new(4, 8, 16, Di)
    sel = idx(torch.randn(T, d), torch.randn(T, qr), 0, s)  # [T, k], k = min(3, 10 entries)
    assert sel.shape == (T, 3)
    for q in range(T):
        visible = (q + 1) // 4
        picks = set(sel[q].tolist()) - {-1}
        assert all(0 <= w < visible for w in picks)  # never a window that is still open for this query
        assert len(picks) == min(3, visible)  # all visible entries while there are at most top-k of them


# --- weight products (fastar.quant.linear) against the numpy reference codecs -------------------------------


def _fp8_linear(rows: int, cols: int, kernels: bool, seed: int = 0):
    from fastar.quant.linear import Linear
    from fastar.quant.reference import fp8_block_quant

    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    q, s = fp8_block_quant(w)
    return Linear("w", q, "F8_E4M3", s, kernels=kernels), q, s


@pytest.mark.parametrize("kernels", [False, True])
def test_linear_fp8_bf16_and_grouped_products(kernels):
    from fastar.quant.linear import Linear
    from fastar.quant.reference import bf16_decode, bf16_encode, fp8_block_dequant

    lin, q, s = _fp8_linear(384, 256, kernels)
    x = torch.randn(5, 256)
    ref = x.double() @ torch.from_numpy(fp8_block_dequant(q, s)).double().T
    assert torch.allclose(lin(x).double(), ref, atol=1e-4)
    w = torch.from_numpy(fp8_block_dequant(q, s))
    bf = bf16_encode(np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32))
    lb = Linear("b", bf, "BF16", kernels=kernels)
    assert torch.allclose(lb(x), x @ torch.from_numpy(bf16_decode(bf)).T, atol=1e-4)
    assert torch.equal(lb.rows(torch.tensor([3, 0])), torch.from_numpy(bf16_decode(bf))[[3, 0]])
    # the rows as an array by the bits (a decode step's embedding): `rows`' values bit for bit, specials included
    special = bf.copy()
    special[5, :4] = [0x7F80, 0xFF80, 0x8000, 0x0001]  # +inf, -inf, -0.0, the smallest subnormal
    ls, picks = Linear("e", special, "BF16", kernels=kernels), [5, 3, 0, 3, 63]
    got = torch.from_numpy(ls.rows_array(picks))
    want = ls.rows(torch.tensor(picks))
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert lin.rows_array(picks) is None  # an FP8 weight has no row lookup
    if kernels:  # the bound C call (`_direct`) gives the generic kernel path's bits, a strided x included
        xt = torch.randn(256, 5).T
        for linear in (lin, lb):
            assert linear._direct is not None
            for inp in (x, xt):
                assert torch.equal(linear(inp), linear._kernel_product(inp))
    xs = torch.randn(5, 3, 256)
    g = lin.grouped(xs)  # 3 groups of 128 output rows each
    assert g.shape == (5, 3, 128)
    for k in range(3):
        assert torch.allclose(g[:, k], xs[:, k] @ w[128 * k : 128 * (k + 1)].T, atol=1e-4)


def test_fp8_grouped_product_with_groups_inside_a_scale_block_is_batch_invariant():
    """Groups of 64 output rows share 128-row FP8 scale blocks (a small model's O-LoRA): each group still runs on the
    kernels (its whole scale blocks, the rows sliced), so a token's outputs are the same bits alone or with others,
    and equal the dequantized product to float32 rounding. The float32 matmul fallback it replaces summed a 2-token
    call differently from a 1-token one."""
    from fastar.quant.reference import fp8_block_dequant

    if not kernels.available():
        pytest.skip("the C extension is not built")
    lin, q, s = _fp8_linear(384, 256, True)
    w = torch.from_numpy(fp8_block_dequant(q, s))
    xs = torch.randn(5, 6, 256)  # 6 groups of 64 rows
    g = lin.grouped(xs)
    for t in range(5):
        assert torch.equal(lin.grouped(xs[t : t + 1])[0], g[t])
    for k in range(6):
        assert torch.allclose(g[:, k], xs[:, k] @ w[64 * k : 64 * (k + 1)].T, atol=1e-4)
    for r0, r1 in ((64, 128), (100, 300), (320, 384)):  # any row range, as the matching rows of the whole product
        assert torch.equal(lin._kernel_product(xs[:, 0], r0, r1), lin._kernel_product(xs[:, 0])[:, r0:r1])


@pytest.mark.parametrize("kernels", [False, True])
def test_expert_ffn_orders_and_activation_hook(kernels):
    from fastar.contracts import ExpertWeights
    from fastar.quant.linear import expert_ffn
    from fastar.quant.reference import fp4_decode, fp4_encode

    rng = np.random.default_rng(2)
    D, inter = 64, 96
    parts = {}
    for nm, shape in (("w1", (inter, D)), ("w3", (inter, D)), ("w2", (D, inter))):
        parts[nm], parts[nm + "_scale"] = fp4_encode(rng.standard_normal(shape).astype(np.float32) / 4)
    ew = ExpertWeights(**parts)
    x = torch.from_numpy(rng.standard_normal((7, D)).astype(np.float32) * 4)
    rw = torch.from_numpy(rng.uniform(0.1, 1, 7).astype(np.float32))
    W = {nm: torch.from_numpy(fp4_decode(parts[nm], parts[nm + "_scale"])) for nm in ("w1", "w3", "w2")}
    expect = ops.limited_swiglu(x @ W["w1"].T, x @ W["w3"].T, 1.0) @ W["w2"].T * rw[:, None]
    after = expert_ffn(x, ew, rw, 1.0, kernels=kernels)
    before = expert_ffn(x, ew, rw, 1.0, weight_before_down=True, kernels=kernels)
    assert torch.allclose(after, expect, atol=1e-4) and torch.allclose(before, expect, atol=1e-4)

    def q(a):
        return ops.fp8_quant_sim(a, 32)

    hooked = expert_ffn(x, ew, rw, 1.0, weight_before_down=True, act_quant=q, kernels=kernels)
    mid = ops.limited_swiglu(q(x) @ W["w1"].T, q(x) @ W["w3"].T, 1.0) * rw[:, None]
    ref = q(mid) @ W["w2"].T
    # the kernels sum in another order: an FP8 rounding of the mid activation may flip (one e4m3 step)
    tol = 0.05 * ref.abs().max().item() if kernels else 1e-5
    assert (hooked - ref).abs().max().item() <= tol


def test_layer_experts_in_one_call_equal_expert_by_expert():
    """`linear.experts_ffn` (the MoE's one-call path, with its own bookkeeping for a single token) against
    `expert_ffn` per expert summed in the same order: bit-identical, for one token, two tokens with distinct
    experts, a token routed twice to one expert (a hash table may repeat one), and a chunk where experts share
    tokens."""
    from fastar.contracts import ExpertWeights
    from fastar.quant.linear import _kernels, expert_ffn, experts_ffn
    from fastar.quant.reference import fp4_encode

    if _kernels() is None:
        pytest.skip("the one-call path needs the C kernels")
    rng = np.random.default_rng(3)
    D, inter, E = 128, 64, 9
    experts = {}
    for e in range(E):
        parts = {}
        for nm, shape in (("w1", (inter, D)), ("w3", (inter, D)), ("w2", (D, inter))):
            parts[nm], parts[nm + "_scale"] = fp4_encode(rng.standard_normal(shape).astype(np.float32) / 4)
        experts[e] = ExpertWeights(**parts)

    def q(a):
        return ops.fp8_quant_sim(a, 128)

    for routed in (
        np.array([[7, 2, 5]]),
        np.array([[1, 4], [6, 2]]),
        np.array([[3, 3, 5]]),
        np.array([[1, 4, 2], [4, 2, 8], [0, 2, 1]]),
    ):
        T = routed.shape[0]
        x = torch.from_numpy(rng.standard_normal((T, D)).astype(np.float32) * 3)
        wts = torch.from_numpy(rng.uniform(0.1, 1, routed.shape).astype(np.float32))
        ascending = np.unique(routed).tolist()  # the MoE's order (one sort groups the routes), then any other
        for order in (ascending, ascending[::-1]):
            got = torch.zeros(T, D)
            assert experts_ffn(
                x, routed, wts, experts, order, 1.0, got, weight_before_down=True, act_quant=q, act_block=128
            )
            want = torch.zeros(T, D)
            for e in order:
                tok, slot = (torch.from_numpy(a) for a in np.nonzero(routed == e))
                want.index_add_(
                    0,
                    tok,
                    expert_ffn(
                        x[tok], experts[e], wts[tok, slot], 1.0, weight_before_down=True, act_quant=q, act_block=128
                    ),
                )
            assert torch.equal(got, want), order


def test_row_ops_over_the_pool_do_not_depend_on_threads(isa):
    """The RMS norm and RoPE of a prefill chunk run over the kernel pool: bit-identical for 1, 2 and 3 threads and
    to the same rows one at a time, and RoPE still bit-identical to torch's."""
    from fastar.quant import kernels as K

    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 4, 512, generator=g) * 3  # large enough for the pool, rows per token = 4 for RoPE
    w = torch.rand(512, generator=g) + 0.5
    cos, sin = ops.rope_cos_sin(ops.rope_inv_freq(64, 1e4), torch.arange(300) + 7)
    before = K.get_num_threads()
    try:
        res = []
        for n in (1, 2, 3):
            K.set_num_threads(n)
            res.append((ops.rms_norm(x, w, 1e-6), ops.apply_rope(x, cos, sin), ops.apply_rope(x, cos, sin, True)))
    finally:
        K.set_num_threads(before)
    for r in res[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r, res[0]))
    one = torch.cat([ops.rms_norm(x[i : i + 1], w, 1e-6) for i in range(0, 300, 37)])
    assert torch.equal(one, res[0][0][::37])
    assert torch.equal(res[0][1], ops.apply_rope_torch(x, cos, sin, False))
    empty = np.zeros((0, 8), np.float32)  # no rows: nothing to do, no chunking arithmetic on zero rows per token
    K._C.rope(empty, np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32), False, empty)
    K._C.rms_norm(empty, None, 1e-6, empty)


def test_picked_entries_of_one_query_equal_the_marked_dedupe():
    """`picked_entries` on one query's picks (its shortcut: the picks are already the list) against the mark-array
    dedupe it runs for several queries: the same ids and places, with and without -1 padding; several queries
    sharing entries get one id each."""
    g = torch.Generator().manual_seed(4)
    for E, k, n in ((50, 8, 8), (50, 8, 5), (3000, 512, 512), (700, 512, 300), (10, 4, 0)):
        one = torch.full((1, k), -1, dtype=torch.int64)
        one[0, :n] = torch.randperm(E, generator=g)[:n].sort().values
        two = torch.cat([one, one])  # the general path on the same picks twice: the same list
        for got, want in zip(ops.picked_entries(one, E), ops.picked_entries(two, E)):
            assert torch.equal(got, want[: got.shape[0]] if got.dim() == 2 else want)
    picks = torch.tensor([[1, 4, 9, -1], [0, 4, 7, 9]])
    ids, where = ops.picked_entries(picks, 12)
    assert ids.tolist() == [0, 1, 4, 7, 9] and where.tolist() == [[1, 2, 4, -1], [0, 2, 3, 4]]
