"""The async engine loop's queue: up to `async_depth` scheduled steps in flight, filling first.

Shared by the real engine and the fake one; knows nothing of what executing a step returns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from kvtier.sched.output import SchedulerOutput
from kvtier.sched.scheduler import Scheduler

H = TypeVar("H")


class BatchQueue(Generic[H]):
    """Steps scheduled and launched but not yet processed, oldest first.

    Filling the queue wins over collecting results (as vLLM's batch queue); an empty step is
    handed back at once so an idle loop makes progress.
    """

    def __init__(self, scheduler: Scheduler, execute: Callable[[SchedulerOutput], H]) -> None:
        self.scheduler = scheduler
        self.execute = execute
        self.in_flight: deque[tuple[SchedulerOutput, H]] = deque()
        self.num_steps = 0

    def advance(self) -> tuple[SchedulerOutput, H] | None:
        """Schedule and launch one step if allowed; return the oldest step to process, or None
        while the queue should keep filling (mutates)."""
        sched = self.scheduler
        if sched.can_schedule() and sched.has_unfinished_requests():
            output = sched.schedule()
            self.in_flight.append((output, self.execute(output)))
            self.num_steps += 1
            if not output.is_empty and sched.can_schedule():
                return None
        return self.in_flight.popleft() if self.in_flight else None

    def pop_oldest(self) -> tuple[SchedulerOutput, H] | None:
        """The oldest step in flight without scheduling another (None if none)."""
        return self.in_flight.popleft() if self.in_flight else None

    def __len__(self) -> int:
        return len(self.in_flight)
