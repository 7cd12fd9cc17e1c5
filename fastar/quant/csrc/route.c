/* The MoE router's routing weights after its top-k (fastar/model/route_fused.py): for each token, the picked experts'
 * scores gathered, their total, then each divided by the total and scaled. The same float32 operations in the same
 * order as the torch reference (`MoE.route`: `gather`, `sum(dim=-1)`, `div_`, `mul_`), so the same bits: torch sums
 * fewer than 8 contiguous values of a row in four interleaved partial sums, value i into sum i % 4 for the first
 * multiple of four values and the rest into sum 0, then sums 1, 2 and 3 into sum 0 (route_fused.py checks that the
 * torch it runs with still does, and falls back to torch otherwise). Portable scalar code: k is a handful of values.
 * Owns: the arithmetic. Does not own: the argument checks (bind_route.c), the top-k (torch's, whose order the sum
 * follows).
 */
#include "kernels.h"

/* A row's k < 8 values summed in torch's order for a short contiguous row (see above). */
static float torch_row_sum(const float *w, int64_t k) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const int64_t full = k / 4 * 4;
    for (int64_t i = 0; i < full; i++) acc[i % 4] += w[i];
    for (int64_t i = full; i < k; i++) acc[0] += w[i];
    return ((acc[0] + acc[1]) + acc[2]) + acc[3];
}

int route_weights_rows(const float *scores, int64_t T, int64_t E, const int64_t *idx, int64_t k, float eps, float scale,
                       float *out) {
    float w[ROUTE_MAX_K];
    for (int64_t t = 0; t < T; t++) {
        for (int64_t j = 0; j < k; j++) {
            const int64_t e = idx[t * k + j];
            if (e < 0 || e >= E) return (int)(t * k + j) + 1;
            w[j] = scores[t * E + e];
        }
        float total = torch_row_sum(w, k);
        if (eps != 0.0f) total += eps;
        for (int64_t j = 0; j < k; j++) out[t * k + j] = w[j] / total * scale;
    }
    return 0;
}
