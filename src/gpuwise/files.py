"""Files the user names and files we write: ``file.py:function`` checked before torch loads (a config path or Hub
id: planning/sources/hub.py ``model_files``);
writing safely (a temporary file in the same folder, then an atomic rename)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from gpuwise.errors import GpuwiseError


def file_function(spec: str, flag: str) -> tuple[Path, str]:
    """``--model``/``--data`` as ``path/to/file.py:function``: the file (it must exist) and the function's name."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise GpuwiseError(f"{flag} {spec!r} names a file but no function" if spec.endswith(".py") else
                           f"{flag} {spec!r} is not file.py:function", f"pass {flag} path/to/file.py:function")
    if not Path(path).is_file():
        raise GpuwiseError(f"no such file: {path}" if not Path(path).exists() else f"{path} is a folder",
                           f"pass {flag} path/to/file.py:function")
    return Path(path), name


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


class LogFile:
    """A JSON-lines log (``--log``), one line per log step, flushed as it goes. A write that fails (a full disk)
    is reported once through ``warn`` and stops the log, not the run.

    >>> # log = LogFile("run.jsonl", warn=print); log.write('{"step": 1}'); log.close()
    """

    def __init__(self, path: str | os.PathLike, *, warn: Callable[[str], None]) -> None:
        self.path, self.warn = Path(path), warn
        self.file = open_log(self.path)

    def write(self, line: str) -> None:
        if self.file is None:
            return
        try:
            self.file.write(line + "\n")
            self.file.flush()
        except OSError as exc:
            self.warn(f"warning: cannot write the log {self.path}: {exc.strerror or exc}; training goes on "
                      "without it (the checkpoints are unaffected)")
            self.close()

    def resumed(self, step: int) -> None:
        """A resumed run: one line saying so is appended, and the steps after ``step`` follow again. The log is only
        ever appended to (it may be shared with another run, or hold the user's own notes); a reader that wants one
        series takes, for each step, the entry after the last ``resume`` line at or before it."""
        self.write(json.dumps({"event": "resume", "step": step,
                               "note": f"resumed from the checkpoint of step {step}: the steps after it follow again"}))

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None
