/* Two mHC sites of a decode step as one C call, `hc_post_pre`: a sub-layer's mix back (`hc_post`) followed by the next
 * site's collapse (`hc_pre` with its norm, or the final head's). A decode step runs four mHC calls per layer, and
 * each Python-level call between the weight-streaming kernels pays its argument handling from cold caches; here the
 * mix back of one site and the collapse of the next run back to back in one call, on the same values through the
 * same routines (mhc.c's hc_post_run and hc_pre_run, rowops.c's rms_norm_rows), so the bits are those of the two
 * calls made one after the other (tests/test_hc_chain.py compares them on every ISA).
 * Owns: the argument checks and the sequence. Does not own: the arithmetic (mhc.c, rowops.c), when to call it
 * (fastar/model/hc_chain.py).
 */
#include "bindings.h"

#include <string.h>

#include "dispatch.h"
#include "kernels.h"

typedef struct {
    float *u;
    const float *w;
    int64_t d, rows_per_chunk, T;
    float eps;
} norm_ctx;

static void norm_rows_chunk(void *p, int64_t i) {
    const norm_ctx *c = p;
    const int64_t r0 = i * c->rows_per_chunk, n = c->T - r0 < c->rows_per_chunk ? c->T - r0 : c->rows_per_chunk;
    rms_norm_rows(c->u + r0 * c->d, c->w, c->u + r0 * c->d, n, c->d, c->eps); /* each row alone: any split, same bits */
}

/* hc_post_pre(f, x, post, comb, out, fn, base, scale, iters, hc_eps, eps, u, post_out=None, comb_out=None,
 * norm=None, norm_eps=0) -> None.
 * First the mix back: out f32 [T, n*d] = hc_post(f f32 [T, d], x f32 [T, n*d], post f32 [T, n], comb f32 [T, n*n])
 * (n from post). Then the collapse of out, as hc_pre(out, fn, base, scale, n, iters, hc_eps, eps, u, post_out,
 * comb_out, norm, norm_eps): fn f32 [R, n*d], base f32 [R], scale f32 [3] -> u f32 [T, d], post_out f32 [T, n],
 * comb_out f32 [T, n*n] with R = (2+n)*n; with post_out and comb_out None, the final head: R = n, scale [1], u only.
 * The mix back is done before the collapse starts, so the collapse's outputs may be the mix back's inputs (post_out
 * the post array itself, u over f: one set of buffers for a whole step); they must not overlap out, fn, base, scale,
 * norm or one another. */
PyObject *py_hc_post_pre(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kws[] = {"f",      "x", "post",     "comb",     "out",  "fn",       "base", "scale", "iters",
                          "hc_eps", "eps", "u", "post_out", "comb_out", "norm", "norm_eps", NULL};
    /* f, x, post, comb, out | fn, base, scale, u, post_out, comb_out, norm */
    PyObject *o[12] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, Py_None, Py_None, Py_None};
    int iters;
    double hc_eps, eps, norm_eps = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOiddO|OOOd", kws, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                                     &o[6], &o[7], &iters, &hc_eps, &eps, &o[8], &o[9], &o[10], &o[11], &norm_eps))
        return NULL;
    const int head = o[9] == Py_None;
    if (head != (o[10] == Py_None))
        return PyErr_Format(PyExc_ValueError,
                            "post_out and comb_out must both be arrays (a layer's mHC) or both None (the head)");
    if (!head && iters < 1) return PyErr_Format(PyExc_ValueError, "iters must be >= 1, got %d", iters);
    view_t v[12];
    memset(v, 0, sizeof v);
    static const char *names[12] = {"f", "x", "post", "comb", "out", "fn", "base", "scale", "u", "post_out", "comb_out",
                                    "norm"};
    /* the views in the order: stage-2 reads (out, fn, base, scale, norm) then its writes (u, post_out, comb_out) */
    for (int i = 0; i < 11; i++) {
        if (head && (i == 9 || i == 10)) continue;
        const int writable = i == 4 || i >= 8;
        if (get_view(o[i], &v[i], names[i], 'f', i == 6 || i == 7 ? 1 : 2, writable)) goto fail;
    }
    if (o[11] != Py_None && get_view(o[11], &v[11], "norm", 'f', 1, 0)) goto fail;
    const int64_t T = dim(&v[0], 0), d = dim(&v[0], 1), n = dim(&v[2], 1);
    if (n < 1 || n > 16) {
        PyErr_Format(PyExc_ValueError, "post has shape (%lld, %lld), expected (T, n) with n in [1, 16]",
                     (long long)dim(&v[2], 0), (long long)n);
        goto fail;
    }
    const int64_t K = n * d, R = head ? n : (2 + n) * n;
    if (shape_is(&v[1], "x", T, K, "= (T, n*d), n = post.shape[1], d = f.shape[1]") ||
        shape_is(&v[2], "post", T, n, "= (T, n), T = f.shape[0]") || shape_is(&v[3], "comb", T, n * n, "= (T, n*n)") ||
        shape_is(&v[4], "out", T, K, "= x.shape") || no_overlap(&v[4], v, 4))
        goto fail;
    if (shape_is(&v[5], "fn", R, K, head ? "= (n, n*d) for the head" : "= ((2+n)*n, n*d)")) goto fail;
    if (dim(&v[6], 0) != R || dim(&v[7], 0) != (head ? 1 : 3)) {
        PyErr_Format(PyExc_ValueError, "base has %lld entries and scale %lld, expected %lld (fn's rows) and %d",
                     (long long)dim(&v[6], 0), (long long)dim(&v[7], 0), (long long)R, head ? 1 : 3);
        goto fail;
    }
    if (v[11].held && dim(&v[11], 0) != d) {
        PyErr_Format(PyExc_ValueError, "norm has %lld values, expected %lld (d)", (long long)dim(&v[11], 0),
                     (long long)d);
        goto fail;
    }
    if (shape_is(&v[8], "u", T, d, "= (T, d)")) goto fail;
    if (!head && (shape_is(&v[9], "post_out", T, n, "= (T, n)") || shape_is(&v[10], "comb_out", T, n * n, "= (T, n*n)")))
        goto fail;
    /* the collapse's outputs against what it reads (out, fn, base, scale; the norm) and one another */
    const view_t *reads[5] = {&v[4], &v[5], &v[6], &v[7], &v[11]};
    for (int w = 8; w < 11; w++) {
        if (head && w > 8) break;
        for (int r = 0; r < 5; r++)
            if (no_overlap_named(&v[w], names[w], reads[r], 1)) goto fail;
        for (int w2 = 8; w2 < w; w2++)
            if (no_overlap_named(&v[w], names[w], &v[w2], 1)) goto fail;
    }
    const isa_ops *isa = cur_isa;
    int rc = 0;
    if (T > 0) {
        Py_BEGIN_ALLOW_THREADS
        hc_post_run(isa, v[0].b.buf, v[1].b.buf, v[2].b.buf, v[3].b.buf, T, (int)n, d, v[4].b.buf);
        rc = hc_pre_run(isa, v[4].b.buf, v[5].b.buf, v[6].b.buf, v[7].b.buf, T, (int)n, d, head, iters, (float)hc_eps,
                        (float)eps, v[8].b.buf, head ? NULL : v[9].b.buf, head ? NULL : v[10].b.buf);
        if (!rc && v[11].held) {
            norm_ctx c = {v[8].b.buf, v[11].b.buf, d, 1, T, (float)norm_eps};
            if (T * d < (1 << 16)) {
                c.rows_per_chunk = T;
                norm_rows_chunk(&c, 0);
            } else {
                pool_run(T, norm_rows_chunk, &c);
            }
        }
        Py_END_ALLOW_THREADS
    }
    if (rc) {
        PyErr_NoMemory();
        goto fail;
    }
    release(v, 12);
    Py_RETURN_NONE;
fail:
    release(v, 12);
    return NULL;
}

/* embed_streams(w u16 [V, d], ids (a sequence of ints, B of them), out f32 [B, n*d]) -> None: the decode step's first
 * streams, row b the bfloat16 row w[ids[b]] widened to float32 (its bits shifted up: `.float()`'s values exactly) in
 * each of its n streams, as `forward_rows`' `embed.rows(ids)` expanded over the streams (what `hc_chain.begin` collapses
 * next). */
PyObject *py_embed_streams(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ow, *oids, *oo;
    if (!PyArg_ParseTuple(args, "OOO", &ow, &oids, &oo)) return NULL;
    PyObject *seq = PySequence_Fast(oids, "ids must be a sequence of token ids");
    if (!seq) return NULL;
    view_t v[2];
    memset(v, 0, sizeof v);
    if (get_view(ow, &v[0], "w", 'H', 2, 0) || get_view(oo, &v[1], "out", 'f', 2, 1)) goto fail;
    const int64_t V = dim(&v[0], 0), d = dim(&v[0], 1), B = PySequence_Fast_GET_SIZE(seq);
    if (dim(&v[1], 0) != B || d < 1 || dim(&v[1], 1) % d || dim(&v[1], 1) < d) {
        PyErr_Format(PyExc_ValueError, "out has shape (%lld, %lld), expected (%lld, a multiple of %lld) = (len(ids), n*d)",
                     (long long)dim(&v[1], 0), (long long)dim(&v[1], 1), (long long)B, (long long)d);
        goto fail;
    }
    const int64_t n = dim(&v[1], 1) / d;
    const uint16_t *w = v[0].b.buf;
    uint32_t *out = v[1].b.buf; /* float32 bits */
    for (int64_t b = 0; b < B; b++) {
        const long long id = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, b));
        if (id == -1 && PyErr_Occurred()) goto fail;
        if (id < 0 || id >= V) {
            PyErr_Format(PyExc_ValueError, "ids[%lld] = %lld is outside the embedding's %lld rows", (long long)b, id,
                         (long long)V);
            goto fail;
        }
        const uint16_t *row = w + id * d;
        uint32_t *o = out + b * n * d;
        for (int64_t i = 0; i < d; i++) o[i] = (uint32_t)row[i] << 16;
        for (int64_t j = 1; j < n; j++) memcpy(o + j * d, o, (size_t)d * sizeof *o);
    }
    Py_DECREF(seq);
    release(v, 2);
    Py_RETURN_NONE;
fail:
    Py_DECREF(seq);
    release(v, 2);
    return NULL;
}
