"""`tools/gpu_check.sh` as far as a machine without a GPU can run it: it refuses at once, names
what is missing and exits 2; every pytest selection it runs names tests that exist."""

from __future__ import annotations

import re
import subprocess
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
