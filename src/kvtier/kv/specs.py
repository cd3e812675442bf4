"""Attention specs of a KV-cache group and their block arithmetic (skipping, steady and transient need).

One formula for capacity, `blocks_for_requests`: what an admission policy charges per request
plus once per pool — by default `steady_blocks` per request and one pool-wide `transient_blocks`
reserve — used by startup sizing, reported max concurrency and runtime admission alike
(architecture.md §Admission).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvtier.config import ADMISSION_POLICIES


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class FullAttention:
    """Every position attends to every earlier one: all blocks stay resident."""

    block_size: int

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    def steady_blocks(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def transient_blocks(
        self, max_in_flight_tokens: int, num_requests: int, max_model_len: int
    ) -> int:
        return 0  # in-flight tokens are inside the request's own steady charge

    def held_blocks(self, num_extra_tokens: int, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True, slots=True)
class SlidingWindow:
    """The query at position n reads keys [n - window + 1, n]."""

    block_size: int
    window: int

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.window + 1)

    def steady_blocks(self, num_tokens: int) -> int:
        # W - 1 tokens before the next query, +1 block because the window need not be aligned.
        return min(cdiv(num_tokens, self.block_size), cdiv(self.window - 1, self.block_size) + 1)

    def transient_blocks(
        self, max_in_flight_tokens: int, num_requests: int, max_model_len: int
    ) -> int:
        return shared_reserve(self, max_in_flight_tokens, num_requests, max_model_len)

    def held_blocks(self, num_extra_tokens: int, num_tokens: int) -> int:
        """Most blocks a request of `num_tokens` holds while it keeps `num_extra_tokens` beyond
        its window: vLLM's per-request admission cap, cdiv(min(W − 1 + x, n), bs) + 1."""
        bs = self.block_size
        held = cdiv(min(self.window - 1 + num_extra_tokens, num_tokens), bs) + 1
        return min(cdiv(num_tokens, bs), held)


@dataclass(frozen=True, slots=True)
class ChunkedLocal:
    """Llama-4 style local attention: a query sees only its own chunk of `chunk` tokens."""

    block_size: int
    chunk: int

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return (num_computed_tokens // self.chunk) * self.chunk

    def steady_blocks(self, num_tokens: int) -> int:
        per_chunk = cdiv(self.chunk, self.block_size) + (1 if self.chunk % self.block_size else 0)
        return min(cdiv(num_tokens, self.block_size), per_chunk)

    def transient_blocks(
        self, max_in_flight_tokens: int, num_requests: int, max_model_len: int
    ) -> int:
        return shared_reserve(self, max_in_flight_tokens, num_requests, max_model_len)

    def held_blocks(self, num_extra_tokens: int, num_tokens: int) -> int:
        """vLLM's per-request cap for chunked-local groups: cdiv(min(C + x, n), bs)."""
        bs = self.block_size
        return min(cdiv(num_tokens, bs), cdiv(min(self.chunk + num_extra_tokens, num_tokens), bs))


@dataclass(frozen=True, slots=True)
class Mamba:
    """State-space layer: one live state block; block-aligned snapshots serve prefix hits.

    Table position i holds the state after (i + 1) * block_size tokens; only the position of the
    last computed token is needed, so skipping works like a window of one token.
    """

    block_size: int

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - 1)

    def steady_blocks(self, num_tokens: int) -> int:
        return min(1, cdiv(num_tokens, self.block_size))

    def transient_blocks(
        self, max_in_flight_tokens: int, num_requests: int, max_model_len: int
    ) -> int:
        # Each unsettled step that crosses a block boundary holds one more state block: at most
        # cdiv(unsettled tokens, bs) per request, so the window bound applies unchanged.
        return shared_reserve(self, max_in_flight_tokens, num_requests, max_model_len)

    def held_blocks(self, num_extra_tokens: int, num_tokens: int) -> int:
        """The live state block plus one per block boundary that `num_extra_tokens` may cross."""
        return min(cdiv(num_tokens, self.block_size), 1 + cdiv(num_extra_tokens, self.block_size))


KVSpec = FullAttention | SlidingWindow | ChunkedLocal | Mamba


def shared_reserve(
    spec: SlidingWindow | ChunkedLocal | Mamba,
    max_in_flight_tokens: int,
    num_requests: int,
    max_model_len: int,
) -> int:
    """Blocks a group's requests may hold beyond their steady charge while steps are in flight.

    A request with u unsettled tokens holds at most cdiv(u, bs) blocks beyond its steady charge,
    and Σ u ≤ max_in_flight_tokens, so Σ ≤ cdiv(max_in_flight_tokens, bs) + num_requests. No
    request can hold more than its whole table, which caps the reserve for short max lengths.
    """
    if max_in_flight_tokens <= 0 or num_requests <= 0:
        return 0
    bs = spec.block_size
    per_request_cap = max(0, cdiv(max_model_len, bs) - spec.steady_blocks(max_model_len))
    return min(cdiv(max_in_flight_tokens, bs) + num_requests, num_requests * per_request_cap)


def validate_spec(spec: KVSpec) -> None:
    """Raise ValueError naming the bad field of `spec` and the fix."""
    if spec.block_size <= 0:
        raise ValueError(f"{spec}: block_size must be positive (e.g. --block-size 16)")
    if isinstance(spec, SlidingWindow) and spec.window <= 0:
        raise ValueError(f"{spec}: sliding window must be at least 1 token")
    if isinstance(spec, ChunkedLocal) and spec.chunk <= 0:
        raise ValueError(f"{spec}: attention chunk size must be at least 1 token")


# ---- admission policies: the one formula, charged per request and once per pool ----------------


class AdmissionPolicy(ABC):
    """What admission charges a window-type group for blocks held while steps are in flight.

    A request is charged `request_blocks` in each group; `pool_blocks` is charged once for the
    whole pool. Startup sizing, reported max concurrency and runtime admission all read these.
    """

    name: ClassVar[str]

    @abstractmethod
    def request_blocks(self, spec: KVSpec, num_tokens: int, max_in_flight_tokens: int) -> int:
        """Blocks one request of `num_tokens` is charged in `spec`'s group."""

    def pool_blocks(
        self, spec: KVSpec, max_in_flight_tokens: int, num_requests: int, max_model_len: int
    ) -> int:
        """Blocks charged once for `num_requests` requests in `spec`'s group (default none)."""
        return 0


@dataclass(frozen=True)
class SharedReserve(AdmissionPolicy):
    """kvtier's: the steady window per request plus one pool-wide transient reserve (at most
    `max_in_flight_tokens` are unsettled across all requests together)."""

    name: ClassVar[str] = "shared"

    def request_blocks(self, spec: KVSpec, num_tokens: int, max_in_flight_tokens: int) -> int:
        return spec.steady_blocks(num_tokens)

    def pool_blocks(
        self, spec: KVSpec, max_in_flight_tokens: int, num_requests: int, max_model_len: int
    ) -> int:
        return spec.transient_blocks(max_in_flight_tokens, num_requests, max_model_len)


@dataclass(frozen=True)
class PerRequestReserve(AdmissionPolicy):
    """vLLM's after its settled-basis fix: every request is charged `W − 1 + max_in_flight_tokens`
    tokens of window blocks (safe, but the pool-wide bound is paid once per request)."""

    name: ClassVar[str] = "per-request"

    def request_blocks(self, spec: KVSpec, num_tokens: int, max_in_flight_tokens: int) -> int:
        steady = spec.steady_blocks(num_tokens)
        return max(steady, spec.held_blocks(max_in_flight_tokens, num_tokens))


@dataclass(frozen=True)
class OptimisticCharge(AdmissionPolicy):
    """vLLM's before that fix: `W − 1 + num_step_tokens` per request — one step's tokens, what
    pruning on the optimistic count holds. Under the settled basis it under-charges steps in
    flight (capacity then preempts); with the protections off it is the racy configuration."""

    num_step_tokens: int
    name: ClassVar[str] = "optimistic"

    def request_blocks(self, spec: KVSpec, num_tokens: int, max_in_flight_tokens: int) -> int:
        steady = spec.steady_blocks(num_tokens)
        return max(steady, spec.held_blocks(self.num_step_tokens, num_tokens))


SHARED = SharedReserve()


def admission_policy(name: str, max_num_batched_tokens: int) -> AdmissionPolicy:
    """The policy named by `--admission` (ValueError naming the choices if unknown)."""
    if name == SharedReserve.name:
        return SHARED
    if name == PerRequestReserve.name:
        return PerRequestReserve()
    if name == OptimisticCharge.name:
        return OptimisticCharge(max_num_batched_tokens)
    raise ValueError(f"--admission must be one of {', '.join(ADMISSION_POLICIES)}; got {name!r}")


def blocks_for_requests(
    specs: Sequence[KVSpec],
    num_requests: int,
    num_tokens: int,
    max_in_flight_tokens: int,
    policy: AdmissionPolicy = SHARED,
    max_model_len: int | None = None,
) -> int:
    """Blocks (all groups, one shared pool) that `num_requests` requests of `num_tokens` need.

    The single sizing formula: per request what `policy` charges each, once what it charges the
    pool — capped by what requests of `max_model_len` (default `num_tokens`) can hold, as the
    runtime caps it: it cannot know that a request will stay shorter than that.
    """
    cap_len = num_tokens if max_model_len is None else max_model_len
    return sum(
        num_requests * policy.request_blocks(s, num_tokens, max_in_flight_tokens)
        + policy.pool_blocks(s, max_in_flight_tokens, num_requests, cap_len)
        for s in specs
    )


def max_concurrency(
    specs: Sequence[KVSpec],
    num_usable_blocks: int,
    num_tokens: int,
    max_in_flight_tokens: int,
    policy: AdmissionPolicy = SHARED,
    max_model_len: int | None = None,
) -> int:
    """Largest number of `num_tokens`-token requests that fit in `num_usable_blocks` (≥ 0), in a
    pool for requests of up to `max_model_len` (default `num_tokens`)."""
    lo, hi = 0, max(1, num_usable_blocks)
    while lo < hi:  # blocks_for_requests is monotone in num_requests
        mid = (lo + hi + 1) // 2
        f = max_in_flight_tokens
        if (
            blocks_for_requests(specs, mid, num_tokens, f, policy, max_model_len)
            <= num_usable_blocks
        ):
            lo = mid
        else:
            hi = mid - 1
    return lo
