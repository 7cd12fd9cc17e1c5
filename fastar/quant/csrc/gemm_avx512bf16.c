/* The bfloat16 tile path (prefill GEMM) of the FP4 and FP8 products on AVX512_BF16 (Zen 4/5, Sapphire Rapids and
 * later), called by kern_avx512bf16.c for T > DOT_MAX when every x of the call is an exact bfloat16 (dispatch.c
 * decides, see x_kind there: true of the official numerics' FP8-quantized activations).
 *
 * Owns: the cache-blocked GEMM out[t, n] (+)= sum_k x[t, k] W[n, k] with vdpbf16ps, two multiply-adds per lane
 * per instruction (twice the FP32 FMA rate). A tile of NR = 32 rows x KC = 128 columns is decoded once into L1
 * as bfloat16 pairs, wt[p][r] = (W[r, 2p], W[r, 2p+1]) (e4m3 and e2m1 values are exact bfloat16s), and every token
 * of the token panel (up to 512, see "Blocking") runs over it: MR8 = 12 tokens x 32 rows per microkernel call (24
 * accumulators), x[t, 2p..2p+1] broadcast as one dword from x's group of 12 tokens. Scales: FP8 has one per tile (a
 * tile sits in one 128 x 128 scale block), applied as out += sum * s; FP4 one per row and 32 columns, folded into
 * the decoded weights where that is exact (see FOLD_S_LO: then out += sum, 12 tokens a call like FP8), else
 * applied per 16 pairs as tot += partial * s, then out += tot (6 tokens a call; "out": the row tile's running
 * sums). Every product is exact in float32 and no partial sum is a denormal (x_kind's bounds, FOLD_S_LO's), and a
 * power-of-two scale multiplies exactly, so a result differs from the FP32 tile path (kern_avx512.c) only in
 * float32 summation order. A token's sums do not depend on T, on its place in the batch or on the rows a thread
 * owns (tiles start at multiples of 32 rows; whether an FP4 tile is folded depends on its scales and, through
 * mm_job.x_tiny, on the call's x having a nonzero value below 2^-64, which FP8-quantized activations do not).
 * Input: mm_job.xb = x as bfloat16 pairs in groups of TILE_XG = 12 tokens, pair-major within a group, groups of
 * kp / 2 pairs (K rounded up to KC, zero padded), 64-byte aligned (kernels.h; written by dispatch.c).
 * Where the time goes (Zen 4, one thread, per CPU-second against the vdpbf16ps peak): a tile's decode is a fixed
 * cost the tokens of the call share, ~1,500 dot-instruction slots for an FP8 tile (the transposition and five byte
 * permutes per 64 bytes of 16 rows) and ~750 for an FP4 one, against 128 slots per token; so FP8 4096 x 4096 runs
 * at ~50 % of the peak at T = 16, ~72 % at 64 and ~80-85 % from 128 on, the FP4 expert shapes at ~56 % at T = 24,
 * ~72 % at 64 and ~80 % at 192. The FP4 tile's scale bytes are read as one dword per row (a gather) and the fold
 * check and the folded exponents stay in vector registers, and the next tile's weights are prefetched into L2
 * while the tokens run over this one (its 32 rows are 32 streams K bytes apart, more than the hardware prefetchers
 * follow): before, the scalar scale loops (with a store-forwarding stall per vector of scales) and the wait for
 * the rows cost FP4 tiles 10-14 % at 24-64 tokens. What is left at large T is the microkernel's own: the
 * read-modify-write of the running sums per 128-column k-block (FP8's scale is per 128 x 128 block) and the loads.
 *
 * AMX seam: an AMX-BF16 variant (tdpbf16ps on 16 x 32 bfloat16 tiles) would take the same inputs (pair-
 * interleaved weight tiles are AMX's B layout, x rows its A layout) as another isa_ops with its own
 * fp4_tile_bf16 / fp8_tile_bf16; none of the machines this is tested on has AMX, so none is written.
 * Does not own: argument checks, the choice of path, the bfloat16 copy of x, threading (bindings, dispatch.c, pool.c).
 */
#include "kernels.h"

#if FASTAR_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi,avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi,avx2,fma,f16c")
#endif
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "kern_avx512.h"

#define NR 32 /* tile rows (2 vectors of 16) */
#define KC 128
#define KP (KC / 2) /* bfloat16 pairs per tile row */
#define MR8 12      /* tokens per FP8 microkernel call: 24 accumulators */
#define MR4 6       /* tokens per FP4 microkernel call on a tile with scales kept apart: 12 partial sums + 12 totals */
_Static_assert(MR8 == TILE_XG && TILE_XG % MR4 == 0, "token blocks are x's groups or halves of them");
#define BH(v) ((__m512bh)(v))

static uint16_t fp4_bf16[32];                      /* bfloat16 of the e2m1 value of (i & 15) */
static uint8_t fp8_bf16_hi[128], fp8_bf16_lo[128]; /* high / low byte of the bfloat16 of e4m3 magnitude i */
static uint8_t pair_idx[2][64];                    /* vpermt2b indices, see fp8_tile_bf16 */

void gemm_bf16_init(void) {
    for (int i = 0; i < 32; i++) {
        uint32_t u;
        memcpy(&u, &fp4_f32[i & 15], 4);
        fp4_bf16[i] = (uint16_t)(u >> 16);
    }
    for (int i = 0; i < 128; i++) {
        uint32_t u;
        memcpy(&u, &fp8_f32[i], 4);
        fp8_bf16_hi[i] = (uint8_t)(u >> 24);
        fp8_bf16_lo[i] = (uint8_t)(u >> 16);
    }
    /* dword i of output j (j = 0: columns 0, 1 of the dword's 4; j = 1: columns 2, 3) = lo[4i+2j], hi[4i+2j],
     * lo[4i+2j+1], hi[4i+2j+1]; index bit 6 picks the second table (hi) */
    for (int j = 0; j < 2; j++)
        for (int i = 0; i < 16; i++)
            for (int b = 0; b < 4; b++) pair_idx[j][4 * i + b] = (uint8_t)(4 * i + 2 * j + (b >> 1) + (b & 1 ? 64 : 0));
}

/* FP8 tile: rows n..n+nr-1, columns k0..k0+kc-1 -> wt[p * NR + r] for p < ceil(kc / 2); columns past kc are zero.
 * Per 16 rows and 4 columns (one transposed dword per row): vpermi2b looks up the low and the high byte of each
 * byte's bfloat16 (index: the low 7 bits), the sign goes into the high byte, vpermt2b pairs them up. */
static void fp8_tile_bf16(const mm_job *j, int64_t n, int nr, int64_t k0, int64_t kc, uint32_t *wt) {
    const int64_t K = j->K;
    const __m512i tl0 = _mm512_loadu_si512((const void *)fp8_bf16_lo), tl1 = _mm512_loadu_si512((const void *)(fp8_bf16_lo + 64));
    const __m512i th0 = _mm512_loadu_si512((const void *)fp8_bf16_hi), th1 = _mm512_loadu_si512((const void *)(fp8_bf16_hi + 64));
    const __m512i i0 = _mm512_loadu_si512((const void *)pair_idx[0]), i1 = _mm512_loadu_si512((const void *)pair_idx[1]);
    const __m512i top = _mm512_set1_epi8((char)0x80);
    for (int h = 0; h < NR / 16; h++) {
        const int rows = nr - 16 * h > 16 ? 16 : nr - 16 * h;
        const uint8_t *base = (const uint8_t *)j->w + (n + 16 * h) * K + k0;
        for (int64_t b0 = 0; b0 < KC; b0 += 64) {
            __m512i c[16];
            if (rows <= 0 || b0 >= kc) {
                for (int q = 0; q < 16; q++) c[q] = _mm512_setzero_si512();
            } else {
                load_t16(base + b0, K, rows, kc - b0, c); /* bytes past kc read as zero: e4m3 +0 */
            }
            for (int q = 0; q < 16; q++) {
                const __m512i lo = _mm512_permutex2var_epi8(tl0, c[q], tl1);
                const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(th0, c[q], th1), c[q], top, 0xf8);
                const int64_t p = (b0 + 4 * q) / 2;
                _mm512_store_si512((void *)(wt + p * NR + 16 * h), _mm512_permutex2var_epi8(lo, i0, hi));
                _mm512_store_si512((void *)(wt + (p + 1) * NR + 16 * h), _mm512_permutex2var_epi8(lo, i1, hi));
            }
        }
    }
}

/* FP4 scale folding. A tile whose every UE8M0 scale byte is in [FOLD_S_LO, FOLD_S_HI] (2^-54 ... 2^38) decodes
 * e2m1 * 2^e straight into its bfloat16s (the exponent field plus e, zeros stay zero): exact, since bfloat16 has
 * float32's exponent range. Then its products need no per-32-column scale, and the FP4 microkernel runs MR8 tokens
 * like FP8's (before: MR4 = 6, for 12 partial sums + 12 totals). Bounds, with dispatch.c's guarantee for a tile call
 * without x_tiny (every x is an exact bfloat16, zero or 2^-64 <= |x| < 2^65, so x's quantum >= 2^-71): a folded
 * weight's quantum is 2^(e-1) >= 2^-55 and |w| <= 6 * 2^e, so every product is exact in float32 and a multiple of
 * 2^-126 (no partial sum is a denormal, which vdpbf16ps would flush), and for K <= 2^21 no partial sum reaches
 * 2^21 * 2^65 * 2^41 = 2^127 (no overflow the scaled sums would not also show). Other tiles (a scale outside the
 * range, NaN's 255 included), and every tile of a call with x_tiny or K > 2^21, keep the scales in float32
 * (micro4). The choice depends on the weights and on the whole call's x only, never on a token's place in it. */
#define FOLD_S_LO (127 - 54)
#define FOLD_S_HI (127 + 38)
#define FOLD_K_MAX (1 << 21)

/* FP4 tile (kc a multiple of 32): as fp8_tile_bf16; a transposed dword holds columns 8q..8q+7 as its nibbles 0..7,
 * and pair m takes nibbles 2m, 2m+1 into the low 5 bits of its two words (vpermw's index; the table repeats every
 * 16, so the fifth bit does not matter). Returns 1 when the tile's scales are folded into wt (see FOLD_S_LO), else
 * 0 with sv[g][h] lane i = the scale of row n + 16h + i, group g. */
INLINE __mmask16 row_mask(int rows) { return rows >= 16 ? (__mmask16)0xffff : rows <= 0 ? 0 : (__mmask16)((1u << rows) - 1); }

/* The scale bytes of groups g0..g0+3 of 16 rows (groups bytes apart) as one dword per row, rows past `rows` set to
 * 127 (2^0, what a missing row's lane needs: no fold veto, adj 0). A full tile (kc == KC) reads the 4 bytes of each
 * row with one gather; a short one (K's last, ng < 4 groups) byte by byte, the missing groups 127 too. */
INLINE __m512i scale_dwords(const uint8_t *sb, int64_t groups, int rows, int ng) {
    const __m512i ones = _mm512_set1_epi32(0x7f7f7f7f);
    if (ng == 4) {
        const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32((int)groups));
        return _mm512_mask_i32gather_epi32(ones, row_mask(rows), idx, (const void *)sb, 1);
    }
    uint32_t d[16];
    for (int r = 0; r < 16; r++) {
        d[r] = 0x7f7f7f7fu;
        for (int g = 0; g < ng && r < rows; g++) d[r] = (d[r] & ~(0xffu << 8 * g)) | (uint32_t)sb[r * groups + g] << 8 * g;
    }
    return _mm512_loadu_si512((const void *)d);
}

static int fp4_tile_bf16(const mm_job *j, int64_t n, int nr, int64_t k0, int64_t kc, uint32_t *wt, __m512 sv[4][2]) {
    const int64_t half = j->K / 2, groups = j->K / FP4_GROUP;
    const int ng = (int)(kc / FP4_GROUP);
    const __m512i tab = _mm512_loadu_si512((const void *)fp4_bf16), lowbyte = _mm512_set1_epi32(0xff);
    const __m512i mag = _mm512_set1_epi16(0x7fff), hiword = _mm512_set1_epi32((int)0xffff0000u);
    __m512i sd[NR / 16]; /* per half: lane i = the scale bytes of row n + 16h + i, byte g = group g */
    int fold = !j->x_tiny && j->K <= FOLD_K_MAX;
    for (int h = 0; h < NR / 16; h++) {
        const int rows = nr - 16 * h > 16 ? 16 : nr - 16 * h;
        sd[h] = scale_dwords(j->s + (n + 16 * h) * groups + k0 / FP4_GROUP, groups, rows, ng);
        fold &= !(_mm512_cmplt_epu8_mask(sd[h], _mm512_set1_epi8((char)FOLD_S_LO)) |
                  _mm512_cmpgt_epu8_mask(sd[h], _mm512_set1_epi8((char)FOLD_S_HI)));
    }
    for (int h = 0; h < NR / 16; h++) {
        const int rows = nr - 16 * h > 16 ? 16 : nr - 16 * h;
        __m512i adj[4]; /* fold: per group, (e << 7) in both words of row i's dword */
        for (int g = 0; g < ng; g++) {
            if (fold) {
                const __m512i e7 = _mm512_and_si512(
                    _mm512_slli_epi32(_mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(sd[h], 8 * g), lowbyte),
                                                       _mm512_set1_epi32(127)), 7),
                    _mm512_set1_epi32(0xffff));
                adj[g] = _mm512_or_si512(e7, _mm512_slli_epi32(e7, 16));
            } else {
                float sc[16];
                const uint8_t *sb = j->s + (n + 16 * h) * groups + k0 / FP4_GROUP;
                for (int r = 0; r < 16; r++) sc[r] = r < rows ? ue8m0_f32[sb[r * groups + g]] : 0.0f;
                sv[g][h] = _mm512_loadu_ps(sc);
            }
        }
        __m512i c[16];
        if (rows <= 0) {
            for (int q = 0; q < 16; q++) c[q] = _mm512_setzero_si512();
        } else {
            load_t16((const uint8_t *)j->w + (n + 16 * h) * half + k0 / 2, half, rows, kc / 2, c);
        }
        for (int q = 0; q < kc / 8; q++)
            for (int m = 0; m < 4; m++) {
                /* low word: byte m (nibble 2m in its low 4 bits), high word: nibble 2m + 1 at bit 16; one ternlog
                 * takes the low word from one shift of c and the high from another (vpermw reads 5 bits of each) */
                const __m512i lo = m ? _mm512_srli_epi32(c[q], 8 * m) : c[q];
                const __m512i hi = m < 2 ? _mm512_slli_epi32(c[q], 12 - 8 * m) : _mm512_srli_epi32(c[q], 8 * m - 12);
                __m512i v = _mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(hiword, hi, lo, 0xca), tab);
                if (fold) v = _mm512_mask_add_epi16(v, _mm512_test_epi16_mask(v, mag), v, adj[q / 4]);
                _mm512_store_si512((void *)(wt + (4 * q + m) * NR + 16 * h), v);
            }
    }
    return fold;
}

/* tb rows of nr (<= NR) floats from s (lds apart) to d (ldd apart): inline, where memcpy's call per 128-byte row took
 * ~5 % of a 512-token product. */
static void copy_rows(float *d, int64_t ldd, const float *s, int64_t lds, int64_t tb, int nr) {
    const __mmask16 m0 = row_mask(nr), m1 = row_mask(nr - 16);
    for (int64_t t = 0; t < tb; t++) {
        _mm512_mask_storeu_ps(d + t * ldd, m0, _mm512_maskz_loadu_ps(m0, s + t * lds));
        _mm512_mask_storeu_ps(d + t * ldd + 16, m1, _mm512_maskz_loadu_ps(m1, s + t * lds + 16));
    }
}

/* out[t, r] (+)= s * sum over np pairs, for mr tokens (x: the tokens' bfloat16 pairs of the tile's columns, pair p of
 * token t at x[p * TILE_XG + t]). */
INLINE void micro8(const int mr, int np, const uint32_t *wt, const uint32_t *x, float s, float *out,
                   int64_t ldo, int nr, int store) {
    __m512 acc[MR8][2];
    UNROLL
    for (int t = 0; t < mr; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    for (const uint32_t *w = wt, *we = wt + np * NR; w < we; w += NR, x += TILE_XG) { /* pointers: constant offsets */
        const __m512i w0 = _mm512_load_si512((const void *)w), w1 = _mm512_load_si512((const void *)(w + 16));
        UNROLL
        for (int t = 0; t < mr; t++) {
            const __m512i b = _mm512_set1_epi32((int)x[t]);
            acc[t][0] = _mm512_dpbf16_ps(acc[t][0], BH(b), BH(w0));
            acc[t][1] = _mm512_dpbf16_ps(acc[t][1], BH(b), BH(w1));
        }
    }
    const __mmask16 m0 = row_mask(nr), m1 = row_mask(nr - 16);
    const __m512 sv = _mm512_set1_ps(s);
    UNROLL
    for (int t = 0; t < mr; t++) {
        float *o = out + t * ldo;
        if (store) {
            _mm512_mask_storeu_ps(o, m0, _mm512_mul_ps(acc[t][0], sv));
            _mm512_mask_storeu_ps(o + 16, m1, _mm512_mul_ps(acc[t][1], sv));
        } else {
            _mm512_mask_storeu_ps(o, m0, _mm512_fmadd_ps(acc[t][0], sv, _mm512_maskz_loadu_ps(m0, o)));
            _mm512_mask_storeu_ps(o + 16, m1, _mm512_fmadd_ps(acc[t][1], sv, _mm512_maskz_loadu_ps(m1, o + 16)));
        }
    }
}

/* FP4: per scale group (16 pairs) a partial sum, then tot += partial * scale; out (+)= tot. */
INLINE void micro4(const int mr, int ng, const uint32_t *wt, const uint32_t *x, __m512 sv[4][2],
                   float *out, int64_t ldo, int nr, int store) {
    __m512 tot[MR4][2];
    UNROLL
    for (int t = 0; t < mr; t++) tot[t][0] = tot[t][1] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++) {
        __m512 part[MR4][2];
        UNROLL
        for (int t = 0; t < mr; t++) part[t][0] = part[t][1] = _mm512_setzero_ps();
        const uint32_t *xg = x + 16 * g * TILE_XG;
        for (const uint32_t *w = wt + 16 * g * NR, *we = w + 16 * NR; w < we; w += NR, xg += TILE_XG) {
            const __m512i w0 = _mm512_load_si512((const void *)w), w1 = _mm512_load_si512((const void *)(w + 16));
            UNROLL
            for (int t = 0; t < mr; t++) {
                const __m512i b = _mm512_set1_epi32((int)xg[t]);
                part[t][0] = _mm512_dpbf16_ps(part[t][0], BH(b), BH(w0));
                part[t][1] = _mm512_dpbf16_ps(part[t][1], BH(b), BH(w1));
            }
        }
        UNROLL
        for (int t = 0; t < mr; t++) {
            tot[t][0] = _mm512_fmadd_ps(part[t][0], sv[g][0], tot[t][0]);
            tot[t][1] = _mm512_fmadd_ps(part[t][1], sv[g][1], tot[t][1]);
        }
    }
    const __mmask16 m0 = row_mask(nr), m1 = row_mask(nr - 16);
    UNROLL
    for (int t = 0; t < mr; t++) {
        float *o = out + t * ldo;
        if (!store) {
            tot[t][0] = _mm512_add_ps(tot[t][0], _mm512_maskz_loadu_ps(m0, o));
            tot[t][1] = _mm512_add_ps(tot[t][1], _mm512_maskz_loadu_ps(m1, o + 16));
        }
        _mm512_mask_storeu_ps(o, m0, tot[t][0]);
        _mm512_mask_storeu_ps(o + 16, m1, tot[t][1]);
    }
}

/* Blocking. A call runs in token panels of at most T_PANEL tokens (rounded up to whole groups of x); within one, in K
 * panels of kcp columns (a multiple of KC), sized so that the panel of x (tb rows x kcp bfloat16s, <= X_PANEL_BYTES:
 * an L2; 4 and 8 MB measured slower at K = 8192) stays close while every
 * tile of the thread's rows runs over it. A weight tile is so decoded once per token panel (for T <= T_PANEL: once
 * per call), not once per ~60 tokens as when the panel spanned all of K (K = 8192: 1 MB / 16 KB rows), and the
 * x panel is read from L3 once per K panel and thread chunk. The running sums of a tile's rows live in a
 * contiguous scratch [tb][NR] for the K panel, loaded from out and written back once: out's own rows are N floats
 * apart, a power of two for most products, and the rows of a token block fell into the same few L1 and L2 sets
 * (N = 32768: every row in one L2 set). The k-blocks of a row still add into its running sum in ascending order,
 * one fma (FP8) or add (FP4) each, so the bits do not depend on T, on the panels or on the thread's rows. */
#define X_PANEL_BYTES (1 << 20)
#define T_PANEL 512

typedef void (*tile_fn)(const mm_job *j, int64_t n, int nr, int64_t ts, int64_t tb, int64_t k1, int64_t k2,
                        uint32_t *wt, float *c, int store);

/* The x of token t (t - ts a multiple of TILE_XG at a block's start) at column k0 (see mm_job.xb). */
INLINE const uint32_t *x_at(const mm_job *j, int64_t t, int64_t k0) {
    return (const uint32_t *)j->xb + (t / TILE_XG) * (j->kp / 2) * TILE_XG + (k0 / 2) * TILE_XG + t % TILE_XG;
}

/* The weight bytes of the tile after (n, k0) (the next k-block of the row tile, or after k2 the next row tile's
 * first) into L2 while the tokens run over this one: a tile's 32 rows are 32 streams K bytes apart, too many for the
 * hardware prefetchers, and at a few dozen tokens the decode waited on them. Prefetches do not fault, but stay
 * inside the matrix anyway. */
INLINE void prefetch_next(const mm_job *j, int64_t n, int64_t k0, int64_t k1, int64_t k2, int64_t row_bytes,
                          int64_t col_bytes_num, int64_t col_bytes_den) {
    int64_t nn = n, kk = k0 + KC;
    if (kk >= k2) nn += NR, kk = k1;
    if (nn >= j->N) return;
    const int64_t rows = j->N - nn < NR ? j->N - nn : NR, kc = j->K - kk < KC ? j->K - kk : KC;
    const uint8_t *w = (const uint8_t *)j->w + nn * row_bytes + kk * col_bytes_num / col_bytes_den;
    const int64_t bytes = (kc * col_bytes_num + col_bytes_den - 1) / col_bytes_den;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)(w + r * row_bytes + b), _MM_HINT_T1);
}

/* FP8: k-blocks [k1, k2) of row tile n for tokens ts..ts+tb-1 (ts a multiple of TILE_XG), running sums in c [tb][NR];
 * store: the first k-block writes (k1 == 0 and not accumulating). Token blocks: x's groups of TILE_XG = MR8. */
static void fp8_tile_tokens(const mm_job *j, int64_t n, int nr, int64_t ts, int64_t tb, int64_t k1, int64_t k2,
                            uint32_t *wt, float *c, int store) {
    const int64_t K = j->K, kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    for (int64_t k0 = k1; k0 < k2; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        const int np = (int)((kc + 1) / 2);
        fp8_tile_bf16(j, n, nr, k0, kc, wt);
        prefetch_next(j, n, k0, k1, k2, K, 1, 1);
        const float s = ue8m0_f32[j->s[(n / FP8_BLOCK) * kb + k0 / FP8_BLOCK]];
        const int st = store && k0 == k1;
        for (int64_t t0 = 0; t0 < tb; t0 += MR8) {
            const int mr = tb - t0 < MR8 ? (int)(tb - t0) : MR8;
            const uint32_t *x = x_at(j, ts + t0, k0);
            float *o = c + t0 * NR;
            switch (mr) {
#define MCASE(M) case M: micro8(M, np, wt, x, s, o, NR, nr, st); break;
                MCASE(1) MCASE(2) MCASE(3) MCASE(4) MCASE(5) MCASE(6)
                MCASE(7) MCASE(8) MCASE(9) MCASE(10) MCASE(11)
                default: micro8(MR8, np, wt, x, s, o, NR, nr, st); break;
#undef MCASE
            }
        }
    }
}

/* FP4: as FP8; a folded tile runs micro8 over x's groups, another micro4 over half groups (MR4 = MR8 / 2). */
static void fp4_tile_tokens(const mm_job *j, int64_t n, int nr, int64_t ts, int64_t tb, int64_t k1, int64_t k2,
                            uint32_t *wt, float *c, int store) {
    const int64_t K = j->K;
    for (int64_t k0 = k1; k0 < k2; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC; /* a multiple of 32 */
        const int ng = (int)(kc / FP4_GROUP);
        __m512 sv[4][2];
        const int folded = fp4_tile_bf16(j, n, nr, k0, kc, wt, sv), mb = folded ? MR8 : MR4;
        prefetch_next(j, n, k0, k1, k2, K / 2, 1, 2);
        const int st = store && k0 == k1;
        for (int64_t t0 = 0; t0 < tb; t0 += mb) {
            const int mr = tb - t0 < mb ? (int)(tb - t0) : mb;
            const uint32_t *x = x_at(j, ts + t0, k0);
            float *o = c + t0 * NR;
            if (folded) { /* scales in wt: one sum per token and row, out (+)= sum * 1 (exact) */
                switch (mr) {
#define MCASE(M) case M: micro8(M, (int)(kc / 2), wt, x, 1.0f, o, NR, nr, st); break;
                    MCASE(1) MCASE(2) MCASE(3) MCASE(4) MCASE(5) MCASE(6)
                    MCASE(7) MCASE(8) MCASE(9) MCASE(10) MCASE(11)
                    default: micro8(MR8, (int)(kc / 2), wt, x, 1.0f, o, NR, nr, st); break;
#undef MCASE
                }
            } else {
                switch (mr) {
#define MCASE(M) case M: micro4(M, ng, wt, x, sv, o, NR, nr, st); break;
                    MCASE(1) MCASE(2) MCASE(3) MCASE(4) MCASE(5)
                    default: micro4(MR4, ng, wt, x, sv, o, NR, nr, st); break;
#undef MCASE
                }
            }
        }
    }
}

/* Rows [n0, n1) of a call: token panels, K panels, row tiles. c holds the running sums of one row tile for a token
 * panel; when it cannot be allocated, the panels are cut to MR8 tokens over a stack scratch (more weight decoding,
 * the same bits: a token's sums do not depend on its panel). Panels start at multiples of TILE_XG tokens. */
static void tile_rows(const mm_job *j, int64_t n0, int64_t n1, tile_fn fn) {
    uint32_t wt[KP * NR] __attribute__((aligned(64)));
    float small[MR8 * NR] __attribute__((aligned(64)));
    const int64_t T = j->T, K = j->K, ntp = (T + T_PANEL - 1) / T_PANEL;
    const int64_t tmax = ((T + ntp - 1) / ntp + TILE_XG - 1) / TILE_XG * TILE_XG; /* panels start on x's groups */
    float *heap = aligned_alloc(64, (size_t)tmax * NR * sizeof(float)), *c = heap ? heap : small;
    const int64_t tcap = heap ? tmax : MR8;
    for (int64_t t1 = 0; t1 < T; t1 += tcap) {
        const int64_t tb = T - t1 < tcap ? T - t1 : tcap;
        int64_t kcp = X_PANEL_BYTES / (2 * tb) / KC * KC;
        if (kcp < KC) kcp = KC;
        for (int64_t k1 = 0; k1 < K; k1 += kcp) {
            const int64_t k2 = K - k1 < kcp ? K : k1 + kcp;
            const int store = k1 == 0 && !j->accumulate; /* else continue from out */
            for (int64_t n = n0; n < n1; n += NR) {
                const int nr = n1 - n < NR ? (int)(n1 - n) : NR;
                float *o = j->out + t1 * j->ldo + n;
                if (!store) copy_rows(c, NR, o, j->ldo, tb, nr);
                fn(j, n, nr, t1, tb, k1, k2, wt, c, store);
                copy_rows(o, j->ldo, c, NR, tb, nr);
            }
        }
    }
    free(heap);
}

void fp8_tile_bf16_rows(const mm_job *j, int64_t n0, int64_t n1) { tile_rows(j, n0, n1, fp8_tile_tokens); }

void fp4_tile_bf16_rows(const mm_job *j, int64_t n0, int64_t n1) { tile_rows(j, n0, n1, fp4_tile_tokens); }

/* The bf16 tile path's instruction peak, measured like the FP32 FMA peak (isa_ops.fma_loop): 12 independent
 * vdpbf16ps chains; returns the flops executed (2 per multiply-add, 64 per instruction). */
double bf16_dot_loop(int64_t iters) {
    __m512 a[12];
    const __m512i m = _mm512_set1_epi32(0x3f803f80), c = _mm512_set1_epi32(0x38003800); /* bf16 pairs (1, 1), tiny */
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps((float)i);
    for (int64_t it = 0; it < iters; it++)
        for (int i = 0; i < 12; i++) a[i] = _mm512_dpbf16_ps(a[i], BH(m), BH(c));
    __m512 s = a[0];
    for (int i = 1; i < 12; i++) s = _mm512_add_ps(s, a[i]);
    volatile float sink = _mm512_reduce_add_ps(s);
    (void)sink;
    return (double)iters * 12 * 16 * 4;
}

#if defined(__clang__)
#pragma clang attribute pop
#endif
#else /* no SIMD files: stubs for the declarations (no ISA table sets tile_bf16 here) */
double bf16_dot_loop(int64_t iters) { (void)iters; return 0.0; }
void gemm_bf16_init(void) {}
void fp8_tile_bf16_rows(const mm_job *j, int64_t n0, int64_t n1) { (void)j, (void)n0, (void)n1; }
void fp4_tile_bf16_rows(const mm_job *j, int64_t n0, int64_t n1) { (void)j, (void)n0, (void)n1; }
#endif /* FASTAR_X86 */
