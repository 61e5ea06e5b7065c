"""hardware/device.py: the default device and the catalog row of each device, decided once for every command."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from conftest import run_cli
from fakes.environments import cpu_env, cuda_env, gpu, nvml
from gpuwise.environment import TorchInfo
from gpuwise.errors import GpuwiseError
from gpuwise.hardware import device as hw
from gpuwise.hardware.catalog import load_catalog
from gpuwise.hardware.detect import bf16_capable, describe_local
from gpuwise.units import GiB

CATALOG = load_catalog()
A100 = "NVIDIA A100-SXM4-80GB"


def two_gpu_machine():
    """GPU 0 an H100, GPU 1 an A100: two different catalog rows, so a wrong index shows."""
    env = cuda_env(count=2)
    devices = (gpu(index=0), gpu(A100, (8, 0), index=1))
    env = replace(env, torch=replace(env.torch, devices=devices),
                  nvml_devices=(nvml(index=0), nvml(A100, (8, 0), index=1)))
    return describe_local(env, CATALOG)


def test_each_cuda_index_gets_its_own_row():
    machine = two_gpu_machine()
    assert hw.resolve_device("cuda:1", machine).row.key == "a100-80gb-sxm"
    assert hw.resolve_device("cuda:0", machine).row.key == "h100-sxm"
    assert hw.resolve_device("cuda", machine).name == "cuda:0"  # torch's "cuda" is the current device, 0
    assert hw.resolve_device(None, machine).row.key == "h100-sxm"
    assert hw.resolve_device("cpu", machine).row is None


def test_default_device_prefers_a_gpu_then_mps_then_the_cpu():
    assert hw.default_device(two_gpu_machine()) == "cuda:0"
    mps = cpu_env(os="Darwin", machine="arm64",
                  torch=TorchInfo(version="2.13.0", cuda=None, hip=None, mps_available=True))
    assert hw.default_device(describe_local(mps, CATALOG)) == "mps"
    assert hw.default_device(describe_local(cpu_env(), CATALOG)) == "cpu"
    # A GPU torch cannot use (NVML sees it, torch does not) is not a default.
    unusable = cpu_env(nvml_devices=(nvml("NVIDIA GeForce RTX 4090", (8, 9), 24 * GiB),), driver_version="550.54.14")
    assert hw.default_device(describe_local(unusable, CATALOG)) == "cpu"


@pytest.mark.parametrize(("name", "message"), [
    ("cuda:2", "there are 2 CUDA GPUs"),
    ("mps", "no Apple GPU"),
    ("xla", "not a device gpuwise can time"),
    ("cuda:x", "is not a device name"),
])
def test_bad_devices_are_one_line_errors(name, message):
    with pytest.raises(GpuwiseError, match=message):
        hw.resolve_device(name, two_gpu_machine())


def test_no_gpu_for_cuda():
    with pytest.raises(GpuwiseError, match="torch sees no CUDA GPU"):
        hw.resolve_device("cuda", describe_local(cpu_env(), CATALOG))


@pytest.mark.parametrize(("name", "cc", "bf16", "precision"), [
    ("NVIDIA H100 80GB HBM3", (9, 0), True, "bf16-mixed"),
    ("NVIDIA A100-SXM4-80GB", (8, 0), True, "bf16-mixed"),
    ("Tesla V100-SXM2-32GB", (7, 0), False, "fp16-mixed"),  # Volta: no bf16 tensor cores
    ("Tesla T4", (7, 5), False, "fp16-mixed"),
])
def test_default_precision_follows_the_architecture(name, cc, bf16, precision):
    machine = describe_local(cuda_env(name=name, cc=cc), CATALOG)
    target = hw.resolve_device(None, machine)
    assert (target.bf16, target.precision) == (bf16, precision)
    assert hw.resolve_device("cpu", machine).precision == "fp32"


def test_bf16_rule():
    assert bf16_capable("cuda", "sm_80") and bf16_capable("cuda", "sm_120") and not bf16_capable("cuda", "sm_75")
    assert bf16_capable("rocm", "gfx942") and not bf16_capable("rocm", "gfx908")  # MI300 yes, MI100 no
    assert not bf16_capable("cpu", "x86_64") and not bf16_capable("cuda", None)


def test_plan_device_picks_that_gpus_remedies(capsys, monkeypatch):
    """``plan --device cuda:1`` plans max batch and remedies for GPU 1's row, the default for GPU 0's."""
    monkeypatch.setattr(hw, "local_machine", lambda environ: two_gpu_machine())
    args = ["plan", "--model", "gpt2", "--seq", "128", "--batch", "2", "--json"]
    code, out, err = run_cli(capsys, *args, "--device", "cuda:1")
    assert code == 0, err
    assert json.loads(out)["gpu"] == "a100-80gb-sxm"
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    assert json.loads(out)["gpu"] == "h100-sxm"
    code, _, err = run_cli(capsys, *args, "--device", "cuda:1", "--gpu", "rtx-4090")
    assert code == 2 and "give one" in err
