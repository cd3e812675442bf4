"""How many threads torch's kernels get, out of the CPUs this process may use (`kvtier.cpus`:
its affinity mask and cgroup quota, not the machine's count). The host thread (scheduling, output processing, HTTP)
and each device stream's worker need a core of their own, so kernels get the rest: OpenMP
threads spin while they wait, so a pool as large as the machine takes the cores the host needs
and stalls every step behind it. A model whose weights reach `ALL_CORES_WEIGHT_BYTES` gets every
core instead: its matmuls are long enough that a second thread pays for its start-up and for
sharing a core with the host thread (`kvtier bench compare` shows it: more threads help the 0.5B
shape and cost the embedded model). The native kernels (`kvtier.model.native`) get every usable core unless
threads were requested: they release the GIL, decode attention is memory-bound, and a call starts
threads only when its work pays for them."""

from __future__ import annotations

import logging
from pathlib import Path

from kvtier.cpus import usable_cpus

log = logging.getLogger("kvtier.engine")


ALL_CORES_WEIGHT_BYTES = 256 << 20  # a checkpoint this large gets every usable core


def checkpoint_bytes(folder: str | Path) -> int:
    """Bytes of a model folder's weight files (`*.safetensors`)."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def default_torch_threads(cores: int | None = None, weight_bytes: int = 0) -> int:
    """All usable cores but one, which is left to the host thread, at least one; all of them for
    a model of at least `ALL_CORES_WEIGHT_BYTES` of weights."""
    cores = usable_cpus() if cores is None else cores
    if weight_bytes >= ALL_CORES_WEIGHT_BYTES:
        return cores
    return max(1, cores - 1)


def configure_torch_threads(requested: int | None, model_path: str | Path | None = None) -> int:
    """Set torch's intra-op thread count (`requested`, or the default for the model in
    `model_path`) and log the choice."""
    import torch

    from kvtier.model import native

    weight_bytes = 0 if model_path is None else checkpoint_bytes(model_path)
    cores = usable_cpus()  # affinity and cgroup quota (kvtier/cpus.py)
    threads = requested if requested is not None else default_torch_threads(cores, weight_bytes)
    torch.set_num_threads(threads)
    # The native kernels release the GIL and are memory-bound (decode attention): every core
    # unless threads were requested; a call starts threads only when its work pays for them.
    native.set_threads(requested if requested is not None else cores)
    if requested is not None:
        how = "--torch-threads"
    elif weight_bytes >= ALL_CORES_WEIGHT_BYTES:
        how = f"default: every core for {weight_bytes / (1 << 20):.0f} MiB of weights"
    else:
        how = "default: usable cores − 1 for the host"
    log.info(
        "torch threads: %d of %d usable cores (%s); native kernels: %d",
        threads, cores, how, native.threads(),
    )  # fmt: skip
    return threads
