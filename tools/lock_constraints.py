"""Write constraints.txt: the exact versions installed here of every package kvtier and its extras
need, their requirements followed through the installed metadata (a `pip freeze` of that closure).

Run after upgrading a dependency and passing the tests: `python3 tools/lock_constraints.py`.
tools/setup.sh (and so CI) installs with `-c constraints.txt`; pyproject.toml keeps ranges.
"""

from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
HEADER = """\
# The versions kvtier is tested with: tools/setup.sh and CI install with `-c constraints.txt`.
# pyproject.toml declares compatible ranges; regenerate this file with tools/lock_constraints.py.
# torch is the CPU build (local version 2.13.0+cpu, matched by ==2.13.0).
"""


def closure(requirements: list[Requirement]) -> dict[str, str]:
    """Name → installed version of `requirements` and everything they need, markers evaluated."""
    pins: dict[str, str] = {}
    todo = [(r, frozenset(r.extras)) for r in requirements]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if name == "kvtier" or (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            sys.exit(f"{req.name} is not installed: run tools/setup.sh first")
        pins[name] = dist.version.split("+")[0]
        for text in dist.requires or []:
            sub = Requirement(text)
            env = [{"extra": e} for e in extras] or [{"extra": ""}]
            if sub.marker is None or any(sub.marker.evaluate(e) for e in env):
                todo.append((sub, frozenset(sub.extras)))
    return pins


def main() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    texts = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        texts += [t for t in extra if not t.startswith("kvtier[")]
    pins = closure([Requirement(t) for t in texts])
    lines = [f"{name}=={version}" for name, version in sorted(pins.items())]
    (ROOT / "constraints.txt").write_text(HEADER + "\n".join(lines) + "\n")
    print(f"constraints.txt: {len(lines)} packages")


if __name__ == "__main__":
    main()
