/* Weight readahead: the next product's weights read into the caches while the calling thread is between kernels.
 *
 * A decode step is a fixed sequence of weight products (a layer's attention projections, its shared expert, its
 * routed experts, ..., the LM head) with Python, norms, attention and routing between them. At one token every
 * product streams its weights at the memory's speed, and between two products the memory bus idles while the
 * calling thread runs the glue and the pool's worker spins. Here each product of resident weights is a "stream":
 * the stream that followed it last time is remembered, and when a stream ends, the idle worker is asked to prefetch
 * the start of the stream predicted next (pool_prefetch) until the next pool job arrives. The product that then
 * starts finds its first rows in L2 / L3 instead of DRAM. Nothing is computed from the prefetched lines (prefetch
 * instructions never fault and change no data), so every result is the same bits with or without it; a wrong guess
 * costs only memory traffic while the bus is idle.
 *
 * Streams are stable (the same weights each step: the dense products, the LM head) or volatile (the routed experts,
 * whose weights change with the routing). A volatile stream is never a key: the one predicted after it is the one
 * that followed the last stable stream, and a stable stream followed by a volatile one last time prefetches nothing
 * (its successor's weights are unknown until the routing). Products under READAHEAD_MIN bytes (routers, the head's
 * candidate rows) are no streams at all: their weights are few, and a buffer made per call would only pollute the
 * table.
 *
 * Owns: the table of successors (direct-mapped on the weights' address: a collision overwrites) and what the next
 * prefetch is. Does not own: the prefetch itself (pool.c's worker), when a product runs (its caller).
 * FASTAR_READAHEAD_MB (read once; `readahead_set_cap` changes it at run time, for tests and A/B runs) caps how much
 * of a stream's start is prefetched: 0 turns readahead off.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

#define TABLE 4096                      /* entries: a 43-layer model has ~10 streams a layer */
#define READAHEAD_MIN ((size_t)1 << 20) /* smaller products are no streams */
#define DEFAULT_MB 8                    /* a quarter of a 32 MB L3: what ~0.3 ms of glue can read */

typedef struct {
    const void *key;  /* a stable stream's weights */
    const void *next; /* the stable stream that followed it last time */
    size_t next_bytes;
    int volatile_next; /* a volatile stream came between them last time: nothing to prefetch at its end */
} entry_t;

static struct {
    pthread_mutex_t mu;
    entry_t table[TABLE];
    const void *last;     /* the last stable stream begun */
    int volatile_since;   /* a volatile stream began since `last` */
    int current_volatile; /* the stream running now is volatile */
    size_t cap;           /* bytes prefetched at most (FASTAR_READAHEAD_MB) */
    int cap_read;
    uint64_t predicted;   /* prefetches requested */
} L = {.mu = PTHREAD_MUTEX_INITIALIZER};

static entry_t *slot(const void *key) {
    const uintptr_t h = ((uintptr_t)key >> 6) * 0x9E3779B97F4A7C15ull;
    return &L.table[(h >> 40) % TABLE];
}

static size_t cap_locked(void) {
    if (!L.cap_read) {
        const char *env = getenv("FASTAR_READAHEAD_MB");
        const long mb = env && *env ? atol(env) : DEFAULT_MB;
        L.cap = mb > 0 ? (size_t)mb << 20 : 0;
        L.cap_read = 1;
    }
    return L.cap;
}

void readahead_begin(const void *w, size_t bytes, int stable) {
    if (bytes < READAHEAD_MIN) return;
    pthread_mutex_lock(&L.mu);
    if (cap_locked()) {
        pool_prefetch(NULL, 0); /* whatever was being prefetched is this stream's or a wrong guess: stop */
        if (stable) {
            if (L.last) {
                entry_t *e = slot(L.last);
                *e = (entry_t){.key = L.last, .next = w, .next_bytes = bytes, .volatile_next = L.volatile_since};
            }
            L.last = w, L.volatile_since = 0;
        } else {
            L.volatile_since = 1;
        }
        L.current_volatile = !stable;
    }
    pthread_mutex_unlock(&L.mu);
}

void readahead_end(const void *w, size_t bytes) {
    if (bytes < READAHEAD_MIN) return;
    pthread_mutex_lock(&L.mu);
    const size_t cap = cap_locked();
    if (cap && L.last && (L.current_volatile || L.last == w)) {
        const entry_t *e = slot(L.last);
        if (e->key == L.last && e->next && (L.current_volatile || !e->volatile_next)) {
            pool_prefetch(e->next, e->next_bytes < cap ? e->next_bytes : cap);
            L.predicted++;
        }
    }
    pthread_mutex_unlock(&L.mu);
}

size_t readahead_set_cap(size_t bytes) {
    pthread_mutex_lock(&L.mu);
    const size_t was = cap_locked();
    L.cap = bytes;
    if (!bytes) pool_prefetch(NULL, 0);
    pthread_mutex_unlock(&L.mu);
    return was;
}

void readahead_stats(uint64_t *predicted, uint64_t *prefetched_bytes) {
    pthread_mutex_lock(&L.mu);
    *predicted = L.predicted;
    pthread_mutex_unlock(&L.mu);
    *prefetched_bytes = pool_prefetched_bytes();
}
