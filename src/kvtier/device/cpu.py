"""The cpu backend: tensors in host memory, each stream a worker thread (`threaded.py`), so at
async depth 2–3 the host schedules step k+1 and processes step k−1 while step k's forward runs
(PyTorch releases the GIL inside kernels), and copies on the load and store streams run beside it.

An op has finished when its worker moves on, so a record is complete once its worker reaches it.
Nothing orders streams but events: a copy that does not wait on the compute-done event really
races the forward here, as on a GPU."""

from __future__ import annotations

import torch

from kvtier.device.threaded import ThreadedDevice
from kvtier.device.types import Tier


class CpuDevice(ThreadedDevice):
    """Device whose streams are worker threads over plain CPU tensors."""

    kind = "cpu"

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype, tier: Tier) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)
