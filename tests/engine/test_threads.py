"""torch's kernel threads: by default the usable cores but one (the host thread keeps a core),
at least one; `torch_threads` / `--torch-threads` overrides; the engine logs what it chose."""

from __future__ import annotations

import logging

import pytest
import torch

from kvtier.engine import LLM
from kvtier.engine.threads import default_torch_threads, usable_cores


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (4, 3), (64, 63)])
def test_default_leaves_the_host_a_core(cores: int, threads: int) -> None:
    assert default_torch_threads(cores) == threads


def test_the_engine_sets_and_logs_its_thread_count(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvtier.engine"):
        LLM(max_model_len=64, num_device_blocks=64)
    assert torch.get_num_threads() == default_torch_threads()
    assert (
        f"torch threads: {default_torch_threads()} of {usable_cores()} usable cores" in caplog.text
    )
    with caplog.at_level(logging.INFO, logger="kvtier.engine"):
        LLM(max_model_len=64, num_device_blocks=64, torch_threads=2)
    assert torch.get_num_threads() == 2 and "(--torch-threads)" in caplog.text


def test_a_bad_thread_count_names_the_flag() -> None:
    for bad in (0, 10**9):
        with pytest.raises(ValueError, match=r"--torch-threads must be in 1\.\.1024"):
            LLM(torch_threads=bad)
