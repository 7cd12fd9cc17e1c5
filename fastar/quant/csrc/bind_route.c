/* The MoE router's Python entry points (route.c does the arithmetic; fastar/model/route_fused.py and
 * fastar/model/ops.py call them): `route_weights`, `sqrtsoftplus`. Owns: the argument checks. */
#include "bindings.h"

#include <string.h>

#include "kernels.h"

/* route_weights(scores f32 [T, E], idx i64 [T, k], eps, scale, out f32 [T, k], ids=None, table=None, bias=None,
 * softplus=False) -> None: the routing weights of the experts idx picked (route.c). With softplus, scores holds the
 * router's logits and becomes its scores first (sqrt(softplus), in place). With ids i64 [T] and table i64 [V, k] (a
 * hash-routed layer), idx is written first: row t = table[ids[t]]; with bias f32 [E] instead (a scored layer), idx is
 * written first as the top-k of scores + bias. With by_expert, each row's (idx, out) pairs are then put in ascending
 * id order (a stable sort: a repeated id keeps its slots' order), after the weights' total took them in top-k order. */
PyObject *py_route_weights(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kws[] = {"scores", "idx", "eps", "scale", "out", "ids", "table", "bias", "softplus", "by_expert", NULL};
    PyObject *os, *oi, *oo, *oids = Py_None, *otab = Py_None, *obias = Py_None;
    double eps, scale;
    int softplus = 0, by_expert = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOddO|OOOpp", kws, &os, &oi, &eps, &scale, &oo, &oids, &otab, &obias,
                                     &softplus, &by_expert))
        return NULL;
    const int hashed = otab != Py_None, biased = obias != Py_None;
    if (hashed != (oids != Py_None))
        return PyErr_Format(PyExc_ValueError, "ids and table must both be arrays (a hash-routed layer) or both None");
    if (hashed && biased)
        return PyErr_Format(PyExc_ValueError, "bias picks a scored layer's experts, table a hash-routed one's: not both");
    view_t v[6];
    memset(v, 0, sizeof v);
    if (get_view(os, &v[0], "scores", 'f', 2, softplus) || get_view(oi, &v[1], "idx", 'q', 2, hashed || biased || by_expert) ||
        get_view(oo, &v[2], "out", 'f', 2, 1))
        goto fail;
    if (hashed && (get_view(oids, &v[3], "ids", 'q', 1, 0) || get_view(otab, &v[4], "table", 'q', 2, 0))) goto fail;
    if (biased && get_view(obias, &v[5], "bias", 'f', 1, 0)) goto fail;
    const int64_t T = dim(&v[0], 0), E = dim(&v[0], 1), k = dim(&v[1], 1);
    if (k < 1 || k > ROUTE_MAX_K) {
        PyErr_Format(PyExc_ValueError, "idx has %lld experts per token, expected 1 to %d", (long long)k, ROUTE_MAX_K);
        goto fail;
    }
    if (shape_is(&v[1], "idx", T, k, "= (T, k), T = scores.shape[0]") || shape_is(&v[2], "out", T, k, "= idx.shape") ||
        no_overlap(&v[2], v, 2))
        goto fail;
    if (softplus && (no_overlap_named(&v[0], "scores", &v[1], 1) || no_overlap_named(&v[0], "scores", &v[2], 1)))
        goto fail;
    if (biased) {
        if (dim(&v[5], 0) != E) {
            PyErr_Format(PyExc_ValueError, "bias has %lld values, expected %lld (scores' experts)",
                         (long long)dim(&v[5], 0), (long long)E);
            goto fail;
        }
        if (k > E) {
            PyErr_Format(PyExc_ValueError, "idx picks %lld experts of scores' %lld", (long long)k, (long long)E);
            goto fail;
        }
        if (no_overlap_named(&v[1], "idx", v, 1) || no_overlap_named(&v[1], "idx", &v[5], 1)) goto fail;
    }
    if (hashed) {
        const int64_t V = dim(&v[4], 0);
        if (dim(&v[3], 0) != T || shape_is(&v[4], "table", V, k, "= (vocabulary, k)") ||
            no_overlap_named(&v[1], "idx", v, 1) || no_overlap_named(&v[1], "idx", &v[3], 2)) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "ids has %lld tokens, expected %lld (scores' rows)",
                             (long long)dim(&v[3], 0), (long long)T);
            goto fail;
        }
        const int64_t *ids = v[3].b.buf, *table = v[4].b.buf;
        int64_t *idx = v[1].b.buf;
        for (int64_t t = 0; t < T; t++) {
            if (ids[t] < 0 || ids[t] >= V) {
                PyErr_Format(PyExc_ValueError, "ids[%lld] = %lld is outside the table's %lld tokens", (long long)t,
                             (long long)ids[t], (long long)V);
                goto fail;
            }
            memcpy(idx + t * k, table + ids[t] * k, (size_t)k * sizeof *idx);
        }
    }
    if (softplus) sqrtsoftplus_rows(v[0].b.buf, T * E, v[0].b.buf);
    if (biased) route_topk_rows(v[0].b.buf, v[5].b.buf, T, E, k, v[1].b.buf);
    const int rc = route_weights_rows(v[0].b.buf, T, E, v[1].b.buf, k, (float)eps, (float)scale, v[2].b.buf);
    if (rc) {
        PyErr_Format(PyExc_ValueError, "idx[%lld, %lld] = %lld is not an expert of scores' %lld",
                     (long long)((rc - 1) / k), (long long)((rc - 1) % k), (long long)((int64_t *)v[1].b.buf)[rc - 1],
                     (long long)E);
        goto fail;
    }
    if (by_expert) route_by_expert_rows(v[1].b.buf, v[2].b.buf, T, k);
    release(v, 6);
    Py_RETURN_NONE;
fail:
    release(v, 6);
    return NULL;
}

/* sqrtsoftplus(x f32, out f32) -> None: out = sqrt(softplus(x)) elementwise (route.c), any shape, out may be x. */
PyObject *py_sqrtsoftplus(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *oo;
    if (!PyArg_ParseTuple(args, "OO", &ox, &oo)) return NULL;
    view_t v[2];
    memset(v, 0, sizeof v);
    if (PyObject_GetBuffer(ox, &v[0].b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto fail;
    v[0].held = 1;
    if (PyObject_GetBuffer(oo, &v[1].b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) goto fail;
    v[1].held = 1;
    for (int i = 0; i < 2; i++) {
        const char *f = v[i].b.format ? v[i].b.format : "B";
        if (*f == '@' || *f == '=' || *f == '<') f++;
        if (f[0] != 'f' || f[1] != '\0' || v[i].b.itemsize != 4) {
            PyErr_Format(PyExc_TypeError, "%s must be float32", i ? "out" : "x");
            goto fail;
        }
    }
    if (v[0].b.len != v[1].b.len) {
        PyErr_Format(PyExc_ValueError, "out has %zd bytes, x %zd: expected the same size", v[1].b.len, v[0].b.len);
        goto fail;
    }
    const char *x0 = v[0].b.buf, *o0 = v[1].b.buf;
    if (x0 != o0 && x0 < o0 + v[1].b.len && o0 < x0 + v[0].b.len) {
        PyErr_SetString(PyExc_ValueError, "out overlaps x without being x");
        goto fail;
    }
    sqrtsoftplus_rows(v[0].b.buf, v[0].b.len / 4, v[1].b.buf);
    release(v, 2);
    Py_RETURN_NONE;
fail:
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "x and out must be C-contiguous float32 arrays");
    release(v, 2);
    return NULL;
}
