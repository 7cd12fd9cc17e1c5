/* The MoE router's routing weights after its top-k (fastar/model/route_fused.py): for each token, the picked experts'
 * scores gathered, their total, then each divided by the total and scaled. The same float32 operations in the same
 * order as the torch reference (`MoE.route`: `gather`, `sum(dim=-1)`, `div_`, `mul_`), so the same bits: torch sums
 * fewer than 8 contiguous values of a row in four interleaved partial sums, value i into sum i % 4 for the first
 * multiple of four values and the rest into sum 0, then sums 1, 2 and 3 into sum 0 (route_fused.py checks that the
 * torch it runs with still does, and falls back to torch otherwise). Portable scalar code: k is a handful of values.
 * Before the weights, where the caller asks: the scores themselves, sqrt(softplus(logit)) as torch's own scalar code
 * computes it (`x > 20 ? x : log1pf(expf(x))`, then the square root: the C library's functions, which torch's
 * elementwise loop calls for the values it does not take in SIMD vectors; its vector path rounds up to 1 ulp
 * differently), and a scored layer's top-k, the k largest of scores + bias in descending order, a tie to the lower
 * expert id and NaN above every number (`ops.topk_ordered`: torch's stable descending sort, its first k).
 * Owns: the arithmetic. Does not own: the argument checks (bind_route.c).
 */
#include <math.h>

#include "kernels.h"

void sqrtsoftplus_rows(const float *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) {
        const float a = x[i];
        out[i] = sqrtf(a > 20.0f ? a : log1pf(expf(a)));
    }
}

/* whether a ranks before b in a descending order that puts NaN first */
static inline int ranks_before(float a, float b) { return (isnan(a) && !isnan(b)) || a > b; }

void route_topk_rows(const float *scores, const float *bias, int64_t T, int64_t E, int64_t k, int64_t *idx) {
    float v[ROUTE_MAX_K];
    for (int64_t t = 0; t < T; t++) {
        const float *s = scores + t * E;
        int64_t *row = idx + t * k, n = 0;
        for (int64_t e = 0; e < E; e++) {
            const float x = s[e] + bias[e];
            if (n == k && !ranks_before(x, v[k - 1])) continue; /* a tie keeps the lower id already held */
            int64_t j = n < k ? n++ : k - 1;
            while (j > 0 && ranks_before(x, v[j - 1])) { /* after every kept value it does not rank before */
                v[j] = v[j - 1];
                row[j] = row[j - 1];
                j--;
            }
            v[j] = x;
            row[j] = e;
        }
    }
}

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

void route_by_expert_rows(int64_t *idx, float *w, int64_t T, int64_t k) {
    for (int64_t t = 0; t < T; t++) {
        int64_t *id = idx + t * k;
        float *x = w + t * k;
        for (int64_t i = 1; i < k; i++) { /* insertion sort: stable, and k is a handful */
            const int64_t e = id[i];
            const float y = x[i];
            int64_t j = i;
            for (; j > 0 && id[j - 1] > e; j--) {
                id[j] = id[j - 1];
                x[j] = x[j - 1];
            }
            id[j] = e;
            x[j] = y;
        }
    }
}
