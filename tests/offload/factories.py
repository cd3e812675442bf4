"""One-line factories for the host-tier tests: a device manager, a tier, requests and steps."""

from __future__ import annotations

import itertools
from typing import Any

from kvtier.kv import FullAttention, KVCacheManager, KVSpec
from kvtier.offload import HostTier, Transfer
from kvtier.sched.request import Request, StepRecord

_fresh = itertools.count(2_000_000)


def device(num_blocks: int = 16, specs: list[KVSpec] | None = None, **kw: Any) -> KVCacheManager:
    return KVCacheManager(specs or [FullAttention(16)], num_blocks, max_model_len=4096, **kw)


def tier(dev: KVCacheManager, num_host_blocks: int = 8, **kw: Any) -> HostTier:
    return HostTier(dev, num_host_blocks, **kw)


def tokens(n: int) -> list[int]:
    """`n` token ids that match nothing else built here."""
    return [next(_fresh) for _ in range(n)]


def request(dev: KVCacheManager, rid: str, toks: list[int]) -> Request:
    return Request(rid, toks, hasher=dev.hasher)


def run(dev: KVCacheManager, req: Request, settle: bool = True, step: int = 1) -> None:
    """Allocate and compute the whole prompt (device hits included); settled unless told."""
    hits, num_hit = dev.get_computed_blocks(req)
    n = req.num_tokens - num_hit
    got = dev.allocate_slots(req, n, num_new_computed_tokens=num_hit, new_computed_blocks=hits)
    assert got is not None, req.request_id
    req.num_computed_tokens = req.num_tokens
    if not settle:
        req.ledger.append(StepRecord(step, n, 0, 1))


def admit_with_load(
    dev: KVCacheManager, t: HostTier, req: Request, max_external: int | None = None
) -> Transfer | None:
    """Device lookup, host lookup, allocation with external tokens, load planning."""
    hits, num_hit = dev.get_computed_blocks(req)
    ext = t.lookup(req, num_hit, max_external).num_tokens
    new = req.num_tokens - num_hit - ext
    got = dev.allocate_slots(
        req,
        new,
        num_new_computed_tokens=num_hit,
        new_computed_blocks=hits,
        num_external_computed_tokens=ext,
        delay_cache_blocks=ext > 0,
    )
    assert got is not None, req.request_id
    req.num_computed_tokens = num_hit + ext
    return t.plan_load(req, ext)


def settle_all(t: HostTier, transfers: list[Transfer]) -> list[str]:
    return t.complete([x.transfer_id for x in transfers])


def check(dev: KVCacheManager, t: HostTier) -> None:
    t.check_integrity()
    dev.check_integrity(num_pinned=t.device_pins())


def host_has(t: HostTier, req: Request, positions: list[int], group: int = 0) -> list[bool]:
    view = t.coordinator.group_hashes(req.block_hashes)[group]
    return [t.host.contains((group, view[p])) for p in positions]
