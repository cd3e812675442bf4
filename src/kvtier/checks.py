"""Type and range checks for values arriving at a boundary (sampling parameters, engine arguments,
token ids, config dataclass fields by their declared types). Each returns the value in its plain
Python form (numpy scalars become int / float, sequences become tuples) or raises TypeError (wrong
kind) / ValueError (out of range) naming the field and what it accepts. Torch-free."""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, TypeGuard

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1


def show(value: object) -> str:
    """A short repr for error messages (a 10 MB string must not become a 10 MB message)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        text = f"an integer of {value.bit_length()} bits" if isinstance(value, int) else "?"
    if len(text) > 60:
        text = f"{text[:50]}…"
    return text if isinstance(value, (int, float, str)) else f"{text} ({type(value).__name__})"


def show_ids(ids: list[int]) -> str:
    """The first few of `ids` for an error message: "[1, 2, 3, 4, 5, …]"."""
    return "[" + ", ".join(map(show, ids[:5])) + (", …]" if len(ids) > 5 else "]")


def is_int(value: object) -> TypeGuard[numbers.Integral]:
    """True for int and numpy integers; False for bool (True is not a token id or a count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(
    name: str, value: object, lo: int = INT64_MIN, hi: int = INT64_MAX, hint: str = ""
) -> int:
    """`value` as an int in [lo, hi]; `hint` follows the range in the message."""
    what = f"an integer{_range(lo, hi)}{hint}"
    if not is_int(value):
        raise TypeError(f"{name} must be {what}, got {show(value)}")
    n = int(value)
    if not lo <= n <= hi:
        unsaid = hi == INT64_MAX and (n > hi or n < lo == INT64_MIN)  # bounds _range omits
        fits = " that fits 64 bits" if unsaid else ""
        raise ValueError(f"{name} must be {what}{fits}, got {show(n)}")
    return n


def check_float(
    name: str,
    value: object,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hint: str = "",
) -> float:
    """`value` as a finite float in [lo, hi] (or (lo, hi] with `lo_open`); ints are accepted."""
    left = "(" if lo_open else "["
    span = f" in {left}{lo}, {hi}]" if lo is not None and hi is not None else ""
    if lo is not None and hi is None:
        span = f" > {lo}" if lo_open else f" ≥ {lo}"
    what = f"a finite number{span}{hint}"
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be {what}, got {show(value)}")
    try:
        x = float(value)
    except OverflowError:  # an int or fraction beyond float range
        x = math.inf
    low_bad = lo is not None and (x <= lo if lo_open else x < lo)
    if not math.isfinite(x) or low_bad or (hi is not None and x > hi):
        raise ValueError(f"{name} must be {what}, got {show(x)}")
    return x


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {show(value)}")
    return value


def check_ints(
    name: str, value: object, lo: int | None = 0, hi: int = INT64_MAX
) -> tuple[int, ...]:
    """A list / tuple / array of integers in [lo, hi] (lo None: any integer, for callers that
    check the range themselves) as a tuple (None → ())."""
    if value is None:
        return ()
    items = _items(name, value, "integers")
    ints: tuple[int, ...]
    if all(type(v) is int for v in items):  # the common case, without an ABC check per item
        ints = items  # type: ignore[assignment]
    else:
        bad_type = [v for v in items if not is_int(v)]
        if bad_type:
            raise TypeError(f"{name} must be a list of integers, but it holds {show(bad_type[0])}")
        ints = tuple(int(v) for v in items if is_int(v))
    if lo is None or not ints or (lo <= min(ints) and max(ints) <= hi):
        return ints
    bad = [n for n in ints if not lo <= n <= hi]
    if bad:
        fits = " that fit 64 bits" if hi == INT64_MAX and max(bad) > hi else ""
        shown = ", ".join(map(show, bad[:5]))
        raise ValueError(f"{name} must be a list of integers{_range(lo, hi)}{fits}, got {shown}")
    return ints


def check_strs(name: str, value: object, allow_empty: bool = False) -> tuple[str, ...]:
    """A string or a list of strings as a tuple of strings (None → ())."""
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else _items(name, value, "strings")
    strs: list[str] = []
    for s in items:
        if not isinstance(s, str):
            raise TypeError(f"{name} must be a string or a list of strings, but it holds {show(s)}")
        if not s and not allow_empty:
            raise ValueError(f"{name} must not contain an empty string; drop it")
        strs.append(s)
    return tuple(strs)


def _items(name: str, value: object, of: str) -> tuple[object, ...]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list of {of}, got {show(value)}")
    return tuple(value)


def _range(lo: int, hi: int) -> str:
    if hi == INT64_MAX:
        return "" if lo == INT64_MIN else f" ≥ {lo}"
    return f" in [{lo}, {hi}]"


def flag(name: str) -> str:
    """The CLI spelling of a field: block_size → --block-size."""
    return "--" + name.replace("_", "-")


def check_field_types(obj: Any) -> None:
    """TypeError naming the flag of a field whose value is not of its declared type (bool is not
    an int, NaN and ±inf are not numbers); ints beyond 64 bits are a ValueError. Stores numpy
    scalars as int / float and lists of strings as tuples on `obj` (a frozen dataclass)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, kinds = getattr(obj, f.name), _kinds(hints[f.name])
        name = f"{f.name} ({flag(f.name)})"
        if value is None and type(None) in kinds:
            continue
        if isinstance(value, bool):
            if bool not in kinds:
                raise TypeError(f"{name} must be {_describe(kinds)}, got {show(value)}")
            continue
        if int in kinds and is_int(value):
            object.__setattr__(obj, f.name, check_int(name, value))
        elif float in kinds and not isinstance(value, (str, bytes)):
            object.__setattr__(obj, f.name, check_float(name, value))
        elif tuple in kinds and not isinstance(value, str):
            object.__setattr__(obj, f.name, check_strs(name, value, allow_empty=True))
        elif not any(isinstance(value, k) for k in kinds if k not in (int, float, tuple)):
            raise TypeError(f"{name} must be {_describe(kinds)}, got {show(value)}")


def _kinds(annotation: Any) -> tuple[type, ...]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return tuple(k for a in typing.get_args(annotation) for k in _kinds(a))
    origin = typing.get_origin(annotation)
    return (origin,) if origin is not None else (annotation,)


def _describe(kinds: tuple[type, ...]) -> str:
    words = {int: "an integer", float: "a number", bool: "True or False", str: "a string"}
    words |= {tuple: "a list of strings", type(None): "None"}
    return " or ".join(words.get(k, k.__name__) for k in kinds)
