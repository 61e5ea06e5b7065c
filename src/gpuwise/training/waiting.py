"""A line while a run waits on the user's data, and a bound on the wait (``--data-timeout``).

A ``--data`` function that never returned, or a Dataset whose ``__getitem__`` (or DataLoader worker) was stuck, hung
``gpuwise train`` with nothing said (issue 30). ``Watchdog`` watches those waits from a thread: after ``NOTE_S``
seconds it says what the run is waiting for, again every ``EVERY_S``; with a bound it ends the wait in a one-line
error (exit 2). A normal run pays about 1 us a batch (a context manager around the wait: 1.1 us measured on the 2-core
VM), as the thread wakes in ticks, formats nothing until a wait is long, and sends nothing unless a bound is passed.

The bound interrupts the main thread with SIGALRM (``signal.pthread_kill``): a signal wakes a blocked ``time.sleep``,
socket read or queue wait, which a flag cannot. The exception it raises derives from BaseException, so a user's
``except Exception`` (a retry loop) does not swallow it; ``waiting`` turns it into the one-line error. Off the main
thread (a Trainer run in a thread) no signal can be aimed: the line still comes, the bound is not enforced.

>>> # with Watchdog(print, timeout=60) as dog, dog.waiting(lambda: "the first batch", "check the Dataset"): ...
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from gpuwise.errors import GpuwiseError

NOTE_S = 30.0  # seconds of waiting before the first line (half the bound when that is shorter)
EVERY_S = 60.0  # seconds between the lines after it
ENV = "GPUWISE_DATA_TIMEOUT"  # the bound's environment variable (read by the CLI's --data-timeout)


class _Expired(BaseException):
    """The SIGALRM handler's exception in the main thread: the wait in progress passed its bound."""


class Watchdog:
    """Watches the waits opened with ``waiting`` while it is entered; ``say`` hears the lines (None: silent),
    ``timeout`` bounds each wait in seconds (None: no bound)."""

    def __init__(self, say: Callable[[str], None] | None, timeout: float | None = None) -> None:
        self.say, self.timeout = say, timeout
        self.first = NOTE_S if timeout is None else min(NOTE_S, timeout / 2)
        self._wait: tuple[int, float, Callable[[], str], str] | None = None  # token, start, what, hint
        self._token = 0
        self._expired: int | None = None  # the token whose bound passed (the handler raises for it only)
        self._sent = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous: Any = None
        self._bounded = False

    def __enter__(self) -> Watchdog:
        if self.timeout is not None and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGALRM, self._alarm)
            self._bounded = True
        if self.say is not None or self._bounded:
            self._main = threading.main_thread().ident
            self._thread = threading.Thread(target=self._watch, name="gpuwise-data-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        if not self._bounded:
            return
        self._bounded = False
        if not self._sent:
            signal.signal(signal.SIGALRM, self._previous)
            return
        # an alarm was aimed at this thread: one still pending must not meet the default action (terminate)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        try:
            while signal.SIGALRM in signal.sigpending():
                signal.sigtimedwait({signal.SIGALRM}, 0)
            signal.signal(signal.SIGALRM, self._previous)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})

    @contextlib.contextmanager
    def waiting(self, what: Callable[[], str], hint: str) -> Iterator[None]:
        """The block waits on ``what()`` (formatted only for a line or the error, e.g. "the first batch (step 1)
        from the Dataset Slow"); ``hint`` says where to look."""
        self._token += 1
        self._wait = (self._token, time.monotonic(), what, hint)
        try:
            yield
        except _Expired:
            self._wait = None
            raise GpuwiseError(f"gave up waiting for {what()} after {self.timeout:g} s (--data-timeout)",
                               hint) from None
        finally:
            self._wait = None

    def _alarm(self, signum: int, frame: Any) -> None:
        wait = self._wait
        if wait is not None and wait[0] == self._expired:  # a late alarm, after the wait ended, does nothing
            raise _Expired

    def _watch(self) -> None:
        tick = min(0.5, self.first / 5)
        seen, next_line = 0, 0.0
        while not self._done.wait(tick):
            wait = self._wait
            if wait is None:
                continue
            token, start, what, hint = wait
            if token != seen:
                seen, next_line = token, start + self.first
            now = time.monotonic()
            if self._bounded and now - start >= self.timeout and self._expired != token:
                self._expired, self._sent = token, True
                signal.pthread_kill(self._main, signal.SIGALRM)
            elif self.say is not None and now >= next_line and self._expired != token:
                next_line += EVERY_S
                bound = (f"giving up at {self.timeout:g} s" if self.timeout is not None else
                         f"bound the wait with --data-timeout SECONDS or {ENV}")
                with contextlib.suppress(Exception):  # a closed stderr must not end the watch with a traceback
                    self.say(f"still waiting for {what()} ({_seconds(now - start)}; {bound}): {hint}")


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"
