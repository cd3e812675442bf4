/* What a kernel library needs of the process's thread pool (pool.c): `pool_run` runs a call's
 * items [0, n), each item's result independent of the thread that computes it (kernels here write
 * disjoint rows), so outputs are the same bits on any number of threads. Every library calls the
 * one pool, bound at load by kvtier/model/native.py (`kvtier_pool_bind`): one set of helpers for
 * the whole layer, kept hot across its back-to-back calls into different libraries. Until bound,
 * a library runs every call on the calling thread. Included by each kernel source. */
#ifndef KVTIER_POOL_H
#define KVTIER_POOL_H

#include <stdint.h>

typedef void (*ChunkFn)(const void *ctx, int64_t begin, int64_t end);
typedef void (*PoolRunFn)(ChunkFn fn, const void *ctx, int64_t items, int64_t chunk, int threads);

#ifndef KVTIER_POOL_IMPL
static PoolRunFn pool_bound; /* pool.c's kvtier_pool_run, once bound */

void kvtier_pool_bind(PoolRunFn run) { pool_bound = run; }

/* items [0, n) in chunks of `chunk`, on the caller and up to `threads - 1` helpers */
static void pool_run(ChunkFn fn, const void *ctx, int64_t items, int64_t chunk, int threads) {
    if (pool_bound)
        pool_bound(fn, ctx, items, chunk, threads);
    else if (items > 0)
        fn(ctx, 0, items);
}
#endif

#endif
