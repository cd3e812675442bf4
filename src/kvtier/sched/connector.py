"""What the scheduler needs from a KV connector (the host tier): the protocol, so `sched/` never
imports `offload/`. `kvtier.offload.HostTier` implements it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from kvtier.kv.block import BlockId
from kvtier.sched.output import PlannedTransfer
from kvtier.sched.request import Request


class Lookup(Protocol):
    num_tokens: int  # tokens beyond the device hit the connector can restore
    wait_for_load: bool  # another request is loading that prefix: retry after it completes


class Transfer(Protocol):
    def planned(self) -> PlannedTransfer: ...


class Failure(Protocol):
    req_id: str
    num_good_tokens: int
    evict_device_block_ids: list[int]
    must_reallocate: bool


class KVConnector(Protocol):
    def lookup(self, request: Request, num_device_hit_tokens: int) -> Lookup: ...

    def record_lookup(self, request: Request) -> None: ...

    def plan_load(self, request: Request, num_external_tokens: int) -> Transfer | None: ...

    def finish_request(self, request: Request) -> list[Transfer]: ...

    def preempt_request(self, request: Request) -> list[Transfer]: ...

    def store_before_prune(self, request: Request) -> list[Transfer]: ...

    def plan_stores(self, requests: Iterable[Request]) -> list[Transfer]: ...

    def complete(self, transfer_ids: Iterable[int]) -> list[str]: ...

    def fail(self, transfer_id: int) -> Failure | None: ...

    def device_pins(self) -> dict[BlockId, int]: ...

    @property
    def has_pending_transfers(self) -> bool: ...
