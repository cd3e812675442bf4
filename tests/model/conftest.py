"""Tiny model folders shared by the model tests (built once per session, per architecture), and
one torch thread while a model test runs: toy-sized ops gain nothing from a thread pool, and on a
busy 2-core machine spinning OpenMP workers made this suite ~20x slower (125 s vs 7 s)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.model.testing import write_tiny_model


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[tuple[Any, ...], Path] = {}

    def make(arch: str, seed: int = 0, **config: Any) -> Path:
        key = (arch, seed, tuple(sorted(config.items())))
        if key not in cache:
            cache[key] = write_tiny_model(tmp_path_factory.mktemp(arch), arch, seed, **config)
        return cache[key]

    return make
