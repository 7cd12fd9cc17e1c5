/* The MoE router's Python entry point after its top-k (route.c does the arithmetic; fastar/model/route_fused.py
 * calls it): `route_weights`. Owns: the argument checks. */
#include "bindings.h"

#include <string.h>

#include "kernels.h"

/* route_weights(scores f32 [T, E], idx i64 [T, k], eps, scale, out f32 [T, k], ids=None, table=None) -> None: the
 * routing weights of the experts idx picked (route.c). With ids i64 [T] and table i64 [V, k] (a hash-routed layer),
 * idx is written first: row t = table[ids[t]]. */
PyObject *py_route_weights(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kws[] = {"scores", "idx", "eps", "scale", "out", "ids", "table", NULL};
    PyObject *os, *oi, *oo, *oids = Py_None, *otab = Py_None;
    double eps, scale;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOddO|OO", kws, &os, &oi, &eps, &scale, &oo, &oids, &otab)) return NULL;
    const int hashed = otab != Py_None;
    if (hashed != (oids != Py_None))
        return PyErr_Format(PyExc_ValueError, "ids and table must both be arrays (a hash-routed layer) or both None");
    view_t v[5];
    memset(v, 0, sizeof v);
    if (get_view(os, &v[0], "scores", 'f', 2, 0) || get_view(oi, &v[1], "idx", 'q', 2, hashed) ||
        get_view(oo, &v[2], "out", 'f', 2, 1))
        goto fail;
    if (hashed && (get_view(oids, &v[3], "ids", 'q', 1, 0) || get_view(otab, &v[4], "table", 'q', 2, 0))) goto fail;
    const int64_t T = dim(&v[0], 0), E = dim(&v[0], 1), k = dim(&v[1], 1);
    if (k < 1 || k > ROUTE_MAX_K) {
        PyErr_Format(PyExc_ValueError, "idx has %lld experts per token, expected 1 to %d", (long long)k, ROUTE_MAX_K);
        goto fail;
    }
    if (shape_is(&v[1], "idx", T, k, "= (T, k), T = scores.shape[0]") || shape_is(&v[2], "out", T, k, "= idx.shape") ||
        no_overlap(&v[2], v, 2))
        goto fail;
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
    const int rc = route_weights_rows(v[0].b.buf, T, E, v[1].b.buf, k, (float)eps, (float)scale, v[2].b.buf);
    if (rc) {
        PyErr_Format(PyExc_ValueError, "idx[%lld, %lld] = %lld is not an expert of scores' %lld",
                     (long long)((rc - 1) / k), (long long)((rc - 1) % k), (long long)((int64_t *)v[1].b.buf)[rc - 1],
                     (long long)E);
        goto fail;
    }
    release(v, 5);
    Py_RETURN_NONE;
fail:
    release(v, 5);
    return NULL;
}
