"""What the scheduler needs from the KV tiers below the device: the `KVTier` protocol and the
decisions a tier returns. `sched/` never imports `offload/`; `kvtier.offload.HostTier` is the
first implementation.

A tier never changes a request: it answers lookups, plans copies (pinning the device blocks it
copies through `KVCacheManager.pin`) and reports what finished or failed; the scheduler alone
sets a request's status and `num_computed_tokens` from those answers.

Tiers chain: device → host → disk → remote. Each tier extends the hit of the tiers above it
(`lookup(request, num_hit_tokens)` returns tokens *beyond* `num_hit_tokens`), so a chain of
tiers is itself a `KVTier` whose lookup walks its members in order, each extending the hit so
far, and whose loads are planned per member for the range it serves (architecture.md §Offload).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from kvtier.ids import BlockId, ReqId
from kvtier.sched.output import PlannedTransfer
from kvtier.sched.request import Request


@dataclass(frozen=True, slots=True)
class TierLookup:
    """A tier's answer to a lookup for a waiting request.

    `num_tokens`: tokens beyond the hit so far that the tier can restore (a multiple of every
    group's block size; 0 = no hit). `wait_for_load`: part of that prefix is being loaded for
    another request right now; keep this request waiting and look up again after that load
    completes (the device cache will then hit it) instead of loading it twice.
    """

    num_tokens: int
    wait_for_load: bool = False


@dataclass(frozen=True, slots=True)
class LoadFailure:
    """What the scheduler does after a failed load: roll back and recompute (architecture.md
    §H7).

    Set the request's `num_computed_tokens` to `num_good_tokens` and its status back to WAITING.
    `evict_device_block_ids`: destination blocks whose content is bad; drop them from the device
    prefix cache (`KVCacheManager.evict_blocks`) if they were published. `must_reallocate`: a
    window or state group cannot roll back inside its table (positions before the old boundary
    are null), so free the request's device blocks and admit it afresh (`num_good_tokens` is 0).
    """

    req_id: ReqId
    num_good_tokens: int
    evict_device_block_ids: list[BlockId]
    must_reallocate: bool


class Transfer(Protocol):
    """A copy a tier planned; the step contract carries its `planned()` form."""

    def planned(self) -> PlannedTransfer: ...


class KVTier(Protocol):
    """A KV tier below the device, as the scheduler uses it. Every method returns decisions and
    changes only the tier's own state (and its pins on device blocks)."""

    def lookup(self, request: Request, num_hit_tokens: int) -> TierLookup:
        """Tokens beyond `num_hit_tokens` this tier restores for a waiting request; the hit stays
        pinned until `plan_load` (or the next lookup of the request)."""
        ...

    def record_lookup(self, request: Request) -> None:
        """The request was admitted (or its load planned) with its last lookup: count it."""
        ...

    def plan_load(self, request: Request, num_external_tokens: int) -> Transfer | None:
        """The load of the last lookup's hit into the device blocks just allocated for it, or
        None with 0 tokens (drops the pending hit). The request waits for it to complete."""
        ...

    def finish_request(self, request: Request) -> list[Transfer]:
        """Before the request's device blocks are freed at finish or abort: its last stores."""
        ...

    def preempt_request(self, request: Request) -> list[Transfer]:
        """Before the request's device blocks are freed at preemption: stores of what is
        settled (it may come back as a hit)."""
        ...

    def store_before_prune(self, request: Request) -> list[Transfer]:
        """Before the request's windows drop blocks from its device table: their stores."""
        ...

    def plan_stores(self, requests: Iterable[Request]) -> list[Transfer]:
        """Once per step: stores of the running requests' settled blocks, and re-stores."""
        ...

    def complete(self, transfer_ids: Iterable[int]) -> list[ReqId]:
        """Copies the runner reported done; returns the requests whose load is now complete
        (the scheduler publishes their blocks and lets them run)."""
        ...

    def fail(self, transfer_id: int) -> LoadFailure | None:
        """A copy failed; for a load of a live request, how to roll it back (None otherwise)."""
        ...

    def device_pins(self) -> dict[BlockId, int]:
        """Device block id → references this tier holds (for `KVCacheManager.check_integrity`)."""
        ...

    @property
    def has_pending_transfers(self) -> bool:
        """True while a copy is in flight (its completion must still be polled)."""
        ...
