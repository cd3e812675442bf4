"""Admission of waiting requests (prefix hits, host-tier loads) and the host tier's completions:
the half of the scheduler that turns waiting requests into running ones. Mixed into `Scheduler`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.kv.coordinator import GroupBlocks
from kvtier.kv.manager import KVCacheManager
from kvtier.sched.output import NewRequestData, PlannedTransfer, RunnerOutput
from kvtier.sched.queues import RequestQueue
from kvtier.sched.request import ReqId, Request, RequestStatus

if TYPE_CHECKING:
    from kvtier.sched.connector import KVTier
    from kvtier.sched.lifetimes import SettledLifetimes


class AdmissionMixin:
    """Needs the scheduler's queues, KV manager, lifetimes and connector (declared below)."""

    kv: KVCacheManager
    waiting: RequestQueue
    running: list[Request]
    requests: dict[ReqId, Request]
    lifetimes: SettledLifetimes
    connector: KVTier | None
    max_num_seqs: int
    long_prefill_token_threshold: int
    _transfers: list[PlannedTransfer]

    def _admit(
        self, seq: int, budget: int, num_scheduled: dict[ReqId, int], new_reqs: list[NewRequestData]
    ) -> int:
        """Admit waiting requests in queue order while budget, seats and blocks last."""
        waiting, kv = self.waiting, self.kv
        skipped: list[Request] = []
        while len(waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = waiting.pop()
            if request.ledger.records or request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                skipped.append(request)  # a stale step of its last incarnation is still in flight
                continue
            loaded = kv.has_request(request.request_id)  # its host load completed
            if loaded:
                num_hit = request.num_computed_tokens
            elif not request.stop.skip_reading_prefix_cache:  # prompt logprobs: compute all
                hits, num_hit = kv.get_computed_blocks(request)
                parked = self._try_load(request, num_hit, hits)
                if parked is None:
                    waiting.prepend(request)  # no room for its load destinations: wait
                    self._release_loaded_behind(request)
                    break
                if parked:
                    skipped.append(request)  # loading, or waiting on another request's load
                    continue
            else:
                hits, num_hit = [[] for _ in kv.specs], 0
            n = min(request.num_tokens - num_hit, budget)
            if 0 < self.long_prefill_token_threshold < n:
                n = self.long_prefill_token_threshold
            if kv.allocate_slots(request, n, *(() if loaded else (num_hit, hits))) is None:
                waiting.prepend(request)  # capacity: wait (head of line keeps its place)
                self._release_loaded_behind(request)
                break
            if not loaded:
                self._record_lookup(request, num_hit)
            request.num_slot_tokens = self.lifetimes.num_slot_tokens(num_hit + n)
            request.num_computed_tokens = num_hit
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit  # what the user is told was a prefix hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            request.schedule_step(seq, n, 0, num_hit + n == request.num_tokens)
            request.admit_seq = seq  # its prefix hits are final once this step is processed
            num_scheduled[request.request_id] = n
            new_reqs.append(
                NewRequestData(
                    request.request_id,
                    list(request.all_token_ids),
                    request.num_prompt_tokens,
                    request.stop,
                    request.draw,
                    kv.get_block_ids(request.request_id),
                    num_hit,
                )
            )
            budget -= n
        waiting.prepend_all(skipped)
        return budget

    def _release_loaded_behind(self, head: Request) -> None:
        """`head` cannot get its blocks and nothing runs, so no block will come back by itself:
        if requests whose host load completed wait behind it holding their blocks, nothing ever
        moves (each waits on the other). Take those blocks back — they are published, so they
        stay prefix hits — and let the requests look up again when their turn comes."""
        if self.running:
            return  # running requests finish and free blocks: the head's wait ends
        for request in self.waiting:
            rid = request.request_id
            if (
                request is head
                or request.status is not RequestStatus.WAITING
                or request.ledger.records
                or not self.kv.has_request(rid)
            ):
                continue
            if self.connector is not None:  # store what is settled first, as on preemption
                self._transfers += [t.planned() for t in self.connector.preempt_request(request)]
            self.lifetimes.free(request)
            request.num_computed_tokens = 0

    def _try_load(self, request: Request, num_hit: int, hits: GroupBlocks) -> bool | None:
        """Start loading what the connector holds beyond the device hit. True: the request is
        parked (its load is planned, or another request is loading that prefix: look again next
        step); False: nothing to load, admit it now; None: its destinations do not fit now."""
        connector = self.connector
        if connector is None:
            return False
        lookup = connector.lookup(request, num_hit)
        if lookup.wait_for_load:
            return True
        num_external = lookup.num_tokens
        if num_external == 0:
            return False
        if (
            self.kv.allocate_slots(request, 0, num_hit, hits, 0, num_external, True) is None
        ):  # destinations for the loaded tokens; published only when the load completes
            connector.plan_load(request, 0)
            return None
        self._record_lookup(request, num_hit)
        request.num_computed_tokens = num_hit + num_external
        transfer = connector.plan_load(request, num_external)
        assert transfer is not None, "a host hit with room for it must plan a load"
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS  # until `complete` names it
        self._transfers.append(transfer.planned())
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit + num_external
            request.num_external_cached_tokens = num_external
        return True

    def _record_lookup(self, request: Request, num_hit: int) -> None:
        """Count the lookups this admission used, once (retries of a waiting request are not
        admissions; a request counts again only after a preemption)."""
        if request.lookup_counted:
            return
        request.lookup_counted = True
        self.kv.record_lookup(request, num_hit, preempted=request.num_preemptions > 0)
        if self.connector is not None:
            self.connector.record_lookup(request)

    def _transfers_done(self, result: RunnerOutput) -> None:
        """Apply the copies the runner reports: loaded requests publish their blocks and become
        admissible; a failed load rolls its request back (recomputed: same output)."""
        assert self.connector is not None
        for req_id in self.connector.complete(result.finished_transfers):
            request = self.requests.get(req_id)
            if request is not None:
                request.status = RequestStatus.WAITING  # admissible from the loaded boundary
                self.kv.cache_blocks(request, request.num_computed_tokens)
        for tid in result.failed_transfers:
            failure = self.connector.fail(tid)
            if failure is None or failure.req_id not in self.requests:
                continue
            request = self.requests[failure.req_id]
            request.status = RequestStatus.WAITING
            request.num_computed_tokens = failure.num_good_tokens
            self.kv.evict_blocks(failure.evict_device_block_ids)
            if failure.must_reallocate:  # a window table cannot roll back in place: start over
                self.lifetimes.free(request)
            else:
                self.kv.cache_blocks(request, failure.num_good_tokens)
