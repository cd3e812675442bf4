"""Torch-free scheduling: requests and their step ledgers, queues, the scheduler, step contracts."""

from kvtier.sched.fake_runner import FakeEngine, FakeRunner, hashed_token
from kvtier.sched.lifetimes import OptimisticLifetimes, SettledLifetimes
from kvtier.sched.ngram import NgramProposer
from kvtier.sched.oracle import AccessOracle, Violation
from kvtier.sched.output import (
    CachedRequestData,
    NewRequestData,
    PlannedTransfer,
    RequestUpdate,
    RunnerOutput,
    SchedulerOutput,
)
from kvtier.sched.queues import FCFSQueue, PriorityQueue, RequestQueue, make_queue
from kvtier.sched.request import Request, RequestStatus, StepLedger, StepRecord
from kvtier.sched.scheduler import Scheduler

__all__ = [
    "AccessOracle",
    "CachedRequestData",
    "FCFSQueue",
    "FakeEngine",
    "FakeRunner",
    "NewRequestData",
    "NgramProposer",
    "OptimisticLifetimes",
    "PlannedTransfer",
    "PriorityQueue",
    "Request",
    "RequestQueue",
    "RequestStatus",
    "RequestUpdate",
    "RunnerOutput",
    "Scheduler",
    "SchedulerOutput",
    "SettledLifetimes",
    "StepLedger",
    "StepRecord",
    "Violation",
    "hashed_token",
    "make_queue",
]
