"""The CPUs this process may use (`kvtier.cpus`): the affinity mask capped by the cgroup quota,
v2 and v1, the tightest along the process's cgroup path; read from cgroup trees built here, and
the affinity narrowed for real in a child process, whose engine then sizes its threads by it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cpus import cpu_quota, usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


def tree(root: Path, self_cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup tree under `root` holding `files` (path → text) and a /proc/self/cgroup."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    own = root / "self_cgroup"
    own.write_text(self_cgroup)
    return root, own


def test_v2_quota_of_the_process_cgroup(tmp_path: Path) -> None:
    root, own = tree(tmp_path, "0::/kv.slice/job\n", {
        "cpu.max": "max 100000\n",
        "kv.slice/cpu.max": "max 100000\n",
        "kv.slice/job/cpu.max": "150000 100000\n",
    })  # fmt: skip
    assert cpu_quota(root, own) == 1.5
    assert usable_cpus(root, own) == min(AFFINITY, 2)  # 1.5 CPUs of time: two threads


def test_a_parent_quota_binds_its_children(tmp_path: Path) -> None:
    root, own = tree(tmp_path, "0::/kv.slice/job\n", {
        "kv.slice/cpu.max": "50000 100000\n",
        "kv.slice/job/cpu.max": "400000 100000\n",
    })  # fmt: skip
    assert cpu_quota(root, own) == 0.5
    assert usable_cpus(root, own) == 1


def test_a_container_namespace_reads_its_root(tmp_path: Path) -> None:
    root, own = tree(tmp_path, "0::/\n", {"cpu.max": "100000 100000\n"})
    assert cpu_quota(root, own) == 1.0 and usable_cpus(root, own) == 1


def test_v1_cfs_quota(tmp_path: Path) -> None:
    root, own = tree(tmp_path, "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "100000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        "memory/docker/abc/cpu.cfs_quota_us": "1000\n",  # not the cpu controller's: ignored
        "memory/docker/abc/cpu.cfs_period_us": "100000\n",
    })  # fmt: skip
    assert cpu_quota(root, own) == 1.0 and usable_cpus(root, own) == 1
    (root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us").write_text("-1\n")  # unlimited
    assert cpu_quota(root, own) is None and usable_cpus(root, own) == AFFINITY


@pytest.mark.parametrize("text", ["", "garbage\n", "max 100000\n", "0 0\n"])
def test_no_quota_leaves_the_affinity(tmp_path: Path, text: str) -> None:
    root, own = tree(tmp_path, "0::/job\n", {"job/cpu.max": text} if text else {})
    assert cpu_quota(root, own) is None
    assert usable_cpus(root, own) == AFFINITY
    assert usable_cpus(tmp_path / "absent", tmp_path / "absent") == AFFINITY


def test_without_proc_self_cgroup_the_root_is_read(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cpu_quota(tmp_path, tmp_path / "no-such-file") == 2.5
    assert usable_cpus(tmp_path, tmp_path / "no-such-file") == min(AFFINITY, math.ceil(2.5))


CHILD = """
import os, sys, torch
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
from kvtier.cpus import usable_cpus
from kvtier.engine.threads import configure_torch_threads
from kvtier.model import native
threads = configure_torch_threads(None)
print(usable_cpus(), threads, torch.get_num_threads(), native.threads())
"""


def test_a_narrowed_affinity_sizes_the_engine_threads() -> None:
    """taskset's effect, in a child: one CPU left, one thread for torch and the native kernels."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "1", "1"]
