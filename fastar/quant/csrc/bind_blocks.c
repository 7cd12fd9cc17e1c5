/* The attention block's decode-time sequences as one C call each: `attn_project` (the query and KV projections with
 * their norms, activation rounding and RoPE) and `attn_output` (inverse RoPE, bfloat16 rounding, the grouped O-LoRA
 * product and the output product). At decode each of these is a dozen Python-level ops around two products, and
 * their dispatch cost more than their arithmetic; here the same C routines run in the same order on the same values
 * (the products through dispatch.c's `product` / `grouped_product`, the rows through rowops.c and the ISA's
 * act_quant), so the results are bit-identical to fastar/model/deepseek_v4.py's `Attention._project` / `_output`
 * run op by op on the C extension (tests/test_fused_blocks.py compares them), and as batch-invariant. The row
 * passes between the products run one token per pool chunk (row_stage): every op there works on one token's rows
 * alone, so the split changes no bit, and the other thread no longer waits through them (at 8 rows they were ~10 %
 * of attn_output and ~4 % of attn_project, one thread working).
 * Owns: the argument checks and the sequences. Does not own: the arithmetic of any step, the choice of when to
 * call these (fastar/model/fused.py), the state updates and attention between them (Python).
 */
#include "bindings.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"

/* A weight for a product with K inputs: FP8 bytes [N, K] with UE8M0 scales [ceil(N/128), ceil(K/128)], or (s None)
 * bfloat16 bits [N, K]. Sets *fmt ('8' or 'b') and *N. */
static int get_weight(PyObject *ow, PyObject *os, view_t *vw, view_t *vs, const char *name, int64_t K, char *fmt,
                      int64_t *N) {
    *fmt = os == Py_None ? 'b' : '8';
    if (get_view(ow, vw, name, *fmt == 'b' ? 'H' : 'B', 2, 0)) return -1;
    *N = dim(vw, 0);
    if (shape_is(vw, name, *N, K, "= (N, the input width)")) return -1;
    if (*fmt == '8' && (get_view(os, vs, "scale", 'B', 2, 0) ||
                        shape_is(vs, "scale", (*N + FP8_BLOCK - 1) / FP8_BLOCK, (K + FP8_BLOCK - 1) / FP8_BLOCK,
                                 "= (ceil(N/128), ceil(K/128))")))
        return -1;
    return 0;
}

static int get_vector(PyObject *o, view_t *v, const char *name, int64_t n) {
    if (get_view(o, v, name, 'f', 1, 0)) return -1;
    if (v->b.shape[0] != n) {
        PyErr_Format(PyExc_ValueError, "%s has %zd values, expected %lld", name, v->b.shape[0], (long long)n);
        return -1;
    }
    return 0;
}

static int product_into(const isa_ops *isa, char fmt, const float *x, const view_t *vw, const view_t *vs, int64_t T,
                        int64_t K, float *out, int64_t G) {
    const int64_t N = dim(vw, 0);
    mm_job job = {.x = x, .w = vw->b.buf, .s = fmt == 'b' ? NULL : vs->b.buf, .T = T, .N = N, .K = K, .out = out,
                  .ldo = N, .accumulate = 0};
    return weights_product(isa, fmt, &job, G);
}

/* The row passes of both calls, one token t per pool chunk (the same ops on the same rows as a loop over the
 * tokens). */

typedef struct {
    const isa_ops *isa;
    int stage;
    int64_t d, Na, q_lora, D, H, half, act_block, nope_block;
    int bf16_input;
    float eps;
    const float *x, *qn, *kn, *cs, *sn;
    float *xq, *lin, *qr, *qa, *q, *kv;
} rows_ctx;

enum { PROJECT_IN, PROJECT_LORA, PROJECT_HEADS, OUTPUT_IN, OUTPUT_LORA };

static void row_stage(void *p, int64_t t) {
    const rows_ctx *c = p;
    const int64_t D = c->D, H = c->H, half = c->half;
    const float *cs = c->cs + t * half, *sn = c->sn + t * half;
    switch (c->stage) {
        case PROJECT_IN: /* x's FP8 rounding */
            act_quant_rows(c->isa, c->x + t * c->d, c->xq + t * c->d, 1, c->d, c->act_block);
            break;
        case PROJECT_LORA: /* the query and KV latents' norms, the query latent's FP8 rounding */
            rms_norm_rows(c->lin + t * c->Na, c->qn, c->qr + t * c->q_lora, 1, c->q_lora, c->eps);
            rms_norm_rows(c->lin + t * c->Na + c->q_lora, c->kn, c->kv + t * D, 1, D, c->eps);
            if (c->act_block)
                act_quant_rows(c->isa, c->qr + t * c->q_lora, c->qa + t * c->q_lora, 1, c->q_lora, c->act_block);
            break;
        case PROJECT_HEADS: { /* the weightless per-head norm, RoPE, the KV row's FP8 non-RoPE dims */
            float *q = c->q + t * H * D, *kv = c->kv + t * D;
            rms_norm_rows(q, NULL, q, H, D, c->eps);
            rope_rows(q, q, cs, sn, H, D, half, H, 0);
            rope_rows(kv, kv, cs, sn, 1, D, half, 1, 0);
            if (c->nope_block) act_quant_rows(c->isa, kv, kv, 1, D - 2 * half, c->nope_block);
            break;
        }
        case OUTPUT_IN: /* inverse RoPE, bfloat16 rounding */
            rope_rows(c->x + t * H * D, c->q + t * H * D, cs, sn, H, D, half, H, 1);
            if (c->bf16_input) bf16_round_rows(c->q + t * H * D, H * D);
            break;
        case OUTPUT_LORA: /* the O-LoRA output's FP8 rounding */
            act_quant_rows(c->isa, c->lin + t * c->Na, c->qa + t * c->Na, 1, c->Na, c->act_block);
            break;
    }
}

static void rows_run(rows_ctx *c, int stage, int64_t T) {
    c->stage = stage;
    pool_run(T, row_stage, c);
}

/* attn_project(x f32 [T, d], w_a, s_a, q_lora, w_b, s_b, q_norm f32 [q_lora], kv_norm f32 [D], cos f32 [T, h], sin,
 * eps, act_block, nope_block, q f32 [T, H*D], qr f32 [T, q_lora], kv f32 [T, D]) -> None.
 * w_a: wq_a and wkv stacked [q_lora + D, d]; w_b: wq_b [H*D, q_lora]; s None for bfloat16 weights. act_block > 0:
 * the products' inputs rounded to FP8 in blocks of it (the official numerics); nope_block > 0: the KV row's non-RoPE
 * dims too, in blocks of it (the FP8 KV cache). */
PyObject *py_attn_project(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *owa, *osa, *owb, *osb, *oqn, *okn, *oc, *os, *oq, *oqr, *okv;
    Py_ssize_t q_lora, act_block, nope_block;
    double eps;
    if (!PyArg_ParseTuple(args, "OOOnOOOOOOdnnOOO", &ox, &owa, &osa, &q_lora, &owb, &osb, &oqn, &okn, &oc, &os, &eps,
                          &act_block, &nope_block, &oq, &oqr, &okv))
        return NULL;
    view_t v[12];
    memset(v, 0, sizeof v);
    view_t *vx = &v[0], *vwa = &v[1], *vsa = &v[2], *vwb = &v[3], *vsb = &v[4], *vqn = &v[5], *vkn = &v[6];
    view_t *vc = &v[7], *vs = &v[8], *vq = &v[9], *vqr = &v[10], *vkv = &v[11];
    float *buf = NULL;
    char fa, fb;
    int64_t Na, Nb;
    if (get_view(ox, vx, "x", 'f', 2, 0)) goto fail;
    const int64_t T = dim(vx, 0), d = dim(vx, 1);
    if (get_weight(owa, osa, vwa, vsa, "w_a", d, &fa, &Na) || get_weight(owb, osb, vwb, vsb, "w_b", q_lora, &fb, &Nb))
        goto fail;
    const int64_t D = Na - q_lora;
    if (q_lora < 1 || D < 1 || get_vector(oqn, vqn, "q_norm", q_lora) || get_vector(okn, vkn, "kv_norm", D) ||
        get_view(oc, vc, "cos", 'f', 2, 0) || shape_is(vc, "cos", T, dim(vc, 1), "(one row per token)") ||
        get_view(os, vs, "sin", 'f', 2, 0) || shape_is(vs, "sin", T, dim(vc, 1), "(= cos's shape)"))
        goto fail;
    const int64_t half = dim(vc, 1);
    if (Nb % D || 2 * half > D || act_block < 0 || nope_block < 0 || (nope_block && (D - 2 * half) % nope_block)) {
        PyErr_Format(PyExc_ValueError, "attn_project: w_b rows (%lld) must be heads x D (%lld), 2 x cos width (%lld) "
                     "<= D, and the non-RoPE dims a multiple of nope_block (%zd)", (long long)Nb, (long long)D,
                     (long long)half, nope_block);
        goto fail;
    }
    const int64_t H = Nb / D;
    if (get_view(oq, vq, "q", 'f', 2, 1) || shape_is(vq, "q", T, Nb, "= (T, H*D)") ||
        get_view(oqr, vqr, "qr", 'f', 2, 1) || shape_is(vqr, "qr", T, q_lora, "= (T, q_lora)") ||
        get_view(okv, vkv, "kv", 'f', 2, 1) || shape_is(vkv, "kv", T, D, "= (T, D)") || no_overlap_named(vq, "q", v, 9) ||
        no_overlap_named(vqr, "qr", v, 10) || no_overlap_named(vkv, "kv", v, 11))
        goto fail;
    const size_t n_buf = (size_t)T * (size_t)(d + Na + q_lora);
    buf = malloc((n_buf ? n_buf : 1) * sizeof(float));
    if (!buf) {
        PyErr_NoMemory();
        goto fail;
    }
    const isa_ops *isa = cur_isa;
    const float *x = vx->b.buf, *qn = vqn->b.buf, *kn = vkn->b.buf, *cs = vc->b.buf, *sn = vs->b.buf;
    float *q = vq->b.buf, *qr = vqr->b.buf, *kv = vkv->b.buf;
    float *xq = buf, *lin = buf + T * d, *qa = lin + T * Na;
    const float e = (float)eps;
    int rc;
    rows_ctx rs = {.isa = isa, .d = d, .Na = Na, .q_lora = q_lora, .D = D, .H = H, .half = half, .act_block = act_block,
                    .nope_block = nope_block, .eps = e, .x = x, .qn = qn, .kn = kn, .cs = cs, .sn = sn, .xq = xq,
                    .lin = lin, .qr = qr, .qa = qa, .q = q, .kv = kv};
    Py_BEGIN_ALLOW_THREADS
    if (act_block) rows_run(&rs, PROJECT_IN, T);
    rc = product_into(isa, fa, act_block ? xq : x, vwa, vsa, T, d, lin, 1);
    if (!rc) {
        rows_run(&rs, PROJECT_LORA, T);
        rc = product_into(isa, fb, act_block ? qa : qr, vwb, vsb, T, q_lora, q, 1);
    }
    if (!rc) rows_run(&rs, PROJECT_HEADS, T);
    Py_END_ALLOW_THREADS
    free(buf);
    release(v, 12);
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
fail:
    free(buf);
    release(v, 12);
    return NULL;
}

/* attn_output(o f32 [T, H*D], cos f32 [T, h], sin, heads, bf16_input, w_a, s_a, groups, act_block, w_b, s_b, out f32
 * [T, d]) -> None: o's heads rotated back by their token's angles, rounded to bfloat16 where bf16_input, through
 * the grouped wo_a [G*R, H*D/G] (group g's input: heads g*H/G..), rounded to FP8 in blocks of act_block where > 0,
 * and wo_b [d, G*R]. */
PyObject *py_attn_output(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oo, *oc, *os, *owa, *osa, *owb, *osb, *out_o;
    Py_ssize_t H, G, act_block;
    int bf16_input;
    if (!PyArg_ParseTuple(args, "OOOnpOOnnOOO", &oo, &oc, &os, &H, &bf16_input, &owa, &osa, &G, &act_block, &owb, &osb,
                          &out_o))
        return NULL;
    view_t v[8];
    memset(v, 0, sizeof v);
    view_t *vo = &v[0], *vc = &v[1], *vs = &v[2], *vwa = &v[3], *vsa = &v[4], *vwb = &v[5], *vsb = &v[6], *vout = &v[7];
    float *buf = NULL;
    char fa, fb;
    int64_t Na, Nb;
    if (get_view(oo, vo, "o", 'f', 2, 0)) goto fail;
    const int64_t T = dim(vo, 0), HD = dim(vo, 1);
    if (H < 1 || G < 1 || HD % H || HD % G || act_block < 0) {
        PyErr_Format(PyExc_ValueError, "attn_output: o's width (%lld) must split into heads (%zd) and groups (%zd)",
                     (long long)HD, H, G);
        goto fail;
    }
    const int64_t D = HD / H;
    if (get_view(oc, vc, "cos", 'f', 2, 0) || shape_is(vc, "cos", T, dim(vc, 1), "(one row per token)") ||
        get_view(os, vs, "sin", 'f', 2, 0) || shape_is(vs, "sin", T, dim(vc, 1), "(= cos's shape)") ||
        get_weight(owa, osa, vwa, vsa, "w_a", HD / G, &fa, &Na))
        goto fail;
    const int64_t half = dim(vc, 1);
    if (2 * half > D || Na % G || (fa == '8' && G > 1 && (Na / G) % FP8_BLOCK)) {
        PyErr_Format(PyExc_ValueError, "attn_output: w_a rows (%lld) must split into %zd groups (of whole 128-row "
                     "scale blocks for FP8), and 2 x cos width (%lld) <= the head dim (%lld)", (long long)Na, G,
                     (long long)half, (long long)D);
        goto fail;
    }
    if (get_weight(owb, osb, vwb, vsb, "w_b", Na, &fb, &Nb) || get_view(out_o, vout, "out", 'f', 2, 1) ||
        shape_is(vout, "out", T, Nb, "= (T, wo_b's rows)") || no_overlap(vout, v, 7))
        goto fail;
    const size_t n_buf = (size_t)T * (size_t)(HD + 2 * Na);
    buf = malloc((n_buf ? n_buf : 1) * sizeof(float));
    if (!buf) {
        PyErr_NoMemory();
        goto fail;
    }
    const isa_ops *isa = cur_isa;
    const float *o = vo->b.buf, *cs = vc->b.buf, *sn = vs->b.buf;
    float *rot = buf, *z = buf + T * HD, *za = z + T * Na;
    int rc;
    /* OUTPUT_IN reads o as x and writes rot as q, OUTPUT_LORA z as lin and za as qa */
    rows_ctx rs = {.isa = isa, .Na = Na, .D = D, .H = H, .half = half, .act_block = act_block,
                    .bf16_input = bf16_input, .x = o, .cs = cs, .sn = sn, .lin = z, .qa = za, .q = rot};
    Py_BEGIN_ALLOW_THREADS
    rows_run(&rs, OUTPUT_IN, T);
    rc = product_into(isa, fa, rot, vwa, vsa, T, HD, z, G);
    if (!rc) {
        if (act_block) rows_run(&rs, OUTPUT_LORA, T);
        rc = product_into(isa, fb, act_block ? za : z, vwb, vsb, T, Na, vout->b.buf, 1);
    }
    Py_END_ALLOW_THREADS
    free(buf);
    release(v, 8);
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
fail:
    free(buf);
    release(v, 8);
    return NULL;
}

/* index_queries(qr f32 [T, q_lora], w_b, s_b, x f32 [T, d], w_w, s_w, cos f32 [T, h], sin, heads, act_block, rotate,
 * w_scale, q f32 [T, Hi*Di], w f32 [T, Hi]) -> None: the lightning indexer's queries and head weights at decode
 * (fastar/model/deepseek_v4.py's `Indexer.queries`, op by op): qr rounded to FP8 in blocks of act_block where > 0,
 * through wq_b [Hi*Di, q_lora], each head's last 2h dims rotated by its token's angles, where rotate the Hadamard
 * transform of each head (scaled by Di^-1/2) rounded to FP4 in blocks of 32; and x through weights_proj [Hi, d] times
 * w_scale. s None: bfloat16 weights. */
PyObject *py_index_queries(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oqr, *owb, *osb, *ox, *oww, *osw, *oc, *os, *oq, *ow;
    Py_ssize_t Hi, act_block;
    int rotate;
    double w_scale;
    if (!PyArg_ParseTuple(args, "OOOOOOOOnnpdOO", &oqr, &owb, &osb, &ox, &oww, &osw, &oc, &os, &Hi, &act_block, &rotate,
                          &w_scale, &oq, &ow))
        return NULL;
    view_t v[10];
    memset(v, 0, sizeof v);
    view_t *vqr = &v[0], *vwb = &v[1], *vsb = &v[2], *vx = &v[3], *vww = &v[4], *vsw = &v[5], *vc = &v[6], *vs = &v[7];
    view_t *vq = &v[8], *vw = &v[9];
    float *buf = NULL;
    char fb, fw;
    int64_t Nb, Nw;
    if (get_view(oqr, vqr, "qr", 'f', 2, 0) || get_view(ox, vx, "x", 'f', 2, 0)) goto fail;
    const int64_t T = dim(vqr, 0), q_lora = dim(vqr, 1), d = dim(vx, 1);
    if (shape_is(vx, "x", T, d, "(qr's rows)") || get_weight(owb, osb, vwb, vsb, "w_b", q_lora, &fb, &Nb) ||
        get_weight(oww, osw, vww, vsw, "w_w", d, &fw, &Nw) || get_view(oc, vc, "cos", 'f', 2, 0) ||
        shape_is(vc, "cos", T, dim(vc, 1), "(one row per token)") || get_view(os, vs, "sin", 'f', 2, 0) ||
        shape_is(vs, "sin", T, dim(vc, 1), "(= cos's shape)"))
        goto fail;
    const int64_t half = dim(vc, 1), Di = Hi > 0 ? Nb / Hi : 0;
    if (Hi < 1 || Nb % Hi || Nw != Hi || 2 * half > Di || act_block < 0 || (rotate && (Di & (Di - 1)))) {
        PyErr_Format(PyExc_ValueError, "index_queries: w_b rows (%lld) must be heads (%zd) x Di, w_w rows the heads "
                     "(%lld), 2 x cos width (%lld) <= Di, Di a power of two to rotate", (long long)Nb, Hi,
                     (long long)Nw, (long long)half);
        goto fail;
    }
    if (get_view(oq, vq, "q", 'f', 2, 1) || shape_is(vq, "q", T, Nb, "= (T, Hi*Di)") || get_view(ow, vw, "w", 'f', 2, 1) ||
        shape_is(vw, "w", T, Hi, "= (T, Hi)") || no_overlap_named(vq, "q", v, 8) || no_overlap_named(vw, "w", v, 9))
        goto fail;
    buf = malloc((size_t)(T * q_lora > 0 ? T * q_lora : 1) * sizeof(float));
    if (!buf) {
        PyErr_NoMemory();
        goto fail;
    }
    const isa_ops *isa = cur_isa;
    float *q = vq->b.buf, *w = vw->b.buf;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    if (act_block) act_quant_rows(isa, vqr->b.buf, buf, T, q_lora, act_block);
    rc = product_into(isa, fb, act_block ? buf : vqr->b.buf, vwb, vsb, T, q_lora, q, 1);
    if (!rc) {
        rope_rows(q, q, vc->b.buf, vs->b.buf, T * Hi, Di, half, Hi, 0);
        if (rotate) {
            hadamard_rows(q, q, T * Hi, Di, (float)pow((double)Di, -0.5)); /* Python's Di ** -0.5 */
            fp4_quant_rows(q, q, T * Hi, Di, 32);
        }
        rc = product_into(isa, fw, vx->b.buf, vww, vsw, T, d, w, 1);
    }
    if (!rc)
        for (int64_t i = 0; i < T * Hi; i++) w[i] *= (float)w_scale;
    Py_END_ALLOW_THREADS
    free(buf);
    release(v, 10);
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
fail:
    free(buf);
    release(v, 10);
    return NULL;
}
