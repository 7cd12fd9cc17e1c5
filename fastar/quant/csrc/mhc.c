/* mHC (the hyper-connections between DeepSeek-V4's n residual streams) in C, one call per site and token chunk.
 *
 * Owns: the arithmetic of fastar.model.ops.hc_pre_torch / hc_head_torch / hc_post_torch and the Sinkhorn
 * projection (sinkhorn_torch) they use; splitting it over the pool.
 * Does not own: argument checks and the GIL (bind_ops.c), the pool (pool.c).
 *
 * hc_pre_run, per token t with streams X_t [n, d] (K = n*d values):
 *   m = (X_t . fn_r for every row r of fn) / sqrt(|X_t|^2 / K + eps)   (the weightless RMS norm, then fn)
 *   pre = sigmoid(m[:n] s0 + base[:n]) + hc_eps;  u = sum_k pre_k X_t,k
 *   and unless `head`: post = 2 sigmoid(m[n:2n] s1 + base[n:2n]), comb = sinkhorn(m[2n:] s2 + base[2n:] as n x n).
 * fn is the big read (Flash: 24 rows x 16384 floats, 1.5 MB per site), so its rows are spread over the pool; the
 * per-token rest is small and runs token by token.
 *
 * Batch invariance: a token's numbers never depend on T, on its place in the chunk or on the thread count. Every
 * (token, row) dot product is summed in full by one thread in one order (16 lanes over the columns, then the lanes
 * in a fixed tree, then any ragged columns), whichever tile it falls in; everything else is per token. So a chunk
 * of tokens gives each one bit for bit what a one-token call gives (tests/test_mhc.py).
 * SIMD: the same C (gcc vector extensions for the lanes, plain loops elsewhere) is compiled three times, for the
 * baseline ISA, AVX2+FMA and AVX-512, and the variant follows the kernels' ISA (set_isa('scalar') takes the
 * baseline one). Results are identical within a variant, not across them (on x86-64 only AVX2 / AVX-512 fuse
 * multiply-adds). On AArch64 the baseline is NEON with FMA: the NEON variant differs from it only in tile shape,
 * so there the two give identical results.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define HC_ROWS 4   /* fn rows per pool chunk */
#define HC_TOKENS 8 /* tokens per pool chunk */
#define HC_TILE 4   /* largest tile side (tokens or rows) of any variant */

/* The lanes of a dot product, as the variant's registers hold them (vectors wider than the registers compile
 * poorly), and the same types for loads from any float address. */
typedef float v4 __attribute__((vector_size(16)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));
typedef float v4u __attribute__((vector_size(16), aligned(4)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

/* ---------------------------------------------------------------- Sinkhorn */

/* The mHC mixing matrix of each of B logits [n, n]: row softmax + eps, a column normalisation, then iters - 1
 * rounds of row and column normalisation (x / (sum + eps)), as fastar.model.ops.sinkhorn_torch; per matrix, in
 * one fixed order, so a token's result never depends on the batch. n <= 16. */
void sinkhorn_rows(const float *in, float *out, int64_t B, int n, int iters, float eps) {
    for (int64_t b = 0; b < B; b++) {
        const float *x = in + b * n * n;
        float *m = out + b * n * n;
        for (int i = 0; i < n; i++) {
            float mx = x[i * n];
            for (int j = 1; j < n; j++) mx = x[i * n + j] > mx ? x[i * n + j] : mx;
            float sum = 0.0f;
            for (int j = 0; j < n; j++) sum += (m[i * n + j] = expf(x[i * n + j] - mx));
            for (int j = 0; j < n; j++) m[i * n + j] = m[i * n + j] / sum + eps;
        }
        for (int it = 0; it < iters; it++) {
            if (it) /* rows */
                for (int i = 0; i < n; i++) {
                    float sum = 0.0f;
                    for (int j = 0; j < n; j++) sum += m[i * n + j];
                    for (int j = 0; j < n; j++) m[i * n + j] /= sum + eps;
                }
            for (int j = 0; j < n; j++) { /* columns */
                float sum = 0.0f;
                for (int i = 0; i < n; i++) sum += m[i * n + j];
                for (int i = 0; i < n; i++) m[i * n + j] /= sum + eps;
            }
        }
    }
}

/* ---------------------------------------------------------------- the fn product */

typedef struct {
    const float *x, *fn; /* [T, K], [R, K] */
    int64_t T, R, K;
    float *dots;         /* [T, R + 1]: x_t . fn_r, then |x_t|^2 in the last column */
    int64_t row_blocks, token_groups;
} dots_ctx;

/* 16 lanes in a fixed tree. */
INLINE float lanes_sum(const void *lanes) {
    float a[16];
    memcpy(a, lanes, sizeof a);
    for (int h = 8; h; h >>= 1)
        for (int l = 0; l < h; l++) a[l] += a[l + h];
    return a[0];
}

/* out[t * ldo + r] = x_t . w_r for nt tokens x [nt, K] (row stride K) and rows w[0 .. nr); rows from nvalid on are
 * padding (they repeat a real row) and are not stored. Each (token, row) sums in 16 lanes, NV vectors of VEC
 * (lane l takes columns l, l + 16, ...), then as the header says. nt and nr are constants where this is inlined,
 * so the accumulators stay in registers. One definition per vector type. */
#define DOT_TILE(NAME, VEC)                                                                                        \
    INLINE void NAME(const float *x, int64_t K, const int nt, const float *const *w, const int nr, int nvalid,     \
                     float *out, int64_t ldo) {                                                                    \
        enum { NV = 64 / sizeof(VEC) };                                                                            \
        VEC acc[HC_TILE][HC_TILE][NV];                                                                             \
        for (int t = 0; t < nt; t++)                                                                               \
            for (int r = 0; r < nr; r++)                                                                           \
                for (int v = 0; v < NV; v++) acc[t][r][v] = (VEC){0};                                              \
        const int64_t K16 = K & ~(int64_t)15;                                                                      \
        for (int64_t c = 0; c < K16; c += 16) {                                                                    \
            VEC wv[HC_TILE][NV], xv[NV];                                                                           \
            for (int r = 0; r < nr; r++)                                                                           \
                for (int v = 0; v < NV; v++) wv[r][v] = *(const VEC##u *)(w[r] + c + v * (16 / NV));              \
            for (int t = 0; t < nt; t++) {                                                                         \
                for (int v = 0; v < NV; v++) xv[v] = *(const VEC##u *)(x + t * K + c + v * (16 / NV));            \
                for (int r = 0; r < nr; r++)                                                                       \
                    for (int v = 0; v < NV; v++) acc[t][r][v] += xv[v] * wv[r][v];                                 \
            }                                                                                                      \
        }                                                                                                          \
        for (int t = 0; t < nt; t++)                                                                               \
            for (int r = 0; r < nvalid; r++) {                                                                     \
                float s = lanes_sum(acc[t][r]);                                                                    \
                for (int64_t c = K16; c < K; c++) s += x[t * K + c] * w[r][c];                                     \
                out[t * ldo + r] = s;                                                                              \
            }                                                                                                      \
    }

DOT_TILE(dot_tile_v4, v4)
DOT_TILE(dot_tile_v8, v8)
DOT_TILE(dot_tile_v16, v16)

/* dot_tile with vectors of vb bytes (a constant where inlined). */
INLINE void dot_tile(const int vb, const float *x, int64_t K, const int nt, const float *const *w, const int nr,
                     int nvalid, float *out, int64_t ldo) {
    if (vb == 64) dot_tile_v16(x, K, nt, w, nr, nvalid, out, ldo);
    else if (vb == 32) dot_tile_v8(x, K, nt, w, nr, nvalid, out, ldo);
    else dot_tile_v4(x, K, nt, w, nr, nvalid, out, ldo);
}

/* Pool chunk i of the product, in tiles of TT tokens x RT rows (RT divides HC_ROWS) with VB-byte vectors: chunks
 * [0, groups * blocks) are (token group, row block) pairs, the T after them the squared norm of one token each. */
INLINE void dots_chunk(void *p, int64_t i, const int VB, const int TT, const int RT) {
    const dots_ctx *c = p;
    const int64_t K = c->K, ld = c->R + 1, pairs = c->token_groups * c->row_blocks;
    if (i >= pairs) {
        const float *xt = c->x + (i - pairs) * K;
        dot_tile(VB, xt, K, 1, &xt, 1, 1, c->dots + (i - pairs) * ld + c->R, ld);
        return;
    }
    const int64_t t0 = i / c->row_blocks * HC_TOKENS, t1 = t0 + HC_TOKENS < c->T ? t0 + HC_TOKENS : c->T;
    const int64_t r0 = i % c->row_blocks * HC_ROWS, r1 = r0 + HC_ROWS < c->R ? r0 + HC_ROWS : c->R;
    for (int64_t rb = r0; rb < r1; rb += RT) {
        const float *w[HC_TILE];
        const int nvalid = r1 - rb < RT ? (int)(r1 - rb) : RT;
        for (int r = 0; r < RT; r++) w[r] = c->fn + (rb + (r < nvalid ? r : nvalid - 1)) * K;
        for (int64_t t = t0; t < t1; t += TT) {
            const float *xt = c->x + t * K;
            float *o = c->dots + t * ld + rb;
            switch (t1 - t < TT ? t1 - t : TT) {
                case 1: dot_tile(VB, xt, K, 1, w, RT, nvalid, o, ld); break;
                case 2: dot_tile(VB, xt, K, 2, w, RT, nvalid, o, ld); break;
                case 3: dot_tile(VB, xt, K, 3, w, RT, nvalid, o, ld); break;
                default: dot_tile(VB, xt, K, TT, w, RT, nvalid, o, ld); break;
            }
        }
    }
}

/* ---------------------------------------------------------------- per-token collapse and mix back */

typedef struct {
    const float *x, *dots, *base, *scale; /* x [T, n*d], dots as dots_ctx's */
    int64_t R, d;
    int n, iters, head;
    float hc_eps, eps;
    float *u, *post, *comb;               /* [T, d], [T, n], [T, n*n] (post, comb unused for the head) */
} mix_ctx;

INLINE float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

/* Token t's weights from its dot products, then u_t = sum_k pre_k X_t,k (k ascending). */
INLINE void mix_token(void *p, int64_t t) {
    const mix_ctx *c = p;
    const int n = c->n;
    const int64_t d = c->d;
    const float *m = c->dots + t * (c->R + 1);
    const float r = 1.0f / sqrtf(m[c->R] / (float)(n * d) + c->eps);
    float pre[16];
    for (int k = 0; k < n; k++) pre[k] = sigmoid(m[k] * r * c->scale[0] + c->base[k]) + c->hc_eps;
    if (!c->head) {
        float logits[16 * 16];
        for (int k = 0; k < n; k++) c->post[t * n + k] = 2.0f * sigmoid(m[n + k] * r * c->scale[1] + c->base[n + k]);
        for (int k = 0; k < n * n; k++) logits[k] = m[2 * n + k] * r * c->scale[2] + c->base[2 * n + k];
        sinkhorn_rows(logits, c->comb + t * n * n, 1, n, c->iters, c->hc_eps);
    }
    const float *x = c->x + t * n * d;
    float *u = c->u + t * d;
    for (int64_t i = 0; i < d; i++) u[i] = pre[0] * x[i];
    for (int k = 1; k < n; k++)
        for (int64_t i = 0; i < d; i++) u[i] += pre[k] * x[k * d + i];
}

typedef struct {
    const float *f, *x, *post, *comb; /* [T, d], [T, n*d], [T, n], [T, n*n] */
    int64_t d;
    int n;
    float *out;                       /* [T, n*d] */
} post_ctx;

/* Chunk i = stream k of token t: out_t,k = post_k f_t + sum_j comb[j, k] X_t,j (j ascending, then the post term,
 * as torch's post * f + comb^T @ X groups it). */
INLINE void post_stream(void *p, int64_t i) {
    const post_ctx *c = p;
    const int n = c->n, k = (int)(i % n);
    const int64_t t = i / n, d = c->d;
    const float *x = c->x + t * n * d, *f = c->f + t * d, *cm = c->comb + t * n * n;
    const float pk = c->post[t * n + k];
    float *o = c->out + (t * n + k) * d;
    for (int64_t e = 0; e < d; e++) o[e] = cm[k] * x[e];
    for (int j = 1; j < n; j++)
        for (int64_t e = 0; e < d; e++) o[e] += cm[j * n + k] * x[j * d + e];
    for (int64_t e = 0; e < d; e++) o[e] = pk * f[e] + o[e];
}

/* ---------------------------------------------------------------- the variants */

/* One set of pool-chunk functions per instruction set, with its register width and the tile shape (tokens x rows)
 * measured fastest for it: the 4 x 4 tile's accumulators fill half of AVX-512's 32 registers. */
static void dots_base(void *p, int64_t i) { dots_chunk(p, i, 16, 1, 2); }
static void mix_base(void *p, int64_t t) { mix_token(p, t); }
static void post_base(void *p, int64_t i) { post_stream(p, i); }
#if FASTAR_X86
TARGET_AVX2 static void dots_avx2(void *p, int64_t i) { dots_chunk(p, i, 32, 2, 2); }
TARGET_AVX2 static void mix_avx2(void *p, int64_t t) { mix_token(p, t); }
TARGET_AVX2 static void post_avx2(void *p, int64_t i) { post_stream(p, i); }
TARGET_AVX512 static void dots_avx512(void *p, int64_t i) { dots_chunk(p, i, 64, 4, 4); }
TARGET_AVX512 static void mix_avx512(void *p, int64_t t) { mix_token(p, t); }
TARGET_AVX512 static void post_avx512(void *p, int64_t i) { post_stream(p, i); }
#endif
#if FASTAR_ARM64
/* ASIMD is baseline there, so the base variant is already NEON code (with FMA: AArch64 compilers contract
 * a * b + c); this one only takes a larger tile for its 32 registers (16 accumulators). Same sums as the base. */
static void dots_neon(void *p, int64_t i) { dots_chunk(p, i, 16, 2, 2); }
#endif

typedef struct {
    chunk_fn dots, mix, post;
} hc_variant;

static hc_variant variant(const isa_ops *isa) {
#if FASTAR_X86
    if (isa->vec == VEC_AVX512) return (hc_variant){dots_avx512, mix_avx512, post_avx512};
    if (isa->vec == VEC_AVX2) return (hc_variant){dots_avx2, mix_avx2, post_avx2};
#endif
#if FASTAR_ARM64
    if (isa->vec == VEC_NEON) return (hc_variant){dots_neon, mix_base, post_base};
#endif
    (void)isa;
    return (hc_variant){dots_base, mix_base, post_base};
}

int hc_pre_run(const isa_ops *isa, const float *x, const float *fn, const float *base, const float *scale, int64_t T,
               int n, int64_t d, int head, int iters, float hc_eps, float eps, float *u, float *post, float *comb) {
    if (T <= 0) return 0;
    const int64_t R = head ? n : (int64_t)(2 + n) * n;
    float *dots = malloc((size_t)(T * (R + 1)) * sizeof(float));
    if (!dots) return -1;
    const hc_variant v = variant(isa);
    dots_ctx dc = {x, fn, T, R, (int64_t)n * d, dots, (R + HC_ROWS - 1) / HC_ROWS, (T + HC_TOKENS - 1) / HC_TOKENS};
    pool_run(dc.token_groups * dc.row_blocks + T, v.dots, &dc);
    mix_ctx mc = {x, dots, base, scale, R, d, n, iters, head, hc_eps, eps, u, post, comb};
    pool_run(T, v.mix, &mc);
    free(dots);
    return 0;
}

void hc_post_run(const isa_ops *isa, const float *f, const float *x, const float *post, const float *comb, int64_t T,
                 int n, int64_t d, float *out) {
    post_ctx c = {f, x, post, comb, d, n, out};
    pool_run(T * n, variant(isa).post, &c);
}
