/* AVX-512 + AVX512_BF16 + AVX512_VBMI kernels (Zen 4/5, Sapphire Rapids and later), chosen at run time by
 * dispatch.c ("avx512bf16"; set_isa("avx512") turns them off).
 *
 * Owns: the bfloat16 dot path of the FP4 and FP8 products. When every x of a call is a bfloat16 (dispatch.c
 * checks, see x_kind there; true of the official numerics' FP8-quantized activations), x arrives as
 * bfloat16 pairs (mm_job.xb, columns in this file's order) and vdpbf16ps multiplies it by the weights widened
 * to bfloat16: e4m3 and e2m1 values are all bfloat16 normals (or zero, or NaN), every product is exact in
 * float32, so the result differs from the FP32 dot path only in float32 summation order. Scales are applied in
 * float32 to each scale group's partial sum, as in kern_avx512.c. Everything else (arbitrary x, BF16 weights,
 * T > DOT_MAX) runs the AVX-512 kernels of kern_avx512.c.
 * Structure: two rows per pass (_row2, PAIR_DISPATCH below), so each 64-byte load of x feeds two vdpbf16ps (with one
 * row, loads of x and dot instructions both run at one per cycle, and the loads set the speed), and all T <= DOT_MAX
 * tokens of a call in one pass, so each weight block is read and widened to bfloat16 once (passes of 4 tokens, as
 * before, did both twice for T = 5..8). One token took one row per pass until the FP4 experts measured 5-16 % faster
 * at T = 1 with pairs too (CPU time per call, 2 threads, DRAM-fed, scripts/dot_rows_ab.py's experts case).
 * Measured on Zen 4, 2 threads, DRAM-fed Flash shapes (scripts/dot_rows_ab.py): the FP4 experts at T = 2 +9 % (T = 2
 * took one row per pass before), FP8 4096x4096 at T = 6 +15 %; T = 3, 4, 8 within a few % either way. At T = 8 the
 * 32 totals of a pair do not fit the 32 registers and the compiler keeps some in L1. Every (row, token) sum is the
 * same sequence of float operations whatever the path, T or the pass.
 * FP8 weights (every T) fold their scales into x instead where they can (fp8_rows_folded): a UE8M0 scale is a power of
 * two, so x times the scale of its 128x128 block is exact while it stays in range, and each (row, token) sum is then one
 * chain of vdpbf16ps over the whole row, 4 rows and up to 4 tokens per pass (5-8 tokens 2 rows per pass where their x'
 * stays in L1, else in two passes of 4 rows; see fp8_fold_rows): per 128 columns and (row, token) 4 vdpbf16ps and no
 * add or FMA, each load of x serving 4 rows. A (token, row block) whose x' would leave the range, or whose block has a
 * NaN scale, keeps the per-block scales above (one token at a time; the choice depends on that token and block alone,
 * so batch invariance holds). Measured (scripts/dot_rows_ab.py, 2 threads, DRAM-fed,
 * memory ~34 GB/s in the run): FP8 4096x4096 at T = 4 27.3 GB/s against 20.9 (x1.31), 32768x1024 31.8 against 23.7
 * (x1.34); T = 1, 2 within the run's noise to +10 %. In CPU time per call (to see past other jobs on the machine;
 * memory 25-36 GB/s): 4096x4096 T = 1 0.98x, 2 1.02x, 4 1.31x, 5 1.06x, 8 1.37x; 32768x1024 T = 1 1.02x, 2 1.10x,
 * 4 1.46x, 6 1.07x, 8 1.24x.
 * Per 128-column stretch (an FP4 chunk, an unfolded FP8 block) and (row, token), one chain of 4 vdpbf16ps (w[0..3] in
 * order, from zero) and one FMA with the scales into the total: 5 zmm ops per token, not the 6 of two chains of two
 * and an add. On Zen 4 every 512-bit op here issues at about one per cycle, so the FP4 experts at T = 1..4 are bound by
 * the ops per weight byte (per row and chunk: 3 shifts and 4 vpermw to widen, 2 for the scales, 5 per token) whenever
 * memory is fast. Measured (scripts/dot_rows_ab.py's experts case in CPU time per call on 1 thread, which other jobs
 * on the machine disturb less; weights L3-fed, two runs): T = 1 x1.04 and x1.04, 2 x1.04 and x1.06, 3 x1.04 and
 * x1.02, 4 x1.05 and x1.02, 8 x1.02 and x1.01; DRAM-fed (memory 31 GB/s): T = 1 x1.02, 3 x1.04, 2, 4, 8 x0.99-1.00.
 * In wall time on 2 threads, DRAM-fed (memory 34 GB/s, one of three probes 9: a busy machine), T = 1..8 x0.97, 1.02,
 * 1.10, 1.06, 1.20, where the unchanged folded FP8 kernel read x0.82-1.24 in the same run.
 * Tried and dropped: the scales of 4 chunks from one 16-byte load (widened and shifted once, one vpermps per chunk)
 * x0.99 at T = 1, x0.79-0.95 at T = 3..8; one total per row instead of two alternating ones (chunk c into total c % 2)
 * x0.96 at T = 1, x1.02-1.07 at T = 4..8 over the one-chain kernel; fp4_chunk's scale vector widened and shifted in
 * 128 bits with one 512-bit vpermd (instead of a 512-bit vpshufb and shift) x0.97-1.02 at T = 1..8.
 * Also the vectorized preparation of the dot path's x, called by dispatch.c (x_scan: x_kind's test; x_bf16: the
 * permuted bfloat16 copy): at 8 rows the portable loops, one thread working while the other waited, were ~10 % of
 * the grouped wo_a product's time and ~2.5 % of a 4-layer decode step.
 * Does not own: argument checks, the choice of path, threading (bindings, dispatch.c, pool.c).
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

#define BH(v) ((__m512bh)(v)) /* bfloat16 pairs: the same 512 bits */
#define PAIR_GROUP DOT_MAX /* the row-pair kernels take every token of a call in one pass */
/* Software prefetch distance in weight bytes. These kernels consume a row several times faster than the FP32 ones,
 * so they prefetch further ahead (measured: 2 KB loses a third of the DRAM-fed T=4 speed to 8 KB). Into L2, not L1
 * (PF_HINT): a prefetch to L1 holds one of the core's few L1 miss buffers until the line arrives, which caps the
 * lines in flight, so one core streamed 13 GB/s from DRAM at T = 1 and 10 at T = 4; to L2, 21 and 13 (the loads
 * then hit L2, a dozen cycles the out-of-order core hides). */
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
#define PF_DIST 8192
#define PF_FOLD 8192 /* the folded FP8 kernel's, in the order it reads its rows (measured: 16 KB no better) */
#ifndef PF_DIST2
#define PF_DIST2 16384
#endif

static uint8_t fp4_map[XP_CHUNK], bf16_map[XP_CHUNK]; /* kern_avx512.c's, for its FP32 dot path */
static uint8_t fp4_bmap[XP_CHUNK], fp8_bmap[XP_CHUNK];
static uint16_t fp4_bf16[32];                     /* bfloat16 bits of the e2m1 value of (i & 15) */
static uint8_t fp8_bf16_hi[128], fp8_bf16_lo[128]; /* high and low byte of the bfloat16 bits of e4m3 magnitude i */

static void init_avx512bf16(void) {
    isa_avx512_ops.init();
    memcpy(fp4_map, isa_avx512_ops.fp4_map, XP_CHUNK);
    memcpy(bf16_map, isa_avx512_ops.bf16_map, XP_CHUNK);
    /* FP4: vector p (0..3, the nibble within a 16-bit word), word w (columns 4w..4w+3) */
    for (int p = 0; p < 4; p++)
        for (int w = 0; w < 32; w++) fp4_bmap[32 * p + w] = (uint8_t)(4 * w + p);
    /* FP8: per 64 columns, unpacklo then unpackhi; 128-bit lane L, word e of either: column 16L + 8 * hi + e */
    for (int i = 0; i < XP_CHUNK; i++) {
        const int h = i / 64, hi = (i % 64) / 32, lane = (i % 32) / 8, e = i % 8;
        fp8_bmap[i] = (uint8_t)(64 * h + 16 * lane + 8 * hi + e);
    }
    for (int i = 0; i < 32; i++) { /* e2m1 and e4m3 values have at most 4 significant bits: exact bfloat16s */
        uint32_t u;
        memcpy(&u, &fp4_f32[i & 15], 4);
        fp4_bf16[i] = (uint16_t)(u >> 16);
    }
    for (int i = 0; i < 128; i++) { /* e4m3 denormals become bfloat16 normals; code 0x7f (NaN) a bfloat16 NaN */
        uint32_t u;
        memcpy(&u, &fp8_f32[i], 4);
        fp8_bf16_hi[i] = (uint8_t)(u >> 24);
        fp8_bf16_lo[i] = (uint8_t)(u >> 16);
    }
    gemm_bf16_init();
}

/* FP4 chunk c of a row (64 bytes = 128 columns, one scale group per 128-bit lane) against nt tokens: tot[t] += the
 * scaled products. vpermw with a 32-word table (the index is the low 5 bits of a word; entries i and i + 16 are
 * equal) maps nibble p of every word to its bfloat16, so w[p] (word w = column 4w + p) keeps group L in lane L.
 * Per token one chain of four vdpbf16ps (w[0] to w[3]), then one FMA with the scales. */
INLINE void fp4_bdot_chunk(const mm_job *j, const uint8_t *wr, const uint8_t *sr, int64_t c, int64_t full, int64_t rem,
                           int normal, const int nt, __m512i tab, __m512 *tot) {
    __m512 sv;
    __m512i b = fp4_chunk(wr, sr, c, full, rem, normal, &sv);
    __asm__("" : "+v"(b)); /* one load (see fp8_bdot_block) */
    _mm_prefetch((const char *)(wr + 64 * c + PF_DIST), PF_HINT);
    __m512i w[4];
    for (int p = 0; p < 4; p++) w[p] = _mm512_permutexvar_epi16(p ? _mm512_srli_epi16(b, 4 * p) : b, tab);
    for (int t = 0; t < nt; t++) {
        const uint16_t *xt = j->xb + t * j->kp + 128 * c;
        __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(), BH(_mm512_loadu_si512((const void *)xt)), BH(w[0]));
        p = _mm512_dpbf16_ps(p, BH(_mm512_loadu_si512((const void *)(xt + 32))), BH(w[1]));
        p = _mm512_dpbf16_ps(p, BH(_mm512_loadu_si512((const void *)(xt + 64))), BH(w[2]));
        p = _mm512_dpbf16_ps(p, BH(_mm512_loadu_si512((const void *)(xt + 96))), BH(w[3]));
        tot[t] = _mm512_fmadd_ps(p, sv, tot[t]);
    }
}

/* FP4 row n against nt tokens; pairs of chunks add into separate totals, so a chunk does not wait on the previous
 * one's FMA. */
INLINE void fp4_bdot_row(const mm_job *j, int64_t n, const int nt, int64_t cb, int64_t ce, float *acc) {
    const int64_t K = j->K;
    const uint8_t *wr = (const uint8_t *)j->w + n * (K / 2);
    const uint8_t *sr = j->s + n * (K / FP4_GROUP);
    const __m512i tab = _mm512_loadu_si512((const void *)fp4_bf16);
    const int normal = scales_normal(sr + cb / FP4_GROUP, (ce - cb) / FP4_GROUP);
    __m512 tot0[DOT_GROUP], tot1[DOT_GROUP];
    for (int t = 0; t < nt; t++) tot0[t] = tot1[t] = _mm512_setzero_ps();
    const int64_t full = ce / 128, rem = (ce % 128) / FP4_GROUP, chunks = full + (rem != 0);
    int64_t c = cb / 128;
    for (; c + 2 <= full; c += 2) {
        fp4_bdot_chunk(j, wr, sr, c, full, rem, normal, nt, tab, tot0);
        fp4_bdot_chunk(j, wr, sr, c + 1, full, rem, normal, nt, tab, tot1);
    }
    for (; c < chunks; c++) fp4_bdot_chunk(j, wr, sr, c, full, rem, normal, nt, tab, tot0); /* the last whole one, the ragged one */
    for (int t = 0; t < nt; t++) acc[t] += _mm512_reduce_add_ps(_mm512_add_ps(tot0[t], tot1[t]));
}

/* One 128-column stretch of two weight rows (ua, ub: 4 vectors of bfloat16 pairs each) against every token's x
 * from column c0 on: the pair kernels' shared inner loop (the FP4 and the FP8 ones), each (row, token) sum formed
 * exactly as by the one-row kernels, then scaled into its total. */
INLINE void bdot_pair_tokens(const mm_job *j, int64_t c0, const int nt, const __m512i ua[4], const __m512i ub[4],
                             __m512 sa, __m512 sb, __m512 *tot_a, __m512 *tot_b) {
    for (int t = 0; t < nt; t++) {
        const uint16_t *xt = j->xb + t * j->kp + c0;
        __m512i x = _mm512_loadu_si512((const void *)xt);
        __m512 pa = _mm512_dpbf16_ps(_mm512_setzero_ps(), BH(x), BH(ua[0]));
        __m512 pb = _mm512_dpbf16_ps(_mm512_setzero_ps(), BH(x), BH(ub[0]));
        for (int q = 1; q < 4; q++) {
            x = _mm512_loadu_si512((const void *)(xt + 32 * q));
            pa = _mm512_dpbf16_ps(pa, BH(x), BH(ua[q]));
            pb = _mm512_dpbf16_ps(pb, BH(x), BH(ub[q]));
        }
        tot_a[t] = _mm512_fmadd_ps(pa, sa, tot_a[t]);
        tot_b[t] = _mm512_fmadd_ps(pb, sb, tot_b[t]);
    }
}

/* fp4_bdot_chunk on chunk c of rows a and b at once: each load of x serves both rows (one row per pass is bound by
 * its loads of x, one per vdpbf16ps). Every (row, token) sum takes exactly fp4_bdot_chunk's operations. */
INLINE void fp4_bdot_chunk2(const mm_job *j, const uint8_t *wa, const uint8_t *sa, const uint8_t *wb, const uint8_t *sb,
                            int64_t c, int64_t full, int64_t rem, int norm_a, int norm_b, const int nt, __m512i tab,
                            __m512 *tot_a, __m512 *tot_b) {
    __m512 sva, svb;
    __m512i ba = fp4_chunk(wa, sa, c, full, rem, norm_a, &sva), bb = fp4_chunk(wb, sb, c, full, rem, norm_b, &svb);
    __asm__("" : "+v"(ba), "+v"(bb)); /* one load each (see fp8_bdot_block) */
    _mm_prefetch((const char *)(wa + 64 * c + PF_DIST2), PF_HINT);
    _mm_prefetch((const char *)(wb + 64 * c + PF_DIST2), PF_HINT);
    __m512i ua[4], ub[4];
    for (int p = 0; p < 4; p++) {
        ua[p] = _mm512_permutexvar_epi16(p ? _mm512_srli_epi16(ba, 4 * p) : ba, tab);
        ub[p] = _mm512_permutexvar_epi16(p ? _mm512_srli_epi16(bb, 4 * p) : bb, tab);
    }
    bdot_pair_tokens(j, 128 * c, nt, ua, ub, sva, svb, tot_a, tot_b);
}

/* fp4_bdot_row on rows n and n + 1 at once (the same chunks into the same totals): bit-identical to it. */
INLINE void fp4_bdot_row2(const mm_job *j, int64_t n, const int nt, int64_t cb, int64_t ce, float *acc_a, float *acc_b) {
    const int64_t K = j->K;
    const uint8_t *wa = (const uint8_t *)j->w + n * (K / 2), *wb = wa + K / 2;
    const uint8_t *sa = j->s + n * (K / FP4_GROUP), *sb = sa + K / FP4_GROUP;
    const __m512i tab = _mm512_loadu_si512((const void *)fp4_bf16);
    const int norm_a = scales_normal(sa + cb / FP4_GROUP, (ce - cb) / FP4_GROUP);
    const int norm_b = scales_normal(sb + cb / FP4_GROUP, (ce - cb) / FP4_GROUP);
    __m512 ta0[PAIR_GROUP], ta1[PAIR_GROUP], tb0[PAIR_GROUP], tb1[PAIR_GROUP];
    for (int t = 0; t < nt; t++) ta0[t] = ta1[t] = tb0[t] = tb1[t] = _mm512_setzero_ps();
    const int64_t full = ce / 128, rem = (ce % 128) / FP4_GROUP, chunks = full + (rem != 0);
    int64_t c = cb / 128;
    for (; c + 2 <= full; c += 2) {
        fp4_bdot_chunk2(j, wa, sa, wb, sb, c, full, rem, norm_a, norm_b, nt, tab, ta0, tb0);
        fp4_bdot_chunk2(j, wa, sa, wb, sb, c + 1, full, rem, norm_a, norm_b, nt, tab, ta1, tb1);
    }
    for (; c < chunks; c++) fp4_bdot_chunk2(j, wa, sa, wb, sb, c, full, rem, norm_a, norm_b, nt, tab, ta0, tb0);
    for (int t = 0; t < nt; t++) {
        acc_a[t] += _mm512_reduce_add_ps(_mm512_add_ps(ta0[t], ta1[t]));
        acc_b[t] += _mm512_reduce_add_ps(_mm512_add_ps(tb0[t], tb1[t]));
    }
}

/* 64 e4m3 bytes -> 64 bfloat16 words: vpermi2b looks up the low and the high byte of each magnitude's bfloat16
 * (the index is the low 7 bits, so the sign bit is ignored), the sign is ORed into the high byte, and unpacklo /
 * unpackhi interleave them: w[0] = bytes 0-7 of each 128-bit lane, w[1] = bytes 8-15. */
INLINE void fp8_bf16(__m512i v, const __m512i tab[4], __m512i w[2]) {
    const __m512i lo = _mm512_permutex2var_epi8(tab[0], v, tab[1]);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(tab[2], v, tab[3]), v, _mm512_set1_epi8((char)0x80), 0xf8); /* a | (b & c) */
    w[0] = _mm512_unpacklo_epi8(lo, hi);
    w[1] = _mm512_unpackhi_epi8(lo, hi);
}

/* Scale block b of the row, its first `cols` (<= 128) columns, against nt tokens: tot[t] += scale * its sum.
 * Per token one chain of four vdpbf16ps (w[0] to w[3]), then one FMA with the scale. */
INLINE void fp8_bdot_block(const mm_job *j, const uint8_t *wr, const uint8_t *srow, int64_t b, int64_t cols, const int nt,
                           const __m512i tab[4], __m512 *tot) {
    const int64_t c0 = FP8_BLOCK * b;
    __m512i w[4]; /* columns 0-63 of the block in w[0], w[1], columns 64-127 in w[2], w[3] */
    for (int h = 0; h < 2; h++) {
        const int64_t left = cols - 64 * h;
        __m512i v = left >= 64 ? _mm512_loadu_si512((const void *)(wr + c0 + 64 * h))
                  : _mm512_maskz_loadu_epi8(left > 0 ? ((__mmask64)1 << left) - 1 : 0, wr + c0 + 64 * h);
        __asm__("" : "+v"(v)); /* one load: compilers reload v for each vpermi2b that overwrites it, and rows that are
                                * not 64-byte aligned (numpy's) make every load two */
        fp8_bf16(v, tab, w + 2 * h);
    }
    _mm_prefetch((const char *)(wr + c0 + PF_DIST), PF_HINT);
    _mm_prefetch((const char *)(wr + c0 + PF_DIST + 64), PF_HINT);
    const __m512 sf = _mm512_set1_ps(ue8m0_f32[srow[b]]);
    for (int t = 0; t < nt; t++) {
        const uint16_t *xt = j->xb + t * j->kp + c0;
        __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(), BH(_mm512_loadu_si512((const void *)xt)), BH(w[0]));
        p = _mm512_dpbf16_ps(p, BH(_mm512_loadu_si512((const void *)(xt + 32))), BH(w[1]));
        p = _mm512_dpbf16_ps(p, BH(_mm512_loadu_si512((const void *)(xt + 64))), BH(w[2]));
        p = _mm512_dpbf16_ps(p, BH(_mm512_loadu_si512((const void *)(xt + 96))), BH(w[3]));
        tot[t] = _mm512_fmadd_ps(p, sf, tot[t]);
    }
}

/* FP8 row n against nt tokens, per 128-column scale block; pairs of blocks add into separate totals, so a block
 * does not wait on the previous one's FMA. */
INLINE void fp8_bdot_row(const mm_job *j, int64_t n, const int nt, int64_t cb, int64_t ce, float *acc) {
    const int64_t K = j->K, kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    const uint8_t *wr = (const uint8_t *)j->w + n * K;
    const uint8_t *srow = j->s + (n / FP8_BLOCK) * kb;
    const __m512i tab[4] = {_mm512_loadu_si512((const void *)fp8_bf16_lo), _mm512_loadu_si512((const void *)(fp8_bf16_lo + 64)),
                            _mm512_loadu_si512((const void *)fp8_bf16_hi), _mm512_loadu_si512((const void *)(fp8_bf16_hi + 64))};
    __m512 tot0[DOT_GROUP], tot1[DOT_GROUP];
    for (int t = 0; t < nt; t++) tot0[t] = tot1[t] = _mm512_setzero_ps();
    int64_t b = cb / FP8_BLOCK;
    for (; FP8_BLOCK * (b + 2) <= ce; b += 2) {
        fp8_bdot_block(j, wr, srow, b, FP8_BLOCK, nt, tab, tot0);
        fp8_bdot_block(j, wr, srow, b + 1, FP8_BLOCK, nt, tab, tot1);
    }
    for (; FP8_BLOCK * b < ce; b++) /* the last whole block, the ragged one */
        fp8_bdot_block(j, wr, srow, b, ce - FP8_BLOCK * b < FP8_BLOCK ? ce - FP8_BLOCK * b : FP8_BLOCK, nt, tab, tot0);
    for (int t = 0; t < nt; t++) acc[t] += _mm512_reduce_add_ps(_mm512_add_ps(tot0[t], tot1[t]));
}

/* fp8_bdot_block on scale block b of rows a and b at once (see fp4_bdot_chunk2): each load of x serves both rows,
 * every (row, token) sum takes exactly fp8_bdot_block's operations. */
INLINE void fp8_bdot_block2(const mm_job *j, const uint8_t *wa, const uint8_t *sa, const uint8_t *sb, int64_t K, int64_t b,
                            int64_t cols, const int nt, const __m512i tab[4], __m512 *tot_a, __m512 *tot_b) {
    const int64_t c0 = FP8_BLOCK * b;
    __m512i ua[4], ub[4];
    for (int h = 0; h < 2; h++) {
        const int64_t left = cols - 64 * h;
        const __mmask64 m = left >= 64 ? ~(__mmask64)0 : left > 0 ? ((__mmask64)1 << left) - 1 : 0;
        __m512i va = _mm512_maskz_loadu_epi8(m, wa + c0 + 64 * h), vb = _mm512_maskz_loadu_epi8(m, wa + K + c0 + 64 * h);
        __asm__("" : "+v"(va), "+v"(vb));
        fp8_bf16(va, tab, ua + 2 * h);
        fp8_bf16(vb, tab, ub + 2 * h);
    }
    _mm_prefetch((const char *)(wa + c0 + PF_DIST2), PF_HINT);
    _mm_prefetch((const char *)(wa + c0 + PF_DIST2 + 64), PF_HINT);
    _mm_prefetch((const char *)(wa + K + c0 + PF_DIST2), PF_HINT);
    _mm_prefetch((const char *)(wa + K + c0 + PF_DIST2 + 64), PF_HINT);
    const __m512 sfa = _mm512_set1_ps(ue8m0_f32[sa[b]]), sfb = _mm512_set1_ps(ue8m0_f32[sb[b]]);
    bdot_pair_tokens(j, c0, nt, ua, ub, sfa, sfb, tot_a, tot_b);
}

/* fp8_bdot_row on rows n and n + 1 at once: bit-identical to it. Each row looks up its own 128-row scale block, so
 * a pair may straddle two (simd.h's pairs start at even offsets from a multiple of ROW_ALIGN: today they do not). */
INLINE void fp8_bdot_row2(const mm_job *j, int64_t n, const int nt, int64_t cb, int64_t ce, float *acc_a, float *acc_b) {
    const int64_t K = j->K, kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    const uint8_t *wa = (const uint8_t *)j->w + n * K;
    const uint8_t *sa = j->s + (n / FP8_BLOCK) * kb, *sb = j->s + ((n + 1) / FP8_BLOCK) * kb;
    const __m512i tab[4] = {_mm512_loadu_si512((const void *)fp8_bf16_lo), _mm512_loadu_si512((const void *)(fp8_bf16_lo + 64)),
                            _mm512_loadu_si512((const void *)fp8_bf16_hi), _mm512_loadu_si512((const void *)(fp8_bf16_hi + 64))};
    __m512 ta0[PAIR_GROUP], ta1[PAIR_GROUP], tb0[PAIR_GROUP], tb1[PAIR_GROUP];
    for (int t = 0; t < nt; t++) ta0[t] = ta1[t] = tb0[t] = tb1[t] = _mm512_setzero_ps();
    int64_t b = cb / FP8_BLOCK;
    for (; FP8_BLOCK * (b + 2) <= ce; b += 2) {
        fp8_bdot_block2(j, wa, sa, sb, K, b, FP8_BLOCK, nt, tab, ta0, tb0);
        fp8_bdot_block2(j, wa, sa, sb, K, b + 1, FP8_BLOCK, nt, tab, ta1, tb1);
    }
    for (; FP8_BLOCK * b < ce; b++)
        fp8_bdot_block2(j, wa, sa, sb, K, b, ce - FP8_BLOCK * b < FP8_BLOCK ? ce - FP8_BLOCK * b : FP8_BLOCK, nt, tab, ta0, tb0);
    for (int t = 0; t < nt; t++) {
        acc_a[t] += _mm512_reduce_add_ps(_mm512_add_ps(ta0[t], ta1[t]));
        acc_b[t] += _mm512_reduce_add_ps(_mm512_add_ps(tb0[t], tb1[t]));
    }
}

/* ---------------------------------------------------------------- FP8 with the scales folded into x */

/* The FP8 dot path proper (every T): a UE8M0 scale is a power of two, 2^(s - 127), so x * scale is exact as long as it
 * stays a bfloat16 normal. For the 128-row scale block of the rows at hand, fold_x writes x' = x scaled by each
 * column block's scale (an add to the exponent field), and each (row, token) sum is then one chain of vdpbf16ps over
 * the whole row, x' against the widened weights: no per-block add and scale FMA, and the same sum for any number
 * of rows or tokens per pass. A token takes it for a row block when every nonzero x' keeps an exponent field in
 * [17, 191] (x_kind's X_EXACT bound, so every product is exact in float32, a multiple of 2^-126, and no sum
 * overflows or turns denormal) and no scale of the block is NaN (255); otherwise that (token, row block) takes
 * fp8_bdot_row, one token at a time (rare: only extreme scales or x; the decision depends on that token and row
 * block alone, so batch invariance holds). */
#define FOLD_LO 17
#define FOLD_HI 191

/* x' of nt tokens (xb, row stride kp) for the scale row srow: the tokens that qualify written in order into dst
 * (row stride kp), their indices into idx. Returns how many qualify. */
INLINE int fold_x(const mm_job *j, const uint8_t *srow, int nt, uint16_t *dst, int *idx) {
    const int64_t kp = j->kp, kb = (j->K + FP8_BLOCK - 1) / FP8_BLOCK;
    for (int64_t b = 0; b < kb; b++)
        if (srow[b] == 255) return 0;
    const __m512i absm = _mm512_set1_epi16(0x7fff), lo = _mm512_set1_epi16(FOLD_LO << 7);
    const __m512i span = _mm512_set1_epi16((short)(((FOLD_HI - FOLD_LO) << 7) | 0x7f));
    int nf = 0;
    for (int t = 0; t < nt; t++) {
        const uint16_t *xt = j->xb + t * kp;
        uint16_t *d = dst + nf * kp;
        __mmask32 bad = 0;
        for (int64_t b = 0; b < kb; b++) {
            const __m512i dv = _mm512_set1_epi16((short)((srow[b] - 127) * 128));
            for (int64_t c = FP8_BLOCK * b; c < FP8_BLOCK * (b + 1); c += 32) {
                const __m512i x = _mm512_load_si512((const void *)(xt + c));
                const __mmask32 nz = _mm512_test_epi16_mask(x, absm);
                const __m512i a = _mm512_add_epi16(_mm512_and_si512(x, absm), dv); /* |x'|'s bits, wrapped if out of range */
                bad |= _mm512_mask_cmpgt_epu16_mask(nz, _mm512_sub_epi16(a, lo), span);
                _mm512_store_si512((void *)(d + c), _mm512_mask_add_epi16(x, nz, x, dv));
            }
        }
        if (!bad) idx[nf++] = t;
    }
    return nf;
}

/* R rows from n (one scale block) against NT tokens of x' (row stride kp): acc[r * NT + t] = the chain's total. Per 64
 * columns, one load and widening per row, two loads of x per token, 2 R vdpbf16ps per token. */
INLINE void fp8_fold_block(const mm_job *j, int64_t n, const int R, const int NT, const uint16_t *xf,
                           const __m512i tab[4], float *out) {
    const int64_t K = j->K, kp = j->kp;
    const uint8_t *w0 = (const uint8_t *)j->w + n * K;
    __m512 acc[4][PAIR_GROUP]; /* R x NT <= 16 of them used: 4 x 4, 2 x 8 */
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_ps();
    /* prefetch PF_FOLD bytes ahead in the order the rows are read (R rows side by side, then the next R): column pc
     * of the rows pg bytes on */
    int64_t pc = PF_FOLD / R, pg = 0;
    for (; pc >= K; pc -= K) pg += R * K;
    for (int64_t c = 0; c < K; c += 64, pc += 64) {
        if (pc >= K) pc -= K, pg += R * K;
        const int64_t left = K - c;
        __m512i w[4][2];
        UNROLL for (int r = 0; r < R; r++) {
            __m512i v = left >= 64 ? _mm512_loadu_si512((const void *)(w0 + r * K + c))
                      : _mm512_maskz_loadu_epi8(((__mmask64)1 << left) - 1, w0 + r * K + c);
            __asm__("" : "+v"(v)); /* one load (see fp8_bdot_block) */
            fp8_bf16(v, tab, w[r]);
            _mm_prefetch((const char *)(w0 + pg + r * K + pc), PF_HINT);
        }
        UNROLL for (int t = 0; t < NT; t++) {
            const __m512i x0 = _mm512_load_si512((const void *)(xf + t * kp + c));
            const __m512i x1 = _mm512_load_si512((const void *)(xf + t * kp + c + 32));
            UNROLL for (int r = 0; r < R; r++) {
                acc[r][t] = _mm512_dpbf16_ps(acc[r][t], BH(x0), BH(w[r][0]));
                acc[r][t] = _mm512_dpbf16_ps(acc[r][t], BH(x1), BH(w[r][1]));
            }
        }
    }
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int t = 0; t < NT; t++) out[r * NT + t] = _mm512_reduce_add_ps(acc[r][t]);
}

/* Rows [n0, n1) of one scale block against the nf <= 8 tokens of x' (xf): up to 4 tokens 4 rows per pass (16 totals,
 * 8 weight vectors, 4 tables in registers), 5-8 tokens 2 rows per pass (up to 16 totals, 4 weight vectors), the rest
 * one row at a time; outputs to the tokens' places idx[] (+ t0). Each (row, token) total is the same chain whatever R
 * and NT (acc += x'[c..c+31] . w, then x'[c+32..c+63] . w, column after column), so a token's outputs do not depend on
 * the pass. Measured on Zen 4 from DRAM: 4 rows at T = 1 read as fast as the unfolded path's one row, 8 rows slower.
 * 5-8 tokens take one pass of 2 rows where their x' fits FOLD_X_L1 (each weight row is then read and widened once,
 * and the widening's shuffles no longer compete with vdpbf16ps twice), otherwise two passes of 4 rows (fp8_rows_folded):
 * at K = 1024 one pass ran 1.06-1.30x two (T = 5-8; CPU time, DRAM- and L3-fed), at K = 4096 (x' of 5-8 tokens
 * 40-64 KB, over the 32 KB L1) 0.72-1.0x from DRAM (docs/PERFORMANCE.md). */
#define FOLD_X_L1 (24 << 10)
#define FOLD_CASE(R, NT) \
    case NT: fp8_fold_block(j, n, R, NT, xf, tab, o); break;
#define FOLD_SWITCH4(R)                                                                                         \
    switch (nf) {                                                                                               \
        FOLD_CASE(R, 1) FOLD_CASE(R, 2) FOLD_CASE(R, 3) default: fp8_fold_block(j, n, R, 4, xf, tab, o); break; \
    }
#define FOLD_SWITCH8(R)                                                                                         \
    switch (nf) {                                                                                               \
        FOLD_CASE(R, 5) FOLD_CASE(R, 6) FOLD_CASE(R, 7) default: fp8_fold_block(j, n, R, 8, xf, tab, o); break; \
    }
static void fp8_fold_rows(const mm_job *j, int64_t n0, int64_t n1, int64_t t0, int nf, const uint16_t *xf,
                          const int *idx) {
    const __m512i tab[4] = {_mm512_loadu_si512((const void *)fp8_bf16_lo), _mm512_loadu_si512((const void *)(fp8_bf16_lo + 64)),
                            _mm512_loadu_si512((const void *)fp8_bf16_hi), _mm512_loadu_si512((const void *)(fp8_bf16_hi + 64))};
    const int wide = nf > 4, rows = wide ? 2 : 4;
    float o[16];
    for (int64_t n = n0; n < n1;) {
        const int r = n + rows <= n1 ? rows : 1;
        if (!wide) {
            if (r == 4) FOLD_SWITCH4(4) else FOLD_SWITCH4(1)
        } else {
            if (r == 2) FOLD_SWITCH8(2) else FOLD_SWITCH8(1)
        }
        for (int i = 0; i < r; i++)
            for (int t = 0; t < nf; t++) put(j, t0 + idx[t], n + i, o[i * nf + t]);
        n += r;
    }
}

/* The FP8 dot path: per pass of up to PAIR_GROUP tokens and per 128-row scale block in [n0, n1), x' and the folded
 * rows, then the (token, row block)s that do not qualify on fp8_bdot_row. Returns 0, or -1 when the thread's x'
 * buffer cannot be allocated (the caller then runs the unfolded path on the whole job). */
static int fp8_rows_folded(const mm_job *j, int64_t n0, int64_t n1) {
    static __thread uint16_t *buf;
    static __thread size_t cap;
    const size_t need = (size_t)(PAIR_GROUP * j->kp) * sizeof(uint16_t);
    if (cap < need) {
        free(buf);
        buf = aligned_alloc(64, need);
        cap = buf ? need : 0;
        if (!buf) return -1;
    }
    const int64_t kb = (j->K + FP8_BLOCK - 1) / FP8_BLOCK;
    for (int64_t t0 = 0; t0 < j->T; t0 += PAIR_GROUP) {
        mm_job g = *j;
        g.xb = j->xb + t0 * j->kp;
        const int nt = (int)(j->T - t0 < PAIR_GROUP ? j->T - t0 : PAIR_GROUP);
        for (int64_t nb = n0; nb < n1;) {
            const int64_t ne = (nb / FP8_BLOCK + 1) * FP8_BLOCK < n1 ? (nb / FP8_BLOCK + 1) * FP8_BLOCK : n1;
            int idx[PAIR_GROUP];
            const int nf = fold_x(&g, j->s + (nb / FP8_BLOCK) * kb, nt, buf, idx);
            /* 5-8 tokens in one pass where their x' stays in L1, else in two (see fp8_fold_rows) */
            const int h = nf > 4 && (size_t)nf * (size_t)j->kp * sizeof(uint16_t) > FOLD_X_L1 ? (nf + 1) / 2 : nf;
            if (h) fp8_fold_rows(j, nb, ne, t0, h, buf, idx);
            if (nf > h) fp8_fold_rows(j, nb, ne, t0, nf - h, buf + h * j->kp, idx + h);
            for (int t = 0, f = 0; t < nt; t++) { /* the tokens that do not qualify */
                if (f < nf && idx[f] == t) {
                    f++;
                    continue;
                }
                mm_job h = g;
                h.xb = g.xb + t * j->kp;
                for (int64_t n = nb; n < ne; n++) {
                    float a[1] = {0};
                    fp8_bdot_row(&h, n, 1, 0, j->K, a);
                    put(j, t0 + t, n, a[0]);
                }
            }
            nb = ne;
        }
    }
    return 0;
}

/* The bf16 dot path (FP4; FP8 where its scales are not folded): rows [n0, n1) two at a time by ROW2 (rows n, n + 1,
 * each (row, token) sum exactly ROW's), the odd last one by ROW (DOT_GROUP tokens at a time), the T tokens in passes
 * of at most PAIR_GROUP of as even a size as they allow. T, the pass and the row's pairing change no bit of any
 * output. */
#define PAIR_CASE(ROW2, NT) \
    case NT: ROW2(&g, n, NT, 0, j->K, a, b); break;
#define PAIR_DISPATCH(ROW, ROW2)                                                                                 \
    {                                                                                                            \
        const int64_t passes = (j->T + PAIR_GROUP - 1) / PAIR_GROUP, per = (j->T + passes - 1) / passes;         \
        for (int64_t t0 = 0; t0 < j->T; t0 += per) {                                                            \
            mm_job g = *j;                                                                                       \
            g.xb = j->xb + t0 * j->kp;                                                                           \
            const int nt = (int)(j->T - t0 < per ? j->T - t0 : per);                                             \
            int64_t n = n0;                                                                                      \
            for (; n + 1 < n1; n += 2) {                                                                         \
                float a[PAIR_GROUP] = {0}, b[PAIR_GROUP] = {0};                                                  \
                switch (nt) {                                                                                    \
                    PAIR_CASE(ROW2, 1) PAIR_CASE(ROW2, 2) PAIR_CASE(ROW2, 3) PAIR_CASE(ROW2, 4)                  \
                    PAIR_CASE(ROW2, 5) PAIR_CASE(ROW2, 6) PAIR_CASE(ROW2, 7)                                     \
                    default: ROW2(&g, n, PAIR_GROUP, 0, j->K, a, b); break;                                      \
                }                                                                                                \
                for (int t = 0; t < nt; t++) put(j, t0 + t, n, a[t]), put(j, t0 + t, n + 1, b[t]);               \
            }                                                                                                    \
            for (int u0 = 0; n < n1 && u0 < nt; u0 += DOT_GROUP) { /* the odd last row */                        \
                mm_job h = g;                                                                                    \
                h.xb = g.xb + u0 * j->kp;                                                                        \
                float a[DOT_GROUP] = {0};                                                                        \
                const int nu = nt - u0 < DOT_GROUP ? nt - u0 : DOT_GROUP;                                        \
                switch (nu) {                                                                                    \
                    case 1: ROW(&h, n, 1, 0, j->K, a); break;                                                    \
                    case 2: ROW(&h, n, 2, 0, j->K, a); break;                                                    \
                    case 3: ROW(&h, n, 3, 0, j->K, a); break;                                                    \
                    default: ROW(&h, n, 4, 0, j->K, a); break;                                                   \
                }                                                                                                \
                for (int t = 0; t < nu; t++) put(j, t0 + u0 + t, n, a[t]);                                       \
            }                                                                                                    \
        }                                                                                                        \
    }

/* ---------------------------------------------------------------- the dot path's x (dispatch.c's x_kind, permute_x) */

/* x_kind's scan, 16 floats a step (a masked tail reads zeros, which set no bit). */
static unsigned x_scan(const float *x, int64_t n) {
    const __m512i absm = _mm512_set1_epi32(0x7fffffff), e17 = _mm512_set1_epi32(17), e33 = _mm512_set1_epi32(33);
    __m512i low = _mm512_setzero_si512();
    __mmask16 out_exact = 0, out_split = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512i u = _mm512_maskz_loadu_epi32(m, x + i), a = _mm512_and_si512(u, absm);
        const __mmask16 nz = _mm512_test_epi32_mask(a, a);
        const __m512i e = _mm512_srli_epi32(a, 23);
        low = _mm512_or_si512(low, u);
        out_exact |= _mm512_mask_cmpgt_epu32_mask(nz, _mm512_sub_epi32(e, e17), _mm512_set1_epi32(174));
        out_split |= _mm512_mask_cmpgt_epu32_mask(nz, _mm512_sub_epi32(e, e33), _mm512_set1_epi32(158));
    }
    return (_mm512_test_epi32_mask(low, _mm512_set1_epi32(0xffff)) ? X_SCAN_INEXACT : 0u) |
           (out_exact ? X_SCAN_OUT_EXACT : 0u) | (out_split ? X_SCAN_OUT_SPLIT : 0u);
}

/* permute_x's bfloat16 copy: per XP_CHUNK columns, the high halves of the 128 floats as 4 vectors of 32 words in
 * column order (vpermt2w of the odd words of two float vectors), then each output vector j gathers its words
 * bmap[32 j ..] from the low 64 and the high 64 columns (one vpermt2w each: the index's low 6 bits pick within a
 * half) and blends the two by bmap[i] >= 64. */
static void x_bf16(const uint8_t *bmap, const float *x, int64_t T, int64_t K, int64_t ld, uint16_t *dst, int64_t kp) {
    __m512i idx[4];
    __mmask32 high[4];
    for (int j = 0; j < 4; j++) {
        idx[j] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(bmap + 32 * j)));
        high[j] = _mm512_cmpge_epu16_mask(idx[j], _mm512_set1_epi16(64));
    }
    uint16_t odd_w[32];
    for (int i = 0; i < 32; i++) odd_w[i] = (uint16_t)(2 * i + 1);
    const __m512i odd = _mm512_loadu_si512((const void *)odd_w);
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * ld;
        uint16_t *d = dst + t * kp;
        for (int64_t c0 = 0; c0 < kp; c0 += XP_CHUNK) {
            __m512i w[4];
            for (int q = 0; q < 4; q++) {
                __m512i f[2];
                for (int h = 0; h < 2; h++) {
                    const int64_t c = c0 + 32 * q + 16 * h, left = K - c;
                    const __mmask16 m = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
                    f[h] = _mm512_maskz_loadu_epi32(m, xr + c);
                }
                w[q] = _mm512_permutex2var_epi16(f[0], odd, f[1]);
            }
            for (int j = 0; j < 4; j++) {
                const __m512i lo = _mm512_permutex2var_epi16(w[0], idx[j], w[1]);
                const __m512i hi = _mm512_permutex2var_epi16(w[2], idx[j], w[3]);
                _mm512_store_si512((void *)(d + c0 + 32 * j), _mm512_mask_blend_epi16(high[j], lo, hi));
            }
        }
    }
}

/* ---------------------------------------------------------------- entry points */

/* xb with dot unset: the bf16 tile path (gemm_avx512bf16.c), x in groups of TILE_XG tokens (kernels.h). */
static void fp4_rows(const mm_job *j, int64_t n0, int64_t n1) {
    if (j->dot && j->xb) PAIR_DISPATCH(fp4_bdot_row, fp4_bdot_row2) else if (j->xb) fp4_tile_bf16_rows(j, n0, n1); else isa_avx512_ops.fp4(j, n0, n1);
}
static void fp8_rows(const mm_job *j, int64_t n0, int64_t n1) {
    if (j->dot && j->xb && fp8_fold && !fp8_rows_folded(j, n0, n1)) return;
    if (j->dot && j->xb) { if (j->T < 2) { DOT_DISPATCH(fp8_bdot_row) } else { PAIR_DISPATCH(fp8_bdot_row, fp8_bdot_row2) } } else if (j->xb) fp8_tile_bf16_rows(j, n0, n1); else isa_avx512_ops.fp8(j, n0, n1);
}
static void bf16_rows(const mm_job *j, int64_t n0, int64_t n1) { isa_avx512_ops.bf16(j, n0, n1); }
static double fma_loop(int64_t iters) { return isa_avx512_ops.fma_loop(iters); }
static double read_sum(const uint8_t *p, size_t n) { return isa_avx512_ops.read_sum(p, n); }
static void act_quant(const float *x, float *out, int64_t rows, int64_t K, int64_t block) {
    isa_avx512_ops.act_quant(x, out, rows, K, block);
}
static void swiglu(const float *g, const float *u, float *out, int64_t n, float limit, float scale) {
    isa_avx512_ops.swiglu(g, u, out, n, limit, scale);
}

const isa_ops isa_avx512bf16_ops = {
    .name = "avx512bf16",
    .needs = "avx2 fma f16c avx512f avx512bw avx512vl avx512bf16 avx512vbmi",
    .vec = VEC_AVX512,
    .init = init_avx512bf16,
    .dot_max = DOT_MAX, /* kern_avx512.c's: its FP32 dot path takes the calls whose x does not allow the bf16 one */
    .fp4 = fp4_rows,
    .fp8 = fp8_rows,
    .bf16 = bf16_rows,
    .fp4_map = fp4_map,
    .fp8_map = NULL,
    .bf16_map = bf16_map,
    .fp4_bmap = fp4_bmap,
    .fp8_bmap = fp8_bmap,
    .tile_bf16 = 1,
    .fma_loop = fma_loop,
    .read_sum = read_sum,
    .act_quant = act_quant,
    .swiglu = swiglu,
    .x_scan = x_scan,
    .x_bf16 = x_bf16,
};

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif /* FASTAR_X86 */
