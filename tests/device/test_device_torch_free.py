"""The sanitizer, records and cost model import no torch: run them with torch blocked."""

from __future__ import annotations

from tests.torch_blocked import run_without_torch

BODY = """
from kvtier.device import COMPUTE, STORE, AccessSet, OpId, OpMeta, Sanitizer, Work, CostModel
import kvtier.device.sanitizer, kvtier.device.types, kvtier.device.costs

san = Sanitizer("collect")
san.launch(COMPUTE, OpId(1), AccessSet.of(writes={"device": [0]}), OpMeta("forward"))
san.launch(STORE, OpId(2), AccessSet.of(reads={"device": [0]}), OpMeta("store"))
assert [h.kind for h in san.hazards] == ["RAW"], san.hazards
assert CostModel().base_ns(Work.copy(0)) == CostModel().copy_latency_ns
try:
    from kvtier.device import Device
except ImportError:
    pass
else:
    raise AssertionError("Device should need torch")
print("ok")
"""


def test_sanitizer_types_and_costs_run_with_torch_blocked() -> None:
    assert run_without_torch(BODY, timeout=60).strip() == "ok"
