"""`kvtier bench compare · roofline · device · preempt · overlap · sampler`: these live in the
lab, `benchmarks/` of a git checkout, not in the package; from a checkout this hands the process
to `python -m benchmarks.<name>` (docs/architecture.md §Shipping). Nothing here imports the lab."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

LAB_BENCHMARKS = ("compare", "roofline", "device", "preempt", "overlap", "sampler")


def checkout_root(package: Path | None = None) -> Path | None:
    """The git checkout `package` (default: this kvtier) runs from, when it is `src/kvtier` of a
    checkout with `benchmarks/`; None for an installed package."""
    package = (package or Path(__file__).resolve().parent.parent).resolve()
    root = package.parent.parent
    if package.parent.name == "src" and (root / "benchmarks" / "__init__.py").is_file():
        return root
    return None


def lab_command(name: str, argv: list[str], root: Path | None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run lab benchmark `name` from checkout `root`; a
    SystemExit naming the fix when there is no checkout."""
    if name not in LAB_BENCHMARKS:
        raise ValueError(f"{name!r} is not a lab benchmark; those are {', '.join(LAB_BENCHMARKS)}")
    if root is None:
        raise SystemExit(
            f"kvtier bench {name}: this benchmark lives in the lab (benchmarks/ of kvtier's git "
            "checkout), which the installed package does not carry. Run it from a git checkout: "
            f"`pip install -e .` there, then `kvtier bench {name}` or `python -m benchmarks.{name}`."
        )
    env = dict(os.environ)
    paths = [str(root / "src"), str(root), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)  # this checkout's kvtier first
    return [sys.executable, "-m", f"benchmarks.{name}", *argv], env


def run_lab(name: str, argv: list[str]) -> NoReturn:
    """Replace this process with the lab benchmark, so its signals and exit status are the lab's
    own (a peer server it started is stopped by its own `finally`, never orphaned by a parent)."""
    cmd, env = lab_command(name, argv, checkout_root())
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)
