"""How many threads torch's kernels get. The host thread (scheduling, output processing, HTTP)
and each device stream's worker need a core of their own, so kernels get the rest: on a busy
2-core machine a pool of two spinning OpenMP threads made serving 10–15× slower than one."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("kvtier.engine")


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without affinity masks
        return os.cpu_count() or 1


def default_torch_threads(cores: int | None = None) -> int:
    """All usable cores but one, which is left to the host thread; at least one."""
    return max(1, (usable_cores() if cores is None else cores) - 1)


def configure_torch_threads(requested: int | None) -> int:
    """Set torch's intra-op thread count (`requested`, or the default) and log the choice."""
    import torch

    cores = usable_cores()
    threads = requested if requested is not None else default_torch_threads(cores)
    torch.set_num_threads(threads)
    how = "--torch-threads" if requested is not None else "default: usable cores − 1 for the host"
    log.info("torch threads: %d of %d usable cores (%s)", threads, cores, how)
    return threads
