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
