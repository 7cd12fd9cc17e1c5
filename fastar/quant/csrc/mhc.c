/* mHC (the hyper-connections between DeepSeek-V4's n residual streams) in C.
 *
 * Owns: the Sinkhorn projection of the mixing logits (fastar.model.ops.sinkhorn_torch).
 * Does not own: argument checks and the GIL (kernels.c).
 */
#include <math.h>

#include "kernels.h"

/* The mHC mixing matrix of each of B logits [n, n]: row softmax + eps, a column normalisation, then iters - 1
 * rounds of row and column normalisation (x / (sum + eps)), as fastar.model.ops.sinkhorn_torch; per matrix, in
 * one fixed order, so a token's result never depends on the batch. n <= 16. */
void sinkhorn_rows(const float *in, float *out, int64_t B, int n, int iters, float eps) {
    for (int64_t b = 0; b < B; b++) {
        const float *x = in + b * n * n;
        float *m = out + b * n * n;
        for (int i = 0; i < n; i++) {
            float mx = x[i * n];
            for (int j = 1; j < n; j++) mx = x[i * n + j] > mx ? x[i * n + j] : mx;
            float sum = 0.0f;
            for (int j = 0; j < n; j++) sum += (m[i * n + j] = expf(x[i * n + j] - mx));
            for (int j = 0; j < n; j++) m[i * n + j] = m[i * n + j] / sum + eps;
        }
        for (int it = 0; it < iters; it++) {
            if (it) /* rows */
                for (int i = 0; i < n; i++) {
                    float sum = 0.0f;
                    for (int j = 0; j < n; j++) sum += m[i * n + j];
                    for (int j = 0; j < n; j++) m[i * n + j] /= sum + eps;
                }
            for (int j = 0; j < n; j++) { /* columns */
                float sum = 0.0f;
                for (int i = 0; i < n; i++) sum += m[i * n + j];
                for (int i = 0; i < n; i++) m[i * n + j] /= sum + eps;
            }
        }
    }
}
