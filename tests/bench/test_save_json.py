"""Every saved result says what it was measured on (`kvtier.bench.save_json`): the CPU, the CPUs
the process may use, the environment that changes the kernels, and the commit it ran from — and
no other environment variable (one may hold a secret)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from kvtier.bench import save_json
from kvtier.cpus import usable_cpus

ROOT = Path(__file__).resolve().parents[2]


def test_a_result_records_the_build_the_cpu_and_the_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_CPU_ISA", "skylake-avx512")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    monkeypatch.setenv("KVTIER_API_KEY", "secret-key")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    path = save_json({"rows": [1]}, tmp_path / "sub" / "r.json")
    text = path.read_text()
    saved = json.loads(text)
    meta = saved["meta"]
    assert saved["rows"] == [1]
    assert meta["env"]["KVTIER_CPU_ISA"] == "skylake-avx512"
    assert meta["env"]["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    assert "OMP_NUM_THREADS" not in meta["env"]
    assert "secret-key" not in text and "KVTIER_API_KEY" not in text
    assert meta["cpus"] == usable_cpus()
    if Path("/proc/cpuinfo").exists() and "model name" in Path("/proc/cpuinfo").read_text():
        assert meta["cpu"]
    if (ROOT / ".git").exists():
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                              capture_output=True, text=True, check=True)  # fmt: skip
        assert meta["commit"] == head.stdout.strip()
        assert isinstance(meta["dirty"], bool)
    else:
        pytest.skip("not a git checkout: the commit is None")


def test_outside_a_checkout_the_commit_is_none(tmp_path, monkeypatch):
    """An installed package has no checkout above it: no commit, and no git call fails the run."""
    import kvtier.bench as bench

    fake = tmp_path / "site" / "kvtier" / "bench" / "__init__.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("")
    monkeypatch.setattr(bench, "__file__", str(fake))
    assert bench.run_meta()["commit"] is None
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT.*", bench.run_meta()["time"])
