"""Module sizes of src/kvtier: a prompt for review, never a reason to split one concept across
files (docs/architecture.md §CI).

Without flags: every module's line count, marking those past 300 (~) and 400 (!) lines.
With --check: only the marked modules, and exit 1 if one passes the hard ceiling of 1000 lines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SOFT, REVIEW, CEILING = 300, 400, 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"print only modules past {SOFT} lines; exit 1 if one passes {CEILING}",
    )
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent / "src" / "kvtier"
    sizes = sorted(
        ((sum(1 for _ in p.open()), p.relative_to(root.parent)) for p in root.rglob("*.py")),
        reverse=True,
    )
    for n, p in sizes:
        mark = " !" if n > REVIEW else (" ~" if n > SOFT else "")
        if mark or not args.check:
            print(f"{n:5d}  {p}{mark}")
    if not args.check:
        print(f"{sum(n for n, _ in sizes):5d}  total in {len(sizes)} modules")
    over = [(n, p) for n, p in sizes if n > CEILING]
    for n, p in over:
        print(f"{p}: {n} lines > {CEILING}: is this more than one concept?", file=sys.stderr)
    return 1 if over and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
