"""The snapshot on this real machine, and each probe's failure path."""

import importlib
import importlib.metadata
import os
import sys

import psutil
import pytest
import torch

from fakes.nvml import ProbeNvml
from gpuwise import environment
from gpuwise.environment import gather_environment


@pytest.fixture(scope="module")
def env():
    return gather_environment({"CUDA_VISIBLE_DEVICES": "0", "HOME": "/root", "PYTORCH_ALLOC_CONF": "x:y"})


def test_snapshot_matches_what_torch_and_psutil_say(env):
    assert env.torch.version == torch.__version__
    assert env.torch.cuda == torch.version.cuda
    assert env.torch.float32_matmul_precision == torch.get_float32_matmul_precision()
    assert len(env.gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert env.cpu.logical_cores == psutil.cpu_count(logical=True)
    assert env.cpu.usable_cores == len(os.sched_getaffinity(0))
    assert 0 < env.cpu.memory_available_bytes <= env.cpu.memory_total_bytes <= psutil.virtual_memory().total


def test_snapshot_keeps_only_relevant_variables(env):
    assert env.variables == {"CUDA_VISIBLE_DEVICES": "0", "PYTORCH_ALLOC_CONF": "x:y"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_cpu_machine_has_no_driver(env):
    assert env.driver_version is None and env.nvml_devices == ()
    assert env.nvml_error  # says why: no NVML library, no driver, ...


def test_a_broken_torch_import_is_recorded_not_raised(monkeypatch):
    real = importlib.import_module

    def fake_import(name, *args):
        if name == "torch":
            raise OSError("libcudnn.so.9: cannot open shared object file: No such file or directory")
        return real(name, *args)

    monkeypatch.setattr(environment.importlib, "import_module", fake_import)
    info, error = environment._probe_torch()
    assert info is None and error.startswith("OSError: libcudnn.so.9")


def test_triton_pin_is_read_from_torch_requirements(monkeypatch):
    monkeypatch.setattr(environment.importlib.metadata, "requires", lambda name: [
        "filelock", 'triton==3.6.0; platform_system == "Linux"', 'optree>=0.13.0; extra == "optree"'])
    assert environment._triton_pin() == "3.6.0"
    monkeypatch.setattr(environment.importlib.metadata, "requires", lambda name: ["filelock"])
    assert environment._triton_pin() is None


def test_missing_nvml_is_recorded(monkeypatch):
    import pynvml

    def no_driver():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    assert "nvml_error" in environment._probe_nvml()


def test_one_failing_nvml_query_loses_only_its_field(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", ProbeNvml())
    found = environment._probe_nvml()
    assert found["driver_version"] == "580.82.07" and found["driver_cuda"] == (13, 0)
    (dev,) = found["nvml_devices"]  # the lost GPU is noted, the other kept
    assert (dev.name, dev.compute_capability, dev.total_memory_bytes) == ("NVIDIA H100 80GB HBM3", (9, 0), None)
    assert "GPU 1" in found["nvml_error"]


@pytest.mark.parametrize(
    ("files", "cores", "memory"),
    [
        ({"/sys/fs/cgroup/cpu.max": "200000 100000", "/sys/fs/cgroup/memory.max": "8589934592"}, 2, 8 * 2**30),
        ({"/sys/fs/cgroup/cpu.max": "150000 100000"}, 2, None),  # 1.5 CPUs: round up
        ({"/sys/fs/cgroup/cpu.max": "max 100000", "/sys/fs/cgroup/memory.max": "max"}, None, None),
        ({"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "400000", "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000",
          "/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712"}, 4, None),  # v1, no memory limit
        ({"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1"}, None, None),
        ({}, None, None),
    ],
)
def test_container_limits_are_read_from_cgroups(monkeypatch, files, cores, memory):
    monkeypatch.setattr(environment, "_read_first", lambda *paths: next((files[p] for p in paths if p in files), None))
    assert environment._cpu_quota() == cores
    assert environment._memory_limit_bytes() == memory


def test_triton_distributions_are_all_looked_up(monkeypatch):
    def version(name):
        if name == "triton-windows":
            return "3.6.0.post21"
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(environment.importlib.metadata, "version", version)
    assert environment._probe_triton(import_it=False) == {"triton_version": "3.6.0.post21"}


def test_triton_missing_is_recorded(monkeypatch):
    def not_found(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(environment.importlib.metadata, "version", not_found)
    assert environment._probe_triton(import_it=True) == {"triton_error": "triton is not installed"}


def test_triton_without_a_usable_driver_is_recorded(monkeypatch):
    """What Triton 3.x raises on a machine without a GPU it has a driver for, as the GPU probe records it."""
    import types

    def no_driver():
        raise RuntimeError("0 active drivers ([]). There should only be one.")

    fake = types.SimpleNamespace(runtime=types.SimpleNamespace(driver=types.SimpleNamespace(
        active=types.SimpleNamespace(get_current_target=no_driver))))
    monkeypatch.setattr(environment.importlib.metadata, "version", lambda name: "3.6.0")
    monkeypatch.setattr(environment.importlib, "import_module", lambda name: fake)
    assert environment._probe_triton(import_it=True) == {
        "triton_version": "3.6.0",
        "triton_backend_error": "RuntimeError: 0 active drivers ([]). There should only be one."}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton installed")
def test_real_triton_probe_agrees_with_the_machine():
    """The real Triton: with a CUDA GPU its driver loads; without one it says it has no active driver."""
    import torch

    probe = environment._probe_triton(import_it=True)
    assert probe["triton_version"] and "triton_error" not in probe
    assert ("triton_backend_error" in probe) is (not torch.cuda.is_available())


@pytest.mark.requires_cuda
def test_real_gpu_snapshot_agrees_with_nvml_and_the_catalog(env):
    from gpuwise.doctor import diagnose
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.hardware.detect import describe_local

    assert env.driver_version and env.nvml_devices and env.gpus
    nvml_uuids = {d.uuid.removeprefix("GPU-") for d in env.nvml_devices}
    assert all(dev.uuid in nvml_uuids for dev in env.gpus)  # torch and NVML name the same cards
    assert env.torch.cudnn_version and env.torch.nccl_version
    machine = describe_local(env, load_catalog())
    for dev in machine.devices:
        if dev.name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
            assert dev.catalog_match is not None and dev.memory_free_bytes is not None
    assert not diagnose(env).failed, [f for f in diagnose(env).findings if f.status == "fail"]


def test_one_dataloader_workers_rule():
    from gpuwise.environment import suggested_workers, workers_cap

    assert (workers_cap(16, 4), workers_cap(2), workers_cap(1), workers_cap(3, 8)) == (3, 1, 0, 0)
    assert (suggested_workers(16, 1), suggested_workers(16, 4), suggested_workers(64, 2)) == (8, 3, 8)
    assert suggested_workers(2, 1) == 1  # a GPU always gets one worker
    assert (suggested_workers(16, 0), suggested_workers(2, 0), suggested_workers(64, 0)) == (4, 0, 4)


def test_loading_that_waits_on_io_may_take_more_workers_than_cores():
    """PyTorch's DataLoader warns past its suggested max but runs: sleeping or disk-bound loaders gain from 4 a core."""
    from gpuwise.environment import workers_cap

    assert workers_cap(16, 4, waits_on_io=True) == 16  # 4 cores each, 4 workers a core
    assert workers_cap(2, 1, waits_on_io=True) == 8 > workers_cap(2, 1) == 1
