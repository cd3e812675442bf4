"""The worker half of the host tier: block copies between tiers on the load and store streams.

Loads are launched before the step's forward and, with the `event` protection, wait on the
compute-done event of the last forward launched (so they cannot overwrite a block a pending
forward reads); stores are launched after the forward and wait on its compute-done event (so they
cannot read a block before the forward that writes it). Completions are polled without blocking.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.device import COMPUTE, LOAD, STORE, Device, EventId, OpMeta, StreamId, Tier
from kvtier.sched.output import PlannedTransfer


@dataclass(slots=True)
class _Pending:
    transfer: PlannedTransfer
    event: EventId


class TransferEngine:
    """Launches `PlannedTransfer`s and reports which have completed (or failed)."""

    def __init__(self, device: Device, *, order_after_compute: bool = True) -> None:
        self.device = device
        self.order_after_compute = order_after_compute
        self.compute_done = device.new_event()  # re-recorded after every forward
        self._any_forward = False
        self._pending: dict[int, _Pending] = {}
        self._free_events: list[EventId] = []
        self.fail_ids: set[int] = set()  # fault injection: these transfers report failure
        self.num_load_blocks = 0
        self.num_store_blocks = 0

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def launch_loads(self, transfers: list[PlannedTransfer], step_seq: int) -> None:
        """Host → device copies, before this step's forward."""
        loads = [t for t in transfers if t.is_load]
        if not loads:
            return
        if self.order_after_compute and self._any_forward:
            self.device.wait(LOAD, self.compute_done)
        for t in loads:
            self._launch(LOAD, "host", "device", t, step_seq)
            self.num_load_blocks += len(t.src_block_ids)

    def forward_launched(self) -> None:
        """Record the compute-done event after the step's forward (call once per step)."""
        self.device.record(COMPUTE, self.compute_done)
        self._any_forward = True

    def launch_stores(self, transfers: list[PlannedTransfer], step_seq: int) -> None:
        """Device → host copies, after this step's forward."""
        stores = [t for t in transfers if not t.is_load]
        if not stores:
            return
        if self.order_after_compute and self._any_forward:
            self.device.wait(STORE, self.compute_done)
        for t in stores:
            self._launch(STORE, "device", "host", t, step_seq)
            self.num_store_blocks += len(t.src_block_ids)

    def _launch(
        self, stream: StreamId, src: Tier, dst: Tier, t: PlannedTransfer, step_seq: int
    ) -> None:
        if t.transfer_id in self._pending:
            raise ValueError(
                f"transfer id {t.transfer_id} is already in flight; ids must be unique"
            )
        label = "load" if t.is_load else "store"
        meta = OpMeta(label, step_seq, (t.req_id,))
        self.device.copy_blocks(stream, src, dst, t.src_block_ids, t.dst_block_ids, meta)
        event = self._free_events.pop() if self._free_events else self.device.new_event()
        self.device.record(stream, event)
        self._pending[t.transfer_id] = _Pending(t, event)

    def poll(self) -> tuple[list[int], list[int]]:
        """(finished, failed) transfer ids whose copies completed since the last poll.

        Never blocks; a completed copy is synchronised on before it is reported, so whatever the
        host does next is ordered after it.
        """
        finished: list[int] = []
        failed: list[int] = []
        for tid, p in list(self._pending.items()):
            if not self.device.query(p.event):
                continue
            self.device.synchronize_event(p.event)
            del self._pending[tid]
            self._free_events.append(p.event)
            (failed if tid in self.fail_ids else finished).append(tid)
        return finished, failed

    def flush(self) -> tuple[list[int], list[int]]:
        """Wait for every transfer in flight (preemption of their requests, shutdown)."""
        for p in self._pending.values():
            self.device.synchronize_event(p.event)
        return self.poll()
