"""Tiny model folders shared by the model tests (built once per session, per architecture)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.model.testing import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[tuple[Any, ...], Path] = {}

    def make(arch: str, seed: int = 0, **config: Any) -> Path:
        key = (arch, seed, tuple(sorted(config.items())))
        if key not in cache:
            cache[key] = write_tiny_model(tmp_path_factory.mktemp(arch), arch, seed, **config)
        return cache[key]

    return make
