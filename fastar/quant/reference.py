"""Reference codecs: the slow, exact, numpy-only definition of every storage format fastar reads.

Owns: FP8 e4m3 (+ 128x128 UE8M0 block scales), FP4 e2m1 packed two per byte (+ per-32 UE8M0 scales),
UE8M0 scale bytes, BF16. Every fast kernel in `fastar.quant.kernels` is tested against these functions.
Does not own: activation quantization used by the model's `official` numerics (see `fastar.model.ops`).

Layouts (identical to the official DeepSeek-V4 checkpoint):
- UE8M0 byte b means 2**(b - 127); b = 0 is 2**-127, b = 255 is NaN.
- FP8 weight [R, C] uint8 (e4m3fn bits), scale [ceil(R/128), ceil(C/128)] UE8M0:
  W[r, c] = fp8(w[r, c]) * scale[r // 128, c // 128].
- FP4 weight [R, C/2] uint8: byte j of a row holds column 2j in its low nibble and 2j+1 in its high nibble;
  nibble bit 3 is the sign, bits 0-2 index (0, 0.5, 1, 1.5, 2, 3, 4, 6). Scale [R, C/32] UE8M0:
  W[r, c] = fp4(w[r, c]) * scale[r, c // 32].
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_BLOCK = 128  # rows and columns per FP8 weight scale
FP4_GROUP = 32  # columns per FP4 scale

FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


# --- UE8M0 -------------------------------------------------------------------------------------------------


def ue8m0_decode(b: np.ndarray) -> np.ndarray:
    """UE8M0 bytes -> float32 powers of two (255 -> NaN)."""
    b = np.asarray(b, dtype=np.uint8)
    with np.errstate(over="ignore"):
        out = np.ldexp(np.float32(1.0), b.astype(np.int32) - 127).astype(np.float32)
    out[b == 255] = np.nan
    return out


def ue8m0_encode(x: np.ndarray) -> np.ndarray:
    """Positive powers of two (float) -> UE8M0 bytes. Raises on values that are not exact powers of two."""
    x = np.asarray(x, dtype=np.float64)
    mant, exp = np.frexp(x)  # x = mant * 2**exp, mant in [0.5, 1)
    if np.any(mant != 0.5):
        raise ValueError("UE8M0 can only hold positive powers of two")
    e = exp.astype(np.int64) - 1 + 127
    if np.any((e < 0) | (e > 254)):
        raise ValueError("UE8M0 exponent out of range")
    return e.astype(np.uint8)


def pow2_scale(amax: np.ndarray, qmax: float, floor: float = 0.0) -> np.ndarray:
    """Smallest power of two s with amax / s <= qmax (DeepSeek's UE8M0 scale rule)."""
    amax = np.maximum(np.asarray(amax, dtype=np.float64), floor)
    amax = np.where(amax > 0, amax, qmax)  # all-zero block: scale 1
    return np.exp2(np.ceil(np.log2(amax / qmax)))


# --- BF16 --------------------------------------------------------------------------------------------------


def bf16_decode(u16: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) -> float32 (exact)."""
    return (np.asarray(u16, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def bf16_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bit patterns, round to nearest even (NaN stays NaN)."""
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


# --- FP8 e4m3 with 128x128 block scales --------------------------------------------------------------------


def fp8_decode(u8: np.ndarray) -> np.ndarray:
    """FP8 e4m3fn bit patterns -> float32 (exact)."""
    return np.asarray(u8, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def fp8_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> FP8 e4m3fn bits, round to nearest even, saturating at +-448."""
    x = np.clip(np.asarray(x, dtype=np.float32), -FP8_MAX, FP8_MAX)
    return x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def fp8_act_quant(x: np.ndarray, block: int = 128) -> np.ndarray:
    """DeepSeek's activation quant-dequant, float32 [..., K]: per `block` values s = 2^ceil(log2(max(amax, 1e-4)
    / 448)) and x -> e4m3(x / s) * s (a block holding NaN or inf gets s = 1, as torch's frexp gives)."""
    x = np.asarray(x, dtype=np.float32)
    k = x.shape[-1]
    pad = -k % block
    g = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(*x.shape[:-1], -1, block)
    with np.errstate(invalid="ignore", over="ignore"):
        amax = np.abs(g).max(-1, keepdims=True)
        mant, exp = np.frexp(np.maximum(amax, np.float32(1e-4)) / np.float32(FP8_MAX))
        s = np.ldexp(np.float32(1), np.where(mant == 0.5, exp - 1, exp)).astype(np.float32)
        s = np.where(np.isfinite(amax), s, np.float32(1))
        q = fp8_decode(fp8_encode(g / s))
    return (q * s).reshape(*x.shape[:-1], -1)[..., :k]


def _expand_blocks(scale: np.ndarray, rows: int, cols: int, br: int, bc: int) -> np.ndarray:
    return np.repeat(np.repeat(scale, br, axis=0), bc, axis=1)[:rows, :cols]


def fp8_block_dequant(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """FP8 weight [R, C] + UE8M0 scale [ceil(R/128), ceil(C/128)] -> float32 [R, C]."""
    rows, cols = w.shape
    want = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if scale.shape != want:
        raise ValueError(f"FP8 scale shape {scale.shape} does not match weight {w.shape} (want {want})")
    s = _expand_blocks(ue8m0_decode(scale), rows, cols, FP8_BLOCK, FP8_BLOCK)
    return fp8_decode(w) * s


def fp8_block_quant(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [R, C] -> (FP8 bits [R, C], UE8M0 scale [ceil(R/128), ceil(C/128)]), DeepSeek's rule."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    br, bc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    pad = np.zeros((br * FP8_BLOCK, bc * FP8_BLOCK), np.float32)
    pad[:rows, :cols] = np.abs(x)
    amax = pad.reshape(br, FP8_BLOCK, bc, FP8_BLOCK).max(axis=(1, 3))
    s = pow2_scale(amax, FP8_MAX)
    q = fp8_encode(x / _expand_blocks(s, rows, cols, FP8_BLOCK, FP8_BLOCK))
    return q, ue8m0_encode(s)


# --- FP4 e2m1, packed, per-32 scales ------------------------------------------------------------------------


def fp4_unpack(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., C/2] -> nibble codes uint8 [..., C] (low nibble first)."""
    p = np.asarray(packed, dtype=np.uint8)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = p & 0x0F
    out[..., 1::2] = p >> 4
    return out


def fp4_pack(codes: np.ndarray) -> np.ndarray:
    """nibble codes uint8 [..., C] (C even) -> packed uint8 [..., C/2]."""
    c = np.asarray(codes, dtype=np.uint8)
    if c.shape[-1] % 2:
        raise ValueError("FP4 rows need an even number of columns")
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def fp4_decode(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """FP4 weight [R, C/2] + UE8M0 scale [R, C/32] -> float32 [R, C]."""
    rows, half = packed.shape
    cols = half * 2
    if cols % FP4_GROUP or scale.shape != (rows, cols // FP4_GROUP):
        raise ValueError(f"FP4 scale shape {scale.shape} does not match packed weight {packed.shape}")
    v = FP4_VALUES[fp4_unpack(packed)]
    return v * np.repeat(ue8m0_decode(scale), FP4_GROUP, axis=1)


def fp4_round(x: np.ndarray) -> np.ndarray:
    """float -> nearest e2m1 code (ties to the even code), magnitudes above 6 saturate."""
    x = np.asarray(x, dtype=np.float32)
    mag = np.minimum(np.abs(x), FP4_MAX)
    grid = FP4_VALUES[:8]
    # distance to each grid point; argmin picks the first (lower, even-mantissa) code on ties except 2.5/5
    d = np.abs(mag[..., None] - grid)
    code = np.argmin(d, axis=-1).astype(np.uint8)
    # round-half-to-even on the e2m1 grid: ties at 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go to even mantissa
    tie = (d.min(axis=-1)[..., None] == d).sum(axis=-1) > 1
    odd = (code & 1) == 1
    code = np.where(tie & odd, code + 1, code).astype(np.uint8)
    sign = (np.signbit(x) & (code != 0)).astype(np.uint8) << 3
    return code | sign


def fp4_encode(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [R, C] -> (packed FP4 [R, C/2], UE8M0 scale [R, C/32]), DeepSeek's per-32 power-of-two rule."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    if cols % FP4_GROUP:
        raise ValueError(f"FP4 needs columns in multiples of {FP4_GROUP}, got {cols}")
    g = x.reshape(rows, cols // FP4_GROUP, FP4_GROUP)
    s = pow2_scale(np.abs(g).max(axis=-1), FP4_MAX)
    codes = fp4_round(g / s[..., None]).reshape(rows, cols)
    return fp4_pack(codes), ue8m0_encode(s)
