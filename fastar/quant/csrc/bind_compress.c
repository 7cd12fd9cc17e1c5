/* A compressor's decode-time work on one new token as one C call, `compress_row`: the token's kv and gate rows
 * (gate + its absolute-position embedding) appended to the raw rows of its state, and when the token closes a window,
 * the window pooled (softmax over its gate rows), normed, RoPE'd at the window's first position, rounded as the
 * numerics say (the FP8 KV cache's non-RoPE dims, or the indexer's Hadamard rotation and FP4) and stored in the
 * entry buffer's format. At decode this is ~25 Python-level ops per closing window and a few per token, and their
 * dispatch cost far more than their arithmetic; here the same C routines run in the same order on the same values
 * (attn_prefill.c's pooling and state-row encoder, rowops.c's norm, RoPE, Hadamard and FP4 rounding, the ISA's FP8
 * rounding), so the results are bit-identical to fastar/model/deepseek_v4.py's `Compressor.add` run op by op on the
 * C extension (tests/test_compress_fused.py compares them).
 * Owns: the argument checks and the sequence. Does not own: the arithmetic of any step, the state's buffers (Python
 * grows them and hands over their storage), when to call it (fastar/model/compress_fused.py).
 */
#include "bindings.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"

enum { QUANT_NONE = 0, QUANT_FP8_NOPE = 1, QUANT_FP4_ROTATE = 2 };
enum { OUT_F32 = -1 }; /* else STATE_FP8 / STATE_FP4 (kernels.h) */

/* Rows [lo, lo + n) of a 2-D storage view exist. */
static int rows_in(const view_t *v, const char *name, int64_t lo, int64_t n) {
    if (lo < 0 || lo + n > dim(v, 0)) {
        PyErr_Format(PyExc_ValueError, "compress_row: %s rows [%lld, %lld) are outside its %lld rows", name,
                     (long long)lo, (long long)(lo + n), (long long)dim(v, 0));
        return -1;
    }
    return 0;
}

/* compress_row(y f32 [T, S], t, off, kv_rows f32 [N, W], gate_rows f32 [N, W], row, ape f32 [m, W], pos, norm f32
 * [hd], eps, quant, rope, cos f32 [1, h] | None, sin | None, out f32 [E, hd] | u8 [E, B] | None, out_row, out_kind)
 * -> bool.
 * The token at position pos: its kv row y[t, off : off+W] goes to kv_rows[row] and its gate row y[t, off+W : off+2W]
 * plus ape[pos % m] to gate_rows[row] (W = hd, or 2 hd for the overlapping ratio-4 windows: [Ca | Cb] halves). When
 * pos closes its window w (pos + 1 a multiple of m), the window's rows are the m rows up to `row` (overlapping: their
 * Cb halves, after the Ca halves of the m rows before them, or of nothing for window 0: kv 0, gate -inf), pooled,
 * normed with `norm`, rotated by cos / sin (the angles of position w m) in their last 2h dims, rounded by `quant`
 * (QUANT_FP8_NOPE: the first hd - rope dims in FP8 blocks of 64; QUANT_FP4_ROTATE: Hadamard, then FP4 blocks of 32)
 * and stored at out[out_row] (out_kind OUT_F32: as float32; STATE_FP8 / STATE_FP4: packed as fastar.model.state's
 * row formats, `rope` float32 dims for FP8). Returns False (the entry row untouched past its packing) when the entry is
 * not exactly representable in the packed format, True otherwise. */
PyObject *py_compress_row(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *oy, *okv, *og, *oape, *onorm, *oc, *os, *oout;
    Py_ssize_t t, off, row, pos, quant, rope, out_row, out_kind;
    double eps;
    if (!PyArg_ParseTuple(args, "OnnOOnOnOdnnOOOnn", &oy, &t, &off, &okv, &og, &row, &oape, &pos, &onorm, &eps, &quant,
                          &rope, &oc, &os, &oout, &out_row, &out_kind))
        return NULL;
    view_t v[8];
    memset(v, 0, sizeof v);
    view_t *vy = &v[0], *vape = &v[1], *vn = &v[2], *vc = &v[3], *vs = &v[4], *vkv = &v[5], *vg = &v[6], *vo = &v[7];
    float *buf = NULL;
    if (get_view(oy, vy, "y", 'f', 2, 0) || get_view(oape, vape, "ape", 'f', 2, 0) ||
        get_view(onorm, vn, "norm", 'f', 1, 0) || get_view(okv, vkv, "kv_rows", 'f', 2, 1) ||
        get_view(og, vg, "gate_rows", 'f', 2, 1))
        goto fail;
    const int64_t m = dim(vape, 0), W = dim(vape, 1), hd = vn->b.shape[0];
    if (m < 1 || hd < 1 || (W != hd && W != 2 * hd) || pos < 0 || t < 0 || t >= dim(vy, 0) || off < 0 ||
        off + 2 * W > dim(vy, 1) || dim(vkv, 1) != W || dim(vg, 1) != W || quant < 0 || quant > 2 || rope < 0 ||
        rope > hd || out_kind < OUT_F32 || out_kind > STATE_FP4) {
        PyErr_Format(PyExc_ValueError, "compress_row: ape [%lld, %lld] needs width hd or 2 hd (norm has hd = %lld), "
                     "y [%lld, %lld] row %zd its kv and gate at column %zd, kv_rows / gate_rows that width, quant in "
                     "0..2, 0 <= rope <= hd, out_kind in -1..1", (long long)m, (long long)W, (long long)hd,
                     (long long)dim(vy, 0), (long long)dim(vy, 1), t, off);
        goto fail;
    }
    if (rows_in(vkv, "kv_rows", row, 1) || rows_in(vg, "gate_rows", row, 1) || no_overlap_named(vkv, "kv_rows", v, 3) ||
        no_overlap_named(vg, "gate_rows", v, 3) || no_overlap_named(vg, "gate_rows", vkv, 1))
        goto fail;
    const int overlap = W == 2 * hd, closes = (pos + 1) % m == 0, has_prev = overlap && pos + 1 > m;
    int64_t half = 0, B = 0;
    if (closes) {
        const int64_t need = has_prev ? 2 * m : m; /* the window's rows, up to the new one */
        if (rows_in(vkv, "kv_rows", row + 1 - need, need) || get_view(oc, vc, "cos", 'f', 2, 0) ||
            shape_is(vc, "cos", 1, dim(vc, 1), "(one row: the window's position)") ||
            get_view(os, vs, "sin", 'f', 2, 0) || shape_is(vs, "sin", 1, dim(vc, 1), "(= cos's shape)"))
            goto fail;
        half = dim(vc, 1);
        if (2 * half > hd || (quant == QUANT_FP4_ROTATE && (hd & (hd - 1)))) {
            PyErr_Format(PyExc_ValueError, "compress_row: 2 x cos width (%lld) must be <= hd (%lld), a power of two for "
                         "the Hadamard rotation", (long long)half, (long long)hd);
            goto fail;
        }
        if (out_kind == OUT_F32) {
            if (get_view(oout, vo, "out", 'f', 2, 1)) goto fail;
            B = hd;
        } else {
            if (get_view(oout, vo, "out", 'B', 2, 1)) goto fail;
            B = packed_row_bytes((int)out_kind, rope, hd); /* 0 (no FP8 row without non-RoPE dims): refused below */
        }
        if (!B || dim(vo, 1) != B || rows_in(vo, "out", out_row, 1) || no_overlap_named(vo, "out", v, 7)) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "compress_row: out rows hold %lld values, expected %lld", (long long)dim(vo, 1),
                             (long long)B);
            goto fail;
        }
        buf = malloc((size_t)(2 * 2 * m * hd + hd) * sizeof(float));
        if (!buf) {
            PyErr_NoMemory();
            goto fail;
        }
    }
    const isa_ops *isa = cur_isa;
    const float *y = (const float *)vy->b.buf + t * dim(vy, 1) + off, *ape = (const float *)vape->b.buf + pos % m * W;
    float *kv = vkv->b.buf, *gate = vg->b.buf;
    int rc = 0;
    int64_t bad = -1;
    Py_BEGIN_ALLOW_THREADS
    memcpy(kv + row * W, y, (size_t)W * sizeof(float));
    for (int64_t f = 0; f < W; f++) gate[row * W + f] = y[W + f] + ape[f];
    if (closes) {
        const float *wkv = kv + (row + 1 - m) * W, *wg = gate + (row + 1 - m) * W; /* the window's own rows */
        float *c = buf + 2 * 2 * m * hd;
        if (overlap) { /* [m Ca rows of the window before | m Cb rows of this one] as [2m, hd] */
            float *pkv = buf, *pg = buf + 2 * m * hd;
            for (int64_t r = 0; r < m; r++)
                for (int64_t f = 0; f < hd; f++) {
                    pkv[r * hd + f] = has_prev ? wkv[(r - m) * W + f] : 0.0f;
                    pg[r * hd + f] = has_prev ? wg[(r - m) * W + f] : -INFINITY;
                    pkv[(m + r) * hd + f] = wkv[r * W + hd + f];
                    pg[(m + r) * hd + f] = wg[r * W + hd + f];
                }
            rc = compress_pool_run(isa, pkv, pg, c, 1, 2 * m, hd);
        } else {
            rc = compress_pool_run(isa, wkv, wg, c, 1, m, hd);
        }
        if (!rc) {
            rms_norm_rows(c, vn->b.buf, c, 1, hd, (float)eps);
            rope_rows(c, c, vc->b.buf, vs->b.buf, 1, hd, half, 1, 0);
            if (quant == QUANT_FP8_NOPE && hd > rope) act_quant_rows(isa, c, c, 1, hd - rope, 64);
            if (quant == QUANT_FP4_ROTATE) {
                hadamard_rows(c, c, 1, hd, (float)pow((double)hd, -0.5)); /* Python's hd ** -0.5 */
                fp4_quant_rows(c, c, 1, hd, 32);
            }
            if (out_kind == OUT_F32)
                memcpy((float *)vo->b.buf + out_row * hd, c, (size_t)hd * sizeof(float));
            else
                bad = state_rows_encode(c, (uint8_t *)vo->b.buf + out_row * B, 1, B, (int)out_kind, hd, rope);
        }
    }
    Py_END_ALLOW_THREADS
    free(buf);
    release(v, 8);
    if (rc) return PyErr_NoMemory();
    return PyBool_FromLong(bad < 0);
fail:
    free(buf);
    release(v, 8);
    return NULL;
}
