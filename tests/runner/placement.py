"""A placement audit for the runner and model, run on the CPU: `AuditDevice` is the cpu backend
with a stand-in accelerator (`ACCEL`, i.e. `cpu:1`) as its torch device, and `PlacementAudit`
(a TorchFunctionMode) tracks which tensors live there by storage. It records, with the kvtier
function that did it:

- a mix-up: one call taking accelerator tensors and host tensors (other than 0-dim scalars,
  which CUDA accepts too), unless the call is an explicit transfer (`to`, `copy_`, `cpu`);
- a host read of accelerator data (`tolist`, `item`, `int()`, `bool()`, `nonzero`, boolean
  masks, …): on a GPU each one blocks the calling thread until the device catches up.

Numbers are real (it is the CPU underneath), so an audited run must also give the usual tokens.
Generators are not tensors, so the audit cannot see where one lives (`cpu:1` reads back as `cpu`):
the runner builds its generator on `device.torch_device` and the sampler its per-row ones on the
logits' device, which the audit does see.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kvtier.device.cpu import CpuDevice
from kvtier.device.types import Tier
from kvtier.ids import StreamId

ACCEL = torch.device("cpu", 1)  # where "device" tensors are meant to be; they land on the CPU

TRANSFERS = {"to", "copy_", "cpu", "cuda", "pin_memory"}
MODULE_MOVES = {"__set__", "_has_compatible_shallow_copy_type"}  # nn.Module.to swapping .data
DEVICE_ATTR = torch._C.TensorBase.__dict__["device"]  # `x.device`, seen as its __get__
HOST_READS = {
    "tolist",
    "item",
    "__int__",
    "__float__",
    "__bool__",
    "__index__",
    "numpy",
    "nonzero",
    "masked_select",
    "unique",
    "repeat_interleave",
}


@dataclass(frozen=True)
class Violation:
    kind: str  # "mix" or "host-read"
    call: str  # the torch function
    where: str  # the innermost kvtier function on the stack

    def __str__(self) -> str:
        return f"{self.kind} in {self.call} at {self.where}"


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("kvtier.") and not name.startswith("kvtier.device"):
            qual = frame.f_code.co_qualname
            return f"{name}.{qual}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<outside kvtier>"


class PlacementAudit:
    """Tags tensors on `ACCEL` by storage and records `Violation`s. Each thread enters its own
    `mode()`; they share this state (appends and dict writes under the GIL)."""

    def __init__(self) -> None:
        self._accel: dict[int, torch.UntypedStorage] = {}  # kept alive: addresses never reused
        self.violations: list[Violation] = []

    def tag(self, t: torch.Tensor) -> None:
        if t.numel():
            storage = t.untyped_storage()
            self._accel[storage.data_ptr()] = storage

    def on_accel(self, t: torch.Tensor) -> bool:
        return bool(t.numel()) and t.untyped_storage().data_ptr() in self._accel

    def mode(self) -> _Mode:
        """A TorchFunctionMode that routes every torch call of this thread through `call`."""
        return _Mode(self)

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        name = getattr(func, "__name__", str(func))
        if getattr(func, "__self__", None) is DEVICE_ATTR:  # "where x is" must say ACCEL
            return ACCEL if self.on_accel(args[0]) else func(*args, **kwargs)
        inputs = [t for t in _tensors((args, kwargs)) if t.numel()]
        accel = [self.on_accel(t) for t in inputs]
        if any(accel):
            index = args[1] if name in ("__getitem__", "__setitem__") and len(args) > 1 else None
            masks = [t for t in _tensors(index) if t.dtype == torch.bool and self.on_accel(t)]
            if (name in HOST_READS and not _sized(name, args, kwargs)) or masks:
                # a boolean mask's result size is data-dependent
                self.violations.append(Violation("host-read", name, _caller()))
            host = [t for t, a in zip(inputs, accel, strict=True) if not a and t.dim()]
            if host and name not in TRANSFERS | MODULE_MOVES:
                self.violations.append(Violation("mix", name, _caller()))
        target = _target_device(name, args, kwargs)
        result = func(*args, **kwargs)
        if name in TRANSFERS and target is not None:
            if isinstance(result, torch.Tensor) and inputs and result is inputs[0]:
                result = result.clone()  # a move that did not copy still changes placement
            if target == ACCEL:
                self.tag(result)
            return result
        if target == ACCEL or (any(accel) and name not in ("copy_",)):
            for t in _tensors(result):
                self.tag(t)
        return result


class _Mode(TorchFunctionMode):
    def __init__(self, audit: PlacementAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.audit.call(func, args, kwargs or {})


def _sized(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A `repeat_interleave` whose output size follows from shapes (int repeats, or output_size
    given) reads nothing back; with a tensor of repeats it must sum them on the host."""
    if name != "repeat_interleave":
        return False
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    return isinstance(repeats, int) or kwargs.get("output_size") is not None


def _target_device(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The device a call puts its result on, if it names one."""
    device = kwargs.get("device")
    if name == "cpu":
        return torch.device("cpu")
    if name == "to":
        for a in args[1:]:
            if isinstance(a, torch.device | str):
                device = a
            elif isinstance(a, torch.Tensor):
                return ACCEL if a.device == ACCEL else None
    if device is None:
        return None
    device = torch.device(device)
    return ACCEL if device == ACCEL else torch.device("cpu")


class AuditDevice(CpuDevice):
    """The threaded cpu backend with `ACCEL` as its torch device: device-tier memory is tagged,
    and every op runs under the audit on its stream's worker."""

    kind = "audit"
    torch_device = ACCEL

    def __init__(self, *args: Any, audit: PlacementAudit, **kwargs: Any) -> None:
        self.audit = audit
        super().__init__(*args, **kwargs)

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype, tier: Tier) -> torch.Tensor:
        t = torch.zeros(shape, dtype=dtype)
        if tier == "device":
            self.audit.tag(t)
        return t

    def _run_op(self, stream: StreamId, fn: Any) -> None:
        with self.audit.mode():
            fn()
