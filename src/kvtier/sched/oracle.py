"""Access oracle for fake runs: which blocks each unprocessed step may touch, and what it read.

Checks invariant I2 (no block handed out by allocation while an unprocessed step may read or write
it) and, per executed step, I4 (every block inside the attention window of the step's queries is
real); architecture.md §Invariants.
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

    invariant: str  # "I2" or "I4"
    step_seq: int  # the step being scheduled (I2) or executed (I4)
    req_id: str  # the request that received (I2) or read (I4) the block
    detail: str  # block ids, groups, positions


class AccessOracle:
    """Tracks, per dispatched-but-unprocessed step, the blocks inside its queries' windows.

    A step with queries at device positions [start, end) may read or write, per group, the table
    positions from the first block its first query sees up to the block of its last query.

    `host_tables(req_id)` returns the scheduler's current tables (the truth at schedule time,
    nulls included), which the runner's diff-built tables are checked against.
    """

    def __init__(self, specs: Sequence[KVSpec], host_tables: Callable[[str], BlockIds]) -> None:
        self.specs = list(specs)
        self.host_tables = host_tables
        self.pending: dict[int, set[int]] = {}  # step seq → block ids it may read or write
        self.violations: list[Violation] = []

    def on_schedule(self, output: SchedulerOutput) -> None:
        """Check every freshly allocated block of `output` against unprocessed steps (I2)."""
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
        for req_id, block_id in fresh:
            if block_id != NULL_BLOCK_ID and block_id in busy:
                steps = sorted(s for s, ids in self.pending.items() if block_id in ids)
                self.violations.append(
                    Violation("I2", output.step_seq, req_id, f"block {block_id} busy in {steps}")
                )

    def on_execute(
        self, step_seq: int, req_id: str, runner_tables: list[list[int]], start: int, end: int
    ) -> None:
        """Record what step `step_seq` of `req_id` may touch; check its windows (I4).

        `start`/`end`: the device positions of the step's first and one-past-last query.
        """
        host = self.host_tables(req_id)
        touched = self.pending.setdefault(step_seq, set())
        for g, (spec, table) in enumerate(zip(self.specs, host, strict=True)):
            mine = runner_tables[g]
            for i, block_id in enumerate(table):
                assert block_id == NULL_BLOCK_ID or (i < len(mine) and mine[i] == block_id), (
                    f"step {step_seq}: runner table of {req_id} group {g} drifted at {i}"
                )
            bs = spec.block_size
            lo, hi = spec.num_skipped_tokens(start) // bs, (end - 1) // bs
            window = [table[i] if i < len(table) else NULL_BLOCK_ID for i in range(lo, hi + 1)]
            touched.update(b for b in window if b != NULL_BLOCK_ID)
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
