"""Ctrl-C during training: the first lets the step in progress finish (a half-applied update is never saved), the
second stops at once. Under torchrun (which passes Ctrl-C on to every process, each at its own point in a step)
the processes agree on the step to stop after: the flag travels with the step's loss all-reduce.

>>> # with stop.installed(): ... if stop.requested(world): raise KeyboardInterrupt
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import torch


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run after ``step``; ``saved`` is the checkpoint that holds it (None without a folder).
    ``forced``: a second Ctrl-C stopped it mid-step (nothing saved; under torchrun the processes are not in step)."""

    def __init__(self, step: int, saved: Path | None, forced: bool = False) -> None:
        super().__init__(step, saved)
        self.step, self.saved, self.forced = step, saved, forced


class StopFlag:
    """What Ctrl-C asked: ``asked`` (stop after this step), ``forced`` (a second Ctrl-C, mid-step), and under
    torchrun ``agreed`` (some process was asked, so every process stops after this step)."""

    def __init__(self) -> None:
        self.asked = self.forced = self.agreed = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """SIGINT sets the flag while the block runs (the main thread only: signals go nowhere else)."""
        self.asked = self.forced = self.agreed = False
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self.asked:
                self.forced = True  # mid-step: the state may be half updated, so nothing is saved
                raise KeyboardInterrupt
            self.asked = True

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

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
