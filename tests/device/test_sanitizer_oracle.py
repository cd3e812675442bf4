"""Hypothesis machine: random stream programs (launch, host access, record, wait, sync) whose
sanitizer verdicts must match a brute-force happens-before oracle: an explicit graph of host
program order, stream program order, launch and event edges, searched for reachability."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.device import HOST_STREAM, WHOLE, AccessSet, OpMeta, Sanitizer
from kvtier.ids import EventId, OpId, StreamId

NUM_STREAMS, NUM_EVENTS, NUM_BLOCKS = 3, 2, 3
Key = tuple[str, int]  # (buffer, block)
Flat = tuple[str, str, int, int, int]  # (kind, buffer, block, first op, second op)


class Oracle:
    """Happens-before as graph reachability; recomputes each check from scratch."""

    def __init__(self) -> None:
        self.preds: list[list[int]] = []
        self.host_last = self._node([])
        self.stream_last: dict[int, int | None] = dict.fromkeys(range(NUM_STREAMS))
        self.event_record: dict[int, int | None] = dict.fromkeys(range(NUM_EVENTS))
        # per block: (node, op id, actor, is_write) in program order
        self.history: dict[Key, list[tuple[int, int, int, bool]]] = {}
        self.expected: list[Flat] = []
        self.num_expected_reports = 0
        self.any_unordered_pair = False

    def _node(self, preds: list[int | None]) -> int:
        self.preds.append([p for p in preds if p is not None])
        return len(self.preds) - 1

    def _issue(self) -> int:
        self.host_last = self._node([self.host_last])
        return self.host_last

    def _ancestors(self, node: int) -> set[int]:
        seen, todo = set(), [node]
        while todo:
            for p in self.preds[todo.pop()]:
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
        return seen

    def launch(self, stream: int, op: int, access: dict[Key, bool]) -> None:
        issue = self._issue()
        node = self._node([issue, self.stream_last[stream]])
        self.stream_last[stream] = node
        self._access(node, op, stream, access)

    def host(self, op: int, access: dict[Key, bool]) -> None:
        self._access(self._issue(), op, HOST_STREAM, access)

    def record(self, event: int, stream: int) -> None:
        node = self._node([self._issue(), self.stream_last[stream]])
        self.stream_last[stream] = self.event_record[event] = node

    def wait(self, stream: int, event: int) -> None:
        node = self._node([self._issue(), self.stream_last[stream], self.event_record[event]])
        self.stream_last[stream] = node

    def sync(self, *sources: int | None) -> None:
        self.host_last = self._node([self.host_last, *sources])

    def _access(self, node: int, op: int, actor: int, access: dict[Key, bool]) -> None:
        before = self._ancestors(node)
        reports: set[tuple[str, str, int]] = set()
        for key, is_write in access.items():
            history = self.history.setdefault(key, [])
            for prev_node, _, _, prev_write in history:
                if (prev_write or is_write) and prev_node not in before:
                    self.any_unordered_pair = True
            last_write = max((i for i, h in enumerate(history) if h[3]), default=-1)
            relevant = [history[last_write]] if last_write >= 0 else []
            latest_read: dict[int, tuple[int, int, int, bool]] = {}
            for h in history[last_write + 1 :]:
                latest_read[h[2]] = h
            if is_write:
                relevant += latest_read.values()
            for prev_node, prev_op, _, prev_write in relevant:
                if prev_node not in before:
                    kind = ("WAW" if is_write else "RAW") if prev_write else "WAR"
                    self.expected.append((kind, key[0], key[1], prev_op, op))
                    reports.add((kind, key[0], prev_op))
            history.append((node, op, actor, is_write))
        self.num_expected_reports += len(reports)


blocks = st.sets(st.integers(0, NUM_BLOCKS - 1), max_size=NUM_BLOCKS)
token_use = st.sampled_from([None, "read", "write"])
streams = st.integers(0, NUM_STREAMS - 1)
events = st.integers(0, NUM_EVENTS - 1)


class SanitizerVersusOracle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.san = Sanitizer("collect", max_kept=10**6)
        for s in range(NUM_STREAMS):
            self.san.add_stream(StreamId(s), f"s{s}")
        self.oracle = Oracle()
        self.num_ops = 0

    def _access(
        self, reads: set[int], writes: set[int], tok: str | None
    ) -> tuple[AccessSet, dict[Key, bool]]:
        spec: dict[Key, bool] = {("device", b): b in writes for b in reads | writes}
        r: dict[str, list[int] | None] = {"device": sorted(reads)}
        w: dict[str, list[int] | None] = {"device": sorted(writes)}
        if tok is not None:
            (w if tok == "write" else r)["tok"] = None
            spec[("tok", WHOLE)] = tok == "write"
        # the sanitizer checks writes first, then reads: keep the oracle in the same order
        ordered = dict(sorted(spec.items(), key=lambda kv: not kv[1]))
        return AccessSet.of(r, w), ordered

    @rule(stream=streams, reads=blocks, writes=blocks, tok=token_use)
    def launch(self, stream: int, reads: set[int], writes: set[int], tok: str | None) -> None:
        self.num_ops += 1
        access, spec = self._access(reads, writes, tok)
        self.san.launch(StreamId(stream), OpId(self.num_ops), access, OpMeta("op"))
        self.oracle.launch(stream, self.num_ops, spec)

    @rule(reads=blocks, writes=blocks, tok=token_use)
    def host_access(self, reads: set[int], writes: set[int], tok: str | None) -> None:
        self.num_ops += 1
        access, spec = self._access(reads, writes, tok)
        self.san.host_access(OpId(self.num_ops), access, OpMeta("host"))
        self.oracle.host(self.num_ops, spec)

    @rule(event=events, stream=streams)
    def record(self, event: int, stream: int) -> None:
        self.san.record(EventId(event), StreamId(stream))
        self.oracle.record(event, stream)

    @rule(stream=streams, event=events)
    def wait(self, stream: int, event: int) -> None:
        self.san.wait(StreamId(stream), EventId(event))
        self.oracle.wait(stream, event)

    @rule(event=events)
    def sync_event(self, event: int) -> None:
        self.san.sync_event(EventId(event))
        self.oracle.sync(self.oracle.event_record[event])

    @rule(stream=streams)
    def sync_stream(self, stream: int) -> None:
        self.san.sync_stream(StreamId(stream))
        self.oracle.sync(self.oracle.stream_last[stream])

    @rule()
    def sync_all(self) -> None:
        self.san.sync_all()
        self.oracle.sync(*self.oracle.stream_last.values())

    @invariant()
    def reports_match_the_oracle(self) -> None:
        got = [
            (h.kind, h.buffer, block, h.first.op_id, h.second.op_id)
            for h in self.san.hazards
            for block in h.block_ids
        ]
        assert sorted(got) == sorted(self.oracle.expected)
        assert self.san.num_hazards == self.oracle.num_expected_reports

    @invariant()
    def any_hazard_iff_some_access_pair_is_unordered(self) -> None:
        assert (self.san.num_hazards > 0) == self.oracle.any_unordered_pair


TestSanitizerVersusOracle = SanitizerVersusOracle.TestCase
