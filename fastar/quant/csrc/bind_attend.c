/* One decode query's attention over what its state stores, as one C call, `attend_stored`: the window rows and the
 * compressed entries it sees read (decoded where the state packs them, FP8 / FP4 as fastar.model.state's row formats)
 * straight from the state's storage, then attn.c's attention. At decode the same work was a dozen Python-level steps
 * per row and layer (each buffer's bounds, a float32 copy of its rows, the indexer's picks mapped to the rows they
 * name, the attention call's arguments), costing more than the attention itself. The decoded rows are the same floats
 * state_rows_decode gives the Python path, in the same arrays, and attn_run gets the same job, so the output is
 * bit-identical to fastar/model/deepseek_v4.py's `Attention._attend` op by op (tests/test_attend_stored.py).
 * Owns: the argument checks and the gathering. Does not own: the attention (attn.c), the row formats (attn_prefill.c),
 * when to call it (fastar/model/attend_fused.py).
 */
#include "bindings.h"

#include <stdlib.h>
#include <string.h>

#include "dispatch.h"

enum { ROWS_F32 = -1 }; /* else STATE_FP8 / STATE_FP4 */

/* A state buffer's storage: float32 [N, D] (kind ROWS_F32) or packed bytes [N, B]; sets *B (bytes a row). */
static int get_rows(PyObject *o, view_t *v, const char *name, Py_ssize_t kind, Py_ssize_t rope, int64_t D,
                    int64_t *B) {
    if (kind == ROWS_F32) {
        if (get_view(o, v, name, 'f', 2, 0)) return -1;
        *B = D * 4;
        return shape_is(v, name, dim(v, 0), D, "= (rows, D)");
    }
    if (kind != STATE_FP8 && kind != STATE_FP4) {
        PyErr_Format(PyExc_ValueError, "attend_stored: %s kind must be -1, 0 or 1, got %zd", name, kind);
        return -1;
    }
    if (kind == STATE_FP8 && (rope < 0 || rope >= D)) {
        PyErr_Format(PyExc_ValueError, "attend_stored: %s rope dims %zd outside [0, D = %lld)", name, rope, (long long)D);
        return -1;
    }
    if (get_view(o, v, name, 'B', 2, 0)) return -1;
    *B = packed_row_bytes((int)kind, rope, D);
    return shape_is(v, name, dim(v, 0), *B, "= (rows, the format's row bytes)");
}

/* attend_stored(q f32 [1, H, D], kv, kv_kind, kv_rope, kv_first, n_keys, k0, p0, window, entries | None, ent_kind,
 * ent_rope, n_entries, picks i64 [1, k] | None, ratio, sinks f32 [H], scale, out f32 [1, H, D]) -> None.
 * The query at position p0 over the window keys at positions k0 .. k0 + n_keys - 1, stored rows kv_first .. of kv
 * (ROWS_F32 float32 rows, else STATE_FP8 / STATE_FP4 packed rows with kv_rope float32 dims), and the compressed
 * entries: with picks (the indexer's, ascending, -1 last) and packed entries, the picked rows only (each decoded, in
 * pick order, the picks then naming their places); with picks and float32 entries, the entries' first n_entries
 * rows with the picks as they are; without picks, the first n_entries rows (none when 0). */
PyObject *py_attend_stored(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oq, *okv, *oent, *opk, *os, *oo;
    Py_ssize_t kv_kind, kv_rope, kv_first, n_keys, k0, p0, window, ent_kind, ent_rope, n_ent, ratio;
    double scale;
    if (!PyArg_ParseTuple(args, "OOnnnnnnnOnnnOnOdO", &oq, &okv, &kv_kind, &kv_rope, &kv_first, &n_keys, &k0, &p0,
                          &window, &oent, &ent_kind, &ent_rope, &n_ent, &opk, &ratio, &os, &scale, &oo))
        return NULL;
    view_t v[6]; /* q, kv, sinks, entries, picks, out */
    memset(v, 0, sizeof v);
    float *keys_buf = NULL, *comp_buf = NULL;
    int64_t *idx_buf = NULL;
    if (get_view(oq, &v[0], "q", 'f', 3, 0) || get_view(os, &v[2], "sinks", 'f', 1, 0) ||
        get_view(oo, &v[5], "out", 'f', 3, 1))
        goto fail;
    const int64_t H = dim(&v[0], 1), D = dim(&v[0], 2);
    int64_t Bk = 0, Be = 0;
    if (dim(&v[0], 0) != 1 || dim(&v[5], 0) != 1 || dim(&v[5], 1) != H || dim(&v[5], 2) != D || dim(&v[2], 0) != H) {
        PyErr_Format(PyExc_ValueError, "attend_stored needs q and out [1, H, D] and sinks [H]; got q [%lld, %lld, %lld]",
                     (long long)dim(&v[0], 0), (long long)H, (long long)D);
        goto fail;
    }
    if (get_rows(okv, &v[1], "kv", kv_kind, kv_rope, D, &Bk)) goto fail;
    if (kv_first < 0 || n_keys < 1 || kv_first + n_keys > dim(&v[1], 0) || k0 < 0 || p0 < 0 || window < 1 ||
        ratio < 0) {
        PyErr_Format(PyExc_ValueError, "attend_stored: kv rows [%zd, %zd) outside its %lld rows, or k0 %zd, p0 %zd, "
                     "window %zd, ratio %zd out of range", kv_first, kv_first + n_keys, (long long)dim(&v[1], 0), k0,
                     p0, window, ratio);
        goto fail;
    }
    const int has_ent = oent != Py_None, has_picks = opk != Py_None;
    int64_t k = 0;
    if (has_ent) {
        if (get_rows(oent, &v[3], "entries", ent_kind, ent_rope, D, &Be)) goto fail;
        if (n_ent < 0 || n_ent > dim(&v[3], 0) || ratio < 1) {
            PyErr_Format(PyExc_ValueError, "attend_stored: %zd entries of %lld stored, ratio %zd", n_ent,
                         (long long)dim(&v[3], 0), ratio);
            goto fail;
        }
        if (has_picks) {
            if (get_view(opk, &v[4], "picks", 'q', 2, 0)) goto fail;
            k = dim(&v[4], 1);
            const int64_t *pk = v[4].b.buf;
            for (int64_t i = 0; i < k; i++)
                if (dim(&v[4], 0) != 1 || pk[i] >= n_ent || (i && pk[i] >= 0 && pk[i] <= pk[i - 1]) ||
                    (i && pk[i - 1] < 0 && pk[i] >= 0)) {
                    PyErr_Format(PyExc_ValueError, "attend_stored: picks must be [1, k], ascending entries below %zd, "
                                 "then -1", n_ent);
                    goto fail;
                }
        }
    } else if (has_picks || n_ent) {
        PyErr_SetString(PyExc_ValueError, "attend_stored: picks or entries without the entry rows");
        goto fail;
    }
    if (no_overlap(&v[5], v, 5)) goto fail;
    const isa_ops *isa = cur_isa;
    const uint8_t *kv = v[1].b.buf, *ent = has_ent ? v[3].b.buf : NULL;
    const int64_t *picks = has_picks ? v[4].b.buf : NULL;
    int64_t E = 0, used = 0;
    while (used < k && picks[used] >= 0) used++;
    const int packed_picks = has_picks && ent_kind != ROWS_F32;
    if (kv_kind != ROWS_F32) keys_buf = malloc((size_t)(n_keys * D) * sizeof(float));
    if (has_ent && ent_kind != ROWS_F32 && (packed_picks ? used : n_ent) > 0)
        comp_buf = malloc((size_t)((packed_picks ? used : n_ent) * D) * sizeof(float));
    if (packed_picks) idx_buf = malloc((size_t)(k ? k : 1) * sizeof(int64_t));
    if ((kv_kind != ROWS_F32 && !keys_buf) || (packed_picks && !idx_buf) ||
        (has_ent && ent_kind != ROWS_F32 && (packed_picks ? used : n_ent) > 0 && !comp_buf)) {
        PyErr_NoMemory();
        goto fail;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    const float *keys = (const float *)(kv + kv_first * Bk), *comp = NULL;
    const int64_t *idx = NULL;
    if (kv_kind != ROWS_F32) {
        state_rows_decode_pool(kv + kv_first * Bk, keys_buf, n_keys, Bk, (int)kv_kind, D, kv_rope);
        keys = keys_buf;
    }
    if (packed_picks) { /* the picked rows in pick order; each pick names its place */
        for (int64_t i = 0; i < used; i++)
            state_rows_decode(ent + picks[i] * Be, comp_buf + i * D, 1, Be, (int)ent_kind, D, ent_rope);
        for (int64_t i = 0; i < k; i++) idx_buf[i] = i < used ? i : -1;
        comp = used ? comp_buf : NULL, E = used, idx = idx_buf;
    } else if (has_ent && n_ent) { /* the first n_entries rows (with float32 entries, any picks name them) */
        if (ent_kind != ROWS_F32) {
            state_rows_decode_pool(ent, comp_buf, n_ent, Be, (int)ent_kind, D, ent_rope);
            comp = comp_buf;
        } else {
            comp = (const float *)ent;
        }
        E = n_ent, idx = picks;
    }
    const attn_job job = {.q = v[0].b.buf, .keys = keys, .comp = comp, .idx = comp ? idx : NULL, .sinks = v[2].b.buf,
                          .out = v[5].b.buf, .T = 1, .H = H, .D = D, .K = n_keys, .E = E, .k = comp && idx ? k : 0,
                          .k0 = k0, .p0 = p0, .window = window, .ratio = ratio, .scale = (float)scale};
    rc = attn_run(isa, &job);
    Py_END_ALLOW_THREADS
    free(keys_buf);
    free(comp_buf);
    free(idx_buf);
    release(v, 6);
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
fail:
    free(keys_buf);
    free(comp_buf);
    free(idx_buf);
    release(v, 6);
    return NULL;
}
