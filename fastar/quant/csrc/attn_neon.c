/* The AArch64 NEON kernel of attn.c's attention with sinks (attn_heads_neon; attn_run picks it for VEC_NEON ISAs).
 *
 * Owns: hb heads of one query against its visible rows, register-tiled like attn.c's AVX-512 kernel so each row is
 * loaded once for several heads: logits in 4 heads x 4 rows tiles, the softmax with exp_neon, the weighted sum in
 * 4 heads x 16 columns tiles. Every number is computed the same way whatever tile it falls in:
 *   logit (head, row) = (faddp-tree of one 4-lane FMA accumulator over D in order + the D % 4 last columns in
 *                        order) * scale;
 *   out element       = FMAs over rows j = 0.. from zero;
 * so a (query, head) depends only on what that query sees (attn.c's batch invariance). Within float32 rounding of
 * the portable kernel (FMA, exp_neon), checked against it by tests/csrc/kernels_check.c under qemu-aarch64.
 * Does not own: the visible rows, the pool, argument checks (attn.c, bind_ops.c).
 */
#include "kernels.h"

#if FASTAR_ARM64
#include <arm_neon.h>
#include <string.h>

#include "exp_neon.h"
#include "simd.h"

/* Logits of NH heads (q rows D apart) x NR rows into s[a * ld + b]. */
INLINE void qk_tile(const float *q, const float *const *v, int64_t D, float scale, float *s, int64_t ld, const int NH,
                    const int NR) {
    float32x4_t acc[4][4];
    for (int a = 0; a < NH; a++)
        for (int b = 0; b < NR; b++) acc[a][b] = vdupq_n_f32(0.0f);
    int64_t d = 0;
    for (; d + 4 <= D; d += 4) {
        float32x4_t vv[4];
        for (int b = 0; b < NR; b++) vv[b] = vld1q_f32(v[b] + d);
        for (int a = 0; a < NH; a++) {
            const float32x4_t qa = vld1q_f32(q + a * D + d);
            for (int b = 0; b < NR; b++) acc[a][b] = vfmaq_f32(acc[a][b], qa, vv[b]);
        }
    }
    for (int a = 0; a < NH; a++)
        for (int b = 0; b < NR; b++) {
            float sum = vaddvq_f32(acc[a][b]);
            for (int64_t e = d; e < D; e++) sum = __builtin_fmaf(q[a * D + e], v[b][e], sum);
            s[a * ld + b] = sum * scale;
        }
}

/* Logits s[0..n) of one head -> softmax probabilities, the sink in the denominator only. */
static void softmax_row(float *s, int64_t n, float sink) {
    float32x4_t mv = vdupq_n_f32(sink);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) mv = vmaxq_f32(mv, vld1q_f32(s + j));
    float m = vmaxvq_f32(mv);
    for (int64_t i = j; i < n; i++) m = s[i] > m ? s[i] : m;
    const float32x4_t mx = vdupq_n_f32(m);
    float32x4_t sv = vdupq_n_f32(0.0f);
    for (j = 0; j + 4 <= n; j += 4) {
        const float32x4_t e = exp_neon(vsubq_f32(vld1q_f32(s + j), mx));
        vst1q_f32(s + j, e);
        sv = vaddq_f32(sv, e);
    }
    float tail[4] = {m, m, m, m}, rest = 0.0f; /* the n % 4 last logits, padded with m */
    memcpy(tail, s + j, (size_t)(n - j) * sizeof(float));
    vst1q_f32(tail, exp_neon(vsubq_f32(vld1q_f32(tail), mx)));
    for (int64_t i = j; i < n; i++) rest += (s[i] = tail[i - j]);
    vst1q_f32(tail, exp_neon(vdupq_n_f32(sink - m)));
    const float den = vaddvq_f32(sv) + rest + tail[0];
    const float32x4_t dv = vdupq_n_f32(den);
    for (j = 0; j + 4 <= n; j += 4) vst1q_f32(s + j, vdivq_f32(vld1q_f32(s + j), dv));
    for (; j < n; j++) s[j] /= den;
}

/* out[a * D + c0 ..] for NH heads x 4 NC columns from column c0 (all inside D): sum_j p[a * n + j] v_j. */
INLINE void pv_tile(const float *const *v, int64_t n, const float *p, int64_t D, int64_t c0, float *out, const int NH,
                    const int NC) {
    float32x4_t acc[4][4];
    for (int a = 0; a < NH; a++)
        for (int c = 0; c < NC; c++) acc[a][c] = vdupq_n_f32(0.0f);
    for (int64_t j = 0; j < n; j++) {
        float32x4_t vv[4];
        for (int c = 0; c < NC; c++) vv[c] = vld1q_f32(v[j] + c0 + 4 * c);
        for (int a = 0; a < NH; a++) {
            const float pa = p[a * n + j];
            for (int c = 0; c < NC; c++) acc[a][c] = vfmaq_n_f32(acc[a][c], vv[c], pa);
        }
    }
    for (int a = 0; a < NH; a++)
        for (int c = 0; c < NC; c++) vst1q_f32(out + a * D + c0 + 4 * c, acc[a][c]);
}

void attn_heads_neon(const float *const *rows, int64_t n, const float *q, int hb, int64_t D, float scale,
                     const float *sinks, float *s, float *out) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) { /* 4 rows at a time against every head: each row comes from L2 once */
        int a = 0;
        for (; a + 4 <= hb; a += 4) qk_tile(q + a * D, rows + j, D, scale, s + a * n + j, n, 4, 4);
        for (; a < hb; a++) qk_tile(q + a * D, rows + j, D, scale, s + a * n + j, n, 1, 4);
    }
    for (; j < n; j++) {
        int a = 0;
        for (; a + 4 <= hb; a += 4) qk_tile(q + a * D, rows + j, D, scale, s + a * n + j, n, 4, 1);
        for (; a < hb; a++) qk_tile(q + a * D, rows + j, D, scale, s + a * n + j, n, 1, 1);
    }
    for (int h = 0; h < hb; h++) softmax_row(s + h * n, n, sinks[h]);
    const int64_t D4 = D & ~(int64_t)3;
    int a = 0;
    for (; a + 4 <= hb; a += 4) {
        int64_t c = 0;
        for (; c + 16 <= D4; c += 16) pv_tile(rows, n, s + a * n, D, c, out + a * D, 4, 4);
        for (; c < D4; c += 4) pv_tile(rows, n, s + a * n, D, c, out + a * D, 4, 1);
    }
    for (; a < hb; a++) {
        int64_t c = 0;
        for (; c + 16 <= D4; c += 16) pv_tile(rows, n, s + a * n, D, c, out + a * D, 1, 4);
        for (; c < D4; c += 4) pv_tile(rows, n, s + a * n, D, c, out + a * D, 1, 1);
    }
    for (a = 0; a < hb; a++) /* the D % 4 last columns */
        for (int64_t d = D4; d < D; d++) {
            float acc = 0.0f;
            for (int64_t r = 0; r < n; r++) acc = __builtin_fmaf(s[a * n + r], rows[r][d], acc);
            out[a * D + d] = acc;
        }
}
#endif /* FASTAR_ARM64 */
