/* The process's thread pool for the native kernels: a call's items [0, n) on the calling thread
 * and up to `threads - 1` helpers. Every kernel of the library calls this one pool (internal.h).
 *
 * Helpers are started once. The caller posts a job and starts at once on it; items are claimed in
 * chunks from one atomic counter, so a helper the OS has not scheduled yet (the other cores busy
 * with an HTTP server, a client, the host thread) takes nothing and delays nothing: the caller
 * claims the rest. A helper that comes after the caller closed the job takes no part, and the
 * caller waits only for helpers inside the job. A static split (each thread its share, the caller
 * joining every thread) waited for the slowest, which on a busy machine is the one that was not
 * running; and each call started its threads anew.
 *
 * Between jobs a helper spins for POOL_SPIN_NS before it sleeps, and the caller spins as long for
 * the helpers inside its job before it sleeps: a decoder layer is a run of calls microseconds
 * apart, and waking a sleeping thread costs tens of microseconds in a virtual machine, longer
 * than a short call's items: a helper asleep at every call lost most of every short call. One
 * pool for every kernel keeps one helper busy instead of one per kernel family taking turns,
 * and no helper spins while another kernel's call needs its core.
 *
 * While host work that needs a core runs beside the kernels (kvtier_pool_yield: the grammar
 * masks' fill, on a thread of its own during the forward), helpers do not spin between jobs but
 * sleep at once: on a machine whose every core the forward uses, a spinning helper holds the core
 * that work would run on until the scheduler's slice ends, and the step then waits for the masks.
 *
 * Helpers must pay for themselves. Beside another process that keeps a core busy (a second
 * engine on the box), a helper gets descheduled mid-chunk and the caller waits out the slice
 * for its items; one thread beside the co-tenant then runs faster than two sharing its core.
 * So every POOL_SAMPLE-th job with helpers is timed: its wall time against what the caller
 * alone would have taken, the caller's CPU time (not wall time: a descheduled caller would make
 * helpers look useful) scaled to every item. When a window's jobs saved under a tenth, the pool
 * runs every call alone for a while (100 ms, doubling while later windows agree, up to 1.6 s),
 * then tries its helpers again. A quiet box keeps them.
 *
 * One job at a time: a second concurrent caller runs its items alone. A forked child runs every
 * call alone: its copy of the pool names helpers it does not have, and its locks may have been
 * held at the fork. */
#include "internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#define POOL_MAX_HELPERS 63
#define POOL_SPIN_NS 100000 /* a layer's calls come back to back; steps are milliseconds apart */
#define POOL_SAMPLE 8       /* every 8th job with helpers is timed: a thread's CPU clock costs ~0.5 us */
#define POOL_WINDOW_NS 20000000    /* timed wall time a verdict on the helpers is taken over */
#define POOL_ALONE_MIN_NS 100000000 /* the first spell of calls run alone */
#define POOL_ALONE_MAX_NS 1600000000

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void pool_relax(void) { _mm_pause(); }
#elif defined(__aarch64__)
static inline void pool_relax(void) { __asm__ __volatile__("yield"); }
#else
static inline void pool_relax(void) {}
#endif

typedef struct {
    pthread_mutex_t mu; /* guards every field below that is not atomic */
    pthread_cond_t wake, idle;
    int helpers;                   /* started and alive */
    int sleeping;                  /* helpers waiting on `wake` */
    int caller_waiting;            /* the caller waits on `idle` */
    int open;                      /* the job takes helpers */
    int joined, wanted;            /* helpers that joined the job; how many it may take */
    _Atomic uint64_t generation;   /* bumped per job (written under mu) */
    _Atomic int active;            /* helpers inside the job (written under mu) */
    ChunkFn fn;
    const void *ctx;
    int64_t items, chunk;
    _Atomic int64_t next; /* first unclaimed item */
} Pool;

static Pool pool = {.mu = PTHREAD_MUTEX_INITIALIZER,
                    .wake = PTHREAD_COND_INITIALIZER,
                    .idle = PTHREAD_COND_INITIALIZER};
static pthread_mutex_t pool_call = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static _Atomic int pool_forked;                               /* this process is a forked copy */
static _Atomic int pool_yielding; /* host threads inside kvtier_pool_yield(1) … (0) */

/* Whether helpers pay (the header). Read and written only by the holder of pool_call. */
static struct {
    int64_t wall_ns, alone_ns;   /* the window's timed jobs: wall, the caller's CPU for every item */
    int64_t alone_until, spell;  /* calls run alone until then; the next spell's length */
} gain = {.spell = POOL_ALONE_MIN_NS};

/* Jobs with helpers (every POOL_SAMPLE-th timed), jobs run alone by that rule, spells alone.
 * Written only by the holder of pool_call, read by anyone without it: a reader that took the
 * lock would make a concurrent kernel call run alone (pool_run's trylock). */
enum { WITH_HELPERS, ALONE, SPELLS };
static _Atomic int64_t pool_counts[3];

/* counter i + 1 (the lock holder's); returns its value before */
static int64_t pool_count(int i) {
    const int64_t n = atomic_load_explicit(&pool_counts[i], memory_order_relaxed);
    atomic_store_explicit(&pool_counts[i], n + 1, memory_order_relaxed);
    return n;
}

void kvtier_pool_yield(int on) { atomic_fetch_add(&pool_yielding, on ? 1 : -1); }

static void pool_mark_forked(void) { atomic_store(&pool_forked, 1); }

static int64_t pool_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int64_t pool_cpu_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* One timed job: `wall` ns with helpers, the caller's `cpu` ns on `mine` of `items` items. At
 * the window's end, a verdict: helpers that saved under a tenth send the calls alone. */
static void pool_judge(int64_t now, int64_t wall, int64_t cpu, int64_t mine, int64_t items) {
    gain.wall_ns += wall;
    /* a caller left no item did not run beside its helpers (it claims from the start): they
     * ran the whole job while it waited, so they saved nothing */
    gain.alone_ns += mine > 0 ? (int64_t)((double)cpu * (double)items / (double)mine) : wall;
    if (gain.wall_ns < POOL_WINDOW_NS) return;
    if (gain.wall_ns * 10 > gain.alone_ns * 9) {
        gain.alone_until = now + gain.spell;
        gain.spell = gain.spell * 2 < POOL_ALONE_MAX_NS ? gain.spell * 2 : POOL_ALONE_MAX_NS;
        pool_count(SPELLS);
    } else {
        gain.spell = POOL_ALONE_MIN_NS;
    }
    gain.wall_ns = gain.alone_ns = 0;
}

void kvtier_pool_stats(int64_t *out) {
    for (int i = 0; i < 3; i++) out[i] = atomic_load_explicit(&pool_counts[i], memory_order_relaxed);
}

/* spin up to POOL_SPIN_NS until `done(arg)`; return whether it came */
static int pool_spin(int (*done)(uint64_t), uint64_t arg) {
    const int64_t until = pool_ns() + POOL_SPIN_NS;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (done(arg)) return 1;
            pool_relax();
        }
        if (pool_ns() > until) return 0;
    }
}

/* a job came, or the helper should leave its core to host work (it then sleeps until one) */
static int pool_job_after(uint64_t seen) {
    return atomic_load(&pool.generation) != seen || atomic_load(&pool_yielding) > 0;
}

static int pool_idle(uint64_t unused) {
    (void)unused;
    return atomic_load(&pool.active) == 0;
}

/* claim and run chunks until none is left; the items this thread ran */
static int64_t pool_claim(void) { /* fn, ctx, items, chunk are fixed while a job is open */
    for (int64_t done = 0;;) {
        const int64_t begin = atomic_fetch_add(&pool.next, pool.chunk);
        if (begin >= pool.items) return done;
        const int64_t end = begin + pool.chunk < pool.items ? begin + pool.chunk : pool.items;
        pool.fn(pool.ctx, begin, end);
        done += end - begin;
    }
}

static void *pool_helper(void *unused) {
    (void)unused;
    uint64_t seen = 0;
    for (;;) {
        pool_spin(pool_job_after, seen);
        pthread_mutex_lock(&pool.mu);
        while (atomic_load(&pool.generation) == seen) {
            pool.sleeping++;
            pthread_cond_wait(&pool.wake, &pool.mu);
            pool.sleeping--;
        }
        seen = atomic_load(&pool.generation);
        const int join = pool.open && pool.joined < pool.wanted; /* else gone or full: next one */
        if (join) {
            pool.joined++;
            atomic_fetch_add(&pool.active, 1);
        }
        pthread_mutex_unlock(&pool.mu);
        if (!join) continue;
        pool_claim();
        pthread_mutex_lock(&pool.mu);
        if (atomic_fetch_sub(&pool.active, 1) == 1 && pool.caller_waiting)
            pthread_cond_signal(&pool.idle);
        pthread_mutex_unlock(&pool.mu);
    }
    return NULL;
}

void pool_run(ChunkFn fn, const void *ctx, int64_t items, int64_t chunk, int threads) {
    if (chunk < 1) chunk = 1;
    if (threads > POOL_MAX_HELPERS + 1) threads = POOL_MAX_HELPERS + 1;
    if (threads < 2 || items <= chunk || atomic_load(&pool_forked) ||
        pthread_mutex_trylock(&pool_call) != 0) {
        if (items > 0) fn(ctx, 0, items);
        return;
    }
    const int64_t t0 = pool_ns();
    if (t0 < gain.alone_until) { /* helpers did not pay lately */
        pool_count(ALONE);
        pthread_mutex_unlock(&pool_call);
        fn(ctx, 0, items);
        return;
    }
    const int timed = pool_count(WITH_HELPERS) % POOL_SAMPLE == 0;
    pthread_mutex_lock(&pool.mu);
    if (pool.helpers == 0) pthread_atfork(NULL, NULL, pool_mark_forked);
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
    pool.joined = 0;
    pool.wanted = threads - 1;
    pool.open = 1;
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    if (pool.sleeping) pthread_cond_broadcast(&pool.wake); /* the spinning ones see the generation */
    pthread_mutex_unlock(&pool.mu);
    const int64_t cpu0 = timed ? pool_cpu_ns() : 0;
    const int64_t mine = pool_claim();
    const int64_t cpu = timed ? pool_cpu_ns() - cpu0 : 0;
    pthread_mutex_lock(&pool.mu);
    pool.open = 0; /* no helper joins after this: `active` only falls */
    pthread_mutex_unlock(&pool.mu);
    if (!pool_spin(pool_idle, 0)) {
        pthread_mutex_lock(&pool.mu);
        while (atomic_load(&pool.active) > 0) {
            pool.caller_waiting = 1;
            pthread_cond_wait(&pool.idle, &pool.mu);
        }
        pool.caller_waiting = 0;
        pthread_mutex_unlock(&pool.mu);
    }
    if (timed) {
        const int64_t t1 = pool_ns();
        pool_judge(t1, t1 - t0, cpu, mine, items);
    }
    pthread_mutex_unlock(&pool_call);
}
