"""Native CPU kernels of the model, built from `csrc/` with the system C compiler on first use and
cached per source, flags, compiler and CPU (`~/.cache/kvtier/kernels/`, `$XDG_CACHE_HOME` moves
it); loaded with ctypes, which releases the GIL while a kernel runs. Plain C with no Python or
torch headers, so a build takes about a second. Without a compiler, or when the build fails,
`kernels()` is None (logged once) and the model keeps its torch paths."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("kvtier.model")

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # element types the kernels take

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


@dataclass(frozen=True)
class Kernels:
    """The loaded library and where it came from."""

    library: ctypes.CDLL
    path: Path

    def paged_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor,
        index: tuple[torch.Tensor, ...],
        scale: float,
        softcap: float | None,
    ) -> None:
        """Write the attention of the queries `index` names into their rows of `out`.

        q [T, H, D] (rows may be strided), kv_cache `KVLayout`, out [T, H, D] contiguous, all of
        one dtype in DTYPES on the CPU; index = (tables [n, max_blocks], seq_token [n],
        seq_qlen [n], seq_row [n], lo [rows], hi [rows]), int64, contiguous (see the C source)."""
        tables, seq_token, seq_qlen, seq_row, lo, hi = index
        _, num_heads, dim = q.shape
        assert q.stride(2) == 1 and q.stride(1) == dim and out.is_contiguous()
        assert kv_cache.is_contiguous() and q.dtype == kv_cache.dtype == out.dtype
        status = self.library.kvtier_paged_attention(
            q.data_ptr(), q.stride(0), kv_cache.data_ptr(), out.data_ptr(),
            tables.data_ptr(), tables.stride(0), seq_token.data_ptr(), seq_qlen.data_ptr(),
            seq_row.data_ptr(), lo.data_ptr(), hi.data_ptr(), seq_token.shape[0], num_heads,
            kv_cache.shape[3], dim, kv_cache.shape[2], scale, softcap or 0.0, DTYPES[q.dtype],
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("kvtier_paged_attention: no scratch memory for its work items")


def usable(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the native kernels can serve queries of `q`'s dtype and device (any tensor of
    them) over `kv_cache`, and were built (head_dim a multiple of 16, at most 512)."""
    return (
        q.device.type == "cpu"
        and q.dtype in DTYPES
        and kv_cache.dtype == q.dtype
        and kv_cache.shape[-1] % 16 == 0
        and kv_cache.shape[-1] <= 512
        and kernels() is not None
    )


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier" / "kernels"


def _cpu_signature() -> str:
    """What -march=native depends on: the machine and the CPU's feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


@functools.cache
def kernels() -> Kernels | None:
    """The library built for this CPU, building it on first use; None where it cannot be."""
    return build(FLAGS)


def build(flags: tuple[str, ...]) -> Kernels | None:
    """Build (or find in the cache) and load the kernels compiled with `flags`."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler (cc): native attention off, using the torch path")
        return None
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("C compiler %s unusable (%s): native attention off", compiler, exc)
        return None
    key = hashlib.sha256(
        b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_signature().encode()])
    ).hexdigest()[:16]
    path = cache_dir() / f"paged_attention-{key}.so"
    if not path.is_file() and not _build(compiler, flags, path):
        return None
    try:
        library = ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("could not load %s (%s): native attention off", path, exc)
        return None
    fn = library.kvtier_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR,
                   _I64, _I64, _I64, _I64, _I64, ctypes.c_float, ctypes.c_float, ctypes.c_int,
                   ctypes.c_int]  # fmt: skip
    return Kernels(library, path)


def _build(compiler: str, flags: tuple[str, ...], path: Path) -> bool:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = [compiler, *flags, "-o", tmp, str(SOURCE), "-lm", "-lpthread"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        ok, err = res.returncode == 0, res.stderr
    except (OSError, subprocess.SubprocessError) as exc:
        ok, err = False, str(exc)
    if not ok:
        Path(tmp).unlink(missing_ok=True)
        log.warning("building %s failed: native attention off:\n%s", SOURCE.name, err)
        return False
    os.replace(tmp, path)  # atomic: concurrent builders leave one complete file
    log.info("built %s in %s", SOURCE.name, path)
    return True
