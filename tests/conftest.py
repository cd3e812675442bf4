"""Shared test configuration: Hypothesis profiles (`ci` default and derandomized, `soak` for
-m slow), helper modules' asserts rewritten like tests', and one torch thread per test that uses
torch."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

if TYPE_CHECKING:
    from tests.stores.servers import RedisServer

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("soak", max_examples=5000, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def helper_modules() -> list[str]:
    """Modules of tests/ that are neither test modules nor conftests (factories, invariants,
    oracles, servers): pytest rewrites only test modules' asserts unless told."""
    root = Path(__file__).resolve().parent
    names = []
    for path in root.rglob("*.py"):
        if path.name.startswith("test_") or path.name in ("conftest.py", "__init__.py"):
            continue
        parts = path.relative_to(root.parent).with_suffix("").parts
        names.append(".".join(parts))
    return sorted(names)


# A helper's `assert` is a check like a test's: rewritten, it still runs under `python -O` (which
# strips plain asserts) and reports the values it compared.
pytest.register_assert_rewrite(*helper_modules())


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Toy-sized ops gain nothing from a thread pool, and on a busy 2-core machine OpenMP
    workers spinning for work slow the model suite down many times. Torch-free tests stay so."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    native = sys.modules.get("kvtier.model.native")
    if native is not None:  # an engine sets its kernels' threads too (engine/threads.py)
        native.set_threads(None)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server of the test's own, stopped at its end."""
    from tests.stores.servers import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()
