"""What this machine has, matched to catalog rows: a pure function of the ``Environment``."""

from __future__ import annotations

from dataclasses import dataclass

from gpuwise.environment import CpuInfo, Environment
from gpuwise.hardware.catalog import Accelerator, Catalog
from gpuwise.stack import sm_name


@dataclass(frozen=True, kw_only=True)
class LocalDevice:
    """One accelerator on this machine (or the CPU), with its catalog row when there is one."""

    backend: str  # "cuda", "rocm", "mps" or "cpu"
    index: int | None  # torch's device index; None when torch cannot use the device
    name: str
    memory_total_bytes: int | None
    memory_free_bytes: int | None  # NVML's free memory; for MPS, torch's recommended working set
    arch: str | None  # "sm_90", "gfx942", ...
    catalog_match: Accelerator | None
    note: str | None = None

    @property
    def bf16(self) -> bool:
        return bf16_capable(self.backend, self.arch)


# AMD parts with bf16 matrix cores: MI200 (gfx90a), MI300 (gfx94x), MI350 (gfx95x), RDNA3/4 (gfx11, gfx12).
_ROCM_BF16 = ("gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")


def bf16_capable(backend: str, arch: str | None) -> bool:
    """Whether a GPU computes in bf16 at speed: NVIDIA from Ampere (sm_80) on, AMD from CDNA2/RDNA3 on.

    The one rule, used by ``doctor``, the default precision and the trainer's checks; torch's own
    ``is_bf16_supported`` says yes on older GPUs too, where bf16 runs emulated and slowly.
    """
    if backend == "rocm":
        return (arch or "").startswith(_ROCM_BF16)
    if backend == "cuda" and arch and arch.startswith("sm_") and arch[3:].isdigit():
        return int(arch[3:]) >= 80
    return False


@dataclass(frozen=True, kw_only=True)
class LocalMachine:
    cpu: CpuInfo
    torch_build: str  # "CUDA 13.0", "ROCm 7.2", "CPU", or "not installed"
    devices: tuple[LocalDevice, ...]


def describe_local(env: Environment, catalog: Catalog) -> LocalMachine:
    """The accelerators of this machine: CUDA and ROCm GPUs (torch and NVML), Apple MPS, the CPU."""
    devices: list[LocalDevice] = []
    nvml_by_uuid = {d.uuid.removeprefix("GPU-"): d for d in env.nvml_devices}
    seen_uuids = set()
    backend = "rocm" if env.torch and env.torch.hip else "cuda"
    for dev in env.gpus:
        nvml = nvml_by_uuid.get(dev.uuid or "")
        if nvml is None and len(env.gpus) == len(env.nvml_devices) == 1:
            nvml = env.nvml_devices[0]  # one GPU each side: the same card even without a UUID
        if nvml is not None:
            seen_uuids.add(nvml.uuid)
        arch = (dev.gcn_arch or "").split(":")[0] if backend == "rocm" else sm_name(dev.compute_capability)
        devices.append(LocalDevice(
            backend=backend, index=dev.index, name=dev.name,
            memory_total_bytes=dev.total_memory_bytes,
            memory_free_bytes=nvml.free_memory_bytes if nvml else None,
            arch=arch, catalog_match=catalog.match_device(dev.name, dev.total_memory_bytes),
        ))
    for nvml in env.nvml_devices:
        if nvml.uuid in seen_uuids:
            continue
        cc = nvml.compute_capability
        hidden = "CUDA_VISIBLE_DEVICES" in env.variables and bool(env.gpus)
        devices.append(LocalDevice(
            backend="cuda", index=None, name=nvml.name,
            memory_total_bytes=nvml.total_memory_bytes, memory_free_bytes=nvml.free_memory_bytes,
            arch=sm_name(cc) if cc else None,
            catalog_match=catalog.match_device(nvml.name, nvml.total_memory_bytes),
            note="hidden by CUDA_VISIBLE_DEVICES" if hidden else "not usable by this torch (see gpuwise doctor)",
        ))
    if env.torch and env.torch.mps_available:
        devices.append(LocalDevice(
            backend="mps", index=0, name=env.cpu.model,
            memory_total_bytes=env.cpu.memory_total_bytes,
            memory_free_bytes=env.torch.mps_recommended_max_bytes,
            arch=None, catalog_match=catalog.match_device(env.cpu.model),
            note="unified memory, shared with the CPU; the catalog row is the largest GPU of that chip",
        ))
    devices.append(LocalDevice(
        backend="cpu", index=None, name=env.cpu.model,
        memory_total_bytes=env.cpu.memory_total_bytes, memory_free_bytes=env.cpu.memory_available_bytes,
        arch=env.machine, catalog_match=None,
        note=f"{env.cpu.physical_cores or '?'} cores / {env.cpu.logical_cores} threads"
             f" ({env.cpu.usable_cores} usable)",
    ))
    build = env.torch.build if env.torch else "not installed"
    return LocalMachine(cpu=env.cpu, torch_build=build, devices=tuple(devices))
