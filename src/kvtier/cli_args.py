"""Derive argparse flags from the config dataclasses (spelled like vLLM's) and build them back."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import types
import typing
from typing import Any, TypeVar

from kvtier.config import FLAG_HELP

T = TypeVar("T")

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20}
_UNITS |= {"g": 1 << 30, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str) -> int:
    """'4GiB' → 4294967296; plain integers are bytes. Raises argparse-friendly ValueError."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 2GiB or 536870912")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _base_type(annotation: Any) -> type:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    assert isinstance(annotation, type), annotation
    return annotation


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One `--flag-name` per field of `cls`; bools get `--x/--no-x`."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(hints[f.name])
        help_text = FLAG_HELP.get(f.name, "")
        if kind is bool:
            group.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            conv: Any = parse_bytes if f.name.endswith("_bytes") else kind
            group.add_argument(flag, dest=f.name, type=conv, default=None, help=help_text)


def dataclass_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build `cls` from parsed flags; unset flags keep the dataclass defaults."""
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if getattr(args, f.name, None) is not None
    }
    return cls(**given)


def configure_logging(level: str) -> None:
    """Log lines of the long-running commands (`serve` and its engine process, `router`)."""
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")
