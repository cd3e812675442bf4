"""The C allocator's policy for the engine process: freed memory is kept for reuse.

A step's activations are large, short-lived tensors (a 64 × 128-token prompt step of the embedded
model writes 16 MiB for each layer's gate and up projections). glibc's malloc serves blocks above
its mmap threshold (128 KiB, raised as large blocks are freed) with fresh mappings that it returns
to the OS on free, and trims the heap's free top past its trim threshold; either way the next
step's tensors fault their pages in again, each zeroed by the kernel: thousands of faults a prompt
step (tests/engine/test_allocator.py). Here the mmap threshold is at glibc's largest (32 MiB) and
the heap is not trimmed below 2 GiB free. The price is that the process keeps its peak heap until
exit, as with the tcmalloc that vLLM's CPU docs recommend preloading. Other C libraries (musl,
macOS) are left as they are. (Blocks of 32 MiB and more still get mappings of their own: the fused layers keep
their work buffer instead, `FusedLayers.run`.)"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("kvtier.engine")

# glibc's mallopt parameters (malloc.h; values are C ints)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # blocks from here up get their own mapping (glibc's largest)
TRIM_THRESHOLD = (1 << 31) - 1  # free heap top kept up to this (2 GiB)

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed blocks for reuse (once a process); False where the C
    library is not glibc or refused a setting."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("C library without mallopt: allocator left as it is")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    ok = all([bool(mallopt(param, value)) for param, value in settings])
    log.info("malloc keeps freed memory for reuse: %s", "yes" if ok else "refused")
    return ok
