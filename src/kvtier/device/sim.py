"""The sim backend: a deterministic discrete-event device in virtual nanoseconds.

Each stream is a FIFO with its own clock; op times are fixed at launch by the cost model, and op
effects are applied lazily in (start time, seq) order, so an unordered copy that starts while the
compute stream is backlogged really lands before the forward that reads the block."""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass

import torch

from kvtier.device.base import Device, OpFn
from kvtier.device.costs import CostModel, Work
from kvtier.device.sanitizer import SanitizerMode
from kvtier.device.types import KVLayout, OpMeta, Tier
from kvtier.ids import EventId, OpId, StreamId


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One op as the sim ran it; equal traces mean equal schedules."""

    op_id: OpId
    stream: str
    label: str
    step_seq: int | None
    launch_ns: int
    start_ns: int
    end_ns: int


class SimDevice(Device):
    """Virtual-time device on CPU tensors. `now_ns` is the host's virtual clock.

    An op starts at max(host launch time, its stream's ready time, events the stream waited on)
    and lasts `cost_model.duration_ns(work)`. Host waits move `now_ns` forward and apply every
    op that has started by then; host ops see exactly those effects.
    """

    kind = "sim"

    def __init__(
        self,
        layout: KVLayout,
        num_device_blocks: int,
        num_host_blocks: int,
        *,
        cost_model: CostModel | None = None,
        seed: int = 0,
        max_trace: int = 100_000,
        sanitize: SanitizerMode | None = "raise",
        poison: bool = False,
    ) -> None:
        self.cost_model = cost_model or CostModel()
        self.now_ns = 0
        self.trace: deque[TraceEntry] = deque(maxlen=max_trace)  # the latest ops only
        self._rng = random.Random(seed)
        self._ready_ns: dict[StreamId, int] = {}  # when the stream's next op may start
        self._event_ns: dict[EventId, int] = {}  # completion time of each event's last record
        # INVARIANT: ops whose effect is not applied yet, all after every applied op in
        # (start_ns, op id) order: launches start at or after now_ns, and only ops started by
        # now_ns are applied.
        self._pending: list[tuple[int, int, OpFn]] = []
        super().__init__(
            layout, num_device_blocks, num_host_blocks, sanitize=sanitize, poison=poison
        )

    def idle_ns(self) -> int:
        """Virtual time at which every stream will be idle."""
        return max([self.now_ns, *self._ready_ns.values()])

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype, tier: Tier) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    def _new_stream(self, stream: StreamId) -> None:
        self._ready_ns[stream] = self.now_ns

    def _new_event(self, event: EventId) -> None:
        pass  # an unrecorded event has no time: waits ignore it, queries say done

    def _release_event(self, event: EventId) -> None:
        self._event_ns.pop(event, None)

    def _launch(
        self, stream: StreamId, op_id: OpId, fn: OpFn, meta: OpMeta, work: Work | None
    ) -> None:
        launch_ns = self.now_ns
        self.now_ns += self.cost_model.launch_ns
        start = max(self.now_ns, self._ready_ns[stream])
        end = start + self.cost_model.duration_ns(work, self._rng)
        self._ready_ns[stream] = end
        heapq.heappush(self._pending, (start, op_id, fn))
        self.trace.append(
            TraceEntry(
                op_id, self.stream_name(stream), meta.label, meta.step_seq, launch_ns, start, end
            )
        )

    def _record(self, stream: StreamId, event: EventId) -> None:
        self.now_ns += self.cost_model.event_ns
        self._event_ns[event] = max(self.now_ns, self._ready_ns[stream])

    def _wait(self, stream: StreamId, event: EventId) -> None:
        self.now_ns += self.cost_model.event_ns
        done = self._event_ns.get(event)
        if done is not None and done > self._ready_ns[stream]:
            self._ready_ns[stream] = done

    def _query(self, event: EventId) -> bool:
        self.now_ns += self.cost_model.event_ns  # polling costs host time, so polls terminate
        done = self._event_ns.get(event)
        return done is None or done <= self.now_ns

    def _sync_event(self, event: EventId) -> None:
        self._advance(self._event_ns.get(event, self.now_ns))

    def _sync_stream(self, stream: StreamId) -> None:
        self._advance(self._ready_ns[stream])

    def _sync_all(self) -> None:
        self._advance(self.idle_ns())

    def _host_run(self, fn: OpFn) -> None:
        self._advance(self.now_ns)
        fn()

    def _advance(self, until_ns: int) -> None:
        """Move the host clock to `until_ns` (never back) and apply every op started by then."""
        self.now_ns = max(self.now_ns, until_ns)
        pending = self._pending
        while pending and pending[0][0] <= self.now_ns:
            heapq.heappop(pending)[2]()
