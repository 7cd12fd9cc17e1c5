/* Softmax attention with per-head sinks, DeepSeek-V4's (the twin of fastar.model.deepseek_v4.attend_torch).
 *
 * Owns: attn_run. For every query t (at position p = p0 + t) and head h:
 *   z_j = scale * q[t, h] . v_j  over the rows v_j the query sees, in this order: the window keys at positions
 *         (p - window, p] that keys[] holds (keys[i] is position k0 + i), then the compressed entries, either
 *         comp[idx[t, i]] for i = 0.. with idx >= 0, or every comp[e] with e < (p + 1) / ratio;
 *   out[t, h] = sum_j v_j exp(z_j - m) / (sum_j exp(z_j - m) + exp(sinks[h] - m)),  m = max(sinks[h], max_j z_j)
 * (K = V: the rows are both keys and values; the sink is in the denominator only).
 * Work goes to the thread pool by (query, block of ATTN_HB heads). Each (query, head) is computed by one thread,
 * over its own visible rows only, in an order that depends on nothing else (not T, not the query's place in the
 * chunk, not the thread count): a chunk of queries gives bit-identical results to one query at a time.
 * Three kernels of the same math, picked by the kernels' ISA (its vec): plain C (the fallback), AVX2+FMA (GCC/clang
 * vector types) and AVX-512 intrinsics, the last two register-tiled so each row is loaded once for several heads.
 * They round differently (FMA, exp), each within float32 rounding of the torch reference (tests/test_attend.py).
 * Does not own: argument checks (bind_ops.c), the pool (pool.c).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#if FASTAR_X86
#include <immintrin.h>

#include "exp512.h"
#endif

#define ATTN_HB 8 /* heads per pool chunk: 8 chunks per query on Flash (64 heads) */

/* ---------------------------------------------------------------- portable */

/* Softmax of one head's logits s[0..n) in place, the sink in the denominator only. */
INLINE void softmax_plain(float *s, int64_t n, float sink) {
    float m = sink, sum = 0.0f;
    for (int64_t j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
    for (int64_t j = 0; j < n; j++) sum += (s[j] = expf(s[j] - m));
    sum += expf(sink - m);
    for (int64_t j = 0; j < n; j++) s[j] /= sum;
}

/* q . v in 16 interleaved partial sums (gcc vectorizes them), added pairwise at the end. */
static float dot_plain(const float *q, const float *v, int64_t D) {
    float acc[16] = {0};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16)
        for (int i = 0; i < 16; i++) acc[i] += q[d + i] * v[d + i];
    for (int i = 0; d + i < D; i++) acc[i] += q[d + i] * v[d + i];
    for (int w = 8; w; w /= 2)
        for (int i = 0; i < w; i++) acc[i] += acc[i + w];
    return acc[0];
}

/* hb heads of one query: q [hb, D] against rows[0..n), logits / probabilities scratch s [hb, n], out [hb, D]. */
static void heads_plain(const float *const *rows, int64_t n, const float *q, int hb, int64_t D, float scale,
                        const float *sinks, float *s, float *out) {
    for (int h = 0; h < hb; h++) {
        for (int64_t j = 0; j < n; j++) s[h * n + j] = dot_plain(q + h * D, rows[j], D) * scale;
        softmax_plain(s + h * n, n, sinks[h]);
    }
    memset(out, 0, (size_t)(hb * D) * sizeof(float));
    for (int64_t j = 0; j < n; j++) /* every out element sums its rows in order j = 0.. */
        for (int h = 0; h < hb; h++) {
            const float p = s[h * n + j], *v = rows[j];
            float *o = out + h * D;
            for (int64_t d = 0; d < D; d++) o[d] += p * v[d];
        }
}

#if FASTAR_X86
/* ---------------------------------------------------------------- AVX2 */

/* Written with GCC/clang vector types of 8 floats (one ymm register here), register-tiled like the AVX-512 kernel
 * below. Each (head, row) logit: 8 lanes over D in order, added pairwise, plus the D % 8 leftover columns, times
 * scale; each out element: rows in order j = 0.. from zero. */
typedef float vec8 __attribute__((vector_size(32)));
#define AVX2_INLINE TARGET_AVX2 static inline __attribute__((always_inline))
AVX2_INLINE vec8 load8(const float *p) { vec8 v; memcpy(&v, p, sizeof v); return v; }
AVX2_INLINE void store8(float *p, vec8 v) { memcpy(p, &v, sizeof v); }
AVX2_INLINE float sum8(vec8 a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

/* Logits of NH heads (q rows D apart) x NR rows into s[a * ld + b]. */
AVX2_INLINE void qk8(const float *q, const float *const *v, int64_t D, float scale, float *s, int64_t ld,
                     const int NH, const int NR) {
    vec8 acc[2][4];
    for (int a = 0; a < NH; a++)
        for (int b = 0; b < NR; b++) acc[a][b] = (vec8){0};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        vec8 vv[4];
        for (int b = 0; b < NR; b++) vv[b] = load8(v[b] + d);
        for (int a = 0; a < NH; a++) {
            const vec8 qa = load8(q + a * D + d);
            for (int b = 0; b < NR; b++) acc[a][b] += qa * vv[b];
        }
    }
    for (int a = 0; a < NH; a++)
        for (int b = 0; b < NR; b++) {
            float rest = 0.0f;
            for (int64_t e = d; e < D; e++) rest += q[a * D + e] * v[b][e];
            s[a * ld + b] = (sum8(acc[a][b]) + rest) * scale;
        }
}

/* out[a * D + d0 ..] for NH heads x 16 columns (or the D - d0 < 16 left): sum_j p[a * n + j] v_j. */
AVX2_INLINE void pv8(const float *const *v, int64_t n, const float *p, int64_t D, int64_t d0, float *out,
                     const int NH) {
    if (D - d0 < 16) {
        for (int a = 0; a < NH; a++)
            for (int64_t d = d0; d < D; d++) {
                float acc = 0.0f;
                for (int64_t j = 0; j < n; j++) acc += p[a * n + j] * v[j][d];
                out[a * D + d] = acc;
            }
        return;
    }
    vec8 acc[4][2];
    for (int a = 0; a < NH; a++) acc[a][0] = acc[a][1] = (vec8){0};
    for (int64_t j = 0; j < n; j++) {
        const vec8 v0 = load8(v[j] + d0), v1 = load8(v[j] + d0 + 8);
        for (int a = 0; a < NH; a++) {
            const float pa = p[a * n + j];
            acc[a][0] += pa * v0;
            acc[a][1] += pa * v1;
        }
    }
    for (int a = 0; a < NH; a++) {
        store8(out + a * D + d0, acc[a][0]);
        store8(out + a * D + d0 + 8, acc[a][1]);
    }
}

TARGET_AVX2 static void heads_avx2(const float *const *rows, int64_t n, const float *q, int hb, int64_t D, float scale,
                            const float *sinks, float *s, float *out) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) { /* 4 rows at a time against every head: each row comes from L2 once */
        int a = 0;
        for (; a + 2 <= hb; a += 2) qk8(q + a * D, rows + j, D, scale, s + a * n + j, n, 2, 4);
        for (; a < hb; a++) qk8(q + a * D, rows + j, D, scale, s + a * n + j, n, 1, 4);
    }
    for (; j < n; j++)
        for (int a = 0; a < hb; a++) qk8(q + a * D, rows + j, D, scale, s + a * n + j, n, 1, 1);
    for (int h = 0; h < hb; h++) softmax_plain(s + h * n, n, sinks[h]);
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        int a = 0;
        for (; a + 4 <= hb; a += 4) pv8(rows, n, s + a * n, D, d0, out + a * D, 4);
        for (; a < hb; a++) pv8(rows, n, s + a * n, D, d0, out + a * D, 1);
    }
}

/* ---------------------------------------------------------------- AVX-512 */

/* Every (head, row) logit is one 16-lane accumulator fma'd over D in order (a masked last vector when D % 16),
 * then _mm512_reduce_add_ps, then * scale: the same arithmetic whatever tile it is computed in. */
#define AVX512_INLINE TARGET_AVX512 static inline __attribute__((always_inline))

AVX512_INLINE __mmask16 tail_mask(int64_t D) { return D % 16 ? (__mmask16)((1u << (D % 16)) - 1) : 0; }

/* Logits of NH heads (q rows D apart) x NK rows into s[a * ld + b]. */
AVX512_INLINE void qk_tile(const float *q, const float *const *v, int64_t D, float scale, float *s, int64_t ld,
                           const int NH, const int NK) {
    __m512 acc[4][4];
    for (int a = 0; a < NH; a++)
        for (int b = 0; b < NK; b++) acc[a][b] = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        __m512 vv[4];
        for (int b = 0; b < NK; b++) vv[b] = _mm512_loadu_ps(v[b] + d);
        for (int a = 0; a < NH; a++) {
            const __m512 qv = _mm512_loadu_ps(q + a * D + d);
            for (int b = 0; b < NK; b++) acc[a][b] = _mm512_fmadd_ps(qv, vv[b], acc[a][b]);
        }
    }
    if (d < D) {
        const __mmask16 m = tail_mask(D);
        __m512 vv[4];
        for (int b = 0; b < NK; b++) vv[b] = _mm512_maskz_loadu_ps(m, v[b] + d);
        for (int a = 0; a < NH; a++) {
            const __m512 qv = _mm512_maskz_loadu_ps(m, q + a * D + d);
            for (int b = 0; b < NK; b++) acc[a][b] = _mm512_fmadd_ps(qv, vv[b], acc[a][b]);
        }
    }
    for (int a = 0; a < NH; a++)
        for (int b = 0; b < NK; b++) s[a * ld + b] = _mm512_reduce_add_ps(acc[a][b]) * scale;
}

/* Logits s[0..n) of one head -> softmax probabilities, the sink in the denominator only. */
AVX512_INLINE void softmax_row(float *s, int64_t n, float sink) {
    __m512 mv = _mm512_set1_ps(sink);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        mv = _mm512_mask_max_ps(mv, m, mv, _mm512_maskz_loadu_ps(m, s + j));
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sv = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), mx)));
        _mm512_mask_storeu_ps(s + j, m, e);
        sv = _mm512_add_ps(sv, e);
    }
    const float sum = _mm512_reduce_add_ps(sv) + _mm512_cvtss_f32(exp512(_mm512_sub_ps(_mm512_set1_ps(sink), mx)));
    const __m512 den = _mm512_set1_ps(sum);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        _mm512_mask_storeu_ps(s + j, m, _mm512_div_ps(_mm512_maskz_loadu_ps(m, s + j), den));
    }
}

/* out[a * D + c0*16 ..] for NH heads x NC vectors of 16 columns from vector c0 on: sum_j p[a * ld + j] v_j, each
 * element fma'd in order j = 0..n-1 from zero (the same in any tile). The last vector of a row is masked. */
AVX512_INLINE void pv_tile(const float *const *v, int64_t n, const float *p, int64_t ld, int64_t D, int64_t c0,
                           float *out, const int NH, const int NC) {
    const int64_t nvec = (D + 15) / 16;
    __mmask16 m[4];
    for (int c = 0; c < NC; c++) m[c] = c0 + c == nvec - 1 && D % 16 ? tail_mask(D) : 0xffff;
    __m512 acc[8][4];
    for (int a = 0; a < NH; a++)
        for (int c = 0; c < NC; c++) acc[a][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        __m512 vv[4];
        for (int c = 0; c < NC; c++) vv[c] = _mm512_maskz_loadu_ps(m[c], v[j] + (c0 + c) * 16);
        for (int a = 0; a < NH; a++) {
            const __m512 pa = _mm512_set1_ps(p[a * ld + j]);
            for (int c = 0; c < NC; c++) acc[a][c] = _mm512_fmadd_ps(pa, vv[c], acc[a][c]);
        }
    }
    for (int a = 0; a < NH; a++)
        for (int c = 0; c < NC; c++) _mm512_mask_storeu_ps(out + a * D + (c0 + c) * 16, m[c], acc[a][c]);
}

TARGET_AVX512 static void heads_avx512(const float *const *rows, int64_t n, const float *q, int hb, int64_t D, float scale,
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
    const int64_t nvec = (D + 15) / 16;
    int a = 0;
    for (; a + 8 <= hb; a += 8) { /* 8 heads x 2 vectors: each row slice is read once for all 8 */
        int64_t c = 0;
        for (; c + 2 <= nvec; c += 2) pv_tile(rows, n, s + a * n, n, D, c, out + a * D, 8, 2);
        for (; c < nvec; c++) pv_tile(rows, n, s + a * n, n, D, c, out + a * D, 8, 1);
    }
    for (; a < hb; a++) {
        int64_t c = 0;
        for (; c + 4 <= nvec; c += 4) pv_tile(rows, n, s + a * n, n, D, c, out + a * D, 1, 4);
        for (; c < nvec; c++) pv_tile(rows, n, s + a * n, n, D, c, out + a * D, 1, 1);
    }
}
#endif

/* ---------------------------------------------------------------- driver */

typedef void (*heads_fn)(const float *const *rows, int64_t n, const float *q, int hb, int64_t D, float scale,
                         const float *sinks, float *s, float *out);

typedef struct {
    const attn_job *j;
    heads_fn fn;
    atomic_int failed; /* a chunk's scratch allocation failed */
} attn_ctx;

/* Chunk i: query i / blocks, heads from (i % blocks) * ATTN_HB. */
static void attn_chunk(void *p, int64_t i) {
    attn_ctx *c = p;
    const attn_job *j = c->j;
    const int64_t blocks = (j->H + ATTN_HB - 1) / ATTN_HB, t = i / blocks, h0 = i % blocks * ATTN_HB;
    const int hb = (int)(j->H - h0 < ATTN_HB ? j->H - h0 : ATTN_HB);
    const int64_t pos = j->p0 + t;
    const int64_t lo = pos - j->window + 1 > j->k0 ? pos - j->window + 1 : j->k0;
    const int64_t hi = pos + 1 < j->k0 + j->K ? pos + 1 : j->k0 + j->K;
    const int64_t nwin = hi > lo ? hi - lo : 0;
    int64_t ncomp = 0;
    if (j->idx) ncomp = j->k;
    else if (j->comp && j->ratio > 0) ncomp = (pos + 1) / j->ratio < j->E ? (pos + 1) / j->ratio : j->E;
    const float *q = j->q + (t * j->H + h0) * j->D;
    float *out = j->out + (t * j->H + h0) * j->D;
    const float **rows = malloc((size_t)(nwin + ncomp) * (sizeof *rows + hb * sizeof(float)) + 1);
    if (!rows) {
        atomic_store(&c->failed, 1);
        return;
    }
    int64_t n = 0;
    for (int64_t r = lo; r < hi; r++) rows[n++] = j->keys + (r - j->k0) * j->D;
    if (j->idx) {
        const int64_t *idx = j->idx + t * j->k;
        for (int64_t r = 0; r < j->k; r++)
            if (idx[r] >= 0) rows[n++] = j->comp + idx[r] * j->D;
    } else {
        for (int64_t e = 0; e < ncomp; e++) rows[n++] = j->comp + e * j->D;
    }
    float *s = (float *)(rows + nwin + ncomp); /* [hb, n] */
    c->fn(rows, n, q, hb, j->D, j->scale, j->sinks + h0, s, out);
    free(rows);
}

int attn_run(const isa_ops *isa, const attn_job *j) {
    attn_ctx c = {.j = j, .fn = heads_plain};
#if FASTAR_X86
    if (isa->vec == VEC_AVX512) c.fn = heads_avx512;
    else if (isa->vec == VEC_AVX2) c.fn = heads_avx2;
#endif
#if FASTAR_ARM64
    if (isa->vec == VEC_NEON) c.fn = attn_heads_neon; /* attn_neon.c */
#endif
    (void)isa;
    atomic_init(&c.failed, 0);
    pool_run(j->T * ((j->H + ATTN_HB - 1) / ATTN_HB), attn_chunk, &c);
    return atomic_load(&c.failed) ? -1 : 0;
}
