"""The engine imports no optional store client it was not configured to use: with `redis`
unimportable, `kvtier.engine` imports, an engine with host and disk tiers serves a request, and
only `--kv-remote-url` asks for the client, naming the extra to install. Before, `kvtier.engine`
imported redis through `kvtier.stores` whatever the tiers (issue 41)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.model.testing import write_tiny_model
from tests.torch_blocked import run_blocking


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def test_an_engine_without_a_remote_tier_runs_without_the_redis_client(
    llama: Path, tmp_path: Path
) -> None:
    out = run_blocking(
        ("redis", "hiredis"),
        f"""
        import kvtier.engine
        from kvtier.engine import EngineArgs, EngineCore, SamplingParams

        kw = dict(max_model_len=64, block_size=4, num_host_blocks=16)
        args = EngineArgs.from_kwargs({str(llama)!r}, **kw, kv_disk_path={str(tmp_path)!r})
        eng = EngineCore(args)
        eng.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, temperature=0))
        print(len(eng.drain()["a"].token_ids))
        eng.close()
        remote = EngineArgs.from_kwargs(
            {str(llama)!r}, **kw, kv_remote_url="redis://127.0.0.1:1/0"
        )
        try:
            EngineCore(remote)
        except ModuleNotFoundError as exc:
            print(exc)
        """,
    )
    served, refusal = out.splitlines()
    assert served == "3"
    assert "--kv-remote-url" in refusal and "pip install 'kvtier[redis]'" in refusal
