"""The ctypes side of `csrc/kvtier.h`: every export's signature, the `Layer` and `Step` structs,
and the checks that hold them to the header (a parse of its declarations) and to the library
(its own sizeof/offsetof exports), so a drift is an error, not memory corruption
(docs/architecture.md §Kernels)."""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HEADER = Path(__file__).with_name("csrc") / "kvtier.h"

_P, _I64, _F, _INT, _CP = (
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_float,
    ctypes.c_int,
    ctypes.c_char_p,
)
CType = Any  # a ctypes type (ctypes' own classes have no common public base for mypy)

# INVARIANT: one entry per KVTIER_API function of kvtier.h, (result, argument types) in order
SIGNATURES: dict[str, tuple[CType | None, tuple[CType, ...]]] = {
    "kvtier_layer_work": (_I64, (_P,)),
    "kvtier_layers": (_INT, (_I64, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _INT)),
    "kvtier_paged_attention": (
        _INT,
        (
            _P,
            _I64,
            _P,
            _P,
            _P,
            _I64,
            _P,
            _P,
            _P,
            _P,
            _P,
            _I64,
            _I64,
            _I64,
            _I64,
            _I64,
            _F,
            _F,
            _INT,
            _INT,
            _F,
            _F,
            _INT,
        ),
    ),
    "kvtier_attention_amx": (_INT, (_INT,)),
    "kvtier_rms_norm": (
        None,
        (_P, _I64, _I64, _I64, _P, _P, _P, _I64, _I64, _F, _INT, _INT, _INT),
    ),
    "kvtier_rope": (None, (_P, _I64, _I64, _I64, _P, _P, _I64, _INT, _INT)),
    "kvtier_act_mul": (None, (_P, _P, _I64, _I64, _INT, _INT, _INT)),
    "kvtier_argmax": (None, (_P, _I64, _I64, _I64, _P, _INT, _INT)),
    "kvtier_top_k_top_p": (_INT, (_P, _I64, _I64, _I64, _P, _P, _INT)),
    "kvtier_draw": (None, (_P, _I64, _I64, _I64, _P, _P, _INT)),
    "kvtier_apply_bitmask": (None, (_P, _I64, _I64, _P, _I64, _P, _I64, _INT, _INT)),
    "kvtier_pool_yield": (None, (_INT,)),
    "kvtier_pool_stats": (None, (_P,)),
    "kvtier_linear_available": (_INT, ()),
    "kvtier_linear_pack": (None, (_P, _I64, _I64, _P)),
    "kvtier_linear": (_INT, (_P, _I64, _I64, _P, _I64, _I64, _P, _P, _INT)),
    "kvtier_linear_i8_available": (_INT, ()),
    "kvtier_linear_i8_pack": (None, (_P, _I64, _I64, _P)),
    "kvtier_linear_i8": (_INT, (_P, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _INT)),
    "kvtier_linear_w8a8_available": (_INT, ()),
    "kvtier_linear_w8a8_pack": (None, (_P, _I64, _I64, _P)),
    "kvtier_linear_w8a8": (_INT, (_P, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _INT)),
    "kvtier_linear_f32_available": (_INT, ()),
    "kvtier_linear_f32_pack": (None, (_P, _I64, _I64, _P)),
    "kvtier_linear_f32": (_INT, (_P, _I64, _I64, _P, _I64, _I64, _P, _P, _INT)),
    "kvtier_abi_sizeof": (_I64, (_CP,)),
    "kvtier_abi_offsetof": (_I64, (_CP, _CP)),
    "kvtier_abi_fields": (_I64, (_CP,)),
}


# The structs' fields in kvtier.h's order: the mirrors below declare them, the checks read them.
LAYER_FIELDS: list[tuple[str, Any]] = [
    *((name, _P) for name in ("input_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm")),
    *((name, _P) for name in ("q_norm", "k_norm", "qkv", "o", "gate_up", "down")),
    *((name, _P) for name in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias")),
    *((name, _P) for name in ("qkv_scale", "o_scale", "gate_up_scale", "down_scale")),
    *((name, _I64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter")),
    *((name, _F) for name in ("eps", "scale", "softcap", "k_scale", "v_scale")),
    *((name, _INT) for name in ("gemma", "qk_gemma", "act", "kv_dtype", "w8a8")),
]
STEP_FIELDS: list[tuple[str, Any]] = [
    ("tables", _P),
    ("table_stride", _I64),
    *((name, _P) for name in ("seq_token", "seq_qlen", "seq_row", "lo", "hi")),
    ("num_seqs", _I64),
    ("write_rows", _P),
    ("write_tokens", _P),
    ("num_written", _I64),
    ("block_size", _I64),
]


class Layer(ctypes.Structure):  # kvtier.h `Layer`
    _fields_ = LAYER_FIELDS


class Step(ctypes.Structure):  # kvtier.h `Step`
    _fields_ = STEP_FIELDS


STRUCTS: dict[str, type[ctypes.Structure]] = {"Layer": Layer, "Step": Step}
FIELDS: dict[str, list[tuple[str, Any]]] = {"Layer": LAYER_FIELDS, "Step": STEP_FIELDS}


def load(path: Path) -> ctypes.CDLL:
    """The library at `path` with every export typed; ValueError where its structs are not laid
    out as the mirrors here (a library from other sources than this package's)."""
    library = typed(ctypes.CDLL(str(path)), SIGNATURES)
    wrong = layout_mismatches(library)
    if wrong:
        raise ValueError(f"{path}: its structs differ from kvtier/kernels/abi.py: {wrong}")
    return library


def typed(library: ctypes.CDLL, names: Iterable[str]) -> ctypes.CDLL:
    """`library` with the exports `names` given their SIGNATURES (AttributeError: one is not
    exported)."""
    for name in names:
        result, arguments = SIGNATURES[name]
        fn = getattr(library, name)
        fn.restype = result
        fn.argtypes = list(arguments)
    return library


def layout_mismatches(library: ctypes.CDLL) -> list[str]:
    """Where the library's structs (its kvtier_abi_* answers) differ from the ctypes mirrors."""
    wrong = []
    for name, mirror in STRUCTS.items():
        key = name.encode()
        size, fields = library.kvtier_abi_sizeof(key), library.kvtier_abi_fields(key)
        if size != ctypes.sizeof(mirror):
            wrong.append(f"sizeof({name}) is {size} in C, {ctypes.sizeof(mirror)} here")
        if fields != len(FIELDS[name]):
            wrong.append(f"{name} has {fields} fields in C, {len(FIELDS[name])} here")
        for field, _ in FIELDS[name]:
            offset = library.kvtier_abi_offsetof(key, field.encode())
            ours = getattr(mirror, field).offset
            if offset != ours:
                wrong.append(f"offsetof({name}, {field}) is {offset} in C, {ours} here")
    return wrong


# C types of kvtier.h → ctypes: every pointer is a c_void_p here but `const char *` (a name)
_SCALARS: dict[str, CType | None] = {"void": None, "int": _INT, "int64_t": _I64, "float": _F}
_DECLARATION = re.compile(r"KVTIER_API\s+([^;{]*?)\b(kvtier_\w+)\s*\(([^)]*)\)\s*;", re.S)
_STRUCT = re.compile(r"typedef struct \{(.*?)\}\s*(\w+)\s*;", re.S)
_COMMENT = re.compile(r"/\*.*?\*/", re.S)


def _ctype(c_type: str) -> CType | None:
    """The ctypes type of a C type without a name (`const int64_t *`, `float`)."""
    words = [w for w in c_type.replace("*", " * ").split() if w != "const"]
    if "*" in words:
        return _CP if words == ["char", "*"] else _P
    (word,) = words
    return _SCALARS[word]


def header_signatures(text: str) -> dict[str, tuple[CType | None, tuple[CType, ...]]]:
    """Every KVTIER_API declaration of a header's text as (result, argument types)."""
    out = {}
    for result, name, params in _DECLARATION.findall(_COMMENT.sub("", text)):
        arguments = [p.strip() for p in params.split(",") if p.strip() not in ("", "void")]
        named = [re.fullmatch(r"(.*?[\s*])(\w+)", p) for p in arguments]  # type, then name
        if not all(named):
            raise ValueError(f"{name}: every parameter of kvtier.h has a name: {arguments}")
        types = tuple(_ctype(m.group(1)) for m in named if m is not None)
        out[name] = (_ctype(result), types)
    return out


def header_structs(text: str) -> dict[str, list[tuple[str, CType | None]]]:
    """Every `typedef struct { … } Name;` of a header's text as its (field, type) list."""
    out = {}
    for body, name in _STRUCT.findall(_COMMENT.sub("", text)):
        fields: list[tuple[str, CType | None]] = []
        for declaration in (d.strip() for d in body.split(";")):
            if not declaration:
                continue
            first, *more = declaration.split(",")  # `const void *a, *b`: one base type
            match = re.fullmatch(r"(.*?)((?:\*\s*)*)(\w+)", first.strip(), re.S)
            if match is None:
                raise ValueError(f"struct {name}: cannot read the field {declaration!r}")
            base, stars, field = match.groups()
            fields.append((field, _ctype(base + stars)))
            for extra in more:
                stars, field = re.fullmatch(r"\s*((?:\*\s*)*)(\w+)\s*", extra).groups()  # type: ignore[union-attr]
                fields.append((field, _ctype(base + stars)))
        out[name] = fields
    return out


def header_mismatches(text: str) -> list[str]:
    """Where a header's declarations differ from SIGNATURES and STRUCTS."""
    wrong = []
    declared = header_signatures(text)
    for name in sorted(declared.keys() | SIGNATURES.keys()):
        if name not in SIGNATURES:
            wrong.append(f"{name} is declared in the header but not in abi.SIGNATURES")
        elif name not in declared:
            wrong.append(f"{name} is in abi.SIGNATURES but not declared in the header")
        elif declared[name] != SIGNATURES[name]:
            wrong.append(f"{name}: the header has {declared[name]}, abi.py {SIGNATURES[name]}")
    structs = header_structs(text)
    for name, ours in FIELDS.items():
        if structs.get(name) != ours:
            wrong.append(f"struct {name}: the header has {structs.get(name)}, abi.py {ours}")
    return wrong
