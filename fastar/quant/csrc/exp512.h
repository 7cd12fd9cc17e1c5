/* e^x on 16 float lanes, for the AVX-512 code of any file (it carries its own target, so a file compiled without an
 * AVX-512 pragma can call it from its AVX-512 functions). x = n ln2 + r with |r| <= ln2/2 (two-part ln2), e^r by its
 * degree-7 Taylor polynomial (truncation below 1e-8 relative: within 1-2 ulp of expf), times 2^n by vscalefps,
 * which gives 0 and inf past the float range. NaN stays NaN. Include after <immintrin.h>. */
#ifndef FASTAR_EXP512_H
#define FASTAR_EXP512_H

static inline __attribute__((always_inline, target("avx512f"))) __m512 exp512(__m512 x) {
    /* vmaxps / vminps return their second operand when either is NaN: x second, so NaN stays NaN */
    x = _mm512_min_ps(_mm512_set1_ps(100.0f), _mm512_max_ps(_mm512_set1_ps(-110.0f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#endif
