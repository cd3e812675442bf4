"""An 8-bit KV cache through every tier (docs/kernels.md, "8-bit KV"): with a device pool and a host
tier too small to keep the prefixes, later rounds load fp8 blocks back from the host, the disk or
a real Redis, and every completion — tokens and their logprobs, bit for bit — equals the run
whose blocks all stayed on the device; on the sim device with the sanitizer raising and NaN poison
in recycled blocks. Two replicas with different KV dtypes on one Redis never share a block (the
keys carry the dtype), and every tier holds half the bytes per block of the bfloat16 pool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.engine import LLM, SamplingParams
from kvtier.model.testing import write_tiny_model
from tests.engine.test_tier_engine import BASE, SMALL, assert_clean, prompts, tier
from tests.stores.servers import RedisServer

SAMPLING = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
BF16 = {"dtype": "bfloat16"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama-kv8"), "llama")


def rounds(llm: LLM, n: int = 3) -> list[list[Any]]:
    """`n` rounds of the same prompts: each completion's tokens and logprobs."""
    out = []
    for _ in range(n):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], SAMPLING, use_tqdm=False)
        out.append([(list(o.outputs[0].token_ids), repr(o.outputs[0].logprobs)) for o in outs])
        assert llm.engine.flush_tiers(30)
    return out


def run(model: Path, n: int = 3, **kw: Any) -> list[list[Any]]:
    llm = LLM(str(model), **BASE, **BF16, **kw)
    try:
        return rounds(llm, n)
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def on_device(llama: Path) -> dict[str, list[list[Any]]]:
    """Each fp8 format's rounds with a pool that keeps every prefix on the device."""
    return {d: run(llama, kv_cache_dtype=d, num_device_blocks=400) for d in ("fp8", "fp8_e5m2")}


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_blocks_back_from_the_host_and_disk_give_the_same_bits(
    llama: Path, on_device: dict[str, list[list[Any]]], tmp_path: Path, kv_dtype: str
) -> None:
    llm = LLM(
        str(llama), **BASE, **BF16, **SMALL, kv_cache_dtype=kv_dtype,
        kv_disk_path=str(tmp_path / "disk"),
    )  # fmt: skip
    try:
        assert rounds(llm) == on_device[kv_dtype]
        stats = assert_clean(llm)
        assert stats.host_metrics is not None and stats.host_metrics.num_loaded_blocks > 0
        disk = tier(stats, "disk")
        assert disk.metrics.num_promoted_blocks > 0 and disk.store.num_errors == 0
        assert all(t.dtype.itemsize == 1 for t in llm.engine.device.kv("host"))
    finally:
        llm.engine.close()


def test_fp8_blocks_back_from_redis_give_the_same_bits_and_no_other_dtype_reads_them(
    llama: Path, on_device: dict[str, list[list[Any]]], redis_server: RedisServer
) -> None:
    llm = LLM(str(llama), **BASE, **BF16, **SMALL, kv_cache_dtype="fp8",
              kv_remote_url=redis_server.url)  # fmt: skip
    try:
        assert rounds(llm) == on_device["fp8"]
        remote = tier(assert_clean(llm), "remote")
        assert remote.metrics.num_promoted_blocks > 0 and remote.store.num_hits > 0
    finally:
        llm.engine.close()
    with redis_server.client() as c:
        keys = [k.decode() for k in c.keys("*")]
    assert keys and all("float8_e4m3fn" in k for k in keys)
    # replicas with a bfloat16 and an e5m2 pool on the same Redis: no hit on the fp8 blocks
    for kv_dtype in ("bfloat16", "fp8_e5m2"):
        other = LLM(str(llama), **BASE, **BF16, **SMALL, kv_cache_dtype=kv_dtype,
                    kv_remote_url=redis_server.url)  # fmt: skip
        try:
            other.generate([{"prompt_token_ids": p} for p in prompts()], SAMPLING, use_tqdm=False)
            assert tier(other.engine.stats(), "remote").store.num_hits == 0, kv_dtype
        finally:
            other.engine.close()


def test_every_tier_holds_half_the_bytes_per_block(llama: Path) -> None:
    budget = {"kv_cache_memory_bytes": 1 << 20, "kv_offloading_size": 1 / 1024}
    engines = {
        d: LLM(str(llama), **BASE, **BF16, **budget, kv_cache_dtype=d).engine
        for d in ("bfloat16", "fp8")
    }
    try:
        for name in ("device", "host"):
            blocks = {
                d: next(t.num_blocks for t in e.plan.tiers if t.name == name)
                for d, e in engines.items()
            }
            assert blocks["fp8"] in (2 * blocks["bfloat16"], 2 * blocks["bfloat16"] + 1), blocks
    finally:
        for e in engines.values():
            e.close()
