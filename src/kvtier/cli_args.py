"""Derive argparse flags from the config dataclasses (spelled like vLLM's, with the help text each
field carries) and build them back."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import re
import types
import typing
from typing import Any, TypeVar

from kvtier.config import flag_help

T = TypeVar("T")

# vLLM's human-readable integers: a lowercase suffix is decimal (8k = 8000), an uppercase one
# binary (8K = 8192), and a binary suffix takes no fraction. Byte sizes also take the unit words,
# either case: KB, MB, GB, TB decimal, KiB, MiB, GiB, TiB binary (fractions allowed).
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_BYTE_WORDS = {"b": 1} | {f"{u}b": 10 ** (3 * i) for i, u in enumerate("kmgt", 1)}
_BYTE_WORDS |= {f"{u}ib": 1 << (10 * i) for i, u in enumerate("kmgt", 1)}
# Flags vLLM reads as human-readable integers; `--max-model-len auto` (or -1) is the model's own.
HUMAN_INTS = frozenset({"max_model_len", "max_num_batched_tokens"})
# List flags vLLM reads as one JSON list (`--allowed-origins '["https://a.example"]'`); other
# list flags take one or more values.
JSON_LISTS = frozenset({"allowed_origins", "allowed_methods", "allowed_headers"})


def human_readable_int(text: str) -> int:
    """'8k' → 8000, '8K' → 8192, '25.6k' → 25600, '512' → 512 (vLLM's rule)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([kmgtKMGT]?)\s*", text)
    if m is None or ("." in m.group(1) and m.group(2) not in _DECIMAL):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an integer; write e.g. 8192, 8k (8000) or 8K (8192); a fraction "
            "takes a decimal suffix only (25.6k)"
        )
    number, suffix = m.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    return int(number) * _BINARY.get(suffix, 1)


def _int_or_auto(text: str) -> int | None:
    return None if text.strip() in ("auto", "-1") else human_readable_int(text)


def parse_bytes(text: str) -> int:
    """'4GiB' → 4294967296, '4GB' → 4000000000, '4G' → 4294967296, '4g' → 4000000000 (vLLM's
    single letters); plain integers are bytes. Raises argparse-friendly errors."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]{1,3})\s*", text)
    if m is not None and m.group(2).lower() in _BYTE_WORDS:
        return int(float(m.group(1)) * _BYTE_WORDS[m.group(2).lower()])
    try:
        return human_readable_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write e.g. 2GiB, 2G, 2GB or 536870912"
        ) from None


def json_list(text: str) -> tuple[str, ...]:
    """A JSON list of strings, as vLLM's `--allowed-origins '["https://a.example"]'`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a JSON list of strings; write e.g. '[\"https://a.example\"]'"
        )
    return tuple(value)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in `--help`; a default of None (the model's or the config's own
    value applies) is left to the flag's help, which then says what it is."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.default not in (None, argparse.SUPPRESS):
            action = copy.copy(action)  # argparse lists a flag without help with no text at all
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or action.default is argparse.SUPPRESS or "default" in text:
            return text
        return super()._get_help_string(action)


def _base_type(annotation: Any) -> type:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    origin = typing.get_origin(annotation)  # tuple[str, ...] → tuple
    kind = origin if origin is not None else annotation
    assert isinstance(kind, type), annotation
    return kind


def _shown(value: Any, name: str) -> str:
    if isinstance(value, tuple):
        return json.dumps(list(value)) if name in JSON_LISTS else " ".join(value) or "none"
    return str(value)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One `--flag-name` per field of `cls`; bools get `--x/--no-x`, tuples one or more values
    (a JSON list for JSON_LISTS). The help shows the field's default; the parsed default stays
    None, so unset flags keep the dataclass's."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(hints[f.name])
        help_text = flag_help(cls, f.name)
        if f.default not in (None, dataclasses.MISSING, ()) and "default" not in help_text:
            help_text += f" (default: {_shown(f.default, f.name)})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text.strip()}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind is tuple:
            kwargs |= {"type": json_list} if f.name in JSON_LISTS else {"nargs": "+"}
        elif f.name.endswith("_bytes"):
            kwargs["type"] = parse_bytes
        elif f.name in HUMAN_INTS:
            kwargs["type"] = _int_or_auto if f.name == "max_model_len" else human_readable_int
        else:
            kwargs["type"] = kind
        group.add_argument(flag, **kwargs)


def dataclass_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build `cls` from parsed flags; unset flags keep the dataclass defaults."""
    given = {
        f.name: tuple(value) if isinstance(value, list) else value
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if (value := getattr(args, f.name, None)) is not None
    }
    return cls(**given)


def configure_logging(level: str) -> None:
    """Log lines of the long-running commands (`serve` and its engine process)."""
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")
