"""Devices, decided once: which ones this machine has, the default one, which catalog row device X is,
and what timing needs from a device (wait for its queued work, its peak memory).

``resolve_device`` answers from a ``LocalMachine`` snapshot (``gpuwise.hardware.detect``), so a test can
hand it a machine with any GPUs; ``device_for`` gives the torch-side handle of a device torch can use.

>>> target = resolve_device("cuda:1", local_machine(os.environ))   # doctest: +SKIP
>>> target.row.key, target.precision                                # doctest: +SKIP
('a100-80gb-sxm', 'bf16-mixed')
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gpuwise.errors import GpuwiseError
from gpuwise.precision import Precision, default_precision

if TYPE_CHECKING:
    from gpuwise.hardware.catalog import Accelerator
    from gpuwise.hardware.detect import LocalDevice, LocalMachine

DEVICE_HINT = "use cpu, cuda, cuda:N or mps"


@dataclass(frozen=True, kw_only=True)
class Target:
    """The device a command runs on, probed once: its torch name, what it is, and its catalog row."""

    name: str  # torch's name: "cpu", "cuda:1", "mps" (ROCm GPUs are "cuda:N" to torch too)
    backend: str  # "cuda", "rocm", "mps" or "cpu"
    index: int | None
    model: str  # what the driver calls it: "NVIDIA H100 80GB HBM3", the CPU's model
    row: Accelerator | None  # the catalog row, when the catalog knows the device
    bf16: bool  # the device computes in bf16 at speed
    memory_total_bytes: int | None

    @property
    def gpu(self) -> bool:
        return self.backend in ("cuda", "rocm")

    @property
    def precision(self) -> Precision:
        """What this device trains in by default."""
        return default_precision(gpu=self.gpu, bf16=self.bf16)


def local_machine(environ: Mapping[str, str]) -> LocalMachine:
    """This machine's devices matched to the catalog (probes torch, NVML and the CPU once)."""
    from gpuwise.environment import gather_environment
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.hardware.detect import describe_local

    return describe_local(gather_environment(environ), load_catalog())


def _usable(machine: LocalMachine) -> list[LocalDevice]:
    return [d for d in machine.devices if d.index is not None or d.backend == "cpu"]


def default_device(machine: LocalMachine) -> str:
    """The device a command uses unless told: the first GPU torch can use, else Apple's GPU, else the CPU."""
    for backend in ("cuda", "rocm", "mps"):
        found = [d for d in _usable(machine) if d.backend == backend]
        if found:
            first = min(found, key=lambda d: d.index or 0)
            return "mps" if backend == "mps" else f"cuda:{first.index}"
    return "cpu"


def parse_device(name: str) -> tuple[str, int | None]:
    """``"cuda:1"`` -> ("cuda", 1); ``"CPU"`` -> ("cpu", None); anything else is a one-line error."""
    import torch

    try:
        dev = torch.device(name.strip().lower())
    except (RuntimeError, ValueError):
        raise GpuwiseError(f"--device {name!r} is not a device name", DEVICE_HINT) from None
    if dev.type in ("cpu", "mps") and dev.index is not None:
        raise GpuwiseError(f"--device {name}: the {'CPU' if dev.type == 'cpu' else 'Apple GPU'} has no index",
                           f"use --device {dev.type}")
    if dev.type not in ("cpu", "cuda", "mps") or (dev.index is not None and dev.type != "cuda"):
        raise GpuwiseError(f"--device {name}: not a device gpuwise can time", DEVICE_HINT)
    return dev.type, dev.index


def resolve_device(name: str | None, machine: LocalMachine) -> Target:
    """The device called ``name`` (None: the default) on ``machine``, with its catalog row, checked to exist."""
    kind, index = parse_device(name if name and name.strip() else default_device(machine))
    usable = _usable(machine)
    if kind == "cuda":
        gpus = sorted((d for d in usable if d.backend in ("cuda", "rocm")), key=lambda d: d.index or 0)
        if not gpus:
            raise GpuwiseError(f"--device {name}: torch sees no CUDA GPU here",
                               "run 'gpuwise doctor', or use --device cpu")
        index = 0 if index is None else index
        found = next((d for d in gpus if d.index == index), None)
        if found is None:
            raise GpuwiseError(f"--device {name}: there are {len(gpus)} CUDA GPUs",
                               f"use cuda:0 to cuda:{len(gpus) - 1}")
        torch_name = f"cuda:{index}"
    else:
        found = next((d for d in usable if d.backend == kind), None)
        if found is None:
            raise GpuwiseError(f"--device {kind}: this machine has no Apple GPU torch can use", "use --device cpu")
        torch_name = kind
    return Target(name=torch_name, backend=found.backend, index=found.index, model=found.name,
                  row=found.catalog_match, bf16=found.bf16, memory_total_bytes=found.memory_total_bytes)


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
        import torch

        torch.cuda.synchronize(self.index)

    def reset_peak_memory(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self.index)

    def peak_memory_bytes(self) -> int | None:
        import torch

        return int(torch.cuda.max_memory_allocated(self.index))


@dataclass(frozen=True)
class MpsDevice:
    """Apple GPUs queue work too; torch.mps has no peak counter, only the current allocation."""

    name: str = "mps"

    def synchronize(self) -> None:
        import torch

        torch.mps.synchronize()

    def reset_peak_memory(self) -> None:
        pass

    def peak_memory_bytes(self) -> int | None:
        return None


def device_for(name: str) -> Device:
    """The timing handle of ``cpu``, ``cuda``, ``cuda:N`` or ``mps``, checked against what torch can use."""
    import torch

    kind, index = parse_device(name if name and name.strip() else "cpu")
    if kind == "cpu":
        return CpuDevice()
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise GpuwiseError(f"--device {name}: torch sees no CUDA GPU here",
                               "run 'gpuwise doctor', or use --device cpu")
        index = index if index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise GpuwiseError(f"--device {name}: there are {torch.cuda.device_count()} CUDA GPUs",
                               f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
        return CudaDevice(index)
    if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise GpuwiseError("--device mps: this machine has no Apple GPU torch can use", "use --device cpu")
    return MpsDevice()
