"""Builders for hand-made environments: every doctor branch is tested on one of these."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run interpreted on the CPU (set before they are defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


__all__ = ["ARCHS_CU126", "ARCHS_CU130", "CPU", "GpuProcess", "cpu_env", "cuda_env", "gpu", "nvml", "run_cli"]


def run_cli(capsys, *args):
    """Run ``gpuwise *args`` in-process: (exit code, stdout, stderr)."""
    from gpuwise import cli

    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="session")
def _capture_seed(tmp_path_factory):
    """Captures shared between the tests of one session (one xdist worker), read-only to them: only a test that has
    patched nothing writes here (see _own_cache_folder)."""
    return tmp_path_factory.mktemp("capture-seed")


def _patched(monkeypatch, cache_module) -> bool:
    """Whether the test has patched anything a capture could depend on: an attribute (a function, a flag) other than
    the cache's load and store (ours), or a dict item other than an environment variable. Environment variables do
    not reach the capture (no ``os.environ`` below the CLI; the cache's own switches, XDG_CACHE_HOME and
    GPUWISE_CACHE, are read by ``folder()``)."""
    # pytest's own undo lists: (object, name, old value) and (dict, key, old value)
    return (any(not (obj is cache_module and name in ("load", "store")) for obj, name, _ in monkeypatch._setattr)
            or any(d is not os.environ for d, _, _ in monkeypatch._setitem))


@pytest.fixture(autouse=True)
def _own_cache_folder(request, tmp_path_factory, monkeypatch, _capture_seed):
    """Each test has its own cache folder: it never reads or writes the user's ~/.cache/gpuwise (calibrations from
    gpuwise bench, captures), and no capture one test writes can change what another sees.

    The suite plans the same models again and again, so captures are also kept for the session, as a user's are kept
    between runs (the key is every byte of gpuwise's source, torch's version, the model and the setup, and
    test_capture_cache checks a kept capture equals a fresh one): a capture the test's own folder lacks is read from
    the session's seed, and one the test makes is added to the seed, but only while the test has patched nothing
    (``_patched``). A test that patches something captures afresh and keeps its captures to itself, so a flag it
    flips (or a function it replaces) never reaches, nor is hidden by, another test's capture. Tests of the cache
    itself (marker own_captures) see the library's cache untouched, starting empty."""
    cache = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    if request.node.get_closest_marker("own_captures") is not None:
        return
    import gpuwise.planning.capture.cache as capture_cache

    load, store = capture_cache.load, capture_cache.store

    def shared() -> bool:  # the seed is read and written while the cache is on and the test has patched nothing
        return capture_cache.folder() is not None and not _patched(monkeypatch, capture_cache)

    def layered_load(name, where=None):
        hit = load(name, where)
        return load(name, _capture_seed) if hit is None and where is None and shared() else hit

    def layered_store(name, capture, where=None):
        store(name, capture, where)
        if where is None and shared():
            store(name, capture, _capture_seed)

    monkeypatch.setattr(capture_cache, "load", layered_load)
    monkeypatch.setattr(capture_cache, "store", layered_store)


@pytest.fixture
def tmp_catalog_text() -> str:
    return '''
[[accelerator]]
key = "x1"
name = "Example X1"
vendor = "NVIDIA"
segment = "datacenter"
arch = "Test"
aliases = ["x1 sxm"]
memory_gib = 10
peak_tflops = { bf16 = 100.0 }
source = "https://example.com/x1"
'''


def pytest_collection_modifyitems(config, items):
    """Tests marked requires_cuda run only where torch sees a CUDA GPU (benchmarks/gpu_check.sh)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)
