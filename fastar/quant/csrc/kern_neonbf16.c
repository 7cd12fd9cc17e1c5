/* AArch64 FEAT_BF16 kernels (Apple M2 and later, Graviton 3+, Neoverse V1/N2), chosen at run time by dispatch.c
 * ("neon-bf16"; set_isa("neon") turns them off).
 *
 * Owns: the bfloat16 dot path of the FP4 and FP8 products. When every x of a call is a bfloat16 (dispatch.c
 * checks, see x_kind there; true of the official numerics' FP8-quantized activations), x arrives as bfloat16
 * (mm_job.xb, natural column order) and each weight is decoded straight to its bfloat16: e2m1 by one TBL pair per
 * 16 columns, e4m3 by bit arithmetic (exponent rebias) with a TBX for zero and the denormals (fp8_bf16_16); both
 * formats' values are exact bfloat16s. BFMLALB / BFMLALT then multiply-add the even / odd columns into float32
 * accumulators. Why those and not BFDOT / BFMMLA: without FEAT_EBF16 (and FPCR.EBF set), BFDOT and BFMMLA add
 * their two products with round-to-odd and flush denormals, which would make the sums differ from the FP32 path by
 * more than summation order; BFMLALB/T are fused multiply-adds rounded as FPCR says (to nearest, like FMLA), and a
 * bfloat16 x times an e2m1 or e4m3 value is exact in float32 (x_kind's bounds also keep every partial sum normal),
 * so the result is the FP32 path's up to float32 summation order, as on x86 (kern_avx512bf16.c). Scales are
 * applied to partial sums: per 32-column group (FP4), per 128-column block (FP8). FP8 NaN codes decode to bfloat16
 * NaNs, so they poison their row's outputs as on the FP32 path.
 * Everything else (BF16 weights, x that is neither bfloat16-exact nor splittable, T > DOT_MAX) runs the NEON
 * kernels of kern_neon.c. BF16 weights stay there because x_kind's exactness argument rests on the weights' small
 * range (e4m3 / e2m1): a bfloat16 weight times x can underflow or overflow in float32. The instructions are emitted
 * with inline assembly (.arch_extension bf16), so the file needs no compiler flag or target attribute that gcc and
 * clang would spell differently; dispatch.c runs it only where the CPU reports FEAT_BF16.
 * Does not own: argument checks, the eligibility test and the bfloat16 copy of x, threading.
 */
#include "kernels.h"

#if FASTAR_ARM64
#include <arm_neon.h>
#include <string.h>

#include "simd.h"

#define DOT_MAX 8

static uint8_t ident_map[XP_CHUNK]; /* natural column order: x as bfloat16, unpermuted */
static uint8_t fp4_hi[16], fp4_lo[16];
static uint8_t fp8_hi[16], fp8_lo[16]; /* bfloat16 bits of e4m3 magnitudes 0-15: zero, the denormals, e = 1 */

static void init_neonbf16(void) {
    for (int i = 0; i < XP_CHUNK; i++) ident_map[i] = (uint8_t)i;
    for (int i = 0; i < 16; i++) { /* e2m1 values have at most 2 significant bits: exact bfloat16s */
        uint32_t u;
        memcpy(&u, &fp4_f32[i], 4);
        fp4_hi[i] = (uint8_t)(u >> 24);
        fp4_lo[i] = (uint8_t)(u >> 16);
        memcpy(&u, &fp8_f32[i], 4); /* e4m3 values have at most 4 significant bits: exact bfloat16s */
        fp8_hi[i] = (uint8_t)(u >> 24);
        fp8_lo[i] = (uint8_t)(u >> 16);
    }
}

/* acc[i] += a[2i] * b[2i] (B) or a[2i+1] * b[2i+1] (T), bfloat16 widened to float32, one rounding (FPCR's). */
INLINE float32x4_t bfmlalb(float32x4_t acc, uint16x8_t a, uint16x8_t b) {
    __asm__(".arch_extension bf16\n\tbfmlalb %0.4s, %1.8h, %2.8h" : "+w"(acc) : "w"(a), "w"(b));
    return acc;
}
INLINE float32x4_t bfmlalt(float32x4_t acc, uint16x8_t a, uint16x8_t b) {
    __asm__(".arch_extension bf16\n\tbfmlalt %0.4s, %1.8h, %2.8h" : "+w"(acc) : "w"(a), "w"(b));
    return acc;
}

/* 16 FP4 codes (one per byte, in column order) -> their bfloat16 bits, columns 0-7 and 8-15. */
INLINE void fp4_bf16_16(uint8x16_t codes, uint8x16_t th, uint8x16_t tl, uint16x8_t w[2]) {
    const uint8x16_t h = vqtbl1q_u8(th, codes), l = vqtbl1q_u8(tl, codes);
    w[0] = vreinterpretq_u16_u8(vzip1q_u8(l, h));
    w[1] = vreinterpretq_u16_u8(vzip2q_u8(l, h));
}

/* FP4 row n against nt tokens of bfloat16 x: per group of 32 columns, two chains (even / odd 8-column vectors)
 * of BFMLALB then BFMLALT, then one FMA with the group's scale. */
INLINE void fp4_bdot_row(const mm_job *j, int64_t n, const int nt, int64_t cb, int64_t ce, float *acc) {
    const int64_t K = j->K;
    const uint8_t *wr = (const uint8_t *)j->w + n * (K / 2);
    const uint8_t *sr = j->s + n * (K / FP4_GROUP);
    const uint8x16_t th = vld1q_u8(fp4_hi), tl = vld1q_u8(fp4_lo), m0f = vdupq_n_u8(0x0f);
    float32x4_t tot[DOT_GROUP];
    for (int t = 0; t < nt; t++) tot[t] = vdupq_n_f32(0.0f);
    for (int64_t g = cb / FP4_GROUP; g < ce / FP4_GROUP; g++) {
        const uint8x16_t b = vld1q_u8(wr + 16 * g);
        __builtin_prefetch(wr + 16 * g + 2048);
        const uint8x16_t lo = vandq_u8(b, m0f), hi = vshrq_n_u8(b, 4);
        uint16x8_t w[4];
        fp4_bf16_16(vzip1q_u8(lo, hi), th, tl, w);
        fp4_bf16_16(vzip2q_u8(lo, hi), th, tl, w + 2);
        const float32x4_t sv = vdupq_n_f32(ue8m0_f32[sr[g]]);
        for (int t = 0; t < nt; t++) {
            const uint16_t *xt = j->xb + t * j->kp + FP4_GROUP * g;
            const uint16x8_t x0 = vld1q_u16(xt), x1 = vld1q_u16(xt + 8), x2 = vld1q_u16(xt + 16), x3 = vld1q_u16(xt + 24);
            float32x4_t pa = bfmlalb(vdupq_n_f32(0.0f), x0, w[0]), pb = bfmlalb(vdupq_n_f32(0.0f), x1, w[1]);
            pa = bfmlalt(pa, x0, w[0]);
            pb = bfmlalt(pb, x1, w[1]);
            pa = bfmlalb(pa, x2, w[2]);
            pb = bfmlalb(pb, x3, w[3]);
            pa = bfmlalt(pa, x2, w[2]);
            pb = bfmlalt(pb, x3, w[3]);
            tot[t] = vfmaq_f32(tot[t], vaddq_f32(pa, pb), sv);
        }
    }
    for (int t = 0; t < nt; t++) acc[t] += vaddvq_f32(tot[t]);
}

/* 16 e4m3 bytes (in column order) -> their bfloat16 bits, columns 0-7 and 8-15, exactly. A magnitude m = eeeemmm
 * with e >= 1 is 2^(e-7) (1 + mmm/8): the bfloat16 with exponent field e + 120 and fraction mmm << 4, i.e. bits
 * (m << 4) + 0x3c00, high byte (m >> 4) + 0x3c, low byte m << 4. TBX replaces both bytes of magnitudes 0-15 (zero
 * and the denormals mmm * 2^-9 do not follow the formula) with the table's and leaves the others; the NaN
 * magnitude 0x7f (480 by the formula) gets high byte 0x7f (exponent all ones, fraction 0x70: a NaN); the sign bit
 * is copied into the high byte last (so 0x80 is -0). */
INLINE void fp8_bf16_16(uint8x16_t v, uint8x16_t th, uint8x16_t tl, uint16x8_t w[2]) {
    const uint8x16_t m = vandq_u8(v, vdupq_n_u8(0x7f));
    uint8x16_t hi = vsraq_n_u8(vdupq_n_u8(0x3c), m, 4), lo = vshlq_n_u8(v, 4);
    hi = vqtbx1q_u8(hi, th, m);
    lo = vqtbx1q_u8(lo, tl, m);
    hi = vorrq_u8(hi, vceqq_u8(m, vdupq_n_u8(0x7f)));
    hi = vbslq_u8(vdupq_n_u8(0x80), v, hi);
    w[0] = vreinterpretq_u16_u8(vzip1q_u8(lo, hi));
    w[1] = vreinterpretq_u16_u8(vzip2q_u8(lo, hi));
}

/* FP8 row n against nt tokens of bfloat16 x, per 128-column scale block: two chains per token (columns 0-7 and
 * 8-15 of every 16), BFMLALB then BFMLALT, then one FMA with the block's scale. xb rows are zero padded to a
 * multiple of 128 columns, so only the weights of a ragged row end need a padded copy. */
INLINE void fp8_bdot_row(const mm_job *j, int64_t n, const int nt, int64_t cb, int64_t ce, float *acc) {
    const int64_t K = j->K, kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    const uint8_t *wr = (const uint8_t *)j->w + n * K;
    const uint8_t *srow = j->s + (n / FP8_BLOCK) * kb;
    const uint8x16_t th = vld1q_u8(fp8_hi), tl = vld1q_u8(fp8_lo);
    float32x4_t tot[DOT_GROUP];
    for (int t = 0; t < nt; t++) tot[t] = vdupq_n_f32(0.0f);
    for (int64_t b = cb / FP8_BLOCK; b < (ce + FP8_BLOCK - 1) / FP8_BLOCK; b++) {
        const int64_t c0 = b * FP8_BLOCK, c1 = c0 + FP8_BLOCK < ce ? c0 + FP8_BLOCK : ce;
        float32x4_t pa[DOT_GROUP], pb[DOT_GROUP];
        for (int t = 0; t < nt; t++) pa[t] = pb[t] = vdupq_n_f32(0.0f);
        for (int64_t c = c0; c < c1; c += 16) {
            uint8x16_t v;
            if (c + 16 <= c1) {
                v = vld1q_u8(wr + c);
            } else { /* ragged end of the row: zero weights against xb's zero padding */
                uint8_t tmp[16] = {0};
                memcpy(tmp, wr + c, (size_t)(c1 - c));
                v = vld1q_u8(tmp);
            }
            __builtin_prefetch(wr + c + 2048);
            uint16x8_t w[2];
            fp8_bf16_16(v, th, tl, w);
            for (int t = 0; t < nt; t++) {
                const uint16_t *xt = j->xb + t * j->kp + c;
                const uint16x8_t x0 = vld1q_u16(xt), x1 = vld1q_u16(xt + 8);
                pa[t] = bfmlalb(pa[t], x0, w[0]);
                pb[t] = bfmlalb(pb[t], x1, w[1]);
                pa[t] = bfmlalt(pa[t], x0, w[0]);
                pb[t] = bfmlalt(pb[t], x1, w[1]);
            }
        }
        const float32x4_t sv = vdupq_n_f32(ue8m0_f32[srow[b]]);
        for (int t = 0; t < nt; t++) tot[t] = vfmaq_f32(tot[t], vaddq_f32(pa[t], pb[t]), sv);
    }
    for (int t = 0; t < nt; t++) acc[t] += vaddvq_f32(tot[t]);
}

/* The bf16 dot path when dispatch.c handed x as bfloat16 (xb), else the NEON kernels. */
static void fp4_rows(const mm_job *j, int64_t n0, int64_t n1) {
    if (j->dot && j->xb) {
        DOT_DISPATCH(fp4_bdot_row)
    } else {
        isa_neon_ops.fp4(j, n0, n1);
    }
}

static void fp8_rows(const mm_job *j, int64_t n0, int64_t n1) {
    if (j->dot && j->xb) {
        DOT_DISPATCH(fp8_bdot_row)
    } else {
        isa_neon_ops.fp8(j, n0, n1);
    }
}

static void bf16_rows(const mm_job *j, int64_t n0, int64_t n1) { isa_neon_ops.bf16(j, n0, n1); }
static double fma_loop(int64_t iters) { return isa_neon_ops.fma_loop(iters); }
static double read_sum(const uint8_t *p, size_t n) { return isa_neon_ops.read_sum(p, n); }
static void act_quant(const float *x, float *out, int64_t rows, int64_t K, int64_t block) {
    isa_neon_ops.act_quant(x, out, rows, K, block);
}
static void swiglu(const float *g, const float *u, float *out, int64_t n, float limit, float scale) {
    isa_neon_ops.swiglu(g, u, out, n, limit, scale);
}

const isa_ops isa_neonbf16_ops = {
    .name = "neon-bf16",
    .needs = "asimd bf16",
    .vec = VEC_NEON,
    .init = init_neonbf16,
    .dot_max = DOT_MAX,
    .fp4 = fp4_rows,
    .fp8 = fp8_rows,
    .bf16 = bf16_rows,
    .fp4_bmap = ident_map,
    .fp8_bmap = ident_map,
    .fma_loop = fma_loop,
    .read_sum = read_sum,
    .act_quant = act_quant,
    .swiglu = swiglu,
};
#endif /* FASTAR_ARM64 */
