/* A kernel call's items [0, n) on the calling thread and up to `threads - 1` pool helpers.
 *
 * Helpers are started once and sleep between calls. The caller posts a job and starts at once on
 * it; items are claimed in chunks from one atomic counter, so a helper the OS has not scheduled
 * yet (the other cores busy with an HTTP server, a client, the host thread) takes nothing and
 * delays nothing: the caller claims the rest. A helper that wakes after the caller closed the
 * job goes back to sleep, and the caller waits only for helpers inside the job. A static split
 * (each thread its share, the caller joining every thread) waited for the slowest, which on a
 * busy machine is the one that was not running; and each call started its threads anew.
 *
 * Each item's result must not depend on which thread computes it (kernels here write disjoint
 * rows), so outputs are the same bits on any number of threads. One job at a time per library:
 * a second concurrent caller runs its items alone. A forked child runs every call alone: its
 * copy of the pool names helpers it does not have, and its locks may have been held at the
 * fork. Included by each kernel source (one pool per library). */
#ifndef KVTIER_POOL_H
#define KVTIER_POOL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <unistd.h>

#define POOL_MAX_HELPERS 63

typedef void (*ChunkFn)(const void *ctx, int64_t begin, int64_t end);

typedef struct {
    pthread_mutex_t mu; /* guards every field below except `next` */
    pthread_cond_t wake, idle;
    int helpers;         /* started and alive */
    uint64_t generation; /* bumped per job */
    int open;            /* the job takes helpers */
    int joined, wanted;  /* helpers that joined the job; how many it may take */
    int active;          /* helpers inside the job */
    ChunkFn fn;
    const void *ctx;
    int64_t items, chunk;
    _Atomic int64_t next; /* first unclaimed item */
} Pool;

static Pool pool = {.mu = PTHREAD_MUTEX_INITIALIZER,
                    .wake = PTHREAD_COND_INITIALIZER,
                    .idle = PTHREAD_COND_INITIALIZER};
static pthread_mutex_t pool_call = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static _Atomic int pool_pid;                                  /* the helpers' process, 0: none */

static void pool_claim(void) { /* fn, ctx, items, chunk are fixed while a job is open */
    for (;;) {
        const int64_t begin = atomic_fetch_add(&pool.next, pool.chunk);
        if (begin >= pool.items) return;
        const int64_t end = begin + pool.chunk < pool.items ? begin + pool.chunk : pool.items;
        pool.fn(pool.ctx, begin, end);
    }
}

static void *pool_helper(void *unused) {
    (void)unused;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        while (!(pool.open && pool.generation != seen && pool.joined < pool.wanted))
            pthread_cond_wait(&pool.wake, &pool.mu);
        seen = pool.generation;
        pool.joined++;
        pool.active++;
        pthread_mutex_unlock(&pool.mu);
        pool_claim();
        pthread_mutex_lock(&pool.mu);
        if (--pool.active == 0) pthread_cond_signal(&pool.idle);
    }
    return NULL;
}

static void pool_run(ChunkFn fn, const void *ctx, int64_t items, int64_t chunk, int threads) {
    if (chunk < 1) chunk = 1;
    if (threads > POOL_MAX_HELPERS + 1) threads = POOL_MAX_HELPERS + 1;
    const int pid = atomic_load(&pool_pid);
    if (threads < 2 || items <= chunk || (pid != 0 && pid != (int)getpid()) ||
        pthread_mutex_trylock(&pool_call) != 0) {
        if (items > 0) fn(ctx, 0, items);
        return;
    }
    pthread_mutex_lock(&pool.mu);
    atomic_store(&pool_pid, (int)getpid());
    while (pool.helpers < threads - 1) {
        pthread_t id;
        if (pthread_create(&id, NULL, pool_helper, NULL) != 0) break; /* fewer helpers, still right */
        pthread_detach(id);
        pool.helpers++;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    pool.items = items;
    pool.chunk = chunk;
    atomic_store(&pool.next, 0);
    pool.generation++;
    pool.joined = 0;
    pool.wanted = threads - 1;
    pool.open = 1;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    pool_claim();
    pthread_mutex_lock(&pool.mu);
    pool.open = 0;
    while (pool.active > 0) pthread_cond_wait(&pool.idle, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool_call);
}

#endif
