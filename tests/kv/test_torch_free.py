"""`kvtier.kv` imports no torch: import every module of it with torch blocked and allocate."""

from __future__ import annotations

from tests.torch_blocked import run_without_torch

BODY = """
import importlib, pkgutil
import kvtier.kv
for mod in pkgutil.iter_modules(kvtier.kv.__path__):
    importlib.import_module(f"kvtier.kv.{mod.name}")
from kvtier.kv import FullAttention, KVCacheManager, SlidingWindow

m = KVCacheManager([FullAttention(16), SlidingWindow(16, 32)], 16, max_model_len=256)
seq = m.new_sequence("r", list(range(40)))
new = m.allocate_slots(seq, 40)
assert new is not None and [len(g) for g in new] == [3, 3], new
m.free("r", last_step_seq=1)
assert m.release_quarantine(1) == 6
m.check_integrity()
print("ok", len(list(pkgutil.iter_modules(kvtier.kv.__path__))))
"""


def test_kv_package_imports_and_allocates_with_torch_blocked():
    out = run_without_torch(BODY)
    assert out.startswith("ok ")
    assert int(out.split()[1]) >= 9  # every kv module was imported, not just the package
