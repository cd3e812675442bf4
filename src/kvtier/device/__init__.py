"""Device layer: the `Device` the runner talks to (KV tiers, streams, events, ops with declared
access sets), its sim / cpu / cuda backends and the torch-free happens-before sanitizer.

Importing this package does not import torch: `Device` and the backends load on first use, so
`kvtier.device.sanitizer` stays usable where torch is blocked."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from kvtier.device.costs import CostModel, Work
from kvtier.device.sanitizer import Hazard, OpInfo, RaceError, Sanitizer, SanitizerMode
from kvtier.device.types import (
    COMPUTE,
    DEFAULT_STREAMS,
    HOST_STREAM,
    LOAD,
    STORE,
    WHOLE,
    AccessSet,
    KVLayout,
    OpMeta,
    Tier,
)
from kvtier.ids import BlockId, EventId, OpId, ReqId, StreamId

if TYPE_CHECKING:
    from kvtier.device.base import Device, DeviceError, OpFn

Backend = Literal["sim", "cpu", "cuda"]
BACKENDS: tuple[Backend, ...] = ("sim", "cpu", "cuda")


def make_device(
    backend: Backend,
    layout: KVLayout,
    num_device_blocks: int,
    num_host_blocks: int,
    *,
    sanitize: SanitizerMode | None = "raise",
    poison: bool = False,
    seed: int = 0,
    cost_model: CostModel | None = None,
) -> Device:
    """Build a device of kind `backend`; `seed` and `cost_model` matter to "sim" only."""
    if backend == "sim":
        from kvtier.device.sim import SimDevice

        return SimDevice(
            layout,
            num_device_blocks,
            num_host_blocks,
            cost_model=cost_model,
            seed=seed,
            sanitize=sanitize,
            poison=poison,
        )
    if backend == "cpu":
        from kvtier.device.cpu import CpuDevice

        return CpuDevice(
            layout, num_device_blocks, num_host_blocks, sanitize=sanitize, poison=poison
        )
    if backend == "cuda":
        from kvtier.device.cuda import CudaDevice

        return CudaDevice(
            layout, num_device_blocks, num_host_blocks, sanitize=sanitize, poison=poison
        )
    raise ValueError(f"device backend must be one of {BACKENDS}, got {backend!r}")


def __getattr__(name: str) -> Any:
    if name in ("Device", "DeviceError", "OpFn"):
        from kvtier.device import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "COMPUTE",
    "DEFAULT_STREAMS",
    "HOST_STREAM",
    "LOAD",
    "STORE",
    "WHOLE",
    "AccessSet",
    "Backend",
    "BlockId",
    "CostModel",
    "Device",
    "DeviceError",
    "EventId",
    "Hazard",
    "KVLayout",
    "OpFn",
    "OpId",
    "OpInfo",
    "OpMeta",
    "RaceError",
    "ReqId",
    "Sanitizer",
    "SanitizerMode",
    "StreamId",
    "Tier",
    "Work",
    "make_device",
]
