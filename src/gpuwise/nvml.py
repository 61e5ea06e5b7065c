"""One NVML session for the whole library: ``nvmlInit`` once, ``nvmlShutdown`` once, a device handle opened once.

``doctor`` (through ``environment.gather_environment``) and the monitor (``monitor.nvml.NvmlReader``) both read
NVML through a :class:`NvmlSession`; a caller that does both hands the same session to each.

>>> with NvmlSession.start() as nvml:                                   # doctest: +SKIP
...     [nvml.handle(i) for i in range(nvml.count())]

``nvml`` is the pynvml module (imported when None) or a stand-in with its names: tests pass fakes, so none of this
needs a GPU to be checked.
"""

from __future__ import annotations

import contextlib
from typing import Any


class NvmlSession:
    """An initialised NVML: device handles opened once and shared, shut down once by ``close`` (NVML counts
    inits, so a session that is never closed leaks one)."""

    def __init__(self, nvml: Any) -> None:
        """Wraps a module whose ``nvmlInit`` has already succeeded; ``start`` is the way in."""
        self.nvml = nvml
        self.error: type[BaseException] = getattr(nvml, "NVMLError", Exception)
        self._handles: dict[int, Any] = {}
        self._closed = False

    @classmethod
    def start(cls, nvml: Any = None) -> NvmlSession:
        """``nvmlInit`` on ``nvml`` (pynvml when None). Raises ImportError without nvidia-ml-py, and what NVML
        raises without a driver (NVMLError_LibraryNotFound, DriverNotLoaded, ...)."""
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
        return cls(nvml)

    @property
    def closed(self) -> bool:
        return self._closed

    def count(self) -> int:
        """GPUs the driver sees (``nvidia-smi -L``), in NVML's order (PCI bus order)."""
        return int(self.nvml.nvmlDeviceGetCount())

    def handle(self, index: int) -> Any:
        """The handle of NVML GPU ``index``, opened on first use; raises what NVML raises for a lost GPU."""
        if index not in self._handles:
            self._handles[index] = self.nvml.nvmlDeviceGetHandleByIndex(index)
        return self._handles[index]

    def close(self) -> None:
        """``nvmlShutdown``, once; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._handles.clear()
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()

    def __enter__(self) -> NvmlSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def text(value: Any) -> str:
    """A name or version as NVML gives it: bytes from old bindings, str from new ones."""
    return value.decode() if isinstance(value, bytes) else str(value)


__all__ = ["NvmlSession", "text"]
