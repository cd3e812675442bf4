"""The scheduler: continuous batching with chunked prefill, preemption, async depth and drafts.

Picks requests and token counts, owns every request's ledger and decides when blocks are pruned or
freed (through `KVCacheManager`, on the settled count, stamped for the quarantine). No torch, no clock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.config import MAX_ASYNC_DEPTH
from kvtier.ids import ReqId
from kvtier.kv.manager import KVCacheManager
from kvtier.sched.admission import Admission
from kvtier.sched.lifetimes import OptimisticLifetimes, SettledLifetimes
from kvtier.sched.ngram import NgramProposer
from kvtier.sched.output import (
    BlockIds,
    PlannedTransfer,
    RequestUpdate,
    RunnerOutput,
    SchedulerOutput,
)
from kvtier.sched.queues import make_queue
from kvtier.sched.request import Request, RequestStatus
from kvtier.sched.step_build import StepBuild

if TYPE_CHECKING:
    from kvtier.config import SchedulerConfig
    from kvtier.sched.connector import KVTier


class Scheduler:
    """Continuous-batching scheduler over one `KVCacheManager`.

    `async_depth` is how many scheduled steps may be unprocessed at once (1 = synchronous,
    default 2). `settled=False` prunes windows on the optimistic count (`OptimisticLifetimes`, for
    reproducing hazards); the quarantine switch lives in the KV manager (`enable_quarantine`).
    Both are protections of architecture.md §Protections.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        async_depth: int = 2,
        long_prefill_token_threshold: int = 0,
        num_speculative_tokens: int = 0,
        policy: str = "fcfs",
        settled: bool = True,
        tier: KVTier | None = None,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be ≥ 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be ≥ 1, got {max_num_batched_tokens}")
        if not 1 <= async_depth <= MAX_ASYNC_DEPTH:
            raise ValueError(f"async_depth must be 1 (sync), 2 or 3, got {async_depth}")
        if long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be ≥ 0 (0 = no limit)")
        if num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be ≥ 0 (0 = no drafts)")
        self.kv = kv
        self.max_model_len = kv.max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.async_depth = async_depth
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.num_speculative_tokens = num_speculative_tokens
        self.proposer = NgramProposer(num_speculative_tokens) if num_speculative_tokens else None
        self.settled = settled
        self.lifetimes = SettledLifetimes(kv) if settled else OptimisticLifetimes(kv)
        self.waiting = make_queue(policy)
        self.running: list[Request] = []
        # Every request that is unfinished or still has ledger records (finished ones drain).
        self.requests: dict[ReqId, Request] = {}
        self.sched_step_seq = 0  # steps scheduled (every schedule() call is a step)
        self.processed_step_seq = 0  # steps whose output update() has processed
        self.num_in_flight_tokens = 0  # Σ tokens of unprocessed steps (= Σ over ledgers)
        self.num_arrivals = 0
        self.num_preemptions = 0
        self._finished_ids: list[ReqId] = []  # for the next SchedulerOutput
        self.tier = tier  # the KV tier below the device, if any: loads, stores, their completions
        self._transfers: list[PlannedTransfer] = []  # planned since the last SchedulerOutput
        self.admission = Admission(
            kv,
            self.lifetimes,
            tier,
            max_num_seqs=max_num_seqs,
            long_prefill_token_threshold=long_prefill_token_threshold,
        )

    @classmethod
    def from_config(
        cls, config: SchedulerConfig, kv: KVCacheManager, **kwargs: object
    ) -> Scheduler:
        """A scheduler with the limits of `config` (policy, thresholds, drafts via kwargs)."""
        return cls(
            kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            async_depth=config.depth,
            **kwargs,  # type: ignore[arg-type]
        )

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request (mutates). ValueError if it can never run here."""
        req_id = request.request_id
        if req_id in self.requests:
            raise ValueError(f"request id {req_id!r} is already in use; pick a unique id")
        if request.status is not RequestStatus.WAITING or request.num_output_tokens:
            raise ValueError(f"request {req_id!r} was scheduled before; submit a fresh Request")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"request {req_id!r}: prompt of {request.num_tokens} tokens leaves no room for "
                f"output within max_model_len={self.max_model_len}; shorten it or raise the limit"
            )
        num_tokens = min(request.num_tokens + request.stop.max_tokens, self.max_model_len)
        if self.kv.blocks_for_requests(1, num_tokens) > self.kv.num_blocks - 1:
            raise ValueError(
                f"request {req_id!r} needs more KV blocks than the pool holds at {num_tokens} "
                f"tokens; lower max_tokens or add KV blocks"
            )
        hasher = self.kv.hasher
        if request.hasher is None:
            request.hasher = hasher
            request.append_output_token_ids(())  # hash the prompt's full blocks
        elif request.hasher.block_size != hasher.block_size:
            raise ValueError(
                f"request {req_id!r} is hashed at block size {request.hasher.block_size}, the KV "
                f"cache at {hasher.block_size}; build it with KVCacheManager.hasher or none"
            )
        self.num_arrivals += 1
        request.arrival_seq = self.num_arrivals
        self.requests[req_id] = request
        self.waiting.add(request)

    def abort(self, req_id: ReqId) -> bool:
        """Finish a request now (mutates); its blocks go to the quarantine stamped with its last
        scheduled step. Returns False if it is unknown or already finished."""
        request = self.requests.get(req_id)
        if request is None or request.is_finished:
            return False
        was_running = request.status is RequestStatus.RUNNING
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        if was_running:
            self.running.remove(request)
        return True

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs, or the tier below the device still has copies
        to report (a load of a request aborted while loading pins blocks until it is reported)."""
        if self.running or len(self.waiting) > 0:
            return True
        return self.tier is not None and self.tier.has_pending_transfers

    @property
    def num_unfinished_requests(self) -> int:
        """Requests waiting (loading and preempted ones included) or running."""
        return len(self.waiting) + len(self.running)

    @property
    def num_unprocessed_steps(self) -> int:
        """Steps scheduled whose output update() has not processed yet."""
        return self.sched_step_seq - self.processed_step_seq

    @property
    def protections(self) -> dict[str, bool]:
        """The block-lifetime protections in force here (architecture.md §Protections; the third,
        `event`, is the runner's)."""
        return {"settled": self.settled, "quarantine": self.kv.enable_quarantine}

    def can_schedule(self) -> bool:
        """True if another step may be scheduled before the oldest one is processed."""
        return self.num_unprocessed_steps < self.async_depth

    # ---- schedule ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Build the next step (mutates: counters, ledgers, block tables, queues).

        Running requests first, in order, preempting the policy's victim when blocks run out
        (a request waits instead when the steps in flight will return enough blocks, or when it
        would preempt itself while its own steps are in flight); waiting requests only in a step
        where every running request got its blocks. RuntimeError if `async_depth` steps are
        already unprocessed.
        """
        if not self.can_schedule():
            raise RuntimeError(
                f"{self.num_unprocessed_steps} steps are unprocessed (async_depth="
                f"{self.async_depth}); call update() for step {self.processed_step_seq + 1} first"
            )
        seq = self.sched_step_seq + 1
        step = StepBuild(seq, self.max_num_batched_tokens)
        running = self.running
        blocked = False
        i = 0
        while i < len(running) and step.budget > 0:
            request = running[i]
            n, drafts, samples = self._running_tokens(request, step.budget)
            if n == 0:
                i += 1
                continue
            self._prune(request, self.processed_step_seq)
            num_preempted = len(step.preempted)
            blocks = self._allocate_or_preempt(request, n, step)
            if blocks is None:
                blocked = True  # it waits or preempted itself: nothing later can fit either
                break
            if len(step.preempted) > num_preempted:  # victims may sit before it in the list
                i = running.index(request)
            step.add(
                request, n, drafts, blocks, request.schedule_step(seq, n, len(drafts), samples)
            )
            i += 1
        if not step.preempted and not blocked:
            self._transfers += self.admission.admit(step, self.waiting, running)
        self.sched_step_seq = seq
        total = self.max_num_batched_tokens - step.budget
        self.num_in_flight_tokens += total
        finished, self._finished_ids = self._finished_ids, []
        if self.tier is not None:
            self._transfers += [t.planned() for t in self.tier.plan_stores(self.running)]
        transfers, self._transfers = self._transfers, []
        return SchedulerOutput(
            step_seq=seq,
            scheduled_new_reqs=step.new,
            scheduled_cached_reqs=step.cached,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=step.spec_tokens,
            preempted_req_ids=step.preempted,
            finished_req_ids=finished,
            planned_transfers=transfers,
        )

    def _running_tokens(self, request: Request, budget: int) -> tuple[int, list[int], bool]:
        """(tokens to schedule, draft ids, whether the step samples) for a running request."""
        if request.reaches_max_tokens(self.max_model_len):
            return 0, _NO_DRAFTS, False  # the steps in flight already end it: never over-schedule
        target = len(request.all_token_ids) + request.ledger.num_placeholders
        num_new = target - request.num_computed_tokens
        if num_new <= 0:
            return 0, _NO_DRAFTS, False
        drafts = _NO_DRAFTS
        if num_new == 1 and self.proposer is not None and request.stop.use_ngram:
            k = min(
                request.max_new_drafts(self.num_speculative_tokens, self.max_model_len), budget - 1
            )
            if k > 0 and request.num_output_placeholders:
                drafts = [-1] * k  # the last token is still on the device: the runner proposes
            elif k > 0:
                drafts = self.proposer.propose(request.all_token_ids, k)
            num_new += len(drafts)
            target += len(drafts)
        num_new = min(num_new, budget, self.max_model_len - request.num_computed_tokens)
        if not drafts:
            if 0 < self.long_prefill_token_threshold < num_new:
                num_new = self.long_prefill_token_threshold
            num_new = self.lifetimes.align_chunk(request.num_computed_tokens, num_new)
        return num_new, drafts, request.num_computed_tokens + num_new == target

    def _allocate_or_preempt(self, request: Request, n: int, step: StepBuild) -> BlockIds | None:
        """Ids appended to each group's table (null id 0 where a position is skipped) for `n`
        more tokens, preempting until they fit; None if the request waits or was preempted.

        A victim's blocks free nothing now under async scheduling, so before each preemption the
        blocks the steps in flight return (the quarantine's, earlier victims' included, and those
        of requests they end by length) are counted: if they cover the shortfall, wait for them.
        The victim is the policy's choice among every running request; one already scheduled in
        this step is taken back first. Before a request would preempt itself, waiting requests
        whose load completed give their blocks back (architecture.md §Progress).
        """
        end = request.num_computed_tokens + n
        if not self.lifetimes.needs_allocation(request, end):
            return tuple([] for _ in self.lifetimes.block_sizes)
        kv, running = self.kv, self.running
        while True:
            appended = kv.allocate_slots(request, n)
            if appended is not None:
                request.num_slot_tokens = self.lifetimes.num_slot_tokens(end)
                return tuple([b.block_id for b in blocks] for blocks in appended)
            ending = [r.request_id for r in running if r.reaches_max_tokens(self.max_model_len)]
            if kv.num_blocks_short(request, n) <= kv.num_blocks_returning(ending):
                return None  # the steps in flight will return enough: wait for them
            v = self.waiting.pick_victim(running)
            victim = running[v]
            if victim is request and request.ledger.num_live_in_flight_tokens:
                return None  # its own steps will settle and free window blocks: wait, don't drop
            if victim is request and self.admission.can_release_loaded(self.waiting):
                # Loaded requests wait holding blocks no step uses: take those back before the
                # request drops itself, or it re-enters ahead of them and starves forever
                # (architecture.md §Progress).
                self._transfers += self.admission.release_loaded(self.waiting)
                continue
            running.pop(v)
            if victim.request_id in step.num_scheduled:
                step.take_back(victim, self.processed_step_seq)
            self._preempt(victim)
            step.preempted.append(victim.request_id)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        """Recompute later: blocks to the quarantine, ledger records stale, back to the queue."""
        if self.tier is not None:  # store what is settled first: it may come back as a hit
            self._transfers += [t.planned() for t in self.tier.preempt_request(request)]
        self.lifetimes.free(request)
        request.ledger.mark_stale()
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.lookup_counted = False  # its re-admission is counted again (as preempted)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    # ---- update --------------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, result: RunnerOutput) -> list[RequestUpdate]:
        """Process step `output.step_seq` (mutates). Steps must be processed in schedule order.

        Consumes each scheduled request's ledger record, rolls back rejected drafts, delivers
        tokens (stale ones too, without touching the new incarnation), marks state snapshots on
        the step's verified end, caches full blocks, prunes windows on the settled count,
        finishes requests and releases the quarantine.
        Returns the requests that gained tokens or finished.
        """
        seq = output.step_seq
        if seq != self.processed_step_seq + 1 or seq > self.sched_step_seq:
            raise ValueError(
                f"update() got step {seq}; process step {self.processed_step_seq + 1} next"
            )
        if result.step_seq != seq:
            raise ValueError(f"RunnerOutput of step {result.step_seq} passed with step {seq}")
        self.processed_step_seq = seq
        self.num_in_flight_tokens -= output.total_num_scheduled_tokens
        self.kv.release_quarantine(seq)
        if self.tier is not None:
            self.admission.apply_transfers(result, self.requests)
        outputs: list[RequestUpdate] = []
        num_finished = 0
        sampled = result.sampled_token_ids
        requests, running_status = self.requests, RequestStatus.RUNNING
        for req_id in output.num_scheduled_tokens:
            request = requests[req_id]
            record = request.ledger.consume(seq)
            assert record is not None, f"{req_id} has no ledger record for step {seq}"
            status = request.status
            if status is not running_status and status.is_finished:
                if not request.ledger.records:
                    del requests[req_id]
                continue
            tokens = sampled.get(req_id)
            if record.num_placeholders:
                if not tokens or len(tokens) > 1 + record.num_draft_tokens:
                    raise ValueError(
                        f"step {seq}: {req_id} needs 1 to {1 + record.num_draft_tokens} sampled "
                        f"tokens, the runner returned {tokens!r}"
                    )
                if not record.stale:
                    request.num_computed_tokens -= record.num_draft_tokens - (len(tokens) - 1)
                reason, delivered = request.deliver(tokens, self.max_model_len)
                outputs.append(RequestUpdate(req_id, delivered, reason))
                if not record.stale:
                    self.lifetimes.verified(request)
                if reason is not None:
                    num_finished += status is running_status
                    self._finish(request, reason)
                    continue
            elif tokens:
                raise ValueError(
                    f"step {seq}: {req_id} ran a prefill chunk but got tokens {tokens}"
                )
            elif not record.stale:
                self.lifetimes.verified(request)
            if status is running_status:
                self.lifetimes.cache(request)
                self._prune(request, seq)  # return blocks once the step settles
        if num_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return outputs

    def _prune(self, request: Request, processed_step_seq: int) -> None:
        """Prune the request's windows, storing first what they are about to drop (mutates)."""
        if self.tier is not None and self.lifetimes.prune_due(request):
            self._transfers += [t.planned() for t in self.tier.store_before_prune(request)]
        self.lifetimes.prune(request, processed_step_seq)

    def _finish(self, request: Request, reason: RequestStatus) -> None:
        """Mark finished; free its blocks stamped with its last scheduled step (mutates)."""
        if self.tier is not None:
            self._transfers += [t.planned() for t in self.tier.finish_request(request)]
        if request.status is RequestStatus.RUNNING:
            self.lifetimes.cache(request)
            self.lifetimes.free(request)
        else:
            self.waiting.remove(request)
            if self.kv.has_request(request.request_id):  # loading or loaded
                self.lifetimes.free(request)
        request.status = reason
        request.ledger.mark_stale()  # outputs of steps still in flight are dropped
        self._finished_ids.append(request.request_id)
        if not request.ledger.records:
            del self.requests[request.request_id]


_NO_DRAFTS: list[int] = []  # shared, read-only
