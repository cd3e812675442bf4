"""The ctypes side of the kernels (kvtier/kernels/abi.py) against kvtier.h and the library built
from it: every export's signature, both structs' fields and their types parsed from the header,
their sizes and offsets from the library's own kvtier_abi_* exports. The checker is tried on
scratch copies of the header with a field or a signature changed and abi.py left alone, which it
must report (docs/architecture.md §Kernels)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from kvtier.kernels import abi, build

HEADER = abi.HEADER.read_text()


def _library() -> Path:
    path = build.build()
    if path is None:
        pytest.skip("no C compiler")
    return path


def test_the_header_declares_what_abi_py_mirrors() -> None:
    assert abi.header_mismatches(HEADER) == []
    assert set(abi.header_signatures(HEADER)) == set(abi.SIGNATURES)
    assert [name for name, *_ in abi.header_structs(HEADER)["Layer"]][:2] == [
        "input_norm",
        "post_attn_norm",
    ]


def test_the_library_lays_the_structs_out_as_the_mirrors() -> None:
    library = abi.load(_library())  # load checks them too, and refuses a library that differs
    assert abi.layout_mismatches(library) == []
    for name, mirror in abi.STRUCTS.items():
        assert library.kvtier_abi_sizeof(name.encode()) == ctypes.sizeof(mirror)
        assert library.kvtier_abi_fields(name.encode()) == len(abi.FIELDS[name])
    assert library.kvtier_abi_sizeof(b"Nothing") == -1
    assert library.kvtier_abi_offsetof(b"Step", b"nothing") == -1


@pytest.mark.skipif(shutil.which("nm") is None, reason="reads the symbol table with nm")
def test_the_library_exports_exactly_the_header_s_functions() -> None:
    """Everything else is hidden (-fvisibility=hidden): no second way into the library."""
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(_library())],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    exported = {line.split()[-1] for line in out.splitlines() if " T " in line}
    assert exported == set(abi.header_signatures(HEADER))


def _scratch(tmp_path: Path, old: str, new: str) -> Path:
    """A copy of csrc/ whose header has `old` replaced by `new`."""
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    assert HEADER.count(old) == 1, old
    (csrc / "kvtier.h").write_text(HEADER.replace(old, new))
    return csrc


@pytest.mark.parametrize(
    ("old", "new", "reported"),
    [
        ("int64_t num_written, block_size;", "int num_written;\n    int64_t block_size;", "Step"),
        ("int gemma, qk_gemma, act; ", "int gemma, qk_gemma, act, extra; ", "Layer"),
        ("const void *q_norm, *k_norm;", "const void *q_norm;\n    float k_norm;", "Layer"),
        ("int64_t tokens, int dtype,", "int tokens, int dtype,", "kvtier_rope"),
        ("KVTIER_API int kvtier_linear_available(void);", "", "kvtier_linear_available"),
    ],
    ids=["field-type", "field-in-padding", "pointer-to-float", "signature", "export-removed"],
)
def test_a_header_change_without_abi_py_is_reported(tmp_path, old, new, reported) -> None:
    """Each change to kvtier.h alone — a field's type, a field added where the struct's size
    stays the same, a parameter's type, an export removed — fails the check."""
    header = (_scratch(tmp_path, old, new) / "kvtier.h").read_text()
    wrong = abi.header_mismatches(header)
    assert any(reported in w for w in wrong), wrong


def test_a_struct_built_from_a_changed_header_is_refused(tmp_path, monkeypatch) -> None:
    """The library's own sizes and offsets catch a layout the mirrors do not have: abi.c alone
    built from a header whose Step has two fields swapped."""
    csrc = _scratch(
        tmp_path, "int64_t num_written, block_size;", "int64_t block_size, num_written;"
    )
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = build.build(csrc=csrc, sources={"abi.c": ()})
    if path is None:
        pytest.skip("no C compiler")
    library = abi.typed(ctypes.CDLL(str(path)), ["kvtier_abi_sizeof", "kvtier_abi_offsetof",
                                                  "kvtier_abi_fields"])  # fmt: skip
    wrong = abi.layout_mismatches(library)
    assert "offsetof(Step, num_written) is 88 in C, 80 here" in wrong, wrong
    assert abi.layout_mismatches(abi.typed(ctypes.CDLL(str(_library())), abi.SIGNATURES)) == []


def test_a_function_the_header_does_not_declare_does_not_build(tmp_path, monkeypatch) -> None:
    """A non-static function needs a declaration (-Werror=missing-prototypes): an export cannot
    be added in a .c file alone."""
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    with (csrc / "abi.c").open("a") as f:
        f.write("\nint kvtier_undeclared(int x) { return x; }\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    if build.compiler() is None:
        pytest.skip("no C compiler")
    assert build.build(csrc=csrc, sources={"abi.c": ()}) is None
    (csrc / "abi.c").write_text((build.CSRC / "abi.c").read_text())
    assert build.build(csrc=csrc, sources={"abi.c": ()}) is not None
