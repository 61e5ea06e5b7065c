from dataclasses import replace

from fakes.environments import cpu_env, cuda_env, nvml
from gpuwise.environment import TorchInfo
from gpuwise.hardware.catalog import load_catalog
from gpuwise.hardware.detect import describe_local
from gpuwise.units import GiB

CATALOG = load_catalog()


def test_cuda_gpus_are_merged_with_nvml_by_uuid_and_matched():
    env = cuda_env(count=2)
    # NVML numbers GPUs by PCI bus, torch by speed: give them in reverse order, with different free memory.
    env = replace(env, nvml_devices=(nvml(index=1, free=10 * GiB), nvml(index=0, free=70 * GiB)))
    machine = describe_local(env, CATALOG)
    gpus = [d for d in machine.devices if d.backend == "cuda"]
    assert [(d.index, d.memory_free_bytes) for d in gpus] == [(0, 70 * GiB), (1, 10 * GiB)]
    assert all(d.catalog_match.key == "h100-sxm" and d.arch == "sm_90" for d in gpus)
    assert machine.devices[-1].backend == "cpu"
    assert machine.torch_build == "CUDA 13.0"


def test_gpus_torch_cannot_use_are_still_shown():
    env = cpu_env(nvml_devices=(nvml("NVIDIA GeForce RTX 4090", (8, 9), 24 * GiB),), driver_version="550.54.14")
    gpu = describe_local(env, CATALOG).devices[0]
    assert gpu.index is None and gpu.catalog_match.key == "rtx-4090" and "not usable" in gpu.note


def test_apple_mps_is_matched_by_chip_name():
    info = TorchInfo(version="2.13.0", cuda=None, hip=None, mps_built=True, mps_available=True,
                     mps_recommended_max_bytes=96 * GiB)
    env = cpu_env(torch=info, os="Darwin", machine="arm64", cpu=replace(cpu_env().cpu, model="Apple M3 Max"))
    mps = describe_local(env, CATALOG).devices[0]
    assert (mps.backend, mps.catalog_match.key, mps.memory_free_bytes) == ("mps", "m3-max-40c", 96 * GiB)


def test_cpu_only_machine_lists_the_cpu():
    machine = describe_local(cpu_env(), CATALOG)
    assert [d.backend for d in machine.devices] == ["cpu"]
    assert machine.devices[0].memory_total_bytes == 256 * GiB
    assert machine.devices[0].note == "32 cores / 64 threads (16 usable)"
