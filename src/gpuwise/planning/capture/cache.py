"""Captures kept on disk between runs: the same model and setup is captured once per version of gpuwise and torch.

A capture is device independent and deterministic: the same code, torch and model give the same recording. So
``plan``, ``recommend`` and ``train --auto`` keep each one (about 0.1 MB) in ``$XDG_CACHE_HOME/gpuwise/captures``
(else ``~/.cache/gpuwise/captures``) and read it back the next time: ``gpuwise recommend --model llama2-7b`` runs
16 captures the first time and none after. The key is everything the recording depends on: the bytes of
gpuwise's own source files, torch's (and for a config.json, transformers') version, the model and the setup.
Your own ``file.py:function`` models are never kept: what they import can change without the file changing.

``GPUWISE_CACHE=off`` turns the cache off. A file that cannot be read is captured again; one that cannot be
written is skipped: the cache never fails a command.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pickle
import sys
from pathlib import Path

MAX_FILES = 1000  # about 100 MB at most; the least recently used go first
FOLDER = "captures"


@functools.cache
def _code_fingerprint() -> str:
    """A hash of every Python file of the installed gpuwise, and the versions a recording depends on."""
    import torch

    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256(f"{sys.version_info[:2]} torch {torch.__version__}".encode())
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def source_key(source) -> str | None:
    """What identifies ``source``'s model beyond gpuwise's own code; None for a user's file (never kept)."""
    from gpuwise.planning.sources.hf import HFSource
    from gpuwise.planning.sources.zoo import ZooSource

    if isinstance(source, ZooSource):
        return f"zoo {source.zoo.name}"  # zoo models are defined in gpuwise's source files, already hashed
    if isinstance(source, HFSource):
        try:
            import transformers

            version = transformers.__version__
        except ImportError:
            version = None
        return f"hf {version} {json.dumps(source.config, sort_keys=True)}"
    return None


def folder(environ=os.environ) -> Path | None:
    """Where captures are kept; None when ``GPUWISE_CACHE=off``."""
    if environ.get("GPUWISE_CACHE", "").lower() in ("off", "0", "no", "false"):
        return None
    from gpuwise.hardware.calibration import cache_dir

    return cache_dir(environ) / FOLDER


def key(source, setup, batch: int, n_layer: int | None) -> str | None:
    what = source_key(source)
    if what is None:
        return None
    text = f"{_code_fingerprint()}\n{what}\n{setup!r}\n{batch}\n{n_layer}"
    return hashlib.sha256(text.encode()).hexdigest()


def load(name: str | None, where: Path | None = None):
    """The capture kept under ``name`` in ``where`` (default: ``folder()``), or None (not kept, unreadable, or from
    an incompatible pickle)."""
    where = folder() if where is None else where
    if name is None or where is None:
        return None
    path = where / f"{name}.pkl"
    try:
        with path.open("rb") as f:
            hit = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception:  # a damaged or foreign file (any unpickling error): capture again, and drop it
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # the least recently used go first
    return hit


def store(name: str | None, capture, where: Path | None = None) -> None:
    """Keep ``capture`` under ``name`` in ``where`` (default: ``folder()``), written atomically; any failure to write
    is ignored."""
    where = folder() if where is None else where
    if name is None or where is None:
        return
    from gpuwise.errors import GpuwiseError
    from gpuwise.files import atomic_path

    try:
        where.mkdir(parents=True, exist_ok=True)
        with atomic_path(where / f"{name}.pkl") as tmp:
            tmp.write_bytes(pickle.dumps(capture, protocol=pickle.HIGHEST_PROTOCOL))
        _trim(where)
    except (OSError, GpuwiseError):
        pass


def _trim(where: Path) -> None:
    files = list(where.glob("*.pkl"))
    if len(files) <= MAX_FILES:
        return
    files.sort(key=lambda p: p.stat().st_mtime)
    for path in files[: len(files) - MAX_FILES]:
        with contextlib.suppress(OSError):
            path.unlink()
