"""A benchmark or script of the repository loaded as a module, for the tests that run its cases."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path) -> ModuleType:
    """``path`` (benchmarks/watch_truth.py) imported under its file name, registered in ``sys.modules`` (dataclasses
    look their module up by name)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
