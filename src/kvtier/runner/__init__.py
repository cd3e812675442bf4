"""Runner: turns a `SchedulerOutput` into device ops (forward, sampling, sampled-token copy) and
hands back a `RunnerOutput` once the host has synchronised on the step's completion event."""

from __future__ import annotations

from kvtier.runner.runner import ModelRunner, StepHandle

__all__ = ["ModelRunner", "StepHandle"]
