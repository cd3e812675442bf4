"""The runner and model keep every tensor of a step on the device and never wait for the device
inside an op: the engine run end to end on `AuditDevice` (a stand-in accelerator over the CPU, see
`placement.py`) records no mix-up and no host read, and gives the tokens of the plain cpu backend.
The audit itself is shown to catch each kind of mistake."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.engine import LLM, SamplingParams
from kvtier.model.testing import write_tiny_model
from tests.runner.placement import ACCEL, AuditDevice, PlacementAudit, Violation

SMALL = {"max_model_len": 128, "block_size": 4, "max_num_batched_tokens": 32}
PROMPTS = [[(7 * i) % 300 + 3 for i in range(20)], list(range(40, 47)), [5, 6, 7, 5, 6, 7, 5, 6]]
PARAMS = {
    "greedy": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    "seeded-top-k-p": SamplingParams(
        max_tokens=12, temperature=0.8, top_k=5, top_p=0.9, seed=3, ignore_eos=True
    ),
    "logprobs": SamplingParams(
        max_tokens=8, min_tokens=4, temperature=1.0, seed=1, logprobs=2, prompt_logprobs=1
    ),
}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("gemma3"), "gemma3", window=8)


def run(model: Path, params: SamplingParams, **kw: Any) -> list[list[int]]:
    llm = LLM(str(model), **{**SMALL, **kw})
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def audited_run(
    monkeypatch: pytest.MonkeyPatch, model: Path, params: SamplingParams, **kw: Any
) -> tuple[list[list[int]], list[Violation]]:
    """`run` with every engine built on an AuditDevice, the host thread audited too."""
    audit = PlacementAudit()

    def make_device(backend: str, layout: Any, num_device: int, num_host: int, **dkw: Any) -> Any:
        dkw.pop("seed", None)
        return AuditDevice(layout, num_device, num_host, audit=audit, **dkw)

    with monkeypatch.context() as m, audit.mode():
        m.setattr("kvtier.engine.core.make_device", make_device)
        tokens = run(model, params, **kw)
    return tokens, audit.violations


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_steps_keep_every_tensor_on_the_device_and_never_read_it_back(
    name: str, gemma3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kw = {"async_depth": 2, "num_host_blocks": 64, "num_device_blocks": 120}
    got, violations = audited_run(monkeypatch, gemma3, PARAMS[name], **kw)
    assert violations == []
    assert got == run(gemma3, PARAMS[name], **kw)


def test_a_mixture_of_experts_hybrid_never_reads_its_routing_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GraniteMoeHybrid (Mamba2 and attention layers, 4 routed experts): on a device the experts
    run under a dense routing matrix, giving the plain cpu run's tokens (its expert loop read the
    chosen experts back: `unique`, `tolist`, `nonzero`, a sync per layer on cuda)."""
    model = write_tiny_model(tmp_path / "granite", "granite_hybrid")
    kw = {"async_depth": 2, "num_host_blocks": 64, "num_device_blocks": 120}
    got, violations = audited_run(monkeypatch, model, PARAMS["seeded-top-k-p"], **kw)
    assert [str(v) for v in violations] == []
    assert got == run(model, PARAMS["seeded-top-k-p"], **kw)


def test_drafts_read_tokens_back_only_to_accept_and_propose(
    gemma3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, violations = audited_run(monkeypatch, gemma3, PARAMS["greedy"], num_speculative_tokens=2)
    assert violations  # the documented exception: drafts are proposed on the device's tokens
    assert {v.where for v in violations} == {"kvtier.runner.sampling.StepSampler._accept_drafts"}


def test_the_audit_catches_a_host_tensor_in_a_device_op_and_a_host_read() -> None:
    audit = PlacementAudit()
    with audit.mode():
        on_device = torch.zeros(4, device=ACCEL)
        _ = on_device + torch.ones(4)  # forgot .to(device)
        _ = on_device.tolist()  # waits for the device
        _ = on_device + torch.ones(4).to(ACCEL)  # fine: moved first
        _ = on_device * torch.tensor(2.0)  # fine: a 0-dim host scalar
        _ = on_device.to("cpu").tolist()  # fine: an explicit copy, then a host read
        _ = on_device.repeat_interleave(2, dim=0)  # fine: its size follows from the shape
        counts = torch.ones(4, dtype=torch.long, device=ACCEL)
        _ = on_device.repeat_interleave(counts)  # sums the device's repeats on the host
    assert [(v.kind, v.call) for v in audit.violations] == [
        ("mix", "add"),
        ("host-read", "tolist"),
        ("host-read", "repeat_interleave"),
    ]
