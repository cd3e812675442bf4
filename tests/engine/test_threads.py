"""torch's kernel threads: by default the usable cores but one (the host thread keeps a core),
at least one, and every usable core for a model whose weights are large enough that a second
kernel thread pays for itself; `torch_threads` / `--torch-threads` overrides; the engine logs
what it chose."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvtier.cpus import usable_cpus
from kvtier.engine import LLM
from kvtier.engine.params import DEFAULT_MODEL
from kvtier.engine.threads import (
    ALL_CORES_WEIGHT_BYTES,
    checkpoint_bytes,
    default_torch_threads,
)
from kvtier.model import native


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (4, 3), (64, 63)])
def test_default_leaves_the_host_a_core(cores: int, threads: int) -> None:
    assert default_torch_threads(cores) == threads


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 2), (4, 4)])
def test_a_large_model_gets_every_core(cores: int, threads: int) -> None:
    assert default_torch_threads(cores, ALL_CORES_WEIGHT_BYTES) == threads
    assert default_torch_threads(cores, ALL_CORES_WEIGHT_BYTES - 1) == max(1, cores - 1)


def test_checkpoint_bytes_are_the_weight_files(tmp_path: Path) -> None:
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 5)
    (tmp_path / "tokenizer.json").write_bytes(b"x" * 100)
    assert checkpoint_bytes(tmp_path) == 15
    assert 0 < checkpoint_bytes(DEFAULT_MODEL) < ALL_CORES_WEIGHT_BYTES


def test_the_engine_sets_and_logs_its_thread_count(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvtier.engine"):
        LLM(max_model_len=64, num_device_blocks=64)
    assert torch.get_num_threads() == default_torch_threads()
    assert (
        f"torch threads: {default_torch_threads()} of {usable_cpus()} usable cores" in caplog.text
    )
    with caplog.at_level(logging.INFO, logger="kvtier.engine"):
        LLM(max_model_len=64, num_device_blocks=64, torch_threads=2)
    assert torch.get_num_threads() == 2 and "(--torch-threads)" in caplog.text
    assert native.threads() == 2  # a request binds the native kernels too


def test_native_kernels_get_every_core_by_default() -> None:
    """They release the GIL and decode attention is memory-bound: the host thread's core helps
    (docs/benchmarks.md); torch keeps its own count."""
    LLM(max_model_len=64, num_device_blocks=64)
    assert native.threads() == usable_cpus()
    assert torch.get_num_threads() == default_torch_threads()
    native.set_threads(None)
    assert native.threads() == torch.get_num_threads()
    with pytest.raises(ValueError, match="native kernel threads must be ≥ 1"):
        native.set_threads(0)


def test_a_bad_thread_count_names_the_flag() -> None:
    for bad in (0, 10**9):
        with pytest.raises(ValueError, match=r"--torch-threads must be in 1\.\.1024"):
            LLM(torch_threads=bad)


def test_the_engine_sizes_its_threads_by_the_checkpoint(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The embedded model is small; with the bar lowered under its weights, it gets every core."""
    from kvtier.engine import threads

    monkeypatch.setattr(threads, "ALL_CORES_WEIGHT_BYTES", checkpoint_bytes(DEFAULT_MODEL))
    with caplog.at_level(logging.INFO, logger="kvtier.engine"):
        LLM(max_model_len=64, num_device_blocks=64)
    assert torch.get_num_threads() == usable_cpus()
    assert "every core for" in caplog.text
