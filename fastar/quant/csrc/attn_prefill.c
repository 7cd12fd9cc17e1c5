/* What attention reads from the decode state: the packed state rows decoded to float32, the twin of
 * fastar.model.state.RowFormat.decode (one call instead of a dozen torch ops; ~50x faster on 16k rows).
 *
 * Packed rows (state.py has the byte layout): "fp8" = [rope float32 x r][e4m3 codes x 64*nb][nb UE8M0 bytes][pad],
 * "fp4" = [e2m1 codes, two per byte, low nibble first x 16*nb][nb UE8M0 bytes]. A value is code * 2^(b - 127):
 * both factors are exact float32s and the product is exact (the state holds only rows that decode exactly), so
 * this is bit-identical to the torch decode.
 *
 * Does not own: argument checks and the split over the pool (bind_ops.c).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "simd.h"

#if FASTAR_X86
#include <immintrin.h>

#include "exp512.h"
#define AVX512_IDX_INLINE TARGET_AVX512 static inline __attribute__((always_inline))
#endif

/* ---------------------------------------------------------------- packed rows */

static float e4m3_lut[256];
static const float e2m1_lut[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* A packed FP4 byte (two e2m1 codes, low nibble first) as a bfloat16 pair at scale 1 (e2m1_pair), and the pair's
 * exponent-field unit where a half is nonzero (e2m1_unit): at scale 2^k with both halves' results normal, the pair at
 * that scale is e2m1_pair + k * e2m1_unit exactly (what multiplying each value by 2^k in float32 gives). */
static uint32_t e2m1_pair[256], e2m1_unit[256];

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

void state_rows_init(void) {
    for (int b = 0; b < 256; b++) {
        const float lo = e2m1_lut[b & 15], hi = e2m1_lut[b >> 4];
        e2m1_pair[b] = f32_bits(lo) >> 16 | (f32_bits(hi) & 0xffff0000u);
        e2m1_unit[b] = (lo != 0.0f ? 1u << 7 : 0) | (hi != 0.0f ? 1u << 23 : 0);
    }
    for (int c = 0; c < 256; c++) {
        const int e = (c >> 3) & 15, m = c & 7;
        float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
        if ((c & 0x7f) == 0x7f) v = NAN; /* e4m3fn has no infinities; S.1111.111 is NaN */
        e4m3_lut[c] = c & 0x80 ? -v : v;
    }
}

static inline float ue8m0(uint8_t b) {
    if (b == 255) return NAN;          /* a block that held a non-finite value (UE8M0 0xFF is NaN, as in OCP MX) */
    uint32_t bits = (uint32_t)b << 23; /* 2^(b-127) for b in 1..254 (the state never stores 0) */
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if FASTAR_X86
/* 16 e4m3 codes times the block scale s, as e4m3_lut[c] * s: the value's float32 bits are built from the code
 * (normal: sign, exponent field e + 120, the 3 mantissa bits on top; subnormal: m * 2^-9; S.1111.111: the quiet NaN
 * with the code's sign, as the table holds it), then the same float32 multiply by s. */
TARGET_AVX512 static inline __attribute__((always_inline)) __m512 e4m3x16(const uint8_t *codes, __m512 s) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    const __m512i e = _mm512_and_si512(_mm512_srli_epi32(c, 3), _mm512_set1_epi32(15));
    const __m512i m = _mm512_and_si512(c, _mm512_set1_epi32(7));
    __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23),
                                   _mm512_slli_epi32(m, 20));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(0x1p-9f));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), _mm512_castps_si512(sub));
    const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(c, _mm512_set1_epi32(0x7f)), _mm512_set1_epi32(0x7f));
    bits = _mm512_mask_mov_epi32(bits, nan, _mm512_castps_si512(_mm512_set1_ps(NAN)));
    bits = _mm512_or_si512(bits, _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24));
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), s);
}

/* One FP8 row's codes: the scalar loop below, 16 at a time where a block has them. A block with the NaN scale byte
 * keeps the table's loop: which NaN bits a product returns depends on its operand order, which the compiler may
 * swap, and the two loops must agree bit for bit. */
TARGET_AVX512 static void fp8_codes_avx512(const uint8_t *codes, const uint8_t *scales, float *dst, int64_t nope) {
    for (int64_t b = 0; 64 * b < nope; b++) {
        const float s = ue8m0(scales[b]);
        const int64_t n = nope - 64 * b < 64 ? nope - 64 * b : 64;
        int64_t i = 0;
        if (scales[b] != 255)
            for (; i + 16 <= n; i += 16)
                _mm512_storeu_ps(dst + 64 * b + i, e4m3x16(codes + 64 * b + i, _mm512_set1_ps(s)));
        for (; i < n; i++) dst[64 * b + i] = e4m3_lut[codes[64 * b + i]] * s;
    }
}
#endif

void state_rows_decode(const uint8_t *raw, float *out, int64_t rows, int64_t row_bytes, int kind, int64_t width,
                       int64_t rope) {
#if FASTAR_X86
    const int avx512 = cur_isa->vec == VEC_AVX512;
#endif
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *src = raw + r * row_bytes;
        float *dst = out + r * width;
        if (kind == STATE_FP8) {
            const int64_t nope = width - rope, nb = (nope + 63) / 64;
            const uint8_t *codes = src + 4 * rope, *scales = codes + 64 * nb;
#if FASTAR_X86
            if (avx512) {
                fp8_codes_avx512(codes, scales, dst, nope);
                memcpy(dst + nope, src, (size_t)rope * sizeof(float));
                continue;
            }
#endif
            for (int64_t b = 0; b < nb; b++) {
                const float s = ue8m0(scales[b]);
                const int64_t n = nope - 64 * b < 64 ? nope - 64 * b : 64;
                for (int64_t i = 0; i < n; i++) dst[64 * b + i] = e4m3_lut[codes[64 * b + i]] * s;
            }
            memcpy(dst + nope, src, (size_t)rope * sizeof(float));
        } else {
            const int64_t nb = (width + 31) / 32;
            const uint8_t *scales = src + 16 * nb;
            float block[32];
            for (int64_t b = 0; b < nb; b++) {
                const float s = ue8m0(scales[b]);
                for (int i = 0; i < 16; i++) {
                    const uint8_t byte = src[16 * b + i];
                    block[2 * i] = e2m1_lut[byte & 15] * s;
                    block[2 * i + 1] = e2m1_lut[byte >> 4] * s;
                }
                const int64_t n = width - 32 * b < 32 ? width - 32 * b : 32;
                memcpy(dst + 32 * b, block, (size_t)n * sizeof(float));
            }
        }
    }
}

/* The exponent e of the block scale 2^e the quantizers pick, ceil(log2(max(amax, floor) / qmax)) (ops.pow2_ceil). */
static int scale_exp(float amax, float floor, float qmax) {
    int e;
    const float m = frexpf((amax > floor ? amax : floor) / qmax, &e); /* v = m * 2^e, m in [0.5, 1) */
    return m == 0.5f ? e - 1 : e;
}

static inline float pow2i(int e) { return ue8m0((uint8_t)(e + 127)); } /* 2^e, e in [-126, 127] */

/* The e4m3 code of v if v is exactly an e4m3 value (|v| <= 448), else -1. */
static int e4m3_code(float v) {
    const int sign = signbit(v) ? 0x80 : 0;
    const float a = fabsf(v);
    if (a == 0.0f) return sign;
    if (!(a <= 448.0f)) return -1;
    int e;
    const float m = frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1): e4m3 exponent field e - 1 + 7 */
    if (e - 1 >= -6) {
        const float f = m * 16.0f - 8.0f; /* the 3 mantissa bits, exactly an integer if representable */
        if (f != floorf(f)) return -1;
        return sign | (e + 6) << 3 | (int)f;
    }
    const float f = a * 512.0f; /* subnormal: a = f * 2^-9, f in 1..7 */
    if (f != floorf(f) || f > 7.0f) return -1;
    return sign | (int)f;
}

/* The e2m1 code of v if v is exactly an e2m1 value, else -1. */
static int e2m1_code(float v) {
    for (int c = 0; c < 8; c++)
        if (fabsf(v) == e2m1_lut[c]) return (signbit(v) ? 8 : 0) | c;
    return -1;
}

static int block_finite(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

typedef struct {
    const uint8_t *raw;
    float *out;
    int64_t rows, row_bytes, width, rope, per_chunk;
    int kind;
} state_rows_ctx;

static void state_rows_chunk(void *p, int64_t i) {
    const state_rows_ctx *c = p;
    const int64_t r0 = i * c->per_chunk, n = c->rows - r0 < c->per_chunk ? c->rows - r0 : c->per_chunk;
    state_rows_decode(c->raw + r0 * c->row_bytes, c->out + r0 * c->width, n, c->row_bytes, c->kind, c->width,
                      c->rope);
}

void state_rows_decode_pool(const uint8_t *raw, float *out, int64_t rows, int64_t row_bytes, int kind, int64_t width,
                            int64_t rope) {
    state_rows_ctx c = {.raw = raw, .out = out, .rows = rows, .row_bytes = row_bytes, .width = width, .rope = rope,
                        .kind = kind};
    const int64_t chunks = 4 * (int64_t)pool_get_threads();
    c.per_chunk = (rows + chunks - 1) / chunks;
    if (rows * width < (1 << 16) || c.per_chunk < 1) {
        if (rows > 0) state_rows_decode(raw, out, rows, row_bytes, kind, width, rope);
    } else {
        pool_run((rows + c.per_chunk - 1) / c.per_chunk, state_rows_chunk, &c);
    }
}

/* A block holding a non-finite value is stored as scale byte 255 and decodes all NaN: the quantizers turn such a
 * block into NaN anyway (its amax and so its scale are not finite), so only garbage (a corrupt weight read
 * unchecked) ever meets this. */
int64_t state_rows_encode(const float *x, uint8_t *raw, int64_t rows, int64_t row_bytes, int kind, int64_t width,
                          int64_t rope) {
    for (int64_t r = 0; r < rows; r++) {
        const float *src = x + r * width;
        uint8_t *dst = raw + r * row_bytes;
        memset(dst, 0, (size_t)row_bytes);
        if (kind == STATE_FP8) {
            const int64_t nope = width - rope, nb = (nope + 63) / 64;
            uint8_t *codes = dst + 4 * rope, *scales = codes + 64 * nb;
            memcpy(dst, src + nope, (size_t)rope * sizeof(float));
            for (int64_t b = 0; b < nb; b++) {
                const int64_t n = nope - 64 * b < 64 ? nope - 64 * b : 64;
                if (!block_finite(src + 64 * b, n)) {
                    scales[b] = 255;
                    continue;
                }
                float amax = 0.0f;
                for (int64_t i = 0; i < n; i++) amax = fabsf(src[64 * b + i]) > amax ? fabsf(src[64 * b + i]) : amax;
                const int e = scale_exp(amax, 1e-4f, 448.0f);
                const float inv = pow2i(-e), s = pow2i(e);
                scales[b] = (uint8_t)(e + 127);
                for (int64_t i = 0; i < n; i++) {
                    const int c = e4m3_code(src[64 * b + i] * inv);
                    if (c < 0 || e4m3_lut[c] * s != src[64 * b + i]) return r;
                    codes[64 * b + i] = (uint8_t)c;
                }
            }
        } else {
            const int64_t nb = (width + 31) / 32;
            uint8_t *scales = dst + 16 * nb;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t n = width - 32 * b < 32 ? width - 32 * b : 32;
                if (!block_finite(src + 32 * b, n)) {
                    scales[b] = 255;
                    continue;
                }
                float amax = 0.0f;
                for (int64_t i = 0; i < n; i++) amax = fabsf(src[32 * b + i]) > amax ? fabsf(src[32 * b + i]) : amax;
                const int e = scale_exp(amax, 6.0f * 0x1p-126f, 6.0f);
                const float inv = pow2i(-e), s = pow2i(e);
                scales[b] = (uint8_t)(e + 127);
                for (int64_t i = 0; i < n; i++) {
                    const int c = e2m1_code(src[32 * b + i] * inv);
                    if (c < 0 || e2m1_lut[c] * s != src[32 * b + i]) return r;
                    dst[16 * b + i / 2] |= (uint8_t)(i & 1 ? c << 4 : c);
                }
            }
        }
    }
    return -1;
}

/* ---------------------------------------------------------------- lightning indexer scores */

/* score[t, e] = sum_h w[t, h] * (relu(q[t, h] . k[e]) * scale) for the entries query t sees (e < (p0 + t + 1) / 4),
 * -inf for the others. Each (t, e) sums its dims in order d = 0.. and then its heads in order h = 0.., whatever T,
 * the query's place in the chunk or the thread count: a query scores the same alone (decode) or in a chunk.
 * Work goes to the pool by blocks of IDX_EB entries, each run for every query (the block's keys, transposed so a
 * vector holds one dim of 16 entries, stay in L1). AVX-512 only: elsewhere torch's GEMM beats a portable loop
 * (measured: 5x), so the caller runs its torch reference. */
#define IDX_EB 32

typedef struct {
    const index_job *j;
    atomic_int failed;
} index_ctx;

#if FASTAR_X86
static inline __mmask16 lanes16(int64_t n) { /* the first clamp(n, 0, 16) lanes */
    return (__mmask16)(n <= 0 ? 0 : n >= 16 ? 0xffff : (1u << n) - 1);
}

/* NH heads of one query against the block's transposed keys kt [Di, 32]: the 32 entries' scores accumulate into s. */
AVX512_IDX_INLINE void heads_tile(const float *q, const float *w, const float *kt, int64_t Di, __m512 scale,
                                  __m512 s[2], const int NH) {
    __m512 a[4][2];
    for (int h = 0; h < NH; h++) a[h][0] = a[h][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < Di; d++) {
        const __m512 k0 = _mm512_loadu_ps(kt + d * IDX_EB), k1 = _mm512_loadu_ps(kt + d * IDX_EB + 16);
        for (int h = 0; h < NH; h++) {
            const __m512 qb = _mm512_set1_ps(q[h * Di + d]);
            a[h][0] = _mm512_fmadd_ps(qb, k0, a[h][0]);
            a[h][1] = _mm512_fmadd_ps(qb, k1, a[h][1]);
        }
    }
    for (int h = 0; h < NH; h++) /* heads in order: s += w_h * (relu(dot) * scale) */
        for (int c = 0; c < 2; c++) {
            const __m512 r = _mm512_mul_ps(_mm512_max_ps(a[h][c], _mm512_setzero_ps()), scale);
            s[c] = _mm512_fmadd_ps(_mm512_set1_ps(w[h]), r, s[c]);
        }
}

TARGET_AVX512 static void scores_avx512(const index_job *j, int64_t e0, int64_t e1, float *kt) {
    const int64_t n = e1 - e0, Di = j->Di;
    for (int64_t d = 0; d < Di; d++) /* transpose the block: kt[d, i] = keys[e0 + i, d], zero past the block */
        for (int64_t i = 0; i < IDX_EB; i++) kt[d * IDX_EB + i] = i < n ? j->keys[(e0 + i) * Di + d] : 0.0f;
    const __m512 scale = _mm512_set1_ps(j->scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < j->T; t++) {
        const int64_t visible = (j->p0 + t + 1) / 4;
        float *o = j->out + t * j->E + e0;
        __m512 s[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        if (visible > e0) {
            const float *q = j->q + t * j->Hi * Di, *w = j->w + t * j->Hi;
            int64_t h = 0;
            for (; h + 4 <= j->Hi; h += 4) heads_tile(q + h * Di, w + h, kt, Di, scale, s, 4);
            for (; h < j->Hi; h++) heads_tile(q + h * Di, w + h, kt, Di, scale, s, 1);
        }
        for (int c = 0; c < 2; c++) { /* store the block's lanes; -inf where the query does not see the entry */
            const int64_t vis = visible - e0 - 16 * c, lim = n - 16 * c;
            const __mmask16 seen = lanes16(vis), keep = lanes16(lim);
            _mm512_mask_storeu_ps(o + 16 * c, keep, _mm512_mask_blend_ps(seen, ninf, s[c]));
        }
    }
}
#endif

#if FASTAR_X86
/* The same scores on vdpbf16ps (AVX512_BF16: twice the multiply-adds of an FMA per instruction) when q and the keys
 * are all bfloat16s: the official numerics round both to FP4 e2m1 times a power of two, so every product is exact
 * and the result differs from the FP32 kernel only in float32 summation order (dims in pairs, pairs in order;
 * vdpbf16ps flushes denormals, which FP4-rounded values of any sane scale never produce). q arrives as bfloat16
 * pairs qb [T, Hi, Di/2]; the block's keys are laid out as pairs kb [Di/2, 32] (a vector: one dim pair of 16
 * entries). */
#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))
#define BF16_INLINE TARGET_BF16 static inline __attribute__((always_inline))

BF16_INLINE void heads_tile_bf16(const uint32_t *q, const float *w, const uint32_t *kb, int64_t Dp, __m512 scale,
                                 __m512 s[2], const int NH) {
    __m512 a[4][2];
    for (int h = 0; h < NH; h++) a[h][0] = a[h][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < Dp; d++) {
        const __m512i k0 = _mm512_loadu_si512((const void *)(kb + d * IDX_EB)),
                      k1 = _mm512_loadu_si512((const void *)(kb + d * IDX_EB + 16));
        for (int h = 0; h < NH; h++) {
            const __m512i qb = _mm512_set1_epi32((int)q[h * Dp + d]);
            a[h][0] = _mm512_dpbf16_ps(a[h][0], (__m512bh)qb, (__m512bh)k0);
            a[h][1] = _mm512_dpbf16_ps(a[h][1], (__m512bh)qb, (__m512bh)k1);
        }
    }
    for (int h = 0; h < NH; h++) /* heads in order, as the FP32 kernel */
        for (int c = 0; c < 2; c++) {
            const __m512 r = _mm512_mul_ps(_mm512_max_ps(a[h][c], _mm512_setzero_ps()), scale);
            s[c] = _mm512_fmadd_ps(_mm512_set1_ps(w[h]), r, s[c]);
        }
}

TARGET_BF16 static void scores_bf16(const index_job *j, const uint32_t *qb, int64_t e0, int64_t e1, uint32_t *kb) {
    const int64_t n = e1 - e0, Dp = j->Di / 2;
    if (j->packed) { /* the same pairs from the stored rows: each value decoded as state_rows_decode decodes it */
        const int64_t nb = j->Di / 32, row = 17 * nb;
        for (int64_t i = 0; i < IDX_EB; i++) {
            const uint8_t *src = j->packed + (e0 + i) * row;
            for (int64_t b = 0; b < nb; b++) { /* 16 pairs of one scale block */
                const uint8_t sb = i < n ? src[16 * nb + b] : 127;
                uint32_t *dst = kb + 16 * b * IDX_EB + i;
                if (sb >= 10 && sb <= 250) { /* every nonzero value's result is a normal: add to the exponents */
                    const uint32_t k = (uint32_t)((int32_t)sb - 127);
                    for (int p = 0; p < 16; p++) {
                        const uint8_t byte = i < n ? src[16 * b + p] : 0;
                        dst[p * IDX_EB] = e2m1_pair[byte] + k * e2m1_unit[byte];
                    }
                } else { /* near the range's ends, or a NaN block: the float products themselves */
                    const float s = ue8m0(sb);
                    for (int p = 0; p < 16; p++) {
                        const uint8_t byte = src[16 * b + p];
                        dst[p * IDX_EB] = f32_bits(e2m1_lut[byte & 15] * s) >> 16 |
                                          (f32_bits(e2m1_lut[byte >> 4] * s) & 0xffff0000u);
                    }
                }
            }
        }
    } else {
        for (int64_t d = 0; d < Dp; d++) /* kb[d, i] = keys[e0 + i, 2d .. 2d+1] as a bfloat16 pair, 0 past the block */
            for (int64_t i = 0; i < IDX_EB; i++) {
                const float *k = j->keys + (e0 + i) * j->Di + 2 * d;
                kb[d * IDX_EB + i] = i < n ? f32_bits(k[0]) >> 16 | (f32_bits(k[1]) & 0xffff0000u) : 0;
            }
    }
    const __m512 scale = _mm512_set1_ps(j->scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < j->T; t++) {
        const int64_t visible = (j->p0 + t + 1) / 4;
        float *o = j->out + t * j->E + e0;
        __m512 s[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        if (visible > e0) {
            const uint32_t *q = qb + t * j->Hi * Dp;
            const float *w = j->w + t * j->Hi;
            int64_t h = 0;
            for (; h + 4 <= j->Hi; h += 4) heads_tile_bf16(q + h * Dp, w + h, kb, Dp, scale, s, 4);
            for (; h < j->Hi; h++) heads_tile_bf16(q + h * Dp, w + h, kb, Dp, scale, s, 1);
        }
        for (int c = 0; c < 2; c++) {
            const int64_t vis = visible - e0 - 16 * c, lim = n - 16 * c;
            _mm512_mask_storeu_ps(o + 16 * c, lanes16(lim), _mm512_mask_blend_ps(lanes16(vis), ninf, s[c]));
        }
    }
}

static int all_bf16(const float *x, int64_t n) { /* every value's low 16 bits are zero */
    uint32_t any = 0;
    for (int64_t i = 0; i < n; i++) any |= f32_bits(x[i]) & 0xffffu;
    return any == 0;
}

typedef struct {
    index_ctx base;
    const uint32_t *qb;
} index_bf16_ctx;

static void index_chunk_bf16(void *p, int64_t i) {
    index_bf16_ctx *c = p;
    const index_job *j = c->base.j;
    const int64_t e0 = i * IDX_EB, e1 = e0 + IDX_EB < j->E ? e0 + IDX_EB : j->E;
    uint32_t *kb = malloc((size_t)(j->Di / 2) * IDX_EB * sizeof *kb);
    if (!kb) {
        atomic_store(&c->base.failed, 1);
        return;
    }
    scores_bf16(j, c->qb, e0, e1, kb);
    free(kb);
}

static void index_chunk(void *p, int64_t i) {
    index_ctx *c = p;
    const index_job *j = c->j;
    const int64_t e0 = i * IDX_EB, e1 = e0 + IDX_EB < j->E ? e0 + IDX_EB : j->E;
    float *kt = malloc((size_t)j->Di * IDX_EB * sizeof(float));
    if (!kt) {
        atomic_store(&c->failed, 1);
        return;
    }
    scores_avx512(j, e0, e1, kt);
    free(kt);
}
#endif

int index_scores_run(const isa_ops *isa, const index_job *j) {
#if FASTAR_X86
    /* an ISA with the bf16 dot path (fp8_bmap set: kern_avx512bf16.c) has vdpbf16ps */
    const int dot_bf16 = j->bf16 && isa->vec == VEC_AVX512 && isa->fp8_bmap && j->Di % 2 == 0;
    if (j->packed && (!dot_bf16 || j->Di % 32)) return 1; /* the caller decodes the rows and asks again */
    /* packed keys are e2m1 codes times powers of two: bfloat16s by construction */
    if (j->bf16 && (!all_bf16(j->q, j->T * j->Hi * j->Di) || (!j->packed && !all_bf16(j->keys, j->E * j->Di))))
        return -2;
    if (dot_bf16) {
        const int64_t n = j->T * j->Hi * j->Di / 2;
        uint32_t *qb = malloc((size_t)n * sizeof *qb + 1);
        if (!qb) return -1;
        for (int64_t i = 0; i < n; i++) qb[i] = f32_bits(j->q[2 * i]) >> 16 | (f32_bits(j->q[2 * i + 1]) & 0xffff0000u);
        index_bf16_ctx c = {.base = {.j = j}, .qb = qb};
        atomic_init(&c.base.failed, 0);
        pool_run((j->E + IDX_EB - 1) / IDX_EB, index_chunk_bf16, &c);
        free(qb);
        return atomic_load(&c.base.failed) ? -1 : 0;
    }
    if (isa->vec == VEC_AVX512) {
        index_ctx c = {.j = j};
        atomic_init(&c.failed, 0);
        pool_run((j->E + IDX_EB - 1) / IDX_EB, index_chunk, &c);
        return atomic_load(&c.failed) ? -1 : 0;
    }
#endif
    (void)isa, (void)j;
    return 1; /* no kernel for this ISA (or packed keys without the bf16 one): torch's GEMM beats a portable loop */
}

/* ---------------------------------------------------------------- top-k of the indexer's scores */

/* out[t, 0..k) = the k entries with the highest score[t, e] among those query t sees (e < (p0 + t + 1) / 4), in
 * ascending entry order, ties broken towards the lower entry, then -1 up to k where it sees fewer. Scores compare
 * in a total order on their bits (-0 below +0; a NaN with the sign clear above +inf, as torch.topk ranks NaN
 * highest): the picks of a query depend on its own row only, so they are batch- and thread-invariant. The twin of
 * fastar.model.ops.index_topk_torch (the same picks whenever no two visible scores tie at the k-th place, where
 * torch leaves the choice open). A quickselect finds the k-th largest key, then one pass in entry order takes
 * what is above it and the first of those equal to it: O(E) a query instead of a sort. */
static inline uint32_t order_key(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u & 0x80000000u ? ~u : u | 0x80000000u; /* unsigned order = float order */
}

/* The k-th largest of a[0..n) (1 <= k <= n); a is reordered. */
static uint32_t kth_largest(uint32_t *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    const int64_t want = k - 1; /* its index in descending order */
    while (lo < hi) {
        const uint32_t x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi];
        const uint32_t piv = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        int64_t i = lo, j = hi;
        while (i <= j) { /* descending: [lo, j] >= piv, [i, hi] <= piv afterwards */
            while (a[i] > piv) i++;
            while (a[j] < piv) j--;
            if (i <= j) {
                const uint32_t t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return piv; /* j < want < i: between the halves every key equals piv */
    }
    return a[want];
}

typedef struct {
    const float *score;
    int64_t *out;
    int64_t T, E, k, p0;
    atomic_int failed;
} topk_ctx;

#define TOPK_TB 8 /* queries per pool chunk */

static void topk_chunk(void *p, int64_t c) {
    topk_ctx *x = p;
    uint32_t *keys = NULL;
    for (int64_t t = c * TOPK_TB; t < x->T && t < (c + 1) * TOPK_TB; t++) {
        const float *s = x->score + t * x->E;
        int64_t *o = x->out + t * x->k, n = (x->p0 + t + 1) / 4, m = 0;
        if (n > x->E) n = x->E;
        if (n <= x->k) { /* every visible entry */
            for (; m < n; m++) o[m] = m;
        } else {
            if (!keys && !(keys = malloc((size_t)x->E * sizeof *keys))) {
                atomic_store(&x->failed, 1);
                return;
            }
            for (int64_t e = 0; e < n; e++) keys[e] = order_key(s[e]);
            const uint32_t thr = kth_largest(keys, n, x->k);
            int64_t above = 0;
            for (int64_t e = 0; e < n; e++) above += order_key(s[e]) > thr;
            int64_t ties = x->k - above; /* the first this many entries equal to thr */
            for (int64_t e = 0; e < n && m < x->k; e++) {
                const uint32_t key = order_key(s[e]);
                if (key > thr || (key == thr && ties-- > 0)) o[m++] = e;
            }
        }
        for (; m < x->k; m++) o[m] = -1;
    }
    free(keys);
}

int index_topk_run(const float *score, int64_t *out, int64_t T, int64_t E, int64_t k, int64_t p0) {
    topk_ctx c = {.score = score, .out = out, .T = T, .E = E, .k = k, .p0 = p0};
    atomic_init(&c.failed, 0);
    pool_run((T + TOPK_TB - 1) / TOPK_TB, topk_chunk, &c);
    return atomic_load(&c.failed) ? -1 : 0;
}

/* ---------------------------------------------------------------- the compressor's pooling */

/* out[w, f] = sum_r kv[w, r, f] * p[w, r, f],  p[w, ., f] = softmax over the window's M rows r of gate[w, r, f]
 * (exp(g - max) / sum, rows in order; a -inf gate row weighs 0). Each window depends on its own rows only, in one
 * fixed order, so a window pools the same whichever chunk closes it and for any thread count. The twin of
 * fastar.model.ops.compress_pool_torch (within float32 rounding: libm's expf, or exp512.h's on AVX-512 ISAs, and
 * another summation order). The loops run along the features (contiguous), each exp computed once into a
 * per-window scratch [M + 2, hd]. */
typedef struct {
    const float *kv, *gate;
    float *out;
    int64_t M, hd;
    int avx512; /* the exps on 16 lanes (exp512.h: within 1-2 ulp of expf) */
    atomic_int failed;
} pool_ctx;

#if FASTAR_X86
/* e[r, f] = exp(g[r, f] - m[f]) and sum[f] += e[r, f] over the rows in order, 16 features at a time. */
TARGET_AVX512 static void pool_exps_avx512(const float *g, const float *m, float *e, float *sum, int64_t M,
                                           int64_t hd) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t f = 0; f < hd; f += 16) {
            const __mmask16 k = lanes16(hd - f);
            const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, g + r * hd + f), _mm512_maskz_loadu_ps(k, m + f));
            const __m512 ev = exp512(x);
            _mm512_mask_storeu_ps(e + r * hd + f, k, ev);
            _mm512_mask_storeu_ps(sum + f, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, sum + f), ev));
        }
}
#endif

static void pool_window(void *p, int64_t w) {
    pool_ctx *c = p;
    const int64_t M = c->M, hd = c->hd;
    const float *kv = c->kv + w * M * hd, *g = c->gate + w * M * hd;
    float *o = c->out + w * hd, *e = calloc((size_t)(M + 2) * hd, sizeof *e);
    if (!e) {
        atomic_store(&c->failed, 1);
        return;
    }
    float *m = e + M * hd, *sum = m + hd;
    for (int64_t f = 0; f < hd; f++) m[f] = -INFINITY, sum[f] = 0.0f, o[f] = 0.0f;
    for (int64_t r = 0; r < M; r++)
        for (int64_t f = 0; f < hd; f++) m[f] = g[r * hd + f] > m[f] ? g[r * hd + f] : m[f];
#if FASTAR_X86
    if (c->avx512) pool_exps_avx512(g, m, e, sum, M, hd);
    else
#endif
        for (int64_t r = 0; r < M; r++)
            for (int64_t f = 0; f < hd; f++) sum[f] += (e[r * hd + f] = expf(g[r * hd + f] - m[f]));
    for (int64_t r = 0; r < M; r++)
        for (int64_t f = 0; f < hd; f++) o[f] += kv[r * hd + f] * (e[r * hd + f] / sum[f]);
    free(e);
}

int compress_pool_run(const isa_ops *isa, const float *kv, const float *gate, float *out, int64_t n, int64_t M,
                      int64_t hd) {
    pool_ctx c = {.kv = kv, .gate = gate, .out = out, .M = M, .hd = hd, .avx512 = isa->vec == VEC_AVX512};
    atomic_init(&c.failed, 0);
    if (n * M * hd < (1 << 15)) { /* a decode step's one window: not worth waking the pool */
        for (int64_t w = 0; w < n; w++) pool_window(&c, w);
    } else {
        pool_run(n, pool_window, &c);
    }
    return atomic_load(&c.failed) ? -1 : 0;
}
