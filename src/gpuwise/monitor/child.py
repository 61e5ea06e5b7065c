"""The watched process, apart from what is sampled: ``gpuwise watch -- CMD`` starts it (``spawn``) or attaches to a
running one (``attach``), passes Ctrl-C and SIGTERM on (``Signals``), and waits for it to end (``Waiter``).

The command's exit code is passed through (a signal N as 128 + N, as shells do: ``exit_status``). Ctrl-C reaches the
command (from the terminal, or forwarded where the terminal did not send it); the watcher waits for the command to
end. A third Ctrl-C kills the command.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from gpuwise.errors import GpuwiseError, first_line
from gpuwise.monitor.host import HostReader

KILL_AFTER_INTERRUPTS = 3  # the third Ctrl-C kills the command


# -- before it starts ------------------------------------------------------------------------------------------


def resolve_command(command: Sequence[str]) -> list[str]:
    """The command with its program found now, so a misspelt one is a one-line error before anything runs."""
    if not command or not command[0]:
        raise GpuwiseError("nothing to watch", "pass a command after --: gpuwise watch -- python train.py, "
                                               "or attach with --pid N")
    program = command[0]
    if os.sep in program or (os.altsep and os.altsep in program):
        path = Path(program)
        if not path.exists():
            raise GpuwiseError(f"no such command: {program}", "check the path")
        if path.is_dir() or not os.access(path, os.X_OK):
            raise GpuwiseError(f"cannot run {program}: not an executable file",
                               f"chmod +x {program}, or run it with its interpreter (python {program})")
        return list(command)
    if shutil.which(program) is None:
        raise GpuwiseError(f"no such command: {program}",
                           f"check the spelling, or that {program} is on PATH (which {program})")
    return list(command)


def attach(pid: int) -> psutil.Process:
    if pid <= 0:
        raise GpuwiseError(f"--pid {pid} is not a process id", "pass the pid of a running process (ps, nvidia-smi)")
    if pid == os.getpid():
        raise GpuwiseError("gpuwise watch cannot watch itself", "pass the pid of another process")
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            raise psutil.NoSuchProcess(pid)
    except psutil.NoSuchProcess:
        raise GpuwiseError(f"no running process {pid}", "check the pid: ps -p PID, or nvidia-smi for GPU "
                                                        "processes") from None
    except psutil.Error as exc:
        raise GpuwiseError(f"cannot watch process {pid}: {first_line(exc)}", "run as its user") from None
    return process


def spawn(argv: Sequence[str], *, env: Mapping[str, str], stdin: Any = None, stdout: Any = None,
          stderr: Any = None, cwd: str | os.PathLike | None = None) -> subprocess.Popen:
    """Start ``argv`` with ``env``; a command that cannot start is a one-line error with the fix."""
    try:
        return subprocess.Popen(list(argv), stdin=stdin, stdout=stdout, stderr=stderr, env=dict(env), cwd=cwd)
    except FileNotFoundError:
        raise GpuwiseError(f"no such command: {argv[0]}", "check the spelling and the path") from None
    except PermissionError:
        raise GpuwiseError(f"cannot run {argv[0]}: permission denied",
                           "make it executable, or run it with its interpreter") from None
    except OSError as exc:
        raise GpuwiseError(f"cannot run {argv[0]}: {exc.strerror or exc}", "check the command") from None


def kill(child: subprocess.Popen) -> None:
    """Kill the command and reap it: nothing is left to watch it."""
    with contextlib.suppress(OSError):
        child.kill()
    child.wait()


def exit_status(returncode: int) -> int:
    """Popen's ``-N`` (killed by signal N) as a shell's exit status, 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


# -- while it runs ----------------------------------------------------------------------------------------------


def _tty_pgrp() -> int | None:
    """The foreground process group of this process's terminal, or None without one."""
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError, AttributeError):
            if os.isatty(fd):
                return os.tcgetpgrp(fd)
    return None


class Signals:
    """SIGINT and SIGTERM while a command runs: counted, forwarded to the command where it would not get them
    otherwise, never raised in the middle of a sample or a log line.

    A Ctrl-C at the terminal reaches the whole foreground process group, the command included: forwarding it too would
    hit the command twice (a second KeyboardInterrupt inside its own cleanup). So SIGINT is forwarded only when the
    command is not in the terminal's foreground group with us (``kill -INT`` to the watcher, no terminal, a command
    that made its own group); SIGTERM (a scheduler's stop) always is. With ``--pid`` the process is not ours: a
    signal ends the watch and is not passed on."""

    def __init__(self, child: subprocess.Popen | None) -> None:
        self.child = child
        self.count = 0
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> Signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError, OSError):  # not the main thread: signals stay as they were
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        child = self.child
        if child is None or child.poll() is not None:
            return
        with contextlib.suppress(OSError):
            if self.count >= KILL_AFTER_INTERRUPTS:
                child.kill()
            elif signum != signal.SIGINT or not self._terminal_sent_it(child.pid):
                child.send_signal(signum)

    @staticmethod
    def _terminal_sent_it(pid: int) -> bool:
        try:
            ours = os.getpgrp()
            return os.getpgid(pid) == ours and _tty_pgrp() == ours
        except (OSError, AttributeError):  # AttributeError: no process groups (Windows)
            return False


class Waiter:
    """``ended(timeout)``: has the watched process ended, waiting at most ``timeout`` for it. A pidfd (Linux >= 5.3)
    sleeps in the kernel until the process exits, for a child or any other process; elsewhere Popen's and psutil's
    own waits poll (every 50 ms at most, a few microseconds each). A zombie its parent has not reaped counts as
    ended."""

    def __init__(self, child: subprocess.Popen | None, target: psutil.Process | None, host: HostReader) -> None:
        self.child, self.target, self.host = child, target, host
        self.fd: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self.fd = os.pidfd_open(child.pid if child is not None else target.pid)  # type: ignore[union-attr]

    def __call__(self, timeout: float) -> bool:
        if self.fd is not None:
            try:
                ready, _, _ = select.select([self.fd], [], [], timeout)
                return bool(ready)
            except InterruptedError:  # a signal: the caller looks again
                return False
            except (OSError, ValueError):
                self.close()
        if self.child is not None:
            try:
                self.child.wait(timeout=timeout)
                return True
            except subprocess.TimeoutExpired:
                return False
        if not self.host.alive():
            return True
        try:
            self.target.wait(timeout=timeout)  # type: ignore[union-attr]
            return True
        except psutil.TimeoutExpired:
            return False
        except psutil.Error:
            return True

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


__all__ = ["KILL_AFTER_INTERRUPTS", "Signals", "Waiter", "attach", "exit_status", "kill", "resolve_command", "spawn"]
