"""The backend-independent half of a device: stream and event ids, op launch with access sets,
the sanitizer feed, block copies and poison. Backends implement only the `_hooks` at the bottom;
this module decides nothing about timing."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from kvtier.device.buffers import Buffers
from kvtier.device.costs import Work
from kvtier.device.sanitizer import Hazard, Sanitizer, SanitizerMode
from kvtier.device.types import DEFAULT_STREAMS, AccessSet, KVLayout, OpMeta, Tier
from kvtier.ids import BlockId, EventId, OpId, StreamId

OpFn = Callable[[], object]  # the return value, if any, is ignored


class DeviceError(RuntimeError):
    """An op failed on a device stream. The device is unusable afterwards (sticky, as a CUDA
    error): every later launch, query or synchronisation raises it again."""


class Device(ABC):
    """What the runner talks to: KV tiers, named buffers, streams, events, ops with access sets.

    Backends (`SimDevice`, `CpuDevice`, `CudaDevice`) subclass it and implement the hooks only.
    Every call is forwarded to the sanitizer when one is on, whatever the backend.
    """

    kind = "base"
    torch_device = torch.device("cpu")  # where device-tier tensors live; inputs go here too

    def __init__(
        self,
        layout: KVLayout,
        num_device_blocks: int,
        num_host_blocks: int,
        *,
        sanitize: SanitizerMode | None = "raise",
        poison: bool = False,
    ) -> None:
        self.layout = layout
        self.sanitizer = Sanitizer(sanitize) if sanitize is not None else None
        self.poison_enabled = poison
        self._stream_names: dict[StreamId, str] = {}
        self._stream_ids: dict[str, StreamId] = {}
        self._num_events = 0
        self._live_events: set[EventId] = set()
        self._num_ops = 0
        self._buffers = Buffers(layout, num_device_blocks, num_host_blocks, self._alloc)
        for sid, name in DEFAULT_STREAMS.items():
            self._add_stream(sid, name)

    @property
    def checks_access(self) -> bool:
        """Whether ops' access sets are checked (a sanitizer is on); a caller may declare empty
        block sets otherwise, and skip the work of computing them."""
        return self.sanitizer is not None

    def close(self) -> None:  # noqa: B027 (a hook with a default: most backends hold nothing)
        """Release what the backend holds beyond memory (worker threads); idempotent."""

    # -- buffers ---------------------------------------------------------------------------

    def kv(self, tier: Tier) -> list[torch.Tensor]:
        """The KV tensors of `tier`, one per layer slot, each [num_blocks, page elements] (a
        model views the pages; `KVLayout.slot_shape` is attention's view). Read/write them only
        inside ops."""
        return self._buffers.kv(tier)

    def num_blocks(self, tier: Tier) -> int:
        """Number of blocks in `tier`'s KV pool."""
        return self._buffers.num_blocks(tier)

    def alloc_buffer(
        self, name: str, shape: Sequence[int], dtype: str = "float32", tier: Tier = "device"
    ) -> torch.Tensor:
        """Allocate a named, unpaged buffer (zeros; pinned on a CUDA host tier) and return it.

        Ops access it in their access set as `{name: None}`. Names are unique per device.
        """
        return self._buffers.add(name, shape, dtype, tier)

    def buffer(self, name: str) -> torch.Tensor:
        """The named buffer `name` allocated by `alloc_buffer`."""
        return self._buffers.get(name)

    # -- streams and events ----------------------------------------------------------------

    def stream(self, name: str) -> StreamId:
        """The stream called `name`, created on first use ("compute", "load", "store" exist)."""
        sid = self._stream_ids.get(name)
        if sid is None:
            sid = StreamId(len(self._stream_ids))
            self._add_stream(sid, name)
        return sid

    def stream_name(self, stream: StreamId) -> str:
        """The name `stream` was created under."""
        self._check_stream(stream)
        return self._stream_names[stream]

    def new_event(self) -> EventId:
        """A fresh, unrecorded event (waiting on it orders nothing; querying it says done)."""
        self._num_events += 1
        event = EventId(self._num_events)
        self._live_events.add(event)
        self._new_event(event)
        return event

    def release_event(self, event: EventId) -> None:
        """Forget `event` (any later use is a ValueError). Release events you stop using, or
        re-record a fixed ring of them: every live event holds a snapshot in the sanitizer."""
        self._check_event(event)
        self._live_events.discard(event)
        self._release_event(event)
        if self.sanitizer is not None:
            self.sanitizer.forget_event(event)

    def record(self, stream: StreamId, event: EventId | None = None) -> EventId:
        """Record `event` (a fresh one when None) after all work launched so far on `stream`.

        Re-recording replaces the event's earlier record. Returns the event.
        """
        self._check_stream(stream)
        if event is None:
            event = self.new_event()
        self._check_event(event)
        self._record(stream, event)
        if self.sanitizer is not None:
            self.sanitizer.record(event, stream)
        return event

    def wait(self, stream: StreamId, event: EventId) -> None:
        """Work launched later on `stream` starts after `event`'s latest record completes."""
        self._check_stream(stream)
        self._check_event(event)
        self._wait(stream, event)
        if self.sanitizer is not None:
            self.sanitizer.wait(stream, event)

    def query(self, event: EventId) -> bool:
        """True when `event` has completed. Orders nothing: `synchronize_event` before acting."""
        self._check_event(event)
        return self._query(event)

    def synchronize_event(self, event: EventId) -> None:
        """Block the host until `event` completes; later host work is ordered after it."""
        self._check_event(event)
        self._sync_event(event)
        if self.sanitizer is not None:
            self.sanitizer.sync_event(event)

    def synchronize_stream(self, stream: StreamId) -> None:
        """Block the host until all work launched so far on `stream` completes."""
        self._check_stream(stream)
        self._sync_stream(stream)
        if self.sanitizer is not None:
            self.sanitizer.sync_stream(stream)

    def synchronize(self) -> None:
        """Block the host until every stream is idle."""
        self._sync_all()
        if self.sanitizer is not None:
            self.sanitizer.sync_all()

    # -- ops ---------------------------------------------------------------------------------

    def launch(
        self,
        stream: StreamId,
        fn: OpFn,
        access: AccessSet,
        meta: OpMeta,
        work: Work | None = None,
    ) -> OpId:
        """Launch `fn` (the op's real tensor effect) on `stream`; returns the op id.

        `access` must declare every block and named buffer `fn` touches: the sanitizer checks it.
        """
        self._check_stream(stream)
        self._buffers.check_access(access)
        op_id = self._next_op()
        if self.sanitizer is not None:
            self.sanitizer.launch(stream, op_id, access, meta)
        self._launch(stream, op_id, fn, meta, work)
        return op_id

    def host_op(self, fn: OpFn, access: AccessSet, meta: OpMeta) -> OpId:
        """Run `fn` on the host now (e.g. read sampled tokens); checked as a host access."""
        self._buffers.check_access(access)
        op_id = self._next_op()
        if self.sanitizer is not None:
            self.sanitizer.host_access(op_id, access, meta)
        self._host_run(fn)
        return op_id

    def copy_blocks(
        self,
        stream: StreamId,
        src: Tier,
        dst: Tier,
        src_ids: Sequence[BlockId],
        dst_ids: Sequence[BlockId],
        meta: OpMeta,
    ) -> OpId:
        """Copy blocks `src_ids` of tier `src` onto `dst_ids` of tier `dst`, in every layer slot.

        A load is host → device on the load stream, a store device → host on the store stream.
        """
        if len(src_ids) != len(dst_ids):
            raise ValueError(
                f"copy_blocks needs as many src_ids as dst_ids, got {len(src_ids)} and "
                f"{len(dst_ids)}"
            )
        srcs, dsts = self.kv(src), self.kv(dst)
        src_list, dst_list = list(src_ids), list(dst_ids)
        runs = _runs(src_list, dst_list)

        def copy() -> None:
            # Slice copies only: on CUDA each is one async memcpy queued on the op's stream
            # (pinned host), never a host-side gather that would run at launch time.
            for s, d in zip(srcs, dsts, strict=True):
                for s0, d0, n in runs:
                    d[d0 : d0 + n].copy_(s[s0 : s0 + n], non_blocking=True)

        access = AccessSet(reads=((src, tuple(src_list)),), writes=((dst, tuple(dst_list)),))
        work = Work.copy(len(src_list) * self.layout.block_bytes)
        return self.launch(stream, copy, access, meta, work)

    def poison_blocks(
        self,
        tier: Tier,
        block_ids: Sequence[BlockId],
        *,
        stream: StreamId | None = None,
        meta: OpMeta | None = None,
    ) -> OpId | None:
        """Fill `block_ids` of `tier` with NaN if poisoning is on; returns None when it is off.

        Call on (re)allocation. With `stream=None` the host writes at once, so the sanitizer checks
        that no launched op may still touch the blocks (what quarantine promises); with a stream
        it is an ordinary op ordered like any other write.
        """
        if not self.poison_enabled:
            return None
        tensors, ids = self.kv(tier), list(block_ids)
        runs = _runs(ids, ids)

        def poison() -> None:  # all-ones bytes: NaN in every float format, so in fp8 K/V
            for t in tensors:  # and in the bfloat16 states a hybrid's 8-bit pages hold alike
                for b0, _, n in runs:
                    t[b0 : b0 + n].view(torch.uint8).fill_(0xFF)

        access = AccessSet(writes=((tier, tuple(ids)),))
        meta = meta or OpMeta("poison")
        if stream is None:
            return self.host_op(poison, access, meta)
        return self.launch(stream, poison, access, meta)

    @property
    def num_ops(self) -> int:
        """Ops launched so far, host ops included."""
        return self._num_ops

    @property
    def hazards(self) -> list[Hazard]:
        """Hazards kept by the sanitizer (empty when it is off)."""
        return [] if self.sanitizer is None else self.sanitizer.hazards

    # -- validation ----------------------------------------------------------------------------

    def _next_op(self) -> OpId:
        self._num_ops += 1
        return OpId(self._num_ops)

    def _add_stream(self, sid: StreamId, name: str) -> None:
        self._stream_names[sid] = name
        self._stream_ids[name] = sid
        self._new_stream(sid)
        if self.sanitizer is not None:
            self.sanitizer.add_stream(sid, name)

    def _check_stream(self, stream: StreamId) -> None:
        if stream not in self._stream_names:
            raise ValueError(f"unknown stream id {stream!r}; get one from device.stream(name)")

    def _check_event(self, event: EventId) -> None:
        if event not in self._live_events:
            raise ValueError(
                f"unknown or released event id {event!r}; get one from new_event() or record()"
            )

    # -- backend hooks: `_alloc` and `_new_stream` run inside Device.__init__, so a backend sets
    # its own state before calling super().__init__.

    @abstractmethod
    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype, tier: Tier) -> torch.Tensor: ...
    @abstractmethod
    def _new_stream(self, stream: StreamId) -> None: ...
    @abstractmethod
    def _new_event(self, event: EventId) -> None: ...
    @abstractmethod
    def _release_event(self, event: EventId) -> None: ...
    @abstractmethod
    def _launch(
        self, stream: StreamId, op_id: OpId, fn: OpFn, meta: OpMeta, work: Work | None
    ) -> None: ...
    @abstractmethod
    def _record(self, stream: StreamId, event: EventId) -> None: ...
    @abstractmethod
    def _wait(self, stream: StreamId, event: EventId) -> None: ...
    @abstractmethod
    def _query(self, event: EventId) -> bool: ...
    @abstractmethod
    def _sync_event(self, event: EventId) -> None: ...
    @abstractmethod
    def _sync_stream(self, stream: StreamId) -> None: ...
    @abstractmethod
    def _sync_all(self) -> None: ...
    @abstractmethod
    def _host_run(self, fn: OpFn) -> None: ...


def _runs(src_ids: list[BlockId], dst_ids: list[BlockId]) -> list[tuple[int, int, int]]:
    """Coalesce (src, dst) id pairs into (src start, dst start, length) runs of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            s0, d0, n = runs[-1]
            runs[-1] = (s0, d0, n + 1)
        else:
            runs.append((s, d, 1))
    return runs
