/* Persistent pthread pool for fastar's kernels.
 *
 * Owns: the worker threads, job hand-off and completion. One job runs at a time (a mutex serializes callers
 * from different Python threads); the calling thread works on the job too, so 1 thread means no hand-off.
 * Workers spin briefly after a job (back-to-back kernel calls are the common case: a decode step is a product,
 * some Python, the next product), yielding the core to any other runnable thread (an expert read) as they go,
 * then sleep on a condition variable, so an idle pool costs no CPU. While it waits for a job, the first worker
 * prefetches the range readahead.c asks for (the next product's weights: the memory bus is idle between kernels); a
 * request wakes it if it sleeps.
 * Does not own: how work is split (callers pass chunk counts) or anything about the kernels.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T1) /* into L2: an L1 prefetch holds one of the few L1 miss buffers */
#define HAVE_MXCSR 1
#else
#define CPU_RELAX() ((void)0)
#define PREFETCH(p) __builtin_prefetch((p), 0, 2)
#define HAVE_MXCSR 0
#endif

#include "kernels.h"

#define MAX_THREADS 256
#define SPIN_NS 3000000 /* how long an idle worker polls for the next job before sleeping: longer than the
                              Python between two products of a decode step (attention and the MoE's bookkeeping
                              can take ~0.5 ms), so the next product starts at once: 3 ms measured 1% faster a
                              decode token than 0.3 ms (in-process A/B); it yields the core all along */

typedef struct {
    pthread_mutex_t run_mu;   /* held by the caller for a whole job: one job at a time */
    pthread_mutex_t mu;       /* protects the sleep/wake hand-off below */
    pthread_cond_t cv_work, cv_done;
    int nthreads;             /* including the caller */
    int nworkers;             /* started background threads = nthreads - 1 */
    pthread_t tids[MAX_THREADS];
    atomic_uint_fast64_t generation; /* bumped once per job */
    atomic_int shutdown;
    /* the current job */
    chunk_fn fn;
    void *ctx;
    atomic_int_fast64_t nchunks; /* relaxed: a worker reads it only after claiming by `next`, or to see none left */
    atomic_int_fast64_t next;  /* next chunk index to hand out */
    atomic_int_fast64_t done;  /* chunks of the current job finished */
    atomic_uint mxcsr;         /* the caller's float environment, so results match whoever calls; a worker
                                  applies it per claimed chunk (a late worker must not read it while the
                                  next job's caller writes it) */
} pool_t;

/* The idle-time prefetch (readahead.c asks for it): one range at a time, under a sequence lock (seq odd while
 * written). The first worker reads it while it waits for a job (woken for it from its sleep), and stops at the next
 * job or the next request; one the job interrupted resumes after it, at the offset where it stopped. */
static struct {
    atomic_uint_fast64_t seq;
    _Atomic(const char *) base;
    atomic_size_t bytes;
    atomic_uint_fast64_t done_bytes; /* prefetched in all, for tests and stats */
    atomic_int sleeping;             /* the prefetching worker waits on cv_work: a request wakes it */
} PF;

static pool_t P = {.run_mu = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER,
                   .cv_work = PTHREAD_COND_INITIALIZER, .cv_done = PTHREAD_COND_INITIALIZER,
                   .nthreads = 0};
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

/* Test hooks (`pool_test_delays`, zero in production): a background worker sleeps after each load of `next` in
 * run_chunks, and the caller sleeps after writing a job's fields and before publishing it, so a test can hold a
 * late worker inside the window where the previous job's claim counter meets the next job's fields. */
static atomic_int test_worker_us, test_caller_us;

void pool_test_delays(int worker_us, int caller_us) {
    atomic_store(&test_worker_us, worker_us > 0 ? worker_us : 0);
    atomic_store(&test_caller_us, caller_us > 0 ? caller_us : 0);
}

static void test_delay(atomic_int *us) {
    const int d = atomic_load_explicit(us, memory_order_relaxed);
    if (d) usleep((useconds_t)d);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* `next` packs the job's generation (high bits) with the next chunk index (low IDX_BITS), so a chunk is only ever
 * claimed for the job it belongs to. */
#define IDX_BITS 40
#define IDX_MASK ((1ll << IDX_BITS) - 1)

static int_fast64_t gen_tag(uint64_t gen) {
    return (int_fast64_t)((gen & ((1ull << (63 - IDX_BITS)) - 1)) << IDX_BITS);
}

/* Claims and runs chunks of job `gen` until none is left. The job is complete when every chunk is done, whoever
 * ran it: the caller never waits for a worker that took no chunk (one still waking up, or descheduled by another
 * process); a worker that comes late finds its job gone (another generation in `next`) and claims nothing. A
 * claim is a compare-and-swap, so a late worker never moves a newer job's counter. */
static void run_chunks(uint64_t gen, int worker) {
    const int_fast64_t tag = gen_tag(gen);
    int_fast64_t v = atomic_load(&P.next);
    for (;;) {
        if ((v & ~IDX_MASK) != tag || (v & IDX_MASK) >= atomic_load_explicit(&P.nchunks, memory_order_relaxed))
            break; /* another job's, or none left */
        if (!atomic_compare_exchange_weak(&P.next, &v, v + 1)) continue;  /* v reloaded */
        const int64_t n = atomic_load_explicit(&P.nchunks, memory_order_relaxed); /* fixed while this chunk is out */
#if HAVE_MXCSR
        if (worker) {
            const unsigned csr = atomic_load_explicit(&P.mxcsr, memory_order_relaxed); /* this job's: set before open */
            if (csr != _mm_getcsr()) _mm_setcsr(csr);
        }
#endif
        P.fn(P.ctx, v & IDX_MASK);
        if (atomic_fetch_add(&P.done, 1) + 1 == n) { /* the last chunk: wake the caller if it sleeps */
            pthread_mutex_lock(&P.mu);
            pthread_cond_signal(&P.cv_done);
            pthread_mutex_unlock(&P.mu);
        }
        v = atomic_load(&P.next);
        if (worker) test_delay(&test_worker_us); /* a late worker: it read `next` and now waits to check it */
    }
}

void pool_prefetch(const void *p, size_t bytes) {
    if (P.nworkers == 0) return;
    const uint_fast64_t s = atomic_load_explicit(&PF.seq, memory_order_relaxed);
    atomic_store(&PF.seq, s + 1); /* odd: being written (one writer: readahead.c's lock) */
    atomic_store(&PF.base, (const char *)p);
    atomic_store(&PF.bytes, p ? bytes : 0);
    atomic_store(&PF.seq, s + 2);
    if (p && bytes && atomic_load(&PF.sleeping)) { /* it went to sleep after a long pause between jobs: wake it */
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.cv_work);
        pthread_mutex_unlock(&P.mu);
    }
}

uint64_t pool_prefetched_bytes(void) { return atomic_load(&PF.done_bytes); }

typedef struct {
    uint_fast64_t seq; /* the request this worker works on */
    const char *base;
    size_t at, bytes;  /* prefetched so far, of bytes */
} pf_state;

/* Prefetches some of the current request while the generation stays `seen`; 1 if it did any work. */
static int prefetch_some(pf_state *st, uint64_t seen) {
    const uint_fast64_t s = atomic_load(&PF.seq);
    if (s & 1) return 0;
    if (s != st->seq) { /* a new request: read it whole, or wait for the next look */
        const char *b = atomic_load(&PF.base);
        const size_t n = atomic_load(&PF.bytes);
        if (atomic_load(&PF.seq) != s) return 0;
        *st = (pf_state){.seq = s, .base = b, .at = 0, .bytes = n};
    }
    if (st->at >= st->bytes) return 0;
    const size_t start = st->at;
    while (st->at < st->bytes) { /* 4 KB at a time, then look for a job or a newer request */
        const size_t end = st->at + 4096 < st->bytes ? st->at + 4096 : st->bytes;
        for (size_t o = st->at; o < end; o += 64) PREFETCH(st->base + o);
        st->at = end;
        if (atomic_load_explicit(&P.generation, memory_order_relaxed) != seen ||
            atomic_load_explicit(&PF.seq, memory_order_relaxed) != st->seq || atomic_load(&P.shutdown))
            break;
    }
    atomic_fetch_add_explicit(&PF.done_bytes, st->at - start, memory_order_relaxed);
    return 1;
}

typedef struct {
    uint64_t gen0; /* the generation at creation: a job posted before this thread first runs must still be seen
                      as new */
    int prefetcher; /* this worker does the idle-time prefetch (the first one) */
} worker_arg;

static worker_arg worker_args[MAX_THREADS];

static void *worker_main(void *arg) {
    const worker_arg *a = arg;
    uint64_t seen = a->gen0;
    pf_state pf = {.seq = 0};
    for (;;) {
        /* spin a little, then sleep until the generation moves */
        int64_t t0 = now_ns();
        int spins = 0;
        while (atomic_load_explicit(&P.generation, memory_order_acquire) == seen && !atomic_load(&P.shutdown)) {
            if (a->prefetcher && prefetch_some(&pf, seen)) continue;
            CPU_RELAX();
            if (++spins % 64 == 0) sched_yield(); /* a runnable thread (an expert read's) gets the core at once */
            if (spins % 64 == 0 && now_ns() - t0 > SPIN_NS) {
                pthread_mutex_lock(&P.mu);
                /* the prefetcher also wakes for a new prefetch request: `sleeping` is set before the request's
                 * sequence is read here and the request's writer reads `sleeping` after publishing it (both
                 * sequentially consistent), so either this sees the request or its writer sees `sleeping` */
                if (a->prefetcher) atomic_store(&PF.sleeping, 1);
                while (atomic_load(&P.generation) == seen && !atomic_load(&P.shutdown) &&
                       !(a->prefetcher && atomic_load(&PF.seq) != pf.seq))
                    pthread_cond_wait(&P.cv_work, &P.mu);
                if (a->prefetcher) atomic_store(&PF.sleeping, 0);
                pthread_mutex_unlock(&P.mu);
            }
        }
        if (atomic_load(&P.shutdown)) return NULL;
        seen = atomic_load(&P.generation);
        run_chunks(seen, 1);
    }
}

static void stop_workers(void) {
    if (P.nworkers == 0) return;
    pthread_mutex_lock(&P.mu);
    atomic_store(&P.shutdown, 1);
    pthread_cond_broadcast(&P.cv_work);
    pthread_mutex_unlock(&P.mu);
    for (int i = 0; i < P.nworkers; i++) pthread_join(P.tids[i], NULL);
    P.nworkers = 0;
    atomic_store(&P.shutdown, 0);
}

/* A forked child has none of the parent's workers: start again from one thread (re-grown on demand). */
static void atfork_child(void) {
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c = PTHREAD_COND_INITIALIZER;
    P.run_mu = m;
    P.mu = m;
    P.cv_work = c;
    P.cv_done = c;
    P.nworkers = 0;
    atomic_store(&P.shutdown, 0);
}
static void register_atfork(void) { pthread_atfork(NULL, NULL, atfork_child); }

int pool_default_threads(void) {
    const char *env = getenv("FASTAR_THREADS");
    if (env && *env) {
        int n = atoi(env);
        if (n >= 1) return n > MAX_THREADS ? MAX_THREADS : n;
    }
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n >= 1) return n > MAX_THREADS ? MAX_THREADS : n;
    }
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (n > MAX_THREADS ? MAX_THREADS : (int)n);
}

/* Caller holds run_mu. Starts exactly n-1 workers. */
static int start_locked(int n) {
    pthread_once(&atfork_once, register_atfork);
    stop_workers();
    P.nthreads = 1;
    const uint64_t gen0 = atomic_load(&P.generation);
    for (int i = 0; i < n - 1; i++) {
        worker_args[i] = (worker_arg){.gen0 = gen0, .prefetcher = i == 0};
        if (pthread_create(&P.tids[i], NULL, worker_main, &worker_args[i]) != 0) break;
        P.nworkers++;
    }
    P.nthreads = P.nworkers + 1;
    return P.nthreads == n ? 0 : -1;
}

int pool_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    pthread_mutex_lock(&P.run_mu);
    int rc = start_locked(n);
    pthread_mutex_unlock(&P.run_mu);
    return rc;
}

int pool_get_threads(void) {
    return P.nthreads > 0 ? P.nthreads : pool_default_threads();
}

void pool_run(int64_t nchunks, chunk_fn fn, void *ctx) {
    if (nchunks <= 0) return;
    pthread_mutex_lock(&P.run_mu);
    if (P.nthreads == 0 || (P.nworkers == 0 && P.nthreads > 1)) start_locked(pool_default_threads());
    if (P.nworkers == 0 || nchunks == 1) {
        pthread_mutex_unlock(&P.run_mu); /* nothing shared: let other callers run concurrently */
        for (int64_t i = 0; i < nchunks; i++) fn(ctx, i);
        return;
    }
    const uint64_t gen = atomic_load(&P.generation) + 1;
    /* Close the claim counter before touching the job's fields. A worker can still be inside run_chunks for the
     * previous job, holding a `next` value it loaded when that job was exhausted (index = its chunk count); if it
     * then read this job's larger nchunks, its check would pass and, with `next` unchanged, its compare-and-swap
     * would claim a chunk of the OLD generation and run it with THIS job's fn and ctx: a chunk run twice and
     * counted into this job's `done`, so the job could end while one of its chunks was still running (wrong
     * numbers in a few rows, now and then, under load). With `next` moved to this generation's closed value
     * first, every claim made with a value loaded before fails. */
    atomic_store(&P.next, gen_tag(gen) | IDX_MASK);
    P.fn = fn;
    P.ctx = ctx;
    atomic_store_explicit(&P.nchunks, nchunks, memory_order_relaxed);
    atomic_store(&P.done, 0);
#if HAVE_MXCSR
    atomic_store_explicit(&P.mxcsr, _mm_getcsr(), memory_order_relaxed);
#endif
    test_delay(&test_caller_us);
    /* open, after fn, ctx, nchunks and done: whoever claims a chunk of this generation sees them all */
    atomic_store(&P.next, gen_tag(gen));
    pthread_mutex_lock(&P.mu);
    atomic_store_explicit(&P.generation, gen, memory_order_release);
    pthread_cond_broadcast(&P.cv_work);
    pthread_mutex_unlock(&P.mu);

    run_chunks(gen, 0);

    int64_t t0 = now_ns();
    int spins = 0;
    while (atomic_load_explicit(&P.done, memory_order_acquire) < nchunks) { /* chunks still running elsewhere */
        CPU_RELAX();
        if (++spins % 64 == 0) sched_yield(); /* a worker waiting for a core gets this one */
        if (spins % 64 == 0 && now_ns() - t0 > SPIN_NS) {
            pthread_mutex_lock(&P.mu);
            while (atomic_load(&P.done) < nchunks) pthread_cond_wait(&P.cv_done, &P.mu);
            pthread_mutex_unlock(&P.mu);
        }
    }
    pthread_mutex_unlock(&P.run_mu);
}
