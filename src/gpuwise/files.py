"""Files the user names and files we write: ``file.py:function`` checked before torch loads (a config path or Hub
id: planning/sources/hub.py ``model_files``);
JSON the user hands us read without Python's recursion limit in the way (``load_json``);
writing safely (a temporary file in the same folder, then an atomic rename)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpuwise.errors import GpuwiseError

# A device that refuses a write (`> /dev/full`, a full disk, a quota, `ulimit -f`): the user's environment, exit 2
DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)

# A published config.json nests 3 or 4 levels (text_config.rope_scaling), a safetensors header 3, our own files
# (calibrations, bench runs, checkpoints' manifests) 4: far deeper is no such file, and Python reads it only as deep
# as its recursion limit (a 100,000-deep array: RecursionError)
MAX_JSON_DEPTH = 100


class TooDeep(ValueError):
    """JSON nested past ``MAX_JSON_DEPTH`` levels: no file gpuwise reads is, and deeper still Python cannot parse."""


def load_json(text: str | bytes) -> Any:
    """``json.loads`` for a file the user hands us: JSON nested past ``MAX_JSON_DEPTH`` levels raises ``TooDeep`` (a
    ValueError, as ``json.JSONDecodeError`` is), not the parser's ``RecursionError`` at Python's limit, nor a later
    one where the value is copied or hashed (``copy.deepcopy`` of a 900-deep config.json).

    >>> load_json("[" * 100_000 + "]" * 100_000)
    Traceback (most recent call last):
    gpuwise.files.TooDeep: nested deeper than 100 levels
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    opening = (b"[", b"{") if isinstance(text, (bytes, bytearray)) else ("[", "{")
    if text.count(opening[0]) + text.count(opening[1]) <= MAX_JSON_DEPTH:
        return value  # each level opens with one: no deeper than that (a log line, a small file: no walk)
    stack = [(value, 1)]
    while stack:  # without recursion: a value nested just under the parser's limit is measured too
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise TooDeep(f"nested deeper than {MAX_JSON_DEPTH} levels")
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return value


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
