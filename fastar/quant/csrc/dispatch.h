/* The interface of dispatch.c and experts.c to the bindings: the ISA in use, CPU features, products run over the
 * pool with their path chosen per call, the activation ops of an ISA, and the fused routed experts. Internal to
 * the extension (kernels.h is what the kernel files share). None of these touch Python: they run with the GIL
 * released.
 */
#ifndef FASTAR_DISPATCH_H
#define FASTAR_DISPATCH_H

#include "kernels.h"

/* ---------------------------------------------------------------- ISA choice */

extern const isa_ops *cur_isa;          /* the ISA the bindings run (set_isa, FASTAR_ISA) */
extern const isa_ops *const all_isas[]; /* every table built here, best first */
extern const size_t n_isas;
extern const char *const cpu_feature_names[]; /* what cpu_has knows, for cpu_features() */
extern const size_t n_cpu_features;
int cpu_has(const char *feat);
int isa_usable(const isa_ops *isa); /* this CPU has every feature isa->needs */
const isa_ops *best_isa(void);      /* FASTAR_ISA's if usable, else the best usable */
void isas_init(void);               /* tables, every ISA's init, cur_isa = best_isa(): once, at import */

/* The ISA's activation ops, else the portable ones (fp8_act_quant_scalar, swiglu_rows). */
void act_quant_rows(const isa_ops *isa, const float *x, float *out, int64_t rows, int64_t K, int64_t block);
void swiglu_isa(const isa_ops *isa, const float *g, const float *u, float *out, int64_t n, float limit, float scale);

/* ---------------------------------------------------------------- products */

/* The path of a product: the FP32 kernels, the bf16 ones on exact x, or (dot path only) the bf16 ones on x split in
 * three (prep_job). For T > dot_max, PATH_BF16 is the ISA's bf16 tile path (isa_ops.tile_bf16). Decided once per
 * call from all of its x, so every token (and group) of a call takes the same. */
enum { PATH_FP32, PATH_BF16, PATH_SPLIT };

/* What prep_job allocated and changed in a job, for finish_job. */
typedef struct {
    mm_job *job;
    void *buf, *xs;
    float *out; /* the caller's out under PATH_SPLIT (the job writes 3T pseudo-token rows to a buffer) */
    int64_t T, ldo;
    int accumulate;
} prep_t;

/* fmt: '4' FP4, '8' FP8, 'b' BF16. */
int choose_path(const isa_ops *isa, char fmt, const float *x, int64_t T, int64_t K);
int prep_job(const isa_ops *isa, char fmt, int path, mm_job *job, prep_t *p);
void finish_job(prep_t *p, int ran);
int64_t chunk_rows(int64_t N); /* rows per pool chunk for N rows in all */
void run_jobs(rows_fn fn, const mm_job *jobs, int64_t n);
void empty_sum(mm_job *job); /* the product with K = 0 */
/* One product, and a grouped one (G groups, see fp4_matmul). Return 0, or -1 for out of memory. */
int product(const isa_ops *isa, char fmt, mm_job *job);
int grouped_product(const isa_ops *isa, char fmt, const mm_job *whole, int64_t G);
/* Either of the two (G = 1: product) on resident weights, as a stream of the weight readahead (readahead.c). */
int weights_product(const isa_ops *isa, char fmt, mm_job *job, int64_t G);

/* ---------------------------------------------------------------- the fused routed experts (experts.c) */

int experts_run(const isa_ops *isa, int64_t E, const uint8_t *const *ew, const float *x, int64_t D, int64_t I,
                const int64_t *rows, const int64_t *off, const float *rw, float limit, int64_t act_block, float *out);
/* A MoE layer's shared expert on T rows (experts.c). */
int shared_run(const isa_ops *isa, const float *x, int64_t T, int64_t D, int64_t I, char fmt13, const uint8_t *w13,
               const uint8_t *s13, char fmt2, const uint8_t *w2, const uint8_t *s2, float limit, int64_t act_block,
               float *out, int accumulate);

#endif
