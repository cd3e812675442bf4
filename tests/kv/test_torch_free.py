"""`kvtier.kv` imports no torch: import every module of it with torch blocked and allocate."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    class BlockTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is blocked in this test")
            return None

    sys.meta_path.insert(0, BlockTorch())
    try:
        import torch
    except ImportError:
        pass
    else:
        raise AssertionError("the blocker did not block torch")

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
    assert not any(n == "torch" or n.startswith("torch.") for n in sys.modules)
    print("ok", len(list(pkgutil.iter_modules(kvtier.kv.__path__))))
    """
)


def test_kv_package_imports_and_allocates_with_torch_blocked():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")
    assert int(out.stdout.split()[1]) >= 9  # every kv module was imported, not just the package
