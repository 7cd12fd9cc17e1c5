/* AVX-512 (F, BW, VL) kernels (Zen 4/5, Ice Lake and later servers), chosen at run time by dispatch.c.
 *
 * Owns: the FP4 / FP8 / BF16 products for this ISA, same two shapes as kern_avx2.c:
 * - dot path (T <= DOT_MAX): vpermps with a 16-entry table maps each 4-bit code straight to its signed float
 *   (the index is the low 4 bits of a 32-bit lane, so the 8 nibbles of a lane are reached by shifting); one
 *   64-byte load gives 128 columns = 4 scale groups, one per 128-bit lane. Masked loads handle ragged ends.
 * - BF16 weights' dot path (bf16_dot_rows, the LM head): 1-8 tokens in one pass over the weights, 4 rows at a
 *   time, K-blocked so x stays in L1, the weights prefetched into L2.
 * - tile path: 32 rows x 128 columns dequantized once (16-row gathers) into L1, then an outer-product
 *   microkernel of up to 12 tokens x 32 rows (24 zmm accumulators).
 * Does not own: argument checks, threading (bindings, dispatch.c, pool.c).
 */
#include "kernels.h"

#if FASTAR_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#endif
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "exp512.h"
#include "kern_avx512.h"

#define NR 32 /* tile rows (2 vectors) */
#define MR 12 /* tokens per microkernel call */
#define KC 128

static uint8_t fp4_map[XP_CHUNK], bf16_map[XP_CHUNK];

static void init_avx512(void) {
    /* FP4: vector p (p = 0..7, the nibble index within a dword), lane i (dword i = columns 8i..8i+7) */
    for (int p = 0; p < 8; p++)
        for (int i = 0; i < 16; i++) fp4_map[p * 16 + i] = (uint8_t)(8 * i + p);
    /* BF16: per 32 columns, even columns then odd columns */
    for (int i = 0; i < XP_CHUNK; i++) bf16_map[i] = (uint8_t)((i & ~31) + ((i & 31) < 16 ? 2 * (i & 15) : 2 * (i & 15) + 1));
}

/* ---------------------------------------------------------------- dot path (decode) */

INLINE void fp4_dot_row(const mm_job *j, int64_t n, const int nt, int64_t cb, int64_t ce, float *acc) {
    const int64_t K = j->K;
    const uint8_t *wr = (const uint8_t *)j->w + n * (K / 2);
    const uint8_t *sr = j->s + n * (K / FP4_GROUP);
    const __m512 tab = _mm512_loadu_ps(fp4_f32);
    const int normal = scales_normal(sr + cb / FP4_GROUP, (ce - cb) / FP4_GROUP);
    __m512 tot[DOT_GROUP];
    for (int t = 0; t < nt; t++) tot[t] = _mm512_setzero_ps();
    const int64_t full = ce / 128, rem = (ce % 128) / FP4_GROUP, chunks = full + (rem != 0);
    for (int64_t c = cb / 128; c < chunks; c++) {
        __m512 sv;
        const __m512i b = fp4_chunk(wr, sr, c, full, rem, normal, &sv);
        _mm_prefetch((const char *)(wr + 64 * c + 2048), _MM_HINT_T0);
        __m512 w[8];
        for (int p = 0; p < 8; p++) w[p] = _mm512_permutexvar_ps(p ? _mm512_srli_epi32(b, 4 * p) : b, tab);
        for (int t = 0; t < nt; t++) {
            const float *xt = j->xp + t * j->kp + 128 * c;
            __m512 pa = _mm512_mul_ps(_mm512_loadu_ps(xt), w[0]);
            __m512 pb = _mm512_mul_ps(_mm512_loadu_ps(xt + 16), w[1]);
            pa = _mm512_fmadd_ps(_mm512_loadu_ps(xt + 32), w[2], pa);
            pb = _mm512_fmadd_ps(_mm512_loadu_ps(xt + 48), w[3], pb);
            pa = _mm512_fmadd_ps(_mm512_loadu_ps(xt + 64), w[4], pa);
            pb = _mm512_fmadd_ps(_mm512_loadu_ps(xt + 80), w[5], pb);
            pa = _mm512_fmadd_ps(_mm512_loadu_ps(xt + 96), w[6], pa);
            pb = _mm512_fmadd_ps(_mm512_loadu_ps(xt + 112), w[7], pb);
            tot[t] = _mm512_fmadd_ps(_mm512_add_ps(pa, pb), sv, tot[t]);
        }
    }
    for (int t = 0; t < nt; t++) acc[t] += _mm512_reduce_add_ps(tot[t]);
}

/* 32 e4m3 bytes -> fp16 bits (value / 256) in 32 words; see kern_avx2.c fp8_to_h16. */
INLINE __m512i fp8_to_h16(__m256i v) {
    return _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(v), 7), _mm512_set1_epi16((short)0xbf80));
}

INLINE void fp8_dot_row(const mm_job *j, int64_t n, const int nt, int64_t cb, int64_t ce, float *acc) {
    const int64_t K = j->K, kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    const uint8_t *wr = (const uint8_t *)j->w + n * K;
    const uint8_t *srow = j->s + (n / FP8_BLOCK) * kb;
    const __m256i m7f = _mm256_set1_epi8(0x7f);
    __m256i nanmax = _mm256_setzero_si256();
    __m512 tot[DOT_GROUP];
    for (int t = 0; t < nt; t++) tot[t] = _mm512_setzero_ps();
    for (int64_t b = cb / FP8_BLOCK; b < (ce + FP8_BLOCK - 1) / FP8_BLOCK; b++) {
        const int64_t c0 = b * FP8_BLOCK, c1 = c0 + FP8_BLOCK < ce ? c0 + FP8_BLOCK : ce;
        __m512 pa[DOT_GROUP], pb[DOT_GROUP];
        for (int t = 0; t < nt; t++) pa[t] = pb[t] = _mm512_setzero_ps();
        for (int64_t c = c0; c < c1; c += 32) {
            const int64_t left = c1 - c;
            const __mmask32 m = left >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << left) - 1);
            const __m256i v = _mm256_maskz_loadu_epi8(m, wr + c);
            _mm_prefetch((const char *)(wr + c + 2048), _MM_HINT_T0);
            nanmax = _mm256_max_epu8(nanmax, _mm256_and_si256(v, m7f));
            const __m512i h = fp8_to_h16(v);
            const __m512 f0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), f1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
            for (int t = 0; t < nt; t++) {
                const float *xt = j->x + t * K + c;
                pa[t] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps((__mmask16)m, xt), f0, pa[t]);
                pb[t] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps((__mmask16)(m >> 16), xt + 16), f1, pb[t]);
            }
        }
        const uint8_t sb = srow[b];
        const float sf = ue8m0_f32[sb];
        for (int t = 0; t < nt; t++) {
            const __m512 p = _mm512_add_ps(pa[t], pb[t]);
            if (sb <= 246) /* fold the fp16 trick's x256 into the scale unless that overflows */
                tot[t] = _mm512_fmadd_ps(p, _mm512_set1_ps(sf * 256.0f), tot[t]);
            else
                tot[t] = _mm512_fmadd_ps(_mm512_mul_ps(p, _mm512_set1_ps(256.0f)), _mm512_set1_ps(sf), tot[t]);
        }
    }
    const int nan = _mm256_movemask_epi8(_mm256_cmpeq_epi8(nanmax, m7f)) != 0; /* a NaN code in the row */
    for (int t = 0; t < nt; t++) acc[t] += nan ? __builtin_nanf("") : _mm512_reduce_add_ps(tot[t]);
}

/* BF16 weights, dot path (the LM head of a decode step, up to 8 tokens of a batched step). Every (row, token) sum
 * is one float32 vector: per 32 columns in column order, acc += x_even * w_even, then acc += x_odd * w_odd (x is
 * permuted by bf16_map to match: per 32 columns the even ones, then the odd ones), one FMA each; the result is
 * 0 + reduce(acc). The same operations whatever T, however many rows run together and wherever the K blocks fall,
 * so a token's outputs are bit-identical alone or batched.
 *
 * Order of work (bf16_dot_rows): rows in blocks of BF_RB; a block's columns in K blocks of BF_KB, so the x of all
 * the tokens for one K block stays in L1 while it serves every row of the block (8 tokens x 512 columns = 16 KB; the
 * whole of x at K = 4096 and 8 tokens is 128 KB); within a K block 4 rows at a time (16 accumulators for 4 tokens),
 * so every token rides the one pass over the weights and each x load serves 4 rows; 5-8 tokens run tokens 0-3, then
 * tokens 4..T-1 over the same 4 rows' K block, which the first half has just brought into L1. Between K blocks (and
 * halves) the accumulators wait in a small buffer. 2 rows x 8 tokens instead (each x load serving 2 rows) ran at
 * 72 % of the FMA peak on one core from DRAM against 84-87 % for the halves (the Flash head at 8 tokens, 2 threads,
 * in a process of its own: 49 -> 41.5 ms; inside `fastar bench --profile 8` the old shape was as fast, see
 * docs/PERFORMANCE.md). The weights are prefetched BF_PF_BLOCKS K blocks ahead
 * into L2, not L1, whose few miss buffers held the stream up. Measured on a 2-core Zen 4 with a model's own head
 * (huge pages), each call timed beside the read probe, two builds alternated: at 1-4 tokens the head took 1.3-1.7x
 * the probe's time with the L1 prefetch one block ahead (and whole rows at 1-2 tokens), 1.0-1.15x with this. */
#define BF_RB 8        /* rows per block (a multiple of 4) */
#define BF_KB 512      /* columns per K block (a multiple of 32) */
#define BF_PF_BLOCKS 2 /* how many K blocks ahead to prefetch */

/* Rows w, w + K, ... (NW of them), tokens 0..NT-1 of x (token t's column c at x[t * ldx + c - c0]), columns
 * [c0, c1) (c1 = the row end K, or a multiple of 32 below it), continuing the sums in st (row r, token t at
 * st[r * DOT_MAX + t]; zero when first). pf: how far ahead, in weights, to prefetch. */
INLINE void bf16_span(const int NW, const int NT, const uint16_t *w, int64_t K, const float *x, int64_t ldx,
                      int64_t c0, int64_t c1, int first, __m512 *st, int64_t pf) {
    const __m512i mhi = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[4][DOT_MAX];
    UNROLL
    for (int r = 0; r < NW; r++)
        UNROLL
        for (int t = 0; t < NT; t++) acc[r][t] = first ? _mm512_setzero_ps() : st[r * DOT_MAX + t];
    for (int64_t c = c0; c < c1; c += 32) {
        const int64_t left = c1 - c;
        const __mmask32 m = left >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << left) - 1);
        __m512 e[4], o[4];
        UNROLL
        for (int r = 0; r < NW; r++) {
            const uint16_t *wr = w + r * K + c;
            const __m512i v = left >= 32 ? _mm512_loadu_si512((const void *)wr) : _mm512_maskz_loadu_epi16(m, wr);
            if (pf) _mm_prefetch((const char *)(wr + pf), _MM_HINT_T1);
            e[r] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            o[r] = _mm512_castsi512_ps(_mm512_and_si512(v, mhi));
        }
        UNROLL
        for (int t = 0; t < NT; t++) {
            const float *xt = x + t * ldx + (c - c0);
            __m512 xe = _mm512_loadu_ps(xt), xo = _mm512_loadu_ps(xt + 16);
            if (NW > 1) __asm__("" : "+v"(xe), "+v"(xo)); /* one load for all the rows: the compiler would reload */
            UNROLL
            for (int r = 0; r < NW; r++) acc[r][t] = _mm512_fmadd_ps(xo, o[r], _mm512_fmadd_ps(xe, e[r], acc[r][t]));
        }
    }
    UNROLL
    for (int r = 0; r < NW; r++)
        UNROLL
        for (int t = 0; t < NT; t++) st[r * DOT_MAX + t] = acc[r][t];
}

static void bf16_kblock(const mm_job *j, int64_t nb, int64_t ne, int64_t c0, int64_t c1, const float *xb, int64_t ldx,
                        int64_t pf, void *sums) {
    const int64_t K = j->K, T = j->T;
    const uint16_t *w = (const uint16_t *)j->w;
    __m512 *st = sums; /* row n - nb, token t at st[(n - nb) * DOT_MAX + t] */
    int64_t n = nb;
#define SPAN(NW, NT) bf16_span(NW, NT, w + n * K, K, xb, ldx, c0, c1, c0 == 0, st + (n - nb) * DOT_MAX, pf)
/* tokens 4..T-1 over the same K block of the same rows, just read: no prefetch, x and the totals 4 tokens on */
#define SPAN_HI(NW, NT) bf16_span(NW, NT, w + n * K, K, xb + 4 * ldx, ldx, c0, c1, c0 == 0, st + (n - nb) * DOT_MAX + 4, 0)
    for (; n + 3 < ne; n += 4) switch (T) {
        case 1: SPAN(4, 1); break;
        case 2: SPAN(4, 2); break;
        case 3: SPAN(4, 3); break;
        case 4: SPAN(4, 4); break;
        case 5: SPAN(4, 4); SPAN_HI(4, 1); break;
        case 6: SPAN(4, 4); SPAN_HI(4, 2); break;
        case 7: SPAN(4, 4); SPAN_HI(4, 3); break;
        default: SPAN(4, 4); SPAN_HI(4, 4); break;
        }
    for (; n < ne; n++) switch (T) {
        case 1: SPAN(1, 1); break;
        case 2: SPAN(1, 2); break;
        case 3: SPAN(1, 3); break;
        case 4: SPAN(1, 4); break;
        case 5: SPAN(1, 5); break;
        case 6: SPAN(1, 6); break;
        case 7: SPAN(1, 7); break;
        default: SPAN(1, 8); break;
        }
#undef SPAN_HI
#undef SPAN
}

static void bf16_kblock_done(const mm_job *j, int64_t nb, int64_t ne, const void *sums) {
    const __m512 *st = sums;
    for (int64_t n = nb; n < ne; n++)
        for (int64_t t = 0; t < j->T; t++) put(j, t, n, 0.0f + _mm512_reduce_add_ps(st[(n - nb) * DOT_MAX + t]));
}

static void bf16_dot_rows(const mm_job *j, int64_t n0, int64_t n1) {
    __m512 st[BF_RB * DOT_MAX] __attribute__((aligned(64)));
    dot_kblocked(j, n0, n1, BF_RB, BF_KB, BF_PF_BLOCKS, st, bf16_kblock, bf16_kblock_done);
}

/* ---------------------------------------------------------------- tile path (prefill) */

typedef void (*tile_fn)(const mm_job *j, int64_t n, int nr, int64_t k0, int64_t kc, float *wt, uint32_t *nanrows);

INLINE __mmask16 row_mask(int rows) { return rows >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << rows) - 1); }

static void fp4_tile(const mm_job *j, int64_t n, int nr, int64_t k0, int64_t kc, float *wt, uint32_t *nanrows) {
    (void)nanrows;
    const int64_t half = j->K / 2, groups = j->K / FP4_GROUP;
    const __m512 tab = _mm512_loadu_ps(fp4_f32);
    for (int h = 0; h < NR / 16; h++) {
        const int rows = nr - 16 * h;
        if (rows <= 0) {
            for (int64_t k = 0; k < kc; k++) _mm512_store_ps(wt + k * NR + 16 * h, _mm512_setzero_ps());
            continue;
        }
        const uint8_t *sb = j->s + (n + 16 * h) * groups + k0 / FP4_GROUP;
        __m512 sv[4];
        for (int64_t g = 0; g < kc / FP4_GROUP; g++) {
            float sc[16];
            for (int r = 0; r < 16; r++) sc[r] = r < rows ? ue8m0_f32[sb[r * groups + g]] : 0.0f;
            sv[g] = _mm512_loadu_ps(sc);
        }
        __m512i c[16];
        load_t16((const uint8_t *)j->w + (n + 16 * h) * half + k0 / 2, half, rows, kc / 2, c);
        for (int64_t q = 0; q < kc / 8; q++) /* dword q = columns 8q..8q+7 */
            for (int p = 0; p < 8; p++)
                _mm512_store_ps(wt + (8 * q + p) * NR + 16 * h,
                                _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(c[q], 4 * p), tab), sv[q / 4]));
    }
}

static void fp8_tile(const mm_job *j, int64_t n, int nr, int64_t k0, int64_t kc, float *wt, uint32_t *nanrows) {
    const int64_t K = j->K, kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    const uint8_t sbyte = j->s[(n / FP8_BLOCK) * kb + k0 / FP8_BLOCK]; /* a tile sits inside one scale block */
    const float sf = ue8m0_f32[sbyte];
    const __m512 fac = _mm512_set1_ps(sf * 256.0f);
    /* per 128-bit lane (4 rows): words 0-3 = column a of rows 0-3, words 4-7 = column b; byte in the high half */
    const __m512i ctrl01 = _mm512_broadcast_i32x4(_mm_setr_epi8(-128, 0, -128, 4, -128, 8, -128, 12, -128, 1, -128, 5, -128, 9, -128, 13));
    const __m512i ctrl23 = _mm512_broadcast_i32x4(_mm_setr_epi8(-128, 2, -128, 6, -128, 10, -128, 14, -128, 3, -128, 7, -128, 11, -128, 15));
    const __m512i quads = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
    const __m512i keep = _mm512_set1_epi16((short)0xbfff), top = _mm512_set1_epi8((char)0x80), ones = _mm512_set1_epi8(-1);
    for (int h = 0; h < NR / 16; h++) {
        const int rows = nr - 16 * h;
        const uint8_t *base = (const uint8_t *)j->w + (n + 16 * h) * K + k0;
        if (sbyte > 246 || rows <= 0) { /* huge scales (x256 would overflow) and absent rows: exact scalar */
            for (int64_t k = 0; k < kc; k++)
                for (int r = 0; r < 16; r++) wt[k * NR + 16 * h + r] = r < rows ? fp8_f32[base[r * K + k]] * sf : 0.0f;
            continue;
        }
        __mmask64 nan = 0;
        for (int64_t b0 = 0; b0 < kc; b0 += 64) {
            __m512i c[16];
            load_t16(base + b0, K, rows, kc - b0, c); /* bytes past the row end read as zero */
            for (int64_t q = 0; q < 16 && b0 + 4 * q < kc; q++) {
                nan |= _mm512_cmpeq_epi8_mask(_mm512_or_si512(c[q], top), ones);
                for (int pair = 0; pair < 2; pair++) {
                    __m512i y = _mm512_shuffle_epi8(c[q], pair ? ctrl23 : ctrl01);
                    y = _mm512_permutexvar_epi64(quads, _mm512_and_si512(_mm512_srai_epi16(y, 1), keep));
                    float *dst = wt + (b0 + 4 * q + 2 * pair) * NR + 16 * h;
                    _mm512_store_ps(dst, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(y)), fac));
                    _mm512_store_ps(dst + NR, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(y, 1)), fac));
                }
            }
        }
        for (int r = 0; r < 16; r++)
            if (nan >> (4 * r) & 0xf) *nanrows |= 1u << (16 * h + r);
    }
}

static void bf16_tile(const mm_job *j, int64_t n, int nr, int64_t k0, int64_t kc, float *wt, uint32_t *nanrows) {
    (void)nanrows;
    const int64_t K = j->K;
    const __m512i mhi = _mm512_set1_epi32((int)0xffff0000u);
    for (int h = 0; h < NR / 16; h++) {
        const int rows = nr - 16 * h;
        const uint16_t *base = (const uint16_t *)j->w + (n + 16 * h) * K + k0;
        for (int64_t b0 = 0; b0 < kc; b0 += 32) { /* 32 columns = 64 bytes per row */
            __m512i c[16];
            load_t16((const uint8_t *)(base + b0), 2 * K, rows > 0 ? rows : 0, 2 * (kc - b0), c);
            for (int64_t q = 0; q < 16 && b0 + 2 * q < kc; q++) {
                _mm512_store_ps(wt + (b0 + 2 * q) * NR + 16 * h, _mm512_castsi512_ps(_mm512_slli_epi32(c[q], 16)));
                _mm512_store_ps(wt + (b0 + 2 * q + 1) * NR + 16 * h, _mm512_castsi512_ps(_mm512_and_si512(c[q], mhi)));
            }
        }
    }
}

INLINE void micro(const int mr, int64_t kc, const float *wt, const float *x, int64_t ldx, float *out, int64_t ldo, int nr, int store) {
    __m512 acc[MR][2];
    UNROLL
    for (int t = 0; t < mr; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        const __m512 w0 = _mm512_load_ps(wt + k * NR), w1 = _mm512_load_ps(wt + k * NR + 16);
        UNROLL
        for (int t = 0; t < mr; t++) {
            const __m512 b = _mm512_set1_ps(x[t * ldx + k]);
            acc[t][0] = _mm512_fmadd_ps(b, w0, acc[t][0]);
            acc[t][1] = _mm512_fmadd_ps(b, w1, acc[t][1]);
        }
    }
    const __mmask16 m0 = row_mask(nr), m1 = row_mask(nr - 16 > 0 ? nr - 16 : 0);
    UNROLL
    for (int t = 0; t < mr; t++) {
        float *o = out + t * ldo;
        if (!store) {
            acc[t][0] = _mm512_add_ps(acc[t][0], _mm512_maskz_loadu_ps(m0, o));
            acc[t][1] = _mm512_add_ps(acc[t][1], _mm512_maskz_loadu_ps(m1, o + 16));
        }
        _mm512_mask_storeu_ps(o, m0, acc[t][0]);
        _mm512_mask_storeu_ps(o + 16, m1, acc[t][1]);
    }
}

static void tile_rows(const mm_job *j, int64_t n0, int64_t n1, tile_fn deq) {
    float wt[KC * NR] __attribute__((aligned(64)));
    const int64_t T = j->T, K = j->K;
    const int64_t nblk = (T + MR - 1) / MR; /* balanced token blocks: 16 -> 8,8 */
    for (int64_t n = n0; n < n1; n += NR) {
        const int nr = n1 - n < NR ? (int)(n1 - n) : NR;
        uint32_t nanrows = 0;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kc = K - k0 < KC ? K - k0 : KC;
            deq(j, n, nr, k0, kc, wt, &nanrows);
            const int store = k0 == 0 && !j->accumulate;
            for (int64_t b = 0, t0 = 0; b < nblk; b++) {
                const int mr = (int)(T / nblk + (b < T % nblk));
                const float *x = j->x + t0 * K + k0;
                float *o = j->out + t0 * j->ldo + n;
                switch (mr) {
#define MCASE(M) case M: micro(M, kc, wt, x, K, o, j->ldo, nr, store); break;
                    MCASE(1) MCASE(2) MCASE(3) MCASE(4) MCASE(5) MCASE(6)
                    MCASE(7) MCASE(8) MCASE(9) MCASE(10) MCASE(11)
                    default: micro(12, kc, wt, x, K, o, j->ldo, nr, store); break;
#undef MCASE
                }
                t0 += mr;
            }
        }
        for (int r = 0; r < nr; r++)
            if (nanrows >> r & 1)
                for (int64_t t = 0; t < T; t++) j->out[t * j->ldo + n + r] = __builtin_nanf("");
    }
}

/* ---------------------------------------------------------------- activation ops */

/* fp8_act_quant_scalar (kern_scalar.c) on 16 lanes, bit for bit: per block the same amax (a max is exact in any
 * order) and scale, then per value the same exact steps; e4m3 rounding by roundscale, which rounds to nearest
 * even like the scalar (y + 2^23) - 2^23 for the 0 <= y < 16 it sees. A block holding a NaN or an infinity is
 * left to the scalar code (its s = 1 quirk). */
static void act_quant(const float *x, float *out, int64_t rows, int64_t K, int64_t block) {
    const __m512 lim = _mm512_set1_ps(448.0f), nlim = _mm512_set1_ps(-448.0f), big = _mm512_set1_ps(3.4028235e38f);
    const __m512i absm = _mm512_set1_epi32(0x7fffffff), m6 = _mm512_set1_epi32(-6);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b0 = 0; b0 < K; b0 += block) {
            const float *xb = x + r * K + b0;
            float *ob = out + r * K + b0;
            const int64_t n = K - b0 < block ? K - b0 : block;
            __m512 amax = _mm512_setzero_ps();
            int bad = 0;
            for (int64_t i = 0; i < n; i += 16) {
                const __mmask16 m = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
                const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_maskz_loadu_ps(m, xb + i)), absm));
                bad |= _mm512_mask_cmp_ps_mask(m, a, big, _CMP_LE_OQ) != m;
                amax = _mm512_max_ps(amax, a);
            }
            if (bad) {
                fp8_act_quant_scalar(xb, ob, 1, n, n);
                continue;
            }
            const float am = _mm512_reduce_max_ps(amax);
            int ex = 0;
            const float mant = frexpf((am > 1e-4f ? am : 1e-4f) / 448.0f, &ex);
            const int sexp = mant == 0.5f ? ex - 1 : ex;
            const __m512 sv = _mm512_set1_ps(ldexpf(1.0f, sexp)), inv = _mm512_set1_ps(ldexpf(1.0f, -sexp));
            for (int64_t i = 0; i < n; i += 16) {
                const __mmask16 m = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
                __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xb + i), inv);
                v = _mm512_max_ps(_mm512_min_ps(v, lim), nlim);
                const __m512i vb = _mm512_castps_si512(v), ab = _mm512_and_si512(vb, absm);
                const __m512i q = _mm512_sub_epi32(_mm512_max_epi32(_mm512_sub_epi32(_mm512_srli_epi32(ab, 23),
                                                                                      _mm512_set1_epi32(127)), m6),
                                                   _mm512_set1_epi32(3));
                const __m512 down = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(127), q), 23));
                const __m512 up = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_set1_epi32(127), q), 23));
                const __m512 y = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_castsi512_ps(ab), down),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const __m512i signed_r = _mm512_or_si512(_mm512_castps_si512(_mm512_mul_ps(y, up)),
                                                         _mm512_andnot_si512(absm, vb));
                _mm512_mask_storeu_ps(ob + i, m, _mm512_mul_ps(_mm512_castsi512_ps(signed_r), sv));
            }
        }
}

/* out = silu(min(g, l)) * clamp(u, -l, l) * scale (limit <= 0: no clamp); NaN passes through (comparisons keep
 * it, as the scalar code does). out may be g. */
static void swiglu(const float *g, const float *u, float *out, int64_t n, float limit, float scale) {
    const __m512 l = _mm512_set1_ps(limit), nl = _mm512_set1_ps(-limit), one = _mm512_set1_ps(1.0f),
                 sc = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 gv = _mm512_maskz_loadu_ps(m, g + i), uv = _mm512_maskz_loadu_ps(m, u + i);
        if (limit > 0) { /* where gv > l (false for NaN): l */
            gv = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(gv, l, _CMP_GT_OQ), gv, l);
            uv = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(uv, l, _CMP_GT_OQ), uv, l);
            uv = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(uv, nl, _CMP_LT_OQ), uv, nl);
        }
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), uv), sc);
        _mm512_mask_storeu_ps(out + i, m, y);
    }
}

/* ---------------------------------------------------------------- entry points */

static void fp4_rows(const mm_job *j, int64_t n0, int64_t n1) {
    if (j->dot) { DOT_DISPATCH(fp4_dot_row) } else tile_rows(j, n0, n1, fp4_tile);
}
static void fp8_rows(const mm_job *j, int64_t n0, int64_t n1) {
    if (j->dot) { DOT_DISPATCH(fp8_dot_row) } else tile_rows(j, n0, n1, fp8_tile);
}
static void bf16_rows(const mm_job *j, int64_t n0, int64_t n1) {
    if (j->dot) bf16_dot_rows(j, n0, n1);
    else tile_rows(j, n0, n1, bf16_tile);
}

static double fma_loop(int64_t iters) {
    __m512 a[12];
    const __m512 m = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(0.0001f);
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps((float)i);
    for (int64_t it = 0; it < iters; it++)
        for (int i = 0; i < 12; i++) a[i] = _mm512_fmadd_ps(a[i], m, c);
    __m512 s = a[0];
    for (int i = 1; i < 12; i++) s = _mm512_add_ps(s, a[i]);
    volatile float sink = _mm512_reduce_add_ps(s);
    (void)sink;
    return (double)iters * 12 * 16 * 2;
}

static double read_sum(const uint8_t *p, size_t n) {
    __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
    for (size_t i = 0; i + 256 <= n; i += 256) {
        s0 = _mm512_add_epi64(s0, _mm512_loadu_si512((const void *)(p + i)));
        s1 = _mm512_add_epi64(s1, _mm512_loadu_si512((const void *)(p + i + 64)));
        s2 = _mm512_add_epi64(s2, _mm512_loadu_si512((const void *)(p + i + 128)));
        s3 = _mm512_add_epi64(s3, _mm512_loadu_si512((const void *)(p + i + 192)));
    }
    return (double)_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3)));
}

const isa_ops isa_avx512_ops = {
    .name = "avx512",
    .needs = "avx2 fma f16c avx512f avx512bw avx512vl",
    .vec = VEC_AVX512,
    .init = init_avx512,
    .dot_max = DOT_MAX,
    .fp4 = fp4_rows,
    .fp8 = fp8_rows,
    .bf16 = bf16_rows,
    .fp4_map = fp4_map,
    .fp8_map = NULL,
    .bf16_map = bf16_map,
    .fma_loop = fma_loop,
    .read_sum = read_sum,
    .act_quant = act_quant,
    .swiglu = swiglu,
};

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif /* FASTAR_X86 */
