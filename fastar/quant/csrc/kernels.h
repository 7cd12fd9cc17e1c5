/* Shared declarations of fastar's CPU kernels (extension fastar.quant._kernels).
 *
 * Owns: the job description every product kernel takes (mm_job), the per-ISA kernel table (isa_ops), the
 * lookup tables shared by all ISAs, and the thread-pool interface.
 * Layout of the sources:
 *   bindings.c     the Python module: method table, init, the argument checks every binding uses (bindings.h),
 *                  the bindings of the weight products and the fused routed experts, threads / ISA / features, the
 *                  benchmark's machine probes
 *   bind_ops.c     bindings of the activation, row, mHC and attention ops
 *   bind_blocks.c  the attention block's decode-time projections and output, one call each
 *   bind_compress.c  a compressor's decode step on one token (rows stored, a closed window pooled and stored)
 *   bind_attend.c  a decode query's attention over its state's stored (packed) rows
 *   bind_head_i8.c the int8 screened LM head's build, products and row gather
 *   dispatch.c     CPU features, the list of ISA tables and the choice among them, the per-call path of a product
 *                  (x_kind), job preparation, splitting rows across the pool (dispatch.h: its interface)
 *   experts.c      the fused routed experts of a layer (experts_run)
 *   pool.c         persistent pthread pool (callers run one job at a time; the caller works too)
 *   kern_scalar.c  portable C kernels (vector extensions, no intrinsics): every CPU's fallback, the tables, the FP8
 *                  activation quantization
 *   kern_avx2.c    AVX2+FMA+F16C kernels (compiled with a target pragma, picked at run time)
 *   kern_avx512.c  AVX-512 F/BW/VL kernels (same); kern_avx512.h: helpers both AVX-512 files share
 *   kern_avx512bf16.c  AVX512_BF16 dot path for FP4 / FP8 when x is bfloat16-exact (falls back to kern_avx512.c)
 *   kern_neon.c    AArch64 ASIMD + FMA kernels (no target needed: ASIMD is baseline there)
 *   kern_neonbf16.c  AArch64 FEAT_BF16 dot path for FP4 / FP8 when x is bfloat16-exact (falls back to kern_neon.c)
 *   gemm_avx512bf16.c  AVX512_BF16 tile path (prefill GEMM) for FP4 / FP8 when x is bfloat16-exact
 *   mhc.c          the hyper-connections (mHC) of a layer site and the final head, and their Sinkhorn
 *   attn.c         DeepSeek-V4 attention with sinks: plain C, AVX2 and AVX-512 kernels in one file (attn_run)
 *   attn_neon.c    its AArch64 NEON kernel
 *   exp_neon.h     the one NEON exp (attention softmax, SwiGLU)
 *   head_i8.c      the int8 copy of the LM head that screens greedy decoding: its build, its exact int32 products
 *                  (portable, AVX2 and AVX-512 VNNI in one file), the gather of candidate rows (head_i8.h)
 *   rowops.c       row-wise ops of the forward pass: RMS norm, interleaved RoPE, the portable SwiGLU
 *   simd.h         what the SIMD code shares: INLINE, UNROLL, function targets, the dot-path driver
 *   exp512.h       the one AVX-512 exp (attention softmax, SwiGLU)
 * An architecture's kernel files compile to nothing elsewhere (FASTAR_X86, FASTAR_ARM64 below); its tables are listed once, in
 * dispatch.c.
 * Weight layouts are the checkpoint's (see fastar/quant/reference.py): FP4 [N, K/2] + UE8M0 [N, K/32];
 * FP8 e4m3 [N, K] + UE8M0 [ceil(N/128), ceil(K/128)]; BF16 bit patterns [N, K]. Outputs are float32.
 */
#ifndef FASTAR_KERNELS_H
#define FASTAR_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* The architecture whose SIMD kernels this build compiles in (GCC / clang: they need its target attributes).
 * -DFASTAR_X86=0 builds the portable kernels alone, as on an architecture with no SIMD files. */
#ifndef FASTAR_X86
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define FASTAR_X86 1
#else
#define FASTAR_X86 0
#endif
#endif
/* Likewise for AArch64 (ASIMD is part of the base architecture; -DFASTAR_ARM64=0 builds the portable kernels alone). */
#ifndef FASTAR_ARM64
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define FASTAR_ARM64 1
#else
#define FASTAR_ARM64 0
#endif
#endif

#define FP4_GROUP 32  /* columns per FP4 scale */
#define FP8_BLOCK 128 /* rows and columns per FP8 scale */
#define XP_CHUNK 128  /* the dot path permutes activations in chunks of this many columns */
#define TILE_XG 12    /* the bf16 tile path's x: tokens per group, pair-major within a group (see mm_job.xb) */
#define ROW_ALIGN 32  /* row chunks handed to threads start at multiples of this (>= every tile height) */

/* One product out[t, n] (+)= sum_k x[t, k] * W[n, k] over rows n in [n0, n1) (the rows a thread owns). */
typedef struct {
    const float *x;     /* [T, K] activations, row-major */
    const float *xp;    /* [T, kp] x with columns permuted per XP_CHUNK for the dot path (NULL: use x or xb) */
    const uint16_t *xb; /* [T, kp] x as bfloat16 bits, permuted per XP_CHUNK for the bf16 dot path (NULL: use xp);
                         * the bf16 tile path (dot 0): [ceil(T / TILE_XG)][kp / 2][TILE_XG] bfloat16 pairs (x[t, 2p],
                         * x[t, 2p+1]) as uint32, the tokens of a group side by side per pair, zero padded past K */
    int64_t kp;         /* row stride of xp / xb (K rounded up to XP_CHUNK, zero padded); tile path: see xb */
    const void *w;      /* FP4 bytes [N, K/2] | FP8 bytes [N, K] | BF16 uint16 [N, K] */
    const uint8_t *s;   /* FP4 [N, K/32] | FP8 [ceil(N/128), ceil(K/128)] | NULL */
    int64_t T, N, K;
    float *out;         /* out[t * ldo + n] */
    int64_t ldo;
    int accumulate;     /* 1: out += x W^T; 0: out = x W^T */
    int dot;            /* 1: use the dot path (T <= the ISA's dot_max); 0: the tile path */
    int x_tiny;         /* bf16 tile path (xb set, dot 0): some nonzero x is below 2^-64 (no FP4 scale folding) */
} mm_job;

typedef void (*rows_fn)(const mm_job *j, int64_t n0, int64_t n1);

/* The register family of an ISA: which variant attn.c and mhc.c run for it. */
typedef enum { VEC_PORTABLE, VEC_AVX2, VEC_AVX512, VEC_NEON } isa_vec;

/* Everything one instruction set provides. The dot path (T <= dot_max) streams weights once per row with
 * all tokens in registers; larger T dequantizes a tile into L1 and reuses it across tokens. */
typedef struct {
    const char *name;
    const char *needs;  /* the CPU features it runs on, space-separated names of dispatch.c's cpu_has ("": any) */
    isa_vec vec;
    void (*init)(void); /* fills the column maps below; called once */
    int dot_max;
    rows_fn fp4, fp8, bf16;
    /* Column order the dot path wants per XP_CHUNK columns: xp[c0 + i] = x[c0 + map[i]] (NULL: natural). */
    const uint8_t *fp4_map, *fp8_map, *bf16_map;
    /* The bf16 dot path's column order, xb[c0 + i] = x[c0 + bmap[i]] as bfloat16 (NULL: no such path). dispatch.c
     * hands a product x this way (xb set, xp NULL) only when every x is an exact bfloat16 (see x_kind). */
    const uint8_t *fp4_bmap, *fp8_bmap;
    /* 1: the FP4 / FP8 kernels also take bfloat16 x for T > dot_max (the tile path on vdpbf16ps): dispatch.c then
     * hands a call whose x is all bfloat16-exact as mm_job.xb in its tile layout (see xb) with dot = 0. An AMX-BF16
     * ISA would set this too, with its own tile kernels behind fp4 / fp8. */
    int tile_bf16;
    double (*fma_loop)(int64_t iters); /* returns the flops it executed (FP32 peak benchmark) */
    double (*read_sum)(const uint8_t *p, size_t n); /* streams n bytes (n % 64 == 0), returns a checksum */
    /* Activation ops (NULL: the portable ones): fp8_act_quant_scalar's twin, bit for bit; and
     * out = silu(min(g, l)) * clamp(u, -l, l) * scale (out may be g). */
    void (*act_quant)(const float *x, float *out, int64_t rows, int64_t K, int64_t block);
    void (*swiglu)(const float *g, const float *u, float *out, int64_t n, float limit, float scale);
    /* The dot path's preparation of x, vectorized (NULL: dispatch.c's portable loops, the same results).
     * x_scan: n floats -> X_SCAN_* bits, each set when some x has it (dispatch.c's x_kind reads them).
     * x_bf16: rows t < T of x (ld floats apart, K used) as bfloat16 bits (the high halves) in bmap's column order per
     * XP_CHUNK columns, dst[t * kp + c0 + i] = x[t * ld + c0 + bmap[i]], zero past K; dst 64-byte aligned. */
    unsigned (*x_scan)(const float *x, int64_t n);
    void (*x_bf16)(const uint8_t *bmap, const float *x, int64_t T, int64_t K, int64_t ld, uint16_t *dst, int64_t kp);
} isa_ops;

/* x_scan's bits: a nonzero low half (not a bfloat16), a nonzero |x| outside [2^-110, 2^65) (exponent field outside
 * [17, 191]: not X_EXACT's range), and outside [2^-94, 2^65) ([33, 191]: not X_SPLIT's). */
#define X_SCAN_INEXACT 1u
#define X_SCAN_OUT_EXACT 2u
#define X_SCAN_OUT_SPLIT 4u

/* gemm_avx512bf16.c: the bf16 tile path's tables and row kernels (x: mm_job.xb in its tile layout; stubs
 * where FASTAR_X86 is 0, never called there since no ISA table sets tile_bf16). */
void gemm_bf16_init(void);
void fp4_tile_bf16_rows(const mm_job *j, int64_t n0, int64_t n1);
void fp8_tile_bf16_rows(const mm_job *j, int64_t n0, int64_t n1);
double bf16_dot_loop(int64_t iters); /* vdpbf16ps peak probe: returns the flops it executed */

/* The ISA tables built on this architecture (dispatch.c lists them, best first). */
extern const isa_ops isa_scalar_ops;
#if FASTAR_X86
extern const isa_ops isa_avx2_ops;
extern const isa_ops isa_avx512_ops;
extern const isa_ops isa_avx512bf16_ops;
#endif
#if FASTAR_ARM64
extern const isa_ops isa_neon_ops;
extern const isa_ops isa_neonbf16_ops;
#endif

/* 1 (the default): the FP8 bf16 dot path folds the weight scales into x where it can (kern_avx512bf16.c); 0: it
 * applies them per 128-column block. A test and A/B knob (bindings.c's _fp8_fold), defined in dispatch.c. */
extern int fp8_fold;
/* 1 (default): the dot path's x scan and bfloat16 copy take the ISA's x_scan / x_bf16 where it has them; 0: dispatch.c's
 * portable loops, their reference. A test knob (bindings.c's _x_prep_isa), defined in dispatch.c. */
extern int x_prep_isa;

/* Tables, filled once by tables_init(). */
extern float ue8m0_f32[256]; /* 2^(b-127); b=0 is the denormal 2^-127, b=255 is NaN */
extern float fp8_f32[256];   /* e4m3fn value of each byte (0x7f, 0xff are NaN) */
extern const float fp4_f32[16];
void tables_init(void);

/* Softmax attention with per-head sinks over a query's window keys and compressed entries (attn.c says what it
 * computes). Each (query, head) sums in one order that depends only on what that query sees. */
typedef struct {
    const float *q;      /* [T, H, D] */
    const float *keys;   /* [K, D]: window rows, keys[i] at position k0 + i */
    const float *comp;   /* [E, D] compressed entries, or NULL */
    const int64_t *idx;  /* [T, k] entries picked per query (< 0: none; each < E), or NULL: all closed ones */
    const float *sinks;  /* [H] */
    float *out;          /* [T, H, D] */
    int64_t T, H, D, K, E, k;
    int64_t k0, p0, window, ratio; /* query t is at position p0 + t; ratio >= 1 when comp is set and idx is not */
    float scale;
} attn_job;
/* Runs a job over the pool with the kernel of isa->vec. Returns 0, or -1 for out of memory. */
int attn_run(const isa_ops *isa, const attn_job *j);
#if FASTAR_ARM64
/* attn_neon.c: attn_run's NEON kernel, hb heads of one query (q [hb, D]) against rows[0..n); s [hb, n] scratch. */
void attn_heads_neon(const float *const *rows, int64_t n, const float *q, int hb, int64_t D, float scale,
                     const float *sinks, float *s, float *out);
#endif

/* Packed decode-state rows (attn_prefill.c; the layouts are fastar/model/state.py's): rows of row_bytes bytes ->
 * float32 rows of width values. STATE_FP8 keeps the last `rope` values as float32. state_rows_init fills the
 * e4m3 table once (module init). */
enum { STATE_FP8 = 0, STATE_FP4 = 1 };
void state_rows_init(void);
void state_rows_decode(const uint8_t *raw, float *out, int64_t rows, int64_t row_bytes, int kind, int64_t width,
                       int64_t rope);
/* The same over the pool in blocks of rows where they hold at least 2^16 values (bit-identical: rows are
 * independent). */
void state_rows_decode_pool(const uint8_t *raw, float *out, int64_t rows, int64_t row_bytes, int kind, int64_t width,
                            int64_t rope);
/* The inverse, exactly: -1, or the first row that is not exactly codes * scales (nothing is rounded). */
int64_t state_rows_encode(const float *x, uint8_t *raw, int64_t rows, int64_t row_bytes, int kind, int64_t width,
                          int64_t rope);

/* The lightning indexer's scores of T queries over E index keys (attn_prefill.c says what it computes). */
typedef struct {
    const float *q;    /* [T, Hi, Di] index queries */
    const float *w;    /* [T, Hi] head weights */
    const float *keys; /* [E, Di] index keys, or NULL with: */
    const uint8_t *packed; /* [E, 17 Di / 32] the keys as the decode state stores them (state_rows_decode's "fp4") */
    float *out;        /* [T, E]: -inf where query t (at position p0 + t) does not see entry e yet */
    int64_t T, Hi, Di, E, p0;
    float scale;
    int bf16; /* the caller declares q and keys bfloat16-exact (FP4-rounded): checked, then vdpbf16ps where it runs */
} index_job;
/* Runs a job over the pool: 0, -1 for out of memory, 1 when isa has no kernel for it (AVX-512 only; packed keys:
 * the bf16 kernel only), -2 when bf16 is declared but some q or key is not a bfloat16. */
int index_scores_run(const isa_ops *isa, const index_job *j);
/* The indexer's top-k: out [T, k] = the k best-scored entries each query sees (score [T, E]), ascending, then -1
 * (attn_prefill.c says how ties go). 0, or -1 for out of memory. */
int index_topk_run(const float *score, int64_t *out, int64_t T, int64_t E, int64_t k, int64_t p0);
/* The compressor's pooling of n windows of M rows: out [n, hd] from kv, gate [n, M, hd] (attn_prefill.c). 0, or
 * -1 for out of memory. */
int compress_pool_run(const isa_ops *isa, const float *kv, const float *gate, float *out, int64_t n, int64_t M,
                      int64_t hd);

/* Thread pool. pool_run calls fn(ctx, i) once for every i in [0, nchunks), spread over the pool's threads
 * (the caller included); chunks are handed out dynamically so a descheduled thread delays only its own. */
typedef void (*chunk_fn)(void *ctx, int64_t i);
int pool_set_threads(int n);  /* 0 on success */
int pool_get_threads(void);
int pool_default_threads(void);
void pool_run(int64_t nchunks, chunk_fn fn, void *ctx);
void pool_test_delays(int worker_us, int caller_us); /* test hooks: see pool.c */
/* Idle-time prefetch: the pool's first worker prefetches [p, p + bytes) while it waits for the next job (p NULL:
 * stop); pool_prefetched_bytes counts what it prefetched in all. */
void pool_prefetch(const void *p, size_t bytes);
uint64_t pool_prefetched_bytes(void);

/* Weight readahead (readahead.c): a product of resident weights w (bytes of them) tells it when it begins and ends,
 * and the start of the product that followed it last time is prefetched at its end. stable 0: weights that change
 * from step to step (routed experts). */
void readahead_begin(const void *w, size_t bytes, int stable);
void readahead_end(const void *w, size_t bytes);
void readahead_stats(uint64_t *predicted, uint64_t *prefetched_bytes);
size_t readahead_set_cap(size_t bytes); /* the most bytes of a stream prefetched (0: off); returns the previous */

/* DeepSeek's FP8 activation quant-dequant per `block` values of each row (kern_scalar.c; out may be x). */
void fp8_act_quant_scalar(const float *x, float *out, int64_t rows, int64_t K, int64_t block);
/* Its second half: n values quantized with the block's scale s = 2^e and inv = 2^-e (a SIMD twin's ragged end). */
void fp8_act_quant_tail(const float *xb, float *ob, int64_t n, float s, float inv);

/* Row-wise ops of the forward pass (rowops.c); see fastar/model/ops.py for the math. */
void rms_norm_rows(const float *x, const float *w, float *y, int64_t R, int64_t K, float eps);
void rope_rows(const float *x, float *y, const float *cos, const float *sin, int64_t R, int64_t D, int64_t half,
               int64_t rows_per_token, int inverse);
void bf16_round_rows(float *x, int64_t n);
void swiglu_rows(const float *gate, const float *up, float *y, int64_t n, float limit, float scale);
/* Orthonormal Walsh-Hadamard transform of each row (n a power of two, Sylvester order), then times scale (y may be
 * x); and DeepSeek's FP4 activation rounding per block of a row (e2m1 times a power-of-two scale, as
 * fastar.model.ops.fp4_quant_sim; y may be x). */
void hadamard_rows(const float *x, float *y, int64_t R, int64_t n, float scale);
void fp4_quant_rows(const float *x, float *y, int64_t R, int64_t K, int64_t block);

/* The MoE router's weights (route.c): out [T, k] = the scores [T, E] at the picked experts idx [T, k]
 * (k <= ROUTE_MAX_K), each divided by its row's total (summed in torch's order for a short row; plus eps where
 * eps != 0) and times scale. 0, or 1 + the position in idx of an expert id outside [0, E). */
#define ROUTE_MAX_K 7
int route_weights_rows(const float *scores, int64_t T, int64_t E, const int64_t *idx, int64_t k, float eps, float scale,
                       float *out);
/* out[i] = sqrt(softplus(x[i])) as torch's scalar code computes it (out may be x); and a scored layer's top-k: idx
 * [T, k] (k <= min(E, ROUTE_MAX_K)) the k largest of scores [T, E] + bias [E] per row, descending, a tie to the lower
 * id, NaN first (route.c). */
void sqrtsoftplus_rows(const float *x, int64_t n, float *out);
void route_topk_rows(const float *scores, const float *bias, int64_t T, int64_t E, int64_t k, int64_t *idx);
/* each row of idx [T, k] in ascending order with its weights w [T, k] alongside (a stable sort) (route.c) */
void route_by_expert_rows(int64_t *idx, float *w, int64_t T, int64_t k);

/* mHC (mhc.c); arrays float32, row-major, checked by the caller; the SIMD variant follows isa.
 * hc_pre_run: streams x [T, n*d] and fn [R, n*d] (R = (2+n)*n, or n for the head) -> u [T, d], post [T, n] and
 * comb [T, n*n] (these two not for the head); base [R], scale [3] ([1] for the head). Returns 0, -1 for out of
 * memory. hc_post_run: out [T, n*d] from f [T, d], x [T, n*d], post [T, n], comb [T, n*n]. */
int hc_pre_run(const isa_ops *isa, const float *x, const float *fn, const float *base, const float *scale, int64_t T,
               int n, int64_t d, int head, int iters, float hc_eps, float eps, float *u, float *post, float *comb);
void hc_post_run(const isa_ops *isa, const float *f, const float *x, const float *post, const float *comb, int64_t T,
                 int n, int64_t d, float *out);
void sinkhorn_rows(const float *in, float *out, int64_t B, int n, int iters, float eps); /* B matrices [n, n] */

#endif
