"""How long DDP's gradient all-reduce keeps a step waiting: a communication hook that times each bucket.

DDP all-reduces gradients bucket by bucket while backward still runs; ``loss.backward()`` returns only when every
bucket is reduced (on the CPU) or, on CUDA, once the compute stream waits for them. So the *exposed* communication
of a step is the time from the last bucket becoming ready (backward's compute is done then: the last bucket holds
the first layers' gradients) to the end of backward. On the CPU (gloo) both ends are host clocks, and each
bucket's own all-reduce is timed through its future; on CUDA both ends are CUDA events on the compute stream
(read after the step's synchronisation), and the buckets' own durations are not known (``comm_s`` None).

The hook is DDP's own ``allreduce_hook`` (average over the ranks), with timestamps around it: the gradients are
what they would be without it.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class CommTimer:
    """Registered on a DDP model; ``begin()`` before the synchronising backward, ``end()`` after it, ``take()``
    after the step's synchronisation returns (comm_s, exposed_comm_s) summed since the last take."""

    def __init__(self, ddp_model: Any, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._last_ready: Any = None  # host time, or a CUDA event, of the last bucket ready in this backward
        self._pairs: list[tuple[Any, Any]] = []  # (last ready, end of backward) per synchronising backward
        self._comm = 0.0  # host seconds of the buckets' all-reduces (CPU only)
        ddp_model.register_comm_hook(state=self, hook=_timed_allreduce)

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self) -> None:
        self._last_ready = None

    def end(self) -> None:
        if self._last_ready is not None:
            self._pairs.append((self._last_ready, self._mark()))
        self._last_ready = None

    def take(self) -> tuple[float | None, float | None]:
        pairs, self._pairs = self._pairs, []
        comm, self._comm = self._comm, 0.0
        if not pairs:
            return None, None
        if self.cuda:
            exposed = sum(a.elapsed_time(b) for a, b in pairs) / 1e3
            return None, max(0.0, exposed)
        return comm, max(0.0, sum(b - a for a, b in pairs))


def _timed_allreduce(timer: CommTimer, bucket):  # no annotations: DDP compares them with objects, and ours are strings
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ready = timer._mark()
    timer._last_ready = ready
    fut = allreduce_hook(None, bucket)
    if timer.cuda:
        return fut
    started = ready

    def done(f: torch.futures.Future) -> torch.Tensor:
        timer._comm += time.perf_counter() - started
        return f.value()

    return fut.then(done)
