"""Attention specs of a KV-cache group and their block arithmetic (skipping, steady and transient need).

One formula for capacity: `steady_blocks` per request plus one pool-wide `transient_blocks` reserve,
used by startup sizing, reported max concurrency and runtime admission alike (architecture.md
§Admission).
"""

from __future__ import annotations

from dataclasses import dataclass


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


def blocks_for_requests(
    specs: list[KVSpec], num_requests: int, num_tokens: int, max_in_flight_tokens: int
) -> int:
    """Blocks (all groups, one shared pool) that `num_requests` requests of `num_tokens` need.

    The single sizing formula: per request the steady part, once per pool the transient reserve.
    """
    return sum(
        num_requests * s.steady_blocks(num_tokens)
        + s.transient_blocks(max_in_flight_tokens, num_requests, num_tokens)
        for s in specs
    )


def max_concurrency(
    specs: list[KVSpec], num_usable_blocks: int, max_model_len: int, max_in_flight_tokens: int
) -> int:
    """Largest number of `max_model_len`-token requests that fit in `num_usable_blocks` (≥ 0)."""
    lo, hi = 0, max(1, num_usable_blocks)
    while lo < hi:  # blocks_for_requests is monotone in num_requests
        mid = (lo + hi + 1) // 2
        if (
            blocks_for_requests(specs, mid, max_model_len, max_in_flight_tokens)
            <= num_usable_blocks
        ):
            lo = mid
        else:
            hi = mid - 1
    return lo
