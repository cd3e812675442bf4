"""The cuda backend: torch.cuda streams, events and pinned host memory behind `Device`.

Ops run inside `torch.cuda.stream(...)`, so their kernels queue on that stream; the host tier and
host-side named buffers are pinned so copies can be asynchronous."""

from __future__ import annotations

import torch

from kvtier.device.base import Device, OpFn
from kvtier.device.costs import Work
from kvtier.device.sanitizer import SanitizerMode
from kvtier.device.types import COMPUTE, EventId, KVLayout, OpId, OpMeta, StreamId, Tier


class CudaDevice(Device):
    """Device on one CUDA GPU. The compute stream gets the greatest priority, the others least."""

    kind = "cuda"

    def __init__(
        self,
        layout: KVLayout,
        num_device_blocks: int,
        num_host_blocks: int,
        *,
        device_index: int = 0,
        sanitize: SanitizerMode | None = "raise",
        poison: bool = False,
    ) -> None:
        if not torch.cuda.is_available():
            raise ValueError("the cuda backend needs a CUDA GPU; use backend 'sim' or 'cpu'")
        if not 0 <= device_index < torch.cuda.device_count():
            raise ValueError(
                f"device_index {device_index} is out of range; this machine has "
                f"{torch.cuda.device_count()} GPU(s)"
            )
        self.torch_device = torch.device("cuda", device_index)
        self._streams: dict[StreamId, torch.cuda.Stream] = {}
        self._events: dict[EventId, torch.cuda.Event] = {}
        super().__init__(
            layout, num_device_blocks, num_host_blocks, sanitize=sanitize, poison=poison
        )

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype, tier: Tier) -> torch.Tensor:
        if tier == "host":
            return torch.zeros(shape, dtype=dtype, pin_memory=True)
        return torch.zeros(shape, dtype=dtype, device=self.torch_device)

    def _new_stream(self, stream: StreamId) -> None:
        least, greatest = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
        # smaller number = more urgent
        priority = greatest if stream == COMPUTE else least
        self._streams[stream] = torch.cuda.Stream(  # type: ignore[no-untyped-call]
            self.torch_device, priority=priority
        )

    def _new_event(self, event: EventId) -> None:
        self._events[event] = torch.cuda.Event()  # type: ignore[no-untyped-call]

    def _release_event(self, event: EventId) -> None:
        del self._events[event]

    def _launch(
        self, stream: StreamId, op_id: OpId, fn: OpFn, meta: OpMeta, work: Work | None
    ) -> None:
        with torch.cuda.stream(self._streams[stream]):
            fn()

    def _record(self, stream: StreamId, event: EventId) -> None:
        self._events[event].record(self._streams[stream])

    def _wait(self, stream: StreamId, event: EventId) -> None:
        self._streams[stream].wait_event(self._events[event])

    def _query(self, event: EventId) -> bool:
        return bool(self._events[event].query())  # type: ignore[no-untyped-call]

    def _sync_event(self, event: EventId) -> None:
        self._events[event].synchronize()

    def _sync_stream(self, stream: StreamId) -> None:
        self._streams[stream].synchronize()

    def _sync_all(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def _host_run(self, fn: OpFn) -> None:
        # Host ops that write device memory queue on the current stream; make them finish
        # before returning so they behave as host writes.
        fn()
        torch.cuda.current_stream(self.torch_device).synchronize()
