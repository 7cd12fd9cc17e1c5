/* Bindings of the activation, row, mHC and attention ops: argument checks with the GIL held, then one call into
 * kern_scalar.c / the ISA's act_quant, rowops.c, mhc.c or attn.c with it released.
 * Does not own: the module and the argument helpers (bindings.c), the arithmetic.
 */
#include "bindings.h"

#include <string.h>

#include "dispatch.h"

/* ---------------------------------------------------------------- activation quantization */

/* fp8_act_quant(x, block, out) -> None; x, out float32 [R, K] (out may be x) */
PyObject *py_fp8_act_quant(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *oo;
    Py_ssize_t block;
    if (!PyArg_ParseTuple(args, "OnO", &ox, &block, &oo)) return NULL;
    view_t v[2];
    memset(v, 0, sizeof v);
    if (get_in_out(ox, oo, v, "x", 1)) goto fail;
    if (block < 1) {
        PyErr_Format(PyExc_ValueError, "block must be positive, got %zd", block);
        goto fail;
    }
    const isa_ops *isa = cur_isa;
    Py_BEGIN_ALLOW_THREADS
    act_quant_rows(isa, v[0].b.buf, v[1].b.buf, dim(&v[0], 0), dim(&v[0], 1), block);
    Py_END_ALLOW_THREADS
    release(v, 2);
    Py_RETURN_NONE;
fail:
    release(v, 2);
    return NULL;
}

/* ---------------------------------------------------------------- mHC (mhc.c) */

/* sinkhorn(logits f32 [B, n*n], n, iters, eps, out f32 [B, n*n]) -> None */
PyObject *py_sinkhorn(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *oo;
    int n, iters;
    double eps;
    if (!PyArg_ParseTuple(args, "OiidO", &ox, &n, &iters, &eps, &oo)) return NULL;
    view_t v[2];
    memset(v, 0, sizeof v);
    if (get_in_out(ox, oo, v, "logits", 0)) goto fail;
    if (n < 1 || n > 16 || iters < 1 || dim(&v[0], 1) != (int64_t)n * n) {
        PyErr_Format(PyExc_ValueError, "sinkhorn needs 1 <= n <= 16, iters >= 1 and logits [B, n*n]; got n=%d, "
                     "iters=%d, logits [%lld, %lld]", n, iters, (long long)dim(&v[0], 0), (long long)dim(&v[0], 1));
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    sinkhorn_rows(v[0].b.buf, v[1].b.buf, dim(&v[0], 0), n, iters, (float)eps);
    Py_END_ALLOW_THREADS
    release(v, 2);
    Py_RETURN_NONE;
fail:
    release(v, 2);
    return NULL;
}

/* ---------------------------------------------------------------- row-wise ops (rowops.c) */

/* Row ops over the pool: rows are independent and each is computed by one thread in its own fixed order, so the
 * result is bit-identical to one call over all rows (small inputs run on the calling thread alone). */
typedef struct {
    const float *x, *w, *cos, *sin;
    float *y;
    int64_t R, K, half, rows_per_token, rows_per_chunk, block;
    float eps, scale;
    int inverse, bf16;
} rowop_ctx;

static void norm_chunk(void *p, int64_t i) {
    const rowop_ctx *c = p;
    const int64_t r0 = i * c->rows_per_chunk, n = c->R - r0 < c->rows_per_chunk ? c->R - r0 : c->rows_per_chunk;
    rms_norm_rows(c->x + r0 * c->K, c->w, c->y + r0 * c->K, n, c->K, c->eps);
}

static void rope_chunk(void *p, int64_t i) {
    const rowop_ctx *c = p;
    int64_t r0 = i * c->rows_per_chunk, n = c->R - r0 < c->rows_per_chunk ? c->R - r0 : c->rows_per_chunk;
    /* rope_rows indexes cos / sin by row / rows_per_token: hand it whole tokens (chunks are multiples of them) */
    if (!c->bf16) {
        rope_rows(c->x + r0 * c->K, c->y + r0 * c->K, c->cos + r0 / c->rows_per_token * c->half,
                  c->sin + r0 / c->rows_per_token * c->half, n, c->K, c->half, c->rows_per_token, c->inverse);
        return;
    }
    /* then every element rounded to bfloat16, a token at a time while its rows are in cache */
    for (int64_t t = 0; t < n; t += c->rows_per_token, r0 += c->rows_per_token) {
        rope_rows(c->x + r0 * c->K, c->y + r0 * c->K, c->cos + r0 / c->rows_per_token * c->half,
                  c->sin + r0 / c->rows_per_token * c->half, c->rows_per_token, c->K, c->half, c->rows_per_token,
                  c->inverse);
        bf16_round_rows(c->y + r0 * c->K, c->rows_per_token * c->K);
    }
}

static void hadamard_chunk(void *p, int64_t i) {
    const rowop_ctx *c = p;
    const int64_t r0 = i * c->rows_per_chunk, n = c->R - r0 < c->rows_per_chunk ? c->R - r0 : c->rows_per_chunk;
    hadamard_rows(c->x + r0 * c->K, c->y + r0 * c->K, n, c->K, c->scale);
}

static void fp4_quant_chunk(void *p, int64_t i) {
    const rowop_ctx *c = p;
    const int64_t r0 = i * c->rows_per_chunk, n = c->R - r0 < c->rows_per_chunk ? c->R - r0 : c->rows_per_chunk;
    fp4_quant_rows(c->x + r0 * c->K, c->y + r0 * c->K, n, c->K, c->block);
}

static void rowops_run(chunk_fn fn, rowop_ctx *c, int64_t unit) {
    const int64_t target = 4 * (int64_t)pool_get_threads();
    int64_t rows = (c->R + target - 1) / target;
    rows = (rows + unit - 1) / unit * unit;
    c->rows_per_chunk = rows < unit ? unit : rows;
    const int64_t chunks = (c->R + c->rows_per_chunk - 1) / c->rows_per_chunk;
    if (c->R * c->K < (1 << 16) || chunks < 2) {
        c->rows_per_chunk = c->R;
        fn(c, 0);
    } else {
        pool_run(chunks, fn, c);
    }
}

/* rms_norm(x f32 [R, K], weight f32 [K] | None, eps, out f32 [R, K]) -> None; out may be x */
PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *ow, *oo;
    double eps;
    if (!PyArg_ParseTuple(args, "OOdO", &ox, &ow, &eps, &oo)) return NULL;
    view_t v[3];
    memset(v, 0, sizeof v);
    if (get_in_out(ox, oo, v, "x", 1)) goto fail;
    if (ow != Py_None) {
        if (get_view(ow, &v[2], "weight", 'f', 1, 0)) goto fail;
        if (v[2].b.shape[0] != dim(&v[0], 1)) {
            PyErr_Format(PyExc_ValueError, "weight has %zd values, expected %lld (x's last dim)", v[2].b.shape[0],
                         (long long)dim(&v[0], 1));
            goto fail;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    rowop_ctx c = {.x = v[0].b.buf, .w = ow != Py_None ? v[2].b.buf : NULL, .y = v[1].b.buf, .R = dim(&v[0], 0),
                   .K = dim(&v[0], 1), .eps = (float)eps};
    if (c.R > 0) rowops_run(norm_chunk, &c, 1);
    Py_END_ALLOW_THREADS
    release(v, 3);
    Py_RETURN_NONE;
fail:
    release(v, 3);
    return NULL;
}

/* rope(x f32 [R, D], cos f32 [T, h], sin f32 [T, h], inverse, out f32 [R, D], bf16=False) -> None: the last 2h dims
 * of each row rotated as interleaved pairs by its token's angles (R = T * rows per token), then with bf16 every
 * element of out rounded to the nearest bfloat16 (kept in float32, as torch's x.to(bfloat16).float()); out may be x */
PyObject *py_rope(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *oc, *os, *oo;
    int inverse, bf16 = 0;
    if (!PyArg_ParseTuple(args, "OOOpO|p", &ox, &oc, &os, &inverse, &oo, &bf16)) return NULL;
    view_t v[4];
    memset(v, 0, sizeof v);
    if (get_in_out(ox, oo, v, "x", 1) || get_view(oc, &v[2], "cos", 'f', 2, 0) || get_view(os, &v[3], "sin", 'f', 2, 0))
        goto fail;
    const int64_t R = dim(&v[0], 0), D = dim(&v[0], 1), T = dim(&v[2], 0), h = dim(&v[2], 1);
    if (shape_is(&v[3], "sin", T, h, "(= cos's shape)")) goto fail;
    if (T < 1 || R % T || 2 * h > D) {
        PyErr_Format(PyExc_ValueError, "rope needs x [T * m, D] with cos/sin [T, h] and 2h <= D; got x [%lld, %lld], "
                     "cos [%lld, %lld]", (long long)R, (long long)D, (long long)T, (long long)h);
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    rowop_ctx c = {.x = v[0].b.buf, .y = v[1].b.buf, .cos = v[2].b.buf, .sin = v[3].b.buf, .R = R, .K = D, .half = h,
                   .rows_per_token = R / T, .inverse = inverse, .bf16 = bf16};
    if (R > 0) rowops_run(rope_chunk, &c, R / T);
    Py_END_ALLOW_THREADS
    release(v, 4);
    Py_RETURN_NONE;
fail:
    release(v, 4);
    return NULL;
}

/* hadamard(x f32 [R, n], scale, out f32 [R, n]) -> None: each row's Walsh-Hadamard transform (n a power of two) times
 * scale; out may be x */
PyObject *py_hadamard(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *oo;
    double scale;
    if (!PyArg_ParseTuple(args, "OdO", &ox, &scale, &oo)) return NULL;
    view_t v[2];
    memset(v, 0, sizeof v);
    if (get_in_out(ox, oo, v, "x", 1)) goto fail;
    const int64_t n = dim(&v[0], 1);
    if (n < 1 || (n & (n - 1))) {
        PyErr_Format(PyExc_ValueError, "hadamard needs a power-of-two row length, got %lld", (long long)n);
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    rowop_ctx c = {.x = v[0].b.buf, .y = v[1].b.buf, .R = dim(&v[0], 0), .K = n, .scale = (float)scale};
    if (c.R > 0) rowops_run(hadamard_chunk, &c, 1);
    Py_END_ALLOW_THREADS
    release(v, 2);
    Py_RETURN_NONE;
fail:
    release(v, 2);
    return NULL;
}

/* fp4_act_quant(x f32 [R, K], block, out f32 [R, K]) -> None: FP4 e2m1 quantize-dequantize per block of a row with
 * power-of-two scales (fastar.model.ops.fp4_quant_sim); out may be x */
PyObject *py_fp4_act_quant(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *oo;
    Py_ssize_t block;
    if (!PyArg_ParseTuple(args, "OnO", &ox, &block, &oo)) return NULL;
    view_t v[2];
    memset(v, 0, sizeof v);
    if (get_in_out(ox, oo, v, "x", 1)) goto fail;
    if (block < 1) {
        PyErr_Format(PyExc_ValueError, "block must be positive, got %zd", block);
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    rowop_ctx c = {.x = v[0].b.buf, .y = v[1].b.buf, .R = dim(&v[0], 0), .K = dim(&v[0], 1), .block = block};
    if (c.R > 0 && c.K > 0) rowops_run(fp4_quant_chunk, &c, 1);
    Py_END_ALLOW_THREADS
    release(v, 2);
    Py_RETURN_NONE;
fail:
    release(v, 2);
    return NULL;
}

/* swiglu(gate f32 [T, I], up f32 [T, I], limit, out f32 [T, I]) -> None: silu(min(gate, l)) * clamp(up, -l, l)
 * (limit <= 0: no clamp) */
PyObject *py_swiglu(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *og, *ou, *oo;
    double limit;
    if (!PyArg_ParseTuple(args, "OOdO", &og, &ou, &limit, &oo)) return NULL;
    view_t v[3];
    memset(v, 0, sizeof v);
    if (get_in_out(og, oo, v, "gate", 0) || get_view(ou, &v[2], "up", 'f', 2, 0) ||
        shape_is(&v[2], "up", dim(&v[0], 0), dim(&v[0], 1), "(= gate's shape)") || no_overlap(&v[1], &v[2], 1))
        goto fail;
    const isa_ops *isa = cur_isa;
    Py_BEGIN_ALLOW_THREADS
    swiglu_isa(isa, v[0].b.buf, v[2].b.buf, v[1].b.buf, dim(&v[0], 0) * dim(&v[0], 1), (float)limit, 1.0f);
    Py_END_ALLOW_THREADS
    release(v, 3);
    Py_RETURN_NONE;
fail:
    release(v, 3);
    return NULL;
}

/* hc_pre(x, fn, base, scale, n, iters, hc_eps, eps, u, post=None, comb=None, norm=None, norm_eps=0) -> None: a layer
 * site's mHC collapse, x f32 [T, n*d] (the flattened streams), fn f32 [R, n*d], base f32 [R], scale f32 [3] -> u f32
 * [T, d], post f32 [T, n], comb f32 [T, n*n], with R = (2+n)*n; with post and comb None, the final head: R = n, scale
 * [1], u only. norm f32 [d]: u then goes through the RMS norm with that weight (the sub-layer's input norm, as the
 * rms_norm call would: the same bits, one call less). */
PyObject *py_hc_pre(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kws[] = {"x", "fn", "base", "scale", "n", "iters", "hc_eps", "eps", "u", "post", "comb", "norm",
                          "norm_eps", NULL};
    /* x, fn, base, scale, u, post, comb, norm */
    PyObject *o[8] = {NULL, NULL, NULL, NULL, NULL, Py_None, Py_None, Py_None};
    int n, iters;
    double hc_eps, eps, norm_eps = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOiiddO|OOOd", kws, &o[0], &o[1], &o[2], &o[3], &n, &iters, &hc_eps,
                                     &eps, &o[4], &o[5], &o[6], &o[7], &norm_eps))
        return NULL;
    const int head = o[5] == Py_None;
    if (head != (o[6] == Py_None))
        return PyErr_Format(PyExc_ValueError, "post and comb must both be arrays (a layer's mHC) or both None (the head)");
    if (n < 1 || n > 16) return PyErr_Format(PyExc_ValueError, "n must be in [1, 16], got %d", n);
    if (!head && iters < 1) return PyErr_Format(PyExc_ValueError, "iters must be >= 1, got %d", iters);
    view_t v[7], vn;
    memset(v, 0, sizeof v);
    memset(&vn, 0, sizeof vn);
    static const char *names[7] = {"x", "fn", "base", "scale", "u", "post", "comb"};
    const int nv = head ? 5 : 7;
    for (int i = 0; i < nv; i++)
        if (get_view(o[i], &v[i], names[i], 'f', i == 2 || i == 3 ? 1 : 2, i >= 4)) goto fail;
    if (o[7] != Py_None && get_view(o[7], &vn, "norm", 'f', 1, 0)) goto fail;
    const int64_t T = dim(&v[0], 0), K = dim(&v[0], 1), d = K / n, R = head ? n : (int64_t)(2 + n) * n;
    if (K % n) {
        PyErr_Format(PyExc_ValueError, "x has shape (%lld, %lld), expected (T, n*d) with n = %d", (long long)T,
                     (long long)K, n);
        goto fail;
    }
    if (shape_is(&v[1], "fn", R, K, head ? "= (n, n*d) for the head" : "= ((2+n)*n, n*d)")) goto fail;
    if (dim(&v[2], 0) != R || dim(&v[3], 0) != (head ? 1 : 3)) {
        PyErr_Format(PyExc_ValueError, "base has %lld entries and scale %lld, expected %lld (fn's rows) and %d",
                     (long long)dim(&v[2], 0), (long long)dim(&v[3], 0), (long long)R, head ? 1 : 3);
        goto fail;
    }
    if (shape_is(&v[4], "u", T, d, "= (T, d)") || no_overlap_named(&v[4], "u", v, 4)) goto fail;
    if (vn.held && dim(&vn, 0) != d) {
        PyErr_Format(PyExc_ValueError, "norm has %lld values, expected %lld (d)", (long long)dim(&vn, 0), (long long)d);
        goto fail;
    }
    if (!head && (shape_is(&v[5], "post", T, n, "= (T, n)") || shape_is(&v[6], "comb", T, (int64_t)n * n, "= (T, n*n)") ||
                  no_overlap_named(&v[5], "post", v, 5) || no_overlap_named(&v[6], "comb", v, 6)))
        goto fail;
    const isa_ops *isa = cur_isa;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = hc_pre_run(isa, v[0].b.buf, v[1].b.buf, v[2].b.buf, v[3].b.buf, T, n, d, head, iters, (float)hc_eps,
                    (float)eps, v[4].b.buf, head ? NULL : v[5].b.buf, head ? NULL : v[6].b.buf);
    if (!rc && vn.held) {
        rowop_ctx c = {.x = v[4].b.buf, .w = vn.b.buf, .y = v[4].b.buf, .R = T, .K = d, .eps = (float)norm_eps};
        if (c.R > 0) rowops_run(norm_chunk, &c, 1);
    }
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        goto fail;
    }
    release(v, nv);
    release(&vn, 1);
    Py_RETURN_NONE;
fail:
    release(v, nv);
    release(&vn, 1);
    return NULL;
}

/* hc_post(f, x, post, comb, out) -> None: the mix back, out f32 [T, n*d] from the sub-layer output f f32 [T, d],
 * the streams x f32 [T, n*d], post f32 [T, n] and comb f32 [T, n*n] (n from post). */
PyObject *py_hc_post(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kws[] = {"f", "x", "post", "comb", "out", NULL};
    PyObject *o[5];
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOO", kws, &o[0], &o[1], &o[2], &o[3], &o[4])) return NULL;
    view_t v[5];
    memset(v, 0, sizeof v);
    static const char *names[5] = {"f", "x", "post", "comb", "out"};
    for (int i = 0; i < 5; i++)
        if (get_view(o[i], &v[i], names[i], 'f', 2, i == 4)) goto fail;
    const int64_t T = dim(&v[0], 0), d = dim(&v[0], 1), n = dim(&v[2], 1);
    if (n < 1) {
        PyErr_Format(PyExc_ValueError, "post has shape (%lld, 0), expected (T, n) with n >= 1", (long long)dim(&v[2], 0));
        goto fail;
    }
    if (shape_is(&v[1], "x", T, n * d, "= (T, n*d), n = post.shape[1], d = f.shape[1]") ||
        shape_is(&v[2], "post", T, n, "= (T, n), T = f.shape[0]") || shape_is(&v[3], "comb", T, n * n, "= (T, n*n)") ||
        shape_is(&v[4], "out", T, n * d, "= x.shape") || no_overlap(&v[4], v, 4))
        goto fail;
    const isa_ops *isa = cur_isa;
    Py_BEGIN_ALLOW_THREADS
    hc_post_run(isa, v[0].b.buf, v[1].b.buf, v[2].b.buf, v[3].b.buf, T, (int)n, d, v[4].b.buf);
    Py_END_ALLOW_THREADS
    release(v, 5);
    Py_RETURN_NONE;
fail:
    release(v, 5);
    return NULL;
}

/* ---------------------------------------------------------------- attention */

/* attend(q, keys, k0, p0, window, comp, comp_idx, ratio, sinks, scale, out) -> None: DeepSeek-V4's attention of
 * the queries q f32 [T, H, D] at positions p0.. over the window keys f32 [K, D] (row i at position k0 + i; query
 * p sees positions (p - window, p]) and the compressed entries comp f32 [E, D] (or None): those comp_idx i64
 * [T, k] picks (< 0: none), or with comp_idx None every e < (p + 1) // ratio; sinks f32 [H]; out f32 [T, H, D]. */
PyObject *py_attend(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kws[] = {"q", "keys", "k0", "p0", "window", "comp", "comp_idx", "ratio", "sinks", "scale", "out",
                          NULL};
    PyObject *oq, *ok, *oc, *oi, *os, *oo;
    Py_ssize_t k0, p0, window, ratio;
    double scale;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOnnnOOnOdO", kws, &oq, &ok, &k0, &p0, &window, &oc, &oi, &ratio, &os,
                                     &scale, &oo))
        return NULL;
    view_t v[6]; /* q, keys, sinks, comp, comp_idx, out */
    memset(v, 0, sizeof v);
    const int has_comp = oc != Py_None, has_idx = oi != Py_None;
    if (get_view(oq, &v[0], "q", 'f', 3, 0) || get_view(ok, &v[1], "keys", 'f', 2, 0) ||
        get_view(os, &v[2], "sinks", 'f', 1, 0) || (has_comp && get_view(oc, &v[3], "comp", 'f', 2, 0)) ||
        (has_idx && get_view(oi, &v[4], "comp_idx", 'q', 2, 0)) || get_view(oo, &v[5], "out", 'f', 3, 1))
        goto fail;
    const int64_t T = dim(&v[0], 0), H = dim(&v[0], 1), D = dim(&v[0], 2), E = has_comp ? dim(&v[3], 0) : 0;
    if (dim(&v[5], 0) != T || dim(&v[5], 1) != H || dim(&v[5], 2) != D) {
        PyErr_Format(PyExc_ValueError, "out has shape (%lld, %lld, %lld), expected q's (%lld, %lld, %lld)",
                     (long long)dim(&v[5], 0), (long long)dim(&v[5], 1), (long long)dim(&v[5], 2), (long long)T,
                     (long long)H, (long long)D);
        goto fail;
    }
    if (dim(&v[2], 0) != H) {
        PyErr_Format(PyExc_ValueError, "sinks has %lld entries, expected H = %lld (q.shape[1])",
                     (long long)dim(&v[2], 0), (long long)H);
        goto fail;
    }
    if (has_idx && !has_comp) {
        PyErr_SetString(PyExc_ValueError, "comp_idx needs comp (the entries it picks from)");
        goto fail;
    }
    if (shape_is(&v[1], "keys", dim(&v[1], 0), D, "= (K, D), D as q's") ||
        (has_comp && shape_is(&v[3], "comp", E, D, "= (E, D), D as q's")) ||
        (has_idx && shape_is(&v[4], "comp_idx", T, dim(&v[4], 1), "= (T, k), T as q's")))
        goto fail;
    if (k0 < 0 || p0 < 0 || window < 1 || ratio < 0 || (has_comp && !has_idx && ratio < 1)) {
        PyErr_Format(PyExc_ValueError, "attend needs k0 >= 0, p0 >= 0, window >= 1 and ratio >= 0 (>= 1 with comp and "
                     "no comp_idx); got k0=%zd, p0=%zd, window=%zd, ratio=%zd", k0, p0, window, ratio);
        goto fail;
    }
    if (has_idx) {
        const int64_t *idx = v[4].b.buf, n = T * dim(&v[4], 1);
        for (int64_t i = 0; i < n; i++)
            if (idx[i] >= E) {
                PyErr_Format(PyExc_ValueError, "comp_idx[%lld, %lld] = %lld is not an entry of comp (E = %lld)",
                             (long long)(i / dim(&v[4], 1)), (long long)(i % dim(&v[4], 1)), (long long)idx[i],
                             (long long)E);
                goto fail;
            }
    }
    if (no_overlap(&v[5], v, 5)) goto fail;
    const attn_job job = {.q = v[0].b.buf, .keys = v[1].b.buf, .comp = has_comp ? v[3].b.buf : NULL,
                          .idx = has_idx ? v[4].b.buf : NULL, .sinks = v[2].b.buf, .out = v[5].b.buf, .T = T, .H = H,
                          .D = D, .K = dim(&v[1], 0), .E = E, .k = has_idx ? dim(&v[4], 1) : 0, .k0 = k0, .p0 = p0,
                          .window = window, .ratio = ratio, .scale = (float)scale};
    const isa_ops *isa = cur_isa;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = attn_run(isa, &job);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        goto fail;
    }
    release(v, 6);
    Py_RETURN_NONE;
fail:
    release(v, 6);
    return NULL;
}

/* ---------------------------------------------------------------- packed decode-state rows (attn_prefill.c) */

int64_t packed_row_bytes(int kind, Py_ssize_t rope, int64_t W) {
    if (kind == STATE_FP8 && rope >= 0 && rope < W) return (4 * rope + 65 * ((W - rope + 63) / 64) + 3) / 4 * 4;
    if (kind == STATE_FP4) return 17 * ((W + 31) / 32);
    return 0;
}

/* state_rows_encode(x f32 [k, W], kind, rope, raw u8 [k, B]) -> int: -1, or the first row that is not exactly
 * codes * scales (raw is then partly written: the caller discards it). */
PyObject *py_state_rows_encode(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *oraw;
    int kind;
    Py_ssize_t rope;
    if (!PyArg_ParseTuple(args, "OinO", &ox, &kind, &rope, &oraw)) return NULL;
    view_t v[2];
    memset(v, 0, sizeof v);
    if (get_view(ox, &v[0], "x", 'f', 2, 0) || get_view(oraw, &v[1], "raw", 'B', 2, 1)) goto fail;
    const int64_t k = dim(&v[0], 0), W = dim(&v[0], 1), need = packed_row_bytes(kind, rope, W);
    if (!need || shape_is(&v[1], "raw", k, need, "(x's rows, the format's row bytes)")) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "state_rows_encode: bad kind %d / rope %zd", kind, rope);
        goto fail;
    }
    if (no_overlap_named(&v[1], "raw", v, 1)) goto fail;
    int64_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = state_rows_encode(v[0].b.buf, v[1].b.buf, k, need, kind, W, rope);
    Py_END_ALLOW_THREADS
    release(v, 2);
    return PyLong_FromLongLong(bad);
fail:
    release(v, 2);
    return NULL;
}

/* state_rows_decode(raw u8 [k, B], kind, rope, out f32 [k, W]) -> None: kind 0 (FP8 + float32 rope dims) or 1
 * (FP4); B must be the format's row size for width W (state.py: RowFormat.stored_width). Rows are independent:
 * spread over the pool in blocks (bit-identical for any thread count). */
PyObject *py_state_rows_decode(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oraw, *oo;
    int kind;
    Py_ssize_t rope;
    if (!PyArg_ParseTuple(args, "OinO", &oraw, &kind, &rope, &oo)) return NULL;
    view_t v[2];
    memset(v, 0, sizeof v);
    if (get_view(oraw, &v[0], "raw", 'B', 2, 0) || get_view(oo, &v[1], "out", 'f', 2, 1)) goto fail;
    const int64_t k = dim(&v[0], 0), B = dim(&v[0], 1), W = dim(&v[1], 1), need = packed_row_bytes(kind, rope, W);
    if (!need || B != need || dim(&v[1], 0) != k) {
        PyErr_Format(PyExc_ValueError, "state_rows_decode: kind %d, rope %zd: raw [%lld, %lld] does not hold rows of "
                     "out [%lld, %lld] (expected %lld bytes a row)", kind, rope, (long long)k, (long long)B,
                     (long long)dim(&v[1], 0), (long long)W, (long long)need);
        goto fail;
    }
    if (no_overlap(&v[1], &v[0], 1)) goto fail;
    Py_BEGIN_ALLOW_THREADS
    state_rows_decode_pool(v[0].b.buf, v[1].b.buf, k, B, kind, W, rope);
    Py_END_ALLOW_THREADS
    release(v, 2);
    Py_RETURN_NONE;
fail:
    release(v, 2);
    return NULL;
}

/* The lightning indexer's scores of queries at positions p0.. (attn_prefill.c), -inf for entries a query does not see
 * yet, over keys f32 [E, Di] or (packed) over the keys as the decode state stores them, u8 [E, 17 Di / 32] (FP4 e2m1
 * codes and UE8M0 block scales: state_rows_decode's "fp4" rows), each decoded inside the kernel exactly as
 * state_rows_decode would: the same scores without the float32 copy of every key. Returns False (out untouched)
 * where the ISA has no kernel for them (packed: no vdpbf16ps, or Di not a multiple of 32). bf16: the caller
 * declares q and keys bfloat16 values (FP4-rounded: official numerics; packed keys are by construction), checked
 * (ValueError otherwise); vdpbf16ps runs where the ISA has it. */
static PyObject *index_scores(PyObject *oq, PyObject *ow, PyObject *ok, Py_ssize_t p0, double scale, PyObject *oo,
                              int bf16, int packed) {
    const char *name = packed ? "index_scores_fp4" : "index_scores";
    view_t v[4];
    memset(v, 0, sizeof v);
    if (get_view(oq, &v[0], "q", 'f', 3, 0) || get_view(ow, &v[1], "w", 'f', 2, 0) ||
        get_view(ok, &v[2], packed ? "rows" : "keys", packed ? 'B' : 'f', 2, 0) || get_view(oo, &v[3], "out", 'f', 2, 1))
        goto fail;
    const int64_t T = dim(&v[0], 0), Hi = dim(&v[0], 1), Di = dim(&v[0], 2), E = dim(&v[2], 0);
    const int64_t width = packed ? 17 * Di / 32 : Di; /* a key's stored values */
    if (shape_is(&v[1], "w", T, Hi, "[T, Hi] of q") || (packed && Di % 32) || dim(&v[2], 1) != width ||
        shape_is(&v[3], "out", T, E, "[T, E]") || p0 < 0) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "%s needs %s [E, %lld]%s and p0 >= 0; got Di=%lld, %s [%lld, %lld], p0=%zd",
                         name, packed ? "rows" : "keys", (long long)width,
                         packed ? " (17 Di / 32, Di a multiple of 32)" : "", (long long)Di, packed ? "rows" : "keys",
                         (long long)E, (long long)dim(&v[2], 1), p0);
        goto fail;
    }
    if (no_overlap(&v[3], v, 3)) goto fail;
    int rc = 0;
    const isa_ops *isa = cur_isa;
    Py_BEGIN_ALLOW_THREADS
    index_job j = {.q = v[0].b.buf, .w = v[1].b.buf, .keys = packed ? NULL : v[2].b.buf,
                   .packed = packed ? v[2].b.buf : NULL, .out = v[3].b.buf, .T = T, .Hi = Hi, .Di = Di, .E = E,
                   .p0 = p0, .scale = (float)scale, .bf16 = bf16};
    if (T > 0 && E > 0) rc = index_scores_run(isa, &j);
    Py_END_ALLOW_THREADS
    if (rc == -2) {
        PyErr_Format(PyExc_ValueError, "%s: bf16 declared but q or keys are not all bfloat16 values", name);
        goto fail;
    }
    if (rc < 0) {
        PyErr_NoMemory();
        goto fail;
    }
    release(v, 4);
    return PyBool_FromLong(rc == 0);
fail:
    release(v, 4);
    return NULL;
}

/* index_scores(q f32 [T, Hi, Di], w f32 [T, Hi], keys f32 [E, Di], p0, scale, out f32 [T, E], bf16=False) -> bool */
PyObject *py_index_scores(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oq, *ow, *ok, *oo;
    Py_ssize_t p0;
    double scale;
    int bf16 = 0;
    if (!PyArg_ParseTuple(args, "OOOndO|p", &oq, &ow, &ok, &p0, &scale, &oo, &bf16)) return NULL;
    return index_scores(oq, ow, ok, p0, scale, oo, bf16, 0);
}

/* index_scores_fp4(q f32 [T, Hi, Di], w f32 [T, Hi], rows u8 [E, 17 Di / 32], p0, scale, out f32 [T, E]) -> bool:
 * index_scores with bf16=True over packed keys */
PyObject *py_index_scores_fp4(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oq, *ow, *ok, *oo;
    Py_ssize_t p0;
    double scale;
    if (!PyArg_ParseTuple(args, "OOOndO", &oq, &ow, &ok, &p0, &scale, &oo)) return NULL;
    return index_scores(oq, ow, ok, p0, scale, oo, 1, 1);
}

/* index_topk(score f32 [T, E], p0, out i64 [T, k]) -> None: the lightning indexer's picks (attn_prefill.c): for
 * query t at position p0 + t, the k best-scored entries it sees, ascending, then -1. */
PyObject *py_index_topk(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *os, *oo;
    Py_ssize_t p0;
    if (!PyArg_ParseTuple(args, "OnO", &os, &p0, &oo)) return NULL;
    view_t v[2];
    memset(v, 0, sizeof v);
    if (get_view(os, &v[0], "score", 'f', 2, 0) || get_view(oo, &v[1], "out", 'q', 2, 1)) goto fail;
    const int64_t T = dim(&v[0], 0), E = dim(&v[0], 1), k = dim(&v[1], 1);
    if (dim(&v[1], 0) != T || k < 1 || p0 < 0) {
        PyErr_Format(PyExc_ValueError, "index_topk needs out [T, k] with k >= 1 and p0 >= 0; got score [%lld, %lld], "
                     "out [%lld, %lld], p0=%zd", (long long)T, (long long)E, (long long)dim(&v[1], 0), (long long)k,
                     p0);
        goto fail;
    }
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    if (T > 0) rc = index_topk_run(v[0].b.buf, v[1].b.buf, T, E, k, p0);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        goto fail;
    }
    release(v, 2);
    Py_RETURN_NONE;
fail:
    release(v, 2);
    return NULL;
}

/* compress_pool(kv f32 [n, M, hd], gate f32 [n, M, hd], out f32 [n, hd]) -> None: the compressor's pooling of n
 * closed windows (attn_prefill.c). */
PyObject *py_compress_pool(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *okv, *og, *oo;
    if (!PyArg_ParseTuple(args, "OOO", &okv, &og, &oo)) return NULL;
    view_t v[3];
    memset(v, 0, sizeof v);
    if (get_view(okv, &v[0], "kv", 'f', 3, 0) || get_view(og, &v[1], "gate", 'f', 3, 0) ||
        get_view(oo, &v[2], "out", 'f', 2, 1))
        goto fail;
    const int64_t n = dim(&v[0], 0), M = dim(&v[0], 1), hd = dim(&v[0], 2);
    if (M < 1 || dim(&v[1], 0) != n || dim(&v[1], 1) != M || dim(&v[1], 2) != hd ||
        shape_is(&v[2], "out", n, hd, "[n, hd]")) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "compress_pool needs gate shaped as kv [%lld, %lld, %lld] with rows in a "
                         "window (M >= 1)", (long long)n, (long long)M, (long long)hd);
        goto fail;
    }
    if (no_overlap(&v[2], v, 2)) goto fail;
    int rc = 0;
    const isa_ops *isa = cur_isa;
    Py_BEGIN_ALLOW_THREADS
    if (n > 0) rc = compress_pool_run(isa, v[0].b.buf, v[1].b.buf, v[2].b.buf, n, M, hd);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        goto fail;
    }
    release(v, 3);
    Py_RETURN_NONE;
fail:
    release(v, 3);
    return NULL;
}
