"""Native CPU kernels of the model, built from `csrc/` with the system C compiler on first use and
cached per source, flags, compiler and CPU (`~/.cache/kvtier/kernels/`, `$XDG_CACHE_HOME` moves
it); loaded with ctypes, which releases the GIL while a kernel runs. Plain C with no Python or
torch headers: a build takes a few seconds (4 s for both libraries on a busy 2-core box). Without
a compiler, a writable cache or a successful build, `kernels()` is None (logged once) and the
model keeps its torch paths.

`paged_attention.c`: attention straight from the paged cache (decodes, drafts, and a prompt's
chunk in a step the one-call layers run; decodes on AMX tiles where granted, `attention_tiles`).
`fused.c`: RMSNorm (with the residual add), rotary embedding, act(gate) * up, argmax — built
without FMA contraction so float32 rounds as torch's separate ops do. `linear.c`: bfloat16
linears for few rows on AMX tiles or AVX512-BF16 (`tile_linear`), and float32 linears whose
rows do not depend on their batch (`f32_linear`). `layer.c`: a decoder layer's step as one call
into the others (`model/fused_layer.py`). `pool.c`: the helper threads every library's calls
share (bound to each at load; `pool.h` its interface). Shared headers `vexp.h` (the AVX-512
exponential) and `amx.h` (the tile state's grant and configuration)."""

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

CSRC = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # element types the kernels take
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}
MAX_NORM_DIM, MAX_HEAD_DIM = 8192, 512  # the kernels' stack buffers

_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "kvtier_paged_attention": [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR,
                               _I64, _I64, _I64, _I64, _I64, _F32, _F32, _INT, _INT],
    "kvtier_rms_norm": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT, _INT,
                        _INT],
    "kvtier_rope": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _INT, _INT],
    "kvtier_act_mul": [_PTR, _PTR, _I64, _I64, _INT, _INT, _INT],
    "kvtier_argmax": [_PTR, _I64, _I64, _I64, _PTR, _INT, _INT],
    "kvtier_top_k_top_p": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _INT],
    "kvtier_linear_available": [],
    "kvtier_linear_pack": [_PTR, _I64, _I64, _PTR],
    "kvtier_linear": [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _INT],
    "kvtier_linear_f32_pack": [_PTR, _I64, _I64, _PTR],
    "kvtier_linear_f32": [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _INT],
    "kvtier_layer_work": [_PTR],
    "kvtier_layers": [_I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _INT],
    "kvtier_pool_bind": [_PTR],
    "kvtier_attention_amx": [_INT],
}  # fmt: skip
_RETURNS = {"kvtier_paged_attention": ctypes.c_int, "kvtier_linear_available": ctypes.c_int,
            "kvtier_linear": ctypes.c_int, "kvtier_layers": ctypes.c_int,
            "kvtier_top_k_top_p": ctypes.c_int, "kvtier_attention_amx": ctypes.c_int,
            "kvtier_layer_work": ctypes.c_int64}  # fmt: skip


LINEAR_KINDS = {0: None, 1: "amx", 2: "avx512bf16"}  # kvtier_linear_available's answers


@dataclass(frozen=True)
class Kernels:
    """The loaded libraries (attention, fused elementwise, linear, layer) and where they came
    from; `tile_linear`: which instructions the linear kernel runs on here ("amx": AMX tiles,
    granted by the OS; "avx512bf16": VDPBF16PS; None: neither, oneDNN serves every linear)."""

    attention: ctypes.CDLL
    fused: ctypes.CDLL
    linear: ctypes.CDLL
    layer: ctypes.CDLL | None  # None: it did not build (the layers keep their Python path)
    paths: tuple[Path, ...]
    tile_linear: str | None = None
    pool: ctypes.CDLL | None = None  # the threads every library's calls share (kept loaded)

    def attention_tiles(self, use: bool | None = None) -> bool:
        """Whether the attention kernel runs its small work items (≤ 16 query rows: decodes and
        short drafts; bfloat16, head_dim a multiple of 32 up to 128) on AMX tiles, which the OS
        grants here or not. `use` False puts them on the AVX512-BF16 path until True turns the
        tiles back on (the tests compare both); None only asks."""
        fn = getattr(self.attention, "kvtier_attention_amx", None)
        return fn is not None and bool(fn(-1 if use is None else int(use)))

    @property
    def f32_linear(self) -> bool:
        """The float32 linear kernel is built here (AVX-512F): batch-invariant float32 linears."""
        return hasattr(self.linear, "kvtier_linear_f32")

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
        status = self.attention.kvtier_paged_attention(
            q.data_ptr(), q.stride(0), kv_cache.data_ptr(), out.data_ptr(),
            tables.data_ptr(), tables.stride(0), seq_token.data_ptr(), seq_qlen.data_ptr(),
            seq_row.data_ptr(), lo.data_ptr(), hi.data_ptr(), seq_token.shape[0], num_heads,
            kv_cache.shape[3], dim, kv_cache.shape[2], scale, softcap or 0.0, DTYPES[q.dtype],
            threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("kvtier_paged_attention: no scratch memory for its work items")

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        gemma: bool,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RMSNorm of the rows of x [..., dim] (2-D, or 3-D with a contiguous last two dims'
        rows: q [T, H, D] views) into a new contiguous tensor; with `residual` (contiguous, the
        shape of the rows), residual += x first (in place) and the sum is normalized."""
        dim = x.shape[-1]
        assert x.stride(-1) == 1 and weight.dtype == x.dtype and x.dim() in (2, 3)
        inner, inner_stride = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
        rows = x.numel() // dim
        out = torch.empty(x.shape, dtype=x.dtype)
        if residual is not None:
            assert residual.is_contiguous() and residual.shape == x.shape
        self.fused.kvtier_rms_norm(
            x.data_ptr(), x.stride(0), inner, inner_stride,
            None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
            rows, dim, eps, int(gemma), DTYPES[x.dtype], threads(),
        )  # fmt: skip
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, D] (heads D apart, tokens any stride) in place by cos/sin
        [T, 1, D] (contiguous, x's dtype); returns x."""
        tokens, heads, dim = x.shape
        assert x.stride(2) == 1 and x.stride(1) == dim and cos.is_contiguous()
        assert sin.is_contiguous() and cos.dtype == sin.dtype == x.dtype
        self.fused.kvtier_rope(
            x.data_ptr(), x.stride(0), heads, dim, cos.data_ptr(), sin.data_ptr(), tokens,
            DTYPES[x.dtype], threads(),
        )  # fmt: skip
        return x

    def act_mul(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """act(gate) * up of gate_up [rows, 2 * inter] (contiguous) → [rows, inter]."""
        rows, width = gate_up.shape
        assert gate_up.is_contiguous()
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self.fused.kvtier_act_mul(
            gate_up.data_ptr(), out.data_ptr(), rows, width // 2, ACTIVATIONS[activation],
            DTYPES[gate_up.dtype], threads(),
        )  # fmt: skip
        return out

    def address(self, name: str) -> int:
        """The address of an exported kernel function (for `layer.c`, which calls them)."""
        for library in (self.attention, self.fused, self.linear):
            if hasattr(library, name):
                address = ctypes.cast(getattr(library, name), ctypes.c_void_p).value
                assert address is not None
                return address
        raise KeyError(name)

    def pack_linear(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight [n, k] in the linear kernel's layout: bfloat16 in tiles (needs
        `tile_linear`), float32 in 16-column vectors (needs `f32_linear`)."""
        n, k = weight.shape
        assert weight.is_contiguous()
        if weight.dtype == torch.float32:
            assert self.f32_linear
            packed = torch.empty(-(-n // 16) * k * 16, dtype=torch.float32)
            self.linear.kvtier_linear_f32_pack(weight.data_ptr(), n, k, packed.data_ptr())
            return packed
        assert self.tile_linear and weight.dtype == torch.bfloat16
        packed = torch.empty(-(-n // 16) * -(-k // 32) * 512, dtype=torch.bfloat16)
        self.linear.kvtier_linear_pack(weight.data_ptr(), n, k, packed.data_ptr())
        return packed

    def linear_f32(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [m, k] float32 (rows contiguous) times the packed weight [n, k]ᵀ (+ bias) → [m, n]:
        each output one in-order multiply-add chain, so a row's bits do not depend on its
        batch."""
        m, k = x.shape
        assert x.dtype == packed.dtype == torch.float32 and x.stride(1) == 1
        assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
        out = torch.empty(m, n, dtype=torch.float32)
        self.linear.kvtier_linear_f32(
            x.data_ptr(), x.stride(0), m, packed.data_ptr(), n, k,
            None if bias is None else bias.data_ptr(), out.data_ptr(), threads(),
        )  # fmt: skip
        return out

    def linear_bf16(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [m, k] (rows contiguous) times the packed weight [n, k]ᵀ (+ bias) → [m, n], the
        bits of oneDNN's bfloat16 linear."""
        m, k = x.shape
        assert x.dtype == packed.dtype == torch.bfloat16 and x.stride(1) == 1
        assert bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())
        out = torch.empty(m, n, dtype=torch.bfloat16)
        status = self.linear.kvtier_linear(
            x.data_ptr(), x.stride(0), m, packed.data_ptr(), n, k,
            None if bias is None else bias.data_ptr(), out.data_ptr(), threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("kvtier_linear: no scratch memory")
        return out


CPU = torch.device("cpu")
_threads: int | None = None  # set_threads; None: torch's intra-op thread count


def set_threads(n: int | None) -> None:
    """Threads a kernel call may start (each splits its rows or sequences among them when the
    call has work enough); None follows `torch.get_num_threads()`."""
    global _threads
    if n is not None and n < 1:
        raise ValueError(f"native kernel threads must be ≥ 1, got {n}")
    _threads = n


def threads() -> int:
    """Threads a kernel call may start now (`set_threads`)."""
    return _threads if _threads is not None else torch.get_num_threads()


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of float32 or bfloat16 rows x [n, vocab] (the first maximum, or the
    first NaN); torch's reduction runs at ~2 ns an element, the native one at memory speed."""
    kernels = kernels_for(x) if x.dim() == 2 else None
    if kernels is None or x.stride(-1) != 1:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    kernels.fused.kvtier_argmax(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), DTYPES[x.dtype],
        threads(),
    )  # fmt: skip
    return out


def top_k_top_p_(
    x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor | None:
    """Filter float32 logits x [n, vocab] in place to each row's top-k and then top-p tokens
    (fused.c `kvtier_top_k_top_p`: a radix select, no sort); the others become -inf. top_k [n]
    int64 (≥ vocab: all), top_p [n] float32 (1.0: all). None, touching nothing, where the kernels
    do not serve x (the caller sorts)."""
    kernels = kernels_for(x) if x.dim() == 2 and x.dtype == torch.float32 else None
    if kernels is None or x.stride(-1) != 1:
        return None
    k = None if top_k is None else top_k.to(torch.int64).contiguous()
    p = None if top_p is None else top_p.to(torch.float32).contiguous()
    status = kernels.fused.kvtier_top_k_top_p(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), None if k is None else k.data_ptr(),
        None if p is None else p.data_ptr(), threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"top-k/top-p filter: no scratch for {x.shape[1]} tokens a row")
    return x


def kernels_for(x: torch.Tensor) -> Kernels | None:
    """The kernels, if they serve `x` (see `usable`)."""
    return kernels() if usable(x) else None


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels serve tensors of `x`'s dtype and device (the host CPU: not another
    device, nor a stand-in for one such as the placement audit's `cpu:1`), and were built."""
    return x.device == CPU and x.dtype in DTYPES and kernels() is not None


def attention_usable(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the attention kernel serves queries of `q`'s dtype and device (any tensor of
    them) over `kv_cache`: head_dim a multiple of 16, at most MAX_HEAD_DIM."""
    dim = kv_cache.shape[-1]
    return usable(q) and kv_cache.dtype == q.dtype and dim % 16 == 0 and dim <= MAX_HEAD_DIM


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
    """The kernels built for this CPU, building them on first use; None where they cannot be."""
    return build(FLAGS)


def build(flags: tuple[str, ...]) -> Kernels | None:
    """Build (or find in the cache) and load every kernel library, compiled with `flags`."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler (cc): native kernels off, using the torch paths")
        return None
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("C compiler %s unusable (%s): native kernels off", compiler, exc)
        return None
    pool = _library(compiler, version, CSRC / "pool.c", flags)
    attention = _library(compiler, version, CSRC / "paged_attention.c", flags)
    fused = _library(compiler, version, CSRC / "fused.c", (*flags, "-ffp-contract=off"))
    if pool is None or attention is None or fused is None:
        return None
    linear = _library(compiler, version, CSRC / "linear.c", flags)
    if linear is None:
        return None
    tile = LINEAR_KINDS[linear[0].kvtier_linear_available()]
    layer = _library(compiler, version, CSRC / "layer.c", flags)  # optional: the layers' Python
    run = ctypes.cast(pool[0].kvtier_pool_run, ctypes.c_void_p)
    for library in (attention, fused, linear):  # one pool for every kernel (pool.c)
        library[0].kvtier_pool_bind(run)
    paths = (pool[1], attention[1], fused[1], linear[1], *(() if layer is None else (layer[1],)))
    return Kernels(
        attention[0], fused[0], linear[0], None if layer is None else layer[0], paths, tile, pool[0]
    )


def _library(
    compiler: str, version: str, source: Path, flags: tuple[str, ...]
) -> tuple[ctypes.CDLL, Path] | None:
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
    key = hashlib.sha256(
        b"\0".join([text, " ".join(flags).encode(), version.encode(), _cpu_signature().encode()])
    ).hexdigest()[:16]
    path = cache_dir() / f"{source.stem}-{key}.so"
    if not path.is_file() and not _build(compiler, source, flags, path):
        return None
    try:
        library = ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("could not load %s (%s): native kernels off", path, exc)
        return None
    for name, argtypes in _SIGNATURES.items():
        if hasattr(library, name):
            fn = getattr(library, name)
            fn.restype = _RETURNS.get(name)
            fn.argtypes = argtypes
    return library, path


def _build(compiler: str, source: Path, flags: tuple[str, ...], path: Path) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    except OSError as exc:  # a read-only home, a full disk: the torch paths still work
        log.warning("cannot write %s (%s): native kernels off", path.parent, exc)
        return False
    os.close(fd)
    cmd = [compiler, *flags, "-o", tmp, str(source), "-lm", "-lpthread"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        ok, err = res.returncode == 0, res.stderr
    except (OSError, subprocess.SubprocessError) as exc:
        ok, err = False, str(exc)
    if not ok:
        Path(tmp).unlink(missing_ok=True)
        log.warning("building %s failed: native kernels off:\n%s", source.name, err)
        return False
    os.replace(tmp, path)  # atomic: concurrent builders leave one complete file
    log.info("built %s in %s", source.name, path)
    return True
