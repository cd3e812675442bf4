"""Block lifetimes of scheduled requests: when window blocks are pruned, full blocks published,
and a request's table freed — all through `KVCacheManager`, stamped for its quarantine.

Never picks requests. `SettledLifetimes` is the safe basis (architecture.md §Settled);
`OptimisticLifetimes` keeps the optimistic basis on purpose, to reproduce hazards (the scheduler's
`settled=False` switch).
"""

from __future__ import annotations

from kvtier.kv.manager import KVCacheManager
from kvtier.kv.specs import ChunkedLocal, FullAttention, KVSpec, Mamba, SlidingWindow
from kvtier.sched.request import Request

NEVER = 1 << 62


def next_prune_basis(spec: KVSpec, basis: int) -> int:
    """Smallest token count above `basis` at which `spec` may skip one more block (a lower
    bound: pruning there may free nothing, but never is there anything to free before it)."""
    bs = spec.block_size
    if isinstance(spec, SlidingWindow):
        return (max(0, basis - spec.window + 1) // bs + 1) * bs + spec.window - 1
    if isinstance(spec, ChunkedLocal):
        return (basis // spec.chunk + 1) * spec.chunk
    if isinstance(spec, Mamba):
        return (max(0, basis - 1) // bs + 1) * bs + 1
    return NEVER  # full attention never skips


class SettledLifetimes:
    """Prune on the settled count: every unprocessed step queries positions ≥ settled, so no such
    step reads a pruned block and its last toucher is already processed (free at once)."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.specs = list(kv.specs)
        self.has_windows = not all(isinstance(s, FullAttention) for s in self.specs)
        self.block_sizes = [s.block_size for s in self.specs]
        # With prefix caching, Mamba groups record a snapshot when a processed step ends on
        # their block boundary (architecture.md §Snapshots, §Rollback).
        self.snapshot_sizes = (
            [s.block_size for s in self.specs if isinstance(s, Mamba)] if kv.enable_caching else []
        )
        self.cache_unit = kv.hasher.block_size  # every group caches whole multiples of it

    def basis(self, request: Request, processed_step_seq: int) -> tuple[int, int]:
        """(token count to prune at, step stamp for the quarantine).

        A step launched while earlier drafts were unverified cannot know where it starts, so it
        declares (and may gather) its window from the lowest start a rollback allows — below
        the settled count once those drafts verify, even if it has no drafts of its own. Pruned
        blocks are therefore stamped with the latest unprocessed step that declared a start below
        the basis (held by the quarantine until it is processed); with none, freed at once.
        """
        basis = request.num_settled_tokens
        stamp = processed_step_seq
        for record in request.ledger.records:  # at most async_depth records
            low = record.lowest_write
            if low is not None and low < basis and record.step_seq > stamp:
                stamp = record.step_seq
        return basis, stamp

    def prune_due(self, request: Request) -> bool:
        """True if `prune` would call the KV manager now: a window crossed a block (no side
        effects; it may still free nothing)."""
        return self.has_windows and self.basis(request, 0)[0] >= request.prune_at

    def prune(self, request: Request, processed_step_seq: int) -> None:
        """Free blocks out of every window (mutates the table; calls the KV manager only when a
        window has crossed a block since the last call)."""
        if not self.has_windows:
            return
        basis, stamp = self.basis(request, processed_step_seq)
        if basis >= request.prune_at:
            request.prune_at = min(next_prune_basis(spec, basis) for spec in self.specs)
            self.kv.remove_skipped_blocks(request.request_id, basis, stamp)

    def cache(self, request: Request) -> None:
        """Publish blocks whose tokens are known and whose KV a scheduled step writes."""
        num_tokens = min(request.num_computed_tokens, request.num_tokens)
        unit = self.cache_unit
        if num_tokens // unit > request.cached_basis // unit:  # a block boundary was crossed
            request.cached_basis = num_tokens
            self.kv.cache_blocks(request, num_tokens)

    def verified(self, request: Request) -> None:
        """A step of the request's current incarnation was processed: its settled count is
        now exactly what the device holds. A state group whose block ends there keeps it as a
        prefix-cache snapshot (`KVCacheManager.cache_verified`; call after the step's tokens
        are delivered, so the block's hash is known)."""
        settled = request.num_settled_tokens
        if any(settled % bs == 0 for bs in self.snapshot_sizes):
            self.kv.cache_verified(request, settled)

    def align_chunk(self, start: int, num_new_tokens: int) -> int:
        """Tokens of a prefill chunk from `start`: cut at the last state-block boundary inside
        it, so that every chunk of a prompt leaves a snapshot a prefix hit can restore
        (architecture.md §Snapshots); unchanged when it holds no boundary (no side effects)."""
        for bs in self.snapshot_sizes:
            end = (start + num_new_tokens) // bs * bs
            if end > start:
                num_new_tokens = end - start
        return num_new_tokens

    def needs_allocation(self, request: Request, end: int) -> bool:
        """True unless the tables already cover positions < `end` (then `allocate_slots` would
        change nothing)."""
        return end > request.num_slot_tokens

    def num_slot_tokens(self, num_tokens: int) -> int:
        """Positions covered once every group's table holds `num_tokens` (whole blocks)."""
        return min(-(-num_tokens // bs) * bs for bs in self.block_sizes)

    def free(self, request: Request) -> None:
        """Drop the request's table (mutates), quarantined until its last scheduled step is
        processed, and forget the memos kept for it."""
        self.kv.free(request.request_id, request.last_sched_seq)
        request.prune_at = request.cached_basis = request.num_slot_tokens = 0


class OptimisticLifetimes(SettledLifetimes):
    """The optimistic basis: prune on `num_computed_tokens`. Steps up to the request's last one may
    still read what it frees, so that is the stamp; spec rollbacks can still expose nulls
    (architecture.md §H4)."""

    def basis(self, request: Request, processed_step_seq: int) -> tuple[int, int]:
        return request.num_computed_tokens, request.last_sched_seq
