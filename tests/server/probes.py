"""Checks run inside an engine process (`EngineProcess.call` sends functions by reference, so
they live at module level here)."""

from __future__ import annotations

from kvtier.engine.core import EngineCore


def idle(engine: EngineCore) -> bool:
    return engine.stats().num_requests == 0 and not engine.has_unfinished_requests()


def num_requests(engine: EngineCore) -> int:
    return engine.stats().num_requests


def pools_intact(engine: EngineCore) -> tuple[float, int]:
    """Integrity checked; the device pool's usage and its quarantined references."""
    engine.check_integrity()
    device = engine.stats().device
    return device.usage, device.num_quarantined_refs


def pid(engine: EngineCore) -> int:
    import os

    return os.getpid()


def stall(engine: EngineCore) -> None:
    """Hold the engine thread for a minute (a hung step)."""
    import time

    time.sleep(60)
