"""Engine: `EngineCore` (sync and async loops), the offline `LLM` API and its parameters.

Names load on first use so that `kvtier.engine.cli` can build its flags without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.engine.core import EngineCore
    from kvtier.engine.llm import LLM, CompletionOutput, RequestOutput
    from kvtier.engine.params import EngineArgs, SamplingParams
    from kvtier.engine.requests import FinishedRequest, StepOutput
    from kvtier.engine.stats import EngineStats
    from kvtier.runner.transfers import TransferFaults
    from kvtier.sampling import StructuredOutputsParams

_HOMES = {
    "EngineCore": "core",
    "LLM": "llm",
    "CompletionOutput": "llm",
    "RequestOutput": "llm",
    "EngineArgs": "params",
    "SamplingParams": "params",
    "StructuredOutputsParams": "sampling",
    "FinishedRequest": "requests",
    "StepOutput": "requests",
    "EngineStats": "stats",
    "TransferFaults": "transfers",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "EngineCore",
    "EngineStats",
    "FinishedRequest",
    "RequestOutput",
    "SamplingParams",
    "StepOutput",
    "StructuredOutputsParams",
    "TransferFaults",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'kvtier.engine' has no attribute {name!r}")
    home = _HOMES[name]
    package = {"transfers": "kvtier.runner.", "sampling": "kvtier."}.get(home, "kvtier.engine.")
    return getattr(importlib.import_module(f"{package}{home}"), name)
