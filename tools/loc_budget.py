"""Print per-module line counts of src/kvtier; with --check, fail if a module passes the ceiling."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SOFT, HARD = 300, 400


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help=f"exit 1 if a module exceeds {HARD} lines"
    )
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent / "src" / "kvtier"
    sizes = sorted(
        ((sum(1 for _ in p.open()), p.relative_to(root.parent)) for p in root.rglob("*.py")),
        reverse=True,
    )
    over = [(n, p) for n, p in sizes if n > HARD]
    if not args.check:
        for n, p in sizes:
            mark = " !" if n > HARD else (" ~" if n > SOFT else "")
            print(f"{n:5d}  {p}{mark}")
        print(f"{sum(n for n, _ in sizes):5d}  total in {len(sizes)} modules")
    for n, p in over:
        print(f"{p}: {n} lines > {HARD}; split it along a real seam", file=sys.stderr)
    return 1 if over and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
