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

#include "simd.h"

#if FASTAR_X86
#include <immintrin.h>
#define AVX512_IDX_INLINE TARGET_AVX512 static inline __attribute__((always_inline))
#endif

/* ---------------------------------------------------------------- packed rows */

static float e4m3_lut[256];
static const float e2m1_lut[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

void state_rows_init(void) {
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

void state_rows_decode(const uint8_t *raw, float *out, int64_t rows, int64_t row_bytes, int kind, int64_t width,
                       int64_t rope) {
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *src = raw + r * row_bytes;
        float *dst = out + r * width;
        if (kind == STATE_FP8) {
            const int64_t nope = width - rope, nb = (nope + 63) / 64;
            const uint8_t *codes = src + 4 * rope, *scales = codes + 64 * nb;
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
    if (isa->vec == VEC_AVX512) {
        index_ctx c = {.j = j};
        atomic_init(&c.failed, 0);
        pool_run((j->E + IDX_EB - 1) / IDX_EB, index_chunk, &c);
        return atomic_load(&c.failed) ? -1 : 0;
    }
#endif
    (void)isa, (void)j;
    return 1; /* no kernel for this ISA: torch's GEMM beats a portable loop several times */
}
