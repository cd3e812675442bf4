"""The engine loop over the fake runner, for the scheduler tests: a `BatchQueue` of up to
`async_depth` steps, fed back to the real scheduler (and the fake runner's observer)."""

from __future__ import annotations

from collections import deque

from kvtier.bench.fake_runner import FakeRunner
from kvtier.sched.batch_queue import BatchQueue
from kvtier.sched.output import RequestUpdate, RunnerOutput, SchedulerOutput
from kvtier.sched.scheduler import Scheduler


class FakeEngine:
    """The engine loop over a fake runner: a `BatchQueue` of up to `async_depth` steps."""

    def __init__(self, scheduler: Scheduler, runner: FakeRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.queue: BatchQueue[RunnerOutput] = BatchQueue(scheduler, runner.execute)

    @property
    def num_steps(self) -> int:
        return self.queue.num_steps

    @property
    def in_flight(self) -> deque[tuple[SchedulerOutput, RunnerOutput]]:
        return self.queue.in_flight

    def step(self) -> list[RequestUpdate]:
        """Schedule one step if allowed, else process the oldest; returns processed outputs."""
        return self._process(self.queue.advance())

    def process_oldest(self) -> list[RequestUpdate]:
        """Feed the oldest in-flight step's result back to the scheduler ([] if none)."""
        return self._process(self.queue.pop_oldest())

    def _process(self, item: tuple[SchedulerOutput, RunnerOutput] | None) -> list[RequestUpdate]:
        if item is None:
            return []
        output, result = item
        outputs = self.scheduler.update(output, result)
        self.runner.on_processed(output.step_seq)
        return outputs

    def run(self, max_steps: int = 1_000_000) -> int:
        """Step until every request finished and no step is in flight; returns steps taken.

        RuntimeError if `max_steps` pass first (a request that can never be scheduled).
        """
        for i in range(max_steps):
            if not self.queue and not self.scheduler.has_unfinished_requests():
                return i
            self.step()
        raise RuntimeError(f"requests still unfinished after {max_steps} engine steps")
