"""Waiting queues and preemption-victim choice: FCFS (default) and priority policies.

A policy orders requests; it never allocates blocks or changes a request's counters.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Sequence

from kvtier.sched.request import Request

POLICIES = ("fcfs", "priority")


class RequestQueue(ABC):
    """Waiting requests in scheduling order. Subclasses define the order."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Enqueue a newly arrived request (mutates)."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Re-enqueue a preempted request ahead of requests of equal rank (mutates)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the first request; IndexError if empty."""

    @abstractmethod
    def peek(self) -> Request:
        """The first request without removing it; IndexError if empty."""

    def prepend_all(self, requests: Sequence[Request]) -> None:
        """Put back requests popped in order (e.g. skipped this step), keeping their order."""
        for request in reversed(requests):
            self.prepend(request)

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Remove a specific request (abort); ValueError if absent."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of waiting requests."""

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in scheduling order (read-only view)."""

    @abstractmethod
    def pick_victim(self, running: Sequence[Request]) -> int:
        """Index in `running` (non-empty) of the request to preempt first."""


class FCFSQueue(RequestQueue):
    """Arrival order; preempted requests go back to the front; the latest running is the victim."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def pop(self) -> Request:
        return self._q.popleft()

    def peek(self) -> Request:
        return self._q[0]

    def remove(self, request: Request) -> None:
        self._q.remove(request)  # abort only: not on the per-step path

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def pick_victim(self, running: Sequence[Request]) -> int:
        return len(running) - 1


def _rank(request: Request) -> tuple[int, int]:
    return (request.priority, request.arrival_seq)


class PriorityQueue(RequestQueue):
    """Lowest (priority, arrival) first; the victim is the highest (priority, arrival) running."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, int]] = []  # INVARIANT: sorted, parallel to _reqs
        self._reqs: list[Request] = []

    def add(self, request: Request) -> None:
        key = _rank(request)
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._reqs.insert(i, request)

    def prepend(self, request: Request) -> None:
        key = _rank(request)
        i = bisect.bisect_left(self._keys, key)
        self._keys.insert(i, key)
        self._reqs.insert(i, request)

    def pop(self) -> Request:
        if not self._reqs:
            raise IndexError("pop from an empty queue")
        del self._keys[0]
        return self._reqs.pop(0)

    def peek(self) -> Request:
        return self._reqs[0]

    def remove(self, request: Request) -> None:
        i = self._reqs.index(request)
        del self._keys[i]
        del self._reqs[i]

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs)

    def pick_victim(self, running: Sequence[Request]) -> int:
        return max(range(len(running)), key=lambda i: _rank(running[i]))


def make_queue(policy: str) -> RequestQueue:
    """The waiting queue of `policy`; raises ValueError naming the choices."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; use one of {POLICIES}")
