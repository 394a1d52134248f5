#ifndef KVSERVE_TASK_RANGES_H
#define KVSERVE_TASK_RANGES_H

#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>

/*
 * Work sharing for the products' parallel loops (blocks_gemm.c, int8_gemm.c, q4_gemm.c,
 * f32_gemm.c).
 *
 * A loop's tasks shared out as one range a thread, each taken in order from its start by its
 * thread, and from their ends by the threads that finish first, a group of tasks at a time.
 * With a static share, the thread that lagged (its core busier, its weights further) held the
 * other at the barrier; with libgomp's dynamic schedule the threads took the panels in turn and
 * each one's stream of weights was cut at every panel (8% slower at 8 rows). Here each thread
 * streams its range in order and only the last groups move; a task's results do not depend on
 * the thread that computes it. Measured on the 2-core Zen 4 machine (a decode step's products
 * of the 1.5B, 28 layers, builds alternated in one process): the time one thread waited for the
 * other at the end of a product, as a share of the products' time, 23-30% -> 0.9-1.5% at 1
 * row, 9-26% -> 1.3-1.8% at 8 rows (docs/benchmarks.md, "2026-12-07 16:00"). One 64-bit word
 * a range: its next group (low half) and its end (high half), both moved by compare-and-swap.
 */
typedef struct {
    _Alignas(64) _Atomic uint64_t span;
} task_range;

#define MAX_RANGES 256 /* threads a product shares out among at most */

/* The next group for thread `me`: from the start of its own range, else from the end of
 * another's (from *victim on, which it advances); -1 once every range is empty. */
static inline int64_t next_group(task_range *ranges, int teams, int me, int *victim) {
    if (me < teams) {
        task_range *own = &ranges[me];
        uint64_t span = atomic_load_explicit(&own->span, memory_order_relaxed);
        while ((uint32_t)span < (uint32_t)(span >> 32))
            if (atomic_compare_exchange_weak_explicit(&own->span, &span, span + 1,
                                                      memory_order_relaxed, memory_order_relaxed))
                return (uint32_t)span;
    }
    for (; *victim < teams; ++*victim) {
        if (*victim == me) continue;
        task_range *other = &ranges[*victim];
        uint64_t span = atomic_load_explicit(&other->span, memory_order_relaxed);
        while ((uint32_t)span < (uint32_t)(span >> 32)) {
            const uint64_t last = (span >> 32) - 1;
            if (atomic_compare_exchange_weak_explicit(&other->span, &span,
                                                      (uint32_t)span | last << 32,
                                                      memory_order_relaxed, memory_order_relaxed))
                return (int64_t)last;
        }
    }
    return -1;
}

/* A loop's tasks [0, tasks) shared out among `teams` threads: their ranges and the tasks a
 * group (about 96 groups a thread, so that the last ones taken are small; 32: 2-3% of the time
 * still waited). */
typedef struct {
    task_range ranges[MAX_RANGES];
    int64_t tasks, size;
    int teams;
} task_share;

/* `share` set for `tasks` tasks and `threads` threads (1: none shared); returns the threads to
 * start, at most MAX_RANGES. */
static inline int task_share_init(task_share *share, int64_t tasks, int threads) {
    const int teams = threads < 1 ? 1 : (threads > MAX_RANGES ? MAX_RANGES : threads);
    const int64_t per = tasks / (96 * (int64_t)teams), size = per > 1 ? per : 1;
    const int64_t groups = (tasks + size - 1) / size;
    for (int t = 0; t < teams; t++) { /* thread t's: [groups t / teams, groups (t + 1) / teams) */
        const uint64_t lo = (uint64_t)(groups * t / teams);
        const uint64_t hi = (uint64_t)(groups * (t + 1) / teams);
        atomic_init(&share->ranges[t].span, lo | hi << 32);
    }
    share->tasks = tasks;
    share->size = size;
    share->teams = teams;
    return teams;
}

/* A thread's walk over the tasks it takes (inside the parallel region):
 *     task_cursor c = task_cursor_of(&share);
 *     for (int64_t task; (task = next_task(&c)) >= 0;) ...                                  */
typedef struct {
    task_share *share;
    int me, victim;
    int64_t at, end;
} task_cursor;

static inline task_cursor task_cursor_of(task_share *share) {
    return (task_cursor){share, omp_get_thread_num(), 0, 0, 0};
}

static inline int64_t next_task(task_cursor *c) {
    if (c->at == c->end) {
        const int64_t group = next_group(c->share->ranges, c->share->teams, c->me, &c->victim);
        if (group < 0) return -1;
        const int64_t size = c->share->size, tasks = c->share->tasks;
        c->at = group * size;
        c->end = c->at + size < tasks ? c->at + size : tasks;
    }
    return c->at++;
}

#endif
