"""The sanitizer, records and cost model import no torch: run them with torch blocked."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys

    class BlockTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is blocked in this test")
            return None

    sys.meta_path.insert(0, BlockTorch())
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
    assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
    print("ok")
    """
)


def test_sanitizer_types_and_costs_run_with_torch_blocked() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
