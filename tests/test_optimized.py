"""`python -O` strips `assert`: the engine's invariants that must hold in production raise real
exceptions (`kv.IntegrityError`), and the tests' own checks survive it (tests/conftest.py has
pytest rewrite the helper modules' asserts, and no helper's assert carries a side effect)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

from tests.conftest import helper_modules

ROOT = Path(__file__).resolve().parent.parent
# A double free (kv), a ledger out of order (sched), the offload factories (an allocation once sat
# inside an assert)
SUBSET = (
    "tests/kv/test_block_pool.py",
    "tests/sched/test_units.py",
    "tests/offload/test_scenarios_f.py",
)
# Calls that change state: inside an `assert`, `python -O` would skip them outside pytest's rewrite
MUTATORS = frozenset(
    {"allocate_slots", "free", "touch", "get_new_blocks", "cache_full_blocks", "evict_blocks"}
    | {"release_quarantine", "append", "pop", "insert", "put", "add_request", "step"}
)


def test_a_subset_passes_under_python_O() -> None:
    run = subprocess.run(
        [sys.executable, "-O", "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUBSET],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_helper_modules_keep_their_asserts() -> None:
    """Rewritten by pytest like a test module, so their checks run under `python -O` too."""
    names = helper_modules()
    assert "tests.sched.invariants" in names and "tests.offload.factories" in names
    for name in ("tests.kv.factories", "tests.offload.factories", "tests.sched.invariants"):
        loader = importlib.import_module(name).__loader__
        assert type(loader).__name__ == "AssertionRewritingHook", (name, loader)


def test_no_helper_asserts_a_state_change() -> None:
    """An assert in a helper module calls no mutator: outside pytest (a benchmark importing a
    factory, a plain `python -O` run) the call would be skipped with the check."""
    found = []
    for name in helper_modules():
        path = ROOT / (name.replace(".", "/") + ".py")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Assert):
                continue
            for call in ast.walk(node.test):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr in MUTATORS
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {call.func.attr}()")
    assert not found, found
