"""`tools/gpu_check.sh`'s preflight, runnable on any machine: every package the script lists as
a need imports, and the kvtier modules and pytest selections its checks use import with kvtier's
own imports limited to those packages (and the standard library). Catches on a CPU box what would
otherwise fail every check on the GPU box, where the time is scarce.

Usage: gpu_preflight.py --needs PKG... --modules MOD... --tests PATH...; exit 1 naming each miss.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import FrameType
from typing import Any

OWN = ("kvtier", "tests")  # the importers whose imports must be listed needs


class ListedOnly(MetaPathFinder):
    """Refuses a top-level import that kvtier's (or the tests') code makes of a package outside
    `needs` and the standard library; a package's own imports (torch's, transformers') pass."""

    def __init__(self, needs: set[str]) -> None:
        self.needs = needs
        self.refused: list[str] = []

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        top = name.partition(".")[0]
        if top in self.needs or top in OWN or top in sys.stdlib_module_names:
            return None
        importer = _importer(sys._getframe(1))
        if importer.partition(".")[0] in OWN:
            self.refused.append(f"{importer} imports {top}")
            raise ModuleNotFoundError(f"{top} is not in gpu_check.sh's needs", name=top)
        return None


def _importer(frame: FrameType | None) -> str:
    """The module whose code runs the import: the first frame outside importlib's machinery."""
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        frozen = frame.f_code.co_filename.startswith("<frozen importlib")
        if not frozen and name != "importlib" and not name.startswith("importlib."):
            return name
        frame = frame.f_back
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--needs", nargs="+", required=True, help="import names of the needs")
    parser.add_argument("--modules", nargs="+", default=[], help="kvtier modules the checks run")
    parser.add_argument("--tests", nargs="+", default=[], help="test files the checks select")
    args = parser.parse_args(argv)
    missing = []
    for need in args.needs:
        try:
            importlib.import_module(need)
        except ImportError as exc:
            missing.append(f"{need} ({exc})")
    if missing:
        print(f"preflight: listed needs not importable: {', '.join(missing)}", file=sys.stderr)
        return 1
    guard = ListedOnly(set(args.needs))
    sys.meta_path.insert(0, guard)
    failed = []
    for module in args.modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # any import-time failure is a check that would fail
            failed.append(f"{module}: {type(exc).__name__}: {exc}")
    if args.tests:
        import pytest

        flags = [
            "--collect-only",
            "-q",
            "--disable-warnings",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
        ]
        code = pytest.main([*flags, *args.tests])
        if code != 0:
            failed.append(f"pytest could not collect {args.tests} (exit {code})")
    failed += guard.refused
    if failed:
        print("preflight: failed:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    print(f"preflight: ok: {len(args.needs)} needs, {len(args.modules)} modules, tests collected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
