"""Every engine argument takes effect or is refused: one check per field of `EngineArgs` and of
the `CacheConfig`, `SchedulerConfig` and `StructuredOutputsConfig` it nests, each showing what the field changes in a
running engine (or the error that names it). The list is walked with `dataclasses.fields`, so a
new field without a check fails `test_every_engine_argument_has_a_check` (issue 41: a
`--kv-cache-dtype fp8` was sized in the plan and never applied to the pool)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from kvtier.config import CacheConfig, SchedulerConfig, StructuredOutputsConfig
from kvtier.engine import EngineArgs, EngineCore, SamplingParams, StructuredOutputsParams
from kvtier.model.testing import write_tiny_model
from tests.stores.servers import RedisServer

BASE = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 32}
PROMPT = [(7 * i) % 300 + 3 for i in range(20)]  # 5 full blocks of 4
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": write_tiny_model(root / "llama", "llama"),
        "llama-b": write_tiny_model(root / "llama-b", "llama", seed=1),
        "gemma3": write_tiny_model(root / "gemma3", "gemma3", window=8),
    }


class Ctx:
    """Builds engines on the test's models and closes them at the end."""

    def __init__(self, models: dict[str, Path], tmp: Path) -> None:
        self.models, self.tmp = models, tmp
        self.engines: list[EngineCore] = []
        self.num_runs = 0

    def engine(self, model: str = "llama", **kw: Any) -> EngineCore:
        eng = EngineCore(EngineArgs.from_kwargs(str(self.models[model]), **{**BASE, **kw}))
        self.engines.append(eng)
        return eng

    def run(
        self, eng: EngineCore, params: SamplingParams = GREEDY, prompt: list[int] = PROMPT
    ) -> Any:
        self.num_runs += 1
        req_id = f"run{self.num_runs}"
        eng.add_request(req_id, prompt, params)
        return eng.drain()[req_id]

    def tokens(self, params: SamplingParams = GREEDY, **kw: Any) -> list[int]:
        return list(self.run(self.engine(**kw), params).token_ids)


def pool(eng: EngineCore, tier: str = "device") -> torch.Tensor:
    return eng.device.kv(tier)[0]  # type: ignore[arg-type]


def steps_to_first_token(eng: EngineCore, prompt: list[int] = PROMPT) -> int:
    eng.add_request("first", prompt, GREEDY)
    for n in range(1, 100):
        if any(out.new_token_ids for out in eng.step()):
            eng.drain()
            return n
    raise AssertionError("no token in 100 steps")


# ---- EngineArgs ---------------------------------------------------------------------------------


def check_model(c: Ctx) -> None:
    a, b = c.engine("llama"), c.engine("llama-b")
    assert a.model_config.source == str(c.models["llama"])
    assert c.run(a).token_ids != c.run(b).token_ids  # other weights, other tokens


def check_dtype(c: Ctx) -> None:
    eng = c.engine(dtype="float64")
    assert next(eng.model.module.parameters()).dtype == torch.float64
    assert pool(eng).dtype == torch.float64  # the KV dtype follows (auto)


def check_device(c: Ctx) -> None:
    assert c.engine(device="sim").stats().device_time_ns is not None  # the virtual clock
    assert c.engine(device="cpu").stats().device_time_ns is None


def check_seed(c: Ctx) -> None:
    assert c.tokens(SAMPLED, seed=1) == c.tokens(SAMPLED, seed=1)
    assert c.tokens(SAMPLED, seed=1) != c.tokens(SAMPLED, seed=2)


def check_num_speculative_tokens(c: Ctx) -> None:
    repeats = [5, 6, 7, 8] * 5  # n-gram lookup finds drafts in a repeating prompt
    for k, drafted in ((0, False), (2, True)):
        eng = c.engine(num_speculative_tokens=k)
        c.run(eng, prompt=repeats)
        assert (eng.stats().num_draft_tokens > 0) == drafted


def check_protect(c: Ctx) -> None:
    """Without the quarantine, blocks freed under a step in flight are free at once."""
    held = {}
    for protect in ("event,settled,quarantine", "event,settled"):
        eng = c.engine(protect=protect, async_depth=3)
        eng.add_request("a", PROMPT, GREEDY)
        eng.step()
        eng.abort("a")
        held[protect] = eng.stats().device.num_quarantined_refs
        eng.drain()
    assert held == {
        "event,settled,quarantine": held["event,settled,quarantine"],
        "event,settled": 0,
    }
    assert held["event,settled,quarantine"] > 0


def check_sanitize(c: Ctx) -> None:
    assert c.engine(device="cpu").device.sanitizer is None
    eng = c.engine(device="cpu", sanitize="collect")
    assert eng.device.sanitizer is not None
    c.run(eng)
    assert eng.device.sanitizer.num_accesses > 0  # every op's accesses were checked


def check_poison(c: Ctx) -> None:
    """Blocks handed out are filled with NaN: the unwritten tail of a request's last block."""
    for poison in (False, True):
        eng = c.engine(poison=poison)
        c.run(eng, prompt=PROMPT[:5])  # 5 + 6 tokens: the third block is 3 of 4 written
        assert bool(pool(eng).isnan().any()) == poison


def check_check_integrity(c: Ctx) -> None:
    for on in (False, True):
        eng = c.engine(check_integrity=on)
        calls: list[None] = []
        real = eng.check_integrity
        eng.check_integrity = lambda c=calls, r=real: c.append(r())  # type: ignore[method-assign]
        c.run(eng)
        assert bool(calls) == on


def check_policy(c: Ctx) -> None:
    order = {}
    for policy in ("fcfs", "priority"):
        eng = c.engine(policy=policy, max_num_seqs=1)
        eng.add_request("late", PROMPT, GREEDY, priority=5)
        eng.add_request("early", PROMPT[:8], GREEDY, priority=0)
        order[policy] = list(eng.drain())
    assert order == {"fcfs": ["late", "early"], "priority": ["early", "late"]}


def check_long_prefill_token_threshold(c: Ctx) -> None:
    assert steps_to_first_token(c.engine(async_scheduling=False)) == 1
    assert (
        steps_to_first_token(c.engine(async_scheduling=False, long_prefill_token_threshold=4)) == 5
    )


def check_max_logprobs(c: Ctx) -> None:
    asks = SamplingParams(max_tokens=2, logprobs=2)
    c.engine(max_logprobs=2).add_request("ok", PROMPT, asks)
    with pytest.raises(ValueError, match="max_logprobs=1"):
        c.engine(max_logprobs=1).add_request("no", PROMPT, asks)


def check_torch_threads(c: Ctx) -> None:
    before = torch.get_num_threads()
    try:
        eng = c.engine(torch_threads=1)
        assert eng.torch_threads == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def check_quantization(c: Ctx) -> None:
    """int8 quantizes every linear as the model loads (logits move, greedy tokens mostly not);
    w8a8 too, the decoder's linears on int8 activations; compressed-tensors needs a quantized
    checkpoint; unset keeps the float weights."""
    from kvtier.model.quant import Int8Linear

    eng = c.engine(quantization="int8")
    decoder = eng.model.decoder  # type: ignore[attr-defined]
    assert isinstance(decoder.lm_head, Int8Linear)
    assert not isinstance(c.engine().model.decoder.lm_head, Int8Linear)  # type: ignore[attr-defined]
    assert len(c.run(eng).token_ids) == len(c.tokens())
    w8a8 = c.engine(quantization="w8a8").model.decoder  # type: ignore[attr-defined]
    assert w8a8.model.layers[0].mlp.down_proj.int8_activations
    assert not w8a8.lm_head.int8_activations  # the head's inputs stay in the model's dtype
    with pytest.raises(ValueError, match="no compressed-tensors quantization_config"):
        c.engine(quantization="compressed-tensors")


def check_logprobs_mode(c: Ctx) -> None:
    asks = SamplingParams(max_tokens=4, temperature=0, logprobs=0, ignore_eos=True)
    values = {}
    for mode in ("raw_logprobs", "raw_logits"):
        out = c.run(c.engine(logprobs_mode=mode), asks)
        values[mode] = [lp.logprob for lp in out.logprobs]
    assert all(v <= 0 for v in values["raw_logprobs"])
    assert values["raw_logits"] != values["raw_logprobs"]


# ---- CacheConfig --------------------------------------------------------------------------------


def check_enable_kv_cache_events(c: Ctx) -> None:
    """The device and host pools record each newly cached run of blocks with its own tokens;
    off, nothing is recorded; without prefix caching there is nothing to report: refused."""
    for on in (True, False):
        eng = c.engine(enable_kv_cache_events=on, num_host_blocks=32)
        c.run(eng)
        eng.drain()
        stored = [e for e in eng.take_kv_events() if type(e).__name__ == "BlockStored"]
        media = {e.medium for e in stored}
        assert media == ({"device", "host"} if on else set()), media
        for medium in media:  # each tier's runs, in chain order, cover the prompt's blocks
            toks = [t for e in stored if e.medium == medium for t in e.token_ids]
            assert toks[: len(PROMPT)] == PROMPT
    with pytest.raises(ValueError, match="prefix caching"):
        EngineArgs.from_kwargs(None, enable_kv_cache_events=True, enable_prefix_caching=False)


def check_block_size(c: Ctx) -> None:
    cfg = c.engine().model_config
    for bs in (4, 8):
        eng = c.engine(block_size=bs, num_device_blocks=40)
        assert pool(eng).shape == (40, 2 * bs * cfg.num_kv_heads * cfg.head_dim)


def check_num_device_blocks(c: Ctx) -> None:
    assert pool(c.engine(num_device_blocks=40)).shape[0] == 40
    assert c.engine(num_device_blocks=40).stats().device.num_blocks == 39  # the null block


def check_kv_cache_memory_bytes(c: Ctx) -> None:
    for budget in (1 << 19, 1 << 20):
        eng = c.engine(kv_cache_memory_bytes=budget)
        used = sum(t.numel() * t.element_size() for t in eng.device.kv("device"))
        assert budget - eng.plan.bytes_per_block < used <= budget


def check_kv_cache_dtype(c: Ctx) -> None:
    assert pool(c.engine(kv_cache_dtype="bfloat16")).dtype == torch.bfloat16
    assert pool(c.engine(kv_cache_dtype="fp8")).dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="--kv-cache-dtype int8"):
        c.engine(kv_cache_dtype="int8")


def check_enable_prefix_caching(c: Ctx) -> None:
    for on in (True, False):
        eng = c.engine(enable_prefix_caching=on)
        c.run(eng)
        assert (c.run(eng).num_cached_tokens > 0) == on


def disk_files(c: Ctx, folder: str, **kw: Any) -> set[str]:
    eng = c.engine(num_host_blocks=32, kv_disk_path=str(c.tmp / folder), **kw)
    c.run(eng)
    assert eng.flush_tiers(timeout=60)
    eng.close()
    return {p.name for p in (c.tmp / folder).rglob("*") if p.is_file()}


def check_prefix_caching_hash_algo(c: Ctx) -> None:
    """The disk tier names blocks by their chained hash: another algorithm, other names."""
    sha = disk_files(c, "sha", prefix_caching_hash_algo="sha256")
    xx = disk_files(c, "xx", prefix_caching_hash_algo="xxhash")
    sha, xx = ({n for n in names if n.endswith(".kvb")} for names in (sha, xx))
    assert len(sha) == len(xx) > 1 and not sha & xx  # the lock and marker files aside


def check_kv_offloading_size(c: Ctx) -> None:
    eng = c.engine(kv_offloading_size=0.0005)
    expected = int(0.0005 * (1 << 30)) // eng.plan.bytes_per_block
    assert pool(eng, "host").shape[0] == expected


def check_num_host_blocks(c: Ctx) -> None:
    eng = c.engine(num_host_blocks=24)
    assert pool(eng, "host").shape[0] == 24
    c.run(eng)
    assert eng.stats().host_metrics.num_stored_blocks > 0  # type: ignore[union-attr]


def check_kv_offload_store_mode(c: Ctx) -> None:
    """Eager stores a finished request's full blocks; lazy only blocks near the LRU head."""
    stored = {}
    for mode in ("eager", "lazy"):
        eng = c.engine(num_host_blocks=24, num_device_blocks=64, kv_offload_store_mode=mode)
        c.run(eng)
        eng.drain()
        stored[mode] = eng.stats().host_metrics.num_stored_blocks  # type: ignore[union-attr]
    assert stored["eager"] > 0 and stored["lazy"] == 0


def check_admission(c: Ctx) -> None:
    """A sliding-window model: what admission charges changes how many requests fit."""
    kw = {"max_model_len": 64, "num_device_blocks": 200}
    fits = {
        p: c.engine("gemma3", admission=p, **kw).plan.max_concurrency()
        for p in ("shared", "per-request", "optimistic")
    }
    assert len(set(fits.values())) == 3, fits


def check_kv_disk_path(c: Ctx) -> None:
    assert disk_files(c, "disk")


def check_kv_disk_size(c: Ctx) -> None:
    eng = c.engine(num_host_blocks=32)
    tiny = 3 * eng.plan.bytes_per_block / (1 << 30)  # room for about two framed blocks
    small = c.engine(num_host_blocks=32, kv_disk_path=str(c.tmp / "small"), kv_disk_size=tiny)
    c.run(small)
    assert small.flush_tiers(timeout=60)
    store = small.stats().tiers[0].store
    assert store.num_evicted + store.num_dropped > 0
    small.close()


def check_kv_remote_url(c: Ctx) -> None:
    server = RedisServer(c.tmp / "redis").start()
    try:
        eng = c.engine(num_host_blocks=32, kv_remote_url=server.url)
        c.run(eng)
        assert eng.flush_tiers(timeout=60)
        (remote,) = eng.stats().tiers
        assert remote.name == "remote" and remote.store.num_puts > 0
        eng.close()
    finally:
        server.stop()


def check_kv_remote_ttl_s(c: Ctx) -> None:
    with pytest.raises(ValueError, match="--kv-remote-ttl-s"):
        c.engine(kv_remote_ttl_s=30.0)  # no remote tier to expire keys in
    server = RedisServer(c.tmp / "redis-ttl").start()
    try:
        eng = c.engine(num_host_blocks=32, kv_remote_url=server.url, kv_remote_ttl_s=30.0)
        c.run(eng)
        assert eng.flush_tiers(timeout=60)
        eng.close()
        client = redis.Redis.from_url(server.url)
        keys = client.keys("*")
        assert keys and all(0 < client.ttl(k) <= 30 for k in keys)
        client.close()
    finally:
        server.stop()


def check_kv_tier_timeout_s(c: Ctx) -> None:
    eng = c.engine(num_host_blocks=32, kv_disk_path=str(c.tmp / "t"), kv_tier_timeout_s=0.125)
    assert eng.tier_chain is not None and eng.tier_chain.timeout_s == 0.125
    eng.close()
    with pytest.raises(ValueError, match="--kv-tier-timeout-s"):
        c.engine(kv_tier_timeout_s=0)


# ---- SchedulerConfig ----------------------------------------------------------------------------


def check_max_num_seqs(c: Ctx) -> None:
    for limit in (1, 3):
        eng = c.engine(max_num_seqs=limit, async_scheduling=False)
        for i in range(3):
            eng.add_request(f"r{i}", PROMPT[: 4 + i], GREEDY)
        most = 0
        while eng.has_unfinished_requests():
            eng.step()
            most = max(most, eng.stats().num_running)
        assert most == limit


def check_max_num_batched_tokens(c: Ctx) -> None:
    assert steps_to_first_token(c.engine(async_scheduling=False)) == 1
    assert steps_to_first_token(c.engine(async_scheduling=False, max_num_batched_tokens=8)) == 3


def check_max_model_len(c: Ctx) -> None:
    c.engine(max_model_len=32).add_request("fits", PROMPT, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_model_len"):
        c.engine(max_model_len=16).add_request("long", PROMPT, SamplingParams(max_tokens=4))


def most_in_flight(eng: EngineCore) -> int:
    eng.add_request("a", PROMPT, GREEDY)
    most = 0
    while eng.has_unfinished_requests():
        eng.step()
        most = max(most, eng.stats().num_steps_in_flight)
    return most


def check_async_scheduling(c: Ctx) -> None:
    assert most_in_flight(c.engine(async_scheduling=False)) == 0  # each step processed at once
    assert most_in_flight(c.engine(async_scheduling=True)) == 1  # one left running ahead


def check_async_depth(c: Ctx) -> None:
    assert most_in_flight(c.engine(async_depth=3)) == 2
    with pytest.raises(ValueError, match="--async-depth"):
        c.engine(async_scheduling=False, async_depth=3)


def check_scheduler_reserve_full_isl(c: Ctx) -> None:
    """A pool of one max-length request: a second long prompt starts beside the first only when
    admission charges its first chunk, not its whole prompt."""
    kw = {"max_model_len": 40, "long_prefill_token_threshold": 8, "async_scheduling": False}
    need = c.engine(**kw, num_device_blocks=1000).plan.blocks_per_request(40) + 1
    started = {}
    for full in (True, False):
        eng = c.engine(scheduler_reserve_full_isl=full, num_device_blocks=need, **kw)
        for i in range(2):
            eng.add_request(f"r{i}", [i * 40 + t + 3 for t in range(36)], GREEDY)
        eng.step()
        started[full] = eng.stats().num_running
        eng.drain()
    assert started == {True: 1, False: 2}


# ---- StructuredOutputsConfig --------------------------------------------------------------------


def _schema_params(schema: dict[str, Any]) -> SamplingParams:
    return SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema))


def check_structured_outputs_max_spec_bytes(c: Ctx) -> None:
    schema = {"enum": ["a" * 100]}
    c.run(c.engine(), _schema_params(schema))  # the default takes it
    with pytest.raises(ValueError, match="--structured-outputs-max-spec-bytes"):
        c.engine(structured_outputs_max_spec_bytes=64).add_request(
            "r", PROMPT, _schema_params(schema)
        )


def check_structured_outputs_compile_timeout_s(c: Ctx) -> None:
    """A grammar that compiles within the default is refused under a timeout no compile meets."""
    schema = {"enum": [f"option {i}" for i in range(2000)]}
    c.run(c.engine(), _schema_params(schema))
    eng = c.engine(structured_outputs_compile_timeout_s=1e-6)
    with pytest.raises(ValueError, match="--structured-outputs-compile-timeout-s"):
        eng.add_request("r", PROMPT, _schema_params(schema))


def check_structured_outputs_cache_size(c: Ctx) -> None:
    """Two schemas taking turns: a cache of one compiles each time, the default twice in all."""
    compiles = {}
    for size in (1, 256):
        eng = c.engine(structured_outputs_cache_size=size)
        for i in (0, 1, 0, 1):
            c.run(eng, _schema_params({"enum": [f"x{i}"]}))
        compiles[size] = eng.grammars.num_compiles
    assert compiles == {1: 4, 256: 2}


CHECKS: dict[str, Callable[[Ctx], None]] = {
    name.removeprefix("check_"): fn
    for name, fn in globals().items()
    if name.startswith("check_") and callable(fn)
}


def all_fields() -> set[str]:
    own = {f.name for f in dataclasses.fields(EngineArgs)}
    own -= {"cache", "scheduler", "structured_outputs"}
    configs = (CacheConfig, SchedulerConfig, StructuredOutputsConfig)
    nested = {f.name for cls in configs for f in dataclasses.fields(cls)}
    return own | nested


def test_every_engine_argument_has_a_check() -> None:
    assert sorted(all_fields() - set(CHECKS)) == [], "add a check_<field> for each new field"
    assert sorted(set(CHECKS) - all_fields()) == []


@pytest.fixture
def ctx(models: dict[str, Path], tmp_path: Path) -> Iterator[Ctx]:
    c = Ctx(models, tmp_path)
    yield c
    for eng in c.engines:
        eng.close()


@pytest.mark.parametrize("field", sorted(CHECKS))
def test_the_argument_takes_effect_or_is_refused(field: str, ctx: Ctx) -> None:
    CHECKS[field](ctx)
