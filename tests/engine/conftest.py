"""Fixtures the engine tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.model.testing import write_tiny_model


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Gemma 3 with a sliding window of 8 (window and full layers side by side),
    written once per test module."""
    return write_tiny_model(tmp_path_factory.mktemp("gemma3"), "gemma3", window=8)
