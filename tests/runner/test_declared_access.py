"""Every buffer a runner op touches is in its access set: the forward declares the sampler's
random state and the step's results slot it fills, and the host op that reads a step's results
declares the slot it empties, so the sanitizer checks the ring reuse of both; a hybrid's forward
declares the state pages it reads and writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.device.base import Device
from kvtier.device.types import AccessSet, OpMeta
from kvtier.engine import LLM, SamplingParams
from kvtier.model.mamba2 import StateMetadata
from kvtier.model.testing import write_tiny_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def test_forward_and_result_reads_declare_every_buffer_they_touch(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops: list[tuple[str, int | None, AccessSet]] = []
    launch, host_op = Device.launch, Device.host_op

    def record_launch(self: Device, stream: Any, fn: Any, access: AccessSet, meta: OpMeta, *a: Any):
        ops.append((meta.label, meta.step_seq, access))
        return launch(self, stream, fn, access, meta, *a)

    def record_host_op(self: Device, fn: Any, access: AccessSet, meta: OpMeta) -> Any:
        ops.append((meta.label, meta.step_seq, access))
        return host_op(self, fn, access, meta)

    monkeypatch.setattr(Device, "launch", record_launch)
    monkeypatch.setattr(Device, "host_op", record_host_op)
    llm = LLM(str(llama), device="sim", max_num_batched_tokens=16, block_size=4, max_model_len=96)
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=1, logprobs=2, prompt_logprobs=1)
    [out] = llm.generate([{"prompt_token_ids": list(range(3, 30))}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6 and out.prompt_logprobs is not None
    ring = llm.engine.args.scheduler.depth + 1
    forwards = [(seq, a) for label, seq, a in ops if label == "forward"]
    reads = [(seq, a) for label, seq, a in ops if label == "read-sampled"]
    assert forwards and [s for s, _ in forwards] == [s for s, _ in reads]
    for seq, access in forwards:
        assert seq is not None
        written = {name for name, _ in access.writes}
        slot = f"step_results_{seq % ring}"
        assert {"token_state", "sampler_generator", "sampled_tokens", slot} <= written
    for seq, access in reads:
        assert seq is not None
        assert {name for name, _ in access.writes} == {f"step_results_{seq % ring}"}
        assert {name for name, _ in access.reads} == {f"sampled_host_{seq % ring}"}


@pytest.mark.parametrize(
    "config",
    [{"async_depth": 3}, {"enable_prefix_caching": False}, {"num_speculative_tokens": 3}],
)
def test_a_hybrid_forward_declares_every_state_page_it_reads_and_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict[str, Any]
) -> None:
    """architecture.md §Addressing: each forward reads its state from the page of its start and
    writes the state after its tokens to the page of its end (or one page per token); the forward
    op declares those pages, so the sanitizer checks state pages like KV blocks."""
    folder = write_tiny_model(tmp_path, "falcon_h1", num_kv_heads=4, mamba_d_state=4)
    forwards: list[AccessSet] = []
    used: list[tuple[set[int], set[int]]] = []  # (pages read, pages written) per forward
    launch, build = Device.launch, StateMetadata.build

    def record_launch(self: Device, stream: Any, fn: Any, access: AccessSet, meta: OpMeta, *a: Any):
        if meta.label == "forward" and any(ids for name, ids in access.writes if name == "device"):
            forwards.append(access)  # a step with work: it builds state metadata
        return launch(self, stream, fn, access, meta, *a)

    def record_build(*args: Any, **kwargs: Any) -> StateMetadata:
        meta = build(*args, **kwargs)
        plan = meta.plan(min(meta.src_slots))
        fresh = {i for i, c in enumerate(meta.num_computed_tokens) if c == 0}
        reads = {s for i, s in enumerate(meta.src_slots[min(meta.src_slots)]) if i not in fresh}
        writes = set(plan.decode_dst.tolist()) | {p[3] for p in plan.prefills}
        writes |= {s for step in plan.stepwise for s in step[4]}
        used.append((reads, writes))
        return meta

    monkeypatch.setattr(Device, "launch", record_launch)
    monkeypatch.setattr(StateMetadata, "build", staticmethod(record_build))
    llm = LLM(str(folder), device="sim", block_size=4, max_model_len=64, **config)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    batch = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 19, 30)]
    llm.generate(batch, params, use_tqdm=False)
    assert len(used) == len(forwards) > 0
    for access, (reads, writes) in zip(forwards, used, strict=True):
        declared_reads = {b for name, ids in access.reads if name == "device" for b in ids}
        declared_writes = {b for name, ids in access.writes if name == "device" for b in ids}
        assert writes <= declared_writes
        assert reads <= declared_reads | declared_writes
