"""What timing needs from a device: wait for its queued work, and its peak memory. Probed once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from gpuwise.errors import GpuwiseError


class Device(Protocol):
    name: str  # "cpu", "cuda:0", "mps"

    def synchronize(self) -> None: ...  # wait until every queued kernel has finished

    def reset_peak_memory(self) -> None: ...

    def peak_memory_bytes(self) -> int | None: ...  # None: the device cannot tell


@dataclass(frozen=True)
class CpuDevice:
    """CPU ops run synchronously; PyTorch keeps no allocator statistics for the CPU."""

    name: str = "cpu"

    def synchronize(self) -> None:
        pass

    def reset_peak_memory(self) -> None:
        pass

    def peak_memory_bytes(self) -> int | None:
        return None


@dataclass(frozen=True)
class CudaDevice:
    """CUDA kernels are queued: a clock read without ``torch.cuda.synchronize`` measures the launch only."""

    index: int

    @property
    def name(self) -> str:
        return f"cuda:{self.index}"

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.index)

    def peak_memory_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.index))


@dataclass(frozen=True)
class MpsDevice:
    """Apple GPUs queue work too; torch.mps has no peak counter, only the current allocation."""

    name: str = "mps"

    def synchronize(self) -> None:
        torch.mps.synchronize()

    def reset_peak_memory(self) -> None:
        pass

    def peak_memory_bytes(self) -> int | None:
        return None


def device_for(name: str) -> Device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``mps``, checked against what this machine has."""
    try:
        dev = torch.device(name.strip().lower()) if name and name.strip() else torch.device("cpu")
    except (RuntimeError, ValueError):
        raise GpuwiseError(f"--device {name!r} is not a device name", "use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cpu":
        return CpuDevice()
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise GpuwiseError(f"--device {name}: torch sees no CUDA GPU here",
                               "run 'gpuwise doctor', or use --device cpu")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise GpuwiseError(f"--device {name}: there are {torch.cuda.device_count()} CUDA GPUs",
                               f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
        return CudaDevice(index)
    if dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise GpuwiseError("--device mps: this machine has no Apple GPU torch can use", "use --device cpu")
        return MpsDevice()
    raise GpuwiseError(f"--device {name}: not a device gpuwise can time", "use cpu, cuda, cuda:N or mps")
