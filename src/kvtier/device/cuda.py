"""The cuda backend: each stream is a worker thread (`threaded.py`) that issues its ops' kernels on
its own torch.cuda stream; events are CUDA events recorded by the workers, so cross-stream waits
order the GPU work, not the host. The host tier and host-side named buffers are pinned so copies
are asynchronous. Whatever an op does on its worker (even a read of device data) never blocks the
host thread that schedules the next step."""

from __future__ import annotations

import torch

from kvtier.device.base import OpFn
from kvtier.device.sanitizer import SanitizerMode
from kvtier.device.threaded import ThreadedDevice
from kvtier.device.types import COMPUTE, KVLayout, Tier
from kvtier.ids import StreamId


class CudaDevice(ThreadedDevice):
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
        super()._new_stream(stream)

    def _worker_setup(self, stream: StreamId) -> None:
        torch.cuda.set_device(self.torch_device)

    def _run_op(self, stream: StreamId, fn: OpFn) -> None:
        with torch.cuda.stream(self._streams[stream]):
            fn()

    def _mark(self, stream: StreamId) -> object:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._streams[stream])
        return event

    def _order_after(self, stream: StreamId, mark: object) -> None:
        assert isinstance(mark, torch.cuda.Event)
        self._streams[stream].wait_event(mark)

    def _mark_done(self, mark: object) -> bool:
        assert isinstance(mark, torch.cuda.Event)
        return bool(mark.query())  # type: ignore[no-untyped-call]

    def _mark_sync(self, mark: object) -> None:
        assert isinstance(mark, torch.cuda.Event)
        mark.synchronize()

    def _host_run(self, fn: OpFn) -> None:
        # Host ops that write device memory queue on the host thread's current stream; make them
        # finish before returning so they behave as host writes.
        super()._host_run(fn)
        torch.cuda.current_stream(self.torch_device).synchronize()
