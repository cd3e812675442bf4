"""The sim backend's cost model: how long an op lasts in virtual nanoseconds, and the host's
launch overhead. Torch-free; the other backends ignore `Work` (real hardware decides)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

WorkKind = Literal["fixed", "forward", "copy"]


@dataclass(frozen=True, slots=True)
class Work:
    """What an op costs on the simulated device; build with `fixed`, `forward` or `copy`."""

    kind: WorkKind
    ns: int = 0
    num_tokens: int = 0
    num_layers: int = 0
    num_bytes: int = 0

    @classmethod
    def fixed(cls, ns: int) -> Work:
        """An op lasting exactly `ns` virtual nanoseconds (before jitter)."""
        if ns < 0:
            raise ValueError(f"Work.fixed(ns) needs ns >= 0, got {ns}")
        return cls("fixed", ns=ns)

    @classmethod
    def forward(cls, num_tokens: int, num_layers: int) -> Work:
        """A model forward over `num_tokens` tokens through `num_layers` layers."""
        if num_tokens < 0 or num_layers <= 0:
            raise ValueError(
                f"Work.forward needs num_tokens >= 0 and num_layers > 0, "
                f"got {num_tokens}, {num_layers}"
            )
        return cls("forward", num_tokens=num_tokens, num_layers=num_layers)

    @classmethod
    def copy(cls, num_bytes: int) -> Work:
        """A copy moving `num_bytes` between tiers (or within one)."""
        if num_bytes < 0:
            raise ValueError(f"Work.copy(num_bytes) needs num_bytes >= 0, got {num_bytes}")
        return cls("copy", num_bytes=num_bytes)


@dataclass(frozen=True)
class CostModel:
    """Virtual-time costs. Defaults are round numbers of a small GPU, not a calibration.

    `jitter` is the relative spread of every op duration: each lasts base × U(1 − j, 1 + j),
    drawn from the device's seeded generator, so one seed gives one trace.
    """

    launch_ns: int = 4_000  # host time to launch one op
    event_ns: int = 1_000  # host time to record, wait on or query an event
    kernel_ns: int = 5_000  # an op launched without `Work`
    forward_layer_ns: int = 20_000  # fixed part of a forward, per layer
    forward_token_layer_ns: int = 300  # per token and layer
    copy_latency_ns: int = 8_000
    copy_bytes_per_ns: float = 20.0  # 20 GB/s
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError(f"CostModel.jitter must be in [0, 1), got {self.jitter}")
        if self.copy_bytes_per_ns <= 0:
            raise ValueError(
                f"CostModel.copy_bytes_per_ns must be > 0, got {self.copy_bytes_per_ns}"
            )

    def base_ns(self, work: Work | None) -> int:
        """Duration of `work` without jitter."""
        if work is None:
            return self.kernel_ns
        if work.kind == "forward":
            per_layer = self.forward_layer_ns + self.forward_token_layer_ns * work.num_tokens
            return per_layer * work.num_layers
        if work.kind == "copy":
            return self.copy_latency_ns + int(work.num_bytes / self.copy_bytes_per_ns)
        return work.ns

    def duration_ns(self, work: Work | None, rng: random.Random) -> int:
        """Duration of `work` with jitter from `rng` (advanced only when jitter > 0)."""
        base = self.base_ns(work)
        if self.jitter == 0.0:
            return base
        return max(0, round(base * rng.uniform(1.0 - self.jitter, 1.0 + self.jitter)))
