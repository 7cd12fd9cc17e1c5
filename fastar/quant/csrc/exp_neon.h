/* e^x on 4 float lanes for the AArch64 code of any file (attention softmax, SwiGLU): exp512.h's algorithm in NEON.
 * x = n ln2 + r with |r| <= ln2/2 (two-part ln2), e^r by its degree-7 Taylor polynomial (within 1-2 ulp of expf),
 * times 2^n as two exact power-of-two factors 2^(n/2) 2^(n - n/2) (each a normal float; only the second product
 * rounds, so it is vscalefps's single rounding, with 0 and inf past the float range). NaN stays NaN (FMAX / FMIN
 * propagate it). Include after <arm_neon.h>. */
#ifndef FASTAR_EXP_NEON_H
#define FASTAR_EXP_NEON_H

static inline __attribute__((always_inline)) float32x4_t exp_neon(float32x4_t x) {
    x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-110.0f)), vdupq_n_f32(100.0f));
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693145751953125f));
    r = vfmsq_f32(r, n, vdupq_n_f32(1.428606765330187e-06f));
    float32x4_t p = vdupq_n_f32(1.0f / 5040);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 720), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 120), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 24), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 6), p, r);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    const int32x4_t ni = vcvtq_s32_f32(n); /* NaN: 0, and p is NaN */
    const int32x4_t n1 = vshrq_n_s32(ni, 1), n2 = vsubq_s32(ni, n1);
    const float32x4_t f1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n1, vdupq_n_s32(127)), 23));
    const float32x4_t f2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n2, vdupq_n_s32(127)), 23));
    return vmulq_f32(vmulq_f32(p, f1), f2);
}

#endif
