"""Import direction between layers and no import cycles (docs/architecture.md §Layers).

The layer order is read from the table of §Layers: a module may import modules of its own layer or
of a lower one. Every import in src/kvtier counts: at module level, inside functions, under
`if TYPE_CHECKING:` (a type-only import is still a dependency; an upward one means the lower layer
lacks a protocol), and `importlib.import_module("kvtier…")` with a literal name. Importing an
ancestor package is no edge: Python runs it anyway before any of its modules. The root package
re-exports the engine lazily, so `from kvtier import LLM` counts as importing `kvtier.engine`
(only `__version__` is the root's own).
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "kvtier"
DOC = ROOT / "docs" / "architecture.md"
TOP = "kvtier"


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module
    line: int
    type_only: bool  # under `if TYPE_CHECKING:`


def module_paths(package: Path) -> dict[str, Path]:
    """Dotted module name → file, for every .py file under `package` (a package is its __init__)."""
    out: dict[str, Path] = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts).removesuffix(".__init__")
        out[name] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def _from_prefix(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute name `from X import …` in `module` (at `path`) reads from."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, path: Path, node: ast.AST, modules: dict[str, Path]) -> list[str]:
    top = module.split(".")[0]
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names if a.name != top]
    elif isinstance(node, ast.ImportFrom):
        prefix = _from_prefix(module, path, node)
        for alias in node.names:
            if prefix == top and alias.name == "__version__":
                continue
            if prefix == top and f"{top}.{alias.name}" not in modules:
                names.append(f"{top}.engine")  # a lazy re-export of the root package
            elif f"{prefix}.{alias.name}" in modules:
                names.append(f"{prefix}.{alias.name}")
            else:
                names.append(prefix)
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        names = [node.args[0].value]
    return [n for n in names if n in modules]


def collect_imports(package: Path) -> tuple[dict[str, Path], list[Import]]:
    """Every import edge between modules of `package`, ancestor packages left out."""
    modules = module_paths(package)
    edges: dict[Import, None] = {}  # ordered, one edge per (source, target, line)
    for module, path in sorted(modules.items()):
        tree = ast.parse(path.read_text(), str(path))
        type_only = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            for target in _targets(module, path, node, modules):
                if target == module or module.startswith(target + "."):
                    continue
                line = getattr(node, "lineno", 0)
                edges[Import(module, target, line, id(node) in type_only)] = None
    return modules, list(edges)


def layer_order(markdown: str) -> dict[str, int]:
    """Top-level module or package name → layer, from the table of the §Layers section."""
    section = markdown.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    layers: dict[str, int] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            for name in re.findall(r"`([a-z_]+)`", cells[1]):
                layers[name] = int(cells[0])
    return layers


def layer_name(module: str) -> str | None:
    """`kvtier.kv.block` → "kv"; the root package has no layer (None)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def upward_imports(edges: list[Import], layers: dict[str, int], root: Path) -> list[str]:
    found: list[str] = []
    for e in edges:
        a, b = layer_name(e.source), layer_name(e.target)
        if a is None or b is None or a == b:
            continue
        if layers[b] > layers[a]:
            where = module_file(e.source, root)
            kind = " (TYPE_CHECKING)" if e.type_only else ""
            found.append(
                f"{where}:{e.line}: {e.source} (layer {layers[a]} {a}) imports {e.target} "
                f"(layer {layers[b]} {b}){kind}"
            )
    return found


def module_file(module: str, root: Path) -> str:
    return str(module_paths(root)[module].relative_to(root.parent.parent))


def import_cycles(modules: dict[str, Path], edges: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _describe(cycle: list[str], edges: list[Import]) -> str:
    members = set(cycle)
    inner = [
        f"{e.source} -> {e.target} (line {e.line}{', TYPE_CHECKING' if e.type_only else ''})"
        for e in edges
        if e.source in members and e.target in members
    ]
    return " <-> ".join(cycle) + "\n    " + "\n    ".join(inner)


OUTSIDE = ("benchmarks", "tests")  # the lab and the tests: beside the package, never in it


def imports_of_outside(package: Path, outside: tuple[str, ...] = OUTSIDE) -> list[str]:
    """Every import in `package` of a top-level package in `outside` (module level, in
    functions, type-only, or `importlib.import_module` with a literal name): the wheel does not
    carry them (docs/architecture.md §Shipping)."""
    found: list[str] = []
    for module, path in sorted(module_paths(package).items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names = [node.args[0].value]
            for name in names:
                if name.split(".")[0] in outside:
                    found.append(
                        f"{module_file(module, package)}:{node.lineno}: {module} imports {name}"
                    )
    return found


def names_only_upper_layers_use(
    package: Path, owner: str, layers: dict[str, int], ceiling: int
) -> list[str]:
    """Public top-level names of module `owner` that `owner` itself never uses and that no module
    of a layer at or below `ceiling` imports: settings that belong to the upper layer using them.
    Only `from owner import NAME` counts as a use outside `owner`."""
    modules = module_paths(package)
    tree = ast.parse(modules[owner].read_text())
    defined: dict[str, int] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef | ast.ClassDef):
            defined[stmt.name] = stmt.lineno
        elif isinstance(stmt, ast.Assign | ast.AnnAssign):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            defined.update((t.id, stmt.lineno) for t in targets if isinstance(t, ast.Name))
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    for module, path in modules.items():
        layer = layer_name(module)
        if layer is None or layers[layer] > ceiling:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and _from_prefix(module, path, node) == owner:
                used.update(alias.name for alias in node.names)
    where = module_file(owner, package)
    return [
        f"{where}:{line}: {name}"
        for name, line in sorted(defined.items(), key=lambda item: item[1])
        if not name.startswith("_") and name not in used
    ]


MODULES, EDGES = collect_imports(PACKAGE)
LAYERS = layer_order(DOC.read_text())


def test_the_layer_table_orders_every_package() -> None:
    assert LAYERS["config"] == 0 and LAYERS["cli"] == max(LAYERS.values())
    assert list(dict.fromkeys(sorted(LAYERS, key=LAYERS.__getitem__))) == [
        "config",
        "cli_args",
        "checks",
        "ids",
        "sampling",
        "cpus",
        "kv",
        "stores",
        "sched",
        "offload",
        "device",
        "kernels",
        "model",
        "runner",
        "engine",
        "server",
        "bench",
        "cli",
    ]
    unplaced = sorted({n for m in MODULES if (n := layer_name(m)) is not None} - set(LAYERS))
    assert not unplaced, f"add these to the table of architecture.md §Layers: {unplaced}"


def test_no_module_imports_a_higher_layer() -> None:
    found = upward_imports(EDGES, LAYERS, PACKAGE)
    assert not found, "upward imports (architecture.md §Layers):\n" + "\n".join(found)


def test_no_import_cycles() -> None:
    cycles = import_cycles(MODULES, EDGES)
    assert not cycles, "import cycles:\n" + "\n".join(_describe(c, EDGES) for c in cycles)


def test_the_package_never_imports_the_lab_or_the_tests() -> None:
    found = imports_of_outside(PACKAGE)
    assert not found, "the wheel carries neither benchmarks/ nor tests/:\n" + "\n".join(found)


def test_config_holds_only_what_the_engine_uses() -> None:
    """`kvtier.config` is the engine's settings: what only the server, a benchmark or the CLI uses
    lives in that layer (the server's flags in `server/config.py`)."""
    found = names_only_upper_layers_use(PACKAGE, "kvtier.config", LAYERS, LAYERS["engine"])
    assert not found, "used only above the engine; move to that layer:\n" + "\n".join(found)


def reachable(edges: list[Import], starts: set[str]) -> set[str]:
    """Every module `starts` import, directly or through others (every kind of edge)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
    seen: set[str] = set()
    todo = list(starts)
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_engine_side_of_the_server_loads_no_request_body() -> None:
    """The engine thread and process raise `APIError` (`server/errors.py`) but parse no body:
    the pydantic models of `server/protocol.py` stay on the handlers' side."""
    engine_side = {f"kvtier.server.{m}" for m in ("events", "engine_loop", "engine_process")}
    assert "kvtier.server.protocol" not in reachable(EDGES, engine_side)
    assert "kvtier.server.errors" in reachable(EDGES, engine_side)


def test_type_checking_and_function_level_imports_are_edges() -> None:
    edges = {(e.source, e.target): e for e in EDGES}
    assert edges[("kvtier.sched.scheduler", "kvtier.config")].type_only
    assert not edges[("kvtier.runner.runner", "kvtier.sched.output")].type_only
    assert ("kvtier.cli", "kvtier.server.cli") in edges  # importlib.import_module("kvtier…")
    assert ("kvtier.bench.garble", "kvtier.engine.params") in edges  # inside a function


def test_the_checks_find_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "src" / TOP
    files = {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from kvtier.high.c import C\n"
            "from . import b\n"
        ),
        "low/b.py": "def f():\n    from kvtier.low import a\n",
        "high/__init__.py": "",
        "low/d.py": "",
        "high/c.py": "import importlib\nimportlib.import_module('kvtier.low.d')\nC = 1\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    modules, edges = collect_imports(pkg)
    found = upward_imports(edges, {"low": 0, "high": 1}, pkg)
    assert found == [
        "src/kvtier/low/a.py:3: kvtier.low.a (layer 0 low) imports kvtier.high.c (layer 1 high)"
        " (TYPE_CHECKING)"
    ]
    assert import_cycles(modules, edges) == [["kvtier.low.a", "kvtier.low.b"]]
    assert ("kvtier.high.c", "kvtier.low.d") in {(e.source, e.target) for e in edges}


def test_the_check_finds_the_package_importing_the_lab(tmp_path: Path) -> None:
    pkg = tmp_path / "src" / TOP
    files = {
        "__init__.py": "",
        "bench/__init__.py": "",
        "bench/a.py": "def f():\n    from benchmarks.compare import run\n",
        "bench/b.py": "import importlib\nimportlib.import_module('tests.sched.oracle')\n",
        "bench/c.py": "import benchmarks_of_our_own\nfrom . import a\nimport json\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    assert imports_of_outside(pkg) == [
        "src/kvtier/bench/a.py:2: kvtier.bench.a imports benchmarks.compare",
        "src/kvtier/bench/b.py:2: kvtier.bench.b imports tests.sched.oracle",
    ]


def test_the_check_finds_a_setting_only_an_upper_layer_uses(tmp_path: Path) -> None:
    pkg = tmp_path / "src" / TOP
    files = {
        "__init__.py": "",
        "config.py": (
            "LOW = 1\nOWN = 2\nUSED = OWN\n\n\ndef server_only():\n    pass\n\n\n"
            "class UpperOnly:\n    pass\n\n\n_PRIVATE = 3\n"
        ),
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from kvtier.config import LOW\n",
        "high/__init__.py": "",
        "high/b.py": "from kvtier.config import LOW, UpperOnly, server_only\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    layers = {"config": 0, "low": 1, "high": 2}
    assert names_only_upper_layers_use(pkg, "kvtier.config", layers, ceiling=1) == [
        "src/kvtier/config.py:3: USED",
        "src/kvtier/config.py:6: server_only",
        "src/kvtier/config.py:10: UpperOnly",
    ]


def test_layer_order_reads_the_table_rows_only() -> None:
    markdown = (
        "# T\n## Layers — x\n| layer | modules |\n|---|---|\n| 0 | `config`, `cli_args` |\n"
        "| 1 | `kv` | owns `sched` |\ntext `model`\n## Walks\n| 2 | `runner` |\n"
    )
    assert layer_order(markdown) == {"config": 0, "cli_args": 0, "kv": 1}


if __name__ == "__main__":  # a report for humans: python3 tests/test_layers.py
    for line in upward_imports(EDGES, LAYERS, PACKAGE):
        print(line)
    for cycle in import_cycles(MODULES, EDGES):
        print("cycle:", _describe(cycle, EDGES))
    sys.exit(0)
