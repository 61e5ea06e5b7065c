"""The map of the code in README.md (section Development) is the tree: every package and module under src/gpuwise with
the first sentence of its docstring, as ``python scripts/code_map.py`` writes it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("code_map", ROOT / "scripts" / "code_map.py")
code_map = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(code_map)


def test_the_readmes_map_is_the_tree():
    shown, now = code_map.section(code_map.README.read_text()), code_map.render()
    assert shown is not None, f"README.md lost its map markers ({code_map.START} ... {code_map.END})"
    missing, stale = sorted(code_map.names(now) - code_map.names(shown)), sorted(code_map.names(shown) -
                                                                                   code_map.names(now))
    assert shown == now, (f"README.md's map of the code is not the tree (python scripts/code_map.py rewrites it): "
                          f"missing {missing}, no longer in the tree {stale}, or a docstring's first sentence changed")


def test_the_map_names_every_package_and_module(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "not_a_package").mkdir()
    (root / "__init__.py").write_text('"""The package. More about it."""\n')
    (root / "a.py").write_text('"""First sentence, as in Dettmers et al. 2023, e.g. this.\n\nSecond paragraph."""\n')
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "b.py").write_text("x = 1\n")
    (root / "sub" / "deeper" / "__init__.py").write_text('"""Deeper."""\n')
    (root / "not_a_package" / "c.py").write_text('"""Not shown."""\n')
    (root / "data.toml").write_text("")
    block = code_map.render(root)
    w = code_map.NAME_WIDTH
    assert block.splitlines() == [
        "```",
        "src/pkg/".ljust(w) + "The package.",
        "  a.py".ljust(w) + "First sentence, as in Dettmers et al. 2023, e.g. this.",
        "  sub/",
        "    b.py",
        "    deeper/".ljust(w) + "Deeper.",
        "```",
    ]
    assert code_map.names(block) == {"a.py", "sub/", "sub/b.py", "sub/deeper/"}
