/* The product kernels of every ISA this build has, checked without Python: built natively and cross-compiled for
 * AArch64 (run under qemu-aarch64) by tests/test_arm64.py.
 *
 * For each ISA the CPU can run, each weight format (FP4, FP8, BF16) and each case (awkward N and K, T from 1 past
 * the dot path's limit into the tile path, special values: NaN / infinite x, FP8 NaN codes, zeros, denormals and
 * +-448, a row of small e4m3 codes only (zero, denormals, e = 1: their errors would hide beside large ones), UE8M0
 * scale bytes 0 (2^-127), 1, 247 and 255 (NaN)), with 1, 2 and 3 threads:
 *   - every output is within the float32 summation bound of the float64 product of the dequantized weights
 *     (|got - exact| <= 1e-5 * sum |x w| + K 2^-148) and NaN exactly where the float64 product is NaN;
 *   - its NaN / infinity pattern equals the portable kernels' (isa_scalar_ops, the reference);
 *   - 2 and 3 threads give bit-identical results to 1 thread;
 *   - for T up to the ISA's dot_max, each token's outputs are bit-identical to the token run alone (batch
 *     invariance);
 *   - x that is exactly bfloat16 (the bf16 dot path, where the ISA has one; with the special weights too) and x
 *     that is not (with NaN / infinite x in the special cases) both run.
 * And every e4m3 code's product is exact on every ISA (check_fp8_codes), the FP8 activation quantization of
 * each ISA that has one is bit-identical to the portable one, and the int8 LM head's products are exact and its
 * build keeps its contract on every ISA (check_head_i8_dot, check_head_i8_build).
 * Prints one line per ISA and a summary; exit status 0 only when every check passed.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "head_i8.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) { /* xorshift64*: the same cases on every machine */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545f4914f6cdd1dull) >> 32);
}
static float gauss(void) { /* sum of uniforms: roughly normal, enough for sums of mixed signs */
    float s = 0;
    for (int i = 0; i < 4; i++) s += (float)(rnd() >> 8) / 16777216.0f;
    return (s - 2.0f) * 1.7f;
}
static float bf16_round(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u &= 0xffff0000u;
    memcpy(&v, &u, 4);
    return v;
}

typedef struct {
    char fmt;          /* '4', '8', 'b' */
    int64_t N, K;
    uint8_t *w, *s;    /* weights and scales as the kernels take them */
    double *wd;        /* dequantized [N, K] in float64 */
} weights;

static double bf16_val(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Random weights of fmt, with the special values of case `special` (0: none). */
static weights make_weights(char fmt, int64_t N, int64_t K, int special) {
    weights W = {fmt, N, K, NULL, NULL, malloc((size_t)(N * K) * sizeof(double))};
    if (fmt == '4') {
        const int64_t G = K / FP4_GROUP;
        W.w = malloc((size_t)(N * K / 2));
        W.s = malloc((size_t)(N * G));
        for (int64_t i = 0; i < N * K / 2; i++) W.w[i] = (uint8_t)rnd();
        for (int64_t i = 0; i < N * G; i++) W.s[i] = (uint8_t)(118 + rnd() % 13);
        if (special) {
            for (int64_t i = 0; i < G; i++) W.s[i] = (uint8_t)(rnd() % 4); /* row 0: denormal-range scales */
            if (N > 2) for (int64_t i = 0; i < G; i++) W.s[2 * G + i] = (uint8_t)(140 + rnd() % 20);
            if (N > 3) W.s[3 * G + G / 2] = 255; /* NaN scale: the row is NaN */
            if (N > 5) memset(W.w + 5 * K / 2, 0x77, (size_t)K / 2); /* +6 everywhere */
            if (N > 6) memset(W.w + 6 * K / 2, 0xff, (size_t)K / 2); /* -6 everywhere */
            if (N > 7) W.s[7 * G] = 0;
        }
        for (int64_t n = 0; n < N; n++)
            for (int64_t k = 0; k < K; k++)
                W.wd[n * K + k] = (double)fp4_f32[(W.w[n * K / 2 + k / 2] >> (4 * (k & 1))) & 15] *
                                  ue8m0_f32[W.s[n * G + k / FP4_GROUP]];
    } else if (fmt == '8') {
        const int64_t kb = (K + FP8_BLOCK - 1) / FP8_BLOCK, nb = (N + FP8_BLOCK - 1) / FP8_BLOCK;
        W.w = malloc((size_t)(N * K));
        W.s = malloc((size_t)(nb * kb));
        for (int64_t i = 0; i < N * K; i++) {
            uint8_t b = (uint8_t)rnd();
            W.w[i] = (b & 0x7f) == 0x7f ? (uint8_t)(b - 1) : b; /* NaN codes only where placed below */
        }
        for (int64_t i = 0; i < nb * kb; i++) W.s[i] = (uint8_t)(118 + rnd() % 13);
        if (special) {
            static const uint8_t sb[] = {0, 1, 247, 254, 255};
            for (int64_t i = 0; i < nb * kb && i < 5; i++) W.s[i] = sb[i];
            if (N > 5 && K > 17) W.w[5 * K + 17] = 0x7f;
            if (N > 9) W.w[9 * K + K - 1] = 0xff;
            if (N > 8)
                for (int64_t k = 0; k < K; k++) W.w[8 * K + k] = (uint8_t[]){0x00, 0x01, 0x07, 0x80, 0x81, 0x7e, 0xfe}[rnd() % 7];
            if (N > 10)
                for (int64_t k = 0; k < K; k++) W.w[10 * K + k] = (uint8_t)(rnd() & 0x8f); /* magnitudes 0-15 */
            /* blocks under scales 2^120 and 2^127: small magnitudes keep the products finite in float32 */
            for (int64_t n = 0; n < N; n++)
                for (int64_t k = 0; k < K; k++) {
                    const uint8_t sc = W.s[(n / FP8_BLOCK) * kb + k / FP8_BLOCK], v = W.w[n * K + k];
                    if (sc >= 247 && sc != 255 && (v & 0x7f) != 0x7f) W.w[n * K + k] = v & 0x8f;
                }
        }
        for (int64_t n = 0; n < N; n++)
            for (int64_t k = 0; k < K; k++)
                W.wd[n * K + k] = (double)fp8_f32[W.w[n * K + k]] * ue8m0_f32[W.s[(n / FP8_BLOCK) * kb + k / FP8_BLOCK]];
    } else {
        uint16_t *w = malloc((size_t)(N * K) * 2);
        W.w = (uint8_t *)w;
        for (int64_t i = 0; i < N * K; i++) {
            uint32_t u;
            const float v = gauss();
            memcpy(&u, &v, 4);
            w[i] = (uint16_t)(u >> 16);
        }
        if (special) {
            if (N > 1) w[1 * K + K / 2] = 0x7f80; /* +inf */
            if (N > 4) w[4 * K] = 0x7fc1;         /* NaN */
            if (N > 6) w[6 * K + K - 1] = 0x0001; /* denormal */
        }
        for (int64_t i = 0; i < N * K; i++) W.wd[i] = bf16_val(w[i]);
    }
    return W;
}

static void free_weights(weights *W) {
    free(W->w);
    free(W->s);
    free(W->wd);
}

static void run(const isa_ops *isa, const weights *W, const float *x, int64_t T, float *out) {
    mm_job job = {.x = x, .w = W->w, .s = W->s, .T = T, .N = W->N, .K = W->K, .out = out, .ldo = W->N};
    if (product(isa, W->fmt, &job)) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
}

static long n_cases[16], n_fail;

static void fail(const char *isa, char fmt, int64_t T, int64_t N, int64_t K, const char *what) {
    if (n_fail < 40) fprintf(stderr, "FAIL %s fmt=%c T=%ld N=%ld K=%ld: %s\n", isa, fmt, (long)T, (long)N, (long)K, what);
    n_fail++;
}

/* Bit-identical, NaN payloads aside: a sum that meets two NaNs keeps either one's bits, and the compiler may swap the
 * operands of a commutative add (the portable kernels are plain C). */
static int same_bits(const float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (memcmp(a + i, b + i, sizeof(float)) && !(isnan(a[i]) && isnan(b[i]))) return 0;
    return 1;
}

/* The references of one (weights, x) case, computed once for every ISA. */
typedef struct {
    float *ref;          /* the portable kernels' result, one thread */
    double *exact, *mag; /* the float64 product and sum |x w| */
} refs;

static refs make_refs(const weights *W, const float *x, int64_t T) {
    const int64_t N = W->N, K = W->K;
    refs R = {malloc((size_t)(T * N) * 4), malloc((size_t)(T * N) * 8), malloc((size_t)(T * N) * 8)};
    pool_set_threads(1);
    run(&isa_scalar_ops, W, x, T, R.ref);
    for (int64_t t = 0; t < T; t++)
        for (int64_t n = 0; n < N; n++) {
            double exact = 0, mag = 0;
            for (int64_t k = 0; k < K; k++) {
                exact += (double)x[t * K + k] * W->wd[n * K + k];
                mag += fabs((double)x[t * K + k] * W->wd[n * K + k]);
            }
            R.exact[t * N + n] = exact, R.mag[t * N + n] = mag;
        }
    return R;
}

/* One (ISA, weights, x) case: see the file's comment for what it checks. */
static void check(size_t ii, const isa_ops *isa, const weights *W, const float *x, int64_t T, const refs *R) {
    const int64_t N = W->N, K = W->K;
    float *got = malloc((size_t)(T * N) * 4), *other = malloc((size_t)(T * N) * 4);
    pool_set_threads(1);
    run(isa, W, x, T, got);
    n_cases[ii]++;
    for (int64_t i = 0; i < T * N; i++) {
        const double exact = R->exact[i];
        const float g = got[i], r = R->ref[i];
        if (isnan(exact) != isnan(g)) { fail(isa->name, W->fmt, T, N, K, "NaN where the float64 product is not, or not where it is"); goto done; }
        if (isnan(g) != isnan(r) || isinf(g) != isinf(r)) { fail(isa->name, W->fmt, T, N, K, "NaN / inf pattern differs from the portable kernel"); goto done; }
        if (!isnan(exact) && !isinf(exact) && !(fabs(g - exact) <= 1e-5 * R->mag[i] + (double)K * 0x1p-148)) {
            char msg[160];
            snprintf(msg, sizeof msg, "out[%ld,%ld] = %.9g, float64 product %.9g (bound %.3g)", (long)(i / N), (long)(i % N), g, exact, 1e-5 * R->mag[i]);
            fail(isa->name, W->fmt, T, N, K, msg);
            goto done;
        }
    }
    for (int th = 2; th <= 3; th++) {
        pool_set_threads(th);
        run(isa, W, x, T, other);
        if (!same_bits(got, other, T * N)) { fail(isa->name, W->fmt, T, N, K, "result depends on the thread count"); goto done; }
    }
    pool_set_threads(1);
    if (T > 1 && T <= isa->dot_max)
        for (int64_t t = 0; t < T; t++) {
            /* compare tokens whose path alone is the batch's (a bf16-exact token in a batch that is not takes the
             * split path there, the same products summed in another order) */
            if (choose_path(isa, W->fmt, x + t * K, 1, K) != choose_path(isa, W->fmt, x, T, K)) continue;
            run(isa, W, x + t * K, 1, other);
            if (!same_bits(got + t * N, other, N)) { fail(isa->name, W->fmt, T, N, K, "a token's result depends on its batch"); goto done; }
        }
done:
    free(got);
    free(other);
}

static float *make_x(int64_t T, int64_t K, int bf16, int special) {
    float *x = malloc((size_t)(T * K) * 4);
    for (int64_t i = 0; i < T * K; i++) x[i] = bf16 ? bf16_round(gauss()) : gauss();
    if (special == 2 && T > 1) x[1 * K + K / 3] = NAN;
    if (special == 2 && T > 2) x[2 * K] = INFINITY;
    return x;
}

/* Every e4m3 code's decode, exactly: row n of the weights is code n in every column (scales 1), each token of x is
 * one-hot (at the first / the ragged last column; bfloat16-exact, so the bf16 dot path where the ISA has one), so
 * out[t, n] must be fp8_f32[n] times that one value, NaN for the NaN codes. */
static void check_fp8_codes(size_t ii, const isa_ops *isa) {
    enum { N = 256, KC = 20 };
    static uint8_t w[N * KC], s[2] = {127, 127};
    const float one[2] = {1.0f, -0x1p-100f};
    float x[2 * KC] = {0}, out[2 * N];
    for (int n = 0; n < N; n++) memset(w + n * KC, n, KC);
    x[0] = one[0], x[KC + KC - 1] = one[1];
    const weights W = {'8', N, KC, w, s, NULL};
    pool_set_threads(1);
    run(isa, &W, x, 2, out);
    n_cases[ii]++;
    for (int t = 0; t < 2; t++)
        for (int n = 0; n < N; n++) {
            const float want = fp8_f32[n] * one[t], got = out[t * N + n];
            if (isnan(want) ? !isnan(got) : got != want) {
                char msg[96];
                snprintf(msg, sizeof msg, "e4m3 code 0x%02x times %g gives %.9g, not %.9g", n, (double)one[t], got, want);
                fail(isa->name, 'c', 2, N, KC, msg);
                return;
            }
        }
}

static void check_act_quant(size_t ii, const isa_ops *isa) {
    if (!isa->act_quant) return;
    const int64_t rows = 5, K = 1003; /* ragged ends of every block size */
    float *x = malloc(rows * K * 4), *a = malloc(rows * K * 4), *b = malloc(rows * K * 4);
    for (int64_t i = 0; i < rows * K; i++) x[i] = gauss() * (float)(1 << (rnd() % 12)) / 64.0f;
    x[7] = NAN, x[300] = INFINITY, x[1001] = -INFINITY, x[2000] = 0x1p-130f, x[2100] = 1e30f;
    for (int64_t i = 3 * K; i < 3 * K + 128; i++) x[i] = 0.0f;
    for (int64_t block = 1; block <= 128; block *= 2) {
        fp8_act_quant_scalar(x, a, rows, K, block);
        isa->act_quant(x, b, rows, K, block);
        n_cases[ii]++;
        if (memcmp(a, b, (size_t)(rows * K) * 4)) fail(isa->name, 'q', rows, K, block, "activation quant differs from the portable one");
    }
    free(x), free(a), free(b);
}

/* Where head_i8_build's layout (head_i8.h) keeps q[r, k]: rows in whole groups of 4 as tiles where K % 64 == 0 (the
 * group's rows side by side per 64 columns), the others plain. */
static int64_t q_at(int64_t V, int64_t K, int64_t r, int64_t k) {
    if (K % 64 || r >= V / 4 * 4) return r * K + k;
    return r / 4 * 4 * K + k / 64 * 256 + r % 4 * 64 + k % 64;
}

/* head_i8_dot: exact int32 sums of int8 products (every int8 value, -128 too; T from 1 past the 4 tokens of one pass;
 * 1 and 3 threads) against an int64 reference; and at the largest K, the extremes whose sums come within 2^21 of
 * 2^31. */
static void check_head_i8_dot(size_t ii, const isa_ops *isa) {
    printf("%-12s head_i8_dot path %s\n", isa->name, head_i8_path_name(head_i8_path(isa)));
    static const int64_t shapes[][2] = {{1, 64}, {37, 128}, {130, 192}, {9, 4096}, {3, HEAD_I8_MAX_K}};
    static const int64_t Ts[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 17};
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        const int64_t V = shapes[si][0], K = shapes[si][1], big = K == HEAD_I8_MAX_K;
        int8_t *q = malloc((size_t)(V * K)), *x = malloc((size_t)(17 * K));
        int32_t *rowsum = malloc((size_t)V * 4), *out = malloc((size_t)(17 * V) * 4);
        for (int64_t i = 0; i < V * K; i++) q[i] = big ? (int8_t)(i / K == 0 ? -128 : i / K == 1 ? 127 : -127) : (int8_t)rnd();
        for (int64_t i = 0; i < 17 * K; i++) x[i] = big ? (int8_t)((i / K) % 2 ? 127 : -128) : (int8_t)rnd();
        if (!big) /* row 0 all 127, token 0 all -128 */
            for (int64_t k = 0; k < K; k++) q[q_at(V, K, 0, k)] = 127, x[k] = -128;
        for (int64_t r = 0; r < V; r++) {
            int32_t sum = 0;
            for (int64_t k = 0; k < K; k++) sum += q[q_at(V, K, r, k)];
            rowsum[r] = sum;
        }
        for (size_t ti = 0; ti < sizeof Ts / sizeof *Ts; ti++) {
            const int64_t T = Ts[ti];
            if (big && T > 2) continue;
            for (int threads = 1; threads <= 3; threads += 2) {
                pool_set_threads(threads);
                memset(out, 0x55, (size_t)(T * V) * 4);
                const head_dot d = {.x = x, .q = q, .rowsum = rowsum, .out = out, .T = T, .V = V, .K = K};
                if (head_i8_dot_run(isa, &d)) {
                    fprintf(stderr, "out of memory\n");
                    exit(2);
                }
                n_cases[ii]++;
                for (int64_t t = 0; t < T; t++)
                    for (int64_t r = 0; r < V; r++) {
                        int64_t want = 0;
                        for (int64_t k = 0; k < K; k++) want += (int64_t)x[t * K + k] * q[q_at(V, K, r, k)];
                        if (out[t * V + r] != want) {
                            char msg[96];
                            snprintf(msg, sizeof msg, "head_i8_dot [%ld, %ld] = %ld, not %ld (%d threads)", (long)t,
                                     (long)r, (long)out[t * V + r], (long)want, threads);
                            fail(isa->name, 'i', T, V, K, msg);
                            t = T, r = V; /* one message per case */
                        }
                    }
            }
        }
        free(q), free(x), free(rowsum), free(out);
    }
}

/* head_i8_build against its contract computed here in plain C (float32 quotient, half-even rounding, clamp):
 * ordinary, subnormal-only, largest-value, zero and non-finite rows; q, scale and rowsum bit for bit, the norms
 * within float64 rounding. */
static void check_head_i8_build_shape(size_t ii, const isa_ops *isa, const int64_t K) {
    enum { V = 9, KMAX = 256 };
    static uint16_t w[V * KMAX];
    static int8_t q[V * KMAX];
    float scale[V];
    double wn[V], dn[V];
    int32_t rs[V];
    for (int64_t i = 0; i < V * K; i++) {
        const int64_t r = i / K;
        float v = gauss() * (r == 1 ? 0x1p-90f : 1.0f);
        uint32_t u;
        memcpy(&u, &v, 4);
        w[i] = (uint16_t)(u >> 16);
        if (r == 2) w[i] = (uint16_t)((rnd() & 0x7f) | (rnd() & 0x8000)); /* subnormals and zeros */
        if (r == 3) w[i] = rnd() & 1 ? 0x7f7f : 0xff7f;                  /* +-the largest bfloat16 */
        if (r == 4) w[i] = 0x8000;                                      /* -0 */
    }
    w[5 * K + 17] = 0x7f80, w[6 * K] = 0xff80, w[7 * K + K - 1] = 0x7fc1; /* +inf, -inf, NaN */
    w[8 * K + 3] = 0x0001;                                               /* the smallest subnormal beside others */
    const head_build b = {.w = w, .V = V, .K = K, .q = q, .scale = scale, .wnorm = wn, .dnorm = dn, .rowsum = rs};
    pool_set_threads(2);
    head_i8_build_run(isa, &b);
    n_cases[ii]++;
    for (int64_t r = 0; r < V; r++) {
        float amax = 0.0f;
        int finite = 1;
        for (int64_t k = 0; k < K; k++) {
            const float v = (float)bf16_val(w[r * K + k]);
            finite &= isfinite(v) != 0;
            amax = fabsf(v) > amax ? fabsf(v) : amax;
        }
        const float s = finite && amax > 0 ? amax / 127.0f : 0.0f;
        double ws = 0, ds = 0;
        int32_t sum = 0;
        int bad = scale[r] != s;
        for (int64_t k = 0; k < K && !bad; k++) {
            const float v = (float)bf16_val(w[r * K + k]);
            const float qf = s > 0 ? fminf(fmaxf(rintf(v / s), -127.0f), 127.0f) : 0.0f;
            bad |= q[q_at(V, K, r, k)] != (int8_t)qf;
            sum += (int32_t)qf;
            ws += (double)v * v, ds += ((double)v - (double)qf * s) * ((double)v - (double)qf * s);
        }
        bad |= rs[r] != sum;
        if (!finite)
            bad |= !(isinf(wn[r]) && isinf(dn[r]));
        else
            bad |= fabs(wn[r] - sqrt(ws)) > 1e-13 * sqrt(ws) || fabs(dn[r] - sqrt(ds)) > 1e-13 * sqrt(ds);
        if (bad) {
            char msg[64];
            snprintf(msg, sizeof msg, "head_i8_build row %ld differs from its contract", (long)r);
            fail(isa->name, 'h', 0, V, K, msg);
        }
    }
}

/* plain rows (K % 64 != 0), then two tiles and a plain row after them */
static void check_head_i8_build(size_t ii, const isa_ops *isa) {
    check_head_i8_build_shape(ii, isa, 203);
    check_head_i8_build_shape(ii, isa, 256);
}

int main(void) {
    isas_init();
    /* (N, K): N off every tile and row block, K a multiple of 32 off 64/128, ragged FP8 / BF16 K */
    static const int64_t fp4_shapes[][2] = {{37, 96}, {130, 160}, {61, 288}, {33, 32}, {45, 1056}, {19, 4128}};
    static const int64_t other_shapes[][2] = {{1, 1}, {129, 7}, {200, 130}, {131, 257}, {77, 1000}, {20, 4200}};
    static const int64_t Ts[] = {1, 2, 3, 4, 5, 8, 9, 17};
    int usable[16] = {0};
    for (size_t i = 0; i < n_isas && i < 16; i++) {
        usable[i] = isa_usable(all_isas[i]);
        if (!usable[i]) printf("%-12s not usable on this CPU (needs: %s): skipped\n", all_isas[i]->name, all_isas[i]->needs);
    }
    for (int f = 0; f < 3; f++) {
        const char fmt = "48b"[f];
        for (int si = 0; si < 6; si++) {
            const int64_t N = fmt == '4' ? fp4_shapes[si][0] : other_shapes[si][0];
            const int64_t K = fmt == '4' ? fp4_shapes[si][1] : other_shapes[si][1];
            for (int special = 0; special < 2; special++) {
                weights W = make_weights(fmt, N, K, special);
                for (size_t ti = 0; ti < sizeof Ts / sizeof *Ts; ti++) {
                    if (K >= 4096 && Ts[ti] > 4) continue; /* keep the emulated run short */
                    for (int bf = 0; bf < 2; bf++) {
                        float *x = make_x(Ts[ti], K, bf, special && !bf ? 2 : 0); /* NaN / inf x: never bf16 */
                        refs R = make_refs(&W, x, Ts[ti]);
                        for (size_t i = 0; i < n_isas && i < 16; i++)
                            if (usable[i]) check(i, all_isas[i], &W, x, Ts[ti], &R);
                        free(R.ref), free(R.exact), free(R.mag);
                        free(x);
                    }
                }
                free_weights(&W);
            }
        }
    }
    int checked = 0;
    long total = 0;
    for (size_t i = 0; i < n_isas && i < 16; i++) {
        if (!usable[i]) continue;
        check_fp8_codes(i, all_isas[i]);
        check_act_quant(i, all_isas[i]);
        check_head_i8_dot(i, all_isas[i]);
        check_head_i8_build(i, all_isas[i]);
        printf("%-12s %ld cases\n", all_isas[i]->name, n_cases[i]);
        total += n_cases[i];
        checked++;
    }
    printf("%d ISAs checked, %ld cases, %ld failed\n", checked, total, n_fail);
    return n_fail ? 1 : 0;
}
