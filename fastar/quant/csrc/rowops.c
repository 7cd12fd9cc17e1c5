/* Row-wise ops of the model's forward pass that torch runs as several small ops each: RMS norm, interleaved
 * RoPE, rounding to bfloat16, the indexer's Walsh-Hadamard rotation and FP4 rounding, and the clamped SwiGLU (the portable SwiGLU; AVX-512 has its own, kern_avx512.c). One call each instead of 5-12 torch ops (at decode these are microseconds of
 * arithmetic behind tens of microseconds of dispatch). Every row is computed in one fixed order that does not
 * depend on the number of rows, so a token's result is the same alone or inside a chunk (batch invariance).
 * The formulas are those of fastar/model/ops.py's torch versions (the tests compare them); only the order of the
 * norm's sum of squares and the last bit of exp differ.
 */
#include <math.h>
#include <string.h>

#include "kernels.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off") /* RoPE's products are rounded apart, as torch's: no fused multiply-adds */
#endif

#define LANES 16 /* partial sums of the norm: a fixed split any compiler vectorizes the same way */

void rms_norm_rows(const float *x, const float *w, float *y, int64_t R, int64_t K, float eps) {
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * K;
        float *yr = y + r * K;
        float part[LANES] = {0};
        int64_t k = 0;
        for (; k + LANES <= K; k += LANES)
            for (int l = 0; l < LANES; l++) part[l] += xr[k + l] * xr[k + l];
        for (int l = 0; k < K; k++, l++) part[l] += xr[k] * xr[k];
        for (int h = LANES / 2; h; h /= 2) /* pairwise, in a fixed order */
            for (int l = 0; l < h; l++) part[l] += part[l + h];
        const float inv = 1.0f / sqrtf(part[0] / (float)K + eps);
        if (w)
            for (k = 0; k < K; k++) yr[k] = w[k] * (xr[k] * inv);
        else
            for (k = 0; k < K; k++) yr[k] = xr[k] * inv;
    }
}

void rope_rows(const float *x, float *y, const float *cos, const float *sin, int64_t R, int64_t D, int64_t half,
               int64_t rows_per_token, int inverse) {
    const int64_t r0 = D - 2 * half;
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * D, *c = cos + r / rows_per_token * half, *s = sin + r / rows_per_token * half;
        float *yr = y + r * D;
        if (yr != xr)
            for (int64_t k = 0; k < r0; k++) yr[k] = xr[k];
        for (int64_t i = 0; i < half; i++) {
            const float e = xr[r0 + 2 * i], o = xr[r0 + 2 * i + 1], ci = c[i], si = inverse ? -s[i] : s[i];
            const float pe = e * ci, ps = o * si, pc = o * ci, pf = e * si; /* rounded apart, as torch does */
            yr[r0 + 2 * i] = pe - ps;
            yr[r0 + 2 * i + 1] = pc + pf;
        }
    }
}

/* Round to the nearest bfloat16, ties to even, kept in float32 (torch's float -> bfloat16 -> float; NaN stays NaN). */
void bf16_round_rows(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        if ((u & 0x7fffffffu) > 0x7f800000u)
            u = (u | 0x00400000u) & 0xffff0000u;
        else
            u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
        memcpy(&x[i], &u, 4);
    }
}

void swiglu_rows(const float *gate, const float *up, float *y, int64_t n, float limit, float scale) {
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i], u = up[i];
        if (limit > 0) {
            g = g > limit ? limit : g; /* NaN stays NaN, as in torch's clamp */
            u = u < -limit ? -limit : (u > limit ? limit : u);
        }
        y[i] = g / (1.0f + expf(-g)) * u * scale;
    }
}

void hadamard_rows(const float *x, float *y, int64_t R, int64_t n, float scale) {
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        if (yr != xr)
            for (int64_t k = 0; k < n; k++) yr[k] = xr[k];
        for (int64_t h = 1; h < n; h *= 2) /* the butterflies of fastar.model.ops.hadamard, stage by stage */
            for (int64_t i = 0; i < n; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    const float a = yr[j], b = yr[j + h];
                    yr[j] = a + b;
                    yr[j + h] = a - b;
                }
        for (int64_t k = 0; k < n; k++) yr[k] *= scale;
    }
}

/* The nearest e2m1 value of v (|v| <= 6 after the clamp), ties to the even code, with v's sign. a / step is in
 * [0, 12]: adding and taking away 2^23 rounds it to an integer, ties to even (the default rounding mode, which torch's
 * round also follows), without a libm call; the compiler may not fold the pair away (no -ffast-math). */
static inline float e2m1_nearest(float v) {
    float a = fabsf(v);
    a = a > 6.0f ? 6.0f : a;
    const float step = a < 2.0f ? 0.5f : (a < 4.0f ? 1.0f : 2.0f), magic = 8388608.0f;
    return copysignf(((a / step + magic) - magic) * step, v);
}

void fp4_quant_rows(const float *x, float *y, int64_t R, int64_t K, int64_t block) {
    const float floor_amax = 6.0f * 0x1p-126f; /* FP4_MAX * 2^-126: the scale's lower bound */
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * K;
        float *yr = y + r * K;
        for (int64_t b0 = 0; b0 < K; b0 += block) {
            const int64_t b1 = b0 + block < K ? b0 + block : K;
            float amax = 0.0f;
            for (int64_t k = b0; k < b1; k++) {
                const float a = fabsf(xr[k]);
                amax = a > amax || a != a ? a : amax; /* NaN propagates, as torch's amax */
            }
            float v = (amax < floor_amax ? floor_amax : amax) / 6.0f, s;
            int e;
            const float m = frexpf(v, &e); /* v = m 2^e, m in [0.5, 1): the power of two >= v */
            s = ldexpf(1.0f, m == 0.5f ? e - 1 : e);
            const float inv = 1.0f / s; /* exact (a power of two in the normal range): x * inv rounds as x / s */
            for (int64_t k = b0; k < b1; k++) {
                float q = xr[k] * inv;
                q = q < -6.0f ? -6.0f : (q > 6.0f ? 6.0f : q);
                yr[k] = e2m1_nearest(q) * s;
            }
        }
    }
}
