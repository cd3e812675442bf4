"""Builds the kernel library from `csrc/`: every source compiled with its own flags, the objects
linked once into one shared library, cached per sources, flags, compiler and (for `native`) CPU
(docs/architecture.md §Kernels). A missing compiler or a failed build is logged and gives None."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvtier.cpus import usable_cpus

log = logging.getLogger("kvtier.kernels")

CSRC = Path(__file__).with_name("csrc")
ISA_ENV = "KVTIER_CPU_ISA"  # the -march the library is built for; "native" (the default): this CPU
NO_CONTRACT = ("-ffp-contract=off",)  # float32 rounded where torch's separate ops round
SOURCES: dict[str, tuple[str, ...]] = {  # every object of the library and its own flags
    "pool.c": (),
    "abi.c": (),
    "layer.c": (),
    "attention.c": (),
    "attention_portable.c": (),
    "attention_avx512.c": (),
    "attention_avx2.c": (),
    "attention_avx512bf16.c": (),
    "attention_amx.c": (),
    "fused.c": NO_CONTRACT,
    "fused_avx512.c": NO_CONTRACT,
    "fused_avx512bf16.c": NO_CONTRACT,
    "mask.c": (),
    "linear.c": (),
    "linear_amx.c": (),
    "linear_avx512bf16.c": (),
    "linear_avx2.c": (),
    "linear_wide_avx512.c": (),
    "linear_i8_amx.c": (),
    "linear_i8_avx512.c": (),
    "linear_i8_avx2.c": (),
    "linear_w8a8_avx512.c": (),
    "linear_w8a8_avx2.c": (),
    "linear_f32_avx512.c": (),
    "linear_f32_avx2.c": (),
}
BASE_FLAGS = (
    "-O3",
    "-fopenmp-simd",
    "-fPIC",
    "-fvisibility=hidden",  # only kvtier.h's KVTIER_API functions leave the library
    "-Werror=missing-prototypes",  # a non-static function is declared in a header
    "-Werror=implicit-function-declaration",
)
LIBS = ("-lm", "-lpthread")
_ISA = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


@dataclass(frozen=True)
class Compiler:
    """The C compiler as `make` takes it: `$CC` split as a shell would (`ccache gcc` is a
    command and its argument), `$CFLAGS` after our flags (so they can override them), `$LDFLAGS`
    on the link."""

    command: tuple[str, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    version: str


def isa() -> str:
    """The ISA the library is built for: `$KVTIER_CPU_ISA` (any `-march` value the compiler
    knows, e.g. x86-64-v3 for a portable build), else native."""
    value = os.environ.get(ISA_ENV, "").strip() or "native"
    if not _ISA.fullmatch(value):
        raise ValueError(
            f"{ISA_ENV}={value!r} is not an -march value: use native (this CPU) or a target the "
            "compiler knows, e.g. x86-64-v3"
        )
    return value


def compiler() -> Compiler | None:
    """`$CC` (default `cc`) with its version, or None (logged) where it cannot run."""
    command = shlex.split(os.environ.get("CC", "").strip() or "cc")
    found = shutil.which(command[0])
    if found is None:
        log.warning("no C compiler (%s): native kernels off, using the torch paths", command[0])
        return None
    command[0] = found
    try:
        version = subprocess.run(
            [*command, "--version"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("C compiler %s unusable (%s): native kernels off", command, exc)
        return None
    env = os.environ
    return Compiler(
        tuple(command),
        tuple(shlex.split(env.get("CFLAGS", ""))),
        tuple(shlex.split(env.get("LDFLAGS", ""))),
        version,
    )


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier" / "kernels"


def _cpuinfo_line(key: str) -> str:
    """/proc/cpuinfo's first line of `key` ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line
    except OSError:
        pass
    return ""


def _flags_line() -> str:
    return _cpuinfo_line("flags")


def cpu_model() -> str | None:
    """The CPU's model name as /proc/cpuinfo gives it (None where it cannot be read)."""
    return _cpuinfo_line("model name").partition(":")[2].strip() or None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (avx2, avx512_vnni, …); empty where
    it cannot be read."""
    return frozenset(_flags_line().partition(":")[2].split())


def cpu_signature() -> str:
    """What -march=native depends on: the machine and the CPU's feature flags."""
    return f"{platform.machine()} {_flags_line()}"


def build(
    target: str | None = None,
    csrc: Path = CSRC,
    sources: dict[str, tuple[str, ...]] | None = None,
) -> Path | None:
    """The library for `target` (None: `isa()`) from `csrc`, built unless the cache holds it;
    None (logged) where it cannot be built."""
    target = isa() if target is None else target
    sources = SOURCES if sources is None else sources
    cc = compiler()
    if cc is None:
        return None
    flags = (*BASE_FLAGS, f"-march={target}")
    text = b"".join(
        [
            *((csrc / name).read_bytes() for name in sorted(sources)),
            *(h.read_bytes() for h in sorted(csrc.glob("*.h"))),
        ]
    )
    parts = [text, repr(sorted(sources.items())).encode(), " ".join(flags).encode()]
    parts += [repr((cc.command, cc.cflags, cc.ldflags)).encode(), cc.version.encode()]
    if target == "native":  # a named target's library is the same on every CPU
        parts.append(cpu_signature().encode())
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    path = cache_dir() / f"kvtier-{target}-{key}.so"
    if path.is_file() or _build(cc, flags, csrc, sources, path):
        return path
    return None


def _build(
    cc: Compiler,
    flags: tuple[str, ...],
    csrc: Path,
    sources: dict[str, tuple[str, ...]],
    path: Path,
) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=path.parent))
    except OSError as exc:  # a read-only home, a full disk: the torch paths still work
        log.warning("cannot write %s (%s): native kernels off", path.parent, exc)
        return False
    try:
        commands = [
            [*cc.command, *flags, *own, *cc.cflags, "-c", str(csrc / name), "-o",
             str(work / f"{Path(name).stem}.o")]
            for name, own in sorted(sources.items())
        ]  # fmt: skip
        with ThreadPoolExecutor(max_workers=usable_cpus()) as pool:
            errors = [e for e in pool.map(_run, commands) if e is not None]
        if errors:
            log.warning("building the kernels failed: native kernels off:\n%s", "\n".join(errors))
            return False
        objects = [str(work / f"{Path(name).stem}.o") for name in sorted(sources)]
        lib = work / "kvtier.so"
        error = _run([*cc.command, "-shared", *cc.cflags, *objects, "-o", str(lib), *LIBS,
                      *cc.ldflags])  # fmt: skip
        if error is not None:
            log.warning("linking the kernels failed: native kernels off:\n%s", error)
            return False
        os.replace(lib, path)  # atomic: concurrent builders leave one complete file
        log.info("built the kernels in %s", path)
        return True
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(command: list[str]) -> str | None:
    """None, or what went wrong (the command and its errors)."""
    try:
        res = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{shlex.join(command)}: {exc}"
    return None if res.returncode == 0 else f"{shlex.join(command)}:\n{res.stderr}"
