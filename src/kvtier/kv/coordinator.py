"""Hybrid coordinator: one manager per KV-cache group over one shared pool; one common hit length.

Applies every operation to every group; owns nothing a single group could decide alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvtier.ids import BlockHash, ReqId
from kvtier.kv.block import KVBlock
from kvtier.kv.block_pool import BlockPool
from kvtier.kv.single_type import FullAttentionManager, SingleTypeManager, make_manager
from kvtier.kv.specs import ChunkedLocal, KVSpec, validate_spec

GroupBlocks = list[list[KVBlock]]  # one block list per group


def check_alignment(specs: Sequence[KVSpec]) -> int:
    """The groups' common alignment (lcm of their block sizes: every hit is a multiple of it);
    raises ValueError naming --block-size if an attention chunk is not a multiple of it."""
    alignment = math.lcm(*(s.block_size for s in specs))
    for spec in specs:
        if isinstance(spec, ChunkedLocal) and spec.chunk % alignment:
            raise ValueError(
                f"attention chunk {spec.chunk} must be a multiple of the block size "
                f"{alignment} (lcm of all groups' block sizes); change --block-size"
            )
    return alignment


class KVCacheCoordinator:
    def __init__(self, specs: Sequence[KVSpec], pool: BlockPool) -> None:
        if not specs:
            raise ValueError("a model needs at least one KV-cache group (attention spec)")
        for spec in specs:
            validate_spec(spec)
        self.specs = list(specs)
        self.pool = pool
        self.managers: list[SingleTypeManager] = [
            make_manager(s, pool, g) for g, s in enumerate(specs)
        ]
        sizes = [s.block_size for s in specs]
        self.hash_block_size = math.gcd(*sizes)  # hashes are kept at the finest granularity
        self.alignment = check_alignment(specs)
        self._ratios = [bs // self.hash_block_size for bs in sizes]
        # Full attention first: its left-to-right scan bounds the hit cheaply, then only truncates.
        self._lookup_order = sorted(
            range(len(specs)), key=lambda g: not isinstance(self.managers[g], FullAttentionManager)
        )

    @property
    def num_requests(self) -> int:
        return len(self.managers[0].req_to_blocks)

    def has_request(self, req_id: ReqId) -> bool:
        return req_id in self.managers[0].req_to_blocks

    def group_hashes(self, block_hashes: Sequence[BlockHash]) -> list[Sequence[BlockHash]]:
        """Each group's view of the fine hashes: the hash ending at each of its block boundaries."""
        views: dict[int, Sequence[BlockHash]] = {1: block_hashes}
        for m in self._ratios:
            if m not in views:
                views[m] = [block_hashes[(i + 1) * m - 1] for i in range(len(block_hashes) // m)]
        return [views[m] for m in self._ratios]

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[GroupBlocks, int]:
        """Hit blocks per group and the one hit length (tokens) every group can serve.

        Fixed point: each group's lookup is bounded by the current common length until a whole
        pass leaves it unchanged; partial hits (one group restored further than another) never leave.
        """
        views = self.group_hashes(block_hashes)
        length = max_length // self.alignment * self.alignment
        hits: list[list[KVBlock] | None] = [None] * len(self.managers)
        changed = True
        while changed and length > 0:
            changed = False
            for g in self._lookup_order:
                mgr = self.managers[g]
                found = hits[g]
                if found is not None and isinstance(mgr, FullAttentionManager):
                    del found[length // mgr.block_size :]  # full-attention hits are prefix-closed
                    continue
                found = hits[g] = mgr.find_longest_cache_hit(views[g], length, self.alignment)
                hit_length = len(found) * mgr.block_size
                if hit_length < length:
                    length, changed = hit_length, True
        result = [h[: length // m.block_size] if h else [] for h, m in zip(hits, self.managers)]
        return result, length

    def num_blocks_to_allocate(
        self, req_id: ReqId, num_tokens: int, hits: GroupBlocks, total_computed_tokens: int
    ) -> int:
        return sum(
            m.num_blocks_to_allocate(req_id, num_tokens, h, total_computed_tokens)
            for m, h in zip(self.managers, hits)
        )

    def add_computed_blocks(self, req_id: ReqId, hits: GroupBlocks, total_computed: int) -> None:
        # Every group touches its hits before any group allocates, so no allocation evicts a hit.
        for m, h in zip(self.managers, hits):
            m.add_computed_blocks(req_id, h, total_computed)

    def allocate_new_blocks(
        self, req_id: ReqId, num_tokens: int, total_computed_tokens: int
    ) -> GroupBlocks:
        return [
            m.allocate_new_blocks(req_id, num_tokens, total_computed_tokens) for m in self.managers
        ]

    def cache_blocks(
        self,
        req_id: ReqId,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        token_ids: Sequence[int],
    ) -> None:
        for m, view in zip(self.managers, self.group_hashes(block_hashes)):
            m.cache_blocks(req_id, view, num_tokens, token_ids)

    def mark_snapshots(self, req_id: ReqId, num_tokens: int) -> None:
        for m in self.managers:
            m.mark_snapshot(req_id, num_tokens)

    def remove_skipped_blocks(
        self, req_id: ReqId, num_settled_tokens: int, last_step_seq: int | None
    ) -> int:
        return sum(
            m.remove_skipped_blocks(req_id, num_settled_tokens, last_step_seq)
            for m in self.managers
        )

    def free(self, req_id: ReqId, last_step_seq: int | None) -> None:
        for m in self.managers:
            m.free(req_id, last_step_seq)

    def get_blocks(self, req_id: ReqId) -> GroupBlocks:
        return [m.req_to_blocks.get(req_id, []) for m in self.managers]
