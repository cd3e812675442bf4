"""How many CPUs this process may use: its affinity mask (taskset, cpusets, a container's CPU
list) capped by its cgroup's CPU quota (`docker --cpus`, a Kubernetes CPU limit), which the mask
does not show. Every thread count kvtier chooses starts here (engine/threads.py, the kernel
build); the machine's count would oversubscribe a container whose quota is below it: the threads
past the quota wait for their slice and every step waits on the last of them. Standard library
only (the kernel build imports it)."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


def usable_cpus(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int:
    """CPUs this process may run on (its affinity mask), at most the cgroup quota rounded up,
    at least 1. `root` and `self_cgroup` are where the cgroup tree and this process's place in
    it are read from (tests pass a tree of their own)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without affinity masks
        cpus = os.cpu_count() or 1
    quota = cpu_quota(root, self_cgroup)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> float | None:
    """CPUs' worth of time per period this process's cgroup may use: the tightest quota on its
    path from the hierarchy's root (a parent's limit binds its children), cgroup v2
    (`cpu.max`: "quota period" or "max period") or v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`,
    -1 unlimited); None where none is set or nothing can be read."""
    places = _cgroup_paths(self_cgroup)
    quotas: list[float] = []
    v2 = places.get("")
    if v2 is not None:
        for folder in _ancestors(root, v2):
            quotas += _v2_quota(folder / "cpu.max")
    for controllers, path in places.items():
        if "cpu" in controllers.split(","):
            for folder in _ancestors(root / controllers, path):
                quotas += _v1_quota(folder)
    if not places:  # no /proc/self/cgroup (not Linux, or a test's bare tree): the root alone
        quotas += _v2_quota(root / "cpu.max") + _v1_quota(root / "cpu")
    return min(quotas) if quotas else None


def _cgroup_paths(self_cgroup: Path) -> dict[str, str]:
    """`/proc/self/cgroup` as controllers → path ("" for the v2 hierarchy's "0::/path" line)."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return {}
    places = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            places[parts[1]] = parts[2]
    return places


def _ancestors(base: Path, path: str) -> list[Path]:
    """`base` joined with `path` and with each of its parents up to `base` itself. A container's
    own cgroup namespace shows its path as "/" and mounts its cgroup at the root."""
    parts = [p for p in path.split("/") if p]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(cpu_max: Path) -> list[float]:
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota == "max":
            return []
        q, p = int(quota), int(period)
    except (OSError, ValueError):
        return []
    return [q / p] if q > 0 and p > 0 else []


def _v1_quota(folder: Path) -> list[float]:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return []
    return [quota / period] if quota > 0 and period > 0 else []
