"""`tools/gpu_check.sh` as far as a machine without a GPU can run it: its preflight (the listed
needs import, the checks' modules and tests import with kvtier limited to them) passes, then it
refuses naming the missing GPU and exits 2; every pytest selection it runs names tests that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_without_a_gpu_it_refuses_naming_the_missing_gpu() -> None:
    run = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "refused: no CUDA GPU visible" in run.stderr
    assert "PASS" not in run.stdout and "FAIL" not in run.stdout


def test_its_pytest_selections_collect_gpu_tests() -> None:
    selections = re.findall(r"pytest_gpu (\S+)(?: -k \"([^\"]+)\")?", SCRIPT.read_text())
    paths = sorted({path for path, _ in selections})
    run = subprocess.run(
        [
            "python3",
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            *paths,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    ids = [line for line in run.stdout.splitlines() if "::" in line]
    for path, keyword in selections:
        chosen = [i for i in ids if i.startswith(path) and (not keyword or keyword in i)]
        assert chosen, (path, keyword, run.stdout[-500:])


def script_list(name: str) -> list[str]:
    """The words of one of the script's lists (NEEDS, GPU_TESTS, CLI_MODULES)."""
    found = re.search(rf'^{name}="([^"]*)"', SCRIPT.read_text(), re.M)
    assert found, name
    return found.group(1).split()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_its_preflight_passes_on_this_box_then_it_refuses_for_the_missing_gpu(
    tmp_path: Path,
) -> None:
    """CI's run of the script: every listed need imports, and the checks' modules and test files
    import with kvtier's imports limited to those needs (the redis client once failed it)."""
    env = {**os.environ, "GPU_CHECK_LOGS": str(tmp_path)}
    run = subprocess.run(
        ["bash", str(SCRIPT), "--preflight"], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "preflight: ok" in run.stdout
    assert "refused: no CUDA GPU visible" in run.stderr


def test_its_lists_name_every_test_file_and_bench_the_checks_run() -> None:
    text = SCRIPT.read_text()
    paths = set(re.findall(r"pytest_gpu (\S+)", text))
    assert paths and paths <= set(script_list("GPU_TESTS"))
    benches = {f"kvtier.bench.{b}" for b in re.findall(r"kvtier\.cli bench (\w+)", text)}
    assert benches and benches | {"kvtier.cli"} <= set(script_list("CLI_MODULES"))


def test_the_preflight_names_an_import_of_kvtier_outside_the_needs() -> None:
    """Without xxhash among the needs, kvtier's own import of it (the prefix-cache hashes) is
    what the preflight reports: the guard refuses kvtier's imports, not only the needs' absence."""
    needs = [n for n in script_list("NEEDS") if n != "xxhash"]
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "gpu_preflight.py"),
            "--needs",
            *needs,
            "--modules",
            "kvtier.kv.hashing",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
    )
    assert run.returncode == 1
    assert "kvtier.kv.hashing imports xxhash" in run.stderr
