"""The console script end to end: `kvtier plan` and `kvtier bench kv` as a user runs them."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier import __version__
from kvtier.cli_args import human_readable_int, parse_bytes
from tests.torch_blocked import run_without_torch


def kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_plan_default_model_prints_tiers_and_saves_json(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = kvtier("plan", "--max-model-len", "8192", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "tier device" in r.stdout and "max concurrency at max length" in r.stdout
    plan = json.loads(out.read_text())
    assert plan["architecture"] == "Gemma3ForCausalLM"
    assert plan["tiers"][0]["max_concurrency_at_max_len"] > 0
    assert len(plan["groups"]) == 7


def test_plan_reads_the_model_without_torch() -> None:
    """`kvtier plan` reads config.json through `kvtier.model.hf_config`; the model package loads
    its names lazily, so planning (and the torch-free `arch.py` reader) never imports torch."""
    out = run_without_torch(
        """
from kvtier.cli import main
assert main(["plan", "--model", "falcon-h1-0.5b", "--max-model-len", "4096"]) == 0
import kvtier.model.arch
"""
    )
    assert "FalconH1ForCausalLM" in out and "tier device" in out


def test_plan_refuses_impossible_configuration_with_flag() -> None:
    r = kvtier("plan", "--num-device-blocks", "50")
    assert r.returncode == 2
    assert "--num-device-blocks" in r.stderr and "Traceback" not in r.stderr


def test_plan_rejects_bad_size_flag() -> None:
    r = kvtier("plan", "--kv-cache-memory-bytes", "lots")
    assert r.returncode == 2 and "is not a size" in r.stderr


def test_bench_kv_saves_json(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    r = kvtier(
        "bench",
        "kv",
        "--num-blocks",
        "5000",
        "--prompt-len",
        "512",
        "--iters",
        "5",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["manager"]["full/sha256"]["lookup_miss_plus_allocate_us"] > 0
    assert data["manager"]["full/xxhash"]["hit_rate"] > 0.4


def test_version_is_the_package_version() -> None:
    r = kvtier("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kvtier {__version__}"


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        (("serve",), ["--port PORT", "(default: 8000)", "(default: 256)", "(default: auto)"]),
        (("generate",), ["(default: 64)", "(default: 2048)"]),
        (("plan",), ["(default: 16)"]),
        (("bench", "kv"), ["(default: "]),
        ((), ["--version"]),
    ],
)
def test_help_shows_the_defaults_of_every_subcommand(
    command: tuple[str, ...], shown: list[str]
) -> None:
    r = kvtier(*command, "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # argparse wraps lines
    for item in shown:
        assert item in text, (command, item)
    assert "(default: None)" not in text


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8k", 8000),
        ("8K", 8192),
        ("25.6k", 25600),
        ("1M", 1 << 20),
        ("2m", 2_000_000),
        ("512", 512),
    ],
)
def test_human_readable_ints_as_vllm_reads_them(text: str, value: int) -> None:
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["1.5K", "8kb", "k", "-1", "8 k8"])
def test_human_readable_ints_refuse_what_vllm_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int(text)


def test_max_model_len_takes_8k(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = kvtier(
        "plan", "--max-model-len", "8k", "--max-num-batched-tokens", "2K", "--json", str(out)
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["max_model_len"] == 8000
    auto, default = tmp_path / "auto.json", tmp_path / "default.json"
    assert kvtier("plan", "--max-model-len", "auto", "--json", str(auto)).returncode == 0
    assert kvtier("plan", "--json", str(default)).returncode == 0
    assert (
        json.loads(auto.read_text())["max_model_len"]
        == json.loads(default.read_text())["max_model_len"]
    )
    r = kvtier("plan", "--max-model-len", "1.5K")
    assert r.returncode == 2 and "--max-model-len" in r.stderr and "1.5K" in r.stderr


def test_byte_sizes_read_k_as_vllm_and_kib_as_iec() -> None:
    assert parse_bytes("4GiB") == 4 << 30 and parse_bytes("4G") == 4 << 30
    assert parse_bytes("4g") == 4 * 10**9 and parse_bytes("4GB") == 4 * 10**9
    assert parse_bytes("512") == 512 and parse_bytes("1.5GiB") == 3 << 29
    assert parse_bytes("512b") == 512 and parse_bytes("2KiB") == 2048 and parse_bytes("2k") == 2000


def test_serve_takes_the_model_as_vllm_serve_does(tmp_path: Path) -> None:
    from kvtier.cli import build_parser
    from kvtier.server.cli import model_of

    parser = build_parser()
    assert model_of(parser.parse_args(["serve", str(tmp_path)])) == str(tmp_path)
    assert model_of(parser.parse_args(["serve", "--model", str(tmp_path)])) == str(tmp_path)
    assert model_of(parser.parse_args(["serve"])) is None
    same = parser.parse_args(["serve", str(tmp_path), "--model", str(tmp_path)])
    assert model_of(same) == str(tmp_path)
    with pytest.raises(ValueError, match=r"MODEL .*'a'.*--model 'b'"):
        model_of(parser.parse_args(["serve", "a", "--model", "b"]))
    swallowed = parser.parse_args(["serve", "--api-key", "sk-1", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--api-key took .*a folder.*MODEL --api-key KEY"):
        model_of(swallowed)
    key_first = parser.parse_args(["serve", str(tmp_path), "--api-key", "sk-1", "sk-2"])
    assert model_of(key_first) == str(tmp_path) and key_first.api_key == ["sk-1", "sk-2"]


def test_serve_model_positional_reaches_the_engine(tmp_path: Path) -> None:
    r = kvtier("serve", str(tmp_path / "missing"), "--port", "1")
    assert r.returncode == 2 and str(tmp_path / "missing") in r.stderr
