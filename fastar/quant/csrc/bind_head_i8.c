/* The Python entry points of the int8 screened LM head (head_i8.c does the work; fastar/quant/kernels.py wraps
 * them): head_i8_build, head_i8_dot, head_i8_quantize, head_i8_select, gather_rows, head_i8_exact, _head_i8_path.
 * Owns: the argument checks. */
#include "bindings.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "head_i8.h"

/* A 1-D view's length must be n. */
static int len_is(const view_t *v, const char *name, int64_t n, const char *what) {
    if (dim(v, 0) != n) {
        PyErr_Format(PyExc_ValueError, "%s has %lld entries, expected %lld %s", name, (long long)dim(v, 0),
                     (long long)n, what);
        return -1;
    }
    return 0;
}

/* head_i8_build(w u16 [V, K], q i8 [V, K], scale f32 [V], wnorm f64 [V], dnorm f64 [V], rowsum i32 [V]) -> None:
 * the int8 copy of a bfloat16 weight and its per-row facts (head_i8.h's contract). */
PyObject *py_head_i8_build(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[6];
    if (!PyArg_ParseTuple(args, "OOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5])) return NULL;
    view_t v[6];
    memset(v, 0, sizeof v);
    if (get_view(o[0], &v[0], "w", 'H', 2, 0) || get_view(o[1], &v[1], "q", 'b', 2, 1) ||
        get_view(o[2], &v[2], "scale", 'f', 1, 1) || get_view(o[3], &v[3], "wnorm", 'd', 1, 1) ||
        get_view(o[4], &v[4], "dnorm", 'd', 1, 1) || get_view(o[5], &v[5], "rowsum", 'i', 1, 1))
        goto fail;
    const int64_t V = dim(&v[0], 0), K = dim(&v[0], 1);
    if (K > (1 << 24)) { /* |rowsum| <= 127 K stays an exact int32 */
        PyErr_Format(PyExc_ValueError, "w has %lld columns, at most %d are supported", (long long)K, 1 << 24);
        goto fail;
    }
    if (shape_is(&v[1], "q", V, K, "= w.shape") || len_is(&v[2], "scale", V, "= w.shape[0]") ||
        len_is(&v[3], "wnorm", V, "= w.shape[0]") || len_is(&v[4], "dnorm", V, "= w.shape[0]") ||
        len_is(&v[5], "rowsum", V, "= w.shape[0]"))
        goto fail;
    static const char *names[6] = {"w", "q", "scale", "wnorm", "dnorm", "rowsum"};
    for (int i = 1; i < 6; i++) /* every output against every array before it */
        if (no_overlap_named(&v[i], names[i], v, i)) goto fail;
    head_build b = {.w = v[0].b.buf, .V = V, .K = K, .q = v[1].b.buf, .scale = v[2].b.buf, .wnorm = v[3].b.buf,
                    .dnorm = v[4].b.buf, .rowsum = v[5].b.buf};
    const isa_ops *isa = cur_isa;
    Py_BEGIN_ALLOW_THREADS
    head_i8_build_run(isa, &b);
    Py_END_ALLOW_THREADS
    release(v, 6);
    Py_RETURN_NONE;
fail:
    release(v, 6);
    return NULL;
}

/* head_i8_dot(xq i8 [T, K], q i8 [V, K], rowsum i32 [V], out i32 [T, V]) -> None: out = xq @ q.T exactly. */
PyObject *py_head_i8_dot(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *oq, *or, *oo;
    if (!PyArg_ParseTuple(args, "OOOO", &ox, &oq, &or, &oo)) return NULL;
    view_t v[4];
    memset(v, 0, sizeof v);
    if (get_view(ox, &v[0], "xq", 'b', 2, 0) || get_view(oq, &v[1], "q", 'b', 2, 0) ||
        get_view(or, &v[2], "rowsum", 'i', 1, 0) || get_view(oo, &v[3], "out", 'i', 2, 1))
        goto fail;
    const int64_t T = dim(&v[0], 0), K = dim(&v[0], 1), V = dim(&v[1], 0);
    if (K % HEAD_I8_K_ALIGN || K > HEAD_I8_MAX_K) {
        PyErr_Format(PyExc_ValueError, "xq has %lld columns, expected a multiple of %d up to %d", (long long)K,
                     HEAD_I8_K_ALIGN, HEAD_I8_MAX_K);
        goto fail;
    }
    if (shape_is(&v[1], "q", V, K, "= (V, K), K = xq.shape[1]") || len_is(&v[2], "rowsum", V, "= q.shape[0]") ||
        shape_is(&v[3], "out", T, V, "= (xq.shape[0], q.shape[0])") || no_overlap(&v[3], v, 3))
        goto fail;
    head_dot d = {.x = v[0].b.buf, .q = v[1].b.buf, .rowsum = v[2].b.buf, .out = v[3].b.buf, .T = T, .V = V, .K = K};
    const isa_ops *isa = cur_isa;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    readahead_begin(d.q, (size_t)(V * K), 1); /* the int8 head: the largest stream of a decode step */
    rc = head_i8_dot_run(isa, &d);
    readahead_end(d.q, (size_t)(V * K));
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        goto fail;
    }
    release(v, 4);
    Py_RETURN_NONE;
fail:
    release(v, 4);
    return NULL;
}

/* _head_i8_path() -> 'avx512vnni' | 'avx2' | 'portable': how head_i8_dot runs under the ISA in use (tests, bench). */
PyObject *py_head_i8_path(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    return PyUnicode_FromString(head_i8_path_name(head_i8_path(cur_isa)));
}

/* gather_rows(w u16 [V, K], idx i64 [U], out u16 [U, K]) -> None: out[j] = w[idx[j]], each idx in [0, V). */
PyObject *py_gather_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ow, *oi, *oo;
    if (!PyArg_ParseTuple(args, "OOO", &ow, &oi, &oo)) return NULL;
    view_t v[3];
    memset(v, 0, sizeof v);
    if (get_view(ow, &v[0], "w", 'H', 2, 0) || get_view(oi, &v[1], "idx", 'q', 1, 0) ||
        get_view(oo, &v[2], "out", 'H', 2, 1))
        goto fail;
    const int64_t V = dim(&v[0], 0), K = dim(&v[0], 1), U = dim(&v[1], 0);
    if (shape_is(&v[2], "out", U, K, "= (len(idx), w.shape[1])") || no_overlap(&v[2], v, 2)) goto fail;
    const int64_t *idx = v[1].b.buf;
    for (int64_t j = 0; j < U; j++)
        if (idx[j] < 0 || idx[j] >= V) {
            PyErr_Format(PyExc_ValueError, "idx[%lld] = %lld is not a row of w's %lld", (long long)j, (long long)idx[j],
                         (long long)V);
            goto fail;
        }
    const void *w = v[0].b.buf;
    void *out = v[2].b.buf;
    Py_BEGIN_ALLOW_THREADS
    gather_rows_run(w, 2 * K, idx, U, out);
    Py_END_ALLOW_THREADS
    release(v, 3);
    Py_RETURN_NONE;
fail:
    release(v, 3);
    return NULL;
}

/* head_i8_select(dots i32 [2T, V], sx f32 [2T], scale f32 [V], c1 f32 [T], c2 f32 [T], wnorm f32 [V], dnorm f32 [V],
 * margin, keep u8 [V], rows i64 [V], off f32 [T, V] or None = None) -> n: the screened head's candidate rows in
 * rows[:n], ascending (head_i8.h's contract; keep is scratch). */
PyObject *py_head_i8_select(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[8], *ok, *orows, *ooff = Py_None;
    float margin;
    if (!PyArg_ParseTuple(args, "OOOOOOOfOO|O", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &margin, &ok, &orows,
                          &ooff))
        return NULL;
    view_t v[10];
    memset(v, 0, sizeof v);
    if (get_view(o[0], &v[0], "dots", 'i', 2, 0) || get_view(o[1], &v[1], "sx", 'f', 1, 0) ||
        get_view(o[2], &v[2], "scale", 'f', 1, 0) || get_view(o[3], &v[3], "c1", 'f', 1, 0) ||
        get_view(o[4], &v[4], "c2", 'f', 1, 0) || get_view(o[5], &v[5], "wnorm", 'f', 1, 0) ||
        get_view(o[6], &v[6], "dnorm", 'f', 1, 0) || get_view(ok, &v[7], "keep", 'B', 1, 1) ||
        get_view(orows, &v[8], "rows", 'q', 1, 1))
        goto fail;
    const int64_t T2 = dim(&v[0], 0), V = dim(&v[0], 1), T = T2 / 2;
    if (T2 % 2 || T2 == 0) {
        PyErr_Format(PyExc_ValueError, "dots has %lld rows, expected two per decode row", (long long)T2);
        goto fail;
    }
    if (len_is(&v[1], "sx", T2, "= dots.shape[0]") || len_is(&v[2], "scale", V, "= dots.shape[1]") ||
        len_is(&v[3], "c1", T, "= dots.shape[0] / 2") || len_is(&v[4], "c2", T, "= dots.shape[0] / 2") ||
        len_is(&v[5], "wnorm", V, "= dots.shape[1]") || len_is(&v[6], "dnorm", V, "= dots.shape[1]") ||
        len_is(&v[7], "keep", V, "= dots.shape[1]") || len_is(&v[8], "rows", V, "= dots.shape[1]") ||
        no_overlap(&v[7], v, 7) || no_overlap(&v[8], v, 8))
        goto fail;
    if (ooff != Py_None && (get_view(ooff, &v[9], "off", 'f', 2, 0) ||
                            shape_is(&v[9], "off", T, V, "= (dots.shape[0] / 2, dots.shape[1])") ||
                            no_overlap(&v[7], v + 9, 1) || no_overlap(&v[8], v + 9, 1)))
        goto fail;
    head_select s = {.dots = v[0].b.buf, .sx = v[1].b.buf, .scale = v[2].b.buf, .c1 = v[3].b.buf, .c2 = v[4].b.buf,
                     .wnorm = v[5].b.buf, .dnorm = v[6].b.buf, .off = ooff != Py_None ? v[9].b.buf : NULL,
                     .margin = margin, .T = T, .V = V, .keep = v[7].b.buf, .rows = v[8].b.buf};
    int64_t kept;
    const isa_ops *isa = cur_isa;
    Py_BEGIN_ALLOW_THREADS
    kept = head_i8_select_run(isa, &s);
    Py_END_ALLOW_THREADS
    release(v, 10);
    return PyLong_FromLongLong((long long)kept);
fail:
    release(v, 10);
    return NULL;
}

/* head_i8_screen(x i8 [2T, K], sx f32 [2T], c f32 [T, 4], q i8 [V, K], rowsum i32 [V], scale f32 [V], wnorm f32 [V],
 * dnorm f32 [V], margin, ub f32 [T, V], keep u8 [V], rows i64 [V], off f32 [T, V] or None = None) -> n: the screened head's candidate rows in
 * rows[:n], ascending, from one pass that takes the second terms only where needed (head_i8.h's contract; ub and keep
 * are scratch). */
PyObject *py_head_i8_screen(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[12];
    o[11] = Py_None;
    float margin;
    if (!PyArg_ParseTuple(args, "OOOOOOOOfOOO|O", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &o[7], &margin, &o[8],
                          &o[9], &o[10], &o[11]))
        return NULL;
    view_t v[12];
    memset(v, 0, sizeof v);
    static const char *names[11] = {"x", "sx", "c", "q", "rowsum", "scale", "wnorm", "dnorm", "ub", "keep", "rows"};
    static const char fmts[11] = {'b', 'f', 'f', 'b', 'i', 'f', 'f', 'f', 'f', 'B', 'q'};
    static const int ndims[11] = {2, 1, 2, 2, 1, 1, 1, 1, 2, 1, 1};
    for (int j = 0; j < 11; j++)
        if (get_view(o[j], &v[j], names[j], fmts[j], ndims[j], j >= 8)) goto fail;
    const int64_t T2 = dim(&v[0], 0), K = dim(&v[0], 1), T = T2 / 2, V = dim(&v[3], 0);
    if (T2 % 2 || T2 == 0) {
        PyErr_Format(PyExc_ValueError, "x has %lld rows, expected two per decode row", (long long)T2);
        goto fail;
    }
    if (K % HEAD_I8_K_ALIGN || K > HEAD_I8_MAX_K) {
        PyErr_Format(PyExc_ValueError, "x has %lld columns, expected a multiple of %d up to %d", (long long)K,
                     HEAD_I8_K_ALIGN, HEAD_I8_MAX_K);
        goto fail;
    }
    if (len_is(&v[1], "sx", T2, "= x.shape[0]") || shape_is(&v[2], "c", T, 4, "= (x.shape[0] / 2, 4)") ||
        shape_is(&v[3], "q", V, K, "= (V, K), K = x.shape[1]") || len_is(&v[4], "rowsum", V, "= q.shape[0]") ||
        len_is(&v[5], "scale", V, "= q.shape[0]") || len_is(&v[6], "wnorm", V, "= q.shape[0]") ||
        len_is(&v[7], "dnorm", V, "= q.shape[0]") || shape_is(&v[8], "ub", T, V, "= (x.shape[0] / 2, q.shape[0])") ||
        len_is(&v[9], "keep", V, "= q.shape[0]") || len_is(&v[10], "rows", V, "= q.shape[0]") ||
        no_overlap(&v[8], v, 8) || no_overlap(&v[9], v, 9) || no_overlap(&v[10], v, 10))
        goto fail;
    if (o[11] != Py_None &&
        (get_view(o[11], &v[11], "off", 'f', 2, 0) ||
         shape_is(&v[11], "off", T, V, "= (x.shape[0] / 2, q.shape[0])") || no_overlap(&v[8], v + 11, 1) ||
         no_overlap(&v[9], v + 11, 1) || no_overlap(&v[10], v + 11, 1)))
        goto fail;
    head_screen s = {.x = v[0].b.buf, .sx = v[1].b.buf, .c = v[2].b.buf, .q = v[3].b.buf, .rowsum = v[4].b.buf,
                     .scale = v[5].b.buf, .wnorm = v[6].b.buf, .dnorm = v[7].b.buf,
                     .off = o[11] != Py_None ? v[11].b.buf : NULL, .margin = margin, .T = T, .V = V, .K = K,
                     .ub = v[8].b.buf, .keep = v[9].b.buf, .rows = v[10].b.buf};
    const isa_ops *isa = cur_isa;
    int64_t kept;
    Py_BEGIN_ALLOW_THREADS
    readahead_begin(s.q, (size_t)(V * K), 1); /* the int8 head, as head_i8_dot */
    kept = head_i8_screen_run(isa, &s);
    readahead_end(s.q, (size_t)(V * K));
    Py_END_ALLOW_THREADS
    if (kept < 0) {
        PyErr_NoMemory();
        goto fail;
    }
    release(v, 12);
    return PyLong_FromLongLong((long long)kept);
fail:
    release(v, 12);
    return NULL;
}

/* head_i8_quantize(y f32 [T, K], x i8 [2T, K], sx f32 [2T], stats f64 [T, 3 or 5]) -> None: the decode rows' two int8
 * terms and their norms, with 5 columns also the first term's alone (head_i8.h's contract). */
PyObject *py_head_i8_quantize(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[4];
    if (!PyArg_ParseTuple(args, "OOOO", &o[0], &o[1], &o[2], &o[3])) return NULL;
    view_t v[4];
    memset(v, 0, sizeof v);
    if (get_view(o[0], &v[0], "y", 'f', 2, 0) || get_view(o[1], &v[1], "x", 'b', 2, 1) ||
        get_view(o[2], &v[2], "sx", 'f', 1, 1) || get_view(o[3], &v[3], "stats", 'd', 2, 1))
        goto fail;
    const int64_t T = dim(&v[0], 0), K = dim(&v[0], 1);
    if (shape_is(&v[1], "x", 2 * T, K, "= (2 y.shape[0], y.shape[1])") || len_is(&v[2], "sx", 2 * T, "= 2 y.shape[0]") ||
        shape_is(&v[3], "stats", T, dim(&v[3], 1) == 5 ? 5 : 3, "= (y.shape[0], 3 or 5)") || no_overlap(&v[1], v, 1) ||
        no_overlap(&v[2], v, 2) || no_overlap(&v[3], v, 3))
        goto fail;
    const int ncol = (int)dim(&v[3], 1);
    Py_BEGIN_ALLOW_THREADS
    head_i8_quantize_run(v[0].b.buf, T, K, v[1].b.buf, v[2].b.buf, v[3].b.buf, ncol);
    Py_END_ALLOW_THREADS
    release(v, 4);
    Py_RETURN_NONE;
fail:
    release(v, 4);
    return NULL;
}

/* head_i8_exact(w u16 [V, K], rows i64 [U], y f32 [T, K], out f32 [T, V]) -> None: the screened logits in one call,
 * out[t, rows[j]] = the BF16 head's logit of y[t] at row rows[j] and -inf elsewhere: the rows gathered
 * (gather_rows_run) and multiplied by the same product bf16_matmul runs on them (each (row, token) sum the same chain
 * whatever the rows around it), then scattered; what `gather_rows`, `bf16_matmul` and an index assignment into an
 * -inf-filled array do one after the other (fastar/model/head_screen.py). */
PyObject *py_head_i8_exact(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[4];
    if (!PyArg_ParseTuple(args, "OOOO", &o[0], &o[1], &o[2], &o[3])) return NULL;
    view_t v[4];
    memset(v, 0, sizeof v);
    if (get_view(o[0], &v[0], "w", 'H', 2, 0) || get_view(o[1], &v[1], "rows", 'q', 1, 0) ||
        get_view(o[2], &v[2], "y", 'f', 2, 0) || get_view(o[3], &v[3], "out", 'f', 2, 1))
        goto fail;
    const int64_t V = dim(&v[0], 0), K = dim(&v[0], 1), U = dim(&v[1], 0), T = dim(&v[2], 0);
    if (shape_is(&v[2], "y", T, K, "= (T, w.shape[1])") || shape_is(&v[3], "out", T, V, "= (y.shape[0], w.shape[0])") ||
        no_overlap(&v[3], v, 3))
        goto fail;
    const int64_t *rows = v[1].b.buf;
    for (int64_t j = 0; j < U; j++)
        if (rows[j] < 0 || rows[j] >= V) {
            PyErr_Format(PyExc_ValueError, "rows[%lld] = %lld is not a row of w's %lld", (long long)j, (long long)rows[j],
                         (long long)V);
            goto fail;
        }
    uint16_t *sub = U ? malloc((size_t)(U * K) * sizeof *sub) : NULL;
    float *got = U ? malloc((size_t)(T * U) * sizeof *got) : NULL;
    if (U && (!sub || !got)) {
        free(sub);
        free(got);
        PyErr_NoMemory();
        goto fail;
    }
    float *out = v[3].b.buf;
    const isa_ops *isa = cur_isa;
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < T * V; i++) out[i] = -INFINITY;
    if (U && T && K) {
        gather_rows_run(v[0].b.buf, 2 * K, rows, U, sub);
        mm_job job = {.x = v[2].b.buf, .w = sub, .s = NULL, .T = T, .N = U, .K = K, .out = got, .ldo = U};
        rc = product(isa, 'b', &job);
        for (int64_t t = 0; !rc && t < T; t++)
            for (int64_t j = 0; j < U; j++) out[t * V + rows[j]] = got[t * U + j];
    } else if (U && T) {
        for (int64_t t = 0; t < T; t++) /* K = 0: every logit an empty sum */
            for (int64_t j = 0; j < U; j++) out[t * V + rows[j]] = 0.0f;
    }
    Py_END_ALLOW_THREADS
    free(sub);
    free(got);
    if (rc) {
        PyErr_NoMemory();
        goto fail;
    }
    release(v, 4);
    Py_RETURN_NONE;
fail:
    release(v, 4);
    return NULL;
}
