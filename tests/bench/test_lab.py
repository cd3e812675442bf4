"""`kvtier bench compare · roofline` hand the process to the lab (`benchmarks/` of the checkout,
docs/architecture.md §Shipping); an installed package without the checkout says where to run them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench import BENCHMARKS
from kvtier.bench.lab import LAB_BENCHMARKS, checkout_root, lab_command

ROOT = Path(__file__).resolve().parents[2]


def kvtier(
    *args: str, src: Path = ROOT / "src", cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(src))
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=cwd)  # fmt: skip


def test_the_lab_benchmarks_are_commands_of_kvtier_bench() -> None:
    assert set(LAB_BENCHMARKS) <= set(BENCHMARKS)
    assert checkout_root(ROOT / "src" / "kvtier") == ROOT
    for name in LAB_BENCHMARKS:  # in the lab, not in the package
        assert (ROOT / "benchmarks" / f"{name}.py").is_file()
        assert not (ROOT / "src" / "kvtier" / "bench" / f"{name}.py").exists()


def test_bench_compare_runs_the_lab_from_the_checkout(tmp_path: Path) -> None:
    """A real `--merge` run through the console command: the lab reads the saved run, prints the
    table and writes the merged JSON where it was told, relative to the caller's directory."""
    row = {"metric": "offline output tok/s", "setting": "tiny", "ours": [3.0, 3.0],
           "theirs": [2.0, 2.0], "better": "higher", "target": 1.2}  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps({"peer": {"version": "0.32.0"}, "rows": [row]}))
    r = kvtier("bench", "compare", "--merge", "run.json", "--out", "merged.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["rows"][0]["ratio"] == pytest.approx(1.5)
    assert "offline output tok/s" in r.stdout


def test_the_lab_sees_the_flags_and_its_exit_status_is_the_commands() -> None:
    r = kvtier("bench", "roofline", "--batch-sizes", "many")
    assert r.returncode == 2
    assert "python -m benchmarks.roofline" in r.stderr and "--batch-sizes" in r.stderr


def test_an_installed_package_says_to_run_the_lab_from_a_checkout(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    shutil.copytree(ROOT / "src" / "kvtier", site / "kvtier",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "default"))  # fmt: skip
    assert checkout_root(site / "kvtier") is None
    r = kvtier("bench", "compare", "--help", src=site, cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "git checkout" in r.stderr and "python -m benchmarks.compare" in r.stderr


def test_a_checkout_is_src_kvtier_beside_benchmarks(tmp_path: Path) -> None:
    package = tmp_path / "src" / "kvtier"
    package.mkdir(parents=True)
    assert checkout_root(package) is None  # no lab beside it
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "__init__.py").write_text("")
    assert checkout_root(package) == tmp_path
    cmd, env = lab_command("compare", ["--repeat", "1"], tmp_path)
    assert cmd == [sys.executable, "-m", "benchmarks.compare", "--repeat", "1"]
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(package.parent), str(tmp_path)]
    with pytest.raises(ValueError, match="'kv' is not a lab benchmark"):
        lab_command("kv", [], tmp_path)
