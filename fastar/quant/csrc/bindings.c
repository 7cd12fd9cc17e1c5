/* fastar.quant._kernels: the CPython module of fastar's CPU kernels, and the bindings of its products.
 *
 * Owns: the method table and module init; the argument checks every binding uses (buffer protocol; dtype,
 * contiguity, shape, writability, aliasing -> TypeError / ValueError, never a crash); the bindings of the weight
 * products and the fused routed experts; threads, ISA and CPU-feature controls; the two machine probes the
 * benchmark needs (streaming read bandwidth, FMA peak). Each binding checks its arguments with the GIL held, then
 * runs with it released.
 * Does not own: the ISA choice and how products run (dispatch.c, experts.c), the bindings of the activation, row,
 * mHC and attention ops (bind_ops.c), the arithmetic (kern_*.c, mhc.c, attn.c, rowops.c), the pool (pool.c),
 * friendly Python wrappers (kernels.py).
 */
#include "bindings.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "dispatch.h"

/* ---------------------------------------------------------------- argument checking (bindings.h) */

void release(view_t *v, int n) {
    for (int i = 0; i < n; i++)
        if (v[i].held) {
            PyBuffer_Release(&v[i].b);
            v[i].held = 0;
        }
}

static const char *dtype_name(char code) {
    switch (code) {
        case 'f': return "float32";
        case 'B': return "uint8";
        case 'H': return "uint16";
        case 'q': return "int64";
        case 'b': return "int8";
        case 'i': return "int32";
        case 'd': return "float64";
        default: return "?";
    }
}

/* Get a C-contiguous view of `obj` with numpy dtype `code` and `ndim` dimensions. */
int get_view(PyObject *obj, view_t *v, const char *name, char code, int ndim, int writable) {
    if (PyObject_GetBuffer(obj, &v->b, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a numpy array (buffer protocol), got %.200s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    v->held = 1;
    const char *f = v->b.format ? v->b.format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++; /* native / little-endian prefixes (x86 and ARM are LE) */
    Py_ssize_t want = code == 'f' || code == 'i' ? 4 : code == 'H' ? 2 : code == 'q' || code == 'd' ? 8 : 1;
    /* int64 is 'l' where long has 64 bits, int32 where it has 32 (the itemsize check below tells them apart) */
    const int same = f[0] == code || ((code == 'q' || code == 'i') && f[0] == 'l');
    if (!same || f[1] != '\0' || v->b.itemsize != want) {
        PyErr_Format(PyExc_TypeError, "%s must be %s, got buffer format '%s' (itemsize %zd)", name, dtype_name(code),
                     v->b.format ? v->b.format : "B", v->b.itemsize);
        return -1;
    }
    if (v->b.ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s must be %d-D, got %d-D", name, ndim, v->b.ndim);
        return -1;
    }
    if (!PyBuffer_IsContiguous(&v->b, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s must be C-contiguous (row-major, no strides); use np.ascontiguousarray", name);
        return -1;
    }
    if (writable && v->b.readonly) {
        PyErr_Format(PyExc_ValueError, "%s must be writable", name);
        return -1;
    }
    return 0;
}

int shape_is(const view_t *v, const char *name, int64_t a, int64_t b, const char *what) {
    if (dim(v, 0) != a || dim(v, 1) != b) {
        PyErr_Format(PyExc_ValueError, "%s has shape (%lld, %lld), expected (%lld, %lld) %s", name, (long long)dim(v, 0),
                     (long long)dim(v, 1), (long long)a, (long long)b, what);
        return -1;
    }
    return 0;
}

/* An output is written while the inputs are read by other threads: refuse any overlap instead of racing. */
int no_overlap_named(const view_t *out, const char *name, const view_t *in, int n_in) {
    const char *o0 = out->b.buf, *o1 = o0 + out->b.len;
    for (int i = 0; i < n_in; i++) {
        const char *a0 = in[i].b.buf, *a1 = a0 + in[i].b.len;
        if (out->b.len && in[i].b.len && a0 < o1 && o0 < a1) {
            PyErr_Format(PyExc_ValueError, "%s must not overlap another array argument", name);
            return -1;
        }
    }
    return 0;
}

int no_overlap(const view_t *out, const view_t *in, int n_in) { return no_overlap_named(out, "out", in, n_in); }

/* A float32 input and a writable float32 output of the same 2-D shape that do not overlap (unless in_place
 * allows out to be the input itself). */
int get_in_out(PyObject *ox, PyObject *oo, view_t v[2], const char *in_name, int in_place) {
    if (get_view(ox, &v[0], in_name, 'f', 2, 0) || get_view(oo, &v[1], "out", 'f', 2, 1)) return -1;
    if (shape_is(&v[1], "out", dim(&v[0], 0), dim(&v[0], 1), "= the input's shape")) return -1;
    if (in_place && v[0].b.buf == v[1].b.buf) return 0;
    return no_overlap(&v[1], &v[0], 1);
}

/* ---------------------------------------------------------------- weight products */

/* fp4_matmul / fp8_matmul / bf16_matmul(x, w, [s,] out, accumulate, groups=1) -> None. groups = G > 1: a
 * block-diagonal product, x [T, G*K] (group g's input in columns g*K..), w [G*R, K] (group g's rows g*R..),
 * out [T, G*R]; for FP8, R must be a multiple of 128 (each group owns whole scale blocks). */
static PyObject *matmul(PyObject *args, PyObject *kw, char fmt) {
    static char *kw4[] = {"x", "w", "s", "out", "accumulate", "groups", NULL};
    static char *kw16[] = {"x", "w", "out", "accumulate", "groups", NULL};
    PyObject *ox, *ow, *os = NULL, *oo;
    int accumulate = 0;
    Py_ssize_t G = 1;
    if (fmt == 'b') {
        if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|pn", kw16, &ox, &ow, &oo, &accumulate, &G)) return NULL;
    } else if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|pn", kw4, &ox, &ow, &os, &oo, &accumulate, &G)) {
        return NULL;
    }
    if (G < 1) return PyErr_Format(PyExc_ValueError, "groups must be >= 1, got %zd", G);
    view_t v[4];
    memset(v, 0, sizeof v);
    const int nv = fmt == 'b' ? 3 : 4;
    view_t *vx = &v[0], *vw = &v[1], *vo = &v[2], *vs = &v[3];
    if (get_view(ox, vx, "x", 'f', 2, 0) || get_view(ow, vw, "w", fmt == 'b' ? 'H' : 'B', 2, 0) ||
        get_view(oo, vo, "out", 'f', 2, 1) || (fmt != 'b' && get_view(os, vs, "s", 'B', 2, 0)))
        goto fail;
    const int64_t T = dim(vx, 0), N = dim(vw, 0);
    if (dim(vx, 1) % G || N % G || (fmt == '8' && G > 1 && (N / G) % FP8_BLOCK)) {
        PyErr_Format(PyExc_ValueError, "groups=%zd needs x.shape[1] (%lld) and w.shape[0] (%lld) to be multiples of it%s",
                     G, (long long)dim(vx, 1), (long long)N, fmt == '8' ? ", and 128 to divide w.shape[0] / groups" : "");
        goto fail;
    }
    const int64_t K = dim(vx, 1) / G; /* per group */
    if (fmt == '4') {
        if (K % FP4_GROUP) {
            PyErr_Format(PyExc_ValueError, "FP4 needs K (x.shape[1] = %lld) to be a multiple of %d", (long long)K, FP4_GROUP);
            goto fail;
        }
        if (shape_is(vw, "w", N, K / 2, "= (N, K/2) for packed FP4") || shape_is(vs, "s", N, K / FP4_GROUP, "= (N, K/32)"))
            goto fail;
    } else if (fmt == '8') {
        if (shape_is(vw, "w", N, K, "= (N, K) for FP8") ||
            shape_is(vs, "s", (N + FP8_BLOCK - 1) / FP8_BLOCK, (K + FP8_BLOCK - 1) / FP8_BLOCK, "= (ceil(N/128), ceil(K/128))"))
            goto fail;
    } else if (shape_is(vw, "w", N, K, "= (N, K) for BF16")) {
        goto fail;
    }
    if (shape_is(vo, "out", T, N, "= (T, N)") || no_overlap(vo, vx, 1) || no_overlap(vo, vw, 1) ||
        (fmt != 'b' && no_overlap(vo, vs, 1)))
        goto fail;

    mm_job job = {.x = vx->b.buf, .w = vw->b.buf, .s = fmt == 'b' ? NULL : vs->b.buf, .T = T, .N = N, .K = K * G,
                  .out = vo->b.buf, .ldo = N, .accumulate = accumulate};
    const isa_ops *isa = cur_isa;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = weights_product(isa, fmt, &job, G);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        goto fail;
    }
    release(v, nv);
    Py_RETURN_NONE;
fail:
    release(v, nv);
    return NULL;
}

static PyObject *py_fp4_matmul(PyObject *self, PyObject *args, PyObject *kw) { (void)self; return matmul(args, kw, '4'); }
static PyObject *py_fp8_matmul(PyObject *self, PyObject *args, PyObject *kw) { (void)self; return matmul(args, kw, '8'); }
static PyObject *py_bf16_matmul(PyObject *self, PyObject *args, PyObject *kw) { (void)self; return matmul(args, kw, 'b'); }


/* ---------------------------------------------------------------- the fused routed experts */

/* expert_ffn(x, w1, s1, w3, s3, w2, s2, route_w, limit, out, act_block=0) -> None; out [T, D] is accumulated
 * into. act_block > 0 applies DeepSeek's FP8 activation quantization (act_quant_rows) per act_block values to x
 * before w1/w3 and to the routed mid activation before w2, as the official numerics do. */
static PyObject *py_expert_ffn(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kws[] = {"x", "w1", "s1", "w3", "s3", "w2", "s2", "route_w", "limit", "out", "act_block", NULL};
    PyObject *o[10];
    double limit;
    Py_ssize_t act_block = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOdO|n", kws, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6],
                                     &o[7], &limit, &o[9], &act_block))
        return NULL;
    if (act_block < 0) return PyErr_Format(PyExc_ValueError, "act_block must be >= 0, got %zd", act_block);
    view_t v[9];
    memset(v, 0, sizeof v);
    const char *names[9] = {"x", "w1", "s1", "w3", "s3", "w2", "s2", "route_w", "out"};
    PyObject *objs[9] = {o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[9]};
    for (int i = 0; i < 9; i++) {
        char code = (i == 0 || i >= 7) ? 'f' : 'B';
        if (get_view(objs[i], &v[i], names[i], code, i == 7 ? 1 : 2, i == 8)) goto fail;
    }
    const int64_t T = dim(&v[0], 0), D = dim(&v[0], 1), I = dim(&v[1], 0);
    if (D % FP4_GROUP || I % FP4_GROUP) {
        PyErr_Format(PyExc_ValueError, "expert_ffn needs D (%lld) and I (%lld) to be multiples of %d", (long long)D,
                     (long long)I, FP4_GROUP);
        goto fail;
    }
    if (shape_is(&v[1], "w1", I, D / 2, "= (I, D/2)") || shape_is(&v[2], "s1", I, D / 32, "= (I, D/32)") ||
        shape_is(&v[3], "w3", I, D / 2, "= (I, D/2), like w1") || shape_is(&v[4], "s3", I, D / 32, "= (I, D/32)") ||
        shape_is(&v[5], "w2", D, I / 2, "= (D, I/2)") || shape_is(&v[6], "s2", D, I / 32, "= (D, I/32)") ||
        shape_is(&v[8], "out", T, D, "= x.shape"))
        goto fail;
    if (dim(&v[7], 0) != T) {
        PyErr_Format(PyExc_ValueError, "route_w has %lld entries, expected T = %lld", (long long)dim(&v[7], 0), (long long)T);
        goto fail;
    }
    if (no_overlap(&v[8], v, 8)) goto fail;

    const isa_ops *isa = cur_isa;
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    if (T > 0 && D > 0 && I > 0) { /* one expert on all T tokens: experts_run with E = 1 */
        int64_t *rows = malloc((size_t)T * sizeof(int64_t)), off[2] = {0, T};
        const uint8_t *ew[6];
        for (int i = 0; i < 6; i++) ew[i] = v[1 + i].b.buf;
        if (!rows) rc = -1;
        for (int64_t t = 0; !rc && t < T; t++) rows[t] = t;
        if (!rc) rc = experts_run(isa, 1, ew, v[0].b.buf, D, I, rows, off, v[7].b.buf, (float)limit, act_block,
                                  v[8].b.buf);
        free(rows);
    }
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        goto fail;
    }
    release(v, 9);
    Py_RETURN_NONE;
fail:
    release(v, 9);
    return NULL;
}

/* experts_ffn(x, experts, rows, offsets, route_w, limit, out, act_block=0, zero=False) -> None: expert_ffn for a
 * layer's experts at once. experts: a sequence of E (w1, s1, w3, s3, w2, s2) tuples shaped as expert_ffn's; rows int64
 * [M]: token indices into x [T, D], expert e's being rows[offsets[e]:offsets[e+1]] (at least one each);
 * offsets int64 [E+1] from 0 to M; route_w float32 [M]; out [T, D] is added to, expert after expert (zero: set to
 * +0.0 first, as `out.fill(0.0)` would). */
static PyObject *py_experts_ffn(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kws[] = {"x", "experts", "rows", "offsets", "route_w", "limit", "out", "act_block", "zero", NULL};
    PyObject *ox, *oexp, *orows, *ooff, *orw, *oout, *seq = NULL;
    double limit;
    Py_ssize_t act_block = 0;
    int zero = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOdO|np", kws, &ox, &oexp, &orows, &ooff, &orw, &limit, &oout,
                                     &act_block, &zero))
        return NULL;
    if (act_block < 0) return PyErr_Format(PyExc_ValueError, "act_block must be >= 0, got %zd", act_block);
    seq = PySequence_Fast(oexp, "experts must be a sequence of (w1, s1, w3, s3, w2, s2) tuples");
    if (!seq) return NULL;
    const Py_ssize_t E = PySequence_Fast_GET_SIZE(seq);
    view_t v[5];
    memset(v, 0, sizeof v);
    view_t *ev = calloc((size_t)(6 * E) + 1, sizeof(view_t));
    const uint8_t **ew = calloc((size_t)(6 * E) + 1, sizeof(uint8_t *));
    Py_ssize_t got = 0; /* expert views acquired */
    if (!ev || !ew) {
        PyErr_NoMemory();
        goto fail;
    }
    if (get_view(ox, &v[0], "x", 'f', 2, 0) || get_view(orows, &v[1], "rows", 'q', 1, 0) ||
        get_view(ooff, &v[2], "offsets", 'q', 1, 0) || get_view(orw, &v[3], "route_w", 'f', 1, 0) ||
        get_view(oout, &v[4], "out", 'f', 2, 1))
        goto fail;
    const int64_t T = dim(&v[0], 0), D = dim(&v[0], 1), M = dim(&v[1], 0);
    const int64_t *rows = v[1].b.buf, *off = v[2].b.buf;
    if (shape_is(&v[4], "out", T, D, "= x.shape") || no_overlap(&v[4], v, 4)) goto fail;
    if (dim(&v[2], 0) != E + 1 || dim(&v[3], 0) != M || (E && (off[0] != 0 || off[E] != M))) {
        PyErr_Format(PyExc_ValueError, "offsets must have E+1 = %zd entries from 0 to len(rows) = %lld, and route_w "
                     "len(rows) entries", E + 1, (long long)M);
        goto fail;
    }
    for (Py_ssize_t e = 0; e < E; e++)
        if (off[e + 1] <= off[e]) {
            PyErr_Format(PyExc_ValueError, "offsets must increase: expert %zd has no tokens", e);
            goto fail;
        }
    for (int64_t j = 0; j < M; j++)
        if (rows[j] < 0 || rows[j] >= T) {
            PyErr_Format(PyExc_ValueError, "rows[%lld] = %lld is not a token of x (T = %lld)", (long long)j,
                         (long long)rows[j], (long long)T);
            goto fail;
        }
    int64_t I = -1;
    static const char *names[6] = {"w1", "s1", "w3", "s3", "w2", "s2"};
    for (Py_ssize_t e = 0; e < E; e++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, e);
        if (!PyTuple_Check(t) && !PyList_Check(t)) {
            PyErr_Format(PyExc_TypeError, "experts[%zd] must be a (w1, s1, w3, s3, w2, s2) tuple", e);
            goto fail;
        }
        if (PySequence_Size(t) != 6) {
            PyErr_Format(PyExc_ValueError, "experts[%zd] has %zd arrays, expected 6", e, PySequence_Size(t));
            goto fail;
        }
        for (int i = 0; i < 6; i++) {
            PyObject *a = PySequence_GetItem(t, i);
            int bad = !a || get_view(a, &ev[6 * e + i], names[i], 'B', 2, 0);
            Py_XDECREF(a);
            got = 6 * e + i + 1;
            if (bad) goto fail;
            ew[6 * e + i] = ev[6 * e + i].b.buf;
        }
        const view_t *w = ev + 6 * e;
        if (I < 0) I = dim(&w[0], 0);
        if (D % FP4_GROUP || I % FP4_GROUP) {
            PyErr_Format(PyExc_ValueError, "experts_ffn needs D (%lld) and I (%lld) to be multiples of %d",
                         (long long)D, (long long)I, FP4_GROUP);
            goto fail;
        }
        if (shape_is(&w[0], "w1", I, D / 2, "= (I, D/2), I as experts[0]") ||
            shape_is(&w[1], "s1", I, D / 32, "= (I, D/32)") || shape_is(&w[2], "w3", I, D / 2, "= (I, D/2)") ||
            shape_is(&w[3], "s3", I, D / 32, "= (I, D/32)") || shape_is(&w[4], "w2", D, I / 2, "= (D, I/2)") ||
            shape_is(&w[5], "s2", D, I / 32, "= (D, I/32)") || no_overlap(&v[4], w, 6))
            goto fail;
    }
    const isa_ops *isa = cur_isa;
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    if (zero) memset(v[4].b.buf, 0, (size_t)v[4].b.len);
    if (E > 0 && D > 0 && I > 0)
        rc = experts_run(isa, E, ew, v[0].b.buf, D, I, rows, off, v[3].b.buf, (float)limit, act_block, v[4].b.buf);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        goto fail;
    }
    release(ev, (int)got);
    release(v, 5);
    free(ev);
    free(ew);
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    if (ev) release(ev, (int)got);
    release(v, 5);
    free(ev);
    free(ew);
    Py_DECREF(seq);
    return NULL;
}

/* The UE8M0 scales of an FP8 weight [N, K]: [ceil(N/128), ceil(K/128)]. */
static int fp8_scales(PyObject *os, view_t *vs, const char *name, int64_t N, int64_t K) {
    return get_view(os, vs, name, 'B', 2, 0) ||
           shape_is(vs, name, (N + FP8_BLOCK - 1) / FP8_BLOCK, (K + FP8_BLOCK - 1) / FP8_BLOCK,
                    "= (ceil(N/128), ceil(K/128))");
}

/* shared_ffn(x f32 [T, D], w13, s13, w2, s2, limit, act_block, out f32 [T, D], accumulate=0) -> None: a MoE layer's
 * shared expert,
 * out = w2 q(silu(min(gate, l)) * clamp(up, -l, l)) with [gate | up] = w13 q(x); w13 [2I, D] (w1 and w3 stacked by
 * rows), w2 [D, I], each FP8 with its scales or bfloat16 with s None; q the FP8 activation rounding in blocks of
 * act_block (0: none). The same bits as the op-by-op calls (fp8_act_quant, fp8_matmul, swiglu, fp8_act_quant,
 * fp8_matmul); accumulate: added into out (the routed experts' sum there: out + shared, element by element). */
static PyObject *py_shared_ffn(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ox, *ow13, *os13, *ow2, *os2, *oo;
    double limit;
    Py_ssize_t act_block;
    int accumulate = 0;
    if (!PyArg_ParseTuple(args, "OOOOOdnO|p", &ox, &ow13, &os13, &ow2, &os2, &limit, &act_block, &oo, &accumulate))
        return NULL;
    if (act_block < 0) return PyErr_Format(PyExc_ValueError, "act_block must be >= 0, got %zd", act_block);
    view_t v[6];
    memset(v, 0, sizeof v);
    const char f13 = os13 == Py_None ? 'b' : '8', f2 = os2 == Py_None ? 'b' : '8';
    if (get_view(ox, &v[0], "x", 'f', 2, 0) || get_view(ow2, &v[3], "w2", f2 == 'b' ? 'H' : 'B', 2, 0)) goto fail;
    const int64_t T = dim(&v[0], 0), D = dim(&v[0], 1), I = dim(&v[3], 1);
    if (shape_is(&v[3], "w2", D, I, "= (D, I)") || (f2 == '8' && fp8_scales(os2, &v[4], "s2", D, I)) ||
        get_view(ow13, &v[1], "w13", f13 == 'b' ? 'H' : 'B', 2, 0) ||
        shape_is(&v[1], "w13", 2 * I, D, "= (2I, D): w1 and w3 stacked by rows") ||
        (f13 == '8' && fp8_scales(os13, &v[2], "s13", 2 * I, D)) || get_view(oo, &v[5], "out", 'f', 2, 1) ||
        shape_is(&v[5], "out", T, D, "= x.shape") || no_overlap(&v[5], v, 5))
        goto fail;
    const isa_ops *isa = cur_isa;
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    if (T > 0)
        rc = shared_run(isa, v[0].b.buf, T, D, I, f13, v[1].b.buf, f13 == 'b' ? NULL : v[2].b.buf, f2, v[3].b.buf,
                        f2 == 'b' ? NULL : v[4].b.buf, (float)limit, act_block, v[5].b.buf, accumulate);
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

/* ---------------------------------------------------------------- threads, ISA, features */

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg) {
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1 || n > 256) return PyErr_Format(PyExc_ValueError, "thread count must be in [1, 256], got %ld", n);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pool_set_threads((int)n);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_Format(PyExc_RuntimeError, "could only start %d of %ld threads", pool_get_threads(), n);
    Py_RETURN_NONE;
}

/* keep_freed_memory() -> bool: glibc's malloc keeps freed blocks for reuse instead of unmapping them (every block
 * from the heap: M_MMAP_MAX 0, since M_MMAP_THRESHOLD cannot rise past 32 MB; freed memory trimmed from the top
 * only past 1 GiB). A prefill chunk's big temporaries (64 MB per tensor at 512 tokens and Flash widths) were
 * otherwise fresh mappings each time, page-faulted and zeroed anew: ~20 % of a prefill's CPU time. False (and no
 * change) where malloc is not glibc's. Process-wide: the engine calls it where it sets torch's threads. */
static PyObject *py_keep_freed_memory(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
#if defined(__GLIBC__)
    return PyBool_FromLong(mallopt(M_MMAP_MAX, 0) && mallopt(M_TRIM_THRESHOLD, 1 << 30));
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLong(pool_get_threads());
}

static PyObject *py_default_num_threads(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLong(pool_default_threads());
}

static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    if (!strcmp(name, "auto")) {
        cur_isa = best_isa();
        Py_RETURN_NONE;
    }
    for (size_t i = 0; i < n_isas; i++)
        if (!strcmp(name, all_isas[i]->name)) {
            if (!isa_usable(all_isas[i])) return PyErr_Format(PyExc_ValueError, "this CPU cannot run the %s kernels", name);
            cur_isa = all_isas[i];
            Py_RETURN_NONE;
        }
    char names[256] = "";
    for (size_t i = 0; i < n_isas; i++) {
        strncat(names, all_isas[i]->name, sizeof names - strlen(names) - 1);
        strncat(names, ", ", sizeof names - strlen(names) - 1);
    }
    names[strlen(names) - 2] = '\0'; /* the last ", " */
    return PyErr_Format(PyExc_ValueError, "unknown ISA '%s' (%s or auto)", name, names);
}

static PyObject *py_get_isa(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyUnicode_FromString(cur_isa->name);
}

static PyObject *py_cpu_features(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    PyObject *d = PyDict_New(), *isas = PyList_New(0);
    if (!d || !isas) goto fail;
    for (size_t i = 0; i < n_cpu_features; i++)
        if (PyDict_SetItemString(d, cpu_feature_names[i], cpu_has(cpu_feature_names[i]) ? Py_True : Py_False))
            goto fail;
    for (size_t i = 0; i < n_isas; i++)
        if (isa_usable(all_isas[i])) {
            PyObject *s = PyUnicode_FromString(all_isas[i]->name);
            if (!s || PyList_Append(isas, s)) { Py_XDECREF(s); goto fail; }
            Py_DECREF(s);
        }
    PyObject *cur = PyUnicode_FromString(cur_isa->name);
    if (!cur || PyDict_SetItemString(d, "isa", cur)) { Py_XDECREF(cur); goto fail; }
    Py_DECREF(cur);
    if (PyDict_SetItemString(d, "usable_isas", isas)) goto fail;
    Py_DECREF(isas);
    return d;
fail:
    Py_XDECREF(d);
    Py_XDECREF(isas);
    return NULL;
}

/* ---------------------------------------------------------------- machine probes for the benchmark */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
    const isa_ops *isa;
    const uint8_t *p;
    size_t chunk, n;
    double *sums;
    int64_t iters;
    int dot; /* fma_chunk: 1 runs the bf16 dot loop */
} probe_ctx;

static void read_chunk(void *p, int64_t i) {
    probe_ctx *c = p;
    size_t off = (size_t)i * c->chunk, len = c->n - off < c->chunk ? c->n - off : c->chunk;
    c->sums[i] = c->isa->read_sum(c->p + off, len);
}

/* read_bandwidth(buf) -> seconds to stream every byte of buf once over the pool (buf.nbytes % 256 == 0). */
static PyObject *py_read_bandwidth(PyObject *self, PyObject *arg) {
    (void)self;
    view_t v = {0};
    if (get_view(arg, &v, "buf", 'B', 1, 0)) { release(&v, 1); return NULL; }
    probe_ctx c = {.isa = cur_isa, .p = v.b.buf, .chunk = 1 << 20, .n = (size_t)v.b.len & ~(size_t)255};
    int64_t nchunks = (int64_t)((c.n + c.chunk - 1) / c.chunk);
    c.sums = calloc((size_t)nchunks + 1, sizeof(double));
    if (!c.sums) { release(&v, 1); return PyErr_NoMemory(); }
    double t0, t1;
    Py_BEGIN_ALLOW_THREADS
    t0 = now_s();
    pool_run(nchunks, read_chunk, &c);
    t1 = now_s();
    Py_END_ALLOW_THREADS
    free(c.sums);
    release(&v, 1);
    return PyFloat_FromDouble(t1 - t0);
}

static void fma_chunk(void *p, int64_t i) {
    probe_ctx *c = p;
    c->sums[i] = c->dot ? bf16_dot_loop(c->iters) : c->isa->fma_loop(c->iters);
}

/* fma_peak(iters) -> (seconds, flops): every thread runs 8 slices of an FMA loop on independent registers. */
static PyObject *fma_probe(PyObject *arg, int dot) {
    long long iters = PyLong_AsLongLong(arg);
    if (iters == -1 && PyErr_Occurred()) return NULL;
    if (iters < 1) return PyErr_Format(PyExc_ValueError, "iters must be positive");
    if (dot && !cur_isa->tile_bf16) return PyErr_Format(PyExc_ValueError, "ISA %s has no bf16 tile path", cur_isa->name);
    int64_t nchunks = 8 * (int64_t)pool_get_threads();
    probe_ctx c = {.isa = cur_isa, .iters = iters, .dot = dot};
    c.sums = calloc((size_t)nchunks, sizeof(double));
    if (!c.sums) return PyErr_NoMemory();
    double t0, t1;
    Py_BEGIN_ALLOW_THREADS
    t0 = now_s();
    pool_run(nchunks, fma_chunk, &c);
    t1 = now_s();
    Py_END_ALLOW_THREADS
    double flops = 0;
    for (int64_t i = 0; i < nchunks; i++) flops += c.sums[i];
    free(c.sums);
    return Py_BuildValue("(dd)", t1 - t0, flops);
}

static PyObject *py_fma_peak(PyObject *self, PyObject *arg) { (void)self; return fma_probe(arg, 0); }
/* bf16_dot_peak(iters) -> (seconds, flops): the same with vdpbf16ps (the bf16 tile path's instruction). */
static PyObject *py_bf16_dot_peak(PyObject *self, PyObject *arg) { (void)self; return fma_probe(arg, 1); }

/* ---------------------------------------------------------------- pool tests */

typedef struct {
    int64_t *counts;
    double spin_s;
} pool_probe_ctx;

static void pool_probe_chunk(void *p, int64_t i) {
    const pool_probe_ctx *c = p;
    const double t0 = now_s();
    while (now_s() - t0 < c->spin_s) {}
    __atomic_fetch_add(&c->counts[i], 1, __ATOMIC_SEQ_CST); /* at the end: a chunk still running counts 0 */
}

/* _pool_probe(counts i64[n], spin_us): one pool job of n chunks, chunk i spinning spin_us then adding 1 to
 * counts[i]; when it returns every count must be exactly 1 (each chunk ran once, all before the job ended). */
static PyObject *py_pool_probe(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o;
    double spin_us;
    if (!PyArg_ParseTuple(args, "Od", &o, &spin_us)) return NULL;
    view_t v = {0};
    if (get_view(o, &v, "counts", 'q', 1, 1)) { release(&v, 1); return NULL; }
    pool_probe_ctx c = {.counts = v.b.buf, .spin_s = spin_us * 1e-6};
    Py_BEGIN_ALLOW_THREADS
    pool_run(dim(&v, 0), pool_probe_chunk, &c);
    Py_END_ALLOW_THREADS
    release(&v, 1);
    Py_RETURN_NONE;
}

/* _pool_test_delays(worker_us, caller_us): the pool's race-widening test hooks (pool.c); 0, 0 turns them off. */
static PyObject *py_pool_test_delays(PyObject *self, PyObject *args) {
    (void)self;
    int w, c;
    if (!PyArg_ParseTuple(args, "ii", &w, &c)) return NULL;
    pool_test_delays(w, c);
    Py_RETURN_NONE;
}

/* _readahead(mb) -> the previous cap in MB: how much of the next product's weights the idle worker prefetches
 * (readahead.c; 0 turns it off); tests and A/B runs. */
static PyObject *py_readahead(PyObject *self, PyObject *args) {
    (void)self;
    long long mb;
    if (!PyArg_ParseTuple(args, "L", &mb)) return NULL;
    if (mb < 0 || mb > (1ll << 20)) return PyErr_Format(PyExc_ValueError, "readahead cap must be 0..%lld MB, got %lld", 1ll << 20, mb);
    return PyLong_FromSize_t(readahead_set_cap((size_t)mb << 20) >> 20);
}

/* _readahead_stats() -> (prefetches requested, bytes prefetched) since the process started. */
static PyObject *py_readahead_stats(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    uint64_t n, bytes;
    readahead_stats(&n, &bytes);
    return Py_BuildValue("KK", (unsigned long long)n, (unsigned long long)bytes);
}

/* A kernel switch set to arg's truth; returns its previous setting (the toggles below). */
static PyObject *swap_switch(int *flag, PyObject *arg) {
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    const int was = *flag;
    *flag = on;
    return PyBool_FromLong(was);
}

/* _x_prep_isa(on) -> the previous setting: the ISA's vectorized x scan and bfloat16 copy, or their portable reference
 * loops (kernels.h's x_prep_isa); tests. */
static PyObject *py_x_prep_isa(PyObject *self, PyObject *arg) {
    (void)self;
    return swap_switch(&x_prep_isa, arg);
}

/* _fp8_fold(on) -> the previous setting: the FP8 dot path's scale folding (kernels.h's fp8_fold); tests and A/B. */
static PyObject *py_fp8_fold(PyObject *self, PyObject *arg) {
    (void)self;
    return swap_switch(&fp8_fold, arg);
}

/* ---------------------------------------------------------------- module */

static PyMethodDef methods[] = {
    {"fp4_matmul", (PyCFunction)(void (*)(void))py_fp4_matmul, METH_VARARGS | METH_KEYWORDS,
     "fp4_matmul(x f32[T,K], w u8[N,K/2], s u8[N,K/32], out f32[T,N], accumulate=False): out (+)= x @ W.T"},
    {"fp8_matmul", (PyCFunction)(void (*)(void))py_fp8_matmul, METH_VARARGS | METH_KEYWORDS,
     "fp8_matmul(x f32[T,K], w u8[N,K], s u8[ceil(N/128),ceil(K/128)], out f32[T,N], accumulate=False)"},
    {"bf16_matmul", (PyCFunction)(void (*)(void))py_bf16_matmul, METH_VARARGS | METH_KEYWORDS,
     "bf16_matmul(x f32[T,K], w u16[N,K], out f32[T,N], accumulate=False)"},
    {"experts_ffn", (PyCFunction)(void (*)(void))py_experts_ffn, METH_VARARGS | METH_KEYWORDS,
     "experts_ffn(x, experts, rows, offsets, route_w, limit, out, act_block=0): a layer's experts in one call"},
    {"expert_ffn", (PyCFunction)(void (*)(void))py_expert_ffn, METH_VARARGS | METH_KEYWORDS,
     "expert_ffn(x, w1, s1, w3, s3, w2, s2, route_w, limit, out): out += route_w * swiglu(x) @ W2.T"},
    {"shared_ffn", py_shared_ffn, METH_VARARGS,
     "shared_ffn(x, w13, s13, w2, s2, limit, act_block, out, accumulate=False): a MoE layer's shared expert"},
    {"fp8_act_quant", py_fp8_act_quant, METH_VARARGS,
     "fp8_act_quant(x f32[R,K], block, out f32[R,K]): DeepSeek's FP8 activation quant-dequant per block"},
    {"sinkhorn", py_sinkhorn, METH_VARARGS, "sinkhorn(logits f32[B, n*n], n, iters, eps, out): mHC mixing matrices"},
    {"rms_norm", py_rms_norm, METH_VARARGS, "rms_norm(x f32[R, K], weight f32[K] | None, eps, out): RMS norm of each row"},
    {"rope", py_rope, METH_VARARGS, "rope(x f32[R, D], cos f32[T, h], sin, inverse, out): interleaved RoPE per row"},
    {"hadamard", py_hadamard, METH_VARARGS, "hadamard(x f32[R, n], scale, out): Walsh-Hadamard transform of each row, scaled"},
    {"fp4_act_quant", py_fp4_act_quant, METH_VARARGS,
     "fp4_act_quant(x f32[R, K], block, out): FP4 e2m1 quantize-dequantize per block, power-of-two scales"},
    {"swiglu", py_swiglu, METH_VARARGS, "swiglu(gate f32[T, I], up, limit, out): silu(min(g, l)) * clamp(u, -l, l)"},

    {"hc_pre", (PyCFunction)(void (*)(void))py_hc_pre, METH_VARARGS | METH_KEYWORDS,
     "hc_pre(x f32[T,n*d], fn f32[R,n*d], base f32[R], scale f32[3], n, iters, hc_eps, eps, u f32[T,d], post f32[T,n]"
     "=None, comb f32[T,n*n]=None, norm f32[d]=None, norm_eps=0): mHC collapse (R = (2+n)*n); post = comb = None: the "
     "head (R = n, scale [1]); norm: u then RMS-normed with that weight"},
    {"hc_post", (PyCFunction)(void (*)(void))py_hc_post, METH_VARARGS | METH_KEYWORDS,
     "hc_post(f f32[T,d], x f32[T,n*d], post f32[T,n], comb f32[T,n*n], out f32[T,n*d]): mHC mix back"},
    {"hc_post_pre", (PyCFunction)(void (*)(void))py_hc_post_pre, METH_VARARGS | METH_KEYWORDS,
     "hc_post_pre(f, x, post, comb, out, fn, base, scale, iters, hc_eps, eps, u, post_out=None, comb_out=None, "
     "norm=None, norm_eps=0): hc_post into out, then hc_pre of out (post_out/comb_out None: the head's collapse)"},
    {"attend", (PyCFunction)(void (*)(void))py_attend, METH_VARARGS | METH_KEYWORDS,
     "attend(q f32[T,H,D], keys f32[K,D], k0, p0, window, comp f32[E,D]|None, comp_idx i64[T,k]|None, ratio, "
     "sinks f32[H], scale, out f32[T,H,D]): attention with sinks over window keys and compressed entries"},
    {"state_rows_decode", py_state_rows_decode, METH_VARARGS,
     "state_rows_decode(raw u8[k,B], kind 0 fp8|1 fp4, rope, out f32[k,W]): packed decode-state rows to float32"},
    {"state_rows_encode", py_state_rows_encode, METH_VARARGS,
     "state_rows_encode(x f32[k,W], kind, rope, raw u8[k,B]) -> -1 or the first row not exactly representable"},
    {"compress_pool", py_compress_pool, METH_VARARGS,
     "compress_pool(kv f32[n,M,hd], gate f32[n,M,hd], out f32[n,hd]): the compressor's softmax-gated pooling"},
    {"index_topk", py_index_topk, METH_VARARGS,
     "index_topk(score f32[T,E], p0, out i64[T,k]): the k best visible entries of each query, ascending, -1 after"},
    {"index_scores_fp4", py_index_scores_fp4, METH_VARARGS,
     "index_scores_fp4(q f32[T,Hi,Di], w f32[T,Hi], rows u8[E,17Di/32], p0, scale, out f32[T,E]): lightning indexer "
     "scores over keys packed as the state stores them"},
    {"index_scores", py_index_scores, METH_VARARGS,
     "index_scores(q f32[T,Hi,Di], w f32[T,Hi], keys f32[E,Di], p0, scale, out f32[T,E], bf16=False): lightning "
     "indexer scores"},
    {"attn_project", py_attn_project, METH_VARARGS,
     "attn_project(x, w_a, s_a, q_lora, w_b, s_b, q_norm, kv_norm, cos, sin, eps, act_block, nope_block, q, qr, kv): "
     "the attention block's projections at decode, one call"},
    {"attn_output", py_attn_output, METH_VARARGS,
     "attn_output(o, cos, sin, heads, bf16_input, w_a, s_a, groups, act_block, w_b, s_b, out): the attention "
     "block's output at decode, one call"},
    {"index_queries", py_index_queries, METH_VARARGS,
     "index_queries(qr, w_b, s_b, x, w_w, s_w, cos, sin, heads, act_block, rotate, w_scale, q, w): the lightning "
     "indexer's queries and head weights at decode, one call"},
    {"route_weights", (PyCFunction)(void (*)(void))py_route_weights, METH_VARARGS | METH_KEYWORDS,
     "route_weights(scores f32[T,E], idx i64[T,k], eps, scale, out f32[T,k], ids i64[T]=None, table i64[V,k]=None, "
     "bias=None, softplus=False, by_expert=False): "
     "the MoE router's weights of its picks (with ids and table: idx = table[ids] first; with bias f32[E]: idx = the "
     "top-k of scores + bias first; softplus=True: scores holds the logits, made the scores in place first; by_expert: "
     "each row's (id, weight) pairs then ordered by id)"},
    {"embed_streams", py_embed_streams, METH_VARARGS,
     "embed_streams(w u16[V,d], ids (ints), out f32[B,n*d]): the bfloat16 rows w[ids] widened into each of n streams"},
    {"sqrtsoftplus", py_sqrtsoftplus, METH_VARARGS,
     "sqrtsoftplus(x f32, out f32): out = sqrt(softplus(x)) elementwise, as torch's scalar code (out may be x)"},
    {"compress_row", py_compress_row, METH_VARARGS,
     "compress_row(y, t, off, kv_rows, gate_rows, row, ape, pos, norm, eps, quant, rope, cos, sin, out, out_row, "
     "out_kind) -> bool: a compressor's decode step on one token (its rows stored; a closed window's entry too)"},
    {"attend_stored", py_attend_stored, METH_VARARGS,
     "attend_stored(q, kv, kv_kind, kv_rope, kv_first, n_keys, k0, p0, window, entries, ent_kind, ent_rope, "
     "n_entries, picks, ratio, sinks, scale, out): one decode query's attention over its state's stored rows"},
    {"head_i8_build", py_head_i8_build, METH_VARARGS,
     "head_i8_build(w u16[V,K], q i8[V,K], scale f32[V], wnorm f64[V], dnorm f64[V], rowsum i32[V]): the int8 copy "
     "of a bfloat16 LM head and its per-row scale, norms and sums"},
    {"head_i8_dot", py_head_i8_dot, METH_VARARGS,
     "head_i8_dot(xq i8[T,K], q i8[V,K], rowsum i32[V], out i32[T,V]): out = xq @ q.T, exact int32"},
    {"head_i8_quantize", py_head_i8_quantize, METH_VARARGS,
     "head_i8_quantize(y f32[T,K], x i8[2T,K], sx f32[2T], stats f64[T,3 or 5]): decode rows as two int8 terms, "
     "norms (5: also the first term's alone)"},
    {"head_i8_screen", py_head_i8_screen, METH_VARARGS,
     "head_i8_screen(x i8[2T,K], sx f32[2T], c f32[T,4], q i8[V,K], rowsum i32[V], scale f32[V], wnorm f32[V], "
     "dnorm f32[V], margin, ub f32[T,V], keep u8[V], rows i64[V]) -> n: head_i8_dot and head_i8_select in one pass, "
     "the second terms only where the first leaves a row open"},
    {"head_i8_select", py_head_i8_select, METH_VARARGS,
     "head_i8_select(dots i32[2T,V], sx f32[2T], scale f32[V], c1 f32[T], c2 f32[T], wnorm f32[V], dnorm f32[V], "
     "margin, keep u8[V], rows i64[V]) -> n: the screened head's candidate rows in rows[:n]"},
    {"_head_i8_path", py_head_i8_path, METH_NOARGS, "_head_i8_path() -> how head_i8_dot runs under the ISA in use"},
    {"gather_rows", py_gather_rows, METH_VARARGS, "gather_rows(w u16[V,K], idx i64[U], out u16[U,K]): out = w[idx]"},
    {"head_i8_exact", py_head_i8_exact, METH_VARARGS,
     "head_i8_exact(w u16[V,K], rows i64[U], y f32[T,K], out f32[T,V]): out = -inf but at rows, the BF16 head's logits"},
    {"set_num_threads", py_set_num_threads, METH_O, "set_num_threads(n): resize the thread pool"},
    {"keep_freed_memory", py_keep_freed_memory, METH_NOARGS, "keep_freed_memory() -> bool: malloc reuses freed blocks"},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "get_num_threads() -> int"},
    {"default_num_threads", py_default_num_threads, METH_NOARGS, "CPUs this process may run on (or FASTAR_THREADS)"},
    {"set_isa", py_set_isa, METH_O, "set_isa('avx512bf16'|'avx512'|'avx2'|'scalar'|'auto')"},
    {"get_isa", py_get_isa, METH_NOARGS, "get_isa() -> str"},
    {"cpu_features", py_cpu_features, METH_NOARGS, "cpu_features() -> dict"},
    {"read_bandwidth", py_read_bandwidth, METH_O, "read_bandwidth(buf u8[n]) -> seconds for one streaming pass"},
    {"fma_peak", py_fma_peak, METH_O, "fma_peak(iters) -> (seconds, flops)"},
    {"bf16_dot_peak", py_bf16_dot_peak, METH_O, "bf16_dot_peak(iters) -> (seconds, flops) of vdpbf16ps"},
    {"_pool_probe", py_pool_probe, METH_VARARGS, "_pool_probe(counts i64[n], spin_us): count each chunk's runs"},
    {"_pool_test_delays", py_pool_test_delays, METH_VARARGS, "_pool_test_delays(worker_us, caller_us): test hooks"},
    {"_readahead", py_readahead, METH_VARARGS, "_readahead(mb) -> previous: the weight readahead's cap (0: off)"},
    {"_readahead_stats", py_readahead_stats, METH_NOARGS, "_readahead_stats() -> (prefetches requested, bytes)"},
    {"_x_prep_isa", py_x_prep_isa, METH_O, "_x_prep_isa(on) -> previous: vectorized x scan and copy (tests)"},
    {"_fp8_fold", py_fp8_fold, METH_O, "_fp8_fold(on) -> previous: the FP8 dot path's scale folding (tests, A/B)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "fastar's fused dequantize-and-multiply CPU kernels",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) {
    isas_init();
    state_rows_init();
    return PyModule_Create(&module);
}
