/* The fused routed experts of a layer: gate and up products, the clamped SwiGLU times the routing weight, and the
 * down product, for E experts in two pool jobs (experts_run), with the row passes around them (gathering and
 * quantizing x, quantizing the SwiGLU output, the sum into out) spread over the pool too; and the layer's shared
 * expert in one call (shared_run).
 * Does not own: argument checks (bindings.c), the product kernels (kern_*.c), job preparation (dispatch.c).
 */
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"

/* ---------------------------------------------------------------- one expert's gate, up and SwiGLU */

typedef struct {
    const isa_ops *isa;
    mm_job gate, up; /* both write [T, I] buffers with ldo = I */
    const float *route_w;
    float limit;
    int64_t rows_per_chunk;
} ffn_ctx;

/* Rows [n0, n1) of gate and up, then h = silu(min(gate, l)) * clamp(up, -l, l) * route_w[t] into gate's buffer.
 * NaN passes through the clamps as in numpy (comparisons, not fminf). limit <= 0 means no clamp, as DeepSeek's
 * swiglu_limit = 0 does. */
static void ffn_phase1(void *p, int64_t i) {
    const ffn_ctx *c = p;
    const int64_t I = c->gate.N;
    int64_t n0 = i * c->rows_per_chunk, n1 = n0 + c->rows_per_chunk;
    if (n1 > I) n1 = I;
    c->isa->fp4(&c->gate, n0, n1);
    c->isa->fp4(&c->up, n0, n1);
    for (int64_t t = 0; t < c->gate.T; t++)
        swiglu_isa(c->isa, c->gate.out + t * I + n0, c->up.out + t * I + n0, c->gate.out + t * I + n0, n1 - n0,
                   c->limit, c->route_w[t]);
}

/* ---------------------------------------------------------------- a layer's experts in two pool jobs */

typedef struct {
    ffn_ctx *c;              /* one per expert, all with the same I and rows_per_chunk */
    const int64_t *order;    /* the experts in the order their chunks are handed out */
    int64_t chunks_per_expert;
} ffn_multi;

static void ffn_multi_phase1(void *p, int64_t i) {
    const ffn_multi *m = p;
    ffn_phase1(&m->c[m->order[i / m->chunks_per_expert]], i % m->chunks_per_expert);
}

/* The experts by token count, most first (ties in the given order): the pool hands chunks out in index order to
 * whichever thread is free, so the big pieces go first and the cheap ones fill the gaps at the end, instead of a
 * thread starting an 8-token expert as the other runs out of work (largest-first: within 4/3 of the best split).
 * The order of the work changes no result: every expert writes its own rows of gu and y. */
static void by_tokens(const int64_t *off, int64_t E, int64_t *order) {
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = off[e + 1] - off[e];
        int64_t i = e;
        for (; i > 0 && off[order[i - 1] + 1] - off[order[i - 1]] < n; i--) order[i] = order[i - 1];
        order[i] = e;
    }
}

/* An expert product's path: choose_path's, but never PATH_SPLIT (phase 1 writes gate and up straight into the
 * SwiGLU, so their rows cannot be three pseudo-tokens' partial sums). */
static int expert_path(const isa_ops *isa, const mm_job *job) {
    const int path = choose_path(isa, '4', job->x, job->T, job->K);
    return path == PATH_SPLIT ? PATH_FP32 : path;
}

/* ---------------------------------------------------------------- the row passes around the products, over the pool */

/* At prefill sizes (a 512-token chunk: M = 3072 token-expert rows of 4096) the gather and quantization of x, the
 * quantization of the SwiGLU output and the sum into out took ~10 % of a layer's experts on one thread while the
 * other waited. Each pass is cut so every output element is computed by one chunk in the order the serial loop
 * used: rows for the gather and the quantizations (each row on its own), column slices for the sum (every
 * element still adds its expert rows j in ascending order). */
typedef struct {
    const isa_ops *isa;
    const float *x;
    float *xs, *gu, *y, *out;
    const int64_t *rows;
    int64_t M, D, I, act_block, per; /* per: rows (columns for the sum) per chunk */
} pass_ctx;

static void gather_chunk(void *p, int64_t i) {
    const pass_ctx *c = p;
    const int64_t j0 = i * c->per, j1 = j0 + c->per < c->M ? j0 + c->per : c->M;
    for (int64_t j = j0; j < j1; j++) memcpy(c->xs + j * c->D, c->x + c->rows[j] * c->D, (size_t)c->D * sizeof(float));
    if (c->act_block) act_quant_rows(c->isa, c->xs + j0 * c->D, c->xs + j0 * c->D, j1 - j0, c->D, c->act_block);
}

static void quant_gu_chunk(void *p, int64_t i) {
    const pass_ctx *c = p;
    const int64_t j0 = i * c->per, j1 = j0 + c->per < c->M ? j0 + c->per : c->M;
    act_quant_rows(c->isa, c->gu + j0 * c->I, c->gu + j0 * c->I, j1 - j0, c->I, c->act_block);
}

static void sum_chunk(void *p, int64_t i) {
    const pass_ctx *c = p;
    const int64_t d0 = i * c->per, d1 = d0 + c->per < c->D ? d0 + c->per : c->D;
    for (int64_t j = 0; j < c->M; j++) { /* expert after expert: the fixed order of the sum */
        float *o = c->out + c->rows[j] * c->D;
        const float *v = c->y + j * c->D;
        for (int64_t d = d0; d < d1; d++) o[d] += v[d];
    }
}

/* n items in chunks of about 8 per thread (at least `least` items each): the chunk count, *per the items each. */
static int64_t pass_chunks(int64_t n, int64_t least, int64_t *per) {
    const int64_t target = 8 * (int64_t)pool_get_threads();
    *per = (n + target - 1) / target;
    if (*per < least) *per = least;
    return n > 0 ? (n + *per - 1) / *per : 0;
}

/* E routed experts of one layer (ew: 6 arrays each, as expert_ffn's w1, s1, w3, s3, w2, s2) as two pool jobs, all
 * gate/up rows then all down rows, instead of 2E. Expert e takes the tokens rows[off[e]] .. rows[off[e+1] - 1]
 * of x [*, D] with routing weights rw[off[e] ..]; its outputs are added into out[rows[j]] expert after expert, in
 * the given order: bit for bit what E expert_ffn calls (which are this with E = 1) and index_add_s in that order
 * give, since each expert's products choose their paths and sum as they do alone. Returns 0, or -1 for out of
 * memory. */
int experts_run(const isa_ops *isa, int64_t E, const uint8_t *const *ew, const float *x, int64_t D, int64_t I,
                const int64_t *rows, const int64_t *off, const float *rw, float limit, int64_t act_block, float *out) {
    const int64_t M = off[E];
    const size_t bytes = (size_t)E * 3 * (size_t)(I * D / 2); /* FP4 gate, up and down: a volatile stream */
    readahead_begin(E ? ew[0] : NULL, bytes, 0);
    float *xs = malloc((size_t)(M * D) * sizeof(float)), *gu = malloc((size_t)(2 * M * I) * sizeof(float));
    float *y = malloc((size_t)(M * D) * sizeof(float));
    ffn_ctx *c = calloc((size_t)E, sizeof(ffn_ctx));
    mm_job *down = calloc((size_t)E, sizeof(mm_job));
    mm_job *down_run = calloc((size_t)E, sizeof(mm_job)); /* down in by_tokens order */
    int64_t *order = calloc((size_t)E, sizeof(int64_t));
    prep_t *preps = calloc((size_t)(2 * E), sizeof(prep_t)); /* per expert: its gate/up inputs, its down inputs */
    int64_t prepared = 0;
    int rc = !xs || !gu || !y || !c || !down || !down_run || !order || !preps ? -1 : 0;
    if (!rc) {
        pass_ctx pc = {.isa = isa, .x = x, .xs = xs, .gu = gu, .y = y, .out = out, .rows = rows, .M = M, .D = D,
                       .I = I, .act_block = act_block};
        pool_run(pass_chunks(M, 4, &pc.per), gather_chunk, &pc); /* act_quant per row: as each expert's own x */
        const int64_t rpc = chunk_rows(E * I) < I ? chunk_rows(E * I) : (I + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
        for (int64_t e = 0; e < E && !rc; e++) {
            const int64_t T = off[e + 1] - off[e];
            const uint8_t *const *w = ew + 6 * e;
            c[e] = (ffn_ctx){.isa = isa, .route_w = rw + off[e], .limit = limit, .rows_per_chunk = rpc};
            c[e].gate = (mm_job){.x = xs + off[e] * D, .w = w[0], .s = w[1], .T = T, .N = I, .K = D,
                                 .out = gu + off[e] * I, .ldo = I};
            rc = prep_job(isa, '4', expert_path(isa, &c[e].gate), &c[e].gate, &preps[prepared++]);
            c[e].up = c[e].gate;
            c[e].up.w = w[2], c[e].up.s = w[3], c[e].up.out = gu + (M + off[e]) * I;
        }
        if (!rc) by_tokens(off, E, order);
        if (!rc) {
            ffn_multi m = {c, order, (I + rpc - 1) / rpc};
            pool_run(E * m.chunks_per_expert, ffn_multi_phase1, &m);
            pass_ctx pc = {.isa = isa, .gu = gu, .M = M, .I = I, .act_block = act_block};
            if (act_block) pool_run(pass_chunks(M, 4, &pc.per), quant_gu_chunk, &pc);
        }
        for (int64_t e = 0; e < E && !rc; e++) {
            const uint8_t *const *w = ew + 6 * e;
            down[e] = (mm_job){.x = gu + off[e] * I, .w = w[4], .s = w[5], .T = off[e + 1] - off[e], .N = D, .K = I,
                               .out = y + off[e] * D, .ldo = D, .accumulate = 0};
            rc = prep_job(isa, '4', expert_path(isa, &down[e]), &down[e], &preps[prepared++]); /* h decides */
        }
        if (!rc) {
            for (int64_t e = 0; e < E; e++) down_run[e] = down[order[e]]; /* prep_job holds &down[e]: copies run */
            run_jobs(isa->fp4, down_run, E);
            pass_ctx pc = {.y = y, .out = out, .rows = rows, .M = M, .D = D};
            pool_run(pass_chunks(D, 64, &pc.per), sum_chunk, &pc);
        }
    }
    for (int64_t i = 0; i < prepared; i++) finish_job(&preps[i], !rc);
    readahead_end(E ? ew[0] : NULL, bytes);
    free(preps);
    free(order);
    free(down_run);
    free(down);
    free(c);
    free(y);
    free(gu);
    free(xs);
    return rc;
}

/* ---------------------------------------------------------------- the shared expert */

/* The shared expert on T rows of x [T, D]: out = w2 q(swiglu(gate, up)) with [gate | up] = w13 q(x), w13 [2I, D]
 * (w1 and w3 stacked by rows), w2 [D, I]; q the FP8 activation rounding in blocks of act_block (none for 0); fmt13,
 * fmt2 '8' (FP8 with scales) or 'b' (bfloat16, scales NULL). The same routines on the same values as the op-by-op
 * path (fp8_act_quant, the stacked product, swiglu on gate and up as contiguous [T, I] arrays, fp8_act_quant, the w2
 * product), so the same bits. accumulate: added into out (each element out + its output) instead. Returns 0, or -1
 * for out of memory. */
int shared_run(const isa_ops *isa, const float *x, int64_t T, int64_t D, int64_t I, char fmt13, const uint8_t *w13,
               const uint8_t *s13, char fmt2, const uint8_t *w2, const uint8_t *s2, float limit, int64_t act_block,
               float *out, int accumulate) {
    float *xq = act_block ? malloc((size_t)(T * D) * sizeof(float)) : NULL;
    float *gu = malloc((size_t)(2 * T * I) * sizeof(float)), *g = malloc((size_t)(2 * T * I) * sizeof(float));
    float *y = accumulate ? malloc((size_t)(T * D) * sizeof(float)) : out;
    int rc = (act_block && !xq) || !gu || !g || !y ? -1 : 0;
    if (!rc) {
        if (act_block) act_quant_rows(isa, x, xq, T, D, act_block);
        mm_job up = {.x = act_block ? xq : x, .w = w13, .s = s13, .T = T, .N = 2 * I, .K = D, .out = gu,
                     .ldo = 2 * I, .accumulate = 0};
        rc = weights_product(isa, fmt13, &up, 1);
    }
    if (!rc) {
        float *u = g + T * I;
        for (int64_t t = 0; t < T; t++) {
            memcpy(g + t * I, gu + t * 2 * I, (size_t)I * sizeof(float));
            memcpy(u + t * I, gu + t * 2 * I + I, (size_t)I * sizeof(float));
        }
        swiglu_isa(isa, g, u, g, T * I, limit, 1.0f);
        if (act_block) act_quant_rows(isa, g, g, T, I, act_block);
        mm_job down = {.x = g, .w = w2, .s = s2, .T = T, .N = D, .K = I, .out = y, .ldo = D, .accumulate = 0};
        rc = weights_product(isa, fmt2, &down, 1);
    }
    if (!rc && accumulate) /* out + the whole output: one addition per element, as `routed + shared` */
        for (int64_t i = 0; i < T * D; i++) out[i] += y[i];
    if (accumulate) free(y);
    free(g);
    free(gu);
    free(xq);
    return rc;
}
