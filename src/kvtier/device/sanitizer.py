"""Happens-before race sanitizer: vector clocks for each stream and the host, checked on every
declared block access. Torch-free and device-independent: it sees only the launch, record, wait
and synchronise calls a backend forwards, so a CPU run and a GPU run check the same discipline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvtier.device.types import HOST_STREAM, AccessSet, OpMeta
from kvtier.ids import BlockId, EventId, OpId, StreamId

HazardKind = Literal["RAW", "WAR", "WAW"]
SanitizerMode = Literal["raise", "collect"]
_HOST = 0  # actor index of the host

# One access: (actor index, the actor's clock value at the access, op id, metadata).
_Ref = tuple[int, int, OpId, OpMeta]


@dataclass(frozen=True, slots=True)
class OpInfo:
    """One side of a hazard: the op, the stream it ran on and its metadata."""

    op_id: OpId
    stream: str
    meta: OpMeta

    def describe(self) -> str:
        """One line naming the op, its label, step, requests and stream."""
        return f"op {self.op_id} {self.meta.describe()} on stream {self.stream}"


@dataclass(frozen=True, slots=True)
class Hazard:
    """Two accesses to the same blocks not ordered by happens-before.

    `first` was launched earlier in host program order; `kind` is named from first to second
    (RAW: first wrote, second read).
    """

    kind: HazardKind
    buffer: str
    block_ids: tuple[BlockId, ...]
    first: OpInfo
    second: OpInfo

    def describe(self) -> str:
        """The report: kind, blocks, both ops and the fix."""
        verb = {"RAW": ("wrote", "reads"), "WAR": ("read", "writes"), "WAW": ("wrote", "writes")}
        did, does = verb[self.kind]
        return (
            f"{self.kind} on {self.buffer}{list(self.block_ids)}: {self.second.describe()} "
            f"{does} what {self.first.describe()} {did}, with no happens-before edge between "
            f"them; make the second wait on an event recorded after the first, or sync the host"
        )


class RaceError(RuntimeError):
    """Raised by a sanitizer in "raise" mode; `hazards` are the hazards of the offending op."""

    def __init__(self, hazards: list[Hazard]) -> None:
        super().__init__("\n".join(h.describe() for h in hazards))
        self.hazards = hazards


class _Cell:
    """Access history of one block: the last write and the latest read per actor since."""

    __slots__ = ("reads", "write")

    def __init__(self) -> None:
        self.write: _Ref | None = None
        # INVARIANT: every read here came after `write` in host program order.
        self.reads: dict[int, _Ref] = {}


class Sanitizer:
    """Checks every declared access against the block's last write and the reads since.

    Mode "raise" raises `RaceError` at the first op with a hazard; "collect" counts every hazard
    and keeps the first `max_kept` in `hazards`. Streams are registered on first use.
    """

    def __init__(self, mode: SanitizerMode = "raise", max_kept: int = 1000) -> None:
        if mode not in ("raise", "collect"):
            raise ValueError(f"sanitizer mode must be 'raise' or 'collect', got {mode!r}")
        self.mode: SanitizerMode = mode
        self.max_kept = max_kept
        self.hazards: list[Hazard] = []
        self.counts: dict[HazardKind, int] = {"RAW": 0, "WAR": 0, "WAW": 0}
        self.num_accesses = 0
        self._actor_of: dict[StreamId, int] = {HOST_STREAM: _HOST}
        self._names: list[str] = ["host"]
        self._clocks: list[list[int]] = [[0]]  # INVARIANT: clock i has one entry per actor
        self._events: dict[EventId, list[int]] = {}
        self._cells: dict[str, dict[BlockId, _Cell]] = {}

    @property
    def num_hazards(self) -> int:
        """Hazards found so far, kept or not."""
        return sum(self.counts.values())

    def add_stream(self, stream: StreamId, name: str) -> None:
        """Register `stream` under `name` for reports; a no-op if it is known."""
        if stream in self._actor_of:
            return
        self._actor_of[stream] = len(self._names)
        self._names.append(name)
        for clock in self._clocks:
            clock.append(0)
        self._clocks.append(list(self._clocks[_HOST]))  # a new stream starts after the host

    def launch(self, stream: StreamId, op_id: OpId, access: AccessSet, meta: OpMeta) -> None:
        """An op is launched on `stream`: it is ordered after everything the host knows."""
        actor = self._actor(stream)
        clock = self._clocks[actor]
        _merge(clock, self._clocks[_HOST])
        clock[actor] += 1
        self._check(clock, (actor, clock[actor], op_id, meta), access)

    def host_access(self, op_id: OpId, access: AccessSet, meta: OpMeta) -> None:
        """The host itself reads or writes blocks (e.g. reads sampled tokens, poisons a block)."""
        clock = self._clocks[_HOST]
        clock[_HOST] += 1
        self._check(clock, (_HOST, clock[_HOST], op_id, meta), access)

    def record(self, event: EventId, stream: StreamId) -> None:
        """Snapshot `stream`'s clock into `event`, replacing any earlier record."""
        clock = self._clocks[self._actor(stream)]
        _merge(clock, self._clocks[_HOST])
        self._events[event] = list(clock)

    def wait(self, stream: StreamId, event: EventId) -> None:
        """Later work on `stream` is ordered after the event's last record (none: no edge)."""
        clock = self._clocks[self._actor(stream)]
        _merge(clock, self._clocks[_HOST])
        snapshot = self._events.get(event)
        if snapshot is not None:
            _merge(clock, snapshot)

    def forget_event(self, event: EventId) -> None:
        """Drop `event`'s snapshot; a later wait on it orders nothing, as if never recorded."""
        self._events.pop(event, None)

    def sync_event(self, event: EventId) -> None:
        """The host waited for `event`: it is ordered after the event's last record."""
        snapshot = self._events.get(event)
        if snapshot is not None:
            _merge(self._clocks[_HOST], snapshot)

    def sync_stream(self, stream: StreamId) -> None:
        """The host waited for all work launched so far on `stream`."""
        _merge(self._clocks[_HOST], self._clocks[self._actor(stream)])

    def sync_all(self) -> None:
        """The host waited for every stream."""
        host = self._clocks[_HOST]
        for clock in self._clocks[1:]:
            _merge(host, clock)

    def _actor(self, stream: StreamId) -> int:
        actor = self._actor_of.get(stream)
        if actor is None:
            self.add_stream(stream, f"stream{stream}")
            actor = self._actor_of[stream]
        return actor

    def _check(self, clock: list[int], ref: _Ref, access: AccessSet) -> None:
        found: dict[tuple[HazardKind, OpId, str], tuple[_Ref, list[BlockId]]] = {}
        actor = ref[0]
        num = 0
        for buffer, block_ids in access.writes:
            cells = self._cells.setdefault(buffer, {})
            num += len(block_ids)
            for block in block_ids:
                cell = cells.get(block)
                if cell is None:
                    cell = cells[block] = _Cell()
                else:
                    prev = cell.write
                    if prev is not None and prev[2] != ref[2] and clock[prev[0]] < prev[1]:
                        _note(found, "WAW", buffer, prev, block)
                    for reader, read in cell.reads.items():
                        if reader != actor and clock[reader] < read[1]:
                            _note(found, "WAR", buffer, read, block)
                    cell.reads.clear()
                cell.write = ref
        for buffer, block_ids in access.reads:
            cells = self._cells.setdefault(buffer, {})
            num += len(block_ids)
            for block in block_ids:
                cell = cells.get(block)
                if cell is None:
                    cell = cells[block] = _Cell()
                else:
                    prev = cell.write
                    if prev is not None and clock[prev[0]] < prev[1]:
                        _note(found, "RAW", buffer, prev, block)
                    elif prev is ref:
                        continue  # this op also writes the block
                cell.reads[actor] = ref
        self.num_accesses += num
        if found:
            self._report(ref, found)

    def _report(
        self, ref: _Ref, found: dict[tuple[HazardKind, OpId, str], tuple[_Ref, list[BlockId]]]
    ) -> None:
        second = self._info(ref)
        hazards = [
            Hazard(kind, buffer, tuple(blocks), self._info(prev), second)
            for (kind, _, buffer), (prev, blocks) in found.items()
        ]
        for hazard in hazards:
            self.counts[hazard.kind] += 1
        room = self.max_kept - len(self.hazards)
        self.hazards.extend(hazards[: max(room, 0)])
        if self.mode == "raise":
            raise RaceError(hazards)

    def _info(self, ref: _Ref) -> OpInfo:
        return OpInfo(ref[2], self._names[ref[0]], ref[3])


def _note(
    found: dict[tuple[HazardKind, OpId, str], tuple[_Ref, list[BlockId]]],
    kind: HazardKind,
    buffer: str,
    prev: _Ref,
    block: BlockId,
) -> None:
    entry = found.get((kind, prev[2], buffer))
    if entry is None:
        found[(kind, prev[2], buffer)] = (prev, [block])
    else:
        entry[1].append(block)


def _merge(into: list[int], other: list[int]) -> None:
    for i, value in enumerate(other):
        if value > into[i]:
            into[i] = value
