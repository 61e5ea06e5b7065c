"""Writing files safely: a temporary file in the same folder, then an atomic rename."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gpuwise.errors import GpuwiseError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; it replaces ``path`` only if the block finishes."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise GpuwiseError(f"cannot write {target}: folder {folder} does not exist", f"create it: mkdir -p {folder}")
    if target.is_dir():
        raise GpuwiseError(f"cannot write {target}: it is a folder", f"pass a file name, e.g. {target / 'plot.png'}")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=target.suffix or ".tmp", dir=folder)
    except OSError as exc:
        raise GpuwiseError(f"cannot write {target}: {exc.strerror}", "pick a folder you can write to") from exc
    os.close(fd)
    try:
        yield Path(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the permissions open() would
        os.replace(tmp, target)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise GpuwiseError(f"cannot write {target}: {exc.strerror or exc}", "pick a path you can write to") from exc
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def open_log(path: str | os.PathLike):
    """A JSON-lines log opened for appending (one line per log step, flushed as it goes)."""
    target = Path(path)
    if target.is_dir():
        raise GpuwiseError(f"cannot write the log {target}: it is a folder",
                           f"pass a file, e.g. {target / 'run.jsonl'}")
    try:
        return target.open("a")
    except OSError as exc:
        raise GpuwiseError(f"cannot write the log {target}: {exc.strerror}", "pick a path you can write to") from exc
