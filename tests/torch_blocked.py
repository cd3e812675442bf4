"""Run a snippet in a fresh interpreter where importing torch fails: the one check that a layer
(kv/, sched/, offload planning, the sanitizer) stays torch-free."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_PRELUDE = """
import sys

class _BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
        return None

sys.meta_path.insert(0, _BlockTorch())
try:
    import torch
except ImportError:
    pass
else:
    raise AssertionError("the blocker did not block torch")
"""

_EPILOGUE = """
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules), "torch was imported"
"""


def run_without_torch(body: str, timeout: float = 120) -> str:
    """Run `body` with torch blocked; returns its stdout. AssertionError (with stderr) on failure."""
    code = _PRELUDE + textwrap.dedent(body) + _EPILOGUE
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout
