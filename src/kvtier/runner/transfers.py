"""The worker half of the host tier: block copies between tiers on the load and store streams.

Loads are launched before the step's forward and, with the `event` protection, wait on the
compute-done event of the last forward launched (so they cannot overwrite a block a pending
forward reads); stores are launched after the forward and wait on its compute-done event (so they
cannot read a block before the forward that writes it). Completions are polled without blocking.
`TransferFaults` injects failing, corrupting and slow copies (tests, chaos runs).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.device import COMPUTE, LOAD, STORE, Device, OpMeta, Tier
from kvtier.ids import EventId, StreamId
from kvtier.sched.output import PlannedTransfer


@dataclass(frozen=True, slots=True)
class TransferFaults:
    """Faults a `TransferEngine` injects into the copies it launches; the default injects none.

    A failed copy is reported in `RunnerOutput.failed_transfers` (a failed load rolls its request
    back to recompute, a failed store is dropped and re-stored). Counts are over copies launched
    since the faults were set; everything is deterministic.
    """

    fail_loads_every: int = 0  # the Nth, 2Nth, … load launched fails (0: none)
    fail_transfer_ids: frozenset[int] = frozenset()  # these transfers fail, loads or stores
    # The first N stores launched leave bad host copies: every later load reading one of their
    # host blocks fails, until a store rewrites that block (a persistently bad host copy).
    corrupt_stores: int = 0
    # A completed copy is reported this many polls (engine steps) late: keeps loads and stores
    # in flight across steps, e.g. to abort a request while its load is pending.
    delay_polls: int = 0

    def __post_init__(self) -> None:
        for name in ("fail_loads_every", "corrupt_stores", "delay_polls"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"TransferFaults.{name} must be an int ≥ 0, got {value!r}")


@dataclass(slots=True)
class _Pending:
    transfer: PlannedTransfer
    event: EventId
    fails: bool  # decided at launch by the faults in force
    done_at_poll: int | None = None  # the poll that first saw the copy complete


class TransferEngine:
    """Launches `PlannedTransfer`s and reports which have completed (or failed)."""

    def __init__(self, device: Device, *, order_after_compute: bool = True) -> None:
        self.device = device
        self.order_after_compute = order_after_compute
        self.compute_done = device.new_event()  # re-recorded after every forward
        self._any_forward = False
        self._pending: dict[int, _Pending] = {}
        self._free_events: list[EventId] = []
        self.faults = TransferFaults()
        self._num_loads = 0  # launched since the faults were set
        self._num_stores = 0
        self._bad_host_blocks: set[int] = set()  # host copies left bad by corrupted stores
        self._num_polls = 0
        self.num_load_blocks = 0
        self.num_store_blocks = 0

    def set_faults(self, faults: TransferFaults) -> None:
        """Inject `faults` into copies launched from now on (mutates; `TransferFaults()` stops
        injecting, and bad host copies left by earlier corrupted stores are forgotten)."""
        self.faults = faults
        self._num_loads = self._num_stores = 0
        self._bad_host_blocks.clear()

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
        self._pending[t.transfer_id] = _Pending(t, event, self._fails(t))

    def _fails(self, t: PlannedTransfer) -> bool:
        """Whether the faults in force fail `t` (and, for a store, what it leaves bad)."""
        f = self.faults
        if t.is_load:
            self._num_loads += 1
            every = f.fail_loads_every
            bad = not self._bad_host_blocks.isdisjoint(t.src_block_ids)
            return (
                bad
                or (every > 0 and self._num_loads % every == 0)
                or (t.transfer_id in f.fail_transfer_ids)
            )
        self._num_stores += 1
        if self._num_stores <= f.corrupt_stores:
            self._bad_host_blocks.update(t.dst_block_ids)
        else:
            self._bad_host_blocks.difference_update(t.dst_block_ids)
        return t.transfer_id in f.fail_transfer_ids

    def poll(self) -> tuple[list[int], list[int]]:
        """(finished, failed) transfer ids whose copies completed since the last poll (reported
        `faults.delay_polls` polls late).

        Never blocks; a completed copy is synchronised on before it is reported, so whatever the
        host does next is ordered after it.
        """
        self._num_polls += 1
        return self._report(self.faults.delay_polls)

    def _report(self, delay: int) -> tuple[list[int], list[int]]:
        finished: list[int] = []
        failed: list[int] = []
        for tid, p in list(self._pending.items()):
            if p.done_at_poll is None:
                if not self.device.query(p.event):
                    continue
                self.device.synchronize_event(p.event)
                self._free_events.append(p.event)
                p.done_at_poll = self._num_polls
            if self._num_polls - p.done_at_poll < delay:
                continue
            del self._pending[tid]
            (failed if p.fails else finished).append(tid)
        return finished, failed

    def flush(self) -> tuple[list[int], list[int]]:
        """Wait for every transfer in flight and report them all, delays ignored (preemption of
        their requests, shutdown)."""
        for p in self._pending.values():
            if p.done_at_poll is None:
                self.device.synchronize_event(p.event)
        self._num_polls += 1
        return self._report(0)
