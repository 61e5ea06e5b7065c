"""How long DDP's gradient all-reduce keeps a step waiting: a communication hook that times each bucket.

DDP all-reduces gradients bucket by bucket while backward still runs; ``loss.backward()`` returns only when every
bucket is reduced (on the CPU) or, on CUDA, once the compute stream waits for them. So the *exposed* communication
of a step is the time from the last bucket becoming ready (backward's compute is done then: the last bucket holds
the first layers' gradients) to the moment DDP has waited for every bucket.

That moment is found without the loop's help (``attach``; a user's loop calls nothing but ``Monitor.step``): the
hook, at the first bucket of a backward, queues a callback on the autograd engine. DDP's reducer queues its own
finalize callback (which waits for every bucket's all-reduce, or on CUDA makes the compute stream wait for them)
when the LAST bucket is marked ready, i.e. after our first callback (measured: torch 2.13, gloo, one and two
buckets: at our first callback the gradients are still the local ones). So our callback queues itself once more:
the engine runs the callbacks queued while it runs them, in order, and the second one runs after DDP's finalize
(the gradients are then the averaged ones), whatever the version queues finalize at. On the CPU (gloo) both ends
are host clocks and each bucket's own all-reduce is timed through its future; on CUDA both ends are CUDA events
(the second on the stream the finalize waited on), read once complete, and the buckets' own durations are not
known (``comm_s`` None).

The hook is DDP's own ``allreduce_hook`` (average over the ranks), with timestamps around it: the gradients are
what they would be without it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from gpuwise.errors import GpuwiseError


class DDPCommTimer:
    """Registered on a DDP model as its communication hook (``attach``); ``take()``, after a step, gives
    (comm_s, exposed_comm_s) summed since the last take: None, None when no synchronising backward finished since.
    Backwards under ``model.no_sync()`` call no hook and count nothing (their gradients are not reduced)."""

    def __init__(self, ddp_model: Any) -> None:
        self._lock = threading.Lock()
        self._last_ready: Any = None  # host time, or a CUDA event, of the last bucket ready in this backward
        self._pairs: list[tuple[Any, Any]] = []  # (last ready, DDP done waiting) per synchronising backward
        self._comm = 0.0  # host seconds of the buckets' all-reduces (CPU only)
        self._comm_seen = False
        self._device: Any = None  # the buckets' CUDA device (None on the CPU)
        self._group = getattr(ddp_model, "process_group", None)  # the group DDP reduces over (None: the default)
        try:
            ddp_model.register_comm_hook(state=self, hook=_timed_allreduce)
        except RuntimeError as exc:  # the reducer takes one hook (a built-in one is not listed in _comm_hooks)
            raise _hooked(ddp_model) from exc

    @staticmethod
    def _mark(device: Any) -> Any:
        """Now: the host clock, or a CUDA event on ``device``'s current stream."""
        if device is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return event
        return time.perf_counter()

    def _bucket_ready(self, bucket: Any) -> Any:
        """In the hook: the bucket is ready; at the first of a backward, queue the end-of-backward callback."""
        device = bucket.buffer().device
        self._device = device if device.type == "cuda" else None
        ready = self._mark(self._device)
        first = bucket.index() == 0 or self._last_ready is None  # hooks run in bucket order, from 0
        self._last_ready = ready
        if first:
            try:
                _queue(lambda: _queue(self._finished))  # the second runs after DDP's finalize (module docstring)
            except RuntimeError:  # no backward to queue on (a hook called outside one): this one goes untimed
                self._last_ready = None
        return ready

    def _finished(self) -> None:
        """After DDP's finalize: every bucket reduced (gloo) or waited for on the current stream (CUDA: the
        callbacks run on the streams current around the user's backward call)."""
        if self._last_ready is None:
            return
        end = self._mark(self._device)
        with self._lock:
            self._pairs.append((self._last_ready, end))
        self._last_ready = None

    def _add_comm(self, seconds: float) -> None:
        with self._lock:
            self._comm += seconds
            self._comm_seen = True

    def take(self) -> tuple[float | None, float | None]:
        """(comm_s, exposed_comm_s) since the last take. On CUDA only the backwards whose events have completed are
        counted (a loop that does not synchronise each step gets them one step later); comm_s is None there."""
        with self._lock:
            ready = [p for p in self._pairs if not _pending(p)]
            self._pairs = [p for p in self._pairs if _pending(p)]
            comm, seen = self._comm, self._comm_seen
            self._comm, self._comm_seen = 0.0, False
        if not ready:
            return None, None
        exposed = sum(_seconds(a, b) for a, b in ready)
        cuda = any(not isinstance(b, float) for _, b in ready)
        return (None if cuda or not seen else comm), max(0.0, exposed)


class CommTimer(DDPCommTimer):
    """The trainer's interface (``training.meter``): ``begin()`` before the synchronising backward, ``end()`` after
    it, ``take()`` after the step's synchronisation. The hook finds the end of the backward by itself now, so
    begin and end mark nothing; ``device`` is read off the buckets (kept for the callers)."""

    def __init__(self, ddp_model: Any, device: torch.device | None = None) -> None:
        super().__init__(ddp_model)

    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass


def attach(ddp_model: Any) -> DDPCommTimer:
    """Time the all-reduce of a DistributedDataParallel model: its communication hook becomes DDP's own
    ``allreduce_hook`` with timestamps around it (gradients unchanged). Call before the first backward. Returns a
    timer whose ``take()`` gives (comm_s, exposed_comm_s) summed since the last take."""
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise GpuwiseError(f"Monitor.ddp needs a DistributedDataParallel model, not {type(ddp_model).__name__}",
                           "wrap it first: model = torch.nn.parallel.DistributedDataParallel(model); mon.ddp(model)")
    if getattr(ddp_model, "_comm_hooks", None):
        raise _hooked(ddp_model)
    return DDPCommTimer(ddp_model)


def _hooked(ddp_model: Any) -> GpuwiseError:
    names = ", ".join(getattr(h, "__name__", type(h).__name__) for h, _ in getattr(ddp_model, "_comm_hooks", ()))
    return GpuwiseError(f"this DDP model already has a communication hook{f' ({names})' if names else ''}: DDP takes "
                        "one, so the monitor cannot time the all-reduce",
                        "call mon.ddp(model) instead of register_comm_hook (it runs DDP's allreduce), or time the "
                        "step without it: mon.step(exposed_comm_s=...)")


def _queue(callback: Any) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def _pending(pair: tuple[Any, Any]) -> bool:
    return not isinstance(pair[1], float) and not (pair[0].query() and pair[1].query())


def _seconds(a: Any, b: Any) -> float:
    return a.elapsed_time(b) / 1e3 if not isinstance(b, float) else b - a


def _timed_allreduce(timer: DDPCommTimer, bucket):  # no annotations: DDP compares them with objects (ours are strings)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ready = timer._bucket_ready(bucket)
    fut = allreduce_hook(timer._group, bucket)
    if not isinstance(ready, float):
        return fut

    def done(f: torch.futures.Future) -> torch.Tensor:
        timer._add_comm(time.perf_counter() - ready)
        return f.value()

    return fut.then(done)


__all__ = ["CommTimer", "DDPCommTimer", "attach"]
