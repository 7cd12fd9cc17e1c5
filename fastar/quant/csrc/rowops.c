/* Row-wise ops of the model's forward pass that torch runs as several small ops each: RMS norm, interleaved
 * RoPE and the clamped SwiGLU (the portable SwiGLU; AVX-512 has its own, kern_avx512.c). One call each instead of 5-12 torch ops (at decode these are microseconds of
 * arithmetic behind tens of microseconds of dispatch). Every row is computed in one fixed order that does not
 * depend on the number of rows, so a token's result is the same alone or inside a chunk (batch invariance).
 * The formulas are those of fastar/model/ops.py's torch versions (the tests compare them); only the order of the
 * norm's sum of squares and the last bit of exp differ.
 */
#include <math.h>

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
