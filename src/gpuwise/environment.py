"""One snapshot of the software and hardware stack, gathered once.

``gather_environment`` is the only place in gpuwise that asks the GPU, the driver (NVML) or torch
about devices. Everything else (``doctor``, ``gpus --local``) is a pure function of the snapshot,
so every branch can be tested by building an ``Environment`` by hand.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwise.errors import first_line
from gpuwise.nvml import NvmlSession
from gpuwise.nvml import text as nvml_text

# Environment variables that change what the stack does; the snapshot keeps only these.
RELEVANT_VARIABLES = (
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF",
    "LD_LIBRARY_PATH", "HSA_OVERRIDE_GFX_VERSION", "TRITON_INTERPRET",
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class GpuProcess:
    """A process holding GPU memory (``nvidia-smi --query-compute-apps=pid,name,used_memory``)."""

    pid: int
    name: str | None
    used_memory_bytes: int | None


@dataclass(frozen=True, kw_only=True)
class NvmlDevice:
    """A GPU as the NVIDIA driver reports it through NVML, whether or not torch can use it."""

    index: int
    name: str  # nvidia-smi --query-gpu=name
    uuid: str  # --query-gpu=uuid, "GPU-..."
    total_memory_bytes: int | None  # --query-gpu=memory.total; None where NVML has no figure
    free_memory_bytes: int | None  # --query-gpu=memory.free
    compute_capability: tuple[int, int] | None  # --query-gpu=compute_cap
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True, kw_only=True)
class TorchDevice:
    """A GPU as torch sees it (CUDA or ROCm through ``torch.cuda``), numbered as torch numbers it."""

    index: int
    name: str
    total_memory_bytes: int
    compute_capability: tuple[int, int]
    multiprocessor_count: int
    uuid: str | None = None  # without the "GPU-" prefix
    gcn_arch: str | None = None  # ROCm only, e.g. "gfx942:sramecc+:xnack-"


@dataclass(frozen=True, kw_only=True)
class TorchInfo:
    """The installed torch build and what it can reach."""

    version: str  # e.g. "2.13.0+cu130"
    cuda: str | None  # torch.version.cuda: the CUDA the wheel was built with
    hip: str | None  # torch.version.hip: the ROCm it was built with
    arch_list: tuple[str, ...] = ()  # torch.cuda.get_arch_list()
    cuda_error: str | None = None  # why torch.cuda could not list devices
    devices: tuple[TorchDevice, ...] = ()
    cudnn_version: int | None = None  # e.g. 91002 for 9.10.2
    cudnn_error: str | None = None
    nccl_version: str | None = None  # e.g. "2.28.9"
    mps_built: bool = False
    mps_available: bool = False
    mps_recommended_max_bytes: int | None = None
    float32_matmul_precision: str = "highest"  # "high" or "medium" lets fp32 matmuls use TF32
    triton_pin: str | None = None  # the triton release this torch wheel requires, if any
    warnings: tuple[str, ...] = ()  # what torch warned while being probed

    @property
    def build(self) -> str:
        """ "CUDA 13.0", "ROCm 7.2" or "CPU"."""
        if self.cuda:
            return f"CUDA {self.cuda}"
        if self.hip:
            return f"ROCm {'.'.join(self.hip.split('.')[:2])}"
        return "CPU"


@dataclass(frozen=True, kw_only=True)
class CpuInfo:
    model: str
    physical_cores: int | None
    logical_cores: int
    usable_cores: int  # this process's affinity: what a container or taskset allows
    memory_total_bytes: int
    memory_available_bytes: int


# DataLoader workers: the one rule that doctor's advice, the monitor's input-bound fix and train's default share.
MAX_WORKERS_PER_GPU = 8  # past 8 a GPU's loader rarely gains and each worker holds a copy of the dataset object
MAX_WORKERS_CPU = 4  # a CPU run computes on the cores too: a quarter of them load, at most 4
# Loading that mostly waits (disk, network, a sleep) gains from more workers than cores, as PyTorch's own DataLoader
# allows past its "suggested max" warning: up to IO_WORKERS_PER_CORE per usable core.
IO_WORKERS_PER_CORE = 4


def workers_cap(usable_cores: int, processes: int = 1, *, waits_on_io: bool = False,
                free_cores: int | None = None) -> int:
    """The most DataLoader workers each of ``processes`` training processes should start: its share of the usable
    cores, less one core kept for the training loop itself; loading that waits on IO rather than burning CPU may take
    IO_WORKERS_PER_CORE a core. ``free_cores``: the cores other work leaves free where measured (the monitor); loading
    that burns CPU gets its share of those, never more than the usable cores.

    >>> workers_cap(16, 4), workers_cap(16, 1, free_cores=6), workers_cap(2, 1, free_cores=0)
    (3, 5, 0)
    """
    cores = usable_cores if free_cores is None else max(0, min(usable_cores, free_cores))
    cap = max(0, cores // max(1, processes) - 1)
    return max(cap, IO_WORKERS_PER_CORE * usable_cores // max(1, processes)) if waits_on_io else cap


def suggested_workers(usable_cores: int, gpus: int) -> int:
    """``num_workers`` to start with: on GPUs the cap of each GPU's process (at least 1, at most 8); on a CPU-only
    machine a quarter of the cores, at most 4 (the rest run the model).

    >>> suggested_workers(16, gpus=1), suggested_workers(16, gpus=0)
    (8, 4)
    """
    if gpus:
        return max(1, min(MAX_WORKERS_PER_GPU, workers_cap(usable_cores, gpus)))
    return min(MAX_WORKERS_CPU, usable_cores // 4)


@dataclass(frozen=True, kw_only=True)
class Environment:
    """Everything ``doctor`` and ``gpus --local`` need to know, read once."""

    python_version: tuple[int, int, int]
    os: str  # platform.system(): "Linux", "Windows" or "Darwin"
    machine: str  # platform.machine(): "x86_64", "arm64", ...
    cpu: CpuInfo
    torch: TorchInfo | None  # None when torch does not import
    torch_error: str | None = None
    driver_version: str | None = None  # NVIDIA driver, e.g. "580.82.07"
    driver_cuda: tuple[int, int] | None = None  # newest CUDA the driver supports (nvidia-smi header)
    nvml_devices: tuple[NvmlDevice, ...] = ()
    nvml_error: str | None = None
    triton_version: str | None = None
    triton_error: str | None = None  # why it does not import
    triton_backend_error: str | None = None  # imports, but has no driver for this machine's GPU (probed with one)
    shm_bytes: int | None = None  # size of /dev/shm (DataLoader workers and NCCL use it)
    in_container: bool = False
    variables: Mapping[str, str] = field(default_factory=dict)

    @property
    def gpus(self) -> tuple[TorchDevice, ...]:
        return self.torch.devices if self.torch else ()


# ---------------------------------------------------------------------------------------------
# Probes. Each returns facts or records why it could not; none raises.


def _probe_torch() -> tuple[TorchInfo | None, str | None]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch = importlib.import_module("torch")
        except Exception as exc:  # a broken install raises anything from ImportError to OSError
            return None, first_line(exc)
        try:
            info = _torch_info(torch)
        except Exception as exc:  # a half-broken install: keep what the version says, record why
            info = {"version": getattr(torch, "__version__", "unknown"), "cuda": None, "hip": None,
                    "cuda_error": first_line(exc)}
    seen = tuple(dict.fromkeys(str(w.message).strip() for w in caught))
    return TorchInfo(**{**info, "warnings": seen}), None


def _torch_info(torch) -> dict:
    info: dict = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "triton_pin": _triton_pin(),
    }
    with contextlib.suppress(Exception):
        info["mps_built"] = bool(torch.backends.mps.is_built())
        info["mps_available"] = bool(torch.backends.mps.is_available())
        if info["mps_available"]:
            info["mps_recommended_max_bytes"] = int(torch.mps.recommended_max_memory())
    if not (info["cuda"] or info["hip"]):
        return info
    try:
        available = torch.cuda.is_available()
        info["arch_list"] = tuple(torch.cuda.get_arch_list())
        devices = []
        for i in range(torch.cuda.device_count() if available else 0):
            props = torch.cuda.get_device_properties(i)
            uuid = getattr(props, "uuid", None)
            devices.append(TorchDevice(
                index=i,
                name=props.name,
                total_memory_bytes=int(props.total_memory),
                compute_capability=(props.major, props.minor),
                multiprocessor_count=props.multi_processor_count,
                uuid=str(uuid).removeprefix("GPU-") if uuid is not None else None,
                gcn_arch=getattr(props, "gcnArchName", None) if info["hip"] else None,
            ))
        info["devices"] = tuple(devices)
    except Exception as exc:
        info["cuda_error"] = first_line(exc)
    try:
        info["cudnn_version"] = torch.backends.cudnn.version()
    except Exception as exc:  # torch raises on a cuDNN version mismatch
        info["cudnn_error"] = first_line(exc)
    with contextlib.suppress(Exception):
        version = torch.cuda.nccl.version()
        info["nccl_version"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return info


def _triton_pin() -> str | None:
    """The ``triton==X`` requirement of the installed torch wheel (CUDA wheels on Linux have one)."""
    try:
        requirements = importlib.metadata.requires("torch") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for requirement in requirements:
        match = re.match(r"(?:pytorch-)?triton\s*==\s*([\w.+]+)", requirement)
        if match and "extra ==" not in requirement:
            return match.group(1)
    return None


def _try(call, default=None):
    """One NVML query; a field the device or driver does not support is ``default``, not a crash."""
    try:
        return call()
    except Exception:
        return default


def _nvml_device(session: NvmlSession, index: int) -> NvmlDevice:
    pynvml, handle = session.nvml, session.handle(index)
    memory = _try(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))  # NotSupported on unified-memory parts
    cc = _try(lambda: tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle)))
    processes = []
    for proc in _try(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle), []):
        if proc.pid != os.getpid():  # our own context is not "another process"
            processes.append(GpuProcess(pid=proc.pid, name=_process_name(proc.pid),
                                        used_memory_bytes=getattr(proc, "usedGpuMemory", None)))
    return NvmlDevice(
        index=index,
        name=nvml_text(_try(lambda: pynvml.nvmlDeviceGetName(handle), "unknown NVIDIA GPU")),
        uuid=nvml_text(_try(lambda: pynvml.nvmlDeviceGetUUID(handle), f"unknown-{index}")),
        total_memory_bytes=int(memory.total) if memory else None,
        free_memory_bytes=int(memory.free) if memory else None,
        compute_capability=cc,  # type: ignore[arg-type]
        processes=tuple(processes),
    )


def _probe_nvml(session: NvmlSession | None = None) -> dict:
    """Driver version, the newest CUDA it supports, and every GPU with its processes, via NVML. ``session``: one
    the caller holds (left open); without one, a session is started here and closed."""
    own = session is None
    if session is None:
        try:
            session = NvmlSession.start()
        except Exception as exc:  # no nvidia-ml-py; no driver: NVMLError_LibraryNotFound, DriverNotLoaded, ...
            return {"nvml_error": first_line(exc)}
    pynvml = session.nvml
    found: dict = {}
    try:
        if (driver := _try(pynvml.nvmlSystemGetDriverVersion)) is not None:
            found["driver_version"] = nvml_text(driver)
        if (cuda := _try(pynvml.nvmlSystemGetCudaDriverVersion_v2)) is not None:
            found["driver_cuda"] = (cuda // 1000, (cuda % 1000) // 10)  # 1000 * major + 10 * minor
        devices = []
        for i in range(session.count()):
            try:
                devices.append(_nvml_device(session, i))
            except Exception as exc:  # a lost or fallen-off GPU: note it, keep the others
                found["nvml_error"] = f"GPU {i}: {first_line(exc)}"
        found["nvml_devices"] = tuple(devices)
    except Exception as exc:
        found["nvml_error"] = first_line(exc)
    finally:
        if own:
            session.close()
    return found


def _process_name(pid: int) -> str | None:
    try:
        import psutil

        return psutil.Process(pid).name()
    except Exception:  # another container's pid, or gone
        return None


TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "triton-windows")  # release, nightly, Windows port


def _probe_triton(import_it: bool) -> dict:
    version = None
    for dist in TRITON_DISTRIBUTIONS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            version = importlib.metadata.version(dist)
            break
    if version is None:
        return {"triton_error": "triton is not installed"}
    if import_it:
        try:
            triton = importlib.import_module("triton")
        except Exception as exc:
            return {"triton_version": version, "triton_error": first_line(exc)}
        try:  # what a kernel launch needs first: the GPU's driver, and its launcher built by a C compiler
            triton.runtime.driver.active.get_current_target()
        except Exception as exc:  # RuntimeError "0 active drivers" without one; a compiler's error without gcc
            return {"triton_version": version, "triton_backend_error": first_line(exc)}
    return {"triton_version": version}


def _cpu_model(os_name: str) -> str:
    if os_name == "Linux":
        with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    if os_name == "Darwin":
        with contextlib.suppress(Exception):
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                 capture_output=True, text=True, timeout=5, check=True)
            return out.stdout.strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def _read_first(*paths: str) -> str | None:
    for path in paths:
        with contextlib.suppress(OSError), open(path, encoding="utf-8") as f:
            return f.read().strip()
    return None


def _memory_limit_bytes() -> int | None:
    """A container's memory limit (cgroup v2, else v1), if one is set."""
    text = _read_first("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
    with contextlib.suppress(TypeError, ValueError):
        limit = int(text)  # type: ignore[arg-type]
        return limit if limit < 2**60 else None  # v1 writes a huge number for "no limit"
    return None


def _cpu_quota() -> int | None:
    """A container's CPU quota in whole cores (cgroup v2 cpu.max, else v1 cfs quota), if one is set."""
    v2 = _read_first("/sys/fs/cgroup/cpu.max")
    parts = v2.split() if v2 else [_read_first("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") or "max",
                                   _read_first("/sys/fs/cgroup/cpu/cpu.cfs_period_us") or "100000"]
    with contextlib.suppress(ValueError, IndexError, ZeroDivisionError):
        quota, period = int(parts[0]), int(parts[1])  # "max" (v2) or -1 (v1) means none
        return max(1, math.ceil(quota / period)) if quota > 0 else None
    return None


def usable_cores() -> int:
    """Cores this process may use: its affinity where the OS has one, capped by a container's CPU quota; at least 1.
    The one count doctor's advice, train's default workers and the monitor's input-bound cap all read."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if (quota := _cpu_quota()) is not None:
        usable = min(usable, quota)
    return max(1, usable)


def _probe_cpu(os_name: str) -> CpuInfo:
    import psutil

    memory = psutil.virtual_memory()
    total, available = int(memory.total), int(memory.available)
    if (limit := _memory_limit_bytes()) is not None and limit < total:
        total, available = limit, min(available, limit)
    logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    return CpuInfo(
        model=_cpu_model(os_name),
        physical_cores=psutil.cpu_count(logical=False),
        logical_cores=logical,
        usable_cores=usable_cores(),
        memory_total_bytes=total,
        memory_available_bytes=available,
    )


def gather_environment(environ: Mapping[str, str], *, nvml: NvmlSession | None = None) -> Environment:
    """Read the whole stack once: Python, CPU, torch and its devices, the driver (NVML), Triton. ``nvml``: an
    NVML session the caller holds and shares (the monitor's); without one, one is started and closed here.

    >>> env = gather_environment(os.environ)
    >>> env.torch.version  # doctest: +SKIP
    '2.13.0+cpu'
    """
    os_name = platform.system()
    torch_info, torch_error = _probe_torch()
    found_nvml = _probe_nvml(nvml)
    has_cuda_gpu = bool(torch_info and torch_info.cuda and torch_info.devices)
    shm = None
    with contextlib.suppress(OSError):
        shm = shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else None
    return Environment(
        python_version=tuple(sys.version_info[:3]),  # type: ignore[arg-type]
        os=os_name,
        machine=platform.machine(),
        cpu=_probe_cpu(os_name),
        torch=torch_info,
        torch_error=torch_error,
        **found_nvml,
        **_probe_triton(import_it=has_cuda_gpu),
        shm_bytes=shm,
        in_container=os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv"),
        variables={k: environ[k] for k in RELEVANT_VARIABLES if k in environ},
    )
