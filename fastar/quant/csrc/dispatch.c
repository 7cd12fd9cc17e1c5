/* Running the kernels: CPU features and the choice of ISA, and how a product is prepared and spread over the pool.
 *
 * Owns: the list of ISA tables (all_isas, best first) and the current one (cur_isa: AVX-512 with BF16 > AVX-512 >
 * AVX2+FMA+F16C > scalar on x86-64, NEON with BF16 > NEON > scalar on AArch64, FASTAR_ISA or set_isa to force one), cpuid, the per-call choice of the bf16 dot path
 * (x_kind), the dot path's permuted copies of x (the ISA's vectorized x_scan / x_bf16 where it has them), splitting
 * rows across the thread pool, and the portable-or-ISA choice of the activation ops.
 * Does not own: argument checks and the GIL (bindings.c, bind_ops.c), the arithmetic (kern_*.c), the pool (pool.c),
 * the fused expert (experts.c).
 *
 * Every product writes out[t, n] = sum_k x[t, k] W[n, k] (or adds it when accumulate is true). Each output
 * element is computed by exactly one thread with code that does not depend on the thread count, so results
 * are bit-identical for any number of threads.
 */
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"

const isa_ops *cur_isa = &isa_scalar_ops;
int fp8_fold = 1;
int x_prep_isa = 1;

/* ---------------------------------------------------------------- activation ops */

void act_quant_rows(const isa_ops *isa, const float *x, float *out, int64_t rows, int64_t K, int64_t block) {
    (isa->act_quant ? isa->act_quant : fp8_act_quant_scalar)(x, out, rows, K, block);
}

void swiglu_isa(const isa_ops *isa, const float *g, const float *u, float *out, int64_t n, float limit, float scale) {
    (isa->swiglu ? isa->swiglu : swiglu_rows)(g, u, out, n, limit, scale);
}

/* ---------------------------------------------------------------- CPU features and ISA choice */

#if FASTAR_X86
/* Register r (0-3: EAX, EBX, ECX, EDX) of CPUID leaf / subleaf, 0 where the leaf does not exist. */
static unsigned cpuid_reg(unsigned leaf, unsigned sub, int r) {
    unsigned v[4];
    __asm__ volatile("cpuid" : "=a"(v[0]), "=b"(v[1]), "=c"(v[2]), "=d"(v[3]) : "a"(leaf & 0x80000000u), "c"(0));
    if (v[0] < leaf) return 0;
    __asm__ volatile("cpuid" : "=a"(v[0]), "=b"(v[1]), "=c"(v[2]), "=d"(v[3]) : "a"(leaf), "c"(sub));
    return v[r];
}
#endif

#if FASTAR_ARM64
#if defined(__APPLE__)
#include <sys/sysctl.h>
/* macOS names each optional feature in sysctl hw.optional.arm.FEAT_*; absent means no. */
static int apple_feature(const char *name) {
    int v = 0;
    size_t n = sizeof v;
    return sysctlbyname(name, &v, &n, NULL, 0) == 0 && v;
}
#elif defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP2_BF16
#define HWCAP2_BF16 (1 << 14)
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif
#endif

/* Every architecture's names (false on the others), so cpu_features() has the same keys everywhere. */
const char *const cpu_feature_names[] = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vbmi",
                                        "avx512bf16", "avx512vnni", "asimd", "bf16", "dotprod"};
const size_t n_cpu_features = sizeof cpu_feature_names / sizeof *cpu_feature_names;

int cpu_has(const char *feat) {
#if FASTAR_X86
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
    if (!strcmp(feat, "avx512vnni")) return (cpuid_reg(7, 0, 2) >> 11) & 1; /* vpdpbusd (head_i8.c) */
#endif
#if FASTAR_ARM64
    if (!strcmp(feat, "asimd")) return 1; /* ASIMD (with FMA) is part of the base AArch64 architecture */
    if (!strcmp(feat, "bf16")) { /* FEAT_BF16: BFDOT, BFMMLA, BFMLALB/T */
#if defined(__APPLE__)
        return apple_feature("hw.optional.arm.FEAT_BF16");
#elif defined(__linux__)
        return (getauxval(AT_HWCAP2) & HWCAP2_BF16) != 0;
#else
        return 0;
#endif
    }
    if (!strcmp(feat, "dotprod")) { /* FEAT_DotProd: SDOT / UDOT (head_i8.c) */
#if defined(__APPLE__)
        return apple_feature("hw.optional.arm.FEAT_DotProd");
#elif defined(__linux__)
        return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
        return 0;
#endif
    }
#endif
    (void)feat;
    return 0;
}

/* The ISA tables, best first: the one list of them. */
const isa_ops *const all_isas[] = {
#if FASTAR_X86
    &isa_avx512bf16_ops, &isa_avx512_ops, &isa_avx2_ops,
#endif
#if FASTAR_ARM64
    &isa_neonbf16_ops, &isa_neon_ops,
#endif
    &isa_scalar_ops};
const size_t n_isas = sizeof all_isas / sizeof *all_isas;

/* Every feature in isa->needs. The compiler's cpu_supports checks the OS saves the wide registers (XCR0), so these
 * are safe to use. */
int isa_usable(const isa_ops *isa) {
    char feat[32];
    for (const char *p = isa->needs; *p;) {
        size_t n = strcspn(p, " ");
        if (n >= sizeof feat) return 0;
        memcpy(feat, p, n);
        feat[n] = '\0';
        if (n && !cpu_has(feat)) return 0;
        p += n + (p[n] == ' ');
    }
    return 1;
}

const isa_ops *best_isa(void) {
    const char *env = getenv("FASTAR_ISA"); /* e.g. FASTAR_ISA=avx2 to test a narrower path */
    for (size_t i = 0; i < n_isas; i++)
        if (env && *env && !strcmp(env, all_isas[i]->name) && isa_usable(all_isas[i])) return all_isas[i];
    for (size_t i = 0; i < n_isas; i++)
        if (isa_usable(all_isas[i])) return all_isas[i];
    return &isa_scalar_ops;
}

void isas_init(void) {
    tables_init();
    for (size_t i = 0; i < n_isas; i++)
        if (all_isas[i]->init) all_isas[i]->init();
    cur_isa = best_isa();
}

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
int64_t chunk_rows(int64_t N) {
    int64_t target = 8 * (int64_t)pool_get_threads();
    int64_t r = (N + target - 1) / target;
    r = (r + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
    return r < ROW_ALIGN ? ROW_ALIGN : r;
}

/* n products with the same N (the groups of a grouped product) over the pool at once: one hand-off, and the
 * threads balance across all their rows. */
void run_jobs(rows_fn fn, const mm_job *jobs, int64_t n) {
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

static int x_kind(const isa_ops *isa, const float *x, int64_t n) {
    if (isa->x_scan && x_prep_isa) { /* the same scan, vectorized */
        const unsigned b = isa->x_scan(x, n);
        return !(b & (X_SCAN_INEXACT | X_SCAN_OUT_EXACT)) ? X_EXACT : b & X_SCAN_OUT_SPLIT ? X_NONE : X_SPLIT;
    }
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

/* The dot path's copy of x [T, K] (rows ld floats apart): columns permuted per XP_CHUNK, dst[t, c0 + i] = x[t, c0 +
 * map[i]], each row zero padded to *kp = K rounded up to XP_CHUNK; float32, or (bf16) the high halves of the floats
 * (the ISA's x_bf16 where it has one). 64-byte aligned (so are its rows), so no vector load of it straddles two cache
 * lines. NULL when out of memory. */
static void *permute_x(const isa_ops *isa, const uint8_t *map, const float *x, int64_t T, int64_t K, int64_t ld,
                       int64_t *kp, int bf16) {
    *kp = (K + XP_CHUNK - 1) / XP_CHUNK * XP_CHUNK;
    void *dst = aligned_alloc(64, (size_t)(T * *kp) * (bf16 ? sizeof(uint16_t) : sizeof(float)) + 64);
    if (!dst) return NULL;
    if (bf16 && isa->x_bf16 && x_prep_isa) {
        isa->x_bf16(map, x, T, K, ld, dst, *kp);
        return dst;
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t c0 = 0; c0 < *kp; c0 += XP_CHUNK)
            for (int i = 0; i < XP_CHUNK; i++) {
                const int64_t col = c0 + map[i];
                const float v = col < K ? x[t * ld + col] : 0.0f;
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

/* The bf16 tile path's copy of x: T rows of K floats, ld apart (a grouped product's group is a column slice of its
 * x), as mm_job.xb's tile layout: groups of TILE_XG tokens, pair p of the group's tokens side by side (the
 * microkernel's broadcasts of a pair for its tokens read one 48-byte run, and a token block's x for one tile is one
 * contiguous stream instead of 12 rows 8 KB apart), kp = K rounded up to XP_CHUNK, zero padded. The copy and
 * x_kind's scan are one pass over x's rows, spread over the pool by groups (at 512 tokens x 32768 values, two serial
 * passes took ~15 % of the wo_a product's time). Returns 1 with *dst set when every x is X_EXACT, 0 (nothing kept)
 * when some x is not, -1 for out of memory. *tiny: some nonzero x is below 2^-64 (exponent field < 63:
 * gemm_avx512bf16.c then keeps FP4 scales out of the weights). */
typedef struct {
    const float *x;
    uint32_t *dst;
    int64_t T, K, ld, kp, rows; /* rows: per chunk, a multiple of TILE_XG */
    uint8_t *inexact;           /* per chunk: bit 0 some x not X_EXACT, bit 1 some nonzero |x| < 2^-64 */
} tile_x_ctx;

static void tile_x_chunk(void *p, int64_t i) {
    const tile_x_ctx *c = p;
    const int64_t t1 = (i + 1) * c->rows < c->T ? (i + 1) * c->rows : c->T, np = c->kp / 2, K2 = c->K / 2;
    int bad = 0, tiny = 0;
    for (int64_t t = i * c->rows; t < t1; t++) {
        const uint32_t *src = (const uint32_t *)(c->x + t * c->ld);
        uint32_t *d = c->dst + (t / TILE_XG) * np * TILE_XG + t % TILE_XG;
        for (int64_t q = 0; q < K2; q++) d[q * TILE_XG] = src[2 * q] >> 16 | (src[2 * q + 1] & 0xffff0000u);
        for (int64_t q = K2; q < np; q++) d[q * TILE_XG] = q == K2 && c->K % 2 ? src[c->K - 1] >> 16 : 0;
        uint32_t inexact = 0, out = 0, small = 0; /* x_kind's X_EXACT test and the 2^-64 bound, one (vector) pass */
        for (int64_t k = 0; k < c->K; k++) {
            const uint32_t u = src[k], a = u & 0x7fffffffu;
            inexact |= u & 0xffffu;
            out |= (a != 0) & ((a >> 23) - 17u > 174u);
            small |= a - 1u < (63u << 23) - 1u;
        }
        bad |= inexact || out;
        tiny |= small != 0;
    }
    c->inexact[i] = (uint8_t)(bad | tiny << 1);
}

static int tile_x_bf16(const float *x, int64_t T, int64_t K, int64_t ld, uint16_t **dst, int64_t *kp, int *tiny) {
    *kp = (K + XP_CHUNK - 1) / XP_CHUNK * XP_CHUNK;
    const int64_t groups = (T + TILE_XG - 1) / TILE_XG;
    tile_x_ctx c = {x, aligned_alloc(64, (size_t)(groups * TILE_XG * *kp) * sizeof(uint16_t)), T, K, ld, *kp,
                    TILE_XG * (1 + (1 << 16) / (TILE_XG * K + 1))};
    const int64_t n = (T + c.rows - 1) / c.rows;
    c.inexact = calloc((size_t)n, 1);
    *dst = NULL;
    if (!c.dst || !c.inexact) {
        free(c.dst);
        free(c.inexact);
        return -1;
    }
    pool_run(n, tile_x_chunk, &c);
    int bad = 0;
    for (int64_t i = 0; i < n; i++) bad |= c.inexact[i];
    free(c.inexact);
    *tiny = bad >> 1;
    bad &= 1;
    if (bad) {
        free(c.dst);
        return 0;
    }
    *dst = (uint16_t *)c.dst;
    return 1;
}

/* FASTAR_TILE_BF16=0 keeps the FP32 tile path (an A/B knob, read once). */
static int tile_bf16_off(void) {
    static int off = -1;
    if (off < 0) {
        const char *env = getenv("FASTAR_TILE_BF16");
        off = env && !strcmp(env, "0");
    }
    return off;
}

int choose_path(const isa_ops *isa, char fmt, const float *x, int64_t T, int64_t K) {
    const uint8_t *bmap = fmt == '4' ? isa->fp4_bmap : fmt == '8' ? isa->fp8_bmap : NULL;
    if (!bmap) return PATH_FP32;
    if (T > dot_max(isa)) /* the tile path: bf16 where the ISA has it, if prep_job finds x exact (split: 3x cost) */
        return isa->tile_bf16 && !tile_bf16_off() ? PATH_BF16 : PATH_FP32;
    const int kind = x_kind(isa, x, T * K);
    return kind == X_EXACT ? PATH_BF16 : kind == X_SPLIT ? PATH_SPLIT : PATH_FP32;
}

/* Makes job ready to run on `path`. PATH_SPLIT, for x that is not bf16-exact (the unquantized attention output
 * into wo_a, the reference numerics): every float x = x1 + x2 + x3 exactly, x1 = x with its low 16 bits cleared,
 * x2 = the rest likewise, x3 = what remains (at most 8 significant bits), each a bfloat16. The product runs on 3T
 * pseudo-tokens (3t, 3t+1, 3t+2) = (x1, x2, x3) of token t, and finish_job adds out[t] (+)= (o[3t] + o[3t+1]) +
 * o[3t+2]: the same sum as the FP32 path's up to float32 summation order, at about 1.4-1.8x its speed at T = 1
 * (the weights are decoded once for the three). A bf16-exact token splits into (x, 0, 0) and gets exactly its
 * one-part result, so a token's outputs do not depend on its batch-mates here either. Returns 0, or -1 for out of
 * memory (then finish_job frees what was allocated). */
int prep_job(const isa_ops *isa, char fmt, int path, mm_job *job, prep_t *p) {
    *p = (prep_t){.job = job, .out = job->out, .T = job->T, .ldo = job->ldo, .accumulate = job->accumulate};
    job->dot = job->T <= dot_max(isa);
    job->xp = NULL;
    job->xb = NULL;
    if (!job->dot) { /* the tile path: bfloat16 x in groups of TILE_XG tokens when PATH_BF16 and x is all exact */
        if (path != PATH_BF16) return 0;
        uint16_t *xb;
        const int rc = tile_x_bf16(job->x, job->T, job->K, job->K, &xb, &job->kp, &job->x_tiny);
        job->xb = p->buf = xb; /* NULL when not all exact: the FP32 tile path */
        return rc < 0 ? -1 : 0;
    }
    const uint8_t *bmap = fmt == '4' ? isa->fp4_bmap : isa->fp8_bmap;
    const uint8_t *map = fmt == '4' ? isa->fp4_map : fmt == '8' ? isa->fp8_map : isa->bf16_map;
    if (path == PATH_BF16) {
        job->xb = p->buf = permute_x(isa, bmap, job->x, job->T, job->K, job->K, &job->kp, 1);
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
        job->xb = permute_x(isa, bmap, xs, 3 * T, K, K, &job->kp, 1);
        free(xs);
        p->xs = (void *)job->xb;
        job->x = NULL, job->T = 3 * T, job->out = o, job->ldo = job->N, job->accumulate = 0;
        return job->xb ? 0 : -1;
    } else if (map) {
        job->xp = p->buf = permute_x(isa, map, job->x, job->T, job->K, job->K, &job->kp, 0);
    } else {
        return 0;
    }
    return p->buf ? 0 : -1;
}

/* Completes a job prep_job made ready (after it ran, or after prep failed) and frees its buffers. */
void finish_job(prep_t *p, int ran) {
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

void empty_sum(mm_job *job) {
    if (!job->accumulate)
        for (int64_t t = 0; t < job->T; t++) memset(job->out + t * job->ldo, 0, (size_t)job->N * sizeof(float));
}

/* Runs one product with the GIL released. Returns 0, or -1 for out of memory (GIL not held: caller raises). */
int product(const isa_ops *isa, char fmt, mm_job *job) {
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
int grouped_product(const isa_ops *isa, char fmt, const mm_job *whole, int64_t G) {
    const int64_t T = whole->T, K = whole->K / G, R = whole->N / G;
    const size_t wrow = fmt == '4' ? (size_t)K / 2 : fmt == '8' ? (size_t)K : 2 * (size_t)K; /* bytes per row */
    mm_job *jobs = calloc((size_t)G, sizeof(mm_job));
    prep_t *preps = calloc((size_t)G, sizeof(prep_t));
    float *xg = NULL; /* x regrouped [G][T][K] (each group's rows contiguous), for all but the bf16 paths */
    int rc = !jobs || !preps ? -1 : 0;
    int64_t prepared = 0;
    int path = rc ? PATH_FP32 : choose_path(isa, fmt, whole->x, T, G * K), tiled = 0, direct = 0;
    for (int64_t g = 0; g < G && !rc; g++) {
        jobs[g] = *whole;
        jobs[g].K = K, jobs[g].N = R, jobs[g].out = whole->out + g * R;
        jobs[g].w = (const uint8_t *)whole->w + (size_t)(g * R) * wrow;
        if (fmt == '4') jobs[g].s = whole->s + g * R * (K / FP4_GROUP);
        if (fmt == '8') jobs[g].s = whole->s + (g * R / FP8_BLOCK) * ((K + FP8_BLOCK - 1) / FP8_BLOCK);
    }
    if (!rc && path == PATH_BF16 && T > dot_max(isa)) { /* each group's bf16 copy straight from the call's x */
        for (int64_t g = 0; g < G && !rc && path == PATH_BF16; g++, prepared++) {
            uint16_t *xb;
            const int r = tile_x_bf16(whole->x + g * K, T, K, G * K, &xb, &jobs[g].kp, &jobs[g].x_tiny);
            preps[g] = (prep_t){.job = &jobs[g], .buf = xb, .out = jobs[g].out, .T = T, .ldo = jobs[g].ldo,
                                .accumulate = jobs[g].accumulate};
            jobs[g].x = NULL, jobs[g].dot = 0, jobs[g].xp = NULL, jobs[g].xb = xb;
            rc = r < 0 ? -1 : 0;
            if (r == 0) path = PATH_FP32; /* some x is not exact: every group takes the FP32 tile path */
        }
        tiled = !rc && path == PATH_BF16;
        if (!rc && !tiled) {
            for (int64_t g = 0; g < prepared; g++) finish_job(&preps[g], 0);
            prepared = 0;
        }
    }
    if (!rc && path == PATH_BF16 && T <= dot_max(isa)) { /* each group's permuted copy straight from the call's x */
        const uint8_t *bmap = fmt == '4' ? isa->fp4_bmap : isa->fp8_bmap;
        for (int64_t g = 0; g < G && !rc; g++, prepared++) {
            uint16_t *xb = permute_x(isa, bmap, whole->x + g * K, T, K, G * K, &jobs[g].kp, 1);
            preps[g] = (prep_t){.job = &jobs[g], .buf = xb, .out = jobs[g].out, .T = T, .ldo = jobs[g].ldo,
                                .accumulate = jobs[g].accumulate};
            jobs[g].x = NULL, jobs[g].dot = 1, jobs[g].xp = NULL, jobs[g].xb = xb;
            rc = xb ? 0 : -1;
        }
        direct = 1;
    }
    if (!rc && !tiled && !direct) {
        xg = malloc((size_t)(T * G * K) * sizeof(float));
        rc = xg ? 0 : -1;
        for (int64_t g = 0; g < G && !rc; g++)
            for (int64_t t = 0; t < T; t++) memcpy(xg + (g * T + t) * K, whole->x + t * G * K + g * K, (size_t)K * sizeof(float));
        for (int64_t g = 0; g < G && !rc; g++, prepared++) {
            jobs[g].x = xg + g * T * K;
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

/* A product of resident weights (a layer's, the LM head's): one product (G = 1) or a grouped one, as a stream of
 * the weight readahead (readahead.c). job->K is the whole x's (G groups of K / G). Returns 0, or -1 for out of
 * memory. */
int weights_product(const isa_ops *isa, char fmt, mm_job *job, int64_t G) {
    if (job->K == 0 || job->T == 0 || job->N == 0) {
        empty_sum(job);
        return 0;
    }
    const size_t row = (size_t)(job->K / G), bytes = (size_t)job->N * (fmt == '4' ? row / 2 : fmt == '8' ? row : 2 * row);
    readahead_begin(job->w, bytes, 1);
    const int rc = G == 1 ? product(isa, fmt, job) : grouped_product(isa, fmt, job, G);
    readahead_end(job->w, bytes);
    return rc;
}
