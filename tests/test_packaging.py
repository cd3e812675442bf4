"""The wheel carries every file the package reads at run time (the native kernels' sources and
headers, compiled on first use; the embedded model; presets) and nothing of the lab beside it:
no peer scripts, no experiments (docs/architecture.md §Shipping)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from kvtier.bench.lab import LAB_BENCHMARKS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "kvtier"


def test_the_wheel_ships_every_runtime_file(tmp_path: Path) -> None:
    tree = tmp_path / "tree"  # a copy: setuptools would reuse the checkout's build/ folder
    for folder in ("src", "benchmarks"):  # the lab beside src/, as in a checkout
        shutil.copytree(
            ROOT / folder, tree / folder, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__")
        )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*cmd, "-w", str(tmp_path), str(tree)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("kvtier-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = [
        *(PACKAGE / "model" / "csrc").iterdir(),
        *(PACKAGE / "model" / "default").iterdir(),
        *(PACKAGE / "presets").glob("*.json"),
    ]
    missing = [str(p.relative_to(ROOT / "src")) for p in wanted if p.is_file()]
    missing = [m for m in missing if m not in names]
    assert not missing, f"not in the wheel (pyproject.toml package-data): {missing}"
    lab = [n for n in names if n.startswith(("benchmarks/", "tests/")) or "/peers/" in n]
    lab += [n for n in names if n.endswith(tuple(f"bench/{b}.py" for b in LAB_BENCHMARKS))]
    assert not lab, f"the lab is not the product: {lab}"
