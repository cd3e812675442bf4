"""AdmissionCharges: what admission charges each new request and the pool (the sizing formula at
run time, architecture.md §Admission). Owns the charges of admitted requests; reads the tables and
the quarantine, never changes them; never decides which request runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.ids import ReqId
from kvtier.kv.block_pool import IntegrityError
from kvtier.kv.coordinator import GroupBlocks, KVCacheCoordinator
from kvtier.kv.specs import AdmissionPolicy, Mamba, cdiv


@dataclass(frozen=True, slots=True)
class Charge:
    """What admission charged one request: steady blocks per group, and blocks beyond them."""

    steady: tuple[int, ...]
    extra: int


class AdmissionCharges:
    """The charges of the requests a `KVCacheManager` admitted, and the reserve they imply.

    `max_in_flight_tokens` sizes the transient need of window groups while steps are in flight;
    `admission` says how that need is charged (per request beyond its steady window, and once
    per pool). With `admit_whole_prompt` a new request is also charged the steady windows of its
    whole prompt, beside what admitted requests were promised and have not allocated yet.
    """

    def __init__(
        self,
        coordinator: KVCacheCoordinator,
        *,
        max_model_len: int,
        max_in_flight_tokens: int,
        admission: AdmissionPolicy,
        admit_whole_prompt: bool,
    ) -> None:
        self.coordinator = coordinator
        self.specs = coordinator.specs
        self.max_model_len = max_model_len
        self.max_in_flight_tokens = max_in_flight_tokens
        self.admission = admission
        self.admit_whole_prompt = admit_whole_prompt
        # What each admitted request was charged when admitted: its steady blocks per group at
        # its prompt length, and blocks beyond them (per-request policies only).
        # INVARIANT: keys are the coordinator's requests; num_extra_blocks == Σ extra.
        self._charges: dict[ReqId, Charge] = {}
        self.num_extra_blocks = 0

    def charge_new(
        self,
        num_prompt_tokens: int,
        num_tokens: int,
        hits: GroupBlocks,
        total_computed: int,
        need: int,
    ) -> tuple[int, Charge]:
        """(free blocks a new request's allocation of `need` blocks up to `num_tokens` needs
        once admission is charged, the charge to `add` if it is admitted). Changes nothing."""
        # the reserve it does not hold must stay free beside its blocks
        excess = self._excess_of_new(num_tokens, total_computed)
        length = min(num_prompt_tokens, self.max_model_len)
        charge = Charge(
            tuple(s.steady_blocks(length) for s in self.specs), self.extra_charge(length)
        )
        if self.admit_whole_prompt:  # and the steady windows of its whole prompt
            need = max(need, self._steady_need(charge.steady, hits) + excess)
            need += self.num_promised_blocks()
        return need + self.reserve_shortfall(1, excess, charge.extra), charge

    def add(self, request_id: ReqId, charge: Charge) -> None:
        """Record the charge of a request just admitted (mutates)."""
        self._charges[request_id] = charge
        self.num_extra_blocks += charge.extra

    def release(self, request_id: ReqId) -> None:
        """Drop the request's charge, if it has one (mutates)."""
        charge = self._charges.pop(request_id, None)
        if charge is not None:
            self.num_extra_blocks -= charge.extra

    def reserve_shortfall(
        self,
        num_new_requests: int = 0,
        num_new_excess_blocks: int = 0,
        num_new_extra_blocks: int = 0,
    ) -> int:
        """Blocks of the transient reserve not currently held (≥ 0).

        Reserve: what the admission policy charges the pool for its requests plus what it
        charged each admitted request beyond its steady window (`num_new_extra_blocks` for one
        being admitted); held: blocks tables keep beyond their steady charge, quarantined blocks
        that will come back free, and `num_new_excess_blocks` that a request being admitted will
        hold beyond its steady charge.
        """
        n = self.coordinator.num_requests + num_new_requests
        reserve = self.pool_reserve(n) + self.num_extra_blocks + num_new_extra_blocks
        if reserve == 0:
            return 0
        held = sum(m.num_excess_blocks for m in self.coordinator.managers) + num_new_excess_blocks
        return max(0, reserve - held - self.coordinator.pool.num_quarantined_freeable())

    def pool_reserve(self, num_requests: int) -> int:
        """Blocks the admission policy charges once for the pool with `num_requests` requests."""
        if self.max_in_flight_tokens <= 0:
            return 0
        f, n = self.max_in_flight_tokens, num_requests
        return sum(self.admission.pool_blocks(s, f, n, self.max_model_len) for s in self.specs)

    def extra_charge(self, num_tokens: int) -> int:
        """Blocks the admission policy charges one request of `num_tokens` beyond its steady
        windows (all groups; 0 for the shared reserve)."""
        n, f = min(num_tokens, self.max_model_len), self.max_in_flight_tokens
        return sum(self.admission.request_blocks(s, n, f) - s.steady_blocks(n) for s in self.specs)

    def num_promised_blocks(self) -> int:
        """Steady blocks admitted requests were charged for and have not allocated yet (their
        prompts still prefilling): free now, but theirs."""
        managers = self.coordinator.managers
        return sum(
            max(0, blocks - mgr.num_real_blocks(req_id))
            for req_id, charge in self._charges.items()
            for blocks, mgr in zip(charge.steady, managers, strict=True)
        )

    def _steady_need(self, steady: tuple[int, ...], hits: GroupBlocks) -> int:
        """Blocks a new request's `steady` windows take from the free queue: prefix hits other
        tables already hold are not taken again."""
        need = 0
        for blocks, group_hits in zip(steady, hits, strict=True):
            held = sum(1 for b in group_hits if not b.is_null and b.ref_cnt > 0)
            need += max(0, blocks - held)
        return need

    def _excess_of_new(self, num_tokens: int, total_computed: int) -> int:
        """Real blocks a new request's table will hold beyond each group's steady charge: they
        are its share of the transient reserve, not a second charge on top of it."""
        excess = 0
        for spec in self.specs:
            bs = spec.block_size
            real = cdiv(num_tokens, bs) - spec.num_skipped_tokens(total_computed) // bs
            if isinstance(spec, Mamba):  # the page it starts from (a hit) and the one it writes
                real = min(2, real)
            excess += max(0, real - spec.steady_blocks(1 << 62))
        return excess

    def check_integrity(self) -> None:
        """Check that every admitted request carries its charge and the extra blocks add up;
        raises `IntegrityError` naming what drifted."""
        charged, admitted = self._charges.keys(), self.coordinator.managers[0].req_to_blocks.keys()
        if charged != admitted:
            raise IntegrityError(
                f"admission charges drifted from the tables: charged without a table "
                f"{sorted(charged - admitted)}, a table without a charge {sorted(admitted - charged)}"
            )
        extra = sum(c.extra for c in self._charges.values())
        if self.num_extra_blocks != extra:
            raise IntegrityError(
                f"admission charges drifted: {self.num_extra_blocks} extra blocks counted, "
                f"{extra} charged"
            )
