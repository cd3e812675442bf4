"""Admission: turning waiting requests into running ones (device prefix hits, loads from the tier
below, the admission charge of `KVCacheManager.allocate_slots`), and applying what that tier
reports about its loads. A component of `Scheduler`: it keeps no request list of its own; the
scheduler hands it the waiting queue, the running list and the step being built at each call."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvtier.ids import ReqId
from kvtier.kv.coordinator import GroupBlocks
from kvtier.kv.manager import KVCacheManager
from kvtier.sched.lifetimes import SettledLifetimes
from kvtier.sched.output import NewRequestData, PlannedTransfer, RunnerOutput
from kvtier.sched.queues import RequestQueue
from kvtier.sched.request import Request, RequestStatus
from kvtier.sched.step_build import StepBuild

if TYPE_CHECKING:
    from kvtier.sched.connector import KVTier


class Admission:
    """Admits waiting requests into a step while its budget, the seats and the blocks last.

    `tier`: the KV tier below the device (None: the device cache alone). It changes requests
    (status, `num_computed_tokens`, the step's ledger record) only as the scheduler's agent.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        lifetimes: SettledLifetimes,
        tier: KVTier | None,
        *,
        max_num_seqs: int,
        long_prefill_token_threshold: int,
    ) -> None:
        self.kv = kv
        self.lifetimes = lifetimes
        self.tier = tier
        self.max_num_seqs = max_num_seqs
        self.long_prefill_token_threshold = long_prefill_token_threshold

    def admit(
        self, step: StepBuild, waiting: RequestQueue, running: list[Request]
    ) -> list[PlannedTransfer]:
        """Admit waiting requests in queue order into `step` (mutates the queue, `running`, the
        requests and `step`); returns the copies planned meanwhile (loads; the stores of loaded
        requests whose blocks are taken back), in the order they were planned."""
        kv = self.kv
        transfers: list[PlannedTransfer] = []
        skipped: list[Request] = []
        while len(waiting) and step.budget > 0 and len(running) < self.max_num_seqs:
            request = waiting.pop()
            if request.ledger.records or request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                skipped.append(request)  # a stale step of its last incarnation is still in flight
                continue
            loaded = kv.has_request(request.request_id)  # its load from the tier completed
            hits: GroupBlocks | None = None
            if loaded:
                num_hit = request.num_computed_tokens
            elif not request.stop.skip_reading_prefix_cache:  # prompt logprobs: compute all
                hits, num_hit = kv.get_computed_blocks(request)
                parked = self._try_load(request, num_hit, hits, transfers)
                if parked is None:
                    waiting.prepend(request)  # no room for its load destinations: wait
                    transfers += self._release_loaded_behind(request, waiting, running)
                    break
                if parked:
                    skipped.append(request)  # loading, or waiting on another request's load
                    continue
            else:
                hits, num_hit = [[] for _ in kv.specs], 0
            n = min(request.num_tokens - num_hit, step.budget)
            if 0 < self.long_prefill_token_threshold < n:
                n = self.long_prefill_token_threshold
            n = self.lifetimes.align_chunk(num_hit, n)
            allocated = (
                kv.allocate_slots(request, n)
                if loaded
                else kv.allocate_slots(
                    request, n, num_new_computed_tokens=num_hit, new_computed_blocks=hits
                )
            )
            if allocated is None:
                waiting.prepend(request)  # capacity: wait (head of line keeps its place)
                transfers += self._release_loaded_behind(request, waiting, running)
                break
            if not loaded:
                self._record_lookup(request, num_hit)
            request.num_slot_tokens = self.lifetimes.num_slot_tokens(num_hit + n)
            request.num_computed_tokens = num_hit
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit  # what the user is told was a prefix hit
            request.status = RequestStatus.RUNNING
            running.append(request)
            request.schedule_step(step.step_seq, n, 0, num_hit + n == request.num_tokens)
            request.admit_seq = step.step_seq  # its prefix hits are final once it is processed
            step.add_new(
                NewRequestData(
                    request.request_id,
                    list(request.all_token_ids),
                    request.num_prompt_tokens,
                    request.stop,
                    request.draw,
                    kv.get_block_ids(request.request_id),
                    num_hit,
                ),
                n,
            )
        waiting.prepend_all(skipped)
        return transfers

    def apply_transfers(self, result: RunnerOutput, requests: Mapping[ReqId, Request]) -> None:
        """Apply the copies the runner reports (mutates requests and tables): requests whose load
        landed publish their blocks and become admissible; a failed load rolls its request back
        as the tier's `LoadFailure` says (recomputed later: same output)."""
        tier = self.tier
        assert tier is not None
        for req_id in tier.complete(result.finished_transfers):
            request = requests.get(req_id)
            if request is not None:
                request.status = RequestStatus.WAITING  # admissible from the loaded boundary
                self.kv.cache_verified(request, request.num_computed_tokens)
        for tid in result.failed_transfers:
            failure = tier.fail(tid)
            if failure is None or failure.req_id not in requests:
                continue
            request = requests[failure.req_id]
            request.status = RequestStatus.WAITING
            request.num_computed_tokens = failure.num_good_tokens
            self.kv.evict_blocks(failure.evict_device_block_ids)
            if failure.must_reallocate:  # a window table cannot roll back in place: start over
                self.lifetimes.free(request)
            else:
                self.kv.cache_verified(request, failure.num_good_tokens)

    def _release_loaded_behind(
        self, head: Request, waiting: RequestQueue, running: list[Request]
    ) -> list[PlannedTransfer]:
        """`head` cannot get its blocks and nothing runs, so no block will come back by itself:
        if requests whose load completed wait behind it holding their blocks, nothing ever moves
        (each waits on the other). Take those blocks back (`release_loaded`)."""
        if running:
            return []  # running requests finish and free blocks: the head's wait ends
        return self.release_loaded(waiting, keep=head)

    def can_release_loaded(self, waiting: RequestQueue, keep: Request | None = None) -> bool:
        """True if a waiting request other than `keep` holds the blocks of a completed load and
        no step in flight (no side effects)."""
        return any(self._holds_loaded(r, keep) for r in waiting)

    def release_loaded(
        self, waiting: RequestQueue, keep: Request | None = None
    ) -> list[PlannedTransfer]:
        """Take back the blocks of waiting requests (other than `keep`) whose load completed
        (mutates those requests and the tables; freed at once, no step reads them): they are
        published, so they stay prefix hits, and the requests look up again when their turn
        comes. The rule of architecture.md §Progress. Returns the stores planned first (what is
        settled, as on preemption)."""
        transfers: list[PlannedTransfer] = []
        for request in waiting:
            if not self._holds_loaded(request, keep):
                continue
            if self.tier is not None:
                transfers += [t.planned() for t in self.tier.preempt_request(request)]
            self.lifetimes.free(request)
            request.num_computed_tokens = 0
        return transfers

    def _holds_loaded(self, request: Request, keep: Request | None) -> bool:
        return (
            request is not keep
            and request.status is RequestStatus.WAITING
            and not request.ledger.records
            and self.kv.has_request(request.request_id)
        )

    def _try_load(
        self,
        request: Request,
        num_hit: int,
        hits: GroupBlocks,
        transfers: list[PlannedTransfer],
    ) -> bool | None:
        """Start loading what the tier holds beyond the device hit (appends the load to
        `transfers`). True: the request is parked (its load is planned, or another request is
        loading that prefix: look again next step); False: nothing to load, admit it now; None:
        its destinations do not fit now."""
        tier = self.tier
        if tier is None:
            return False
        lookup = tier.lookup(request, num_hit)
        if lookup.wait_for_load:
            return True
        num_external = lookup.num_tokens
        if num_external == 0:
            return False
        destinations = self.kv.allocate_slots(  # published only when the load completes
            request,
            0,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hits,
            num_external_computed_tokens=num_external,
            delay_cache_blocks=True,
        )
        if destinations is None:
            tier.plan_load(request, 0)
            return None
        self._record_lookup(request, num_hit)
        request.num_computed_tokens = num_hit + num_external
        transfer = tier.plan_load(request, num_external)
        assert transfer is not None, "a hit with room for it must plan a load"
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS  # until `complete` names it
        transfers.append(transfer.planned())
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
        if self.tier is not None:
            self.tier.record_lookup(request)
