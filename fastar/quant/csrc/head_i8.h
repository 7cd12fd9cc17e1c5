/* The int8 screened LM head's kernels (head_i8.c): their jobs and contracts. Internal to the extension; the
 * bindings (bind_head_i8.c) check the arguments, these run with the GIL released.
 */
#ifndef FASTAR_HEAD_I8_H
#define FASTAR_HEAD_I8_H

#include <stdint.h>

#include "kernels.h"

/* The largest K of head_i8_dot: |sum_k x q| <= 128^2 K stays below 2^31 (exact int32), and a multiple of 64. */
#define HEAD_I8_MAX_K 131008
#define HEAD_I8_K_ALIGN 64
#define HEAD_I8_TILE_ROWS 4 /* q's rows per tile (head_i8_build's layout) */

/* q's layout, head_i8_build's and head_i8_dot's: where K % 64 == 0, the rows in whole groups of HEAD_I8_TILE_ROWS
 * (rows 4g .. 4g + 3, at bytes [4g K, (4g + 4) K)) are stored as tiles: row 4g + i's columns [64 j, 64 j + 64) at
 * 4g K + 256 j + 64 i (the four rows side by side per 64 columns, so a block of them is one sequential stream); the
 * rows after the last whole group, or every row where K % 64 != 0, as plain rows (row r at r K). */

/* head_i8_build: per row i of w (bfloat16 bits [V, K]), q in the layout above:
 *   - some w[i, k] infinite or NaN: q[i] = 0, scale 0, wnorm = dnorm = +inf, rowsum 0 (the row is always exact);
 *   - else amax = max_k |w[i, k]|; amax = 0: q[i] = 0, scale = wnorm = dnorm = 0, rowsum 0;
 *   - else s = amax / 127 (float32, rounded to nearest), q[i, k] = round-half-even(w[i, k] / s) (the quotient a
 *     float32, rounded to nearest) clamped to [-127, 127], scale s, wnorm = sqrt(sum_k w^2), dnorm =
 *     sqrt(sum_k (w - q s)^2) (each term exact in float64, the sums float64), rowsum = sum_k q.
 * The float32 steps run in IEEE's default environment whatever the caller's (x86-64: MXCSR set per chunk). */
typedef struct {
    const uint16_t *w;
    int64_t V, K;
    int8_t *q;
    float *scale;
    double *wnorm, *dnorm;
    int32_t *rowsum;
} head_build;
void head_i8_build_run(const isa_ops *isa, const head_build *b);

/* head_i8_dot: out[t, i] = sum_k x[t, k] q[i, k] exactly, q in head_i8_build's layout (K <= HEAD_I8_MAX_K, a
 * multiple of HEAD_I8_K_ALIGN; any int8 values), out [T, V]; rowsum[i] must be sum_k q[i, k] (head_i8_build's),
 * which the VNNI path uses. The weights are read once per 4 tokens (a sub-block of rows is re-read from L2 by the
 * next 4). Returns 0, or -1 for out of memory. */
typedef struct {
    const int8_t *x; /* [T, K] */
    const int8_t *q; /* [V, K] */
    const int32_t *rowsum;
    int32_t *out;
    int64_t T, V, K;
} head_dot;
int head_i8_dot_run(const isa_ops *isa, const head_dot *d);

/* Which way head_i8_dot runs under isa on this CPU, and its name ("avx512vnni", "avx2", "neon-dotprod", "portable"). */
enum { HEAD_PATH_PORTABLE, HEAD_PATH_AVX2, HEAD_PATH_VNNI, HEAD_PATH_SDOT };
int head_i8_path(const isa_ops *isa);
const char *head_i8_path_name(int path);

/* head_i8_select: the screened head's candidate rows (fastar/model/head_screen.py gives the bound's terms). dots
 * [2T, V] are head_i8_dot's products of the T decode rows' two int8 terms (rows t and T + t, scales sx[t], sx[T + t]).
 * For decode row t and head row i, in float32 and in this order: a1 = dots[t, i] * (sx[t] * scale[i]), a2 likewise
 * with row T + t, est = a1 + a2, b = c1[t] wnorm[i] + c2[t] dnorm[i], b += (|a1| + |a2|) margin; floor_t = max_i
 * (est - b); keep[i] = 1 where est + b >= floor_t for some t, else 0 (a scratch array of V bytes), and the rows kept,
 * ascending, in rows[0, n). Returns n.
 * off [T, V] (or NULL: all 0) shifts each bound by its own offset o = off[t, i] (a sampled row's race: the screen
 * bounds logit + o): est += o right after est = a1 + a2, and b += (|a1| + |a2| + |o|) margin in place of the term
 * above. An offset of 0 gives the same bits as none. */
typedef struct {
    const int32_t *dots;
    const float *sx, *scale, *c1, *c2, *wnorm, *dnorm;
    const float *off; /* [T, V] or NULL */
    float margin;
    int64_t T, V;
    uint8_t *keep;
    int64_t *rows;
} head_select;
int64_t head_i8_select_run(const isa_ops *isa, const head_select *s);

/* head_i8_screen: head_i8_dot and head_i8_select in one pass for T decode rows that take the first int8 term alone
 * where it settles a row: x [2T, K] are head_i8_quantize's terms (rows t and T + t, scales sx[t], sx[T + t]); c [T, 4]
 * per decode row the bound's c1 and c2 for the first term alone (c[t, 0], c[t, 1]: its own |dy| and |x|), then for
 * both terms (c[t, 2], c[t, 3]: head_i8_select's c1, c2). For decode row t and head row i, in float32 and in this
 * order: a1 = d1 * (sx[t] * scale[i]) (d1 = x[t] . q[i], exact), b1 = c[t,0] wnorm[i] + c[t,1] dnorm[i], b1 += |a1|
 * margin, ub1 = a1 + b1, lb1 = a1 - b1; and with the second term (d2 = x[T + t] . q[i]), as head_i8_select: a2 =
 * d2 * (sx[T + t] * scale[i]), est = a1 + a2, b2 = c[t,2] wnorm[i] + c[t,3] dnorm[i], b2 += (|a1| + |a2|) margin,
 * ub2 = est + b2, lb2 = est - b2. floor_t = max_i max(lb1, lb2); keep[i] = 1 where ub1 >= floor_t and ub2 >= floor_t
 * for some t (a scratch array of V bytes), the rows kept, ascending, in rows[0, n). Returns n, or -1 for out of memory.
 * The second term's product is computed only for the rows whose ub1 reaches the floor so far (a running maximum of
 * the lower bounds, shared by the threads), right after their sub-block's first terms, from L2: the others cannot
 * be kept, since the floor only rises. The rows kept do not depend on which: the row with the largest lower bound
 * has ub1 >= its lb2, so floor_t is the same (the bounds being sound). ub [T, V] is scratch (the products, then
 * min(ub1, ub2) or ub1). off [T, V] (or NULL) shifts the bounds as in head_i8_select: a1 + o in place of a1 in ub1
 * and lb1 with b1 += (|a1| + |o|) margin, and est = (a1 + a2) + o with b2 += (|a1| + |a2| + |o|) margin. */
typedef struct {
    const int8_t *x; /* [2T, K] */
    const int8_t *q; /* [V, K] in head_i8_build's layout */
    const int32_t *rowsum;
    const float *sx, *c, *scale, *wnorm, *dnorm;
    const float *off; /* [T, V] or NULL */
    float margin;
    int64_t T, V, K;
    float *ub;
    uint8_t *keep;
    int64_t *rows;
} head_screen;
int64_t head_i8_screen_run(const isa_ops *isa, const head_screen *s);

/* head_i8_quantize: decode rows y [T, K] as two int8 terms each, y ~ sx[t] x[t] + sx[T + t] x[T + t] (the second
 * takes the first's rounding error; each scale a float32, max |term| / 127), and per row in stats [T, 3] (float64)
 * |y - that sum|, |that sum|, |y|, and where ncol is 5 also the first term's alone, |y - sx[t] x[t]|, |sx[t] x[t]|
 * (head_i8_screen's bound). A row with a value that is not finite gets zero terms and stats of +inf. */
void head_i8_quantize_run(const float *y, int64_t T, int64_t K, int8_t *x, float *sx, double *stats, int ncol);

/* out[j] = w[idx[j]] for rows of row_bytes bytes, j < U (each idx checked by the caller), over the pool. */
void gather_rows_run(const void *w, int64_t row_bytes, const int64_t *idx, int64_t U, void *out);

#endif
