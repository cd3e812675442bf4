"""Spec-named sanitizer scenarios over synthetic ids, each asserting the exact hazard or none."""

from __future__ import annotations

import pytest

from kvtier.device import (
    COMPUTE,
    LOAD,
    STORE,
    WHOLE,
    AccessSet,
    Hazard,
    OpMeta,
    RaceError,
    Sanitizer,
)
from kvtier.ids import EventId, OpId, StreamId

AUX = StreamId(3)


class Prog:
    """A tiny program writer: numbered ops on named streams, fed to one sanitizer."""

    def __init__(self, mode: str = "collect") -> None:
        self.san = Sanitizer(mode)  # type: ignore[arg-type]
        for sid, name in ((COMPUTE, "compute"), (LOAD, "load"), (STORE, "store"), (AUX, "aux")):
            self.san.add_stream(sid, name)
        self.num_ops = 0

    def op(
        self,
        stream: StreamId,
        label: str,
        *,
        step: int = 0,
        reqs: tuple[str, ...] = (),
        reads: dict[str, list[int] | None] | None = None,
        writes: dict[str, list[int] | None] | None = None,
    ) -> OpId:
        self.num_ops += 1
        self.san.launch(
            stream, OpId(self.num_ops), AccessSet.of(reads, writes), OpMeta(label, step, reqs)
        )
        return OpId(self.num_ops)

    def host(self, label: str, **kw: dict[str, list[int] | None]) -> OpId:
        self.num_ops += 1
        self.san.host_access(
            OpId(self.num_ops), AccessSet.of(kw.get("reads"), kw.get("writes")), OpMeta(label)
        )
        return OpId(self.num_ops)

    def forward(
        self, step: int, reqs: tuple[str, ...], reads: list[int], writes: list[int]
    ) -> OpId:
        return self.op(
            COMPUTE,
            "forward",
            step=step,
            reqs=reqs,
            reads={"device": reads},
            writes={"device": writes},
        )

    def store(self, step: int, dev: list[int], host: list[int]) -> OpId:
        return self.op(STORE, "store", step=step, reads={"device": dev}, writes={"host": host})

    def load(self, step: int, host: list[int], dev: list[int]) -> OpId:
        return self.op(LOAD, "load", step=step, reads={"host": host}, writes={"device": dev})

    def summary(self) -> list[tuple[str, str, tuple[int, ...], int, int]]:
        return [
            (h.kind, h.buffer, h.block_ids, h.first.op_id, h.second.op_id) for h in self.san.hazards
        ]


E1, E2 = EventId(1), EventId(2)


def test_store_before_the_writing_forward_is_raw_naming_both_ops() -> None:
    p = Prog()
    fwd = p.forward(5, ("a",), reads=[], writes=[3])
    st = p.store(5, [3], [0])
    assert p.summary() == [("RAW", "device", (3,), fwd, st)]
    h = p.san.hazards[0]
    assert (h.first.stream, h.first.meta.step_seq, h.first.meta.req_ids) == ("compute", 5, ("a",))
    assert (h.second.stream, h.second.meta.label) == ("store", "store")


def test_store_waiting_on_compute_done_is_clean() -> None:
    p = Prog()
    p.forward(5, ("a",), reads=[], writes=[3])
    p.san.record(E1, COMPUTE)
    p.san.wait(STORE, E1)
    p.store(5, [3], [0])
    assert p.summary() == []


def test_load_into_block_a_pending_forward_reads_is_war() -> None:
    p = Prog()
    fwd = p.forward(4, ("a",), reads=[7, 8], writes=[9])
    ld = p.load(5, [2], [7])
    assert p.summary() == [("WAR", "device", (7,), fwd, ld)]


def test_load_waiting_on_compute_done_is_clean() -> None:
    p = Prog()
    p.forward(4, ("a",), reads=[7], writes=[])
    p.san.record(E1, COMPUTE)
    p.san.wait(LOAD, E1)
    p.load(5, [2], [7])
    assert p.summary() == []


def test_forward_reading_a_block_before_its_load_lands_is_raw() -> None:
    p = Prog()
    ld = p.load(5, [2], [7])
    fwd = p.forward(5, ("b",), reads=[7], writes=[])
    assert p.summary() == [("RAW", "device", (7,), ld, fwd)]


@pytest.mark.parametrize("sync", ["event", "stream", "all"])
def test_host_sync_orders_later_launches_after_the_forward(sync: str) -> None:
    p = Prog()
    p.forward(4, ("a",), reads=[7], writes=[])
    p.san.record(E1, COMPUTE)
    {
        "event": lambda: p.san.sync_event(E1),
        "stream": lambda: p.san.sync_stream(COMPUTE),
        "all": p.san.sync_all,
    }[sync]()
    p.load(5, [2], [7])
    assert p.summary() == []


def test_host_sync_on_an_event_recorded_before_the_forward_orders_nothing() -> None:
    p = Prog()
    p.san.record(E1, COMPUTE)
    fwd = p.forward(4, ("a",), reads=[7], writes=[])
    p.san.sync_event(E1)
    ld = p.load(5, [2], [7])
    assert p.summary() == [("WAR", "device", (7,), fwd, ld)]


def test_ordering_is_transitive_through_a_third_stream() -> None:
    p = Prog()
    p.forward(4, ("a",), reads=[7], writes=[])
    p.san.record(E1, COMPUTE)
    p.san.wait(AUX, E1)
    p.op(AUX, "bookkeeping", reads={"host": [0]})
    p.san.record(E2, AUX)
    p.san.wait(LOAD, E2)
    p.load(5, [2], [7])
    assert p.summary() == []


def test_third_stream_recording_before_its_wait_does_not_pass_the_order_on() -> None:
    p = Prog()
    fwd = p.forward(4, ("a",), reads=[7], writes=[])
    p.san.record(E1, COMPUTE)
    p.san.record(E2, AUX)  # recorded before AUX waited on E1
    p.san.wait(AUX, E1)
    p.san.wait(LOAD, E2)
    ld = p.load(5, [2], [7])
    assert p.summary() == [("WAR", "device", (7,), fwd, ld)]


def test_expired_event_from_the_previous_step_does_not_order_the_next_forward() -> None:
    p = Prog()
    p.forward(4, ("a",), reads=[], writes=[3])
    p.san.record(E1, COMPUTE)  # compute-done of step 4
    fwd5 = p.forward(5, ("a",), reads=[], writes=[4])
    p.san.wait(STORE, E1)  # stale: recorded before step 5's forward
    st = p.store(5, [3, 4], [0, 1])
    assert p.summary() == [("RAW", "device", (4,), fwd5, st)]


def test_re_recorded_event_orders_after_its_new_record() -> None:
    p = Prog()
    p.forward(4, ("a",), reads=[], writes=[3])
    p.san.record(E1, COMPUTE)
    p.forward(5, ("a",), reads=[], writes=[4])
    p.san.record(E1, COMPUTE)  # re-recorded after step 5
    p.san.wait(STORE, E1)
    p.store(5, [3, 4], [0, 1])
    assert p.summary() == []


def test_wait_uses_the_record_current_at_wait_time_not_a_later_re_record() -> None:
    p = Prog()
    p.san.record(E1, COMPUTE)
    p.san.wait(STORE, E1)  # captures the empty record
    fwd = p.forward(5, ("a",), reads=[], writes=[4])
    p.san.record(E1, COMPUTE)  # too late for the wait above
    st = p.store(5, [4], [0])
    assert p.summary() == [("RAW", "device", (4,), fwd, st)]


def test_wait_on_a_never_recorded_event_orders_nothing() -> None:
    p = Prog()
    fwd = p.forward(5, ("a",), reads=[], writes=[4])
    p.san.wait(STORE, E2)
    st = p.store(5, [4], [0])
    assert p.summary() == [("RAW", "device", (4,), fwd, st)]


def test_wait_on_a_forgotten_event_orders_nothing() -> None:
    p = Prog()
    fwd = p.forward(5, ("a",), reads=[], writes=[4])
    p.san.record(E1, COMPUTE)
    p.san.forget_event(E1)
    p.san.wait(STORE, E1)
    st = p.store(5, [4], [0])
    assert p.summary() == [("RAW", "device", (4,), fwd, st)]


def test_concurrent_readers_are_not_a_hazard() -> None:
    p = Prog()
    p.forward(4, ("a",), reads=[7], writes=[])
    p.store(4, [7], [0])
    p.op(AUX, "probe", reads={"device": [7]})
    assert p.summary() == []


def test_write_after_concurrent_readers_names_each_unordered_reader() -> None:
    p = Prog()
    fwd = p.forward(4, ("a",), reads=[7], writes=[])
    p.store(4, [7], [0])
    p.san.record(E1, STORE)
    p.san.wait(LOAD, E1)  # ordered after the store only
    ld = p.load(5, [1], [7])
    assert p.summary() == [("WAR", "device", (7,), fwd, ld)]


def test_two_unordered_loads_into_one_block_are_waw() -> None:
    p = Prog()
    first = p.load(5, [1], [6])
    second = p.op(AUX, "load2", reads={"host": [2]}, writes={"device": [6]})
    assert p.summary() == [("WAW", "device", (6,), first, second)]


def test_one_hazard_per_op_pair_lists_every_block() -> None:
    p = Prog()
    fwd = p.forward(4, ("a", "b"), reads=[1, 2, 3], writes=[])
    ld = p.load(5, [0, 1, 2], [1, 2, 3])
    assert p.summary() == [("WAR", "device", (1, 2, 3), fwd, ld)]


def test_op_reading_and_writing_one_block_is_no_self_hazard() -> None:
    p = Prog()
    p.forward(4, ("a",), reads=[5], writes=[5])
    p.forward(5, ("a",), reads=[5], writes=[5])
    assert p.summary() == []


def test_host_read_of_sampled_tokens_needs_a_sync() -> None:
    p = Prog()
    cp = p.op(COMPUTE, "sampled-copy", step=5, writes={"sampled_tokens": None})
    rd = p.host("read-sampled", reads={"sampled_tokens": None})
    assert p.summary() == [("RAW", "sampled_tokens", (WHOLE,), cp, rd)]
    p.san.record(E1, COMPUTE)
    p.san.sync_event(E1)
    p.host("read-sampled", reads={"sampled_tokens": None})
    assert len(p.summary()) == 1


def test_host_poison_of_a_block_a_pending_forward_reads_is_war() -> None:
    p = Prog()
    fwd = p.forward(4, ("a",), reads=[7], writes=[])
    poison = p.host("poison", writes={"device": [7]})
    assert p.summary() == [("WAR", "device", (7,), fwd, poison)]


def test_launch_is_ordered_after_an_earlier_host_write() -> None:
    p = Prog()
    p.host("poison", writes={"device": [7]})
    p.forward(5, ("b",), reads=[7], writes=[7])
    assert p.summary() == []


def test_raise_mode_raises_race_error_naming_both_ops() -> None:
    p = Prog("raise")
    p.forward(5, ("req-a",), reads=[], writes=[3])
    with pytest.raises(RaceError) as info:
        p.store(5, [3], [0])
    (hazard,) = info.value.hazards
    assert isinstance(hazard, Hazard) and hazard.kind == "RAW"
    text = str(info.value)
    for part in ("RAW", "'forward'", "'store'", "step 5", "req-a", "compute", "device[3]"):
        assert part in text


def test_collect_mode_counts_every_hazard_and_keeps_at_most_max_kept() -> None:
    san = Sanitizer("collect", max_kept=2)
    for i in range(5):
        san.launch(COMPUTE, OpId(2 * i + 1), AccessSet.of(writes={"device": [i]}), OpMeta("w"))
        san.launch(STORE, OpId(2 * i + 2), AccessSet.of(reads={"device": [i]}), OpMeta("r"))
    assert san.counts == {"RAW": 5, "WAR": 0, "WAW": 0}
    assert san.num_hazards == 5 and len(san.hazards) == 2
    assert san.num_accesses == 10


def test_bad_mode_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="raise"):
        Sanitizer("loud")  # type: ignore[arg-type]
