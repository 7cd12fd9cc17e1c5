/* Portable C kernels and the shared lookup tables.
 *
 * Owns: ue8m0_f32 / fp8_f32 / fp4_f32 (built from the bit definitions in fastar/quant/reference.py; the C side's
 * only copy of each: the SIMD files derive their tables from these in their init), the scalar products, which are
 * the always-correct fallback on any CPU, and DeepSeek's FP8 activation quantization (fp8_act_quant_scalar, which
 * the ISAs' act_quant match bit for bit). The products favour plain code over speed: each row is dequantized once
 * into a small buffer (exact: value * 2^k) and reused for every token.
 * Does not own: SIMD paths (kern_avx2.c, kern_avx512*.c) or argument checks (the bindings).
 */
#include <math.h>
#include <string.h>

#include "kernels.h"

float ue8m0_f32[256];
float fp8_f32[256];
const float fp4_f32[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                           -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

void tables_init(void) {
    for (int b = 0; b < 256; b++) {
        ue8m0_f32[b] = b == 255 ? NAN : ldexpf(1.0f, b - 127); /* b = 0: 2^-127, a denormal, exact */
        int sign = b >> 7, e = (b >> 3) & 15, m = b & 7;
        float v;
        if (e == 15 && m == 7) v = NAN; /* e4m3fn has no infinities; S.1111.111 is NaN */
        else if (e == 0) v = ldexpf((float)m, -9); /* denormal: m/8 * 2^-6 */
        else v = ldexpf(1.0f + m / 8.0f, e - 7);
        fp8_f32[b] = sign ? -v : v;
    }
}

#define KB 256 /* columns dequantized at a time */

/* out[t, n] for rows [n0, n1): dequantize KB columns of a row, then accumulate every token against them. */
static void finish_rows(const mm_job *j, int64_t n, const float *acc) {
    for (int64_t t = 0; t < j->T; t++) {
        float *o = j->out + t * j->ldo + n;
        *o = j->accumulate ? *o + acc[t] : acc[t];
    }
}

static float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

#define ROW_LOOP(DEQUANT)                                                                  \
    float wbuf[KB];                                                                        \
    for (int64_t n = n0; n < n1; n++) {                                                   \
        for (int64_t t = 0; t < j->T; t++) acc[t] = 0.0f;                                 \
        for (int64_t k0 = 0; k0 < j->K; k0 += KB) {                                        \
            int64_t kb = j->K - k0 < KB ? j->K - k0 : KB;                                  \
            for (int64_t c = 0; c < kb; c++) wbuf[c] = (DEQUANT);                         \
            for (int64_t t = 0; t < j->T; t++) acc[t] += dot(j->x + t * j->K + k0, wbuf, kb); \
        }                                                                                  \
        finish_rows(j, n, acc);                                                            \
    }

/* The token accumulators live on the stack in blocks of this many tokens. */
#define TB 64

static void fp4_rows_tb(const mm_job *j, int64_t n0, int64_t n1, float *acc) {
    const uint8_t *w = j->w;
    int64_t half = j->K / 2, groups = j->K / FP4_GROUP;
    ROW_LOOP(fp4_f32[(w[n * half + (k0 + c) / 2] >> (4 * ((k0 + c) & 1))) & 15] *
             ue8m0_f32[j->s[n * groups + (k0 + c) / FP4_GROUP]])
}

static void fp8_rows_tb(const mm_job *j, int64_t n0, int64_t n1, float *acc) {
    const uint8_t *w = j->w;
    int64_t kblocks = (j->K + FP8_BLOCK - 1) / FP8_BLOCK;
    ROW_LOOP(fp8_f32[w[n * j->K + k0 + c]] * ue8m0_f32[j->s[(n / FP8_BLOCK) * kblocks + (k0 + c) / FP8_BLOCK]])
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void bf16_rows_tb(const mm_job *j, int64_t n0, int64_t n1, float *acc) {
    const uint16_t *w = j->w;
    ROW_LOOP(bf16_to_f32(w[n * j->K + k0 + c]))
}

/* Split T into blocks of TB tokens so the accumulators fit on the stack. */
#define TOKEN_BLOCKS(FN)                                                          \
    static void FN##_scalar(const mm_job *j, int64_t n0, int64_t n1) {            \
        float acc[TB];                                                            \
        for (int64_t t0 = 0; t0 < j->T; t0 += TB) {                               \
            mm_job sub = *j;                                                      \
            sub.T = j->T - t0 < TB ? j->T - t0 : TB;                              \
            sub.x = j->x + t0 * j->K;                                             \
            sub.out = j->out + t0 * j->ldo;                                       \
            FN##_tb(&sub, n0, n1, acc);                                           \
        }                                                                         \
    }
TOKEN_BLOCKS(fp4_rows)
TOKEN_BLOCKS(fp8_rows)
TOKEN_BLOCKS(bf16_rows)

/* ---------------------------------------------------------------- FP8 activation quantization */

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Nearest e4m3fn value of a (|a| <= 448, finite), ties to even: the quantum is 2^(max(e, -6) - 3) for a's
 * binade e (2^-9 below 2^-6, the subnormals); (y + 2^23) - 2^23 rounds y < 2^22 to an integer, ties to even. */
static inline float e4m3_round(float a) {
    const int e = (int)((f2u(a) >> 23) & 0xff) - 127;
    const int q = (e < -6 ? -6 : e) - 3;
    const float y = a * u2f((uint32_t)(127 - q) << 23);
    return ((y + 8388608.0f) - 8388608.0f) * u2f((uint32_t)(127 + q) << 23);
}

/* DeepSeek's act_quant simulated: per `block` values of a row, s = 2^ceil(log2(max(amax, 1e-4) / 448)) and
 * x -> e4m3(x / s) * s. Bit-identical to fastar.model.ops.fp8_quant_sim_torch (tested), quirks included: a
 * block holding a NaN or an infinity gets s = 1 (NaN stays NaN, infinities saturate to +-448). */
void fp8_act_quant_scalar(const float *x, float *out, int64_t rows, int64_t K, int64_t block) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b0 = 0; b0 < K; b0 += block) {
            const float *xb = x + r * K + b0;
            float *ob = out + r * K + b0;
            const int64_t n = K - b0 < block ? K - b0 : block;
            float amax = 0.0f;
            int bad = 0;
            for (int64_t i = 0; i < n; i++) {
                const float a = fabsf(xb[i]);
                bad |= !(a <= 3.4028235e38f); /* NaN or inf */
                amax = a > amax ? a : amax;
            }
            int ex = 0, sexp = 0; /* a NaN or infinite amax gives s = 1, as torch's frexp does */
            if (!bad) {
                const float m = frexpf((amax > 1e-4f ? amax : 1e-4f) / 448.0f, &ex); /* v = m 2^ex, m in [.5, 1) */
                sexp = m == 0.5f ? ex - 1 : ex;                                       /* s = 2^sexp >= v */
            }
            fp8_act_quant_tail(xb, ob, n, ldexpf(1.0f, sexp), ldexpf(1.0f, -sexp));
        }
}

void fp8_act_quant_tail(const float *xb, float *ob, int64_t n, float s, float inv) {
    for (int64_t i = 0; i < n; i++) {
        float v = xb[i] * inv;
        v = v > 448.0f ? 448.0f : (v < -448.0f ? -448.0f : v);
        ob[i] = copysignf(e4m3_round(fabsf(v)), v) * s;
    }
}

static double fma_loop_scalar(int64_t iters) {
    float a[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    for (int64_t i = 0; i < iters; i++)
        for (int k = 0; k < 8; k++) a[k] = a[k] * 0.9999f + 0.0001f;
    volatile float sink = a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
    (void)sink;
    return (double)iters * 8 * 2;
}

static double read_sum_scalar(const uint8_t *p, size_t n) {
    uint64_t s = 0;
    const uint64_t *q = (const uint64_t *)p;
    for (size_t i = 0; i < n / 8; i++) s += q[i];
    return (double)s;
}

const isa_ops isa_scalar_ops = {
    .name = "scalar",
    .needs = "",
    .vec = VEC_PORTABLE,
    .dot_max = 0,
    .fp4 = fp4_rows_scalar,
    .fp8 = fp8_rows_scalar,
    .bf16 = bf16_rows_scalar,
    .fma_loop = fma_loop_scalar,
    .read_sum = read_sum_scalar,
};
