"""The shape of the tree: imports run one way, and each decision is made in exactly one place.

Imports are read from the source (every ``import gpuwise...``, at module level, inside a function or under
``if TYPE_CHECKING:``), so a lazy import that runs back up is caught as well as a top-level one, and no two
modules import each other by any path.
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "gpuwise"

# Lowest first. A unit may import its own layer and the layers below, never one above. Units in one layer
# do not import each other unless listed in PEERS.
LAYERS = (
    {"errors"},
    {"units", "files", "stack", "nvml"},
    {"compat", "precision", "environment"},
    {"hardware"},
    {"doctor", "ops", "optim"},
    {"models"},
    {"planning"},
    {"monitor"},
    {"bench", "training", "recommend"},
    {"render", "plot"},
    {"cli", "__init__"},
    {"__main__"},
)
PEERS = {("cli", "__init__")}  # the CLI reads gpuwise.__version__; gpuwise/__init__ re-exports lazily
LIBRARY_FREE_OF = ("rich", "typer")  # the library never prints: only render, plot and cli import these
UI = {"render", "plot", "cli", "__main__"}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = (path, ast.parse(path.read_text()))
    return out


MODULES = _modules()


def _imports(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def _layer(unit: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in MODULES}
    assert units <= set().union(*LAYERS), units - set().union(*LAYERS)


def test_imports_run_one_way():
    wrong = []
    for module, (_, tree) in MODULES.items():
        a = _unit(module)
        for target in _imports(tree):
            if not target.startswith("gpuwise"):
                continue
            b = _unit(target)
            if a == b or (a, b) in PEERS:
                continue
            if _layer(b) >= _layer(a):
                wrong.append(f"{module} imports {target}")
    assert not wrong, wrong


def test_training_does_not_import_bench():
    offenders = [m for m, (_, tree) in MODULES.items() if _unit(m) == "training"
                 and any(t.startswith("gpuwise.bench") for t in _imports(tree))]
    assert not offenders


def test_the_library_never_imports_its_ui():
    offenders = [m for m, (_, tree) in MODULES.items() if _unit(m) not in UI
                 and any(t.split(".")[0] in LIBRARY_FREE_OF for t in _imports(tree))]
    assert not offenders


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The gpuwise modules one import statement loads: ``import gpuwise.a.b`` and ``from gpuwise.a.b import name``
    load gpuwise.a.b; ``from gpuwise.a import b`` loads gpuwise.a, and gpuwise.a.b as well when b is a submodule."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
        return {_known(n) for n in names if n.split(".")[0] == "gpuwise"} - {None}
    if node.level:  # relative: resolved against the importing module's package
        package = module if MODULES[module][0].name == "__init__.py" else module.rpartition(".")[0]
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
        origin = f"{base}.{node.module}" if node.module else base
    else:
        origin = node.module or ""
    if origin.split(".")[0] != "gpuwise":
        return set()
    found = {_known(origin)} | {f"{origin}.{a.name}" for a in node.names if f"{origin}.{a.name}" in MODULES}
    return found - {None}


def _known(name: str) -> str | None:
    """The longest prefix of ``name`` that is a module of the tree (a name past it is an attribute)."""
    parts = name.split(".")
    return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in MODULES), None)


def _import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: first line}, counting every import: module level, inside functions and classes,
    and under ``if TYPE_CHECKING:``."""
    graph = {}
    for module, (_, tree) in MODULES.items():
        edges = graph[module] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, node) - {module}:
                    edges.setdefault(target, node.lineno)
    return graph


def _groups(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """The groups of modules that import each other by some path (strongly connected, Tarjan), largest first."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def connect(v):  # recursion depth is bounded by the number of modules (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(groups, key=lambda g: (-len(g), min(g)))


def _shortest_cycle(graph: dict[str, dict[str, int]], group: set[str]) -> list[str]:
    """The shortest way from the group's first module back to itself, as [a, b, ..., a] (breadth first)."""
    start = min(group)
    paths, queue = {start: [start]}, [start]
    for v in queue:
        for w in sorted(graph[v]):
            if w == start:
                return [*paths[v], start]
            if w in group and w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    raise AssertionError(f"no cycle through {start}")


def test_no_import_cycle_of_any_kind():
    graph = _import_graph()
    report = []
    for group in _groups(graph):
        cycle = _shortest_cycle(graph, group)
        path = " -> ".join(f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)) + f" -> {cycle[0]}"
        report.append(f"{len(group)} modules import each other ({', '.join(sorted(group))}), e.g. {path}")
    assert not report, "import cycles (every import counts, lazy and TYPE_CHECKING too):\n" + "\n".join(report)


def test_the_cycle_check_sees_lazy_and_type_checking_imports():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gpuwise.units import GiB\n"
                     "def f():\n    import gpuwise.errors\n    from gpuwise.hardware import catalog\n")
    found = set().union(*(_targets("gpuwise.doctor", n) for n in ast.walk(tree)
                          if isinstance(n, (ast.Import, ast.ImportFrom))))
    assert found == {"gpuwise.units", "gpuwise.errors", "gpuwise.hardware", "gpuwise.hardware.catalog"}
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "b": 5, "d": 4}, "d": {}}
    assert _groups(graph) == [{"a", "b", "c"}] and _shortest_cycle(graph, {"a", "b", "c"}) == ["a", "b", "c", "a"]


MAX_LINES = 600


def test_no_module_is_over_600_lines():
    long = {str(path.relative_to(SRC)): n for path, _ in sorted(MODULES.values())
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


# Each decision, the one file that makes it, and a pattern that would be that decision made again elsewhere.
DECISIONS = [
    ("precision -> dtypes, rate key, scaler", "precision.py", r"""["'](bf16-mixed|fp16-mixed)["']\s*:"""),
    ("precision -> dtypes, rate key, scaler", "precision.py", r"allow_tf32\s*="),
    ("default precision / bf16 support", "hardware/detect.py", r"is_bf16_supported|compute_capability\s*<\s*\(8"),
    ("device -> catalog row", "hardware/detect.py", r"\.match_device\("),
    ("default device", "hardware/device.py", r"""["']cuda["']\s+if\s+torch\.cuda\.is_available\(\)"""),
    ("first line of an exception", "errors.py", r"str\((exc|e|error)\)[^\n]*splitlines"),
    ("private torch API", "compat.py",
     r"torch\._subclasses|torch\.utils\._|torch\._scaled_mm|distributed\._composable"),
    ("the largest micro-batch that divides the batch", "planning/setup.py", r"range\(.*,\s*0,\s*-1\)"),
    ("which modules are routed experts", "planning/experts.py",
     r"""endswith\(["']Experts["']\)|==\s*["']experts["']"""),
    ("a catalog row has bf16 / fp8", "hardware/catalog.py",
     r"""(bool\(|not\s+)[\w.]*peak_tflops\.get\(["'](bf16|fp8)["']\)"""),
    ("DataLoader workers", "environment.py", r"usable_cores\s*//|cores\s*//\s*4"),
]


@pytest.mark.parametrize(("what", "home", "pattern"), DECISIONS, ids=[f"{d[0]}: {d[2][:20]}" for d in DECISIONS])
def test_each_decision_is_made_in_one_place(what, home, pattern):
    elsewhere = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel == home or (rel == "hardware/catalog.py" and "match_device" in pattern):  # where it is defined
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(pattern, line) and not line.lstrip().startswith("#"):
                elsewhere.append(f"{rel}:{i}: {line.strip()}")
    assert not elsewhere, f"{what} is decided in {home} only, but also in:\n" + "\n".join(elsewhere)
