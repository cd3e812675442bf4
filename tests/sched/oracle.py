"""Access oracle for fake runs: which blocks each unprocessed step may touch, and what it read.

Checks invariant I2 (no block handed out by allocation — a table's fresh block or a load's
destination — while an unprocessed step may read or write it), hazard H1 (no store reads a block
an unprocessed step still writes) and, per executed step, I4 (every block inside the attention
window of the step's queries is real); architecture.md §Invariants, §H1.
Records violations; never changes scheduler or KV state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.kv.specs import KVSpec, Mamba
from kvtier.sched.output import BlockIds, SchedulerOutput

NULL_BLOCK_ID = 0


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant, with enough context to find it."""

    invariant: str  # "I2", "H1" or "I4"
    step_seq: int  # the step being scheduled (H1, I2) or executed (I4)
    req_id: str  # the request that received (I2), stored (H1) or read (I4) the block
    detail: str  # block ids, groups, positions


class AccessOracle:
    """Tracks, per dispatched-but-unprocessed step, the blocks inside its queries' windows.

    A step with queries at device positions [start, end) may read or write, per group, the table
    positions from the first block its first query sees up to the block of its last query; it
    writes the positions of [start, end). A step launched while drafts were unverified declares
    its window from a lower start: what it may touch is counted from there.

    `host_tables(req_id)` returns the scheduler's current tables (the truth at schedule time,
    nulls included), which the runner's diff-built tables are checked against.
    """

    def __init__(self, specs: Sequence[KVSpec], host_tables: Callable[[str], BlockIds]) -> None:
        self.specs = list(specs)
        self.host_tables = host_tables
        self.pending: dict[int, set[int]] = {}  # step seq → block ids it may read or write
        self.writes: dict[int, set[int]] = {}  # step seq → block ids it writes
        self.violations: list[Violation] = []

    def on_schedule(self, output: SchedulerOutput) -> None:
        """Check every freshly allocated block and load destination of `output` against the
        unprocessed steps (I2), and every store source against their writes (H1)."""
        if not self.pending:
            return
        busy: set[int] = set().union(*self.pending.values())
        fresh: list[tuple[str, int]] = []
        for new in output.scheduled_new_reqs:
            for spec, ids in zip(self.specs, new.block_ids, strict=True):
                num_hit_blocks = new.num_computed_tokens // spec.block_size  # hits: read-only
                fresh.extend((new.req_id, b) for b in ids[num_hit_blocks:])
        for cached in output.scheduled_cached_reqs:
            for ids in cached.new_block_ids:
                fresh.extend((cached.req_id, b) for b in ids)
        for t in output.planned_transfers:  # a load writes its destinations on another stream
            if t.is_load:
                fresh.extend((t.req_id, b) for b in t.dst_block_ids)
        for req_id, block_id in fresh:
            if block_id != NULL_BLOCK_ID and block_id in busy:
                steps = sorted(s for s, ids in self.pending.items() if block_id in ids)
                self.violations.append(
                    Violation("I2", output.step_seq, req_id, f"block {block_id} busy in {steps}")
                )
        written: set[int] = set().union(*self.writes.values())
        for t in output.planned_transfers:
            for block_id in [] if t.is_load else t.src_block_ids:
                if block_id in written:
                    steps = sorted(s for s, ids in self.writes.items() if block_id in ids)
                    self.violations.append(
                        Violation(
                            "H1",
                            output.step_seq,
                            t.req_id,
                            f"store reads block {block_id} written in {steps}",
                        )
                    )

    def on_execute(
        self,
        step_seq: int,
        req_id: str,
        runner_tables: list[list[int]],
        start: int,
        end: int,
        declared_start: int | None = None,
    ) -> None:
        """Record what step `step_seq` of `req_id` may touch; check its windows (I4).

        `start`/`end`: the device positions of the step's first and one-past-last query;
        `declared_start`: the lowest start the step was launched with (default `start`).
        """
        host = self.host_tables(req_id)
        touched = self.pending.setdefault(step_seq, set())
        writes = self.writes.setdefault(step_seq, set())
        low = start if declared_start is None else min(start, declared_start)
        for g, (spec, table) in enumerate(zip(self.specs, host, strict=True)):
            mine = runner_tables[g]
            for i, block_id in enumerate(table):
                assert block_id == NULL_BLOCK_ID or (i < len(mine) and mine[i] == block_id), (
                    f"step {step_seq}: runner table of {req_id} group {g} drifted at {i}"
                )
            bs = spec.block_size
            lo, hi = spec.num_skipped_tokens(start) // bs, (end - 1) // bs
            window = [table[i] if i < len(table) else NULL_BLOCK_ID for i in range(lo, hi + 1)]
            declared = range(spec.num_skipped_tokens(low) // bs, min(hi + 1, len(table)))
            touched.update(table[i] for i in declared if table[i] != NULL_BLOCK_ID)
            owned = range(low // bs, min(hi + 1, len(table)))
            writes.update(table[i] for i in owned if table[i] != NULL_BLOCK_ID)
            if isinstance(spec, Mamba):
                continue  # only the live state block is real by design
            nulls = [lo + j for j, b in enumerate(window) if b == NULL_BLOCK_ID]
            if nulls:
                self.violations.append(
                    Violation(
                        "I4",
                        step_seq,
                        req_id,
                        f"group {g} queries [{start},{end}) read null positions {nulls}",
                    )
                )

    def on_processed(self, step_seq: int) -> None:
        """The host processed `step_seq`: its blocks may be reused from now on."""
        self.pending.pop(step_seq, None)
        self.writes.pop(step_seq, None)
