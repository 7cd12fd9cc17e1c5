/* AVX2 + FMA + F16C kernels (Haswell / Zen 1 and later), chosen at run time by dispatch.c.
 *
 * Owns: the FP4 / FP8 / BF16 products for this ISA, in two shapes:
 * - dot path (T <= DOT_MAX, decode and verify passes): each weight row is streamed once per DOT_GROUP tokens
 *   and dequantized in registers, the group's tokens accumulate against it, each in an order that does not
 *   depend on T (DOT_DISPATCH in simd.h: batch-invariant). Activations are pre-permuted (xp, see the maps) so the cheapest in-lane unpacking
 *   order of the weights lines up with them; scales are applied once per group to a partial sum (exact: a
 *   power of two), so the inner loop is shuffles + FMAs. BF16 weights with 2-8 tokens (the LM head of a batched
 *   step) walk a block of rows K block by K block instead, 2 rows x 2 tokens at a time (bf16_dot_rows): the same
 *   sums.
 * - tile path (larger T, prefill): a 16-row x 128-column tile is dequantized once into an L1 buffer, already
 *   transposed (row gathers), and an outer-product microkernel (6 tokens x 16 rows = 12 accumulators)
 *   reuses it for every token. Tile values are exact (value * scale), so products round like the reference.
 * Does not own: argument checks, threading (bindings, dispatch.c, pool.c).
 */
#include "kernels.h"

#if FASTAR_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c")
#endif
#include <immintrin.h>
#include <string.h>

#include "simd.h"

#define DOT_MAX 8 /* T up to this takes the dot path, DOT_GROUP tokens at a time */
#define NR 16 /* tile rows (2 vectors) */
#define MR 6  /* tokens per microkernel call */
#define KC 128

static uint8_t fp4_map[XP_CHUNK], bf16_map[XP_CHUNK];
static uint8_t fp4_hi[16], fp4_lo[16]; /* bytes 3 and 2 of each FP4 value as float32 (bytes 1, 0 are zero) */
static int32_t fp4_tab_c[8];           /* float bits of |value| XOR (index << 28): see fp4_tile */

static void init_avx2(void) {
    for (int c = 0; c < 2; c++)
        for (int v = 0; v < 8; v++)
            for (int l = 0; l < 8; l++) {
                /* vector v = (nibble half, unpacklo/hi, even/odd word); lane l: 128-bit half, dword */
                int src = v >> 2, u = (v >> 1) & 1, par = v & 1, half = l >> 2, m = l & 3;
                int jbyte = 16 * half + 8 * u + 2 * m + par;
                fp4_map[c * 64 + v * 8 + l] = (uint8_t)(c * 64 + 2 * jbyte + src);
            }
    for (int i = 0; i < XP_CHUNK; i++) bf16_map[i] = (uint8_t)((i & ~15) + ((i & 15) < 8 ? 2 * (i & 7) : 2 * (i & 7) + 1));
    for (int i = 0; i < 16; i++) {
        uint32_t u;
        memcpy(&u, &fp4_f32[i], 4);
        fp4_hi[i] = (uint8_t)(u >> 24);
        fp4_lo[i] = (uint8_t)(u >> 16);
        if (i < 8) fp4_tab_c[i] = (int32_t)(u ^ ((uint32_t)i << 28));
    }
}

INLINE float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* ---------------------------------------------------------------- dot path (decode) */

/* 64 FP4 columns -> 8 float vectors via two byte lookups that build each value's bfloat16 bits. */
INLINE void fp4_dot_row(const mm_job *j, int64_t n, const int nt, int64_t cb, int64_t ce, float *acc) {
    const int64_t K = j->K;
    const uint8_t *wr = (const uint8_t *)j->w + n * (K / 2);
    const uint8_t *sr = j->s + n * (K / FP4_GROUP);
    const __m256i m0f = _mm256_set1_epi8(0x0f), mhi = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i tabh = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)fp4_hi));
    const __m256i tabl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)fp4_lo));
    /* lane 0 dwords = scale byte 0 (group 2c), lane 1 dwords = byte 1 (group 2c+1) */
    const __m256i spread_b = _mm256_add_epi32(_mm256_set1_epi32((int)0x80808000), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    int normal = 1;
    for (int64_t g = cb / FP4_GROUP; g < ce / FP4_GROUP; g++) normal &= (sr[g] != 0) & (sr[g] != 255);
    __m256 tot[DOT_GROUP];
    for (int t = 0; t < nt; t++) tot[t] = _mm256_setzero_ps();
    const int64_t full = ce / 64, chunks = full + (ce % 64 != 0);
    for (int64_t c = cb / 64; c < chunks; c++) {
        __m256i b;
        __m256 sv;
        if (c < full && normal) { /* 2^(b-127) is the float with exponent field b: no table needed */
            b = _mm256_loadu_si256((const __m256i *)(wr + 32 * c));
            int16_t s16;
            memcpy(&s16, sr + 2 * c, 2);
            sv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_shuffle_epi8(_mm256_set1_epi16(s16), spread_b), 23));
        } else if (c < full) {
            b = _mm256_loadu_si256((const __m256i *)(wr + 32 * c));
            sv = _mm256_set_m128(_mm_set1_ps(ue8m0_f32[sr[2 * c + 1]]), _mm_set1_ps(ue8m0_f32[sr[2 * c]]));
        } else { /* last 32 columns: 16 bytes, one group */
            b = _mm256_maskload_epi32((const int *)(wr + 32 * c), _mm256_setr_epi32(-1, -1, -1, -1, 0, 0, 0, 0));
            sv = _mm256_set_m128(_mm_setzero_ps(), _mm_set1_ps(ue8m0_f32[sr[2 * c]]));
        }
        _mm_prefetch((const char *)(wr + 32 * c + 1024), _MM_HINT_T0);
        __m256i lo = _mm256_and_si256(b, m0f), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m0f);
        __m256i lh = _mm256_shuffle_epi8(tabh, lo), ll = _mm256_shuffle_epi8(tabl, lo);
        __m256i hh = _mm256_shuffle_epi8(tabh, hi), hl = _mm256_shuffle_epi8(tabl, hi);
        __m256i u0 = _mm256_unpacklo_epi8(ll, lh), u1 = _mm256_unpackhi_epi8(ll, lh);
        __m256i v0 = _mm256_unpacklo_epi8(hl, hh), v1 = _mm256_unpackhi_epi8(hl, hh);
        __m256 w[8] = {
            _mm256_castsi256_ps(_mm256_slli_epi32(u0, 16)), _mm256_castsi256_ps(_mm256_and_si256(u0, mhi)),
            _mm256_castsi256_ps(_mm256_slli_epi32(u1, 16)), _mm256_castsi256_ps(_mm256_and_si256(u1, mhi)),
            _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), _mm256_castsi256_ps(_mm256_and_si256(v0, mhi)),
            _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)), _mm256_castsi256_ps(_mm256_and_si256(v1, mhi))};
        for (int t = 0; t < nt; t++) {
            const float *xt = j->xp + t * j->kp + 64 * c;
            __m256 pa = _mm256_mul_ps(_mm256_loadu_ps(xt), w[0]);
            __m256 pb = _mm256_mul_ps(_mm256_loadu_ps(xt + 8), w[1]);
            pa = _mm256_fmadd_ps(_mm256_loadu_ps(xt + 16), w[2], pa);
            pb = _mm256_fmadd_ps(_mm256_loadu_ps(xt + 24), w[3], pb);
            pa = _mm256_fmadd_ps(_mm256_loadu_ps(xt + 32), w[4], pa);
            pb = _mm256_fmadd_ps(_mm256_loadu_ps(xt + 40), w[5], pb);
            pa = _mm256_fmadd_ps(_mm256_loadu_ps(xt + 48), w[6], pa);
            pb = _mm256_fmadd_ps(_mm256_loadu_ps(xt + 56), w[7], pb);
            tot[t] = _mm256_fmadd_ps(_mm256_add_ps(pa, pb), sv, tot[t]); /* lanes 0-3: group 2c, 4-7: 2c+1 */
        }
    }
    for (int t = 0; t < nt; t++) acc[t] += hsum(tot[t]);
}

/* e4m3 byte -> fp16 bits (value / 256): sign-extend, shift the 7 magnitude bits into place, drop bit 14. */
INLINE __m256i fp8_to_h16(__m128i v) {
    __m256i h = _mm256_cvtepi8_epi16(v);
    return _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xbf80));
}

/* FP8 e4m3 has NaN codes (S.1111.111): any in a row makes the reference's row NaN, so track them. */
INLINE int has_fp8_nan(__m128i maxmag) {
    return _mm_movemask_epi8(_mm_cmpeq_epi8(maxmag, _mm_set1_epi8(0x7f))) != 0;
}

INLINE void fp8_dot_row(const mm_job *j, int64_t n, const int nt, int64_t cb, int64_t ce, float *acc) {
    const int64_t K = j->K, kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    const uint8_t *wr = (const uint8_t *)j->w + n * K;
    const uint8_t *srow = j->s + (n / FP8_BLOCK) * kb;
    const __m128i m7f = _mm_set1_epi8(0x7f);
    __m128i nanmax = _mm_setzero_si128();
    __m256 tot[DOT_GROUP];
    for (int t = 0; t < nt; t++) tot[t] = _mm256_setzero_ps();
    for (int64_t b = cb / FP8_BLOCK; b < (ce + FP8_BLOCK - 1) / FP8_BLOCK; b++) {
        const int64_t c0 = b * FP8_BLOCK, c1 = c0 + FP8_BLOCK < ce ? c0 + FP8_BLOCK : ce;
        __m256 pa[DOT_GROUP], pb[DOT_GROUP];
        for (int t = 0; t < nt; t++) pa[t] = pb[t] = _mm256_setzero_ps();
        for (int64_t c = c0; c < c1; c += 16) {
            __m128i v;
            const float *xs[DOT_GROUP];
            float xtail[DOT_GROUP][16];
            if (c + 16 <= c1) {
                v = _mm_loadu_si128((const __m128i *)(wr + c));
                for (int t = 0; t < nt; t++) xs[t] = j->x + t * K + c;
            } else { /* ragged end of the row: copy into zero-padded buffers */
                uint8_t tmp[16] = {0};
                memcpy(tmp, wr + c, (size_t)(c1 - c));
                v = _mm_loadu_si128((const __m128i *)tmp);
                for (int t = 0; t < nt; t++) {
                    memset(xtail[t], 0, sizeof xtail[t]);
                    memcpy(xtail[t], j->x + t * K + c, (size_t)(c1 - c) * 4);
                    xs[t] = xtail[t];
                }
            }
            _mm_prefetch((const char *)(wr + c + 1024), _MM_HINT_T0);
            nanmax = _mm_max_epu8(nanmax, _mm_and_si128(v, m7f));
            __m256i h = fp8_to_h16(v);
            __m256 f0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h)), f1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
            for (int t = 0; t < nt; t++) {
                pa[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[t]), f0, pa[t]);
                pb[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[t] + 8), f1, pb[t]);
            }
        }
        const uint8_t sb = srow[b];
        const float sf = ue8m0_f32[sb];
        for (int t = 0; t < nt; t++) {
            __m256 p = _mm256_add_ps(pa[t], pb[t]);
            if (sb <= 246) /* the x256 of the fp16 trick folds into the scale unless that would overflow */
                tot[t] = _mm256_fmadd_ps(p, _mm256_set1_ps(sf * 256.0f), tot[t]);
            else
                tot[t] = _mm256_fmadd_ps(_mm256_mul_ps(p, _mm256_set1_ps(256.0f)), _mm256_set1_ps(sf), tot[t]);
        }
    }
    const int nan = has_fp8_nan(nanmax);
    for (int t = 0; t < nt; t++) acc[t] += nan ? __builtin_nanf("") : hsum(tot[t]);
}

INLINE void bf16_dot_row(const mm_job *j, int64_t n, const int nt, int64_t cb, int64_t ce, float *acc) {
    const int64_t K = j->K;
    const uint16_t *wr = (const uint16_t *)j->w + n * K;
    const __m256i mhi = _mm256_set1_epi32((int)0xffff0000u);
    __m256 pa[DOT_GROUP], pb[DOT_GROUP];
    for (int t = 0; t < nt; t++) pa[t] = pb[t] = _mm256_setzero_ps();
    for (int64_t c = cb; c < ce; c += 16) {
        __m256i v;
        if (c + 16 <= ce) {
            v = _mm256_loadu_si256((const __m256i *)(wr + c));
        } else {
            uint16_t tmp[16] = {0};
            memcpy(tmp, wr + c, (size_t)(ce - c) * 2);
            v = _mm256_loadu_si256((const __m256i *)tmp);
        }
        _mm_prefetch((const char *)(wr + c + 512), _MM_HINT_T0);
        __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), o = _mm256_castsi256_ps(_mm256_and_si256(v, mhi));
        for (int t = 0; t < nt; t++) {
            const float *xt = j->xp + t * j->kp + c;
            pa[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xt), e, pa[t]);
            pb[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xt + 8), o, pb[t]);
        }
    }
    for (int t = 0; t < nt; t++) acc[t] += hsum(_mm256_add_ps(pa[t], pb[t]));
}

/* BF16 weights with 2-8 tokens (the LM head of a batched decode step or a verify pass): the same (row, token) sums
 * as bf16_dot_row, each the same two FMA chains in column order, so the bits do not depend on T. Rows in blocks of
 * BF_RB, a block's columns in K blocks of BF_KB, so the x of every token for one K block (8 tokens x 512 columns =
 * 16 KB, copied into K-block order) stays in L1 while it serves every row of the block; within a K block 2 rows and
 * 2 tokens at a time (8 accumulators of the 16 registers; each x load serves 2 rows, each widened weight vector 2
 * tokens), token pairs one after another over the 2 rows' K block, which the first pair brought into L1. Between K
 * blocks the chains wait in a small buffer. bf16_dot_row's shape (one row, 4 tokens over the whole row, tokens 5-8 in
 * a second pass) reads x from L2 once T * 16 KB leaves L1 and loads 9 vectors per 8 FMAs. */
#define BF_RB 8        /* rows per block (a multiple of 2) */
#define BF_KB 512      /* columns per K block (a multiple of 16) */
#define BF_PF_BLOCKS 2 /* how many K blocks ahead to prefetch (into L2) */

/* Rows w, w + K (NW of them), tokens 0..NT-1 of x (token t's column c at x[t * ldx + c - c0]), columns [c0, c1),
 * continuing the chains in st (row r, token t at st[(r * DOT_MAX + t) * 2], even and odd; zero when first). */
INLINE void bf16_span(const int NW, const int NT, const uint16_t *w, int64_t K, const float *x, int64_t ldx,
                      int64_t c0, int64_t c1, int first, __m256 *st, int64_t pf) {
    const __m256i mhi = _mm256_set1_epi32((int)0xffff0000u);
    __m256 pa[2][2], pb[2][2];
    for (int r = 0; r < NW; r++)
        for (int t = 0; t < NT; t++) {
            pa[r][t] = first ? _mm256_setzero_ps() : st[(r * DOT_MAX + t) * 2];
            pb[r][t] = first ? _mm256_setzero_ps() : st[(r * DOT_MAX + t) * 2 + 1];
        }
    for (int64_t c = c0; c < c1; c += 16) {
        __m256 e[2], o[2];
        for (int r = 0; r < NW; r++) {
            const uint16_t *wr = w + r * K + c;
            __m256i v;
            if (c + 16 <= c1) {
                v = _mm256_loadu_si256((const __m256i *)wr);
            } else {
                uint16_t tmp[16] = {0};
                memcpy(tmp, wr, (size_t)(c1 - c) * 2);
                v = _mm256_loadu_si256((const __m256i *)tmp);
            }
            if (pf) _mm_prefetch((const char *)(wr + pf), _MM_HINT_T1);
            e[r] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            o[r] = _mm256_castsi256_ps(_mm256_and_si256(v, mhi));
        }
        for (int t = 0; t < NT; t++) {
            const float *xt = x + t * ldx + (c - c0);
            __m256 xe = _mm256_loadu_ps(xt), xo = _mm256_loadu_ps(xt + 8);
            if (NW > 1) __asm__("" : "+x"(xe), "+x"(xo)); /* one load for both rows: the compiler would reload */
            for (int r = 0; r < NW; r++) {
                pa[r][t] = _mm256_fmadd_ps(xe, e[r], pa[r][t]);
                pb[r][t] = _mm256_fmadd_ps(xo, o[r], pb[r][t]);
            }
        }
    }
    for (int r = 0; r < NW; r++)
        for (int t = 0; t < NT; t++) {
            st[(r * DOT_MAX + t) * 2] = pa[r][t];
            st[(r * DOT_MAX + t) * 2 + 1] = pb[r][t];
        }
}

static void bf16_kblock(const mm_job *j, int64_t nb, int64_t ne, int64_t c0, int64_t c1, const float *xb, int64_t ldx,
                        int64_t pf, void *sums) {
    const int64_t K = j->K, T = j->T;
    const uint16_t *w = (const uint16_t *)j->w;
    __m256 *st = sums; /* row n - nb, token t: st[((n - nb) * DOT_MAX + t) * 2], even and odd */
    for (int64_t n = nb; n < ne;) {
        const int nw = n + 1 < ne ? 2 : 1;
        for (int64_t t = 0; t < T; t += 2) {
            /* the first token pair prefetches; the others find the rows' K block in L1 */
            const int64_t p = t ? 0 : pf;
            __m256 *s = st + ((n - nb) * DOT_MAX + t) * 2;
            const float *xt = xb + t * ldx;
            if (nw == 2 && t + 1 < T) bf16_span(2, 2, w + n * K, K, xt, ldx, c0, c1, c0 == 0, s, p);
            else if (nw == 2) bf16_span(2, 1, w + n * K, K, xt, ldx, c0, c1, c0 == 0, s, p);
            else if (t + 1 < T) bf16_span(1, 2, w + n * K, K, xt, ldx, c0, c1, c0 == 0, s, p);
            else bf16_span(1, 1, w + n * K, K, xt, ldx, c0, c1, c0 == 0, s, p);
        }
        n += nw;
    }
}

static void bf16_kblock_done(const mm_job *j, int64_t nb, int64_t ne, const void *sums) {
    const __m256 *st = sums;
    for (int64_t n = nb; n < ne; n++)
        for (int64_t t = 0; t < j->T; t++) {
            const __m256 *s = st + ((n - nb) * DOT_MAX + t) * 2;
            put(j, t, n, 0.0f + hsum(_mm256_add_ps(s[0], s[1])));
        }
}

static void bf16_dot_rows(const mm_job *j, int64_t n0, int64_t n1) {
    __m256 st[BF_RB * DOT_MAX * 2] __attribute__((aligned(32)));
    dot_kblocked(j, n0, n1, BF_RB, BF_KB, BF_PF_BLOCKS, st, bf16_kblock, bf16_kblock_done);
}

/* ---------------------------------------------------------------- tile path (prefill) */

/* wt[k * NR + r] holds W[n + r, k0 + k]; rows >= nr are zero. nanrows gets a bit per row with an FP8 NaN. */
typedef void (*tile_fn)(const mm_job *j, int64_t n, int nr, int64_t k0, int64_t kc, float *wt, uint32_t *nanrows);

/* Loads ndw (<= 8) dwords of 8 rows (rows >= `rows` read as zero) and transposes them: c[q] lane i = dword q of
 * row i. Replaces vpgatherdd, which is slow on AMD cores: 8 masked loads + 24 shuffles. */
INLINE void load_t8(const uint8_t *base, int64_t stride, int rows, int ndw, __m256i c[8]) {
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(ndw), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i r[8], t[8];
    for (int i = 0; i < 8; i++)
        r[i] = i < rows ? (ndw >= 8 ? _mm256_loadu_si256((const __m256i *)(base + i * stride))
                                    : _mm256_maskload_epi32((const int *)(base + i * stride), m))
                        : _mm256_setzero_si256();
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int g = 0; g < 2; g++) { /* r[4g+m] lane L = dword 4L+m of rows 4g..4g+3 */
        r[4 * g + 0] = _mm256_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        r[4 * g + 1] = _mm256_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        r[4 * g + 2] = _mm256_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        r[4 * g + 3] = _mm256_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int m4 = 0; m4 < 4; m4++) {
        c[m4] = _mm256_permute2x128_si256(r[m4], r[4 + m4], 0x20);
        c[4 + m4] = _mm256_permute2x128_si256(r[m4], r[4 + m4], 0x31);
    }
}

static void fp4_tile(const mm_job *j, int64_t n, int nr, int64_t k0, int64_t kc, float *wt, uint32_t *nanrows) {
    (void)nanrows;
    const int64_t half = j->K / 2, groups = j->K / FP4_GROUP;
    /* vpermps reads 3 index bits (the magnitude); the table is pre-XORed with index<<28 so XOR-ing in the whole
       nibble shifted to bits 28-31 restores the magnitude's bits and sets the sign bit in one step. */
    const __m256 tab = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)fp4_tab_c));
    for (int h = 0; h < NR / 8; h++) {
        const int rows = nr - 8 * h;
        if (rows <= 0) {
            for (int64_t k = 0; k < kc; k++) _mm256_store_ps(wt + k * NR + 8 * h, _mm256_setzero_ps());
            continue;
        }
        const uint8_t *base = (const uint8_t *)j->w + (n + 8 * h) * half + k0 / 2;
        const uint8_t *sb = j->s + (n + 8 * h) * groups + k0 / FP4_GROUP;
        for (int64_t b0 = 0; b0 < kc; b0 += 64) { /* 64 columns = 32 bytes = 8 dwords per row, 2 groups */
            __m256i c[8];
            const int ndw = (int)((kc - b0) / 8 < 8 ? (kc - b0) / 8 : 8);
            load_t8(base + b0 / 2, half, rows, ndw, c);
            __m256 sv[2];
            for (int g = 0; g < (ndw + 3) / 4; g++) {
                float sc[8];
                for (int r = 0; r < 8; r++) sc[r] = r < rows ? ue8m0_f32[sb[r * groups + (b0 + 32 * g) / FP4_GROUP]] : 0.0f;
                sv[g] = _mm256_loadu_ps(sc);
            }
            for (int q = 0; q < ndw; q++) {
                float *dst = wt + (b0 + 8 * q) * NR + 8 * h;
                __m256 v[8];
                for (int p = 0; p < 8; p++) {
                    __m256i nib = _mm256_srli_epi32(c[q], 4 * p);
                    v[p] = _mm256_mul_ps(_mm256_xor_ps(_mm256_permutevar8x32_ps(tab, nib), _mm256_castsi256_ps(_mm256_slli_epi32(nib, 28))), sv[q / 4]);
                }
                for (int p = 0; p < 8; p++) _mm256_store_ps(dst + p * NR, v[p]);
            }
        }
    }
}

static void fp8_tile(const mm_job *j, int64_t n, int nr, int64_t k0, int64_t kc, float *wt, uint32_t *nanrows) {
    const int64_t K = j->K, kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    const uint8_t sbyte = j->s[(n / FP8_BLOCK) * kb + k0 / FP8_BLOCK]; /* a tile sits inside one scale block */
    const float sf = ue8m0_f32[sbyte];
    const __m256 fac = _mm256_set1_ps(sf * 256.0f);
    /* per 128-bit lane (4 rows): words 0-3 = column a of rows 0-3, words 4-7 = column b; byte in the high half */
    const __m256i ctrl01 = _mm256_broadcastsi128_si256(_mm_setr_epi8(-128, 0, -128, 4, -128, 8, -128, 12, -128, 1, -128, 5, -128, 9, -128, 13));
    const __m256i ctrl23 = _mm256_broadcastsi128_si256(_mm_setr_epi8(-128, 2, -128, 6, -128, 10, -128, 14, -128, 3, -128, 7, -128, 11, -128, 15));
    const __m256i keep = _mm256_set1_epi16((short)0xbfff), top = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi8(-1);
    for (int h = 0; h < NR / 8; h++) {
        const int rows = nr - 8 * h;
        const uint8_t *base = (const uint8_t *)j->w + (n + 8 * h) * K + k0;
        const int64_t kv = sbyte <= 246 && rows > 0 ? kc / 4 : 0; /* whole dwords; huge scales go scalar */
        __m256i nan = _mm256_setzero_si256();
        for (int64_t q0 = 0; q0 < kv; q0 += 8) {
            __m256i c[8];
            const int ndw = (int)(kv - q0 < 8 ? kv - q0 : 8);
            load_t8(base + 4 * q0, K, rows, ndw, c);
            for (int q = 0; q < ndw; q++) {
                nan = _mm256_or_si256(nan, _mm256_cmpeq_epi8(_mm256_or_si256(c[q], top), ones));
                for (int pair = 0; pair < 2; pair++) {
                    __m256i y = _mm256_shuffle_epi8(c[q], pair ? ctrl23 : ctrl01);
                    y = _mm256_permute4x64_epi64(_mm256_and_si256(_mm256_srai_epi16(y, 1), keep), 0xd8);
                    float *dst = wt + (4 * (q0 + q) + 2 * pair) * NR + 8 * h;
                    _mm256_store_ps(dst, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(y)), fac));
                    _mm256_store_ps(dst + NR, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(y, 1)), fac));
                }
            }
        }
        int clean = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(nan, _mm256_setzero_si256())));
        *nanrows |= (uint32_t)(~clean & 0xff) << (8 * h);
        for (int64_t k = 4 * kv; k < kc; k++) /* ragged columns, absent rows, huge scales: exact scalar */
            for (int r = 0; r < 8; r++) wt[k * NR + 8 * h + r] = r < rows ? fp8_f32[base[r * K + k]] * sf : 0.0f;
    }
}

static void bf16_tile(const mm_job *j, int64_t n, int nr, int64_t k0, int64_t kc, float *wt, uint32_t *nanrows) {
    (void)nanrows;
    const int64_t K = j->K;
    const __m256i mhi = _mm256_set1_epi32((int)0xffff0000u);
    for (int h = 0; h < NR / 8; h++) {
        const int rows = nr - 8 * h;
        const uint16_t *base = (const uint16_t *)j->w + (n + 8 * h) * K + k0;
        const int64_t kv = rows > 0 ? kc / 2 : 0;
        for (int64_t q0 = 0; q0 < kv; q0 += 8) {
            __m256i c[8];
            const int ndw = (int)(kv - q0 < 8 ? kv - q0 : 8);
            load_t8((const uint8_t *)(base + 2 * q0), 2 * K, rows, ndw, c);
            for (int q = 0; q < ndw; q++) {
                _mm256_store_ps(wt + 2 * (q0 + q) * NR + 8 * h, _mm256_castsi256_ps(_mm256_slli_epi32(c[q], 16)));
                _mm256_store_ps(wt + (2 * (q0 + q) + 1) * NR + 8 * h, _mm256_castsi256_ps(_mm256_and_si256(c[q], mhi)));
            }
        }
        for (int64_t k = 2 * kv; k < kc; k++)
            for (int r = 0; r < 8; r++) {
                uint32_t u = r < rows ? (uint32_t)base[r * K + k] << 16 : 0;
                memcpy(&wt[k * NR + 8 * h + r], &u, 4);
            }
    }
}

/* out[t, n..n+nr) (+)= sum_k x[t, k] * wt[k, :] for mr tokens: 2*mr accumulators, w loaded once per k. */
INLINE void micro(const int mr, int64_t kc, const float *wt, const float *x, int64_t ldx, float *out, int64_t ldo, int nr, int store) {
    __m256 acc[MR][2];
    UNROLL
    for (int t = 0; t < mr; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        const __m256 w0 = _mm256_load_ps(wt + k * NR), w1 = _mm256_load_ps(wt + k * NR + 8);
        UNROLL
        for (int t = 0; t < mr; t++) {
            const __m256 b = _mm256_broadcast_ss(x + t * ldx + k);
            acc[t][0] = _mm256_fmadd_ps(b, w0, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(b, w1, acc[t][1]);
        }
    }
    UNROLL
    for (int t = 0; t < mr; t++) {
        float *o = out + t * ldo;
        if (nr == NR) {
            if (!store) {
                acc[t][0] = _mm256_add_ps(acc[t][0], _mm256_loadu_ps(o));
                acc[t][1] = _mm256_add_ps(acc[t][1], _mm256_loadu_ps(o + 8));
            }
            _mm256_storeu_ps(o, acc[t][0]);
            _mm256_storeu_ps(o + 8, acc[t][1]);
        } else {
            float tmp[NR];
            _mm256_storeu_ps(tmp, acc[t][0]);
            _mm256_storeu_ps(tmp + 8, acc[t][1]);
            for (int r = 0; r < nr; r++) o[r] = store ? tmp[r] : o[r] + tmp[r];
        }
    }
}

static void tile_rows(const mm_job *j, int64_t n0, int64_t n1, tile_fn deq) {
    float wt[KC * NR] __attribute__((aligned(64)));
    const int64_t T = j->T, K = j->K;
    const int64_t nblk = (T + MR - 1) / MR; /* balanced token blocks: 16 -> 6,5,5 */
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
                    case 1: micro(1, kc, wt, x, K, o, j->ldo, nr, store); break;
                    case 2: micro(2, kc, wt, x, K, o, j->ldo, nr, store); break;
                    case 3: micro(3, kc, wt, x, K, o, j->ldo, nr, store); break;
                    case 4: micro(4, kc, wt, x, K, o, j->ldo, nr, store); break;
                    case 5: micro(5, kc, wt, x, K, o, j->ldo, nr, store); break;
                    default: micro(6, kc, wt, x, K, o, j->ldo, nr, store); break;
                }
                t0 += mr;
            }
        }
        for (int r = 0; r < nr; r++)
            if (nanrows >> r & 1)
                for (int64_t t = 0; t < T; t++) j->out[t * j->ldo + n + r] = __builtin_nanf("");
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
    if (j->dot && j->T > 1) bf16_dot_rows(j, n0, n1);
    else if (j->dot) { DOT_DISPATCH(bf16_dot_row) } else tile_rows(j, n0, n1, bf16_tile);
}

static double fma_loop(int64_t iters) {
    __m256 a[12];
    const __m256 m = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(0.0001f);
    for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps((float)i);
    for (int64_t it = 0; it < iters; it++)
        for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], m, c);
    __m256 s = a[0];
    for (int i = 1; i < 12; i++) s = _mm256_add_ps(s, a[i]);
    volatile float sink = hsum(s);
    (void)sink;
    return (double)iters * 12 * 8 * 2;
}

static double read_sum(const uint8_t *p, size_t n) {
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    for (size_t i = 0; i + 128 <= n; i += 128) {
        s0 = _mm256_add_epi64(s0, _mm256_loadu_si256((const __m256i *)(p + i)));
        s1 = _mm256_add_epi64(s1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        s2 = _mm256_add_epi64(s2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        s3 = _mm256_add_epi64(s3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    s0 = _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3));
    int64_t r[4];
    _mm256_storeu_si256((__m256i *)r, s0);
    return (double)(r[0] + r[1] + r[2] + r[3]);
}

const isa_ops isa_avx2_ops = {
    .name = "avx2",
    .needs = "avx2 fma f16c",
    .vec = VEC_AVX2,
    .init = init_avx2,
    .dot_max = DOT_MAX,
    .fp4 = fp4_rows,
    .fp8 = fp8_rows,
    .bf16 = bf16_rows,
    .fp4_map = fp4_map,
    .fp8_map = NULL,
    .bf16_map = bf16_map,
    .fma_loop = fma_loop,
    .read_sum = read_sum,
};

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif /* FASTAR_X86 */
