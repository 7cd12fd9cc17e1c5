/* AArch64 ASIMD (NEON) + FMA kernels, chosen at run time by dispatch.c ("neon"; every AArch64 CPU has them).
 *
 * Owns: the FP4 / FP8 / BF16 products for this ISA, in two shapes (as kern_avx2.c):
 * - dot path (T <= DOT_MAX): each weight row is streamed once per DOT_GROUP tokens and decoded in registers, the
 *   group's tokens accumulate against it in an order that depends on neither T nor the token's place
 *   (DOT_DISPATCH, simd.h). x is read in its natural column order (no permuted copy: the decode below yields
 *   columns in order). Scales (powers of two) are applied once per scale group to a partial sum.
 *   FP4: a table lookup (TBL) per nibble gives the high and low byte of the value's bfloat16 bits; FP8: the e4m3
 *   byte becomes the fp16 bits of value / 256 (sign-extend, shift, mask) and FCVTL widens it, the 256 folded into
 *   the block scale; BF16: a 16-bit left shift.
 * - tile path (larger T): an NR-row x KC-column tile is dequantized once (exact: value * scale) into an L1 buffer,
 *   transposed, and an outer-product microkernel (MR tokens x NR rows) reuses it for every token.
 * FP8 NaN codes poison their row as in the reference (the dot path tracks them; in the tile they are NaN values).
 * Also the FP8 activation quantization (bit for bit the portable one), the clamped SwiGLU (exp_neon.h), the FP32
 * peak loop and the streaming read of `fastar bench kernels`.
 * Does not own: argument checks, threading, the bf16 dot path (kern_neonbf16.c), the ISA choice (dispatch.c).
 */
#include "kernels.h"

#if FASTAR_ARM64
#include <arm_neon.h>
#include <math.h>
#include <string.h>

#include "exp_neon.h"
#include "simd.h"

#define DOT_MAX 8 /* T up to this takes the dot path, DOT_GROUP tokens at a time */
#define NR 8      /* tile rows (2 vectors) */
#define MR 8      /* tokens per microkernel call: 16 accumulators */
#define KC 128

static uint8_t fp4_hi[16], fp4_lo[16]; /* bytes 3 and 2 of each FP4 value as float32 (bytes 1, 0 are zero) */

static void init_neon(void) {
    for (int i = 0; i < 16; i++) {
        uint32_t u;
        memcpy(&u, &fp4_f32[i], 4);
        fp4_hi[i] = (uint8_t)(u >> 24);
        fp4_lo[i] = (uint8_t)(u >> 16);
    }
}

/* ---------------------------------------------------------------- dot path (decode) */

/* 16 FP4 codes (one per byte) -> 16 floats in 4 vectors, via the bfloat16 bits. */
INLINE void fp4_decode16(uint8x16_t codes, uint8x16_t th, uint8x16_t tl, float32x4_t w[4]) {
    const uint8x16_t h = vqtbl1q_u8(th, codes), l = vqtbl1q_u8(tl, codes);
    const uint16x8_t b0 = vreinterpretq_u16_u8(vzip1q_u8(l, h)), b1 = vreinterpretq_u16_u8(vzip2q_u8(l, h));
    w[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b0), 16));
    w[1] = vreinterpretq_f32_u32(vshll_high_n_u16(b0, 16));
    w[2] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b1), 16));
    w[3] = vreinterpretq_f32_u32(vshll_high_n_u16(b1, 16));
}

/* One FP4 group (32 columns, 16 bytes) at a time: w[0..7] are columns 0-31 in order. */
INLINE void fp4_dot_row(const mm_job *j, int64_t n, const int nt, int64_t cb, int64_t ce, float *acc) {
    const int64_t K = j->K;
    const uint8_t *wr = (const uint8_t *)j->w + n * (K / 2);
    const uint8_t *sr = j->s + n * (K / FP4_GROUP);
    const uint8x16_t th = vld1q_u8(fp4_hi), tl = vld1q_u8(fp4_lo), m0f = vdupq_n_u8(0x0f);
    float32x4_t tot[DOT_GROUP];
    for (int t = 0; t < nt; t++) tot[t] = vdupq_n_f32(0.0f);
    for (int64_t g = cb / FP4_GROUP; g < ce / FP4_GROUP; g++) {
        const uint8x16_t b = vld1q_u8(wr + 16 * g);
        __builtin_prefetch(wr + 16 * g + 1024);
        const uint8x16_t lo = vandq_u8(b, m0f), hi = vshrq_n_u8(b, 4);
        float32x4_t w[8];
        fp4_decode16(vzip1q_u8(lo, hi), th, tl, w);     /* columns 0-15 */
        fp4_decode16(vzip2q_u8(lo, hi), th, tl, w + 4); /* columns 16-31 */
        const float32x4_t sv = vdupq_n_f32(ue8m0_f32[sr[g]]);
        for (int t = 0; t < nt; t++) {
            const float *xt = j->x + t * K + FP4_GROUP * g;
            float32x4_t pa = vmulq_f32(vld1q_f32(xt), w[0]);
            float32x4_t pb = vmulq_f32(vld1q_f32(xt + 4), w[1]);
            pa = vfmaq_f32(pa, vld1q_f32(xt + 8), w[2]);
            pb = vfmaq_f32(pb, vld1q_f32(xt + 12), w[3]);
            pa = vfmaq_f32(pa, vld1q_f32(xt + 16), w[4]);
            pb = vfmaq_f32(pb, vld1q_f32(xt + 20), w[5]);
            pa = vfmaq_f32(pa, vld1q_f32(xt + 24), w[6]);
            pb = vfmaq_f32(pb, vld1q_f32(xt + 28), w[7]);
            tot[t] = vfmaq_f32(tot[t], vaddq_f32(pa, pb), sv);
        }
    }
    for (int t = 0; t < nt; t++) acc[t] += vaddvq_f32(tot[t]);
}

/* 16 e4m3 bytes -> 16 floats (value / 256) in 4 vectors: the fp16 bits are the sign-extended byte shifted left by 7
 * with bit 14 cleared (e4m3's exponent bias 7 is fp16's 15 minus 8); e4m3 denormals become fp16 denormals. */
INLINE void fp8_decode16(uint8x16_t v, float32x4_t w[4]) {
    const int16x8_t m = vdupq_n_s16((int16_t)0xbf80);
    const int16x8_t h0 = vandq_s16(vshlq_n_s16(vmovl_s8(vget_low_s8(vreinterpretq_s8_u8(v))), 7), m);
    const int16x8_t h1 = vandq_s16(vshlq_n_s16(vmovl_high_s8(vreinterpretq_s8_u8(v)), 7), m);
    const float16x8_t f0 = vreinterpretq_f16_s16(h0), f1 = vreinterpretq_f16_s16(h1);
    w[0] = vcvt_f32_f16(vget_low_f16(f0));
    w[1] = vcvt_high_f32_f16(f0);
    w[2] = vcvt_f32_f16(vget_low_f16(f1));
    w[3] = vcvt_high_f32_f16(f1);
}

INLINE void fp8_dot_row(const mm_job *j, int64_t n, const int nt, int64_t cb, int64_t ce, float *acc) {
    const int64_t K = j->K, kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    const uint8_t *wr = (const uint8_t *)j->w + n * K;
    const uint8_t *srow = j->s + (n / FP8_BLOCK) * kb;
    const uint8x16_t m7f = vdupq_n_u8(0x7f);
    uint8x16_t nanmax = vdupq_n_u8(0);
    float32x4_t tot[DOT_GROUP];
    for (int t = 0; t < nt; t++) tot[t] = vdupq_n_f32(0.0f);
    for (int64_t b = cb / FP8_BLOCK; b < (ce + FP8_BLOCK - 1) / FP8_BLOCK; b++) {
        const int64_t c0 = b * FP8_BLOCK, c1 = c0 + FP8_BLOCK < ce ? c0 + FP8_BLOCK : ce;
        float32x4_t pa[DOT_GROUP], pb[DOT_GROUP];
        for (int t = 0; t < nt; t++) pa[t] = pb[t] = vdupq_n_f32(0.0f);
        for (int64_t c = c0; c < c1; c += 16) {
            uint8x16_t v;
            const float *xs[DOT_GROUP];
            float xtail[DOT_GROUP][16];
            if (c + 16 <= c1) {
                v = vld1q_u8(wr + c);
                for (int t = 0; t < nt; t++) xs[t] = j->x + t * K + c;
            } else { /* ragged end of the row: zero-padded copies */
                uint8_t tmp[16] = {0};
                memcpy(tmp, wr + c, (size_t)(c1 - c));
                v = vld1q_u8(tmp);
                for (int t = 0; t < nt; t++) {
                    memset(xtail[t], 0, sizeof xtail[t]);
                    memcpy(xtail[t], j->x + t * K + c, (size_t)(c1 - c) * 4);
                    xs[t] = xtail[t];
                }
            }
            __builtin_prefetch(wr + c + 1024);
            nanmax = vmaxq_u8(nanmax, vandq_u8(v, m7f));
            float32x4_t w[4];
            fp8_decode16(v, w);
            for (int t = 0; t < nt; t++) {
                pa[t] = vfmaq_f32(pa[t], vld1q_f32(xs[t]), w[0]);
                pb[t] = vfmaq_f32(pb[t], vld1q_f32(xs[t] + 4), w[1]);
                pa[t] = vfmaq_f32(pa[t], vld1q_f32(xs[t] + 8), w[2]);
                pb[t] = vfmaq_f32(pb[t], vld1q_f32(xs[t] + 12), w[3]);
            }
        }
        const uint8_t sb = srow[b];
        const float sf = ue8m0_f32[sb];
        for (int t = 0; t < nt; t++) {
            const float32x4_t p = vaddq_f32(pa[t], pb[t]);
            if (sb <= 246) /* the x256 of the fp16 trick folds into the scale unless that would overflow */
                tot[t] = vfmaq_f32(tot[t], p, vdupq_n_f32(sf * 256.0f));
            else
                tot[t] = vfmaq_f32(tot[t], vmulq_f32(p, vdupq_n_f32(256.0f)), vdupq_n_f32(sf));
        }
    }
    const int nan = vmaxvq_u8(nanmax) == 0x7f; /* e4m3 NaN codes: the reference's row is NaN */
    for (int t = 0; t < nt; t++) acc[t] += nan ? __builtin_nanf("") : vaddvq_f32(tot[t]);
}

INLINE void bf16_dot_row(const mm_job *j, int64_t n, const int nt, int64_t cb, int64_t ce, float *acc) {
    const int64_t K = j->K;
    const uint16_t *wr = (const uint16_t *)j->w + n * K;
    float32x4_t pa[DOT_GROUP], pb[DOT_GROUP];
    for (int t = 0; t < nt; t++) pa[t] = pb[t] = vdupq_n_f32(0.0f);
    for (int64_t c = cb; c < ce; c += 8) {
        uint16x8_t v;
        const float *xs[DOT_GROUP];
        float xtail[DOT_GROUP][8];
        if (c + 8 <= ce) {
            v = vld1q_u16(wr + c);
            for (int t = 0; t < nt; t++) xs[t] = j->x + t * K + c;
        } else {
            uint16_t tmp[8] = {0};
            memcpy(tmp, wr + c, (size_t)(ce - c) * 2);
            v = vld1q_u16(tmp);
            for (int t = 0; t < nt; t++) {
                memset(xtail[t], 0, sizeof xtail[t]);
                memcpy(xtail[t], j->x + t * K + c, (size_t)(ce - c) * 4);
                xs[t] = xtail[t];
            }
        }
        __builtin_prefetch(wr + c + 512);
        const float32x4_t e = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16));
        const float32x4_t o = vreinterpretq_f32_u32(vshll_high_n_u16(v, 16));
        for (int t = 0; t < nt; t++) {
            pa[t] = vfmaq_f32(pa[t], vld1q_f32(xs[t]), e);
            pb[t] = vfmaq_f32(pb[t], vld1q_f32(xs[t] + 4), o);
        }
    }
    for (int t = 0; t < nt; t++) acc[t] += vaddvq_f32(vaddq_f32(pa[t], pb[t]));
}

/* ---------------------------------------------------------------- tile path (prefill) */

/* wt[k * NR + r] = W[n + r, k0 + k] dequantized (exact: value * scale); rows >= nr are zero. */
typedef void (*tile_fn)(const mm_job *j, int64_t n, int nr, int64_t k0, int64_t kc, float *wt);

static void fp4_tile(const mm_job *j, int64_t n, int nr, int64_t k0, int64_t kc, float *wt) {
    const int64_t half = j->K / 2, groups = j->K / FP4_GROUP;
    const uint8x16_t th = vld1q_u8(fp4_hi), tl = vld1q_u8(fp4_lo), m0f = vdupq_n_u8(0x0f);
    memset(wt, 0, (size_t)(kc * NR) * sizeof(float));
    for (int r = 0; r < nr; r++) {
        const uint8_t *wr = (const uint8_t *)j->w + (n + r) * half + k0 / 2;
        const uint8_t *sr = j->s + (n + r) * groups + k0 / FP4_GROUP;
        for (int64_t g = 0; g < kc / FP4_GROUP; g++) { /* kc is a multiple of 32 (K is) */
            const uint8x16_t b = vld1q_u8(wr + 16 * g);
            const uint8x16_t lo = vandq_u8(b, m0f), hi = vshrq_n_u8(b, 4);
            float32x4_t w[8];
            fp4_decode16(vzip1q_u8(lo, hi), th, tl, w);
            fp4_decode16(vzip2q_u8(lo, hi), th, tl, w + 4);
            float v[32];
            const float32x4_t sv = vdupq_n_f32(ue8m0_f32[sr[g]]);
            for (int q = 0; q < 8; q++) vst1q_f32(v + 4 * q, vmulq_f32(w[q], sv));
            for (int c = 0; c < 32; c++) wt[(FP4_GROUP * g + c) * NR + r] = v[c];
        }
    }
}

static void fp8_tile(const mm_job *j, int64_t n, int nr, int64_t k0, int64_t kc, float *wt) {
    const int64_t K = j->K, kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    const float sf = ue8m0_f32[j->s[(n / FP8_BLOCK) * kb + k0 / FP8_BLOCK]]; /* a tile sits inside one scale block */
    memset(wt, 0, (size_t)(kc * NR) * sizeof(float));
    for (int r = 0; r < nr; r++) {
        const uint8_t *wr = (const uint8_t *)j->w + (n + r) * K + k0;
        for (int64_t k = 0; k < kc; k++) wt[k * NR + r] = fp8_f32[wr[k]] * sf; /* NaN codes stay NaN */
    }
}

static void bf16_tile(const mm_job *j, int64_t n, int nr, int64_t k0, int64_t kc, float *wt) {
    const int64_t K = j->K;
    memset(wt, 0, (size_t)(kc * NR) * sizeof(float));
    for (int r = 0; r < nr; r++) {
        const uint16_t *wr = (const uint16_t *)j->w + (n + r) * K + k0;
        for (int64_t k = 0; k < kc; k++) {
            const uint32_t u = (uint32_t)wr[k] << 16;
            memcpy(&wt[k * NR + r], &u, 4);
        }
    }
}

/* out[t, n..n+nr) (+)= sum_k x[t, k] * wt[k, :] for mr tokens, each summed in k order. */
INLINE void micro(const int mr, int64_t kc, const float *wt, const float *x, int64_t ldx, float *out, int64_t ldo, int nr, int store) {
    float32x4_t acc[MR][2];
    UNROLL
    for (int t = 0; t < mr; t++) acc[t][0] = acc[t][1] = vdupq_n_f32(0.0f);
    for (int64_t k = 0; k < kc; k++) {
        const float32x4_t w0 = vld1q_f32(wt + k * NR), w1 = vld1q_f32(wt + k * NR + 4);
        UNROLL
        for (int t = 0; t < mr; t++) {
            const float b = x[t * ldx + k];
            acc[t][0] = vfmaq_n_f32(acc[t][0], w0, b);
            acc[t][1] = vfmaq_n_f32(acc[t][1], w1, b);
        }
    }
    UNROLL
    for (int t = 0; t < mr; t++) {
        float tmp[NR], *o = out + t * ldo;
        vst1q_f32(tmp, acc[t][0]);
        vst1q_f32(tmp + 4, acc[t][1]);
        for (int r = 0; r < nr; r++) o[r] = store ? tmp[r] : o[r] + tmp[r];
    }
}

static void tile_rows(const mm_job *j, int64_t n0, int64_t n1, tile_fn deq) {
    float wt[KC * NR] __attribute__((aligned(64)));
    const int64_t T = j->T, K = j->K;
    for (int64_t n = n0; n < n1; n += NR) {
        const int nr = n1 - n < NR ? (int)(n1 - n) : NR;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kc = K - k0 < KC ? K - k0 : KC;
            deq(j, n, nr, k0, kc, wt);
            const int store = k0 == 0 && !j->accumulate;
            for (int64_t t0 = 0; t0 < T; t0 += MR) {
                const int mr = T - t0 < MR ? (int)(T - t0) : MR;
                const float *x = j->x + t0 * K + k0;
                float *o = j->out + t0 * j->ldo + n;
                switch (mr) {
                    case 1: micro(1, kc, wt, x, K, o, j->ldo, nr, store); break;
                    case 2: micro(2, kc, wt, x, K, o, j->ldo, nr, store); break;
                    case 3: micro(3, kc, wt, x, K, o, j->ldo, nr, store); break;
                    case 4: micro(4, kc, wt, x, K, o, j->ldo, nr, store); break;
                    case 5: micro(5, kc, wt, x, K, o, j->ldo, nr, store); break;
                    case 6: micro(6, kc, wt, x, K, o, j->ldo, nr, store); break;
                    case 7: micro(7, kc, wt, x, K, o, j->ldo, nr, store); break;
                    default: micro(8, kc, wt, x, K, o, j->ldo, nr, store); break;
                }
            }
        }
    }
}

/* ---------------------------------------------------------------- entry points */

static void fp4_rows(const mm_job *j, int64_t n0, int64_t n1) {
    if (j->dot) { DOT_DISPATCH(fp4_dot_row) } else tile_rows(j, n0, n1, fp4_tile);
}
static void fp8_rows(const mm_job *j, int64_t n0, int64_t n1) {
    if (j->dot) { DOT_DISPATCH(fp8_dot_row) } else tile_rows(j, n0, n1, fp8_tile);
}
static void bf16_rows(const mm_job *j, int64_t n0, int64_t n1) {
    if (j->dot) { DOT_DISPATCH(bf16_dot_row) } else tile_rows(j, n0, n1, bf16_tile);
}

/* ---------------------------------------------------------------- FP8 activation quantization */

/* fp8_act_quant_scalar (kern_scalar.c) four values at a time, bit for bit: the same scale per block (computed the
 * same way, in scalar code), the same clamp and the same e4m3 rounding ((y + 2^23) - 2^23 on y = |v| 2^-q, with q
 * from v's exponent field), NaN kept. */
static void act_quant(const float *x, float *out, int64_t rows, int64_t K, int64_t block) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b0 = 0; b0 < K; b0 += block) {
            const float *xb = x + r * K + b0;
            float *ob = out + r * K + b0;
            const int64_t n = K - b0 < block ? K - b0 : block;
            float32x4_t vmax = vdupq_n_f32(0.0f);
            uint32x4_t vbad = vdupq_n_u32(0);
            const float32x4_t fmax = vdupq_n_f32(3.4028235e38f);
            int64_t i = 0;
            for (; i + 4 <= n; i += 4) {
                const float32x4_t a = vabsq_f32(vld1q_f32(xb + i));
                vbad = vorrq_u32(vbad, vmvnq_u32(vcleq_f32(a, fmax))); /* NaN or inf */
                vmax = vmaxnmq_f32(vmax, a);
            }
            float amax = vmaxvq_f32(vmax);
            int bad = vmaxvq_u32(vbad) != 0;
            for (; i < n; i++) {
                const float a = fabsf(xb[i]);
                bad |= !(a <= 3.4028235e38f);
                amax = a > amax ? a : amax;
            }
            int ex = 0, sexp = 0;
            if (!bad) {
                const float m = frexpf((amax > 1e-4f ? amax : 1e-4f) / 448.0f, &ex);
                sexp = m == 0.5f ? ex - 1 : ex;
            }
            const float s = ldexpf(1.0f, sexp), inv = ldexpf(1.0f, -sexp);
            const float32x4_t vs = vdupq_n_f32(s), vinv = vdupq_n_f32(inv), lim = vdupq_n_f32(448.0f);
            const float32x4_t big = vdupq_n_f32(8388608.0f);
            const int32x4_t lo = vdupq_n_s32(-6), b127 = vdupq_n_s32(127);
            const uint32x4_t sign = vdupq_n_u32(0x80000000u);
            for (i = 0; i + 4 <= n; i += 4) {
                float32x4_t v = vmulq_f32(vld1q_f32(xb + i), vinv);
                v = vbslq_f32(vcgtq_f32(v, lim), lim, v); /* v > 448 -> 448, v < -448 -> -448, NaN stays */
                v = vbslq_f32(vcltq_f32(v, vnegq_f32(lim)), vnegq_f32(lim), v);
                const float32x4_t a = vabsq_f32(v);
                const int32x4_t e = vsubq_s32(vreinterpretq_s32_u32(vandq_u32(vshrq_n_u32(vreinterpretq_u32_f32(a), 23), vdupq_n_u32(0xff))), b127);
                const int32x4_t q = vsubq_s32(vmaxq_s32(e, lo), vdupq_n_s32(3));
                const float32x4_t down = vreinterpretq_f32_s32(vshlq_n_s32(vsubq_s32(b127, q), 23));
                const float32x4_t up = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(b127, q), 23));
                const float32x4_t y = vmulq_f32(a, down);
                const float32x4_t rnd = vmulq_f32(vsubq_f32(vaddq_f32(y, big), big), up);
                const uint32x4_t sg = vandq_u32(vreinterpretq_u32_f32(v), sign);
                vst1q_f32(ob + i, vmulq_f32(vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(rnd), sg)), vs));
            }
            if (i < n) fp8_act_quant_tail(xb + i, ob + i, n - i, s, inv);
        }
}

/* out = silu(min(g, l)) * clamp(u, -l, l) * scale, as swiglu_rows (rowops.c) with exp_neon for expf: the clamps
 * are compare-and-select, so NaN passes through them as there; a ragged end goes through a zero-padded copy. */
static void swiglu(const float *g, const float *u, float *out, int64_t n, float limit, float scale) {
    const float32x4_t l = vdupq_n_f32(limit), nl = vdupq_n_f32(-limit), one = vdupq_n_f32(1.0f);
    const float32x4_t sc = vdupq_n_f32(scale);
    for (int64_t i = 0; i < n; i += 4) {
        float gt[4] = {0}, ut[4] = {0};
        const int full = n - i >= 4;
        if (!full) {
            memcpy(gt, g + i, (size_t)(n - i) * sizeof(float));
            memcpy(ut, u + i, (size_t)(n - i) * sizeof(float));
        }
        float32x4_t gv = vld1q_f32(full ? g + i : gt), uv = vld1q_f32(full ? u + i : ut);
        if (limit > 0) { /* where gv > l (false for NaN): l */
            gv = vbslq_f32(vcgtq_f32(gv, l), l, gv);
            uv = vbslq_f32(vcgtq_f32(uv, l), l, uv);
            uv = vbslq_f32(vcltq_f32(uv, nl), nl, uv);
        }
        const float32x4_t e = exp_neon(vnegq_f32(gv));
        const float32x4_t y = vmulq_f32(vmulq_f32(vdivq_f32(gv, vaddq_f32(one, e)), uv), sc);
        if (full) {
            vst1q_f32(out + i, y);
        } else {
            vst1q_f32(gt, y);
            memcpy(out + i, gt, (size_t)(n - i) * sizeof(float));
        }
    }
}

static double fma_loop(int64_t iters) {
    float32x4_t a[16];
    const float32x4_t m = vdupq_n_f32(0.9999f), c = vdupq_n_f32(0.0001f);
    for (int i = 0; i < 16; i++) a[i] = vdupq_n_f32((float)i);
    for (int64_t it = 0; it < iters; it++)
        for (int i = 0; i < 16; i++) a[i] = vfmaq_f32(c, a[i], m);
    float32x4_t s = a[0];
    for (int i = 1; i < 16; i++) s = vaddq_f32(s, a[i]);
    volatile float sink = vaddvq_f32(s);
    (void)sink;
    return (double)iters * 16 * 4 * 2;
}

static double read_sum(const uint8_t *p, size_t n) {
    uint64x2_t s0 = vdupq_n_u64(0), s1 = s0, s2 = s0, s3 = s0;
    for (size_t i = 0; i + 64 <= n; i += 64) {
        s0 = vaddq_u64(s0, vreinterpretq_u64_u8(vld1q_u8(p + i)));
        s1 = vaddq_u64(s1, vreinterpretq_u64_u8(vld1q_u8(p + i + 16)));
        s2 = vaddq_u64(s2, vreinterpretq_u64_u8(vld1q_u8(p + i + 32)));
        s3 = vaddq_u64(s3, vreinterpretq_u64_u8(vld1q_u8(p + i + 48)));
    }
    s0 = vaddq_u64(vaddq_u64(s0, s1), vaddq_u64(s2, s3));
    return (double)(vgetq_lane_u64(s0, 0) + vgetq_lane_u64(s0, 1));
}

const isa_ops isa_neon_ops = {
    .name = "neon",
    .needs = "asimd",
    .vec = VEC_NEON,
    .init = init_neon,
    .dot_max = DOT_MAX,
    .fp4 = fp4_rows,
    .fp8 = fp8_rows,
    .bf16 = bf16_rows,
    .fma_loop = fma_loop,
    .read_sum = read_sum,
    .act_quant = act_quant,
    .swiglu = swiglu,
};
#endif /* FASTAR_ARM64 */
