/* What the SIMD code of several files shares: the always-inline and unroll macros, the function targets of the
 * files that mix plain C with SIMD variants (attn.c, mhc.c), and the dot-path driver of the product kernels.
 *
 * Include it after the file's target pragma (kern_*.c) and its intrinsics header: the helpers below are
 * always-inline, so each including file compiles them for its own target.
 */
#ifndef FASTAR_SIMD_H
#define FASTAR_SIMD_H

#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define INLINE static inline __attribute__((always_inline))
#if defined(__clang__)
#define UNROLL _Pragma("unroll")
#else
#define UNROLL _Pragma("GCC unroll 16") /* token loops: keep every accumulator in a register */
#endif

#if FASTAR_X86
/* Per-function targets for a file that is otherwise compiled for the baseline ISA. */
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx2,fma")))
#endif

/* The dot path's store of one (row, token) sum: DOT_DISPATCH calls it. */
INLINE void put(const mm_job *j, int64_t t, int64_t n, float v) {
    float *o = j->out + t * j->ldo + n;
    *o = j->accumulate ? *o + v : v;
}

/* x of a K-blocked dot path (the BF16 weights' kernels walk a block of rows K block by K block): K block b of token t
 * at xl[(b * T + t) * kb], zero-padded, so one K block of all the tokens is one contiguous run (the tokens' rows of
 * xp lie kp floats apart, which at K = 4096 puts them all on the same L1 sets). Returns NULL when out of memory (the
 * caller then reads xp in place: the same sums, slower). */
INLINE float *dot_blocked_x(const mm_job *j, int64_t kb) {
    const int64_t nkb = (j->kp + kb - 1) / kb;
    float *xl = aligned_alloc(64, (size_t)(nkb * j->T * kb) * sizeof(float));
    if (!xl) return NULL;
    for (int64_t b = 0; b < nkb; b++)
        for (int64_t t = 0; t < j->T; t++) {
            const int64_t n = j->kp - b * kb < kb ? j->kp - b * kb : kb;
            float *d = xl + (b * j->T + t) * kb;
            memcpy(d, j->xp + t * j->kp + b * kb, (size_t)n * sizeof(float));
            memset(d + n, 0, (size_t)(kb - n) * sizeof(float));
        }
    return xl;
}

/* One K block of a K-blocked dot path: rows [nb, ne), columns [c0, c1), the x of the call's tokens (token t's column c
 * at xb[t * ldx + c - c0]), how far on in the weights to prefetch (pf), and the kernel's buffer of running sums. */
typedef void (*kblock_fn)(const mm_job *j, int64_t nb, int64_t ne, int64_t c0, int64_t c1, const float *xb, int64_t ldx,
                          int64_t pf, void *sums);
/* Rows [nb, ne) are summed: their outputs from the buffer. */
typedef void (*kblock_done_fn)(const mm_job *j, int64_t nb, int64_t ne, const void *sums);

/* The BF16 weights' K-blocked walk (each x86 ISA's kernels do the blocks): rows in blocks of rb, a block's columns in
 * K blocks of kb, x copied into K-block order where the rows make it worth its bytes (the copy is at most 1/16 of
 * theirs), the weights prefetched `ahead_blocks` K blocks on in the row, near its end the same place in the next
 * block of rows. */
INLINE void dot_kblocked(const mm_job *j, int64_t n0, int64_t n1, int64_t rb, int64_t kb, int64_t ahead_blocks,
                         void *sums, kblock_fn block, kblock_done_fn done) {
    const int64_t K = j->K, T = j->T, ahead = ahead_blocks * kb;
    float *xl = (n1 - n0) * K * 2 >= 16 * T * j->kp * 4 ? dot_blocked_x(j, kb) : NULL;
    for (int64_t nb = n0; nb < n1; nb += rb) {
        const int64_t ne = nb + rb < n1 ? nb + rb : n1;
        for (int64_t c0 = 0, c1; c0 < K; c0 = c1) {
            c1 = c0 + kb < K ? c0 + kb : K;
            const float *xb = xl ? xl + (c0 / kb) * T * kb : j->xp + c0;
            const int64_t pf = c0 + ahead < K ? ahead : ahead - K + (ne - nb) * K;
            block(j, nb, ne, c0, c1, xb, xl ? kb : j->kp, pf, sums);
        }
        done(j, nb, ne, sums);
    }
    free(xl);
}

/* The dot-path driver of the product kernels (each file defines its ROW kernels): rows in blocks of DOT_RB, tokens
 * in groups of DOT_GROUP, every (row, token) summed over all K columns by ROW in one order that depends on neither
 * T nor the token's place in the batch. So for T <= dot_max a token's outputs are bit-identical whether it runs
 * alone (decode) or with others (a speculative verify pass, a short prefill chunk). */
#define DOT_RB 8
#define DOT_GROUP 4
#define DOT_DISPATCH(ROW)                                                                            \
    {                                                                                                \
        for (int64_t nb = n0; nb < n1; nb += DOT_RB) {                                               \
            const int64_t ne = nb + DOT_RB < n1 ? nb + DOT_RB : n1;                                  \
            for (int64_t t0 = 0; t0 < j->T; t0 += DOT_GROUP) {                                       \
                mm_job g = *j;                                                                       \
                g.x = j->x + t0 * j->K;                                                              \
                g.xp = j->xp ? j->xp + t0 * j->kp : NULL;                                            \
                g.xb = j->xb ? j->xb + t0 * j->kp : NULL;                                            \
                float acc[DOT_RB][DOT_GROUP] = {{0}};                                                \
                for (int64_t n = nb; n < ne; n++) switch (j->T - t0 < DOT_GROUP ? j->T - t0 : DOT_GROUP) { \
                    case 1: ROW(&g, n, 1, 0, j->K, acc[n - nb]); break;                              \
                    case 2: ROW(&g, n, 2, 0, j->K, acc[n - nb]); break;                              \
                    case 3: ROW(&g, n, 3, 0, j->K, acc[n - nb]); break;                              \
                    default: ROW(&g, n, 4, 0, j->K, acc[n - nb]); break;                             \
                    }                                                                                \
                for (int64_t n = nb; n < ne; n++)                                                    \
                    for (int64_t t = t0; t < j->T && t < t0 + DOT_GROUP; t++) put(j, t, n, acc[n - nb][t - t0]); \
            }                                                                                        \
        }                                                                                            \
    }

#endif
