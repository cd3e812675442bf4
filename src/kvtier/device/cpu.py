"""The cpu backend: eager and synchronous, the fast path for serving on a CPU.

Every op runs to completion inside `launch`, so events are always complete and waits cost
nothing; the sanitizer still sees every call, so ordering bugs show up here too."""

from __future__ import annotations

import torch

from kvtier.device.base import Device, OpFn
from kvtier.device.costs import Work
from kvtier.device.types import EventId, OpId, OpMeta, StreamId, Tier


class CpuDevice(Device):
    """Device whose streams are program order on the host; tensors are plain CPU tensors."""

    kind = "cpu"

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype, tier: Tier) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    def _new_stream(self, stream: StreamId) -> None:
        pass  # streams are labels for the sanitizer only

    def _new_event(self, event: EventId) -> None:
        pass

    def _release_event(self, event: EventId) -> None:
        pass

    def _launch(
        self, stream: StreamId, op_id: OpId, fn: OpFn, meta: OpMeta, work: Work | None
    ) -> None:
        fn()

    def _record(self, stream: StreamId, event: EventId) -> None:
        pass  # everything launched so far has already run

    def _wait(self, stream: StreamId, event: EventId) -> None:
        pass

    def _query(self, event: EventId) -> bool:
        return True

    def _sync_event(self, event: EventId) -> None:
        pass

    def _sync_stream(self, stream: StreamId) -> None:
        pass

    def _sync_all(self) -> None:
        pass

    def _host_run(self, fn: OpFn) -> None:
        fn()
