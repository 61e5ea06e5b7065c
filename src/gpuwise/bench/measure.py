"""Timing device work correctly: synchronise before every clock read, warm up, repeat, take the median.

>>> import torch
>>> a = torch.randn(256, 256)
>>> with measure(warmup=2, repeats=5, flops=2 * 256**3) as m:
...     for _ in m:
...         b = a @ a
>>> m.result.repeats
5
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gpuwise.hardware.device import Device, device_for


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """Times in seconds; rates from the median. ``peak_memory_bytes`` is None where the device cannot tell."""

    name: str | None
    device: str
    warmup: int
    repeats: int
    times_s: tuple[float, ...]
    median_s: float
    p10_s: float
    p90_s: float
    peak_memory_bytes: int | None
    flops: float | None
    bytes: float | None

    @property
    def tflops(self) -> float | None:
        return None if self.flops is None or self.median_s <= 0 else self.flops / self.median_s / 1e12

    @property
    def gbps(self) -> float | None:  # 10^9 bytes per second
        return None if self.bytes is None or self.median_s <= 0 else self.bytes / self.median_s / 1e9


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class measure:
    """Time code on a device: a context manager (iterate it to repeat the body) or a decorator.

    ``with measure(device="cuda", warmup=3, repeats=20) as m: for _ in m: y = f(x)`` times 20 runs after 3
    warm-ups; without the loop the whole block is one run. As ``@measure(...)`` on a function, each call
    runs it ``warmup + repeats`` times, returns its last output and leaves the figures in ``fn.measurement``.
    Peak memory is reset on entry and read on exit.
    """

    def __init__(self, name: str | None = None, *, device: str | Device = "cpu", warmup: int = 1,
                 repeats: int = 10, flops: float | None = None, bytes: float | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if warmup < 0 or repeats < 1:
            raise ValueError(f"warmup {warmup} must be >= 0 and repeats {repeats} >= 1")
        self.name = name
        self.device = device_for(device) if isinstance(device, str) else device
        self.warmup, self.repeats = warmup, repeats
        self.flops, self.bytes = flops, bytes
        self.clock = clock
        self._times: list[float] = []
        self._iterated = False
        self.result: Measurement | None = None

    def _read(self) -> float:
        self.device.synchronize()  # never read the clock while the device still has queued work
        return self.clock()

    def __enter__(self) -> measure:
        self._times, self._iterated, self.result = [], False, None
        self.device.synchronize()
        self.device.reset_peak_memory()
        self._start = self._read()
        return self

    def __iter__(self) -> Iterator[int]:
        self._iterated = True
        for i in range(self.warmup + self.repeats):
            t0 = self._read()
            yield i
            t1 = self._read()
            if i >= self.warmup:
                self._times.append(t1 - t0)

    def __exit__(self, exc_type, exc, tb) -> None:
        end = self._read()
        if exc_type is not None:
            return
        times = self._times if self._iterated else [end - self._start]
        if not times:
            raise RuntimeError("the measured loop stopped before any timed repeat")
        self.result = Measurement(
            name=self.name, device=self.device.name, warmup=self.warmup if self._iterated else 0,
            repeats=len(times), times_s=tuple(times), median_s=statistics.median(times),
            p10_s=_quantile(times, 0.1), p90_s=_quantile(times, 0.9),
            peak_memory_bytes=self.device.peak_memory_bytes(), flops=self.flops, bytes=self.bytes,
        )

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            out = None
            with measure(self.name or fn.__name__, device=self.device, warmup=self.warmup, repeats=self.repeats,
                         flops=self.flops, bytes=self.bytes, clock=self.clock) as m:
                for _ in m:
                    out = fn(*args, **kwargs)
            timed.measurement = m.result
            return out

        timed.measurement = None
        return timed
