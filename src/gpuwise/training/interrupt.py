"""Ctrl-C during training, and SIGTERM (a scheduler's stop) and SIGHUP (a closed ssh session) alike: the first
lets the step in progress finish and saves it (a half-applied update is never saved), the second stops at once.
Under torchrun (which passes the signal on to every process, each at its own point in a step) the processes agree
on the step to stop after: the flag travels with the step's loss all-reduce.

>>> # with stop.installed(): ... if stop.requested(world): raise KeyboardInterrupt
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")  # by name: SIGHUP does not exist on Windows


class Interrupted(KeyboardInterrupt):
    """A stop signal ended the run after ``step``; ``saved`` is the checkpoint that holds it (None without a folder).
    ``forced``: a second signal stopped it mid-step (nothing saved; under torchrun the processes are not in step).
    ``signum``: which signal (SIGINT for Ctrl-C); the command exits 128 + it, as a shell reports it."""

    def __init__(self, step: int, saved: Path | None, forced: bool = False, signum: int = signal.SIGINT) -> None:
        super().__init__(step, saved)
        self.step, self.saved, self.forced, self.signum = step, saved, forced, int(signum)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


class StopFlag:
    """What a stop signal asked: ``asked`` (stop after this step), ``forced`` (a second one, mid-step), ``signum``
    (the first one's number), and under torchrun ``agreed`` (some process was asked, so every process stops after
    this step)."""

    def __init__(self) -> None:
        self.asked = self.forced = self.agreed = False
        self.signum: int = signal.SIGINT

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """SIGINT, SIGTERM and SIGHUP set the flag while the block runs (the main thread only: signals go nowhere
        else)."""
        self.asked = self.forced = self.agreed = False
        self.signum = signal.SIGINT
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self.asked:
                self.forced = True  # mid-step: the state may be half updated, so nothing is saved
                raise KeyboardInterrupt
            self.asked, self.signum = True, signum

        previous = {}
        for name in STOP_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            with contextlib.suppress(OSError, ValueError):
                previous[sig] = signal.signal(sig, handler)
        try:
            yield
        finally:
            for sig, old in previous.items():
                with contextlib.suppress(OSError, ValueError, TypeError):
                    signal.signal(sig, old)

    def requested(self, world_size: int) -> bool:
        """Stop before the next step: this process was asked, or under torchrun the processes agreed."""
        return self.agreed if world_size > 1 else self.asked

    def mean_loss(self, loss: torch.Tensor, world_size: int) -> torch.Tensor:
        """The loss of the global batch as one process would see it, in the one all-reduce that also tells every
        process whether any of them heard Ctrl-C (then all of them stop after this step)."""
        both = torch.stack([loss.float(), torch.tensor(float(self.asked), device=loss.device)])
        torch.distributed.all_reduce(both)
        self.agreed = bool(both[1] > 0)
        return both[0] / world_size
