/* The int8 copy of the LM head that screens greedy decoding: cheap integer logits of every row, from which the
 * caller (fastar/model/head_screen.py) bounds the exact logits and recomputes only the rows that could be the argmax.
 *
 * Owns:
 *   head_i8_build_run  the int8 copy of a bfloat16 weight [V, K], row by row: scale s = max|w| / 127 (float32),
 *                      q = round-half-even(w / s) clamped to [-127, 127], with the facts the screen's bound needs:
 *                      ||w|| and ||w - q s|| (float64, from the exact values), and sum q (head_i8.h's contract);
 *   head_i8_dot_run    out[t, i] = sum_k xq[t, k] q[i, k] in exact int32 arithmetic, four ways that give the same
 *                      integers: AVX-512 VNNI (vpdpbusd on x + 128 as unsigned bytes, less 128 sum q[i]), AVX2
 *                      (both sign-extended to 16 bits, vpmaddwd: no saturation), AArch64 SDOT (FEAT_DotProd) and
 *                      portable C (int32 sums the compiler vectorizes), picked from the ISA in use and the CPU;
 *   head_i8_screen_run head_i8_dot of the first int8 terms and head_i8_select's bounds in one pass, the second
 *                      terms' products only for the rows the first leaves open, each sub-block's right after its
 *                      products, from L2 (a running floor shared by the threads; head_i8.h's contract);
 *   gather_rows_run    out[j] = w[idx[j]] for byte rows (the candidates' bfloat16 rows for bf16_matmul).
 * Work goes to the pool in row chunks; each output is computed by one thread in an order fixed by nothing but its
 * row, so results do not depend on the thread count (they are exact integers anyway).
 * Does not own: argument checks and the GIL (bind_head_i8.c), the exact products of the candidates (bf16_matmul),
 * the screen's bounds and the quantization of x (head_screen.py).
 *
 * What binds the VNNI screen at 4-8 tokens (Zen 4, 2 shared vCPUs, docs/PERFORMANCE.md): vpdpbusd runs at 3.4-3.6 G a
 * second on a core (a register loop), the 4 x 4 block at 3.1-3.2 G from L3, the 4 x 2 passes of 4 tokens at 1.7 G; from
 * DRAM at 8 tokens the 66 M products take ~20 ms of one core against ~17 ms for the 0.53 GB, and the bounds' work
 * beside them ~11 % of the products' time. Tried for 4-8 tokens and dropped (scripts/head_screen_kernels_ab.py and
 * copies of head_i8_dot, weights from DRAM, CPU time per call, alternated in one process): one pass of 4 x 4 at 4
 * tokens and of 4 x 5 / 4 x 6 at 5-6 (24 accumulators), though 1.9x and 1.2-1.3x the rate from L3: 1.24x and 1.68x the
 * time (probably x of 4-6 tokens and a tile's 16 KB outgrowing the 32 KB L1; and one pass has no sub-block prefetch),
 * 1.13x and 1.25x with that prefetch; the weights in registers at 2 tokens (the passes of 4 and 6: 1.5x the rate from
 * L3, 1.15x the time from DRAM: probably the prefetch, spread over faster passes, outruns the memory); 2 rows x 4
 * tokens in one pass (1.07x with the prefetch, 1.8x without); passes of 3 + 3 at 6 tokens (1.06x) and 3 + 1 at 4
 * (1.28x); the 16 sums of a 4 x 4 block in a transpose-add tree (1.4x the time from L3: the compiler spilled around
 * it); the tile prefetched into L1 4-16 steps ahead (no gain), the sub-block prefetch into L1 or non-temporal
 * (1.8-2.1x) or unrolled by two (no change).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "head_i8.h"
#include "simd.h"

#if FASTAR_ARM64
#include <arm_neon.h>
#endif
#if FASTAR_X86
#include <immintrin.h>
#define TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma")))
#endif

#define DOT_TG 4       /* tokens per pass over the weights: 4 rows x 4 tokens, 16 accumulators */
#define BUILD_BLOCK 64   /* head_i8_build's columns per step (one tile column) */
#define SUB_BYTES 262144 /* rows per sub-block of a chunk: about this many weight bytes (L2-resident), so T > DOT_TG
                          * re-reads a sub-block from L2, not memory */

/* q's layout (head_i8.h): row r's columns [64 j, 64 j + 64) start at q_row(q, V, K, r) + j q_step(V, K, r). Rows in
 * whole groups of HEAD_I8_TILE_ROWS, where K % 64 == 0, are tiled (the group's rows side by side per 64 columns,
 * one sequential stream for a block of rows); the rest are plain rows. */
INLINE int q_tiled(int64_t V, int64_t K, int64_t r) {
    return K % HEAD_I8_K_ALIGN == 0 && r < V / HEAD_I8_TILE_ROWS * HEAD_I8_TILE_ROWS;
}
INLINE int64_t q_step(int64_t V, int64_t K, int64_t r) {
    return q_tiled(V, K, r) ? HEAD_I8_TILE_ROWS * HEAD_I8_K_ALIGN : HEAD_I8_K_ALIGN;
}
INLINE int64_t q_offset(int64_t V, int64_t K, int64_t r) {
    return q_tiled(V, K, r) ? r / HEAD_I8_TILE_ROWS * HEAD_I8_TILE_ROWS * K + r % HEAD_I8_TILE_ROWS * HEAD_I8_K_ALIGN
                            : r * K;
}

/* Rows [r0, r1) of a dot path against T tokens of X, R rows a block (R divides a tile's rows; r0 is a multiple of
 * them), U partial sums per (row, token): BLOCK(d, X, T, R, U, r, q, rs, cs, pf, pfs, out) for each block, its row
 * i's columns [64 j, 64 j + 64) at q + i rs + j cs, prefetching pfs bytes from pf + j pfs at column step j (the
 * caller's plan, pfs bytes a step for each tile's 4 rows, a multiple of 128: a block of R rows takes its R / 4 share
 * and pf moves on by it); the plain rows after the tiles one at a time (the caller's d, r0, r1, pf, pfs and out). */
#define ROW_BLOCKS(BLOCK, X, T, R, U)                                                                                  \
    {                                                                                                                  \
        const int64_t tiles = d->V / HEAD_I8_TILE_ROWS * HEAD_I8_TILE_ROWS, e = r1 < tiles ? r1 : tiles;               \
        const int64_t cs = HEAD_I8_TILE_ROWS * HEAD_I8_K_ALIGN, steps = d->K / HEAD_I8_K_ALIGN;                        \
        int64_t r = r0;                                                                                                \
        const int64_t share = pfs * (R) / HEAD_I8_TILE_ROWS;                                                           \
        for (; r < e; r += (R), pf = pf ? pf + share * steps : pf)                                                     \
            BLOCK(d, X, T, R, U, r, d->q + q_offset(d->V, d->K, r), HEAD_I8_K_ALIGN, cs, pf, share, out);              \
        for (; r < r1; r++) BLOCK(d, X, T, 1, U, r, d->q + r * d->K, d->K, HEAD_I8_K_ALIGN, NULL, 0, out);             \
    }                                                                                                                  \
    break;

/* The software prefetch of the next sub-block of rows into L2 (the caller's pf, pfs and column step j; see dot_chunk):
 * the hardware prefetcher does not run a sub-block ahead, and with the next one on its way the token groups' passes
 * over this one, from L2, overlap its reads. */
#define PREFETCH_STEP(pf, pfs, j)                                                                                      \
    if (pf)                                                                                                            \
        for (int64_t b = 0; b < (pfs); b += 64) __builtin_prefetch((pf) + (j) * (pfs) + b, 0, 2);

/* ---------------------------------------------------------------- build */

/* A row of zeros, its columns [64 j, 64 j + 64) at q + j cs. */
INLINE void zero_row(int8_t *q, int64_t K, int64_t cs) {
    for (int64_t k0 = 0; k0 < K; k0 += BUILD_BLOCK)
        memset(q + k0 / BUILD_BLOCK * cs, 0, K - k0 < BUILD_BLOCK ? (size_t)(K - k0) : BUILD_BLOCK);
}

/* One row (its columns [64 j, 64 j + 64) written at q + j cs): the contract in head_i8.h. The float32 steps run in
 * the default floating-point environment (the chunk function sets it on x86-64: no flush of subnormals, round to
 * nearest), as numpy's twin computes them. */
INLINE void build_row(const uint16_t *w, int64_t K, int8_t *q, int64_t cs, float *scale, double *wnorm,
                      double *dnorm, int32_t *rowsum) {
    int16_t amax = 0; /* max |w| as bits: the order of non-negative bfloat16 bit patterns is their values' (NaN and
                       * infinity above every finite value) */
    for (int64_t k = 0; k < K; k++) {
        const int16_t a = (int16_t)(w[k] & 0x7fff);
        amax = a > amax ? a : amax;
    }
    if (amax >= 0x7f80) { /* an infinity or NaN: the row is always recomputed exactly */
        zero_row(q, K, cs);
        *scale = 0.0f, *wnorm = *dnorm = INFINITY, *rowsum = 0;
        return;
    }
    if (amax == 0) {
        zero_row(q, K, cs);
        *scale = 0.0f, *wnorm = *dnorm = 0.0, *rowsum = 0;
        return;
    }
    union {
        uint32_t u;
        float f;
    } am = {.u = (uint32_t)amax << 16};
    const float s = am.f / 127.0f;
    const float magic = 12582912.0f; /* 1.5 * 2^23: v + magic - magic rounds |v| <= 2^22 half to even */
    const double sd = s;
    /* 8 interleaved partial sums (vectorized), added pairwise at the end: every term is exact in float64 (w^2, and
     * w - q s, a multiple of s's last bit below s in size), only the additions round */
    double ws[8] = {0}, ds[8] = {0};
    int32_t sum = 0;
    for (int64_t k0 = 0; k0 < K; k0 += BUILD_BLOCK) {
        const int n = K - k0 < BUILD_BLOCK ? (int)(K - k0) : BUILD_BLOCK;
        int8_t *qk = q + k0 / BUILD_BLOCK * cs;
        float wf[BUILD_BLOCK], qf[BUILD_BLOCK];
        for (int i = 0; i < n; i++) {
            union {
                uint32_t u;
                float f;
            } x = {.u = (uint32_t)w[k0 + i] << 16};
            /* |w / s| < 128 (s is amax / 127 within 2^-9 even where it is subnormal), so rounding first and
             * clamping the integer gives round(clamp(w / s)) */
            int32_t qi = (int32_t)((x.f / s + magic) - magic);
            qi = qi < -127 ? -127 : qi > 127 ? 127 : qi;
            qk[i] = (int8_t)qi;
            sum += qi;
            wf[i] = x.f, qf[i] = (float)qi;
        }
        for (int i = n; i < BUILD_BLOCK; i++) wf[i] = qf[i] = 0.0f; /* a ragged end adds zeros */
        for (int j = 0; j < BUILD_BLOCK; j += 8)
            for (int i = 0; i < 8; i++) {
                const double wd = wf[j + i], d = wd - (double)qf[j + i] * sd;
                ws[i] += wd * wd, ds[i] += d * d;
            }
    }
    for (int h = 4; h; h /= 2)
        for (int i = 0; i < h; i++) ws[i] += ws[i + h], ds[i] += ds[i + h];
    *scale = s, *wnorm = sqrt(ws[0]), *dnorm = sqrt(ds[0]), *rowsum = sum;
}

/* The rows of a chunk, for each target: the plain body inlined into a wider one gives wider vectors with the same
 * IEEE arithmetic (q, scale, wnorm and rowsum the same bits; dnorm within its float64 rounding, as a*b+c may fuse). */
#define BUILD_ROWS(NAME, ATTR)                                                                                     \
    ATTR static void NAME(const head_build *b, int64_t r0, int64_t r1) {                                           \
        for (int64_t r = r0; r < r1; r++)                                                                          \
            build_row(b->w + r * b->K, b->K, b->q + q_offset(b->V, b->K, r), q_step(b->V, b->K, r), b->scale + r,  \
                      b->wnorm + r, b->dnorm + r, b->rowsum + r);                                                  \
    }
BUILD_ROWS(build_rows_plain, )
#if FASTAR_X86
BUILD_ROWS(build_rows_avx2, __attribute__((target("avx2,fma"))))
BUILD_ROWS(build_rows_avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"))))
#endif

typedef struct {
    const head_build *b;
    int64_t rows; /* per chunk */
    isa_vec vec;  /* which copy of the rows */
} build_ctx;

static void build_chunk(void *p, int64_t i) {
    const build_ctx *c = p;
    const int64_t r0 = i * c->rows, r1 = r0 + c->rows < c->b->V ? r0 + c->rows : c->b->V;
#if FASTAR_X86
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(0x1f80); /* IEEE defaults: subnormal weights and scales are values, not zeros */
    if (c->vec == VEC_AVX512)
        build_rows_avx512(c->b, r0, r1);
    else if (c->vec == VEC_AVX2)
        build_rows_avx2(c->b, r0, r1);
    else
        build_rows_plain(c->b, r0, r1);
    _mm_setcsr(csr);
#else
    build_rows_plain(c->b, r0, r1);
#endif
}

void head_i8_build_run(const isa_ops *isa, const head_build *b) {
    if (b->V <= 0) return;
    const int64_t bytes = b->K > 0 ? 2 * b->K : 1;
    build_ctx c = {.b = b, .rows = (SUB_BYTES + bytes - 1) / bytes, .vec = isa->vec};
    pool_run((b->V + c.rows - 1) / c.rows, build_chunk, &c);
}

/* ---------------------------------------------------------------- dot: portable */

/* Rows [r0, r1) against tokens [0, T) of x (T <= DOT_TG). int32 sums cannot overflow: |sum| <= 128^2 K < 2^31. */
static void dot_rows_plain(const head_dot *d, const int8_t *x, int T, int64_t r0, int64_t r1, const int8_t *pf,
                           int64_t pfs, int32_t *out) {
    (void)pf, (void)pfs; /* the portable loop reads too slowly for the prefetch to matter */
    const int64_t K = d->K;
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *qr = d->q + q_offset(d->V, K, r);
        const int64_t cs = q_step(d->V, K, r);
        for (int t = 0; t < T; t++) {
            const int8_t *xt = x + t * K;
            int32_t s = 0;
            for (int64_t c = 0, j = 0; c < K; c += HEAD_I8_K_ALIGN, j++)
                for (int k = 0; k < HEAD_I8_K_ALIGN; k++) s += (int32_t)xt[c + k] * (int32_t)qr[j * cs + k];
            out[t * d->V + r] = s;
        }
    }
}

/* ---------------------------------------------------------------- dot: AVX2 */

#if FASTAR_X86
/* Rows [r, r + R) against T tokens of x16 (x as int16, interleaved: see head_i8_dot_run), row i's columns
 * [64 j, 64 j + 64) at q + i rs + j cs, U partial sums per (row, token) (the four 16-column loads of a step in turn),
 * each x load shared by the R rows: each 16 weight bytes sign-extended once, multiplied with vpmaddwd (pairs of int16
 * products summed into int32: at most 2 * 128^2, no saturation) for every token. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
dot_rows_block_avx2(const head_dot *d, const int16_t *x16, const int T, const int R, const int U, int64_t r,
                    const int8_t *q, int64_t rs, int64_t cs, const int8_t *pf, int64_t pfs, int32_t *out) {
    __m256i acc[4][2][DOT_TG];
    UNROLL for (int i = 0; i < R; i++) UNROLL for (int u = 0; u < U; u++) UNROLL for (int t = 0; t < T; t++)
        acc[i][u][t] = _mm256_setzero_si256();
    for (int64_t c = 0, j = 0; c < d->K; c += 64, j++) { /* K % 64 == 0: whole steps */
        PREFETCH_STEP(pf, pfs, j)
        UNROLL for (int h = 0; h < 4; h++) {
            __m256i w[4];
            UNROLL for (int i = 0; i < R; i++)
                w[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + i * rs + j * cs + 16 * h)));
            UNROLL for (int t = 0; t < T; t++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x16 + (c + 16 * h) * T + 16 * t));
                UNROLL for (int i = 0; i < R; i++)
                    acc[i][h % U][t] = _mm256_add_epi32(acc[i][h % U][t], _mm256_madd_epi16(xv, w[i]));
            }
        }
    }
    UNROLL for (int i = 0; i < R; i++) UNROLL for (int t = 0; t < T; t++) {
        const __m256i a = U == 2 ? _mm256_add_epi32(acc[i][0][t], acc[i][1][t]) : acc[i][0][t];
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
        out[t * d->V + r + i] = _mm_cvtsi128_si32(s);
    }
}


/* Rows and partial sums per block within 16 registers: a tile's four rows (one sequential stream) up to 2 tokens, two
 * rows at 3 and 4. */
__attribute__((target("avx2,fma"))) static void dot_rows_avx2(const head_dot *d, const int16_t *x16, int T, int64_t r0,
                                                             int64_t r1, const int8_t *pf, int64_t pfs,
                                                             int32_t *out) {
    switch (T) {
        case 1: ROW_BLOCKS(dot_rows_block_avx2, x16, 1, 4, 2)
        case 2: ROW_BLOCKS(dot_rows_block_avx2, x16, 2, 4, 1)
        case 3: ROW_BLOCKS(dot_rows_block_avx2, x16, 3, 2, 1)
        default: ROW_BLOCKS(dot_rows_block_avx2, x16, 4, 2, 1)
    }
}

/* ---------------------------------------------------------------- dot: AVX-512 VNNI */

/* Rows [r, r + R) against T tokens of xu (x + 128 as unsigned bytes, interleaved: see head_i8_dot_run), row i's
 * columns [64 j, 64 j + 64) at q + i rs + j cs, each x load shared by the R rows: vpdpbusd adds four (x + 128) q
 * products per lane, each at most 255 * 128 in size; the int32 lanes wrap modulo 2^32 (vpdpbusd, unlike vpdpbusds,
 * does not saturate), so sum (x + 128) q - 128 sum q, the exact sum x q, comes out exact since it fits in int32. A
 * tile's rows stream in address order, which the hardware prefetcher follows. */
TARGET_VNNI static inline __attribute__((always_inline)) void dot_rows_block_vnni(const head_dot *d, const uint8_t *xu,
                                                                                 const int T, const int R,
                                                                                 const int U, int64_t r,
                                                                                 const int8_t *q, int64_t rs,
                                                                                 int64_t cs, const int8_t *pf,
                                                                                 int64_t pfs, int32_t *out) {
    (void)U;
    __m512i acc[4][DOT_TG];
    UNROLL for (int i = 0; i < R; i++) UNROLL for (int t = 0; t < T; t++) acc[i][t] = _mm512_setzero_si512();
    for (int64_t c = 0, j = 0; c < d->K; c += 64, j++) {
        PREFETCH_STEP(pf, pfs, j)
        __m512i w[4];
        UNROLL for (int i = 0; i < R; i++) w[i] = _mm512_loadu_si512((const void *)(q + i * rs + j * cs));
        /* 3 tokens: the step's weights held in registers (an empty asm that claims to change them), where the
         * compiler would fold a load into every vpdpbusd (15 loads a step for 12 products, not 7): from L3 3.1 against
         * 1.7 G products/s; head_i8_screen at 3 and 7 rows (4 + 3 tokens) 0.81-0.92x and 0.85-0.97x the CPU time
         * (docs/PERFORMANCE.md). At 2 tokens (the passes of 4 and 6) the same doubled the rate from L3 but took
         * 1.15x the time from DRAM; at 1 each weight feeds one product. */
        if (T == 3) UNROLL for (int i = 0; i < R; i++) __asm__("" : "+v"(w[i]));
        UNROLL for (int t = 0; t < T; t++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(xu + c * T + 64 * t));
            UNROLL for (int i = 0; i < R; i++) acc[i][t] = _mm512_dpbusd_epi32(acc[i][t], xv, w[i]);
        }
    }
    UNROLL for (int i = 0; i < R; i++) {
        const uint32_t off = 128u * (uint32_t)d->rowsum[r + i];
        UNROLL for (int t = 0; t < T; t++)
            out[t * d->V + r + i] = (int32_t)((uint32_t)_mm512_reduce_add_epi32(acc[i][t]) - off);
    }
}


/* A tile's four rows a block, at most 4 x 4 accumulators. The tiles replaced plain rows read two or four side by side
 * (separate 4 KiB pages in turn at K = 4096), which streamed well below the read bandwidth: on Zen 4, two threads,
 * from DRAM, T = 4 in 14-15 ms against 18-22 ms, and T = 8 (two passes, the second from L2) in 20-21 ms against
 * 24-33 ms (docs/PERFORMANCE.md). */
TARGET_VNNI static void dot_rows_vnni(const head_dot *d, const uint8_t *xu, int T, int64_t r0, int64_t r1,
                                      const int8_t *pf, int64_t pfs, int32_t *out) {
    switch (T) {
        case 1: ROW_BLOCKS(dot_rows_block_vnni, xu, 1, 4, 1)
        case 2: ROW_BLOCKS(dot_rows_block_vnni, xu, 2, 4, 1)
        case 3: ROW_BLOCKS(dot_rows_block_vnni, xu, 3, 4, 1)
        default: ROW_BLOCKS(dot_rows_block_vnni, xu, 4, 4, 1)
    }
}
#endif

/* ---------------------------------------------------------------- dot: AArch64 SDOT */

#if FASTAR_ARM64
/* SDOT (vdotq_s32: acc[i] += the four products a[4i + j] b[4i + j], int8 x int8 -> int32, exact) needs FEAT_DotProd:
 * these functions are compiled for it (already so where the build's baseline has it, as Apple's), and head_i8_path
 * takes this path only where the CPU reports it. */
#if defined(__ARM_FEATURE_DOTPROD)
#define TARGET_DOTPROD
#elif defined(__clang__)
#define TARGET_DOTPROD __attribute__((target("dotprod")))
#else
#define TARGET_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#endif

/* Rows [r, r + R) against T tokens of xi (x as int8, interleaved by 64 columns: see head_i8_dot_run), row i's
 * columns [64 j, 64 j + 64) at q + i rs + j cs, P partial sums per (row, token) (independent chains for few tokens):
 * each 64 weight bytes of a row loaded once for all tokens, each x load shared by the R rows. Every sum is exact:
 * |sum| <= 128^2 K < 2^31. */
TARGET_DOTPROD INLINE void dot_rows_block_sdot(const head_dot *d, const int8_t *xi, const int T, const int R,
                                               const int P, int64_t r, const int8_t *q, int64_t rs, int64_t cs,
                                               const int8_t *pf, int64_t pfs, int32_t *out) {
    int32x4_t acc[4][2][DOT_TG];
    UNROLL for (int i = 0; i < R; i++) UNROLL for (int p = 0; p < P; p++) UNROLL for (int t = 0; t < T; t++)
        acc[i][p][t] = vdupq_n_s32(0);
    for (int64_t c = 0, j = 0; c < d->K; c += 64, j++) {
        PREFETCH_STEP(pf, pfs, j)
        int8x16_t w[4][4];
        UNROLL for (int i = 0; i < R; i++) UNROLL for (int h = 0; h < 4; h++)
            w[i][h] = vld1q_s8(q + i * rs + j * cs + 16 * h);
        UNROLL for (int t = 0; t < T; t++) UNROLL for (int h = 0; h < 4; h++) {
            const int8x16_t xv = vld1q_s8(xi + c * T + 64 * t + 16 * h);
            UNROLL for (int i = 0; i < R; i++) acc[i][h % P][t] = vdotq_s32(acc[i][h % P][t], xv, w[i][h]);
        }
    }
    UNROLL for (int i = 0; i < R; i++) UNROLL for (int t = 0; t < T; t++)
        out[t * d->V + r + i] = vaddvq_s32(P == 2 ? vaddq_s32(acc[i][0][t], acc[i][1][t]) : acc[i][0][t]);
}


/* Within 32 registers: a tile's four rows (16 weight registers) up to 2 tokens, two rows with two partial sums at 3,
 * two rows at 4. */
TARGET_DOTPROD static void dot_rows_sdot(const head_dot *d, const int8_t *xi, int T, int64_t r0, int64_t r1,
                                         const int8_t *pf, int64_t pfs, int32_t *out) {
    switch (T) {
        case 1: ROW_BLOCKS(dot_rows_block_sdot, xi, 1, 4, 1)
        case 2: ROW_BLOCKS(dot_rows_block_sdot, xi, 2, 4, 1)
        case 3: ROW_BLOCKS(dot_rows_block_sdot, xi, 3, 2, 2)
        default: ROW_BLOCKS(dot_rows_block_sdot, xi, 4, 2, 1)
    }
}
#endif

/* ---------------------------------------------------------------- dot: driver */

int head_i8_path(const isa_ops *isa) {
#if FASTAR_X86
    static int vnni = -1; /* the CPUID answer, asked once (a benign race: every thread writes the same) */
    if (vnni < 0) vnni = cpu_has("avx512vnni");
    if (isa->vec == VEC_AVX512 && vnni) return HEAD_PATH_VNNI;
    if (isa->vec == VEC_AVX512 || isa->vec == VEC_AVX2) return HEAD_PATH_AVX2;
#endif
#if FASTAR_ARM64
    static int dotprod = -1; /* asked once, as above */
    if (dotprod < 0) dotprod = cpu_has("dotprod");
    if (isa->vec == VEC_NEON && dotprod) return HEAD_PATH_SDOT;
#endif
    (void)isa;
    return HEAD_PATH_PORTABLE;
}

const char *head_i8_path_name(int path) {
    return path == HEAD_PATH_VNNI ? "avx512vnni"
           : path == HEAD_PATH_AVX2 ? "avx2"
           : path == HEAD_PATH_SDOT ? "neon-dotprod"
                                    : "portable";
}

typedef struct screen_ctx screen_ctx;
static void screen_rows(const screen_ctx *sc, int64_t r0, int64_t r1);

typedef struct {
    const head_dot *d;
    const void *xc; /* x as the path wants it: int8 (portable, SDOT), int16 (AVX2), x + 128 as uint8 (VNNI) */
    int path;
    int64_t rows, sub;     /* rows per chunk, per sub-block */
    int64_t tg;            /* tokens per pass (at most DOT_TG) */
    const screen_ctx *scr; /* head_i8_screen: its bounds of each sub-block's rows once their products are done */
} dot_ctx;

static void dot_chunk(void *p, int64_t i) {
    const dot_ctx *c = p;
    const head_dot *d = c->d;
    const int64_t r0 = i * c->rows, r1 = r0 + c->rows < d->V ? r0 + c->rows : d->V;
    const int64_t steps = d->K / HEAD_I8_K_ALIGN, passes = (d->T + c->tg - 1) / c->tg;
    for (int64_t s0 = r0; s0 < r1; s0 += c->sub) { /* a sub-block stays in L2 while every token group passes */
        const int64_t s1 = s0 + c->sub < r1 ? s0 + c->sub : r1, s2 = s1 + c->sub < r1 ? s1 + c->sub : r1;
        /* more than one pass (T > DOT_TG): the next sub-block's bytes, rows [s1, s2) (tiles and plain rows alike lie
         * in row order), prefetched into L2 across every pass's tiles, pfs bytes a column step for each, a multiple
         * of 128 (ROW_BLOCKS), so that its reads overlap this one's passes. Measured (scripts/head_i8_bench.py, 2
         * threads, 35 GB/s): 8 tokens 17.1-17.4 ms against 19.8-20.7 without, 16 tokens 21.4-22.8 against
         * 28.8-30.0; at 1-2 tokens (one pass, read at the probe's bandwidth already) it was 5-10 % slower. */
        const int64_t blocks = (s1 - s0 + HEAD_I8_TILE_ROWS - 1) / HEAD_I8_TILE_ROWS;
        const int64_t per = ((s2 - s1) * d->K + passes * blocks - 1) / (passes * blocks);
        const int64_t pfs = (per + 128 * steps - 1) / (128 * steps) * 128;
        for (int64_t t0 = 0; t0 < d->T; t0 += c->tg) {
            const int T = (int)(d->T - t0 < c->tg ? d->T - t0 : c->tg);
            int32_t *out = d->out + t0 * d->V;
            const int8_t *pf = passes > 1 && s2 > s1 ? d->q + s1 * d->K + t0 / c->tg * blocks * pfs * steps : NULL;
#if FASTAR_X86
            if (c->path == HEAD_PATH_VNNI) {
                dot_rows_vnni(d, (const uint8_t *)c->xc + t0 * d->K, T, s0, s1, pf, pfs, out);
                continue;
            }
            if (c->path == HEAD_PATH_AVX2) {
                dot_rows_avx2(d, (const int16_t *)c->xc + t0 * d->K, T, s0, s1, pf, pfs, out);
                continue;
            }
#endif
#if FASTAR_ARM64
            if (c->path == HEAD_PATH_SDOT) {
                dot_rows_sdot(d, (const int8_t *)c->xc + t0 * d->K, T, s0, s1, pf, pfs, out);
                continue;
            }
#endif
            dot_rows_plain(d, (const int8_t *)c->xc + t0 * d->K, T, s0, s1, pf, pfs, out);
        }
        if (c->scr) screen_rows(c->scr, s0, s1); /* the sub-block's rows are still in L2 */
    }
}

/* head_i8_dot_run, and with scr the screen's bounds of each sub-block after its products. */
static int dot_run(const isa_ops *isa, const head_dot *d, const screen_ctx *scr) {
    if (d->T <= 0 || d->V <= 0) return 0;
    if (d->K == 0) {
        memset(d->out, 0, (size_t)(d->T * d->V) * sizeof(int32_t));
        if (scr) screen_rows(scr, 0, d->V);
        return 0;
    }
    const int path = head_i8_path(isa);
    /* x in the path's type, each group of DOT_TG tokens (at t0 * K) interleaved by column steps of cw (64 bytes for
     * VNNI and SDOT, 16 values for AVX2): step j of the group's token t at (j * Tg + t) * cw. Token rows K apart
     * would share L1 sets (K = 4096: every token's bytes of a step in one set, with the weights' line). */
    const int64_t cw = path == HEAD_PATH_AVX2 ? 16 : 64;
    /* 4 tokens in two passes of 2 (each 4 rows x 2 tokens a block), not one of 4: measured 0.87-0.88x the time in
     * paired runs on Zen 4 (2 threads, scripts/head_i8_bench.py's shape), where 3, 6 and 8 tokens are 1.1-1.8x slower
     * in passes of 2 */
    const int64_t tg = d->T == 4 ? 2 : DOT_TG;
    void *buf = NULL;
    if (path != HEAD_PATH_PORTABLE) {
        /* 64-byte aligned: a vector load of x never straddles two cache lines (T K is a multiple of 64) */
        buf = aligned_alloc(64, (size_t)(d->T * d->K) * (path == HEAD_PATH_AVX2 ? 2 : 1));
        if (!buf) return -1;
        for (int64_t t0 = 0; t0 < d->T; t0 += tg) {
            const int64_t Tg = d->T - t0 < tg ? d->T - t0 : tg;
            for (int64_t t = t0; t < t0 + Tg; t++)
                for (int64_t c = 0; c < d->K; c += cw) {
                    const int8_t *src = d->x + t * d->K + c;
                    const int64_t at = t0 * d->K + c * Tg + (t - t0) * cw;
                    if (path == HEAD_PATH_VNNI)
                        for (int64_t k = 0; k < cw; k++) ((uint8_t *)buf)[at + k] = (uint8_t)((uint8_t)src[k] ^ 0x80);
                    else if (path == HEAD_PATH_SDOT)
                        memcpy((int8_t *)buf + at, src, (size_t)cw);
                    else
                        for (int64_t k = 0; k < cw; k++) ((int16_t *)buf)[at + k] = src[k];
                }
        }
    }
    dot_ctx c = {.d = d, .xc = buf ? buf : (const void *)d->x, .path = path, .scr = scr, .tg = tg};
    c.sub = SUB_BYTES / d->K < 8 ? 8 : SUB_BYTES / d->K / 8 * 8;
    const int64_t target = 8 * (int64_t)pool_get_threads(); /* chunks: about 8 per thread, whole sub-blocks */
    const int64_t subs = (d->V + c.sub - 1) / c.sub;
    c.rows = ((subs + target - 1) / target) * c.sub;
    pool_run((d->V + c.rows - 1) / c.rows, dot_chunk, &c);
    free(buf);
    return 0;
}

int head_i8_dot_run(const isa_ops *isa, const head_dot *d) { return dot_run(isa, d, NULL); }

/* ---------------------------------------------------------------- gather */

typedef struct {
    const uint8_t *w;
    const int64_t *idx;
    uint8_t *out;
    int64_t U, row_bytes, rows;
} gather_ctx;

static void gather_chunk(void *p, int64_t i) {
    const gather_ctx *c = p;
    const int64_t j0 = i * c->rows, j1 = j0 + c->rows < c->U ? j0 + c->rows : c->U;
    for (int64_t j = j0; j < j1; j++)
        memcpy(c->out + j * c->row_bytes, c->w + c->idx[j] * c->row_bytes, (size_t)c->row_bytes);
}

void gather_rows_run(const void *w, int64_t row_bytes, const int64_t *idx, int64_t U, void *out) {
    if (U <= 0 || row_bytes <= 0) return;
    gather_ctx c = {.w = w, .idx = idx, .out = out, .U = U, .row_bytes = row_bytes};
    c.rows = 65536 / row_bytes < 1 ? 1 : 65536 / row_bytes; /* about 64 KiB per chunk: a few rows stay on one thread */
    pool_run((U + c.rows - 1) / c.rows, gather_chunk, &c);
}

/* ---------------------------------------------------------------- select */

/* The estimate and bound of head row i for one decode row (head_i8.h's order of operations), shifted by its offset
 * where has_off (a compile-time constant in each copy of select_core: without offsets the loop reads none). */
#define SELECT_BOUND(i)                                                                                             \
    const float a1 = (float)d1[i] * (s1 * scale[i]), a2 = (float)d2[i] * (s2 * scale[i]);                           \
    float est = a1 + a2, mag = fabsf(a1) + fabsf(a2);                                                               \
    if (has_off) est += offt[i], mag += fabsf(offt[i]);                                                             \
    float b = c1 * wnorm[i] + c2 * dnorm[i];                                                                        \
    b += mag * margin;

static inline __attribute__((always_inline)) int64_t select_core(const head_select *s, const int has_off) {
    const int64_t V = s->V;
    uint8_t *restrict keep = s->keep;
    const float *restrict scale = s->scale, *restrict wnorm = s->wnorm, *restrict dnorm = s->dnorm;
    const float margin = s->margin;
    memset(keep, 0, (size_t)V);
    for (int64_t t = 0; t < s->T; t++) {
        const int32_t *restrict d1 = s->dots + t * V, *restrict d2 = s->dots + (s->T + t) * V;
        const float *restrict offt = has_off ? s->off + t * V : NULL;
        const float s1 = s->sx[t], s2 = s->sx[s->T + t], c1 = s->c1[t], c2 = s->c2[t];
        float lanes[16]; /* the largest lower bound, lane by lane: a loop the compiler vectorizes */
        for (int j = 0; j < 16; j++) lanes[j] = -INFINITY;
        int64_t i = 0;
        for (; i + 16 <= V; i += 16)
            for (int j = 0; j < 16; j++) {
                SELECT_BOUND(i + j)
                const float lo = est - b;
                lanes[j] = lo > lanes[j] ? lo : lanes[j];
            }
        for (; i < V; i++) {
            SELECT_BOUND(i)
            const float lo = est - b;
            lanes[0] = lo > lanes[0] ? lo : lanes[0];
        }
        float floor = -INFINITY;
        for (int j = 0; j < 16; j++) floor = lanes[j] > floor ? lanes[j] : floor;
        for (i = 0; i < V; i++) {
            SELECT_BOUND(i)
            keep[i] |= (uint8_t)(est + b >= floor);
        }
    }
    int64_t n = 0;
    for (int64_t i = 0; i < V; i++)
        if (keep[i]) s->rows[n++] = i;
    return n;
}

static int64_t select_plain(const head_select *s) { return s->off ? select_core(s, 1) : select_core(s, 0); }
#if FASTAR_X86
TARGET_AVX2 static int64_t select_avx2(const head_select *s) { return s->off ? select_core(s, 1) : select_core(s, 0); }
TARGET_AVX512 static int64_t select_avx512(const head_select *s) {
    return s->off ? select_core(s, 1) : select_core(s, 0);
}
#endif

int64_t head_i8_select_run(const isa_ops *isa, const head_select *s) {
#if FASTAR_X86
    if (isa->vec == VEC_AVX512) return select_avx512(s);
    if (isa->vec == VEC_AVX2) return select_avx2(s);
#endif
    (void)isa;
    return select_plain(s);
}

/* ---------------------------------------------------------------- screen */

struct screen_ctx {
    const head_screen *s;
    int vnni;            /* the second terms' products with vpdpbusd (x2u), else portable C */
    const uint8_t *x2u;  /* VNNI: the second terms + 128 as bytes, [T, K] */
    _Atomic float *floor; /* [T]: the largest lower bound so far, each decode row's */
    void (*rows_fn)(const screen_ctx *, int64_t, int64_t); /* screen_core compiled for the ISA in use */
};

/* x . q[r] for one int8 row x of K columns (K % 64 == 0), q's row r at q + j cs for columns [64 j, 64 j + 64): exact
 * int32 (as head_i8_dot). */
static int32_t dot_row_plain(const int8_t *q, int64_t cs, const int8_t *x, int64_t K) {
    int32_t s = 0;
    for (int64_t c = 0, j = 0; c < K; c += HEAD_I8_K_ALIGN, j++)
        for (int k = 0; k < HEAD_I8_K_ALIGN; k++) s += (int32_t)x[c + k] * (int32_t)q[j * cs + k];
    return s;
}

#if FASTAR_X86
/* The same with vpdpbusd on xu = x + 128 (four chains, from L2: 64 products at K = 4096 bound by their latency in
 * two), less 128 sum q (dot_rows_block_vnni's arithmetic). */
TARGET_VNNI static int32_t dot_row_vnni(const int8_t *q, int64_t cs, const uint8_t *xu, int64_t K, int32_t rowsum) {
    __m512i a[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    const int64_t steps = K / HEAD_I8_K_ALIGN;
    int64_t j = 0;
    for (; j + 3 < steps; j += 4)
        UNROLL for (int u = 0; u < 4; u++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(xu + 64 * (j + u)));
            a[u] = _mm512_dpbusd_epi32(a[u], xv, _mm512_loadu_si512((const void *)(q + (j + u) * cs)));
        }
    for (; j < steps; j++)
        a[0] = _mm512_dpbusd_epi32(a[0], _mm512_loadu_si512((const void *)(xu + 64 * j)),
                                   _mm512_loadu_si512((const void *)(q + j * cs)));
    const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(a[0], a[1]), _mm512_add_epi32(a[2], a[3]));
    return (int32_t)((uint32_t)_mm512_reduce_add_epi32(sum) - 128u * (uint32_t)rowsum);
}
#endif

/* Raise the shared floor f to at least v. */
static void floor_raise(_Atomic float *f, float v) {
    float cur = atomic_load_explicit(f, memory_order_relaxed);
    while (v > cur && !atomic_compare_exchange_weak_explicit(f, &cur, v, memory_order_relaxed, memory_order_relaxed)) {
    }
}

/* The second term's bound folded into row i's (hi, lo) for decode row t (head_i8.h's order of operations). */
static inline __attribute__((always_inline)) void second_term(const screen_ctx *sc, int64_t t, int64_t i, float a1,
                                                               float o, float *hi, float *lo) {
    const head_screen *s = sc->s;
    const int64_t V = s->V, K = s->K;
    const int8_t *qr = s->q + q_offset(V, K, i);
    const int64_t cs = q_step(V, K, i);
    int32_t d2;
#if FASTAR_X86
    if (sc->vnni)
        d2 = dot_row_vnni(qr, cs, sc->x2u + t * K, K, s->rowsum[i]);
    else
#endif
        d2 = dot_row_plain(qr, cs, s->x + (s->T + t) * K, K);
    const float a2 = (float)d2 * (s->sx[s->T + t] * s->scale[i]);
    const float est = (a1 + a2) + o; /* o = 0 (no offsets): the sum's own bits */
    float b2 = s->c[4 * t + 2] * s->wnorm[i] + s->c[4 * t + 3] * s->dnorm[i];
    b2 += ((fabsf(a1) + fabsf(a2)) + fabsf(o)) * s->margin;
    const float hi2 = est + b2, lo2 = est - b2;
    *hi = hi2 < *hi ? hi2 : *hi;
    *lo = lo2 > *lo ? lo2 : *lo;
}

#define SCREEN_LANES 16

/* A float that is not NaN as an int32 in the same order (-0 below +0), and back: the floor's maximum as an integer
 * maximum, a reduction the compiler vectorizes (a float maximum it keeps in order). */
static inline __attribute__((always_inline)) int32_t float_key(float v) {
    int32_t i;
    memcpy(&i, &v, sizeof i);
    return i ^ (int32_t)((uint32_t)(i >> 31) >> 1);
}
static inline __attribute__((always_inline)) float key_float(int32_t k) {
    const int32_t i = k ^ (int32_t)((uint32_t)(k >> 31) >> 1);
    float v;
    memcpy(&v, &i, sizeof v);
    return v;
}

/* One group of N rows from i0 (screen_core's loop): the first term's bounds into ub, the second term's where the upper
 * bound reaches the floor as of the group's start, and the floor raised to the group's largest lower bound. That
 * largest is the first terms' (a NaN read as -inf: the maximum ignores it, as `lo > fl` does) in one vector pass,
 * then each second term's in turn: the same value as over the rows' final lower bounds one by one (a sign of zero
 * apart, which no comparison sees). The float maximum row by row, the two-chain second terms and the keep loop a byte
 * at a time had taken ~11 % of the products' time at 8 tokens; with this group, dot_row_vnni's four chains and
 * keep_core: head_i8_screen at 2, 4, 6, 8 rows 0.99, 0.99, 0.98, 0.97x the CPU time on one thread (0.98-0.99x on
 * two; scripts/head_screen_kernels_ab.py's shape). */
#define SCREEN_GROUP(N)                                                                                              \
    {                                                                                                                \
        const int n = (N);                                                                                           \
        float a1[SCREEN_LANES], hi[SCREEN_LANES], lo[SCREEN_LANES];                                                  \
        int open = 0;                                                                                                \
        int32_t top = float_key(-INFINITY);                                                                          \
        for (int j = 0; j < n; j++) {                                                                                \
            const int64_t i = i0 + j;                                                                                \
            a1[j] = (float)d1s[i] * (s1 * scale[i]);                                                                 \
            float b1 = ca1 * wnorm[i] + ca2 * dnorm[i], e1 = a1[j], mag = fabsf(a1[j]);                              \
            if (has_off) e1 += offt[i], mag += fabsf(offt[i]);                                                       \
            b1 += mag * margin;                                                                                      \
            hi[j] = e1 + b1, lo[j] = e1 - b1;                                                                        \
            open |= hi[j] >= fl;                                                                                     \
            const int32_t k = float_key(lo[j] > -INFINITY ? lo[j] : -INFINITY);                                      \
            top = k > top ? k : top;                                                                                 \
            ub[i] = hi[j];                                                                                           \
        }                                                                                                            \
        float best = key_float(top);                                                                                 \
        if (open)                                                                                                    \
            for (int j = 0; j < n; j++)                                                                              \
                if (hi[j] >= fl) {                                                                                   \
                    second_term(sc, t, i0 + j, a1[j], has_off ? offt[i0 + j] : 0.0f, &hi[j], &lo[j]);                \
                    ub[i0 + j] = hi[j];                                                                              \
                    best = lo[j] > best ? lo[j] : best;                                                              \
                }                                                                                                    \
        fl = best > fl ? best : fl;                                                                                  \
    }

/* Rows [r0, r1) once their first terms' products are in ub (as int32): each row's bounds (head_i8.h), the second
 * term's product only where ub1 reaches the floor so far; ub gets min(ub1, ub2) there, ub1 elsewhere. The first
 * term's bounds of SCREEN_LANES rows at a time in a loop the compiler vectorizes, the floor as of the group's start
 * (any floor reached so far is sound: a stale one only takes more second terms). */
static inline __attribute__((always_inline)) void screen_core(const screen_ctx *sc, int64_t r0, int64_t r1,
                                                               const int has_off) {
    const head_screen *s = sc->s;
    const int64_t T = s->T, V = s->V;
    const float margin = s->margin;
    const float *restrict scale = s->scale, *restrict wnorm = s->wnorm, *restrict dnorm = s->dnorm;
    for (int64_t t = 0; t < T; t++) {
        float fl = atomic_load_explicit(&sc->floor[t], memory_order_relaxed);
        const float s1 = s->sx[t], ca1 = s->c[4 * t], ca2 = s->c[4 * t + 1];
        float *ub = s->ub + t * V;
        const int32_t *d1s = (const int32_t *)ub; /* the products, overwritten row by row by the bounds */
        const float *restrict offt = has_off ? s->off + t * V : NULL;
        for (int64_t i0 = r0; i0 < r1; i0 += SCREEN_LANES) {
            if (r1 - i0 >= SCREEN_LANES)
                SCREEN_GROUP(SCREEN_LANES)
            else
                SCREEN_GROUP((int)(r1 - i0))
        }
        floor_raise(&sc->floor[t], fl);
    }
}

/* keep[i] = 1 where ub[t, i] >= floor[t] for some t (with restrict pointers of its own: a loop the compiler
 * vectorizes, where through the struct's pointers it stored a byte at a time) */
static inline __attribute__((always_inline)) void keep_core(const head_screen *s, const float *floors) {
    const int64_t T = s->T, V = s->V;
    uint8_t *restrict keep = s->keep;
    memset(keep, 0, (size_t)V);
    for (int64_t t = 0; t < T; t++) {
        const float fl = floors[t];
        const float *restrict ub = s->ub + t * V;
        for (int64_t i = 0; i < V; i++) keep[i] |= (uint8_t)(ub[i] >= fl);
    }
}

/* screen_core and keep_core for the ISA, screen_core in a copy without offsets (the greedy rows' loop as before) and
 * one with them */
#define SCREEN_ROWS(name, keep_name, target)                                                                        \
    target static void name(const screen_ctx *sc, int64_t r0, int64_t r1) {                                        \
        if (sc->s->off)                                                                                             \
            screen_core(sc, r0, r1, 1);                                                                             \
        else                                                                                                        \
            screen_core(sc, r0, r1, 0);                                                                             \
    }                                                                                                               \
    target static void keep_name(const head_screen *s, const float *floors) { keep_core(s, floors); }
SCREEN_ROWS(screen_rows_plain, keep_plain, )
#if FASTAR_X86
SCREEN_ROWS(screen_rows_avx2, keep_avx2, TARGET_AVX2)
SCREEN_ROWS(screen_rows_avx512, keep_avx512, TARGET_AVX512)
#endif

static void screen_rows(const screen_ctx *sc, int64_t r0, int64_t r1) { sc->rows_fn(sc, r0, r1); }

int64_t head_i8_screen_run(const isa_ops *isa, const head_screen *s) {
    const int64_t T = s->T, V = s->V, K = s->K;
    if (T <= 0 || V <= 0) return 0;
    screen_ctx sc = {.s = s, .vnni = head_i8_path(isa) == HEAD_PATH_VNNI, .rows_fn = screen_rows_plain};
    void (*keep_fn)(const head_screen *, const float *) = keep_plain;
#if FASTAR_X86
    if (isa->vec == VEC_AVX512) sc.rows_fn = screen_rows_avx512, keep_fn = keep_avx512;
    if (isa->vec == VEC_AVX2) sc.rows_fn = screen_rows_avx2, keep_fn = keep_avx2;
#endif
    sc.floor = malloc((size_t)T * (sizeof *sc.floor + sizeof(float)));
    uint8_t *x2u = sc.vnni ? aligned_alloc(64, (size_t)(T * K) + 64) : NULL;
    if (!sc.floor || (sc.vnni && !x2u)) {
        free(sc.floor), free(x2u);
        return -1;
    }
    for (int64_t t = 0; t < T; t++) atomic_init(&sc.floor[t], -INFINITY);
    if (x2u)
        for (int64_t k = 0; k < T * K; k++) x2u[k] = (uint8_t)((uint8_t)s->x[T * K + k] ^ 0x80);
    sc.x2u = x2u;
    const head_dot d = {.x = s->x, .q = s->q, .rowsum = s->rowsum, .out = (int32_t *)s->ub, .T = T, .V = V, .K = K};
    const int rc = dot_run(isa, &d, &sc);
    free(x2u);
    if (rc) {
        free(sc.floor);
        return -1;
    }
    float *floors = (float *)(sc.floor + T); /* every thread is done: the floors as plain floats */
    for (int64_t t = 0; t < T; t++) floors[t] = atomic_load(&sc.floor[t]);
    keep_fn(s, floors);
    free(sc.floor);
    int64_t n = 0;
    for (int64_t i = 0; i < V; i++)
        if (s->keep[i]) s->rows[n++] = i;
    return n;
}

/* ---------------------------------------------------------------- quantize */

void head_i8_quantize_run(const float *y, int64_t T, int64_t K, int8_t *x, float *sx, double *stats, int ncol) {
    for (int64_t t = 0; t < T; t++) {
        const float *yt = y + t * K;
        int8_t *x1 = x + t * K, *x2 = x + (T + t) * K;
        double top = 0.0, ny = 0.0;
        int finite = 1;
        for (int64_t k = 0; k < K; k++) {
            const double v = yt[k];
            finite &= isfinite(yt[k]) != 0;
            top = fabs(v) > top ? fabs(v) : top;
            ny += v * v;
        }
        double *st = stats + ncol * t;
        if (!finite) { /* not screened (the caller sees |y| = inf): no conversion of a NaN to an integer */
            memset(x1, 0, (size_t)K), memset(x2, 0, (size_t)K);
            sx[t] = sx[T + t] = 1.0f;
            for (int j = 0; j < ncol; j++) st[j] = INFINITY;
            continue;
        }
        const float s1 = top > 0 ? (float)(top / 127.0) : 1.0f;
        double top2 = 0.0;
        for (int64_t k = 0; k < K; k++) {
            double q = rint(yt[k] / (double)s1);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            x1[k] = (int8_t)q;
            const double r = yt[k] - (double)s1 * q;
            top2 = fabs(r) > top2 ? fabs(r) : top2;
        }
        const float s2 = top2 > 0 ? (float)(top2 / 127.0) : 1.0f;
        double dy = 0.0, nx = 0.0, dy1 = 0.0, nx1 = 0.0;
        for (int64_t k = 0; k < K; k++) {
            const double r = yt[k] - (double)s1 * x1[k];
            double q = rint(r / (double)s2);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            x2[k] = (int8_t)q;
            const double xt = (double)s1 * x1[k] + (double)s2 * q, e = yt[k] - xt;
            dy += e * e, nx += xt * xt;
            dy1 += r * r, nx1 += ((double)s1 * x1[k]) * ((double)s1 * x1[k]);
        }
        sx[t] = s1, sx[T + t] = s2;
        st[0] = sqrt(dy), st[1] = sqrt(nx), st[2] = sqrt(ny);
        if (ncol == 5) st[3] = sqrt(dy1), st[4] = sqrt(nx1);
    }
}
