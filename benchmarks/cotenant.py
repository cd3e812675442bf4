"""A co-tenant for `kvtier bench compare --co-tenant KIND`: one process that shares the box with
both engines for the whole run, so that "a busy machine" is a load anyone can reproduce rather
than whatever else happened to run (docs/benchmarks.md, Method).

Kinds: `spin` (a busy loop: CPU time only), `membw` (copies between two 256 MiB arrays: memory
bandwidth and last-level cache, what a second model's decode takes from ours) and `inference`
(kvtier's offline engine on the tiny Llama, one torch thread, generating a fixed batch in a loop:
a real second inference tenant). The load runs on the main thread at the default priority; a
thread ends the process when its stdin closes (procs.LineWorker's close).

Run as `python -m benchmarks.cotenant KIND`; it prints {"kind": "ready"} once its load is running
(for `inference` after its first batch, so measuring never starts before the load does)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

KINDS = ("none", "spin", "membw", "inference")
COPY_BYTES = 256 << 20  # well past any last-level cache on the boxes we use


def _exit_when_stdin_closes() -> None:
    def watch() -> None:
        while sys.stdin.readline():
            pass
        os._exit(0)  # the load loops forever on the main thread

    threading.Thread(target=watch, daemon=True).start()


def _ready(**info: Any) -> None:
    print(json.dumps({"kind": "ready", "pid": os.getpid(), **info}), flush=True)


def spin() -> None:
    _ready()
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def membw() -> None:
    import numpy as np

    src = np.ones(COPY_BYTES // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # both arrays resident before the load counts as running
    _ready(copy_bytes=COPY_BYTES)
    while True:
        np.copyto(dst, src)


def inference(seed: int) -> None:
    from kvtier.bench import models
    from kvtier.bench.throughput import random_prompts
    from kvtier.engine import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = models.model_path(models.TINY_LLAMA, Path(tmp))
        llm = LLM(str(path), device="cpu", torch_threads=1, seed=seed, max_model_len=512)
        batch = [{"prompt_token_ids": p} for p in random_prompts(seed, 16, 128, 1024)]
        params = SamplingParams(max_tokens=64, min_tokens=64)
        llm.generate(batch, params, use_tqdm=False)
        _ready(model=models.TINY_LLAMA, batch=16, input_len=128, output_len=64)
        while True:
            llm.generate(batch, params, use_tqdm=False)


LOADS: dict[str, Callable[[int], None]] = {
    "spin": lambda seed: spin(),
    "membw": lambda seed: membw(),
    "inference": inference,
}


@contextmanager
def running(
    kind: str, log: Path, seed: int = 0, timeout: float = 600.0
) -> Iterator[dict[str, Any]]:
    """Run co-tenant `kind` for the block; yields what the results record of it (its CPU seconds
    over the block are filled in at the end). `none` starts nothing."""
    if kind not in KINDS:
        raise ValueError(f"--co-tenant {kind!r}: use one of {', '.join(KINDS)}")
    info: dict[str, Any] = {"kind": kind}
    if kind == "none":
        yield info
        return
    from benchmarks.peers import procs

    argv = [sys.executable, "-m", "benchmarks.cotenant", kind, "--seed", str(seed)]
    root = Path(__file__).resolve().parent.parent
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    )
    worker = procs.LineWorker(argv, env, log, timeout)
    info.update({k: v for k, v in worker.ready.items() if k not in ("kind", "pid")})
    c0 = procs.tree_cpu_seconds(worker.proc.pid)
    try:
        yield info
    finally:
        info["cpu_s"] = procs.tree_cpu_seconds(worker.proc.pid) - c0
        worker.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("kind", choices=[k for k in KINDS if k != "none"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    _exit_when_stdin_closes()
    LOADS[args.kind](args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
