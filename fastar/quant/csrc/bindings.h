/* What the binding files (bindings.c, bind_ops.c) share: a held buffer view and the argument checks on it, each of
 * which sets a clear Python error (TypeError for a wrong type or dtype, ValueError for a wrong shape, stride,
 * writability or overlap) and returns -1 on failure; and bind_ops.c's entry points for the method table.
 */
#ifndef FASTAR_BINDINGS_H
#define FASTAR_BINDINGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    Py_buffer b;
    int held;
} view_t;

void release(view_t *v, int n); /* the held views of v[0 .. n) */
/* A C-contiguous view of obj with numpy dtype code ('f' float32, 'd' float64, 'B' uint8, 'b' int8, 'H' uint16,
 * 'i' int32, 'q' int64), ndim dims. */
int get_view(PyObject *obj, view_t *v, const char *name, char code, int ndim, int writable);
static inline int64_t dim(const view_t *v, int i) { return (int64_t)v->b.shape[i]; }
int shape_is(const view_t *v, const char *name, int64_t a, int64_t b, const char *what); /* 2-D shape (a, b) */
/* An output is written while the inputs are read by other threads: refuse any overlap instead of racing. */
int no_overlap_named(const view_t *out, const char *name, const view_t *in, int n_in);
int no_overlap(const view_t *out, const view_t *in, int n_in); /* out named "out" */
/* A float32 input and a writable float32 output of the same 2-D shape that do not overlap (unless in_place allows
 * out to be the input itself). */
int get_in_out(PyObject *ox, PyObject *oo, view_t v[2], const char *in_name, int in_place);

/* bind_ops.c */
/* The bytes of a packed decode-state row of width W (kind STATE_FP8 with `rope` float32 dims, or STATE_FP4; state.py's
 * RowFormat), 0 for a bad kind / rope. */
int64_t packed_row_bytes(int kind, Py_ssize_t rope, int64_t W);
PyObject *py_fp8_act_quant(PyObject *self, PyObject *args);
PyObject *py_sinkhorn(PyObject *self, PyObject *args);
PyObject *py_rms_norm(PyObject *self, PyObject *args);
PyObject *py_rope(PyObject *self, PyObject *args);
PyObject *py_swiglu(PyObject *self, PyObject *args);
PyObject *py_hadamard(PyObject *self, PyObject *args);
PyObject *py_fp4_act_quant(PyObject *self, PyObject *args);
PyObject *py_hc_pre(PyObject *self, PyObject *args, PyObject *kw);
PyObject *py_hc_post(PyObject *self, PyObject *args, PyObject *kw);
/* bind_hc.c */
PyObject *py_hc_post_pre(PyObject *self, PyObject *args, PyObject *kw);
PyObject *py_attend(PyObject *self, PyObject *args, PyObject *kw);
PyObject *py_state_rows_decode(PyObject *self, PyObject *args);
PyObject *py_state_rows_encode(PyObject *self, PyObject *args);
PyObject *py_index_topk(PyObject *self, PyObject *args);
PyObject *py_compress_pool(PyObject *self, PyObject *args);
PyObject *py_index_scores(PyObject *self, PyObject *args);
PyObject *py_index_scores_fp4(PyObject *self, PyObject *args);

/* bind_blocks.c */
PyObject *py_attn_project(PyObject *self, PyObject *args);
PyObject *py_attn_output(PyObject *self, PyObject *args);
PyObject *py_index_queries(PyObject *self, PyObject *args);

/* bind_route.c */
PyObject *py_route_weights(PyObject *self, PyObject *args, PyObject *kw);
PyObject *py_sqrtsoftplus(PyObject *self, PyObject *args);
PyObject *py_embed_streams(PyObject *self, PyObject *args);

/* bind_compress.c */
PyObject *py_compress_row(PyObject *self, PyObject *args);

/* bind_attend.c */
PyObject *py_attend_stored(PyObject *self, PyObject *args);

/* bind_head_i8.c */
PyObject *py_head_i8_build(PyObject *self, PyObject *args);
PyObject *py_head_i8_dot(PyObject *self, PyObject *args);
PyObject *py_head_i8_select(PyObject *self, PyObject *args);
PyObject *py_head_i8_screen(PyObject *self, PyObject *args);
PyObject *py_head_i8_quantize(PyObject *self, PyObject *args);
PyObject *py_head_i8_path(PyObject *self, PyObject *args);
PyObject *py_gather_rows(PyObject *self, PyObject *args);
PyObject *py_head_i8_exact(PyObject *self, PyObject *args);

#endif
