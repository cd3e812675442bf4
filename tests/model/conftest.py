"""Tiny model folders shared by the model tests (built once per session, per architecture), and
the kernel library built for another ISA than this CPU's (`isa_build`)."""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.kernels.build import cpu_flags
from kvtier.model import native
from kvtier.model.testing import write_tiny_model

# what a CPU needs to run each build the tests ask for (its /proc/cpuinfo flags)
ISA_FLAGS = {
    "x86-64": set(),
    "x86-64-v3": {"avx2", "fma", "f16c", "bmi2"},
    "skylake-avx512": {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"},
    "cascadelake": {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
    | {"avx512_vnni"},
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[tuple[Any, ...], Path] = {}

    def make(arch: str, seed: int = 0, **config: Any) -> Path:
        key = (arch, seed, tuple(sorted(config.items())))
        if key not in cache:
            cache[key] = write_tiny_model(tmp_path_factory.mktemp(arch), arch, seed, **config)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def isa_build() -> Callable[[str], native.Kernels]:
    """`isa_build(isa)`: the kernel library built for `isa` (an -march in ISA_FLAGS), skipping
    where this machine cannot build or run it; a failed build fails the test."""

    def get(isa: str) -> native.Kernels:
        if platform.machine() != "x86_64" or shutil.which(os.environ.get("CC", "cc")) is None:
            pytest.skip(f"the {isa} build needs an x86-64 CPU and a C compiler")
        missing = ISA_FLAGS[isa] - cpu_flags()
        if missing:
            pytest.skip(f"this CPU cannot run the {isa} build (no {', '.join(sorted(missing))})")
        built = native.build(isa)
        assert built is not None, f"the {isa} build failed (its log says why)"
        return built

    return get
