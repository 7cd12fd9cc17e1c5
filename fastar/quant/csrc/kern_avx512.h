/* Helpers shared by the AVX-512 kernel files (kern_avx512.c, kern_avx512bf16.c, gemm_avx512bf16.c).
 *
 * Include it after the file's target pragma and <immintrin.h>: the helpers are always-inline AVX-512 F/BW code,
 * compiled for each including file's target.
 */
#ifndef FASTAR_KERN_AVX512_H
#define FASTAR_KERN_AVX512_H

#include <string.h>

#include "simd.h"

#define DOT_MAX 8 /* T up to this takes the dot path, DOT_GROUP tokens at a time */

/* True when no scale byte is 0 (denormal 2^-127) or 255 (NaN): then b << 23 is the float 2^(b-127). */
INLINE int scales_normal(const uint8_t *s, int64_t n) {
    __mmask64 bad = 0;
    for (int64_t i = 0; i < n; i += 64) {
        const __mmask64 m = n - i >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (n - i)) - 1;
        const __m512i b1 = _mm512_sub_epi8(_mm512_maskz_loadu_epi8(m, s + i), _mm512_set1_epi8(1)); /* 0, 255 -> 255, 254 */
        bad |= _mm512_mask_cmpge_epu8_mask(m, b1, _mm512_set1_epi8((char)254));
    }
    return !bad;
}

/* FP4 dot path: chunk c of a row (64 bytes = 128 columns = 4 scale groups, group g in 128-bit lane g) and the
 * scale of each lane's group in every dword of the lane. The row has `full` whole chunks, then `rem` (0-3)
 * trailing groups; `normal`: scales_normal() of the row, which allows building the scales without the table. */
INLINE __m512i fp4_chunk(const uint8_t *wr, const uint8_t *sr, int64_t c, int64_t full, int64_t rem, int normal, __m512 *sv) {
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const uint8_t *sc = sr + 4 * c;
    if (c < full && normal) { /* 2^(b-127) is the float with exponent field b: no table needed */
        /* per 128-bit lane L: every dword = byte L of a broadcast dword (the scale of group L) */
        const __m512i spread_b = _mm512_add_epi32(_mm512_set1_epi32((int)0x80808000), spread);
        int32_t s32;
        memcpy(&s32, sc, 4);
        *sv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_shuffle_epi8(_mm512_set1_epi32(s32), spread_b), 23));
        return _mm512_loadu_si512((const void *)(wr + 64 * c));
    }
    if (c < full) {
        const __m128 s4 = _mm_setr_ps(ue8m0_f32[sc[0]], ue8m0_f32[sc[1]], ue8m0_f32[sc[2]], ue8m0_f32[sc[3]]);
        *sv = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s4)); /* lane i: group i/4 */
        return _mm512_loadu_si512((const void *)(wr + 64 * c));
    }
    /* 1-3 trailing groups of 16 bytes; the absent ones read as zero weights with scale 0 */
    const __m128 s4 = _mm_setr_ps(ue8m0_f32[sc[0]], rem > 1 ? ue8m0_f32[sc[1]] : 0.0f, rem > 2 ? ue8m0_f32[sc[2]] : 0.0f, 0.0f);
    *sv = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s4));
    return _mm512_maskz_loadu_epi32((__mmask16)((1u << (4 * rem)) - 1), wr + 64 * c);
}

/* Loads nbytes (<= 64) of 16 rows (rows >= `rows` read as zero) and transposes them as 16x16 dwords:
 * c[q] lane i = dword q of row i. Gathers did the same but are slow on AMD; this is 16 loads + 64 shuffles. */
INLINE void load_t16(const uint8_t *base, int64_t stride, int rows, int64_t nbytes, __m512i c[16]) {
    const __mmask64 bm = nbytes >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << nbytes) - 1);
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++)
        r[i] = i < rows ? _mm512_maskz_loadu_epi8(bm, base + i * stride) : _mm512_setzero_si512();
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int g = 0; g < 4; g++) { /* u[g][m] lane L = dword 4L+m of rows 4g..4g+3 */
        __m512i *q = t + 4 * g;
        r[4 * g + 0] = _mm512_unpacklo_epi64(q[0], q[2]);
        r[4 * g + 1] = _mm512_unpackhi_epi64(q[0], q[2]);
        r[4 * g + 2] = _mm512_unpacklo_epi64(q[1], q[3]);
        r[4 * g + 3] = _mm512_unpackhi_epi64(q[1], q[3]);
    }
    for (int m = 0; m < 4; m++) {
        __m512i v0 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x44), w0 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xee);
        __m512i v1 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x44), w1 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xee);
        c[m] = _mm512_shuffle_i32x4(v0, v1, 0x88);
        c[4 + m] = _mm512_shuffle_i32x4(v0, v1, 0xdd);
        c[8 + m] = _mm512_shuffle_i32x4(w0, w1, 0x88);
        c[12 + m] = _mm512_shuffle_i32x4(w0, w1, 0xdd);
    }
}

#endif
