"""Host hits that extend a device hit: the longest aligned boundary L > device hit at which every
group finds, in the host cache, each block a step starting at L reads beyond the device hit.

Unlike a lookup from token 0, blocks the device already serves need not be on the host: a host
tier that evicted a hot prefix (the device keeps serving it) still restores the blocks after it.
One boundary for all groups or no hit (architecture.md §H6). Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.ids import BlockHash
from kvtier.kv.block import KVBlock
from kvtier.kv.specs import FullAttention, KVSpec
from kvtier.offload.context import HostContext

HostHit = list[dict[int, KVBlock]]  # per group: table position -> host block to load


def needed_positions(spec: KVSpec, num_device_hit: int, boundary: int) -> range:
    """Table positions ≥ the device hit that a step starting at `boundary` reads (window and
    chunk groups skip what the table nulls; a state group needs its last block only)."""
    bs = spec.block_size
    first, last = num_device_hit // bs, boundary // bs
    if isinstance(spec, FullAttention):
        return range(first, last)
    return range(max(first, spec.num_skipped_tokens(boundary) // bs), last)


def extend_device_hit(
    ctx: HostContext, block_hashes: Sequence[BlockHash], num_device_hit: int, max_length: int
) -> tuple[HostHit, int]:
    """(host blocks per group, boundary L) with num_device_hit < L ≤ max_length, or ([], 0)."""
    align = ctx.coordinator.alignment
    views = ctx.coordinator.group_hashes(block_hashes)
    get = ctx.host.get
    hi = max_length // align * align
    full: dict[int, list[KVBlock]] = {}
    for g, spec in enumerate(ctx.specs):  # prefix-closed groups bound L in one scan
        if not isinstance(spec, FullAttention):
            continue
        bs, run = spec.block_size, []
        for pos in range(num_device_hit // bs, min(hi // bs, len(views[g]))):
            block = get((g, views[g][pos]))
            if block is None:
                break
            run.append(block)
        full[g] = run
        hi = min(hi, (num_device_hit // bs + len(run)) * bs // align * align)
    boundary = hi
    while boundary > num_device_hit:
        hit: HostHit = []
        for g, spec in enumerate(ctx.specs):
            positions = needed_positions(spec, num_device_hit, boundary)
            if g in full:
                base = num_device_hit // spec.block_size
                hit.append({p: full[g][p - base] for p in positions})
                continue
            found: dict[int, KVBlock] = {}
            for p in positions:
                block = get((g, views[g][p])) if p < len(views[g]) else None
                if block is None:
                    break
                found[p] = block
            if len(found) < len(positions):
                break
            hit.append(found)
        if len(hit) == len(ctx.specs):
            return hit, boundary
        boundary -= align
    return [], 0
