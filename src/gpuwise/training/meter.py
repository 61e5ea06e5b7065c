"""The step's clock: wall time, the wait for data, throughput and MFU, and (with a monitor) each step's phases
timed by CUDA events on the compute stream, so timing adds no synchronisation beyond the one per step.

MFU divides the plan's FLOPs per step by the step time and the catalog's peak for the device in use, at the run's
precision (PaLM appendix B; the peak is dense, from the datasheet row).

Two throughputs: each log line's is the last step's own rate (items / its time), what the live line shows; the run's
is over the wall clock (``wall_throughput``: the items between two log lines over the time between them, everything
the loop did meanwhile counted: logging, evaluation, checkpoint saves, stalls). A run that stalls every 10th step
has a fast median step and a slow wall clock; only the second is what it delivers.

>>> # meter.begin(); x, y = next(batches); meter.fetched(); ...; meter.mark(); ...; dt = meter.end()
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from gpuwise.hardware.device import Target, device_for
from gpuwise.monitor.sampler import runq_ns
from gpuwise.precision import PRECISIONS

LIVE_WINDOW = 50  # steps the progress line's diagnosis looks back over


def mfu_peak_tflops(target: Target, precision: str) -> float | None:
    """MFU's denominator: the catalog's peak of ``target`` at ``precision``'s rate (GPUs only)."""
    return target.row.peak_tflops.get(PRECISIONS[precision].rate_key) if target.gpu and target.row else None


def wall_throughput(logs: Sequence[Any]) -> float | None:
    """Items a second over the wall clock: those of the steps after the first logged one, over the time from that
    log line to the last (everything between counted: logging, evaluation, checkpoints, stalls). With one log line,
    from the first step's start. ``logs``: StepLogs (``items_done``, ``elapsed_s``)."""
    timed = [log for log in logs if getattr(log, "elapsed_s", None) is not None
             and getattr(log, "items_done", None) is not None]
    if len(timed) >= 2:
        first, last = timed[0], timed[-1]
        seconds, items = last.elapsed_s - first.elapsed_s, last.items_done - first.items_done
    elif timed:
        seconds, items = timed[0].elapsed_s, timed[0].items_done
    else:
        return None
    return items / seconds if seconds > 0 and items > 0 else None


class Meter:
    """Times each step of the loop; ``figures`` turns the last one into a log line's numbers."""

    def __init__(self, target: Target, precision: str, *, flops_per_step: float | None, monitor: Any = None,
                 model: torch.nn.Module | None = None, processes: int = 1) -> None:
        self.device, self.timer = torch.device(target.name), device_for(target.name)
        self.flops, self.peak_tflops = flops_per_step, mfu_peak_tflops(target, precision)
        self.monitor = monitor
        self.comm = None  # times DDP's all-reduce for the monitor (exposed communication)
        if monitor is not None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            from gpuwise.monitor.comm import CommTimer

            self.comm = CommTimer(model, self.device)
        self.dt = self.waited = self.waited_cpu = 0.0
        self.waited_runq: float | None = None  # of the wait, the loop thread's time with no core (Linux)
        self._runq0: int | None = None
        self.marks: list[Any] | None = None
        self.processes = processes  # each consumes the same share of the global batch
        self.started: float | None = None  # when the first step began (the wall clock's origin)
        self.items_done = 0  # tokens (or samples) this process's steps consumed since then

    def begin(self) -> None:
        """The step starts: before its batch is read."""
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()
        self._runq0 = runq_ns() if self.monitor is not None else None
        if self.started is None:
            self.started = self.t0
        self.timer.reset_peak_memory()

    def fetched(self) -> None:
        """The batch is here: the wait for data ends, the compute begins."""
        self.waited, self.waited_cpu = time.perf_counter() - self.t0, time.process_time() - self.cpu0
        rq = runq_ns() if self._runq0 is not None else None
        self.waited_runq = None if rq is None or self._runq0 is None else (rq - self._runq0) / 1e9
        self.marks = [self._mark()] if self.monitor is not None else None

    def mark(self) -> None:
        """A phase ends (forward and backward; the optimizer step): the monitor's timings only."""
        if self.marks is not None:
            self.marks.append(self._mark())

    def end(self, *, items: int | None = None, micro_batches: int | None = None) -> float:
        """The step is done: wait for the device once, and report the step to the monitor. ``items``: the tokens
        (or samples) this process's step consumed; ``micro_batches``: its forward/backward passes (accumulation).
        Returns its seconds."""
        self.timer.synchronize()
        self.dt = time.perf_counter() - self.t0
        self.items_done += items or 0
        if self.marks is not None:
            self._report(self.marks, items, micro_batches)
        return self.dt

    def figures(self, items: int) -> dict[str, Any]:
        """The last step's throughput (``items``: tokens or samples over every process), MFU, peak memory, data
        wait and the monitor's diagnosis of the recent steps, and the wall clock so far (seconds since the first
        step began, items every process consumed meanwhile): StepLog's measured fields."""
        dt, flops, peak = self.dt, self.flops, self.peak_tflops
        now = time.perf_counter()
        origin = self.started if self.started is not None else now
        return {"tokens_per_s": items / dt, "mfu": flops / dt / (peak * 1e12) if flops and peak else None,
                "peak_memory_bytes": self.timer.peak_memory_bytes(), "data_wait": self.waited / dt,
                "bottleneck": self._bottleneck(), "elapsed_s": now - origin,
                "items_done": self.items_done * self.processes}

    def _mark(self) -> Any:
        """A point in the step: a CUDA event on the compute stream (no synchronisation), else the host clock."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.device.type == "cuda" else b - a

    def _report(self, marks: list[Any], items: int | None, micro_batches: int | None) -> None:
        """The step to the monitor, after the step's synchronisation (the CUDA events are complete then)."""
        comm, exposed = self.comm.take() if self.comm is not None else (None, None)
        self.monitor.step(seconds=self.dt, data_wait_s=self.waited, data_wait_cpu_s=self.waited_cpu,
                          data_wait_runq_s=self.waited_runq,
                          compute_s=self._seconds(marks[0], marks[1]),
                          optimizer_s=self._seconds(marks[1], marks[2]), comm_s=comm, exposed_comm_s=exposed,
                          peak_memory_bytes=self.timer.peak_memory_bytes(), flops=self.flops, items=items,
                          micro_batches=micro_batches)

    def _bottleneck(self) -> str | None:
        """The monitor's diagnosis of the last steps, for the progress line (None without one, or on failure:
        a diagnosis must never stop a run)."""
        if self.monitor is None:
            return None
        try:
            return self.monitor.diagnose(last_steps=LIVE_WINDOW).bottleneck
        except Exception:
            return None
