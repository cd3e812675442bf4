"""Benchmarks: each module `kvtier.bench.<name>` exposes `add_arguments(parser)` and `run(args)`.

`kvtier bench <name>` dispatches here (see `kvtier.cli`), or for the lab's benchmarks
(`lab.LAB_BENCHMARKS`) to `benchmarks/` of a git checkout. Benchmarks print a summary and save
JSON; they never assert timings."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

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


def save_json(result: dict[str, Any], out: str | Path) -> Path:
    """Write `result` plus machine metadata to `out` (parents created) and return the path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "meta": {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "processor": platform.processor(),
        },
        **result,
    }
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path
