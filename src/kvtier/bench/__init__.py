"""Benchmarks: each module `kvtier.bench.<name>` exposes `add_arguments(parser)` and `run(args)`.

`kvtier bench <name>` dispatches here (see `kvtier.cli`), or for the lab's benchmarks
(`lab.LAB_BENCHMARKS`) to `benchmarks/` of a git checkout. Benchmarks print a summary and save
JSON; they never assert timings."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from kvtier.cpus import usable_cpus
from kvtier.kernels.build import cpu_model

BENCHMARKS = (
    "kv",
    "device",
    "sched",
    "throughput",
    "garble",
    "serve",
    "router",
    "offload",
    "compare",
    "preempt",
    "roofline",
    "overlap",
    "admission",
    "grammar",
    "sampler",
)


# environment variables that change what a run measures (the kernels' build, oneDNN's ISA, thread
# counts): recorded with every result. An allow-list: others may hold secrets (KVTIER_API_KEY).
RECORDED_ENV = (
    "KVTIER_CPU_ISA",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
)


def run_meta() -> dict[str, Any]:
    """What a saved result was measured on: when, the machine (its CPU model, and the CPUs this
    process may use as every thread count kvtier chooses counts them: `usable_cpus`), the
    environment that changes the kernels (`RECORDED_ENV`) and the commit of the checkout the code
    ran from (None outside one; `dirty` when it has uncommitted changes)."""
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu": cpu_model(),
        "cpus": usable_cpus(),
        "env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ},
        **_commit(),
    }


def _commit() -> dict[str, Any]:
    """{"commit": the HEAD of the git checkout this package runs from, "dirty": uncommitted
    changes to tracked files}; {"commit": None} for an installed package or without git."""
    root = Path(__file__).resolve().parents[3]  # src/kvtier/bench/ → the checkout
    if not (root / ".git").exists():
        return {"commit": None}
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True)  # fmt: skip
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                 "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def save_json(result: dict[str, Any], out: str | Path) -> Path:
    """Write `result` plus `run_meta()` to `out` (parents created) and return the path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": run_meta(), **result}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path
