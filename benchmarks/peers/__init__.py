"""Peer engines for `python -m benchmarks.compare`: each installs into its own venv (never the
project's environment, never vendored) and runs the same local model folder and workload as ours.

`venv` installs and finds the peer; `procs` runs its processes (a line-protocol worker and an HTTP
server). The programs those processes run are `scripts/vllm_*.py`: executed by the peer venv's
python, they never import kvtier (the peer venv does not have it) and print JSON lines on stdout.
They are programs, not modules (architecture.md §Shipping): the harness runs them by path, and
nothing imports, type-checks or layers them.
"""

from __future__ import annotations

from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"
VLLM_OFFLINE_SCRIPT = SCRIPTS / "vllm_offline.py"
VLLM_SCHED_SCRIPT = SCRIPTS / "vllm_sched.py"
VLLM_CLI_SCRIPT = SCRIPTS / "vllm_cli.py"
