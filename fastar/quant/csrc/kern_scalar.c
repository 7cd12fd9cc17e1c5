/* Portable C kernels and the shared lookup tables.
 *
 * Owns: ue8m0_f32 / fp8_f32 / fp4_f32 (built from the bit definitions in fastar/quant/reference.py; the C side's
 * only copy of each: the SIMD files derive their tables from these in their init), the scalar products, which are
 * the always-correct fallback on any CPU, and DeepSeek's FP8 activation quantization (fp8_act_quant_scalar, which
 * the ISAs' act_quant match bit for bit). The products are plain C that any compiler vectorizes for whatever the
 * target has (the "scalar" ISA; every architecture's fallback), in two shapes:
 * - dot path (T <= DOT_MAX): 4-lane vector extensions; each 16-byte block of a weight row is decoded in registers
 *   by shifts and masks, no table (the x of the call arrives permuted to the lanes' columns), DOT_GROUP tokens at a
 *   time, each (row, token) summed in an order that depends on neither T nor the token's place (DOT_DISPATCH);
 * - row path (larger T): each row is dequantized once per KB columns into a small buffer (exact: value * 2^k)
 *   and reused for every token, each dot product in 16 lanes.
 * Does not own: the intrinsics paths (kern_avx2.c, kern_avx512*.c, kern_neon*.c) or argument checks (the bindings).
 */
#include <math.h>
#include <string.h>

#include "simd.h"

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

/* ---------------------------------------------------------------- the vectors
 * GCC / clang vector extensions, 4 lanes of 32 bits: whatever vector unit the target has (SSE2 on x86-64, ASIMD on
 * AArch64, VSX, ...) and plain code elsewhere. A 16-byte block of weights is read as 4 32-bit words; a word's bytes
 * or nibbles are taken by shifts and masks (no table, no gather), so the columns a lane holds are not adjacent and
 * the dot path's x arrives permuted to match (the maps below). */
typedef float vf __attribute__((vector_size(16)));
typedef uint32_t vu __attribute__((vector_size(16)));
typedef int32_t vi __attribute__((vector_size(16)));

static inline vf loadf(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vu loadu(const void *p) { vu v; memcpy(&v, p, sizeof v); return v; }
static inline vf as_f(vu u) { return (vf)u; }
static inline vu as_u(vf f) { return (vu)f; }
/* 4 lanes in a fixed order. */
static inline float hsum(vf v) { return (v[0] + v[2]) + (v[1] + v[3]); }

/* Which byte of memory is byte p (0: least significant) of a 32-bit word. */
static int word_byte(int p) {
    const uint32_t one = 1;
    return *(const uint8_t *)&one ? p : 3 - p;
}

/* The dot path's column orders, per XP_CHUNK columns: xp[c0 + i] = x[c0 + map[i]], lane i of nibble / byte / half
 * position j of a 16-byte block at xp[block + 4j + i]. */
static uint8_t fp4_map[XP_CHUNK], fp8_map[XP_CHUNK], bf16_map[XP_CHUNK];

static void init_scalar(void) {
    for (int c0 = 0; c0 < XP_CHUNK; c0 += 32) /* FP4: 32 columns per 16 bytes, nibble j of word i */
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 4; i++)
                fp4_map[c0 + 4 * j + i] = (uint8_t)(c0 + 2 * (4 * i + word_byte(j / 2)) + (j & 1));
    for (int c0 = 0; c0 < XP_CHUNK; c0 += 16) /* FP8: 16 columns per 16 bytes, byte j of word i */
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 4; i++) fp8_map[c0 + 4 * j + i] = (uint8_t)(c0 + 4 * i + word_byte(j));
    for (int c0 = 0; c0 < XP_CHUNK; c0 += 8) /* BF16: 8 columns per 16 bytes, half j of word i */
        for (int j = 0; j < 2; j++)
            for (int i = 0; i < 4; i++) bf16_map[c0 + 4 * j + i] = (uint8_t)(c0 + 2 * i + word_byte(2 * j) / 2);
}

/* ---------------------------------------------------------------- dot path (T <= DOT_MAX) */

#define DOT_MAX 8

/* e2m1 codes (low 4 bits of each lane) -> floats, exactly: e = 1..3 is the float with exponent e + 126 and the
 * mantissa bit m (bits (c & 7) << 22 plus 126 << 23); e = 0 gives f = 0.5 + m/4 there, and 2f - 1 = m/2 is exact. */
static inline vf fp4_value(vu c) {
    const vu mag = (c & 7) << 22;
    const vf f = as_f(mag + (126u << 23));
    const vu sub = (vu)(mag < (2u << 22));
    return as_f(as_u(f + as_f(sub & as_u(f - 1.0f))) | ((c & 8) << 28));
}

/* e4m3fn bytes (low 8 bits) -> floats, exactly, likewise: exponent e + 120 and mantissa m << 20 for e >= 1; for e = 0,
 * f = 2^-7 (1 + m/8) and 2f - 2^-6 = m 2^-9. The NaN codes decode to +-480: the caller tracks them. */
static inline vf fp8_value(vu b) {
    const vu mag = (b & 0x7f) << 20;
    const vf f = as_f(mag + (120u << 23));
    const vu sub = (vu)(mag < (8u << 20));
    return as_f(as_u(f + as_f(sub & as_u(f - 0x1p-6f))) | ((b & 0x80) << 24));
}

/* The row kernels: acc[t] += sum over columns [cb, ce) of x[t] . W[n] for nt tokens (DOT_DISPATCH, simd.h), each
 * (row, token) summed in one order: per scale group two 4-lane chains, times the scale into a 4-lane total, then
 * hsum. */
static inline void fp4_dot_row(const mm_job *j, int64_t n, const int nt, int64_t cb, int64_t ce, float *acc) {
    const uint8_t *wr = (const uint8_t *)j->w + n * (j->K / 2), *sr = j->s + n * (j->K / FP4_GROUP);
    vf tot[DOT_GROUP] = {{0}};
    for (int64_t g = cb / FP4_GROUP; g < ce / FP4_GROUP; g++) {
        const vu w = loadu(wr + 16 * g);
        vf wv[8];
        for (int q = 0; q < 8; q++) wv[q] = fp4_value(w >> (4 * q));
        const float sc = ue8m0_f32[sr[g]];
        for (int t = 0; t < nt; t++) {
            const float *xt = j->xp + t * j->kp + FP4_GROUP * g;
            vf pa = loadf(xt) * wv[0], pb = loadf(xt + 4) * wv[1];
            for (int q = 2; q < 8; q += 2) {
                pa += loadf(xt + 4 * q) * wv[q];
                pb += loadf(xt + 4 * q + 4) * wv[q + 1];
            }
            tot[t] += (pa + pb) * sc;
        }
    }
    for (int t = 0; t < nt; t++) acc[t] += hsum(tot[t]);
}

/* A 16-byte block of a row at column c of [c, ce): the bytes themselves, or a zero-padded copy at the row's end
 * (x is zero padded there too: dispatch.c's permuted copy). */
static inline vu load_block(const uint8_t *p, int64_t nbytes) {
    if (nbytes >= 16) return loadu(p);
    uint8_t tmp[16] = {0};
    memcpy(tmp, p, (size_t)nbytes);
    return loadu(tmp);
}

static inline void fp8_dot_row(const mm_job *j, int64_t n, const int nt, int64_t cb, int64_t ce, float *acc) {
    const int64_t K = j->K, kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    const uint8_t *wr = (const uint8_t *)j->w + n * K, *srow = j->s + (n / FP8_BLOCK) * kb;
    vf tot[DOT_GROUP] = {{0}};
    vu nan = {0};
    for (int64_t b = cb / FP8_BLOCK; b * FP8_BLOCK < ce; b++) {
        const int64_t c0 = b * FP8_BLOCK, c1 = c0 + FP8_BLOCK < ce ? c0 + FP8_BLOCK : ce;
        vf pa[DOT_GROUP] = {{0}}, pb[DOT_GROUP] = {{0}};
        for (int64_t c = c0; c < c1; c += 16) {
            const vu w = load_block(wr + c, c1 - c);
            vf wv[4];
            for (int q = 0; q < 4; q++) {
                const vu byte = (w >> (8 * q)) & 0xff;
                nan |= (vu)((byte & 0x7f) == 0x7f);
                wv[q] = fp8_value(byte);
            }
            for (int t = 0; t < nt; t++) {
                const float *xt = j->xp + t * j->kp + c;
                pa[t] += loadf(xt) * wv[0] + loadf(xt + 8) * wv[2];
                pb[t] += loadf(xt + 4) * wv[1] + loadf(xt + 12) * wv[3];
            }
        }
        const float sc = ue8m0_f32[srow[b]];
        for (int t = 0; t < nt; t++) tot[t] += (pa[t] + pb[t]) * sc;
    }
    const int poisoned = (nan[0] | nan[1] | nan[2] | nan[3]) != 0; /* e4m3 NaN codes: the reference's row is NaN */
    for (int t = 0; t < nt; t++) acc[t] += poisoned ? NAN : hsum(tot[t]);
}

static inline void bf16_dot_row(const mm_job *j, int64_t n, const int nt, int64_t cb, int64_t ce, float *acc) {
    const uint16_t *wr = (const uint16_t *)j->w + n * j->K;
    vf pa[DOT_GROUP] = {{0}}, pb[DOT_GROUP] = {{0}};
    for (int64_t c = cb; c < ce; c += 8) {
        const vu w = load_block((const uint8_t *)(wr + c), 2 * (ce - c));
        const vf lo = as_f(w << 16), hi = as_f(w & 0xffff0000u);
        for (int t = 0; t < nt; t++) {
            const float *xt = j->xp + t * j->kp + c;
            pa[t] += loadf(xt) * lo;
            pb[t] += loadf(xt + 4) * hi;
        }
    }
    for (int t = 0; t < nt; t++) acc[t] += hsum(pa[t] + pb[t]);
}

/* ---------------------------------------------------------------- row path (T > DOT_MAX) */

#define KB 256 /* columns dequantized at a time */

/* out[t, n] for rows [n0, n1): dequantize KB columns of a row (exact: value * 2^k), then accumulate every token
 * against them, each dot product in 16 lanes. */
static void finish_rows(const mm_job *j, int64_t n, const float *acc) {
    for (int64_t t = 0; t < j->T; t++) {
        float *o = j->out + t * j->ldo + n;
        *o = j->accumulate ? *o + acc[t] : acc[t];
    }
}

static float dot(const float *a, const float *b, int64_t n) {
    vf s[4] = {{0}};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int q = 0; q < 4; q++) s[q] += loadf(a + i + 4 * q) * loadf(b + i + 4 * q);
    float r = hsum((s[0] + s[2]) + (s[1] + s[3]));
    for (; i < n; i++) r += a[i] * b[i];
    return r;
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

/* The dot path for T <= DOT_MAX, else the row path with T split into blocks of TB tokens (accumulators on the
 * stack). */
#define ROWS(FN)                                                                  \
    static void FN##_scalar(const mm_job *j, int64_t n0, int64_t n1) {            \
        if (j->dot) {                                                             \
            DOT_DISPATCH(FN##_dot_row)                                            \
            return;                                                               \
        }                                                                         \
        float acc[TB];                                                            \
        for (int64_t t0 = 0; t0 < j->T; t0 += TB) {                               \
            mm_job sub = *j;                                                      \
            sub.T = j->T - t0 < TB ? j->T - t0 : TB;                              \
            sub.x = j->x + t0 * j->K;                                             \
            sub.out = j->out + t0 * j->ldo;                                       \
            FN##_rows_tb(&sub, n0, n1, acc);                                      \
        }                                                                         \
    }
ROWS(fp4)
ROWS(fp8)
ROWS(bf16)

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

/* The portable vectors' multiply-add peak (fused where the target fuses a * b + c): 8 independent 4-lane chains. */
static double fma_loop_scalar(int64_t iters) {
    vf a[8];
    for (int k = 0; k < 8; k++) a[k] = (vf){1, 2, 3, 4} * (float)(k + 1);
    for (int64_t i = 0; i < iters; i++)
        for (int k = 0; k < 8; k++) a[k] = a[k] * 0.9999f + 0.0001f;
    volatile float sink = hsum(((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])));
    (void)sink;
    return (double)iters * 8 * 4 * 2;
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
    .init = init_scalar,
    .dot_max = DOT_MAX,
    .fp4 = fp4_scalar,
    .fp8 = fp8_scalar,
    .bf16 = bf16_scalar,
    .fp4_map = fp4_map,
    .fp8_map = fp8_map,
    .bf16_map = bf16_map,
    .fma_loop = fma_loop_scalar,
    .read_sum = read_sum_scalar,
};
