/* The kernels other than the products, checked without Python for every ISA this build has: built natively and
 * cross-compiled for AArch64 (run under qemu-aarch64) by tests/test_arm64.py, beside kernels_check.c.
 *
 * For each ISA the CPU can run, against the portable variant (isa_scalar_ops, the reference), on awkward sizes and
 * special values, with 1, 2 and 3 threads:
 *   - attention with sinks (attn_run): window / compressed rows / picked entries, D off every vector width, heads off
 *     every tile; within float32 rounding of the portable kernel per (query, head), NaN exactly where it has NaN;
 *     2 and 3 threads bit-identical to 1; every query bit-identical alone and inside its chunk;
 *   - mHC (hc_pre_run, the head form, hc_post_run): within 2e-5 of the portable variant per token (both are within
 *     1e-5 of torch, tests/test_mhc.py); thread- and batch-invariant bit for bit; on AArch64 the NEON variant is
 *     the portable one bit for bit (only its tile differs);
 *   - the clamped SwiGLU (swiglu_isa): within 4 ulp of swiglu_rows (exp differs in its last bits), NaN where it has
 *     NaN, on ragged lengths, with and without the limit, with NaN / infinite / huge inputs;
 *   - the fused routed experts (experts_run): with act_block = 128 bit-identical to the same ISA's products,
 *     SwiGLU and activation quantization composed by hand (the eager expert path), thread-invariant, and within
 *     1e-4 of the portable ISA's result.
 * And, once (they have no ISA variant, but the cross build is what runs on AArch64): the RMS norm and RoPE rows
 * against float64 formulas. Prints one line per ISA and a summary; exit status 0 only when every check passed.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static uint32_t rnd(void) { /* xorshift64*: the same cases on every machine */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545f4914f6cdd1dull) >> 32);
}
static float gauss(void) {
    float s = 0;
    for (int i = 0; i < 4; i++) s += (float)(rnd() >> 8) / 16777216.0f;
    return (s - 2.0f) * 1.7f;
}
static float *randn(int64_t n, float scale) {
    float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    for (int64_t i = 0; i < n; i++) p[i] = gauss() * scale;
    return p;
}

static long n_cases[16], n_fail;

static void fail(const char *isa, const char *op, const char *what) {
    if (n_fail < 40) fprintf(stderr, "FAIL %s %s: %s\n", isa, op, what);
    n_fail++;
}

static int same_bits(const float *a, const float *b, int64_t n) { return !memcmp(a, b, (size_t)n * sizeof(float)); }

static double worst; /* the largest |got - ref| / max|ref| close_rows saw last (1e30: a NaN mismatch) */

/* |got - ref| <= tol * max|ref| over each of `rows` rows of `len`, NaN exactly where ref has NaN. */
static int close_rows(const float *got, const float *ref, int64_t rows, int64_t len, double tol) {
    int ok = 1;
    worst = 0;
    for (int64_t r = 0; r < rows; r++) {
        double m = 0;
        for (int64_t i = 0; i < len; i++)
            if (!isnan(ref[r * len + i]) && fabs(ref[r * len + i]) > m) m = fabs(ref[r * len + i]);
        for (int64_t i = 0; i < len; i++) {
            const float g = got[r * len + i], w = ref[r * len + i];
            const double e = isnan(g) != isnan(w) ? 1e30 : isnan(w) ? 0 : fabs((double)g - w) / (m > 0 ? m : 1e-300);
            if (e > worst) worst = e;
            if (isnan(g) != isnan(w) || (!isnan(w) && !(fabs((double)g - w) <= tol * m))) ok = 0;
        }
    }
    return ok;
}

/* ---------------------------------------------------------------- attention */

static void attn(const isa_ops *isa, const attn_job *j, int threads, float *out) {
    attn_job k = *j;
    k.out = out;
    pool_set_threads(threads);
    if (attn_run(isa, &k)) exit(2);
}

static void check_attn(size_t ii, const isa_ops *isa) {
    static const int64_t shapes[][2] = {{8, 512}, {3, 7}, {11, 36}, {1, 67}, {5, 64}}; /* (H, D) */
    for (int si = 0; si < 5; si++)
        for (int mode = 0; mode < 3; mode++) { /* window only, every closed compressed entry, picked entries */
            const int64_t H = shapes[si][0], D = shapes[si][1], T = 5, K = 23, E = 13, k = 6;
            attn_job j = {.T = T, .H = H, .D = D, .K = K, .k0 = 3, .p0 = 17, .window = 9 + si};
            j.scale = 1.0f / sqrtf((float)D);
            float *q = randn(T * H * D, si == 3 ? 6.0f : 1.0f), *keys = randn(K * D, 1.0f), *comp = randn(E * D, 1.0f);
            float *sinks = randn(H, 1.0f);
            int64_t idx[5 * 6];
            for (int i = 0; i < T * k; i++) idx[i] = i % 5 == 4 ? -1 : (int64_t)(rnd() % E);
            if (si == 4) keys[15 * D + 3] = NAN; /* position 18: the queries that see it get NaN rows */
            j.q = q, j.keys = keys, j.sinks = sinks;
            if (mode) j.comp = comp, j.E = E;
            if (mode == 1) j.ratio = 2;
            if (mode == 2) j.idx = idx, j.k = k;
            const int64_t n = T * H * D;
            float *ref = malloc(n * 4), *got = malloc(n * 4), *other = malloc(n * 4);
            attn(&isa_scalar_ops, &j, 1, ref);
            attn(isa, &j, 1, got);
            n_cases[ii]++;
            if (!close_rows(got, ref, T * H, D, 2e-5)) {
                char msg[120];
                snprintf(msg, sizeof msg, "H=%ld D=%ld mode %d: differs from the portable kernel by %.3g", (long)H,
                         (long)D, mode, worst);
                fail(isa->name, "attention", msg);
            }
            for (int th = 2; th <= 3; th++) {
                attn(isa, &j, th, other);
                if (!same_bits(got, other, n)) fail(isa->name, "attention", "result depends on the thread count");
            }
            for (int64_t t = 0; t < T; t++) { /* query t alone */
                attn_job a = j;
                a.T = 1, a.q = q + t * H * D, a.p0 = j.p0 + t, a.idx = j.idx ? idx + t * k : NULL;
                attn(isa, &a, 1, other);
                if (!same_bits(got + t * H * D, other, H * D))
                    fail(isa->name, "attention", "a query's result depends on its chunk");
            }
            free(q), free(keys), free(comp), free(sinks), free(ref), free(got), free(other);
        }
}

/* ---------------------------------------------------------------- mHC */

typedef struct {
    float *u, *post, *comb, *out;
} hc_result;

static hc_result hc(const isa_ops *isa, const float *x, const float *fn, const float *base, const float *scale,
                    const float *f, int64_t T, int n, int64_t d, int head, int threads) {
    hc_result r = {malloc(T * d * 4), malloc(T * n * 4 + 4), malloc(T * n * n * 4 + 4), malloc(T * n * d * 4)};
    pool_set_threads(threads);
    if (hc_pre_run(isa, x, fn, base, scale, T, n, d, head, 20, 1e-6f, 1e-6f, r.u, r.post, r.comb)) exit(2);
    if (!head) hc_post_run(isa, f, x, r.post, r.comb, T, n, d, r.out);
    return r;
}

static void hc_free(hc_result *r) { free(r->u), free(r->post), free(r->comb), free(r->out); }

/* Every output of a and b: bit-identical (tol < 0), else within tol per token. */
static int hc_same(const hc_result *a, const hc_result *b, int64_t t0, int64_t T, int n, int64_t d, int head,
                   double tol) {
    const hc_result *v[2] = {a, b};
    const float *p[2][4];
    for (int i = 0; i < 2; i++) {
        const int64_t o = i ? 0 : t0; /* a holds the whole chunk, b from token t0 on */
        p[i][0] = v[i]->u + o * d, p[i][1] = v[i]->post + o * n;
        p[i][2] = v[i]->comb + o * n * n, p[i][3] = v[i]->out + o * n * d;
    }
    const int64_t len[4] = {d, n, n * n, n * d};
    for (int k = 0; k < (head ? 1 : 4); k++)
        if (tol < 0 ? !same_bits(p[0][k], p[1][k], T * len[k]) : !close_rows(p[0][k], p[1][k], T, len[k], tol))
            return 0;
    return 1;
}

static void check_mhc(size_t ii, const isa_ops *isa) {
    static const int64_t shapes[][2] = {{4, 4096}, {2, 40}, {3, 7}}; /* (n, d): Flash's and ragged widths */
    for (int si = 0; si < 3; si++)
        for (int head = 0; head < 2; head++) {
            const int n = (int)shapes[si][0];
            const int64_t d = shapes[si][1], T = 10, R = head ? n : (2 + n) * n;
            float *x = randn(T * n * d, 1.0f), *fn = randn(R * n * d, 0.02f), *base = randn(R, 0.5f);
            float *f = randn(T * d, 3.0f);
            const float scale[3] = {0.4f, 0.3f, 0.2f};
            for (int64_t t = 0; t < T; t++) /* per-token magnitudes over two decades */
                for (int64_t i = 0; i < n * d; i++) x[t * n * d + i] *= powf(10.0f, -1.0f + 2.0f * t / (T - 1));
            hc_result ref = hc(&isa_scalar_ops, x, fn, base, scale, f, T, n, d, head, 1);
            hc_result got = hc(isa, x, fn, base, scale, f, T, n, d, head, 1);
            n_cases[ii]++;
            if (!hc_same(&got, &ref, 0, T, n, d, head, 2e-5))
                fail(isa->name, "mHC", "differs from the portable variant");
            if (FASTAR_ARM64 && isa->vec == VEC_NEON && !hc_same(&got, &ref, 0, T, n, d, head, -1))
                fail(isa->name, "mHC", "NEON variant differs from the portable one (only the tile should)");
            for (int th = 2; th <= 3; th++) {
                hc_result o = hc(isa, x, fn, base, scale, f, T, n, d, head, th);
                if (!hc_same(&got, &o, 0, T, n, d, head, -1))
                    fail(isa->name, "mHC", "result depends on the thread count");
                hc_free(&o);
            }
            for (int64_t t0 = 0; t0 < T; t0 += 3) { /* tokens t0.. (1 to 3 of them) alone */
                const int64_t nt = T - t0 < 1 + t0 / 3 % 3 ? T - t0 : 1 + t0 / 3 % 3;
                hc_result o = hc(isa, x + t0 * n * d, fn, base, scale, f + t0 * d, nt, n, d, head, 1);
                if (!hc_same(&got, &o, t0, nt, n, d, head, -1))
                    fail(isa->name, "mHC", "a token's result depends on its chunk");
                hc_free(&o);
            }
            hc_free(&ref), hc_free(&got);
            free(x), free(fn), free(base), free(f);
        }
}

/* ---------------------------------------------------------------- SwiGLU */

static int ulps_apart(float a, float b) {
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b) ? 0 : 1 << 30;
    if (a == b) return 0;
    if (isinf(a) || isinf(b) || (a < 0) != (b < 0)) return fabsf(a - b) <= 0x1p-140f ? 0 : 1 << 30;
    int32_t ia, ib;
    memcpy(&ia, &a, 4), memcpy(&ib, &b, 4);
    const int64_t d = (int64_t)(ia & 0x7fffffff) - (ib & 0x7fffffff);
    return (int)(d < 0 ? -d : d > (1 << 30) ? 1 << 30 : d);
}

static void check_swiglu(size_t ii, const isa_ops *isa) {
    for (int64_t n = 1; n <= 70; n += 3)
        for (int lim = 0; lim < 2; lim++) {
            float *g = randn(n, 8.0f), *u = randn(n, 8.0f), *a = malloc(n * 4), *b = malloc(n * 4);
            static const float special[] = {NAN, INFINITY, -INFINITY, 200.0f, -200.0f, 1e-30f, -0.0f, 90.0f};
            if (n > 8)
                for (int i = 0; i < 8; i++) g[i] = special[i], u[n - 1 - i] = special[(i + 3) % 8];
            const float limit = lim ? 10.0f : 0.0f, scale = 0.75f;
            swiglu_rows(g, u, a, n, limit, scale);
            swiglu_isa(isa, g, u, b, n, limit, scale);
            n_cases[ii]++;
            for (int64_t i = 0; i < n; i++)
                if (ulps_apart(a[i], b[i]) > 4) {
                    char msg[120];
                    snprintf(msg, sizeof msg, "n=%ld g=%g u=%g: %.9g, portable %.9g", (long)n, g[i], u[i], b[i], a[i]);
                    fail(isa->name, "swiglu", msg);
                    break;
                }
            swiglu_isa(isa, g, u, g, n, limit, scale); /* in place, as the fused expert calls it */
            if (!same_bits(g, b, n)) fail(isa->name, "swiglu", "in place differs");
            free(g), free(u), free(a), free(b);
        }
}

/* ---------------------------------------------------------------- the fused experts */

enum { XE = 3, XD = 256, XI = 192, XM = 9 }; /* experts, hidden size, intermediate size, (token, expert) pairs */

typedef struct {
    uint8_t *w[6]; /* w1, s1, w3, s3, w2, s2 of each expert */
} expert_w;

static void experts(const isa_ops *isa, const expert_w *ew, const float *x, const int64_t *rows, const int64_t *off,
                    const float *rw, int64_t act_block, int threads, float *out) {
    const uint8_t *p[6 * XE];
    for (int e = 0; e < XE; e++)
        for (int i = 0; i < 6; i++) p[6 * e + i] = ew[e].w[i];
    memset(out, 0, 4 * 4 * XD);
    pool_set_threads(threads);
    if (experts_run(isa, XE, p, x, XD, XI, rows, off, rw, 10.0f, act_block, out)) exit(2);
}

/* experts() with act_block = 128 composed from the ISA's own pieces, expert after expert. */
static void experts_by_hand(const isa_ops *isa, const expert_w *ew, const float *x, const int64_t *rows,
                            const int64_t *off, const float *rw, float *out) {
    memset(out, 0, 4 * 4 * XD);
    pool_set_threads(1);
    for (int e = 0; e < XE; e++) {
        const int64_t T = off[e + 1] - off[e];
        float xs[XM * XD], g[XM * XI], u[XM * XI], y[XM * XD];
        for (int64_t t = 0; t < T; t++) memcpy(xs + t * XD, x + rows[off[e] + t] * XD, XD * 4);
        act_quant_rows(isa, xs, xs, T, XD, 128);
        mm_job a = {.x = xs, .w = ew[e].w[0], .s = ew[e].w[1], .T = T, .N = XI, .K = XD, .out = g, .ldo = XI};
        mm_job b = a;
        b.w = ew[e].w[2], b.s = ew[e].w[3], b.out = u;
        if (product(isa, '4', &a) || product(isa, '4', &b)) exit(2);
        for (int64_t t = 0; t < T; t++) swiglu_isa(isa, g + t * XI, u + t * XI, g + t * XI, XI, 10.0f, rw[off[e] + t]);
        act_quant_rows(isa, g, g, T, XI, 128);
        mm_job c = {.x = g, .w = ew[e].w[4], .s = ew[e].w[5], .T = T, .N = XD, .K = XI, .out = y, .ldo = XD};
        if (product(isa, '4', &c)) exit(2);
        for (int64_t t = 0; t < T; t++)
            for (int i = 0; i < XD; i++) out[rows[off[e] + t] * XD + i] += y[t * XD + i];
    }
}

static void check_experts(size_t ii, const isa_ops *isa) {
    expert_w ew[XE];
    for (int e = 0; e < XE; e++) {
        const int64_t sizes[6] = {XI * XD / 2, XI * XD / 32, XI * XD / 2, XI * XD / 32, XD * XI / 2, XD * XI / 32};
        for (int i = 0; i < 6; i++) {
            ew[e].w[i] = malloc(sizes[i]);
            for (int64_t b = 0; b < sizes[i]; b++) ew[e].w[i][b] = (uint8_t)(i % 2 ? 118 + rnd() % 8 : rnd());
        }
    }
    /* 4 tokens; expert 0 takes tokens 0-3, expert 1 tokens 1 and 3, expert 2 tokens 0, 2, 3 */
    const int64_t rows[XM] = {0, 1, 2, 3, 1, 3, 0, 2, 3}, off[XE + 1] = {0, 4, 6, 9};
    float *x = randn(4 * XD, 1.0f), *rw = randn(XM, 0.3f);
    float got[4 * XD], ref[4 * XD], other[4 * XD];
    for (int ab = 0; ab <= 128; ab += 128) {
        experts(isa, ew, x, rows, off, rw, ab, 1, got);
        experts(&isa_scalar_ops, ew, x, rows, off, rw, ab, 1, ref);
        n_cases[ii]++;
        if (!close_rows(got, ref, 4, XD, ab ? 2e-2 : 1e-4)) /* act_block: a near-tie of the mid quantization may flip */
            fail(isa->name, "experts", "differs from the portable ISA's");
        for (int th = 2; th <= 3; th++) {
            experts(isa, ew, x, rows, off, rw, ab, th, other);
            if (!same_bits(got, other, 4 * XD)) fail(isa->name, "experts", "result depends on the thread count");
        }
        if (ab) {
            experts_by_hand(isa, ew, x, rows, off, rw, other);
            if (!same_bits(got, other, 4 * XD))
                fail(isa->name, "experts", "differs from its products, SwiGLU and quantization");
        }
    }
    for (int e = 0; e < XE; e++)
        for (int i = 0; i < 6; i++) free(ew[e].w[i]);
    free(x), free(rw);
}

/* ---------------------------------------------------------------- row ops (no ISA variant) */

static void check_rowops(void) {
    for (int64_t K = 1; K <= 300; K += 37) { /* RMS norm, with and without weight, rows of ragged K */
        const int64_t R = 3;
        float *x = randn(R * K, 2.0f), *w = randn(K, 1.0f), *y = malloc(R * K * 4);
        for (int hw = 0; hw < 2; hw++) {
            rms_norm_rows(x, hw ? w : NULL, y, R, K, 1e-6f);
            for (int64_t r = 0; r < R; r++) {
                double ss = 0;
                for (int64_t k = 0; k < K; k++) ss += (double)x[r * K + k] * x[r * K + k];
                const double inv = 1.0 / sqrt(ss / K + 1e-6);
                for (int64_t k = 0; k < K; k++) {
                    const double want = x[r * K + k] * inv * (hw ? w[k] : 1.0);
                    if (!(fabs(y[r * K + k] - want) <= 1e-6 * fabs(want) + 1e-7 * inv * fabs(hw ? w[k] : 1.0)))
                        fail("portable", "rms_norm", "differs from float64");
                }
            }
        }
        free(x), free(w), free(y);
    }
    for (int64_t half = 1; half <= 40; half += 13) /* RoPE: pass-through columns, both directions, in place */
        for (int inv = 0; inv < 2; inv++) {
            const int64_t D = 2 * half + 5, R = 6, per = 3;
            float *x = randn(R * D, 1.0f), *c = randn(2 * half, 1.0f), *s = randn(2 * half, 1.0f);
            float *y = malloc(R * D * 4);
            rope_rows(x, y, c, s, R, D, half, per, inv);
            for (int64_t r = 0; r < R; r++)
                for (int64_t i = 0; i < D; i++) {
                    double want = x[r * D + i];
                    if (i >= D - 2 * half) {
                        const int64_t p = (i - (D - 2 * half)) / 2, e = D - 2 * half + 2 * p;
                        const double cc = c[r / per * half + p], ss = (inv ? -1 : 1) * s[r / per * half + p];
                        /* each product rounded to float32 apart, as torch does */
                        want = (i - e) ? (double)(float)(x[r * D + e + 1] * cc) + (float)(x[r * D + e] * ss)
                                       : (double)(float)(x[r * D + e] * cc) - (float)(x[r * D + e + 1] * ss);
                        want = (float)want;
                    }
                    if ((float)want != y[r * D + i]) fail("portable", "rope", "differs from its formula");
                }
            rope_rows(x, x, c, s, R, D, half, per, inv);
            if (!same_bits(x, y, R * D)) fail("portable", "rope", "in place differs");
            free(x), free(c), free(s), free(y);
        }
}

int main(void) {
    isas_init();
    check_rowops();
    int checked = 0;
    long total = 0;
    for (size_t i = 0; i < n_isas && i < 16; i++) {
        const isa_ops *isa = all_isas[i];
        if (!isa_usable(isa)) {
            printf("%-12s not usable on this CPU (needs: %s): skipped\n", isa->name, isa->needs);
            continue;
        }
        check_attn(i, isa);
        check_mhc(i, isa);
        check_swiglu(i, isa);
        check_experts(i, isa);
        printf("%-12s %ld cases\n", isa->name, n_cases[i]);
        total += n_cases[i];
        checked++;
    }
    printf("%d ISAs checked, %ld cases, %ld failed\n", checked, total, n_fail);
    return n_fail ? 1 : 0;
}
