"""Torch-free scheduling: requests and their step ledgers, queues, the scheduler with its admission,
the step contracts and the protocol of the KV tiers below the device. (Its test doubles live in
`kvtier.bench.fake_runner` and `tests/sched/`.)"""

from kvtier.sched.admission import Admission
from kvtier.sched.connector import KVTier, LoadFailure, TierLookup
from kvtier.sched.lifetimes import OptimisticLifetimes, SettledLifetimes
from kvtier.sched.ngram import NgramProposer
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
    "Admission",
    "CachedRequestData",
    "FCFSQueue",
    "KVTier",
    "LoadFailure",
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
    "TierLookup",
    "make_queue",
]
