"""A fake GPU timer for ``measure``'s tests: a device whose queued work is only done after ``synchronize()``, a clock
that refuses to be read while work is queued, and ``launch`` to queue kernels; every call logged in order."""

from __future__ import annotations


class FakeGpu:
    """A device whose queued work is only done after synchronize(); it logs every call in order."""

    name = "fake:0"

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.pending = 0

    def synchronize(self) -> None:
        self.log.append("sync")
        self.pending = 0

    def reset_peak_memory(self) -> None:
        self.log.append("reset")

    def peak_memory_bytes(self) -> int:
        self.log.append("peak")
        return 1234


class FakeClock:
    """Advances 1 ms per read; a read while the device has queued work is an error."""

    def __init__(self, device: FakeGpu) -> None:
        self.device, self.now = device, 0.0

    def __call__(self) -> float:
        assert self.device.pending == 0, "clock read while GPU work was still queued"
        self.device.log.append("clock")
        self.now += 1e-3
        return self.now


def launch(device: FakeGpu, kernels: int = 1) -> None:
    device.pending += kernels
    device.log.append("launch")
