/* Stress test of the kernel thread pool (fastar/quant/csrc/pool.c), built alone with ThreadSanitizer by
 * tests/test_pool_tsan.py: many small jobs of changing sizes, jobs posted while workers are still starting (the
 * pool resized between jobs), jobs with the race-widening test hooks on, jobs in a forked child, and idle-time
 * prefetch requests (pool_prefetch) posted and cancelled between jobs. Every job checks that each chunk ran exactly
 * once before pool_run returned. Exit status 0 and no ThreadSanitizer report is a pass. */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kernels.h"

typedef struct {
    atomic_int counts[512];
    int work;
    volatile double sink[512];
} job_t;

static void chunk(void *p, int64_t i) {
    job_t *j = p;
    double s = 0;
    for (int k = 0; k < j->work; k++) s += (double)k * 1e-9;
    j->sink[i] = s;
    atomic_fetch_add(&j->counts[i], 1);
}

static char prefetched[4 << 20]; /* what the prefetch requests point into */

static int run_jobs_checked(int jobs, unsigned seed) {
    static job_t j;
    for (int n = 0; n < jobs; n++) {
        seed = seed * 1103515245u + 12345u;
        if (seed % 3 == 0) /* a prefetch request (or, now and then, a cancel) for the idle worker before the job */
            pool_prefetch(seed % 7 ? prefetched + (seed >> 12) % 4096 : NULL, (seed >> 16) % sizeof prefetched / 2);
        const int64_t nchunks = 1 + (seed >> 8) % 300;
        for (int i = 0; i < 512; i++) atomic_store(&j.counts[i], 0);
        j.work = (int)((seed >> 4) % 2000);
        pool_run(nchunks, chunk, &j);
        for (int64_t i = 0; i < nchunks; i++) {
            const int c = atomic_load(&j.counts[i]);
            if (c != 1) {
                fprintf(stderr, "job %d: chunk %lld of %lld ran %d times before pool_run returned\n", n,
                        (long long)i, (long long)nchunks, c);
                return 1;
            }
        }
    }
    return 0;
}

int main(void) {
    int bad = 0;
    pool_set_threads(3);
    bad |= run_jobs_checked(3000, 1);                     /* many small jobs of changing sizes */
    for (int r = 0; r < 40 && !bad; r++) {                /* jobs posted while new workers are still starting */
        pool_set_threads(2 + r % 3);
        bad |= run_jobs_checked(5, (unsigned)r);
    }
    pool_test_delays(300, 600);                           /* a late worker held in the claim window */
    bad |= run_jobs_checked(200, 7);
    pool_test_delays(0, 0);
    pid_t pid = fork();                                   /* a forked child starts its own pool */
    if (pid == 0) _exit(run_jobs_checked(500, 3));
    int st = 0;
    waitpid(pid, &st, 0);
    bad |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
    bad |= run_jobs_checked(500, 9);                      /* and the parent's pool still works after the fork */
    /* the idle worker prefetches: a request right after a job (the worker is spinning), waited for at most 10 s */
    const uint64_t before = pool_prefetched_bytes();
    for (int i = 0; i < 1000 && pool_prefetched_bytes() == before; i++) {
        bad |= run_jobs_checked(1, (unsigned)i);
        pool_prefetch(prefetched, sizeof prefetched);
        usleep(10000);
    }
    if (pool_prefetched_bytes() == before) {
        fprintf(stderr, "the idle worker never prefetched\n");
        bad = 1;
    }
    printf(bad ? "pool stress: FAILED\n" : "pool stress: ok\n");
    return bad;
}
