"""The KV dtype the plan sizes is the dtype the pool stores: for every `--kv-cache-dtype` the
engine accepts (fp8 included: one byte an element, float8 codes), the plan's bytes per tier
equal the bytes of that tier's pool tensors; a value it cannot store (int8) is refused where it
is given. Before, fp8 was sized at one byte per element and allocated in the model's dtype:
twice the budget."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvtier.cli import main
from kvtier.config import CacheConfig
from kvtier.device.buffers import TORCH_DTYPES
from kvtier.engine import EngineArgs, EngineCore, SamplingParams
from kvtier.model.testing import write_kv_scaled_model, write_tiny_model

ARGS = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 32}
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")  # float32 weights


@pytest.fixture(scope="module")
def falcon_h1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("falcon"), "falcon_h1")


def pool_bytes(eng: EngineCore, tier: str) -> int:
    return sum(t.numel() * t.element_size() for t in eng.device.kv(tier))  # type: ignore[arg-type]


def assert_plan_is_allocated(eng: EngineCore, dtype: str) -> None:
    for tier in eng.plan.tiers:
        assert pool_bytes(eng, tier.name) == tier.total_bytes, (tier, dtype)
        assert {t.dtype for t in eng.device.kv(tier.name)} == {TORCH_DTYPES[dtype]}  # type: ignore[arg-type]


KV_DTYPES = [None, "auto", "float64", "float32", "bfloat16", "float16", "fp8", "fp8_e5m2"]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("budget", [{"num_device_blocks": 40}, {"kv_cache_memory_bytes": 1 << 20}])
def test_the_plans_bytes_are_the_pools_bytes(
    llama: Path, kv_dtype: str | None, budget: dict[str, int]
) -> None:
    kw = {**ARGS, **budget, "kv_cache_dtype": kv_dtype, "num_host_blocks": 24}
    eng = EngineCore(EngineArgs.from_kwargs(str(llama), **kw))
    stored = CacheConfig(kv_cache_dtype=kv_dtype).kv_dtype("float32")
    assert stored == {"fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}.get(
        str(kv_dtype), "float32" if kv_dtype in (None, "auto") else kv_dtype
    )
    assert_plan_is_allocated(eng, stored)
    if "kv_cache_memory_bytes" in budget:
        assert pool_bytes(eng, "device") <= budget["kv_cache_memory_bytes"]
    eng.add_request("a", [5, 6, 7, 8, 9], GREEDY)  # the pool in its own dtype serves requests
    assert len(eng.drain()["a"].token_ids) == 4


@pytest.mark.parametrize("kv_dtype", [None, "auto", "bfloat16"])
def test_a_hybrids_plan_is_its_pool(falcon_h1: Path, kv_dtype: str | None) -> None:
    kw = {**ARGS, "dtype": "bfloat16", "kv_cache_dtype": kv_dtype, "num_host_blocks": 8}
    eng = EngineCore(EngineArgs.from_kwargs(str(falcon_h1), **kw, num_device_blocks=16))
    assert_plan_is_allocated(eng, "bfloat16")


@pytest.mark.parametrize(("kv_dtype", "stored"), [("fp8", "float8_e4m3fn"), ("float32", "float32")])
def test_a_hybrids_kv_dtype_holds_its_states_in_the_models_dtype(
    falcon_h1: Path, kv_dtype: str, stored: str
) -> None:
    """The pool is the KV dtype's (an 8-bit one: half the bytes a block, twice the tokens); the
    Mamba states keep the model's bfloat16 in the same pages' bytes."""
    kw = {**ARGS, "dtype": "bfloat16", "num_host_blocks": 8, "num_device_blocks": 16}
    eng = EngineCore(EngineArgs.from_kwargs(str(falcon_h1), **kw, kv_cache_dtype=kv_dtype))
    base = EngineCore(EngineArgs.from_kwargs(str(falcon_h1), **kw))
    assert_plan_is_allocated(eng, stored)
    assert eng.plan.page_bytes == base.plan.page_bytes  # an attention page holds a state page
    ratio = {"fp8": 2, "float32": 0.5}[kv_dtype]
    assert eng.plan.block_size == ratio * base.plan.block_size
    caches = eng.model.bind(eng.device.kv("device"), eng.plan.block_size)
    assert {c.dtype for c in caches.attention.values()} == {TORCH_DTYPES[stored]}
    assert {s.ssm.dtype for s in caches.state.values()} == {torch.bfloat16}
    eng.add_request("a", list(range(5, 30)), GREEDY)
    assert len(eng.drain()["a"].token_ids) == 4


def test_poison_is_nan_in_every_view_of_an_8bit_hybrid_page(falcon_h1: Path) -> None:
    """A recycled page read as fp8 K/V or as the bfloat16 state it may hold is NaN (a NaN fp8
    code, 0x7F, would be a large finite bfloat16 pair)."""
    kw = {**ARGS, "dtype": "bfloat16", "num_device_blocks": 16, "poison": True}
    eng = EngineCore(EngineArgs.from_kwargs(str(falcon_h1), **kw, kv_cache_dtype="fp8"))
    eng.device.poison_blocks("device", [3])
    caches = eng.model.bind(eng.device.kv("device"), eng.plan.block_size)
    assert all(c[3].float().isnan().all() for c in caches.attention.values())
    for state in caches.state.values():
        assert state.conv[3].isnan().all() and state.ssm[3].isnan().all()


def test_bfloat16_kv_halves_a_float32_models_pool_and_keeps_its_greedy_tokens(
    llama: Path,
) -> None:
    """The pool really holds bfloat16: half the bytes, and K/V read back rounded (the tokens of
    a tiny random model stay those of the float32 pool on this short greedy run)."""
    engines = {
        d: EngineCore(EngineArgs.from_kwargs(str(llama), **ARGS, kv_cache_dtype=d))
        for d in ("float32", "bfloat16")
    }
    assert pool_bytes(engines["bfloat16"], "device") * 2 == pool_bytes(engines["float32"], "device")
    tokens = {}
    for d, eng in engines.items():
        eng.add_request("a", [5, 6, 7, 8, 9], GREEDY)
        tokens[d] = eng.drain()["a"].token_ids
        assert eng.device.kv("device")[0].abs().sum() > 0  # K/V were written in that dtype
    assert tokens["bfloat16"] == tokens["float32"]


@pytest.mark.parametrize("value", ["int8", "fp8_e4m3fnuz", "fp4", "uint8"])
def test_a_kv_dtype_the_pool_cannot_store_is_refused_naming_the_flag_and_the_fix(
    value: str,
) -> None:
    with pytest.raises(ValueError, match="--kv-cache-dtype") as err:
        CacheConfig(kv_cache_dtype=value)
    assert "auto" in str(err.value) and "fp8" in str(err.value) and "bfloat16" in str(err.value)


def test_plan_sizes_fp8_at_half_of_bfloat16(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--kv-cache-dtype", "int8"]) == 2
    assert "--kv-cache-dtype" in capsys.readouterr().err
    for value in ("fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"):
        assert CacheConfig(kv_cache_dtype=value).kv_dtype("bfloat16") in (
            "bfloat16", "float8_e4m3fn", "float8_e5m2",
        )  # fmt: skip


def test_an_engine_refuses_int8_before_loading_anything(llama: Path) -> None:
    with pytest.raises(ValueError, match="--kv-cache-dtype int8"):
        EngineArgs.from_kwargs(str(llama), kv_cache_dtype="int8")


def test_fp8_without_checkpoint_scales_warns_as_vllm_does(
    llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """e4m3 with scales 1.0 is a warning naming the flag (vLLM's); e5m2's range needs none, and a
    checkpoint's scales silence it."""
    scaled = write_kv_scaled_model(llama, tmp_path / "scaled", {0: (0.02, 0.01)})
    for folder, kv, warns in (
        (llama, "fp8", True),
        (llama, "fp8_e5m2", False),
        (scaled, "fp8", False),
    ):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvtier.engine"):
            EngineCore(EngineArgs.from_kwargs(str(folder), **ARGS, kv_cache_dtype=kv))
        said = [r.getMessage() for r in caplog.records if "scales 1.0" in r.getMessage()]
        assert bool(said) == warns, (folder, kv, said)
        assert all(f"--kv-cache-dtype {kv}" in m for m in said)
