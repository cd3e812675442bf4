"""Run a snippet in a fresh interpreter where importing some packages fails: the one check that a
layer (kv/, sched/, offload planning, the sanitizer) stays torch-free, and that the engine needs
no optional client (redis) it was not configured to use."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_PRELUDE = """
import sys

BLOCKED = {blocked!r}

class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{{name}} is blocked in this test", name=name)
        return None

sys.meta_path.insert(0, _Block())
for _name in BLOCKED:
    try:
        __import__(_name)
    except ImportError:
        pass
    else:
        raise AssertionError(f"the blocker did not block {{_name}}")
"""

_EPILOGUE = """
_loaded = sorted({m for m in sys.modules if m.split(".")[0] in BLOCKED})
assert not _loaded, f"imported although blocked: {_loaded}"
"""


def run_blocking(blocked: tuple[str, ...], body: str, timeout: float = 120) -> str:
    """Run `body` with the packages `blocked` unimportable; returns its stdout. AssertionError
    (with stderr) on failure or if any of them was imported."""
    code = _PRELUDE.format(blocked=blocked) + textwrap.dedent(body) + _EPILOGUE
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def run_without_torch(body: str, timeout: float = 120) -> str:
    """Run `body` with torch blocked; returns its stdout. AssertionError (with stderr) on failure."""
    return run_blocking(("torch",), body, timeout)
