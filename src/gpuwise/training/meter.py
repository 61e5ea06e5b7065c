"""The step's clock: wall time, the wait for data, throughput and MFU, and (with a monitor) each step's phases
timed by CUDA events on the compute stream, so timing adds no synchronisation beyond the one per step.

MFU divides the plan's FLOPs per step by the step time and the catalog's peak for the device in use, at the run's
precision (PaLM appendix B; the peak is dense, from the datasheet row).

>>> # meter.begin(); x, y = next(batches); meter.fetched(); ...; meter.mark(); ...; dt = meter.end()
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gpuwise.hardware.device import Target, device_for
from gpuwise.precision import PRECISIONS

LIVE_WINDOW = 50  # steps the progress line's diagnosis looks back over


def mfu_peak_tflops(target: Target, precision: str) -> float | None:
    """MFU's denominator: the catalog's peak of ``target`` at ``precision``'s rate (GPUs only)."""
    return target.row.peak_tflops.get(PRECISIONS[precision].rate_key) if target.gpu and target.row else None


class Meter:
    """Times each step of the loop; ``figures`` turns the last one into a log line's numbers."""

    def __init__(self, target: Target, precision: str, *, flops_per_step: float | None, monitor: Any = None,
                 model: torch.nn.Module | None = None) -> None:
        self.device, self.timer = torch.device(target.name), device_for(target.name)
        self.flops, self.peak_tflops = flops_per_step, mfu_peak_tflops(target, precision)
        self.monitor = monitor
        self.comm = None  # times DDP's all-reduce for the monitor (exposed communication)
        if monitor is not None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            from gpuwise.monitor.comm import CommTimer

            self.comm = CommTimer(model, self.device)
        self.dt = self.waited = self.waited_cpu = 0.0
        self.marks: list[Any] | None = None

    def begin(self) -> None:
        """The step starts: before its batch is read."""
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()
        self.timer.reset_peak_memory()

    def fetched(self) -> None:
        """The batch is here: the wait for data ends, the compute begins."""
        self.waited, self.waited_cpu = time.perf_counter() - self.t0, time.process_time() - self.cpu0
        self.marks = [self._mark()] if self.monitor is not None else None

    def mark(self) -> None:
        """A phase ends (forward and backward; the optimizer step): the monitor's timings only."""
        if self.marks is not None:
            self.marks.append(self._mark())

    def end(self) -> float:
        """The step is done: wait for the device once, and report the step to the monitor. Returns its seconds."""
        self.timer.synchronize()
        self.dt = time.perf_counter() - self.t0
        if self.marks is not None:
            self._report(self.marks)
        return self.dt

    def figures(self, items: int) -> dict[str, Any]:
        """The last step's throughput (``items``: tokens or samples over every process), MFU, peak memory, data
        wait and the monitor's diagnosis of the recent steps: StepLog's measured fields."""
        dt, flops, peak = self.dt, self.flops, self.peak_tflops
        return {"tokens_per_s": items / dt, "mfu": flops / dt / (peak * 1e12) if flops and peak else None,
                "peak_memory_bytes": self.timer.peak_memory_bytes(), "data_wait": self.waited / dt,
                "bottleneck": self._bottleneck()}

    def _mark(self) -> Any:
        """A point in the step: a CUDA event on the compute stream (no synchronisation), else the host clock."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.device.type == "cuda" else b - a

    def _report(self, marks: list[Any]) -> None:
        """The step to the monitor, after the step's synchronisation (the CUDA events are complete then)."""
        comm, exposed = self.comm.take() if self.comm is not None else (None, None)
        self.monitor.step(seconds=self.dt, data_wait_s=self.waited, data_wait_cpu_s=self.waited_cpu,
                          compute_s=self._seconds(marks[0], marks[1]),
                          optimizer_s=self._seconds(marks[1], marks[2]), comm_s=comm, exposed_comm_s=exposed,
                          peak_memory_bytes=self.timer.peak_memory_bytes(), flops=self.flops)

    def _bottleneck(self) -> str | None:
        """The monitor's diagnosis of the last steps, for the progress line (None without one, or on failure:
        a diagnosis must never stop a run)."""
        if self.monitor is None:
            return None
        try:
            return self.monitor.diagnose(last_steps=LIVE_WINDOW).bottleneck
        except Exception:
            return None
