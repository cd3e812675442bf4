"""Engine: `EngineCore` (sync and async loops), the offline `LLM` API and its parameters."""

from __future__ import annotations

from kvtier.engine.core import EngineCore
from kvtier.engine.llm import LLM, CompletionOutput, RequestOutput
from kvtier.engine.params import EngineArgs, SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "EngineCore", "RequestOutput", "SamplingParams"]
