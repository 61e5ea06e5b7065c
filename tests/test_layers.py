"""The shape of the tree: imports run one way, and each decision is made in exactly one place.

Imports are read from the source (every ``import gpuwise...``, at module level or inside a function), so a
lazy import that runs back up is caught as well as a top-level one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "gpuwise"

# Lowest first. A unit may import its own layer and the layers below, never one above. Units in one layer
# do not import each other unless listed in PEERS.
LAYERS = (
    {"errors"},
    {"units", "files", "stack"},
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


def test_no_module_level_import_cycle():
    graph = {m: {t for t in _top_level_imports(tree) if t in MODULES and t != m} for m, (_, tree) in MODULES.items()}
    seen, stack, cycles = set(), [], []

    def visit(node):
        if node in stack:
            cycles.append([*stack[stack.index(node):], node])
            return
        if node in seen:
            return
        seen.add(node)
        stack.append(node)
        for nxt in graph[node]:
            visit(nxt)
        stack.pop()

    for m in graph:
        visit(m)
    assert not cycles, cycles[:3]


def _top_level_imports(tree: ast.Module) -> set[str]:
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("gpuwise"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # "from gpuwise.x import y" may load x.y
    return found


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
