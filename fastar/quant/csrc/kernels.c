/* fastar.quant._kernels: the CPython entry points of fastar's CPU kernels.
 *
 * Owns: argument checking (buffer protocol; dtype, contiguity, shape, writability, aliasing -> TypeError /
 * ValueError, never a crash), run-time ISA choice (AVX-512 with BF16 > AVX-512 > AVX2+FMA+F16C > scalar,
 * overridable with set_isa), the per-call choice of the bf16 dot path (x_kind), splitting rows across the
 * thread pool with the GIL released, the fused routed-expert op, and the two machine probes the benchmark
 * needs (streaming read bandwidth, FMA peak); the entry points of mhc.c.
 * Does not own: the arithmetic (kern_*.c, mhc.c), the pool (pool.c), friendly Python wrappers (kernels.py).
 *
 * Every product writes out[t, n] = sum_k x[t, k] W[n, k] (or adds it when accumulate is true). Each output
 * element is computed by exactly one thread with code that does not depend on the thread count, so results
 * are bit-identical for any number of threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels.h"

static const isa_ops *ISA = &isa_scalar_ops;

/* The ISA's activation ops, else the portable ones. */
static void fp8_act_quant_rows(const float *x, float *out, int64_t rows, int64_t K, int64_t block) {
    (ISA->act_quant ? ISA->act_quant : fp8_act_quant_scalar)(x, out, rows, K, block);
}
static void swiglu_any(const float *g, const float *u, float *out, int64_t n, float limit, float scale) {
    (ISA->swiglu ? ISA->swiglu : swiglu_rows)(g, u, out, n, limit, scale);
}

/* ---------------------------------------------------------------- CPU features and ISA choice */

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
/* Register r (0-3: EAX, EBX, ECX, EDX) of CPUID leaf / subleaf, 0 where the leaf does not exist. */
static unsigned cpuid_reg(unsigned leaf, unsigned sub, int r) {
    unsigned v[4];
    __asm__ volatile("cpuid" : "=a"(v[0]), "=b"(v[1]), "=c"(v[2]), "=d"(v[3]) : "a"(leaf & 0x80000000u), "c"(0));
    if (v[0] < leaf) return 0;
    __asm__ volatile("cpuid" : "=a"(v[0]), "=b"(v[1]), "=c"(v[2]), "=d"(v[3]) : "a"(leaf), "c"(sub));
    return v[r];
}
#endif

static int cpu_has(const char *feat) {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (!strcmp(feat, "avx2")) return __builtin_cpu_supports("avx2");
    if (!strcmp(feat, "fma")) return __builtin_cpu_supports("fma");
    /* no __builtin_cpu_supports for these in older compilers: the CPUID bits (the OS's saving of the vector
     * registers is what the avx2 / avx512f checks above and below establish) */
    if (!strcmp(feat, "f16c")) return (cpuid_reg(1, 0, 2) >> 29) & 1;
    if (!strcmp(feat, "avx512f")) return __builtin_cpu_supports("avx512f");
    if (!strcmp(feat, "avx512bw")) return __builtin_cpu_supports("avx512bw");
    if (!strcmp(feat, "avx512vl")) return __builtin_cpu_supports("avx512vl");
    if (!strcmp(feat, "avx512vbmi")) return (cpuid_reg(7, 0, 2) >> 1) & 1;
    if (!strcmp(feat, "avx512bf16")) return (cpuid_reg(7, 1, 0) >> 5) & 1;
#endif
    (void)feat;
    return 0;
}

/* The compiler's cpu_supports checks the OS saves the wide registers (XCR0), so these are safe to use. */
static int isa_usable(const isa_ops *isa) {
    if (isa == &isa_scalar_ops) return 1;
    if (!isa->fp4) return 0; /* not built for this architecture */
    int avx2 = cpu_has("avx2") && cpu_has("fma") && cpu_has("f16c");
    if (isa == &isa_avx2_ops) return avx2;
    const int avx512 = avx2 && cpu_has("avx512f") && cpu_has("avx512bw") && cpu_has("avx512vl");
    if (isa == &isa_avx512_ops) return avx512;
    if (isa == &isa_avx512bf16_ops) return avx512 && cpu_has("avx512bf16") && cpu_has("avx512vbmi");
    return 0;
}

static const isa_ops *const ALL_ISAS[] = {&isa_avx512bf16_ops, &isa_avx512_ops, &isa_avx2_ops, &isa_scalar_ops};

static const isa_ops *best_isa(void) {
    const char *env = getenv("FASTAR_ISA"); /* e.g. FASTAR_ISA=avx2 to test a narrower path */
    for (size_t i = 0; i < sizeof ALL_ISAS / sizeof *ALL_ISAS; i++)
        if (env && *env && !strcmp(env, ALL_ISAS[i]->name) && isa_usable(ALL_ISAS[i])) return ALL_ISAS[i];
    for (size_t i = 0; i < sizeof ALL_ISAS / sizeof *ALL_ISAS; i++)
        if (isa_usable(ALL_ISAS[i])) return ALL_ISAS[i];
    return &isa_scalar_ops;
}

/* ---------------------------------------------------------------- argument checking */

typedef struct {
    Py_buffer b;
    int held;
} view_t;

static void release(view_t *v, int n) {
    for (int i = 0; i < n; i++)
        if (v[i].held) {
            PyBuffer_Release(&v[i].b);
            v[i].held = 0;
        }
}

static const char *dtype_name(char code) {
    switch (code) {
        case 'f': return "float32";
        case 'B': return "uint8";
        case 'H': return "uint16";
        case 'q': return "int64";
        default: return "?";
    }
}

/* Get a C-contiguous view of `obj` with numpy dtype `code` and `ndim` dimensions. */
static int get_view(PyObject *obj, view_t *v, const char *name, char code, int ndim, int writable) {
    if (PyObject_GetBuffer(obj, &v->b, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a numpy array (buffer protocol), got %.200s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    v->held = 1;
    const char *f = v->b.format ? v->b.format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++; /* native / little-endian prefixes (x86 and ARM are LE) */
    Py_ssize_t want = code == 'f' ? 4 : code == 'H' ? 2 : code == 'q' ? 8 : 1;
    const int same = f[0] == code || (code == 'q' && f[0] == 'l'); /* int64 is 'l' where long has 64 bits */
    if (!same || f[1] != '\0' || v->b.itemsize != want) {
        PyErr_Format(PyExc_TypeError, "%s must be %s, got buffer format '%s' (itemsize %zd)", name, dtype_name(code),
                     v->b.format ? v->b.format : "B", v->b.itemsize);
        return -1;
    }
    if (v->b.ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s must be %d-D, got %d-D", name, ndim, v->b.ndim);
        return -1;
    }
    if (!PyBuffer_IsContiguous(&v->b, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s must be C-contiguous (row-major, no strides); use np.ascontiguousarray", name);
        return -1;
    }
    if (writable && v->b.readonly) {
        PyErr_Format(PyExc_ValueError, "%s must be writable", name);
        return -1;
    }
    return 0;
}

static int64_t dim(const view_t *v, int i) { return (int64_t)v->b.shape[i]; }

static int shape_is(const view_t *v, const char *name, int64_t a, int64_t b, const char *what) {
    if (dim(v, 0) != a || dim(v, 1) != b) {
        PyErr_Format(PyExc_ValueError, "%s has shape (%lld, %lld), expected (%lld, %lld) %s", name, (long long)dim(v, 0),
                     (long long)dim(v, 1), (long long)a, (long long)b, what);
        return -1;
    }
    return 0;
}

/* An output is written while the inputs are read by other threads: refuse any overlap instead of racing. */
static int no_overlap_named(const view_t *out, const char *name, const view_t *in, int n_in) {
    const char *o0 = out->b.buf, *o1 = o0 + out->b.len;
    for (int i = 0; i < n_in; i++) {
        const char *a0 = in[i].b.buf, *a1 = a0 + in[i].b.len;
        if (out->b.len && in[i].b.len && a0 < o1 && o0 < a1) {
            PyErr_Format(PyExc_ValueError, "%s must not overlap another array argument", name);
            return -1;
        }
    }
    return 0;
}

static int no_overlap(const view_t *out, const view_t *in, int n_in) { return no_overlap_named(out, "out", in, n_in); }

/* ---------------------------------------------------------------- running a product over the pool */

typedef struct {
    rows_fn fn;
    const mm_job *jobs; /* products with the same N, run as one pool job */
    int64_t rows_per_chunk, chunks_per_job;
} mm_ctx;

static void mm_chunk(void *p, int64_t i) {
    const mm_ctx *c = p;
    const mm_job *job = c->jobs + i / c->chunks_per_job;
    int64_t n0 = i % c->chunks_per_job * c->rows_per_chunk, n1 = n0 + c->rows_per_chunk;
    if (n1 > job->N) n1 = job->N;
    c->fn(job, n0, n1);
}

/* ~8 chunks per thread so a descheduled thread (the machine is shared) delays only a small piece. */
static int64_t chunk_rows(int64_t N) {
    int64_t target = 8 * (int64_t)pool_get_threads();
    int64_t r = (N + target - 1) / target;
    r = (r + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
    return r < ROW_ALIGN ? ROW_ALIGN : r;
}

/* n products with the same N (the groups of a grouped product) over the pool at once: one hand-off, and the
 * threads balance across all their rows. */
static void run_jobs(rows_fn fn, const mm_job *jobs, int64_t n) {
    if (n <= 0 || jobs->N <= 0 || jobs->T <= 0) return;
    mm_ctx c = {fn, jobs, chunk_rows(n * jobs->N)};
    if (c.rows_per_chunk > jobs->N) c.rows_per_chunk = (jobs->N + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
    c.chunks_per_job = (jobs->N + c.rows_per_chunk - 1) / c.rows_per_chunk;
    pool_run(n * c.chunks_per_job, mm_chunk, &c);
}

static void run_rows(rows_fn fn, const mm_job *job) { run_jobs(fn, job, 1); }

static int dot_max(const isa_ops *isa) {
    const char *env = getenv("FASTAR_DOT_MAX"); /* tuning knob: largest T that takes the dot path */
    int d = env && *env ? atoi(env) : isa->dot_max;
    return d < 0 ? 0 : (d > isa->dot_max ? isa->dot_max : d);
}

/* How x can take the bf16 dot path, in one scan.
 * X_EXACT: every x is an exact bfloat16 (low 16 bits zero: FP8-quantized activations have 4 significant bits) and
 * is zero or has a float32 exponent field in [17, 191], i.e. 2^-110 <= |x| < 2^65. Then every product with an
 * e4m3 / e2m1 weight is exact in float32 and a multiple of 2^-126 (x's quantum >= 2^-117, the weights' >= 2^-9),
 * so no partial sum is a float32 denormal (vdpbf16ps flushes those), and a sum of K < 2^53 products below
 * 2^65 * 448 < 2^74 cannot overflow before the float32 scale is applied. The product is then the FP32 path's up
 * to summation order.
 * X_SPLIT: not all exact, but every x is zero or has an exponent field in [33, 191] (2^-94 <= |x| < 2^65): each
 * splits into three bfloat16s (prep_job) whose smallest quantum 2^(e-23) is >= 2^-117, as above.
 * X_NONE otherwise (infinities, NaN, tiny or huge values). */
enum { X_EXACT, X_SPLIT, X_NONE };

static int x_kind(const float *x, int64_t n) {
    uint32_t inexact = 0, out_exact = 0, out_split = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        const uint32_t a = u & 0x7fffffffu, e = a >> 23;
        inexact |= u & 0xffffu;
        out_exact |= (a != 0) & (e - 17u > 174u);
        out_split |= (a != 0) & (e - 33u > 158u);
    }
    return !inexact && !out_exact ? X_EXACT : out_split ? X_NONE : X_SPLIT;
}

/* The dot path's copy of x [T, K]: columns permuted per XP_CHUNK, dst[t, c0 + i] = x[t, c0 + map[i]], each row
 * zero padded to *kp = K rounded up to XP_CHUNK; float32, or (bf16) the high halves of the floats. 64-byte aligned
 * (so are its rows), so no vector load of it straddles two cache lines. NULL when out of memory. */
static void *permute_x(const uint8_t *map, const float *x, int64_t T, int64_t K, int64_t *kp, int bf16) {
    *kp = (K + XP_CHUNK - 1) / XP_CHUNK * XP_CHUNK;
    void *dst = aligned_alloc(64, (size_t)(T * *kp) * (bf16 ? sizeof(uint16_t) : sizeof(float)) + 64);
    if (!dst) return NULL;
    for (int64_t t = 0; t < T; t++)
        for (int64_t c0 = 0; c0 < *kp; c0 += XP_CHUNK)
            for (int i = 0; i < XP_CHUNK; i++) {
                const int64_t col = c0 + map[i];
                const float v = col < K ? x[t * K + col] : 0.0f;
                if (bf16) {
                    uint32_t u;
                    memcpy(&u, &v, 4);
                    ((uint16_t *)dst)[t * *kp + c0 + i] = (uint16_t)(u >> 16);
                } else {
                    ((float *)dst)[t * *kp + c0 + i] = v;
                }
            }
    return dst;
}

/* The bf16 tile path's copy of x [T, K]: the high halves of the floats in natural column order, rows of *kp =
 * K rounded up to XP_CHUNK plus 32 words, zero padded. The extra 64 bytes keep the rows of a token block off one
 * L1 set (power-of-two K otherwise puts every row's columns k at the same 4 KB offset). NULL when out of memory. */
static uint16_t *tile_x_bf16(const float *x, int64_t T, int64_t K, int64_t *kp) {
    *kp = (K + XP_CHUNK - 1) / XP_CHUNK * XP_CHUNK + 32;
    uint16_t *dst = aligned_alloc(64, (size_t)(T * *kp) * sizeof(uint16_t));
    if (!dst) return NULL;
    for (int64_t t = 0; t < T; t++) {
        const uint32_t *src = (const uint32_t *)(x + t * K);
        uint16_t *d = dst + t * *kp;
        for (int64_t k = 0; k < K; k++) d[k] = (uint16_t)(src[k] >> 16);
        memset(d + K, 0, (size_t)(*kp - K) * sizeof(uint16_t));
    }
    return dst;
}

/* The path of a product: the FP32 kernels, the bf16 ones on exact x, or (dot path only) the bf16 ones on x split in
 * three (prep_job). For T > dot_max, PATH_BF16 is the ISA's bf16 tile path (isa_ops.tile_bf16). Decided once per
 * call from all of its x, so every token (and group) of a call takes the same. */
enum { PATH_FP32, PATH_BF16, PATH_SPLIT };

/* FASTAR_TILE_BF16=0 keeps the FP32 tile path (an A/B knob, read once). */
static int tile_bf16_off(void) {
    static int off = -1;
    if (off < 0) {
        const char *env = getenv("FASTAR_TILE_BF16");
        off = env && !strcmp(env, "0");
    }
    return off;
}

static int choose_path(const isa_ops *isa, char fmt, const float *x, int64_t T, int64_t K) {
    const uint8_t *bmap = fmt == '4' ? isa->fp4_bmap : fmt == '8' ? isa->fp8_bmap : NULL;
    if (!bmap) return PATH_FP32;
    if (T > dot_max(isa)) /* the tile path: bf16 on exact x where the ISA has it (split x would cost 3x) */
        return isa->tile_bf16 && !tile_bf16_off() && x_kind(x, T * K) == X_EXACT ? PATH_BF16 : PATH_FP32;
    const int kind = x_kind(x, T * K);
    return kind == X_EXACT ? PATH_BF16 : kind == X_SPLIT ? PATH_SPLIT : PATH_FP32;
}

/* What prep_job allocated and changed in a job, for finish_job. */
typedef struct {
    mm_job *job;
    void *buf, *xs;
    float *out; /* the caller's out under PATH_SPLIT (the job writes 3T pseudo-token rows to a buffer) */
    int64_t T, ldo;
    int accumulate;
} prep_t;

/* Makes job ready to run on `path`. PATH_SPLIT, for x that is not bf16-exact (the unquantized attention output
 * into wo_a, the reference numerics): every float x = x1 + x2 + x3 exactly, x1 = x with its low 16 bits cleared,
 * x2 = the rest likewise, x3 = what remains (at most 8 significant bits), each a bfloat16. The product runs on 3T
 * pseudo-tokens (3t, 3t+1, 3t+2) = (x1, x2, x3) of token t, and finish_job adds out[t] (+)= (o[3t] + o[3t+1]) +
 * o[3t+2]: the same sum as the FP32 path's up to float32 summation order, at about 1.4-1.8x its speed at T = 1
 * (the weights are decoded once for the three). A bf16-exact token splits into (x, 0, 0) and gets exactly its
 * one-part result, so a token's outputs do not depend on its batch-mates here either. Returns 0, or -1 for out of
 * memory (then finish_job frees what was allocated). */
static int prep_job(const isa_ops *isa, char fmt, int path, mm_job *job, prep_t *p) {
    *p = (prep_t){.job = job, .out = job->out, .T = job->T, .ldo = job->ldo, .accumulate = job->accumulate};
    job->dot = job->T <= dot_max(isa);
    job->xp = NULL;
    job->xb = NULL;
    if (!job->dot) { /* the tile path: bfloat16 x in natural column order for PATH_BF16 */
        if (path != PATH_BF16) return 0;
        job->xb = p->buf = tile_x_bf16(job->x, job->T, job->K, &job->kp);
        return p->buf ? 0 : -1;
    }
    const uint8_t *bmap = fmt == '4' ? isa->fp4_bmap : isa->fp8_bmap;
    const uint8_t *map = fmt == '4' ? isa->fp4_map : fmt == '8' ? isa->fp8_map : isa->bf16_map;
    if (path == PATH_BF16) {
        job->xb = p->buf = permute_x(bmap, job->x, job->T, job->K, &job->kp, 1);
    } else if (path == PATH_SPLIT) {
        const int64_t T = job->T, K = job->K;
        float *xs = p->xs = malloc((size_t)(3 * T * K) * sizeof(float));
        float *o = p->buf = malloc((size_t)(3 * T * job->N) * sizeof(float));
        if (!xs || !o) return -1;
        for (int64_t t = 0; t < T; t++)
            for (int64_t k = 0; k < K; k++) {
                const float v = job->x[t * K + k];
                uint32_t u;
                memcpy(&u, &v, 4);
                u &= 0xffff0000u;
                float x1, x2;
                memcpy(&x1, &u, 4);
                const float r = v - x1; /* exact: the low 16 bits of x's significand */
                memcpy(&u, &r, 4);
                u &= 0xffff0000u;
                memcpy(&x2, &u, 4);
                xs[(3 * t) * K + k] = x1;
                xs[(3 * t + 1) * K + k] = x2;
                xs[(3 * t + 2) * K + k] = r - x2; /* exact, at most 8 significant bits */
            }
        job->xb = permute_x(bmap, xs, 3 * T, K, &job->kp, 1);
        free(xs);
        p->xs = (void *)job->xb;
        job->x = NULL, job->T = 3 * T, job->out = o, job->ldo = job->N, job->accumulate = 0;
        return job->xb ? 0 : -1;
    } else if (map) {
        job->xp = p->buf = permute_x(map, job->x, job->T, job->K, &job->kp, 0);
    } else {
        return 0;
    }
    return p->buf ? 0 : -1;
}

/* Completes a job prep_job made ready (after it ran, or after prep failed) and frees its buffers. */
static void finish_job(prep_t *p, int ran) {
    mm_job *job = p->job;
    if (p->xs && ran) { /* PATH_SPLIT: sum the three parts of each token into the caller's out */
        const int64_t N = job->N;
        const float *o = p->buf;
        for (int64_t t = 0; t < p->T; t++) {
            float *dst = p->out + t * p->ldo;
            const float *a = o + 3 * t * N, *b = a + N, *c = b + N;
            for (int64_t n = 0; n < N; n++) {
                const float v = (a[n] + b[n]) + c[n];
                dst[n] = p->accumulate ? dst[n] + v : v;
            }
        }
    }
    free(p->buf);
    free(p->xs);
    job->out = p->out, job->T = p->T, job->ldo = p->ldo, job->accumulate = p->accumulate;
    job->xp = NULL, job->xb = NULL;
    p->buf = p->xs = NULL;
}

static rows_fn rows_of(const isa_ops *isa, char fmt) { return fmt == '4' ? isa->fp4 : fmt == '8' ? isa->fp8 : isa->bf16; }

static void empty_sum(mm_job *job) {
    if (!job->accumulate)
        for (int64_t t = 0; t < job->T; t++) memset(job->out + t * job->ldo, 0, (size_t)job->N * sizeof(float));
}

/* Runs one product with the GIL released. Returns 0, or -1 for out of memory (GIL not held: caller raises). */
static int product(const isa_ops *isa, char fmt, mm_job *job) {
    if (job->K == 0) {
        empty_sum(job);
        return 0;
    }
    prep_t p;
    const float *x = job->x;
    int rc = prep_job(isa, fmt, choose_path(isa, fmt, job->x, job->T, job->K), job, &p);
    if (!rc) run_rows(rows_of(isa, fmt), job);
    finish_job(&p, !rc);
    job->x = x;
    return rc;
}

/* Runs a grouped product (groups > 1: out[t, g*R + r] = sum_k x[t, g*K + k] W[g*R + r, k]) as one pool job, with
 * one path for the whole call. Returns 0, or -1 for out of memory. */
static int grouped_product(const isa_ops *isa, char fmt, const mm_job *whole, int64_t G) {
    const int64_t T = whole->T, K = whole->K / G, R = whole->N / G;
    const size_t wrow = fmt == '4' ? (size_t)K / 2 : fmt == '8' ? (size_t)K : 2 * (size_t)K; /* bytes per row */
    mm_job *jobs = calloc((size_t)G, sizeof(mm_job));
    prep_t *preps = calloc((size_t)G, sizeof(prep_t));
    float *xg = malloc((size_t)(T * G * K) * sizeof(float)); /* x regrouped [G][T][K]: each group's rows contiguous */
    int rc = !jobs || !preps || !xg ? -1 : 0;
    int64_t prepared = 0;
    if (!rc) {
        const int path = choose_path(isa, fmt, whole->x, T, G * K);
        for (int64_t g = 0; g < G; g++)
            for (int64_t t = 0; t < T; t++) memcpy(xg + (g * T + t) * K, whole->x + t * G * K + g * K, (size_t)K * sizeof(float));
        for (int64_t g = 0; g < G && !rc; g++, prepared++) {
            jobs[g] = *whole;
            jobs[g].x = xg + g * T * K, jobs[g].K = K, jobs[g].N = R, jobs[g].out = whole->out + g * R;
            jobs[g].w = (const uint8_t *)whole->w + (size_t)(g * R) * wrow;
            if (fmt == '4') jobs[g].s = whole->s + g * R * (K / FP4_GROUP);
            if (fmt == '8') jobs[g].s = whole->s + (g * R / FP8_BLOCK) * ((K + FP8_BLOCK - 1) / FP8_BLOCK);
            rc = prep_job(isa, fmt, path, &jobs[g], &preps[g]);
        }
    }
    if (!rc) run_jobs(rows_of(isa, fmt), jobs, G);
    for (int64_t g = 0; g < prepared; g++) finish_job(&preps[g], !rc);
    free(xg);
    free(preps);
    free(jobs);
    return rc;
}

/* fp4_matmul / fp8_matmul / bf16_matmul(x, w, [s,] out, accumulate, groups=1) -> None. groups = G > 1: a
 * block-diagonal product, x [T, G*K] (group g's input in columns g*K..), w [G*R, K] (group g's rows g*R..),
 * out [T, G*R]; for FP8, R must be a multiple of 128 (each group owns whole scale blocks). */
static PyObject *matmul(PyObject *args, PyObject *kw, char fmt) {
    static char *kw4[] = {"x", "w", "s", "out", "accumulate", "groups", NULL};
    static char *kw16[] = {"x", "w", "out", "accumulate", "groups", NULL};
    PyObject *ox, *ow, *os = NULL, *oo;
    int accumulate = 0;
    Py_ssize_t G = 1;
    if (fmt == 'b') {
        if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|pn", kw16, &ox, &ow, &oo, &accumulate, &G)) return NULL;
    } else if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|pn", kw4, &ox, &ow, &os, &oo, &accumulate, &G)) {
        return NULL;
    }
    if (G < 1) return PyErr_Format(PyExc_ValueError, "groups must be >= 1, got %zd", G);
    view_t v[4];
    memset(v, 0, sizeof v);
    const int nv = fmt == 'b' ? 3 : 4;
    view_t *vx = &v[0], *vw = &v[1], *vo = &v[2], *vs = &v[3];
    if (get_view(ox, vx, "x", 'f', 2, 0) || get_view(ow, vw, "w", fmt == 'b' ? 'H' : 'B', 2, 0) ||
        get_view(oo, vo, "out", 'f', 2, 1) || (fmt != 'b' && get_view(os, vs, "s", 'B', 2, 0)))
        goto fail;
    const int64_t T = dim(vx, 0), N = dim(vw, 0);
    if (dim(vx, 1) % G || N % G || (fmt == '8' && G > 1 && (N / G) % FP8_BLOCK)) {
        PyErr_Format(PyExc_ValueError, "groups=%zd needs x.shape[1] (%lld) and w.shape[0] (%lld) to be multiples of it%s",
                     G, (long long)dim(vx, 1), (long long)N, fmt == '8' ? ", and 128 to divide w.shape[0] / groups" : "");
        goto fail;
    }
    const int64_t K = dim(vx, 1) / G; /* per group */
    if (fmt == '4') {
        if (K % FP4_GROUP) {
            PyErr_Format(PyExc_ValueError, "FP4 needs K (x.shape[1] = %lld) to be a multiple of %d", (long long)K, FP4_GROUP);
            goto fail;
        }
        if (shape_is(vw, "w", N, K / 2, "= (N, K/2) for packed FP4") || shape_is(vs, "s", N, K / FP4_GROUP, "= (N, K/32)"))
            goto fail;
    } else if (fmt == '8') {
        if (shape_is(vw, "w", N, K, "= (N, K) for FP8") ||
            shape_is(vs, "s", (N + FP8_BLOCK - 1) / FP8_BLOCK, (K + FP8_BLOCK - 1) / FP8_BLOCK, "= (ceil(N/128), ceil(K/128))"))
            goto fail;
    } else if (shape_is(vw, "w", N, K, "= (N, K) for BF16")) {
        goto fail;
    }
    if (shape_is(vo, "out", T, N, "= (T, N)") || no_overlap(vo, vx, 1) || no_overlap(vo, vw, 1) ||
        (fmt != 'b' && no_overlap(vo, vs, 1)))
        goto fail;

    mm_job job = {.x = vx->b.buf, .w = vw->b.buf, .s = fmt == 'b' ? NULL : vs->b.buf, .T = T, .N = N, .K = K * G,
                  .out = vo->b.buf, .ldo = N, .accumulate = accumulate};
    const isa_ops *isa = ISA;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    if (G == 1) {
        rc = product(isa, fmt, &job);
    } else if (K == 0 || T == 0 || N == 0) {
        empty_sum(&job);
        rc = 0;
    } else {
        rc = grouped_product(isa, fmt, &job, G);
    }
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        goto fail;
    }
    release(v, nv);
    Py_RETURN_NONE;
fail:
    release(v, nv);
    return NULL;
}

static PyObject *py_fp4_matmul(PyObject *self, PyObject *args, PyObject *kw) { (void)self; return matmul(args, kw, '4'); }
static PyObject *py_fp8_matmul(PyObject *self, PyObject *args, PyObject *kw) { (void)self; return matmul(args, kw, '8'); }
static PyObject *py_bf16_matmul(PyObject *self, PyObject *args, PyObject *kw) { (void)self; return matmul(args, kw, 'b'); }

/* ---------------------------------------------------------------- the routed expert */

typedef struct {
    const isa_ops *isa;
    mm_job gate, up; /* both write [T, I] buffers with ldo = I */
    const float *route_w;
    float limit;
    int64_t rows_per_chunk;
} ffn_ctx;

/* Rows [n0, n1) of gate and up, then h = silu(min(gate, l)) * clamp(up, -l, l) * route_w[t] into gate's buffer.
 * NaN passes through the clamps as in numpy (comparisons, not fminf). limit <= 0 means no clamp, as DeepSeek's
 * swiglu_limit = 0 does. */
static void ffn_phase1(void *p, int64_t i) {
    const ffn_ctx *c = p;
    const int64_t I = c->gate.N;
    int64_t n0 = i * c->rows_per_chunk, n1 = n0 + c->rows_per_chunk;
    if (n1 > I) n1 = I;
    c->isa->fp4(&c->gate, n0, n1);
    c->isa->fp4(&c->up, n0, n1);
    for (int64_t t = 0; t < c->gate.T; t++)
        (c->isa->swiglu ? c->isa->swiglu : swiglu_rows)(c->gate.out + t * I + n0, c->up.out + t * I + n0,
                                                         c->gate.out + t * I + n0, n1 - n0, c->limit, c->route_w[t]);
}

/* ---------------------------------------------------------------- a layer's routed experts at once */

typedef struct {
    ffn_ctx *c;              /* one per expert, all with the same I and rows_per_chunk */
    int64_t chunks_per_expert;
} ffn_multi;

static void ffn_multi_phase1(void *p, int64_t i) {
    const ffn_multi *m = p;
    ffn_phase1(&m->c[i / m->chunks_per_expert], i % m->chunks_per_expert);
}

/* An expert product's path: choose_path's, but never PATH_SPLIT (phase 1 writes gate and up straight into the
 * SwiGLU, so their rows cannot be three pseudo-tokens' partial sums). */
static int expert_path(const isa_ops *isa, const mm_job *job) {
    const int path = choose_path(isa, '4', job->x, job->T, job->K);
    return path == PATH_SPLIT ? PATH_FP32 : path;
}

/* E routed experts of one layer (ew: 6 arrays each, as expert_ffn's w1, s1, w3, s3, w2, s2) as two pool jobs, all
 * gate/up rows then all down rows, instead of 2E. Expert e takes the tokens rows[off[e]] .. rows[off[e+1] - 1]
 * of x [*, D] with routing weights rw[off[e] ..]; its outputs are added into out[rows[j]] expert after expert, in
 * the given order: bit for bit what E expert_ffn calls (which are this with E = 1) and index_add_s in that order
 * give, since each expert's products choose their paths and sum as they do alone. Returns 0, or -1 for out of
 * memory. */
static int experts_run(const isa_ops *isa, int64_t E, const uint8_t *const *ew, const float *x, int64_t D,
                       int64_t I, const int64_t *rows, const int64_t *off, const float *rw, float limit,
                       int64_t act_block, float *out) {
    const int64_t M = off[E];
    float *xs = malloc((size_t)(M * D) * sizeof(float)), *gu = malloc((size_t)(2 * M * I) * sizeof(float));
    float *y = malloc((size_t)(M * D) * sizeof(float));
    ffn_ctx *c = calloc((size_t)E, sizeof(ffn_ctx));
    mm_job *down = calloc((size_t)E, sizeof(mm_job));
    prep_t *preps = calloc((size_t)(2 * E), sizeof(prep_t)); /* per expert: its gate/up inputs, its down inputs */
    int64_t prepared = 0;
    int rc = !xs || !gu || !y || !c || !down || !preps ? -1 : 0;
    if (!rc) {
        for (int64_t j = 0; j < M; j++) memcpy(xs + j * D, x + rows[j] * D, (size_t)D * sizeof(float));
        if (act_block) fp8_act_quant_rows(xs, xs, M, D, act_block); /* per row: as each expert quantizes its x */
        const int64_t rpc = chunk_rows(E * I) < I ? chunk_rows(E * I) : (I + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
        for (int64_t e = 0; e < E && !rc; e++) {
            const int64_t T = off[e + 1] - off[e];
            const uint8_t *const *w = ew + 6 * e;
            c[e] = (ffn_ctx){.isa = isa, .route_w = rw + off[e], .limit = limit, .rows_per_chunk = rpc};
            c[e].gate = (mm_job){.x = xs + off[e] * D, .w = w[0], .s = w[1], .T = T, .N = I, .K = D,
                                 .out = gu + off[e] * I, .ldo = I};
            rc = prep_job(isa, '4', expert_path(isa, &c[e].gate), &c[e].gate, &preps[prepared++]);
            c[e].up = c[e].gate;
            c[e].up.w = w[2], c[e].up.s = w[3], c[e].up.out = gu + (M + off[e]) * I;
        }
        if (!rc) {
            ffn_multi m = {c, (I + rpc - 1) / rpc};
            pool_run(E * m.chunks_per_expert, ffn_multi_phase1, &m);
            if (act_block) fp8_act_quant_rows(gu, gu, M, I, act_block);
        }
        for (int64_t e = 0; e < E && !rc; e++) {
            const uint8_t *const *w = ew + 6 * e;
            down[e] = (mm_job){.x = gu + off[e] * I, .w = w[4], .s = w[5], .T = off[e + 1] - off[e], .N = D, .K = I,
                               .out = y + off[e] * D, .ldo = D, .accumulate = 0};
            rc = prep_job(isa, '4', expert_path(isa, &down[e]), &down[e], &preps[prepared++]); /* h decides */
        }
        if (!rc) {
            run_jobs(isa->fp4, down, E);
            for (int64_t j = 0; j < M; j++) { /* expert after expert: the fixed order of the sum */
                float *o = out + rows[j] * D;
                const float *v = y + j * D;
                for (int64_t d = 0; d < D; d++) o[d] += v[d];
            }
        }
    }
    for (int64_t i = 0; i < prepared; i++) finish_job(&preps[i], !rc);
    free(preps);
    free(down);
    free(c);
    free(y);
    free(gu);
    free(xs);
    return rc;
}

/* expert_ffn(x, w1, s1, w3, s3, w2, s2, route_w, limit, out, act_block=0) -> None; out [T, D] is accumulated
 * into. act_block > 0 applies DeepSeek's FP8 activation quantization (fp8_act_quant_rows) per act_block values to
 * x before w1/w3 and to the routed mid activation before w2, as the official numerics do. */
static PyObject *py_expert_ffn(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kws[] = {"x", "w1", "s1", "w3", "s3", "w2", "s2", "route_w", "limit", "out", "act_block", NULL};
    PyObject *o[10];
    double limit;
    Py_ssize_t act_block = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOdO|n", kws, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6],
                                     &o[7], &limit, &o[9], &act_block))
        return NULL;
    if (act_block < 0) return PyErr_Format(PyExc_ValueError, "act_block must be >= 0, got %zd", act_block);
    view_t v[9];
    memset(v, 0, sizeof v);
    const char *names[9] = {"x", "w1", "s1", "w3", "s3", "w2", "s2", "route_w", "out"};
    PyObject *objs[9] = {o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[9]};
    for (int i = 0; i < 9; i++) {
        char code = (i == 0 || i >= 7) ? 'f' : 'B';
        if (get_view(objs[i], &v[i], names[i], code, i == 7 ? 1 : 2, i == 8)) goto fail;
    }
    const int64_t T = dim(&v[0], 0), D = dim(&v[0], 1), I = dim(&v[1], 0);
    if (D % FP4_GROUP || I % FP4_GROUP) {
        PyErr_Format(PyExc_ValueError, "expert_ffn needs D (%lld) and I (%lld) to be multiples of %d", (long long)D,
                     (long long)I, FP4_GROUP);
        goto fail;
    }
    if (shape_is(&v[1], "w1", I, D / 2, "= (I, D/2)") || shape_is(&v[2], "s1", I, D / 32, "= (I, D/32)") ||
        shape_is(&v[3], "w3", I, D / 2, "= (I, D/2), like w1") || shape_is(&v[4], "s3", I, D / 32, "= (I, D/32)") ||
        shape_is(&v[5], "w2", D, I / 2, "= (D, I/2)") || shape_is(&v[6], "s2", D, I / 32, "= (D, I/32)") ||
        shape_is(&v[8], "out", T, D, "= x.shape"))
        goto fail;
    if (dim(&v[7], 0) != T) {
        PyErr_Format(PyExc_ValueError, "route_w has %lld entries, expected T = %lld", (long long)dim(&v[7], 0), (long long)T);
        goto fail;
    }
    if (no_overlap(&v[8], v, 8)) goto fail;

    const isa_ops *isa = ISA;
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    if (T > 0 && D > 0 && I > 0) { /* one expert on all T tokens: experts_run with E = 1 */
        int64_t *rows = malloc((size_t)T * sizeof(int64_t)), off[2] = {0, T};
        const uint8_t *ew[6];
        for (int i = 0; i < 6; i++) ew[i] = v[1 + i].b.buf;
        if (!rows) rc = -1;
        for (int64_t t = 0; !rc && t < T; t++) rows[t] = t;
        if (!rc) rc = experts_run(isa, 1, ew, v[0].b.buf, D, I, rows, off, v[7].b.buf, (float)limit, act_block,
                                  v[8].b.buf);
        free(rows);
    }
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        goto fail;
    }
    release(v, 9);
    Py_RETURN_NONE;
fail:
    release(v, 9);
    return NULL;
}

/* experts_ffn(x, experts, rows, offsets, route_w, limit, out, act_block=0) -> None: expert_ffn for a layer's
 * experts at once. experts: a sequence of E (w1, s1, w3, s3, w2, s2) tuples shaped as expert_ffn's; rows int64
 * [M]: token indices into x [T, D], expert e's being rows[offsets[e]:offsets[e+1]] (at least one each);
 * offsets int64 [E+1] from 0 to M; route_w float32 [M]; out [T, D] is added to, expert after expert. */
static PyObject *py_experts_ffn(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kws[] = {"x", "experts", "rows", "offsets", "route_w", "limit", "out", "act_block", NULL};
    PyObject *ox, *oexp, *orows, *ooff, *orw, *oout, *seq = NULL;
    double limit;
    Py_ssize_t act_block = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOdO|n", kws, &ox, &oexp, &orows, &ooff, &orw, &limit, &oout,
                                     &act_block))
        return NULL;
    if (act_block < 0) return PyErr_Format(PyExc_ValueError, "act_block must be >= 0, got %zd", act_block);
    seq = PySequence_Fast(oexp, "experts must be a sequence of (w1, s1, w3, s3, w2, s2) tuples");
    if (!seq) return NULL;
    const Py_ssize_t E = PySequence_Fast_GET_SIZE(seq);
    view_t v[5];
    memset(v, 0, sizeof v);
    view_t *ev = calloc((size_t)(6 * E) + 1, sizeof(view_t));
    const uint8_t **ew = calloc((size_t)(6 * E) + 1, sizeof(uint8_t *));
    Py_ssize_t got = 0; /* expert views acquired */
    if (!ev || !ew) {
        PyErr_NoMemory();
        goto fail;
    }
    if (get_view(ox, &v[0], "x", 'f', 2, 0) || get_view(orows, &v[1], "rows", 'q', 1, 0) ||
        get_view(ooff, &v[2], "offsets", 'q', 1, 0) || get_view(orw, &v[3], "route_w", 'f', 1, 0) ||
        get_view(oout, &v[4], "out", 'f', 2, 1))
        goto fail;
    const int64_t T = dim(&v[0], 0), D = dim(&v[0], 1), M = dim(&v[1], 0);
    const int64_t *rows = v[1].b.buf, *off = v[2].b.buf;
    if (shape_is(&v[4], "out", T, D, "= x.shape") || no_overlap(&v[4], v, 4)) goto fail;
    if (dim(&v[2], 0) != E + 1 || dim(&v[3], 0) != M || (E && (off[0] != 0 || off[E] != M))) {
        PyErr_Format(PyExc_ValueError, "offsets must have E+1 = %zd entries from 0 to len(rows) = %lld, and route_w "
                     "len(rows) entries", E + 1, (long long)M);
        goto fail;
    }
    for (Py_ssize_t e = 0; e < E; e++)
        if (off[e + 1] <= off[e]) {
            PyErr_Format(PyExc_ValueError, "offsets must increase: expert %zd has no tokens", e);
            goto fail;
        }
    for (int64_t j = 0; j < M; j++)
        if (rows[j] < 0 || rows[j] >= T) {
            PyErr_Format(PyExc_ValueError, "rows[%lld] = %lld is not a token of x (T = %lld)", (long long)j,
                         (long long)rows[j], (long long)T);
            goto fail;
        }
    int64_t I = -1;
    static const char *names[6] = {"w1", "s1", "w3", "s3", "w2", "s2"};
    for (Py_ssize_t e = 0; e < E; e++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, e);
        if (!PyTuple_Check(t) && !PyList_Check(t)) {
            PyErr_Format(PyExc_TypeError, "experts[%zd] must be a (w1, s1, w3, s3, w2, s2) tuple", e);
            goto fail;
        }
        if (PySequence_Size(t) != 6) {
            PyErr_Format(PyExc_ValueError, "experts[%zd] has %zd arrays, expected 6", e, PySequence_Size(t));
            goto fail;
        }
        for (int i = 0; i < 6; i++) {
            PyObject *a = PySequence_GetItem(t, i);
            int bad = !a || get_view(a, &ev[6 * e + i], names[i], 'B', 2, 0);
            Py_XDECREF(a);
            got = 6 * e + i + 1;
            if (bad) goto fail;
            ew[6 * e + i] = ev[6 * e + i].b.buf;
        }
        const view_t *w = ev + 6 * e;
        if (I < 0) I = dim(&w[0], 0);
        if (D % FP4_GROUP || I % FP4_GROUP) {
            PyErr_Format(PyExc_ValueError, "experts_ffn needs D (%lld) and I (%lld) to be multiples of %d",
                         (long long)D, (long long)I, FP4_GROUP);
            goto fail;
        }
        if (shape_is(&w[0], "w1", I, D / 2, "= (I, D/2), I as experts[0]") ||
            shape_is(&w[1], "s1", I, D / 32, "= (I, D/32)") || shape_is(&w[2], "w3", I, D / 2, "= (I, D/2)") ||
            shape_is(&w[3], "s3", I, D / 32, "= (I, D/32)") || shape_is(&w[4], "w2", D, I / 2, "= (D, I/2)") ||
            shape_is(&w[5], "s2", D, I / 32, "= (D, I/32)") || no_overlap(&v[4], w, 6))
            goto fail;
    }
    const isa_ops *isa = ISA;
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    if (E > 0 && D > 0 && I > 0)
        rc = experts_run(isa, E, ew, v[0].b.buf, D, I, rows, off, v[3].b.buf, (float)limit, act_block, v[4].b.buf);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        goto fail;
    }
    release(ev, (int)got);
    release(v, 5);
    free(ev);
    free(ew);
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    if (ev) release(ev, (int)got);
    release(v, 5);
    free(ev);
    free(ew);
    Py_DECREF(seq);
    return NULL;
}

/* ---------------------------------------------------------------- activation quantization */

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
            const float s = ldexpf(1.0f, sexp), inv = ldexpf(1.0f, -sexp);
            for (int64_t i = 0; i < n; i++) {
                float v = xb[i] * inv;
                v = v > 448.0f ? 448.0f : (v < -448.0f ? -448.0f : v);
                ob[i] = copysignf(e4m3_round(fabsf(v)), v) * s;
            }
        }
}

/* A float32 input and a writable float32 output of the same 2-D shape that do not overlap (unless in_place
 * allows out to be the input itself). */
static int get_in_out(PyObject *ox, PyObject *oo, view_t v[2], const char *in_name, int in_place) {
    if (get_view(ox, &v[0], in_name, 'f', 2, 0) || get_view(oo, &v[1], "out", 'f', 2, 1)) return -1;
    if (shape_is(&v[1], "out", dim(&v[0], 0), dim(&v[0], 1), "= the input's shape")) return -1;
    if (in_place && v[0].b.buf == v[1].b.buf) return 0;
    return no_overlap(&v[1], &v[0], 1);
}

/* fp8_act_quant(x, block, out) -> None; x, out float32 [R, K] (out may be x) */
static PyObject *py_fp8_act_quant(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *oo;
    Py_ssize_t block;
    if (!PyArg_ParseTuple(args, "OnO", &ox, &block, &oo)) return NULL;
    view_t v[2];
    memset(v, 0, sizeof v);
    if (get_in_out(ox, oo, v, "x", 1)) goto fail;
    if (block < 1) {
        PyErr_Format(PyExc_ValueError, "block must be positive, got %zd", block);
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    fp8_act_quant_rows(v[0].b.buf, v[1].b.buf, dim(&v[0], 0), dim(&v[0], 1), block);
    Py_END_ALLOW_THREADS
    release(v, 2);
    Py_RETURN_NONE;
fail:
    release(v, 2);
    return NULL;
}

/* ---------------------------------------------------------------- mHC (mhc.c) */

/* sinkhorn(logits f32 [B, n*n], n, iters, eps, out f32 [B, n*n]) -> None */
static PyObject *py_sinkhorn(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *oo;
    int n, iters;
    double eps;
    if (!PyArg_ParseTuple(args, "OiidO", &ox, &n, &iters, &eps, &oo)) return NULL;
    view_t v[2];
    memset(v, 0, sizeof v);
    if (get_in_out(ox, oo, v, "logits", 0)) goto fail;
    if (n < 1 || n > 16 || iters < 1 || dim(&v[0], 1) != (int64_t)n * n) {
        PyErr_Format(PyExc_ValueError, "sinkhorn needs 1 <= n <= 16, iters >= 1 and logits [B, n*n]; got n=%d, "
                     "iters=%d, logits [%lld, %lld]", n, iters, (long long)dim(&v[0], 0), (long long)dim(&v[0], 1));
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    sinkhorn_rows(v[0].b.buf, v[1].b.buf, dim(&v[0], 0), n, iters, (float)eps);
    Py_END_ALLOW_THREADS
    release(v, 2);
    Py_RETURN_NONE;
fail:
    release(v, 2);
    return NULL;
}

/* ---------------------------------------------------------------- row-wise ops (rowops.c) */

/* Row ops over the pool: rows are independent and each is computed by one thread in its own fixed order, so the
 * result is bit-identical to one call over all rows (small inputs run on the calling thread alone). */
typedef struct {
    const float *x, *w, *cos, *sin;
    float *y;
    int64_t R, K, half, rows_per_token, rows_per_chunk;
    float eps;
    int inverse;
} rowop_ctx;

static void norm_chunk(void *p, int64_t i) {
    const rowop_ctx *c = p;
    const int64_t r0 = i * c->rows_per_chunk, n = c->R - r0 < c->rows_per_chunk ? c->R - r0 : c->rows_per_chunk;
    rms_norm_rows(c->x + r0 * c->K, c->w, c->y + r0 * c->K, n, c->K, c->eps);
}

static void rope_chunk(void *p, int64_t i) {
    const rowop_ctx *c = p;
    int64_t r0 = i * c->rows_per_chunk, n = c->R - r0 < c->rows_per_chunk ? c->R - r0 : c->rows_per_chunk;
    /* rope_rows indexes cos / sin by row / rows_per_token: hand it whole tokens (chunks are multiples of them) */
    rope_rows(c->x + r0 * c->K, c->y + r0 * c->K, c->cos + r0 / c->rows_per_token * c->half,
              c->sin + r0 / c->rows_per_token * c->half, n, c->K, c->half, c->rows_per_token, c->inverse);
}

static void rowops_run(chunk_fn fn, rowop_ctx *c, int64_t unit) {
    const int64_t target = 4 * (int64_t)pool_get_threads();
    int64_t rows = (c->R + target - 1) / target;
    rows = (rows + unit - 1) / unit * unit;
    c->rows_per_chunk = rows < unit ? unit : rows;
    const int64_t chunks = (c->R + c->rows_per_chunk - 1) / c->rows_per_chunk;
    if (c->R * c->K < (1 << 16) || chunks < 2) {
        c->rows_per_chunk = c->R;
        fn(c, 0);
    } else {
        pool_run(chunks, fn, c);
    }
}

/* rms_norm(x f32 [R, K], weight f32 [K] | None, eps, out f32 [R, K]) -> None; out may be x */
static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *ow, *oo;
    double eps;
    if (!PyArg_ParseTuple(args, "OOdO", &ox, &ow, &eps, &oo)) return NULL;
    view_t v[3];
    memset(v, 0, sizeof v);
    if (get_in_out(ox, oo, v, "x", 1)) goto fail;
    if (ow != Py_None) {
        if (get_view(ow, &v[2], "weight", 'f', 1, 0)) goto fail;
        if (v[2].b.shape[0] != dim(&v[0], 1)) {
            PyErr_Format(PyExc_ValueError, "weight has %zd values, expected %lld (x's last dim)", v[2].b.shape[0],
                         (long long)dim(&v[0], 1));
            goto fail;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    rowop_ctx c = {.x = v[0].b.buf, .w = ow != Py_None ? v[2].b.buf : NULL, .y = v[1].b.buf, .R = dim(&v[0], 0),
                   .K = dim(&v[0], 1), .eps = (float)eps};
    if (c.R > 0) rowops_run(norm_chunk, &c, 1);
    Py_END_ALLOW_THREADS
    release(v, 3);
    Py_RETURN_NONE;
fail:
    release(v, 3);
    return NULL;
}

/* rope(x f32 [R, D], cos f32 [T, h], sin f32 [T, h], inverse, out f32 [R, D]) -> None: the last 2h dims of each row
 * rotated as interleaved pairs by its token's angles (R = T * rows per token); out may be x */
static PyObject *py_rope(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *oc, *os, *oo;
    int inverse;
    if (!PyArg_ParseTuple(args, "OOOpO", &ox, &oc, &os, &inverse, &oo)) return NULL;
    view_t v[4];
    memset(v, 0, sizeof v);
    if (get_in_out(ox, oo, v, "x", 1) || get_view(oc, &v[2], "cos", 'f', 2, 0) || get_view(os, &v[3], "sin", 'f', 2, 0))
        goto fail;
    const int64_t R = dim(&v[0], 0), D = dim(&v[0], 1), T = dim(&v[2], 0), h = dim(&v[2], 1);
    if (shape_is(&v[3], "sin", T, h, "(= cos's shape)")) goto fail;
    if (T < 1 || R % T || 2 * h > D) {
        PyErr_Format(PyExc_ValueError, "rope needs x [T * m, D] with cos/sin [T, h] and 2h <= D; got x [%lld, %lld], "
                     "cos [%lld, %lld]", (long long)R, (long long)D, (long long)T, (long long)h);
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    rowop_ctx c = {.x = v[0].b.buf, .y = v[1].b.buf, .cos = v[2].b.buf, .sin = v[3].b.buf, .R = R, .K = D, .half = h,
                   .rows_per_token = R / T, .inverse = inverse};
    if (R > 0) rowops_run(rope_chunk, &c, R / T);
    Py_END_ALLOW_THREADS
    release(v, 4);
    Py_RETURN_NONE;
fail:
    release(v, 4);
    return NULL;
}

/* swiglu(gate f32 [T, I], up f32 [T, I], limit, out f32 [T, I]) -> None: silu(min(gate, l)) * clamp(up, -l, l)
 * (limit <= 0: no clamp) */
static PyObject *py_swiglu(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *og, *ou, *oo;
    double limit;
    if (!PyArg_ParseTuple(args, "OOdO", &og, &ou, &limit, &oo)) return NULL;
    view_t v[3];
    memset(v, 0, sizeof v);
    if (get_in_out(og, oo, v, "gate", 0) || get_view(ou, &v[2], "up", 'f', 2, 0) ||
        shape_is(&v[2], "up", dim(&v[0], 0), dim(&v[0], 1), "(= gate's shape)") || no_overlap(&v[1], &v[2], 1))
        goto fail;
    Py_BEGIN_ALLOW_THREADS
    swiglu_any(v[0].b.buf, v[2].b.buf, v[1].b.buf, dim(&v[0], 0) * dim(&v[0], 1), (float)limit, 1.0f);
    Py_END_ALLOW_THREADS
    release(v, 3);
    Py_RETURN_NONE;
fail:
    release(v, 3);
    return NULL;
}

/* hc_pre(x, fn, base, scale, n, iters, hc_eps, eps, u, post=None, comb=None) -> None: a layer site's mHC collapse,
 * x f32 [T, n*d] (the flattened streams), fn f32 [R, n*d], base f32 [R], scale f32 [3] -> u f32 [T, d], post f32
 * [T, n], comb f32 [T, n*n], with R = (2+n)*n; with post and comb None, the final head: R = n, scale [1], u only. */
static PyObject *py_hc_pre(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kws[] = {"x", "fn", "base", "scale", "n", "iters", "hc_eps", "eps", "u", "post", "comb", NULL};
    PyObject *o[7] = {NULL, NULL, NULL, NULL, NULL, Py_None, Py_None}; /* x, fn, base, scale, u, post, comb */
    int n, iters;
    double hc_eps, eps;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOiiddO|OO", kws, &o[0], &o[1], &o[2], &o[3], &n, &iters, &hc_eps,
                                     &eps, &o[4], &o[5], &o[6]))
        return NULL;
    const int head = o[5] == Py_None;
    if (head != (o[6] == Py_None))
        return PyErr_Format(PyExc_ValueError, "post and comb must both be arrays (a layer's mHC) or both None (the head)");
    if (n < 1 || n > 16) return PyErr_Format(PyExc_ValueError, "n must be in [1, 16], got %d", n);
    if (!head && iters < 1) return PyErr_Format(PyExc_ValueError, "iters must be >= 1, got %d", iters);
    view_t v[7];
    memset(v, 0, sizeof v);
    static const char *names[7] = {"x", "fn", "base", "scale", "u", "post", "comb"};
    const int nv = head ? 5 : 7;
    for (int i = 0; i < nv; i++)
        if (get_view(o[i], &v[i], names[i], 'f', i == 2 || i == 3 ? 1 : 2, i >= 4)) goto fail;
    const int64_t T = dim(&v[0], 0), K = dim(&v[0], 1), d = K / n, R = head ? n : (int64_t)(2 + n) * n;
    if (K % n) {
        PyErr_Format(PyExc_ValueError, "x has shape (%lld, %lld), expected (T, n*d) with n = %d", (long long)T,
                     (long long)K, n);
        goto fail;
    }
    if (shape_is(&v[1], "fn", R, K, head ? "= (n, n*d) for the head" : "= ((2+n)*n, n*d)")) goto fail;
    if (dim(&v[2], 0) != R || dim(&v[3], 0) != (head ? 1 : 3)) {
        PyErr_Format(PyExc_ValueError, "base has %lld entries and scale %lld, expected %lld (fn's rows) and %d",
                     (long long)dim(&v[2], 0), (long long)dim(&v[3], 0), (long long)R, head ? 1 : 3);
        goto fail;
    }
    if (shape_is(&v[4], "u", T, d, "= (T, d)") || no_overlap_named(&v[4], "u", v, 4)) goto fail;
    if (!head && (shape_is(&v[5], "post", T, n, "= (T, n)") || shape_is(&v[6], "comb", T, (int64_t)n * n, "= (T, n*n)") ||
                  no_overlap_named(&v[5], "post", v, 5) || no_overlap_named(&v[6], "comb", v, 6)))
        goto fail;
    const isa_ops *isa = ISA;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hc_pre_run(isa, v[0].b.buf, v[1].b.buf, v[2].b.buf, v[3].b.buf, T, n, d, head, iters, (float)hc_eps,
                    (float)eps, v[4].b.buf, head ? NULL : v[5].b.buf, head ? NULL : v[6].b.buf);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        goto fail;
    }
    release(v, nv);
    Py_RETURN_NONE;
fail:
    release(v, nv);
    return NULL;
}

/* hc_post(f, x, post, comb, out) -> None: the mix back, out f32 [T, n*d] from the sub-layer output f f32 [T, d],
 * the streams x f32 [T, n*d], post f32 [T, n] and comb f32 [T, n*n] (n from post). */
static PyObject *py_hc_post(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kws[] = {"f", "x", "post", "comb", "out", NULL};
    PyObject *o[5];
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO", kws, &o[0], &o[1], &o[2], &o[3], &o[4])) return NULL;
    view_t v[5];
    memset(v, 0, sizeof v);
    static const char *names[5] = {"f", "x", "post", "comb", "out"};
    for (int i = 0; i < 5; i++)
        if (get_view(o[i], &v[i], names[i], 'f', 2, i == 4)) goto fail;
    const int64_t T = dim(&v[0], 0), d = dim(&v[0], 1), n = dim(&v[2], 1);
    if (n < 1) {
        PyErr_Format(PyExc_ValueError, "post has shape (%lld, 0), expected (T, n) with n >= 1", (long long)dim(&v[2], 0));
        goto fail;
    }
    if (shape_is(&v[1], "x", T, n * d, "= (T, n*d), n = post.shape[1], d = f.shape[1]") ||
        shape_is(&v[2], "post", T, n, "= (T, n), T = f.shape[0]") || shape_is(&v[3], "comb", T, n * n, "= (T, n*n)") ||
        shape_is(&v[4], "out", T, n * d, "= x.shape") || no_overlap(&v[4], v, 4))
        goto fail;
    const isa_ops *isa = ISA;
    Py_BEGIN_ALLOW_THREADS
    hc_post_run(isa, v[0].b.buf, v[1].b.buf, v[2].b.buf, v[3].b.buf, T, (int)n, d, v[4].b.buf);
    Py_END_ALLOW_THREADS
    release(v, 5);
    Py_RETURN_NONE;
fail:
    release(v, 5);
    return NULL;
}

/* ---------------------------------------------------------------- attention */

/* attend(q, keys, k0, p0, window, comp, comp_idx, ratio, sinks, scale, out) -> None: DeepSeek-V4's attention of
 * the queries q f32 [T, H, D] at positions p0.. over the window keys f32 [K, D] (row i at position k0 + i; query
 * p sees positions (p - window, p]) and the compressed entries comp f32 [E, D] (or None): those comp_idx i64
 * [T, k] picks (< 0: none), or with comp_idx None every e < (p + 1) // ratio; sinks f32 [H]; out f32 [T, H, D]. */
static PyObject *py_attend(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kws[] = {"q", "keys", "k0", "p0", "window", "comp", "comp_idx", "ratio", "sinks", "scale", "out",
                          NULL};
    PyObject *oq, *ok, *oc, *oi, *os, *oo;
    Py_ssize_t k0, p0, window, ratio;
    double scale;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOnnnOOnOdO", kws, &oq, &ok, &k0, &p0, &window, &oc, &oi, &ratio, &os,
                                     &scale, &oo))
        return NULL;
    view_t v[6]; /* q, keys, sinks, comp, comp_idx, out */
    memset(v, 0, sizeof v);
    const int has_comp = oc != Py_None, has_idx = oi != Py_None;
    if (get_view(oq, &v[0], "q", 'f', 3, 0) || get_view(ok, &v[1], "keys", 'f', 2, 0) ||
        get_view(os, &v[2], "sinks", 'f', 1, 0) || (has_comp && get_view(oc, &v[3], "comp", 'f', 2, 0)) ||
        (has_idx && get_view(oi, &v[4], "comp_idx", 'q', 2, 0)) || get_view(oo, &v[5], "out", 'f', 3, 1))
        goto fail;
    const int64_t T = dim(&v[0], 0), H = dim(&v[0], 1), D = dim(&v[0], 2), E = has_comp ? dim(&v[3], 0) : 0;
    if (dim(&v[5], 0) != T || dim(&v[5], 1) != H || dim(&v[5], 2) != D) {
        PyErr_Format(PyExc_ValueError, "out has shape (%lld, %lld, %lld), expected q's (%lld, %lld, %lld)",
                     (long long)dim(&v[5], 0), (long long)dim(&v[5], 1), (long long)dim(&v[5], 2), (long long)T,
                     (long long)H, (long long)D);
        goto fail;
    }
    if (dim(&v[2], 0) != H) {
        PyErr_Format(PyExc_ValueError, "sinks has %lld entries, expected H = %lld (q.shape[1])",
                     (long long)dim(&v[2], 0), (long long)H);
        goto fail;
    }
    if (has_idx && !has_comp) {
        PyErr_SetString(PyExc_ValueError, "comp_idx needs comp (the entries it picks from)");
        goto fail;
    }
    if (shape_is(&v[1], "keys", dim(&v[1], 0), D, "= (K, D), D as q's") ||
        (has_comp && shape_is(&v[3], "comp", E, D, "= (E, D), D as q's")) ||
        (has_idx && shape_is(&v[4], "comp_idx", T, dim(&v[4], 1), "= (T, k), T as q's")))
        goto fail;
    if (k0 < 0 || p0 < 0 || window < 1 || ratio < 0 || (has_comp && !has_idx && ratio < 1)) {
        PyErr_Format(PyExc_ValueError, "attend needs k0 >= 0, p0 >= 0, window >= 1 and ratio >= 0 (>= 1 with comp and "
                     "no comp_idx); got k0=%zd, p0=%zd, window=%zd, ratio=%zd", k0, p0, window, ratio);
        goto fail;
    }
    if (has_idx) {
        const int64_t *idx = v[4].b.buf, n = T * dim(&v[4], 1);
        for (int64_t i = 0; i < n; i++)
            if (idx[i] >= E) {
                PyErr_Format(PyExc_ValueError, "comp_idx[%lld, %lld] = %lld is not an entry of comp (E = %lld)",
                             (long long)(i / dim(&v[4], 1)), (long long)(i % dim(&v[4], 1)), (long long)idx[i],
                             (long long)E);
                goto fail;
            }
    }
    if (no_overlap(&v[5], v, 5)) goto fail;
    const attn_job job = {.q = v[0].b.buf, .keys = v[1].b.buf, .comp = has_comp ? v[3].b.buf : NULL,
                          .idx = has_idx ? v[4].b.buf : NULL, .sinks = v[2].b.buf, .out = v[5].b.buf, .T = T, .H = H,
                          .D = D, .K = dim(&v[1], 0), .E = E, .k = has_idx ? dim(&v[4], 1) : 0, .k0 = k0, .p0 = p0,
                          .window = window, .ratio = ratio, .scale = (float)scale};
    const char *isa = ISA->name;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = attn_run(&job, isa);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        goto fail;
    }
    release(v, 6);
    Py_RETURN_NONE;
fail:
    release(v, 6);
    return NULL;
}

/* ---------------------------------------------------------------- threads, ISA, features */

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg) {
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1 || n > 256) return PyErr_Format(PyExc_ValueError, "thread count must be in [1, 256], got %ld", n);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pool_set_threads((int)n);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_Format(PyExc_RuntimeError, "could only start %d of %ld threads", pool_get_threads(), n);
    Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLong(pool_get_threads());
}

static PyObject *py_default_num_threads(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLong(pool_default_threads());
}

static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    if (!strcmp(name, "auto")) {
        ISA = best_isa();
        Py_RETURN_NONE;
    }
    for (size_t i = 0; i < sizeof ALL_ISAS / sizeof *ALL_ISAS; i++)
        if (!strcmp(name, ALL_ISAS[i]->name)) {
            if (!isa_usable(ALL_ISAS[i])) return PyErr_Format(PyExc_ValueError, "this CPU cannot run the %s kernels", name);
            ISA = ALL_ISAS[i];
            Py_RETURN_NONE;
        }
    return PyErr_Format(PyExc_ValueError, "unknown ISA '%s' (avx512bf16, avx512, avx2, scalar or auto)", name);
}

static PyObject *py_get_isa(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyUnicode_FromString(ISA->name);
}

static PyObject *py_cpu_features(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    PyObject *d = PyDict_New(), *isas = PyList_New(0);
    if (!d || !isas) goto fail;
    const char *feats[] = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512bf16"};
    for (size_t i = 0; i < sizeof feats / sizeof *feats; i++)
        if (PyDict_SetItemString(d, feats[i], cpu_has(feats[i]) ? Py_True : Py_False)) goto fail;
    for (size_t i = 0; i < sizeof ALL_ISAS / sizeof *ALL_ISAS; i++)
        if (isa_usable(ALL_ISAS[i])) {
            PyObject *s = PyUnicode_FromString(ALL_ISAS[i]->name);
            if (!s || PyList_Append(isas, s)) { Py_XDECREF(s); goto fail; }
            Py_DECREF(s);
        }
    PyObject *cur = PyUnicode_FromString(ISA->name);
    if (!cur || PyDict_SetItemString(d, "isa", cur)) { Py_XDECREF(cur); goto fail; }
    Py_DECREF(cur);
    if (PyDict_SetItemString(d, "usable_isas", isas)) goto fail;
    Py_DECREF(isas);
    return d;
fail:
    Py_XDECREF(d);
    Py_XDECREF(isas);
    return NULL;
}

/* ---------------------------------------------------------------- machine probes for the benchmark */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
    const isa_ops *isa;
    const uint8_t *p;
    size_t chunk, n;
    double *sums;
    int64_t iters;
    int dot; /* fma_chunk: 1 runs the bf16 dot loop */
} probe_ctx;

static void read_chunk(void *p, int64_t i) {
    probe_ctx *c = p;
    size_t off = (size_t)i * c->chunk, len = c->n - off < c->chunk ? c->n - off : c->chunk;
    c->sums[i] = c->isa->read_sum(c->p + off, len);
}

/* read_bandwidth(buf) -> seconds to stream every byte of buf once over the pool (buf.nbytes % 256 == 0). */
static PyObject *py_read_bandwidth(PyObject *self, PyObject *arg) {
    (void)self;
    view_t v = {0};
    if (get_view(arg, &v, "buf", 'B', 1, 0)) { release(&v, 1); return NULL; }
    probe_ctx c = {.isa = ISA, .p = v.b.buf, .chunk = 1 << 20, .n = (size_t)v.b.len & ~(size_t)255};
    int64_t nchunks = (int64_t)((c.n + c.chunk - 1) / c.chunk);
    c.sums = calloc((size_t)nchunks + 1, sizeof(double));
    if (!c.sums) { release(&v, 1); return PyErr_NoMemory(); }
    double t0, t1;
    Py_BEGIN_ALLOW_THREADS
    t0 = now_s();
    pool_run(nchunks, read_chunk, &c);
    t1 = now_s();
    Py_END_ALLOW_THREADS
    free(c.sums);
    release(&v, 1);
    return PyFloat_FromDouble(t1 - t0);
}

static void fma_chunk(void *p, int64_t i) {
    probe_ctx *c = p;
    c->sums[i] = c->dot ? bf16_dot_loop(c->iters) : c->isa->fma_loop(c->iters);
}

/* fma_peak(iters) -> (seconds, flops): every thread runs 8 slices of an FMA loop on independent registers. */
static PyObject *fma_probe(PyObject *arg, int dot) {
    long long iters = PyLong_AsLongLong(arg);
    if (iters == -1 && PyErr_Occurred()) return NULL;
    if (iters < 1) return PyErr_Format(PyExc_ValueError, "iters must be positive");
    if (dot && !ISA->tile_bf16) return PyErr_Format(PyExc_ValueError, "ISA %s has no bf16 tile path", ISA->name);
    int64_t nchunks = 8 * (int64_t)pool_get_threads();
    probe_ctx c = {.isa = ISA, .iters = iters, .dot = dot};
    c.sums = calloc((size_t)nchunks, sizeof(double));
    if (!c.sums) return PyErr_NoMemory();
    double t0, t1;
    Py_BEGIN_ALLOW_THREADS
    t0 = now_s();
    pool_run(nchunks, fma_chunk, &c);
    t1 = now_s();
    Py_END_ALLOW_THREADS
    double flops = 0;
    for (int64_t i = 0; i < nchunks; i++) flops += c.sums[i];
    free(c.sums);
    return Py_BuildValue("(dd)", t1 - t0, flops);
}

static PyObject *py_fma_peak(PyObject *self, PyObject *arg) { (void)self; return fma_probe(arg, 0); }
/* bf16_dot_peak(iters) -> (seconds, flops): the same with vdpbf16ps (the bf16 tile path's instruction). */
static PyObject *py_bf16_dot_peak(PyObject *self, PyObject *arg) { (void)self; return fma_probe(arg, 1); }

/* ---------------------------------------------------------------- module */

static PyMethodDef methods[] = {
    {"fp4_matmul", (PyCFunction)(void (*)(void))py_fp4_matmul, METH_VARARGS | METH_KEYWORDS,
     "fp4_matmul(x f32[T,K], w u8[N,K/2], s u8[N,K/32], out f32[T,N], accumulate=False): out (+)= x @ W.T"},
    {"fp8_matmul", (PyCFunction)(void (*)(void))py_fp8_matmul, METH_VARARGS | METH_KEYWORDS,
     "fp8_matmul(x f32[T,K], w u8[N,K], s u8[ceil(N/128),ceil(K/128)], out f32[T,N], accumulate=False)"},
    {"bf16_matmul", (PyCFunction)(void (*)(void))py_bf16_matmul, METH_VARARGS | METH_KEYWORDS,
     "bf16_matmul(x f32[T,K], w u16[N,K], out f32[T,N], accumulate=False)"},
    {"experts_ffn", (PyCFunction)(void (*)(void))py_experts_ffn, METH_VARARGS | METH_KEYWORDS,
     "experts_ffn(x, experts, rows, offsets, route_w, limit, out, act_block=0): a layer's experts in one call"},
    {"expert_ffn", (PyCFunction)(void (*)(void))py_expert_ffn, METH_VARARGS | METH_KEYWORDS,
     "expert_ffn(x, w1, s1, w3, s3, w2, s2, route_w, limit, out): out += route_w * swiglu(x) @ W2.T"},
    {"fp8_act_quant", py_fp8_act_quant, METH_VARARGS,
     "fp8_act_quant(x f32[R,K], block, out f32[R,K]): DeepSeek's FP8 activation quant-dequant per block"},
    {"sinkhorn", py_sinkhorn, METH_VARARGS, "sinkhorn(logits f32[B, n*n], n, iters, eps, out): mHC mixing matrices"},
    {"rms_norm", py_rms_norm, METH_VARARGS, "rms_norm(x f32[R, K], weight f32[K] | None, eps, out): RMS norm of each row"},
    {"rope", py_rope, METH_VARARGS, "rope(x f32[R, D], cos f32[T, h], sin, inverse, out): interleaved RoPE per row"},
    {"swiglu", py_swiglu, METH_VARARGS, "swiglu(gate f32[T, I], up, limit, out): silu(min(g, l)) * clamp(u, -l, l)"},

    {"hc_pre", (PyCFunction)(void (*)(void))py_hc_pre, METH_VARARGS | METH_KEYWORDS,
     "hc_pre(x f32[T,n*d], fn f32[R,n*d], base f32[R], scale f32[3], n, iters, hc_eps, eps, u f32[T,d], post f32[T,n]"
     "=None, comb f32[T,n*n]=None): mHC collapse (R = (2+n)*n); post = comb = None: the head (R = n, scale [1])"},
    {"hc_post", (PyCFunction)(void (*)(void))py_hc_post, METH_VARARGS | METH_KEYWORDS,
     "hc_post(f f32[T,d], x f32[T,n*d], post f32[T,n], comb f32[T,n*n], out f32[T,n*d]): mHC mix back"},
    {"attend", (PyCFunction)(void (*)(void))py_attend, METH_VARARGS | METH_KEYWORDS,
     "attend(q f32[T,H,D], keys f32[K,D], k0, p0, window, comp f32[E,D]|None, comp_idx i64[T,k]|None, ratio, "
     "sinks f32[H], scale, out f32[T,H,D]): attention with sinks over window keys and compressed entries"},
    {"set_num_threads", py_set_num_threads, METH_O, "set_num_threads(n): resize the thread pool"},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "get_num_threads() -> int"},
    {"default_num_threads", py_default_num_threads, METH_NOARGS, "CPUs this process may run on (or FASTAR_THREADS)"},
    {"set_isa", py_set_isa, METH_O, "set_isa('avx512bf16'|'avx512'|'avx2'|'scalar'|'auto')"},
    {"get_isa", py_get_isa, METH_NOARGS, "get_isa() -> str"},
    {"cpu_features", py_cpu_features, METH_NOARGS, "cpu_features() -> dict"},
    {"read_bandwidth", py_read_bandwidth, METH_O, "read_bandwidth(buf u8[n]) -> seconds for one streaming pass"},
    {"fma_peak", py_fma_peak, METH_O, "fma_peak(iters) -> (seconds, flops)"},
    {"bf16_dot_peak", py_bf16_dot_peak, METH_O, "bf16_dot_peak(iters) -> (seconds, flops) of vdpbf16ps"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "fastar's fused dequantize-and-multiply CPU kernels",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) {
    tables_init();
    for (size_t i = 0; i < sizeof ALL_ISAS / sizeof *ALL_ISAS; i++)
        if (ALL_ISAS[i]->init) ALL_ISAS[i]->init();
    ISA = best_isa();
    return PyModule_Create(&module);
}
