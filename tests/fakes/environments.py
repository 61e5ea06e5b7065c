"""Hand-made environments: a CPU-only machine and CUDA machines with N identical GPUs, as ``environment``
gathers them; every doctor branch is tested on one of these."""

from __future__ import annotations

from dataclasses import replace

from gpuwise.environment import CpuInfo, Environment, GpuProcess, NvmlDevice, TorchDevice, TorchInfo
from gpuwise.stack import driver_max_cuda, parse_version
from gpuwise.units import GiB

CPU = CpuInfo(model="AMD EPYC 9654 96-Core Processor", physical_cores=32, logical_cores=64, usable_cores=16,
              memory_total_bytes=256 * GiB, memory_available_bytes=200 * GiB)
# Arch lists as torch.cuda.get_arch_list() prints them for official Linux wheels (RELEASE.md).
ARCHS_CU126 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
ARCHS_CU130 = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120")


def cpu_env(**changes) -> Environment:
    """A Linux machine with the CPU build of torch and no GPU."""
    env = Environment(
        python_version=(3, 12, 3), os="Linux", machine="x86_64", cpu=CPU,
        torch=TorchInfo(version="2.13.0+cpu", cuda=None, hip=None),
        nvml_error="NVMLError_LibraryNotFound: NVML Shared Library Not Found",
        shm_bytes=64 * GiB,
    )
    return replace(env, **changes)


def gpu(name="NVIDIA H100 80GB HBM3", cc=(9, 0), memory=80 * GiB, index=0, uuid=None) -> TorchDevice:
    return TorchDevice(index=index, name=name, total_memory_bytes=memory, compute_capability=cc,
                       multiprocessor_count=132, uuid=uuid or f"0000000{index}-aaaa-bbbb-cccc-dddddddddddd")


def nvml(name="NVIDIA H100 80GB HBM3", cc=(9, 0), memory=80 * GiB, free=None, index=0,
         processes=()) -> NvmlDevice:
    return NvmlDevice(index=index, name=name, uuid=f"GPU-0000000{index}-aaaa-bbbb-cccc-dddddddddddd",
                      total_memory_bytes=memory, free_memory_bytes=memory if free is None else free,
                      compute_capability=cc, processes=tuple(processes))


def cuda_env(*, name="NVIDIA H100 80GB HBM3", cc=(9, 0), count=1, driver="580.82.07", cuda="13.0",
             archs=ARCHS_CU130, torch_changes=None, **changes) -> Environment:
    """A Linux machine with `count` identical NVIDIA GPUs that a CUDA build of torch sees."""
    info = TorchInfo(
        version=f"2.13.0+cu{cuda.replace('.', '')}", cuda=cuda, hip=None, arch_list=archs,
        devices=tuple(gpu(name, cc, index=i) for i in range(count)),
        cudnn_version=92000, nccl_version="2.28.9", float32_matmul_precision="high", triton_pin="3.6.0",
    )
    env = cpu_env(
        torch=replace(info, **(torch_changes or {})), driver_version=driver,
        driver_cuda=driver_max_cuda(parse_version(driver)),
        nvml_devices=tuple(nvml(name, cc, index=i) for i in range(count)), nvml_error=None,
        triton_version="3.6.0",
    )
    return replace(env, **changes)

__all__ = ["ARCHS_CU126", "ARCHS_CU130", "CPU", "GpuProcess", "cpu_env", "cuda_env", "gpu", "nvml"]
