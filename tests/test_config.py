"""HF config reading and config validation: errors name the input and the fix; every setting
carries the help text of its flag."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import pytest

from kvtier.cli import build_parser
from kvtier.config import CacheConfig, SchedulerConfig, flag_help
from kvtier.model.hf_config import load_model_config
from kvtier.server.config import ServerConfig


def write(tmp_path: Path, cfg: dict[str, object]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


BASE = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4}


@pytest.mark.parametrize(
    ("cfg", "kinds"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, ("full",) * 4),
        (
            {"architectures": ["LlamaForCausalLM"], "attention_chunk_size": 32},
            ("chunked", "chunked", "chunked", "full"),
        ),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 8}, ("sliding",) * 4),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, ("full",) * 4),
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "use_sliding_window": True,
                "sliding_window": 8,
                "max_window_layers": 2,
            },
            ("full", "full", "sliding", "sliding"),
        ),
        (
            {"architectures": ["Gemma2ForCausalLM"], "sliding_window": 8},
            ("sliding", "full", "sliding", "full"),
        ),
        (
            {
                "architectures": ["Gemma3ForCausalLM"],
                "sliding_window": 8,
                "sliding_window_pattern": 2,
            },
            ("sliding", "full", "sliding", "full"),
        ),
        (
            {
                "architectures": ["Gemma3ForCausalLM"],
                "sliding_window": 8,
                "layer_types": ["full_attention", "sliding_attention"] * 2,
            },
            ("full", "sliding", "full", "sliding"),
        ),
    ],
)
def test_layer_kinds_per_architecture(
    tmp_path: Path, cfg: dict[str, object], kinds: tuple[str, ...]
) -> None:
    model = load_model_config(write(tmp_path, {**BASE, **cfg}))
    assert model.layer_kinds == kinds
    assert model.head_dim == 16 and model.num_kv_heads == 4


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'GPTNeoXForCausalLM' is not supported"):
        load_model_config(write(tmp_path, {**BASE, "architectures": ["GPTNeoXForCausalLM"]}))


def test_missing_field_and_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lacks 'num_hidden_layers'"):
        load_model_config(write(tmp_path, {"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"bundled presets: .*gemma-3-1b"):
        load_model_config(tmp_path / "nowhere")


def test_bad_json_is_reported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_config(tmp_path)


@pytest.mark.parametrize(
    ("make", "flag"),
    [
        (lambda: CacheConfig(block_size=0), "--block-size"),
        (lambda: CacheConfig(num_device_blocks=1), "--num-device-blocks"),
        (lambda: CacheConfig(kv_cache_dtype="int3"), "--kv-cache-dtype"),
        (lambda: SchedulerConfig(max_num_seqs=0), "--max-num-seqs"),
        (lambda: SchedulerConfig(async_depth=4), "--async-depth"),
        (lambda: SchedulerConfig(max_model_len=-1), "--max-model-len"),
        (lambda: ServerConfig(port=0), "--port"),
        (lambda: ServerConfig(max_waiting_requests=-1), "--max-waiting-requests"),
        (lambda: ServerConfig(log_level="loud"), "--log-level"),
        (lambda: CacheConfig(num_host_blocks=1), "--num-host-blocks"),
        (lambda: CacheConfig(prefix_caching_hash_algo="md5"), "--prefix-caching-hash-algo"),
    ],
)
def test_validation_names_the_flag(make: object, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        make()  # type: ignore[operator]


def test_in_flight_bound_follows_depth() -> None:
    assert SchedulerConfig(max_num_batched_tokens=512).max_in_flight_tokens == 1024
    assert SchedulerConfig(max_num_batched_tokens=512, async_depth=3).max_in_flight_tokens == 1536
    sync = SchedulerConfig(max_num_batched_tokens=512, async_scheduling=False)
    assert sync.max_in_flight_tokens == 512


@pytest.mark.parametrize(
    ("make", "flag", "error"),
    [
        (lambda: CacheConfig(block_size="16"), "--block-size", TypeError),
        (lambda: CacheConfig(block_size=True), "--block-size", TypeError),
        (lambda: CacheConfig(block_size=4.0), "--block-size", TypeError),
        (lambda: CacheConfig(enable_prefix_caching="no"), "--enable-prefix-caching", TypeError),
        (lambda: CacheConfig(kv_offloading_size=math.nan), "--kv-offloading-size", ValueError),
        (lambda: CacheConfig(kv_offloading_size="1"), "--kv-offloading-size", TypeError),
        (lambda: CacheConfig(kv_cache_dtype=16), "--kv-cache-dtype", TypeError),
        (lambda: SchedulerConfig(max_num_seqs=2.5), "--max-num-seqs", TypeError),
        (lambda: SchedulerConfig(max_model_len=10**30), "--max-model-len", ValueError),
        (lambda: SchedulerConfig(async_scheduling=1), "--async-scheduling", TypeError),
        (lambda: ServerConfig(port="80"), "--port", TypeError),
    ],
)
def test_wrong_types_name_the_flag(make: object, flag: str, error: type[Exception]) -> None:
    with pytest.raises(error, match=flag):
        make()  # type: ignore[operator]


def test_numpy_scalars_are_stored_as_python_numbers() -> None:
    np = pytest.importorskip("numpy")
    cache = CacheConfig(block_size=np.int64(8), kv_offloading_size=np.float32(0.5))
    assert type(cache.block_size) is int and type(cache.kv_offloading_size) is float


@pytest.mark.parametrize("host", [{"num_host_blocks": 64}, {"kv_offloading_size": 1.0}])
def test_host_tier_needs_prefix_caching(host: dict[str, object]) -> None:
    """The host tier stores and restores prefix-cached blocks: without the prefix cache it was
    accepted and stored nothing. Refused, naming both flags."""
    with pytest.raises(ValueError, match=r"--no-enable-prefix-caching.*enable prefix caching"):
        CacheConfig(enable_prefix_caching=False, **host)  # type: ignore[arg-type]
    assert CacheConfig(**host).enable_prefix_caching  # type: ignore[arg-type]


def test_hash_names_match_the_hash_functions() -> None:
    from kvtier.config import HASH_ALGOS
    from kvtier.kv.hashing import HASH_FUNCTIONS

    assert sorted(HASH_ALGOS) == sorted(HASH_FUNCTIONS)


@pytest.mark.parametrize(
    ("make", "flags"),
    [
        (
            lambda: CacheConfig(num_device_blocks=64, kv_cache_memory_bytes=1 << 20),
            ("--num-device-blocks", "--kv-cache-memory-bytes"),
        ),
        (
            lambda: CacheConfig(num_host_blocks=64, kv_offloading_size=1.0),
            ("--num-host-blocks", "--kv-offloading-size"),
        ),
        (
            lambda: SchedulerConfig(async_scheduling=False, async_depth=3),
            ("--async-depth", "--no-async-scheduling"),
        ),
    ],
)
def test_a_flag_another_would_override_is_refused(make: object, flags: tuple[str, ...]) -> None:
    """Two flags for one quantity (or a depth with synchronous scheduling): before, the second
    was accepted and silently had no effect."""
    with pytest.raises(ValueError) as err:
        make()  # type: ignore[operator]
    assert all(f in str(err.value) for f in flags)


def test_async_depth_defaults_to_two_and_one_is_synchronous_either_way() -> None:
    assert SchedulerConfig().depth == 2 and SchedulerConfig(async_depth=3).depth == 3
    assert SchedulerConfig(async_scheduling=False).depth == 1
    assert SchedulerConfig(async_scheduling=False, async_depth=1).depth == 1


SETTINGS = (CacheConfig, SchedulerConfig, ServerConfig)


@pytest.mark.parametrize("cls", SETTINGS, ids=lambda c: c.__name__)
def test_every_setting_says_what_its_flag_means(cls: type) -> None:
    """The help text lives on the field (`config.setting`); a field added without one fails here."""
    missing = [f.name for f in dataclasses.fields(cls) if not flag_help(cls, f.name).strip()]
    assert not missing, f"{cls.__name__} fields without help text: {missing}"


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", ["generate", "serve", "plan"])
def test_derived_flags_are_fields_with_their_help(command: str) -> None:
    by_title = {cls.__name__: cls for cls in SETTINGS}
    seen = set()
    for group in _commands()[command]._action_groups:
        cls = by_title.get(group.title or "")
        for action in group._group_actions if cls is not None else ():
            names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
            assert action.dest in names, (command, action.option_strings)
            assert (action.help or "").startswith(flag_help(cls, action.dest).strip())
            seen.add(cls)
    assert seen, f"{command} derives no flags from the config dataclasses"
