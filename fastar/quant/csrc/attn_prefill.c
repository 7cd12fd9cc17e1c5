/* What attention reads from the decode state: the packed state rows decoded to float32, the twin of
 * fastar.model.state.RowFormat.decode (one call instead of a dozen torch ops; ~50x faster on 16k rows).
 *
 * Packed rows (state.py has the byte layout): "fp8" = [rope float32 x r][e4m3 codes x 64*nb][nb UE8M0 bytes][pad],
 * "fp4" = [e2m1 codes, two per byte, low nibble first x 16*nb][nb UE8M0 bytes]. A value is code * 2^(b - 127):
 * both factors are exact float32s and the product is exact (the state holds only rows that decode exactly), so
 * this is bit-identical to the torch decode.
 *
 * Does not own: argument checks and the split over the pool (bind_ops.c).
 */
#include <math.h>
#include <string.h>

#include "kernels.h"

/* ---------------------------------------------------------------- packed rows */

static float e4m3_lut[256];
static const float e2m1_lut[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

void state_rows_init(void) {
    for (int c = 0; c < 256; c++) {
        const int e = (c >> 3) & 15, m = c & 7;
        float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
        if ((c & 0x7f) == 0x7f) v = NAN; /* e4m3fn has no infinities; S.1111.111 is NaN */
        e4m3_lut[c] = c & 0x80 ? -v : v;
    }
}

static inline float ue8m0(uint8_t b) {
    uint32_t bits = (uint32_t)b << 23; /* 2^(b-127) for b in 1..254 (the state never stores 0 or 255) */
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

void state_rows_decode(const uint8_t *raw, float *out, int64_t rows, int64_t row_bytes, int kind, int64_t width,
                       int64_t rope) {
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *src = raw + r * row_bytes;
        float *dst = out + r * width;
        if (kind == STATE_FP8) {
            const int64_t nope = width - rope, nb = (nope + 63) / 64;
            const uint8_t *codes = src + 4 * rope, *scales = codes + 64 * nb;
            for (int64_t b = 0; b < nb; b++) {
                const float s = ue8m0(scales[b]);
                const int64_t n = nope - 64 * b < 64 ? nope - 64 * b : 64;
                for (int64_t i = 0; i < n; i++) dst[64 * b + i] = e4m3_lut[codes[64 * b + i]] * s;
            }
            memcpy(dst + nope, src, (size_t)rope * sizeof(float));
        } else {
            const int64_t nb = (width + 31) / 32;
            const uint8_t *scales = src + 16 * nb;
            float block[32];
            for (int64_t b = 0; b < nb; b++) {
                const float s = ue8m0(scales[b]);
                for (int i = 0; i < 16; i++) {
                    const uint8_t byte = src[16 * b + i];
                    block[2 * i] = e2m1_lut[byte & 15] * s;
                    block[2 * i + 1] = e2m1_lut[byte >> 4] * s;
                }
                const int64_t n = width - 32 * b < 32 ? width - 32 * b : 32;
                memcpy(dst + 32 * b, block, (size_t)n * sizeof(float));
            }
        }
    }
}
