"""Captures kept on disk between runs: the same model and setup is captured once per version of gpuwise and torch.

A capture is device independent and deterministic: the same code, torch and model give the same recording. So
``plan``, ``recommend`` and ``train --auto`` keep each one (about 0.1 MB) in ``$XDG_CACHE_HOME/gpuwise/captures``
(else ``~/.cache/gpuwise/captures``) and read it back the next time: ``gpuwise recommend --model llama2-7b`` runs
18 captures the first time and none after. The key is everything the recording depends on: the bytes of
gpuwise's own source files, torch's (and for a config.json, transformers') version, the model and the setup.
Your own ``file.py:function`` models are never kept: what they import can change without the file changing.

``GPUWISE_CACHE=off`` turns the cache off. A file that cannot be read is captured again; one that cannot be
written is skipped: the cache never fails a command.

The format cannot run code: a NumPy ``.npz`` (read with ``allow_pickle=False``) holding the arrays and, as bytes,
a JSON description of the rest (plain values, tuples, dicts, and the capture's own dataclasses, named from a fixed
list) with a SHA-256 of the whole. A file planted in the folder can at worst be refused and captured again; an entry
whose checksum does not match is dropped the same way. Older pickled entries (``*.pkl``) are never read and are
removed when the folder is trimmed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

MAX_FILES = 1000  # about 100 MB at most; the least recently used go first
FOLDER = "captures"
SUFFIX = ".npz"
FORMAT = 1  # the layout of an entry below; another version is captured again


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


def _classes() -> dict[str, type]:
    """The dataclasses an entry may name: the capture and what it holds. Nothing else is ever constructed."""
    from gpuwise.planning.capture.step import Capture
    from gpuwise.planning.capture.tracker import OpCosts, OpRows, Storages

    return {c.__name__: c for c in (Capture, OpCosts, OpRows, Storages)}


def _encode(x, arrays: dict[str, np.ndarray]):
    """``x`` as JSON values, its arrays put aside in ``arrays``."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, (int, float)) and not isinstance(x, np.generic):
        return {"f": repr(x)} if isinstance(x, float) and not math.isfinite(x) else x
    if isinstance(x, (np.ndarray, np.generic)):
        name = f"a{len(arrays)}"
        arrays[name] = np.asarray(x)
        return {"array": name, "scalar": isinstance(x, np.generic)}
    if isinstance(x, tuple):
        return {"tuple": [_encode(v, arrays) for v in x]}
    if isinstance(x, list):
        return [_encode(v, arrays) for v in x]
    if isinstance(x, dict):
        return {"dict": [[_encode(k, arrays), _encode(v, arrays)] for k, v in x.items()]}
    if dataclasses.is_dataclass(x) and type(x).__name__ in _classes():
        return {"dataclass": type(x).__name__,
                "fields": {f.name: _encode(getattr(x, f.name), arrays) for f in dataclasses.fields(x) if f.init}}
    raise TypeError(f"a {type(x).__name__} cannot be kept in the capture cache")


def _decode(x, arrays):
    if x is None or isinstance(x, (bool, str, int, float)):
        return x
    if isinstance(x, list):
        return [_decode(v, arrays) for v in x]
    if "f" in x:
        return float(x["f"])
    if "array" in x:
        a = arrays[x["array"]]
        return a[()] if x["scalar"] else a
    if "tuple" in x:
        return tuple(_decode(v, arrays) for v in x["tuple"])
    if "dict" in x:
        return {_decode(k, arrays): _decode(v, arrays) for k, v in x["dict"]}
    cls = _classes()[x["dataclass"]]  # a KeyError for any other name: the entry is refused
    return cls(**{k: _decode(v, arrays) for k, v in x["fields"].items()})


def _digest(meta: bytes, arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256(meta)
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name} {a.dtype.str} {a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def dumps(value) -> bytes:
    """``value`` as an entry's bytes (an .npz): a JSON description, its arrays, and their SHA-256."""
    arrays: dict[str, np.ndarray] = {}
    meta = json.dumps({"format": FORMAT, "value": _encode(value, arrays)}, separators=(",", ":")).encode()
    buf = io.BytesIO()
    np.savez(buf, __meta__=np.frombuffer(meta, dtype=np.uint8),
             __sha256__=np.frombuffer(_digest(meta, arrays).encode(), dtype=np.uint8), **arrays)
    return buf.getvalue()


def loads(data: bytes):
    """An entry's value back; ValueError for anything that is not one this version wrote, intact."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            files = {k: z[k] for k in z.files}
        meta = files.pop("__meta__").tobytes()
        digest = files.pop("__sha256__").tobytes().decode()
        if digest != _digest(meta, files):
            raise ValueError("checksum mismatch")
        doc = json.loads(meta)
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')}")
        return _decode(doc["value"], files)
    except ValueError:
        raise
    except Exception as exc:  # a damaged zip, a missing key, a name not on the list, a field it lacks
        raise ValueError(f"not a capture entry: {type(exc).__name__}: {exc}") from None


def load(name: str | None, where: Path | None = None):
    """The capture kept under ``name`` in ``where`` (default: ``folder()``), or None (not kept, unreadable, damaged,
    or not one this version wrote: it is removed, to be captured again)."""
    where = folder() if where is None else where
    if name is None or where is None:
        return None
    path = where / f"{name}{SUFFIX}"
    try:
        hit = loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # damaged, planted or foreign: capture again, and drop it
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
        data = dumps(capture)
        where.mkdir(parents=True, exist_ok=True)
        with atomic_path(where / f"{name}{SUFFIX}") as tmp:
            tmp.write_bytes(data)
        _trim(where)
    except (OSError, GpuwiseError, TypeError):
        pass


def _trim(where: Path) -> None:
    for old in where.glob("*.pkl"):  # entries an older gpuwise pickled: never read, so never kept
        with contextlib.suppress(OSError):
            old.unlink()
    files = list(where.glob(f"*{SUFFIX}"))
    if len(files) <= MAX_FILES:
        return
    files.sort(key=lambda p: p.stat().st_mtime)
    for path in files[: len(files) - MAX_FILES]:
        with contextlib.suppress(OSError):
            path.unlink()
