"""Every branch of every doctor check, on hand-built environments."""

from dataclasses import replace

import pytest

from fakes.environments import ARCHS_CU126, ARCHS_CU130, cpu_env, cuda_env, gpu, nvml
from gpuwise.doctor import (
    check_alloc_conf,
    check_arch,
    check_attention_kernels,
    check_cudnn,
    check_dataloader,
    check_driver,
    check_gpu,
    check_gpu_memory,
    check_nccl,
    check_precision,
    check_python,
    check_torch,
    check_triton,
    diagnose,
    recommended_workers,
)
from gpuwise.environment import GpuProcess, TorchInfo
from gpuwise.units import GiB, MiB


def by_check(report):
    return {f.check: f for f in report.findings}


# --- whole reports ------------------------------------------------------------------------------


def test_cpu_only_machine_gets_one_plain_explanation_not_a_wall_of_failures():
    report = diagnose(cpu_env())
    assert report.exit_code == 0
    statuses = {f.check: f.status for f in report.findings}
    assert statuses == {"python": "ok", "torch": "ok", "gpu": "warn", "attention": "ok", "dataloader": "ok"}
    gpu_finding = by_check(report)["gpu"]
    assert "no GPU" in gpu_finding.message and "CPU build" in gpu_finding.message
    assert "--index-url https://download.pytorch.org/whl/cu130" in gpu_finding.fix


def test_healthy_h100_machine_is_all_ok():
    report = diagnose(cuda_env())
    assert [f.status for f in report.findings] == ["ok"] * len(report.findings)
    assert {f.check for f in report.findings} == {
        "python", "torch", "driver", "gpu", "arch", "precision", "cudnn", "nccl", "gpu_memory", "alloc_conf",
        "triton", "attention", "dataloader"}  # fmt: skip
    assert report.exit_code == 0


def test_any_failure_makes_exit_code_1():
    report = diagnose(cuda_env(driver="535.104.05"))
    assert report.failed and report.exit_code == 1


# --- python and torch -------------------------------------------------------------------------


def test_python():
    old = check_python(cpu_env(python_version=(3, 9, 18)))
    assert old.status == "fail" and "needs Python >= 3.10" in old.message
    eol = check_python(cpu_env(python_version=(3, 10, 13)))  # PEP 619: end of life October 2026
    assert eol.status == "warn" and "end of life" in eol.message
    assert check_python(cpu_env()).status == "ok"


def test_torch_missing_or_broken():
    missing = check_torch(cpu_env(torch=None, torch_error="ModuleNotFoundError: No module named 'torch'"))
    assert missing.status == "fail" and "pip install torch==2.13.0" in missing.fix
    broken = check_torch(cpu_env(torch=None, torch_error="OSError: libcudnn.so.9: cannot open shared object"))
    assert broken.status == "fail" and "LD_LIBRARY_PATH" in broken.fix


def test_torch_too_old():
    old = check_torch(cpu_env(torch=TorchInfo(version="2.4.1+cu121", cuda="12.1", hip=None)))
    assert old.status == "fail" and ">= 2.5" in old.message


def test_cpu_build_on_a_gpu_machine_fails_with_the_right_wheel():
    env = cpu_env(nvml_devices=(nvml("NVIDIA GeForce RTX 4090", (8, 9), 24 * GiB),),
                  driver_version="550.54.14", driver_cuda=(12, 4), nvml_error=None)
    finding = check_torch(env)
    assert finding.status == "fail"
    assert "CPU-only build" in finding.message and "RTX 4090" in finding.message
    # R550 supports CUDA 12.4: of torch 2.13's cu126/cu130/cu132, only cu126 runs (minor-version compat).
    assert finding.fix == "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
    assert check_gpu(env) is None  # said once, by the torch check
    assert diagnose(env).exit_code == 1


def test_builds_are_named():
    assert "CUDA 13.0" in check_torch(cuda_env()).message
    rocm = cpu_env(torch=TorchInfo(version="2.13.0+rocm7.2", cuda=None, hip="7.2.26015"))
    assert "ROCm 7.2" in check_torch(rocm).message


# --- driver ----------------------------------------------------------------------------------


def test_driver_too_old_for_the_build():
    env = cuda_env(driver="535.104.05")  # R535 = CUDA 12.2; the cu130 wheel needs >= 580.65.06
    finding = check_driver(env)
    assert finding.status == "fail"
    assert "too old" in finding.message and "580.65.06" in finding.message
    assert "whl/cu126" in finding.fix  # what this driver can run instead


def test_driver_under_minor_version_compatibility_warns():
    env = cuda_env(cuda="13.2", driver="580.82.07")  # floor 580.65.06 met, toolkit driver 595.45.04 not
    finding = check_driver(env)
    assert finding.status == "warn"
    assert "minor-version compatibility" in finding.message and "595.45.04" in finding.fix


def test_driver_ok():
    finding = check_driver(cuda_env(driver="580.82.07"))
    assert finding.status == "ok" and "supports CUDA <= 13.0" in finding.message


def test_driver_floor_on_windows():
    low = cuda_env(cuda="12.6", archs=ARCHS_CU126, driver="526.98", os="Windows")
    assert check_driver(low).status == "fail"  # Windows floor for 12.x is 527.41
    mid = cuda_env(cuda="12.6", archs=ARCHS_CU126, driver="531.14", os="Windows")
    assert check_driver(mid).status == "warn"  # runs, below the 12.6 toolkit driver 560.76


def test_windows_cu13x_needs_the_r580_branch():
    env = cuda_env(cuda="13.0", driver="560.94", os="Windows")
    finding = check_driver(env)
    assert finding.status == "fail" and "too old" in finding.message
    assert finding.fix.endswith("whl/cu126")
    assert check_driver(cuda_env(cuda="13.0", driver="581.57", os="Windows")).status == "ok"


def test_driver_reporting_an_older_cuda_major_is_too_old_whatever_the_version_says():
    # NVML's own answer (the nvidia-smi header) wins: a 12.x driver cannot run a 13.x build.
    env = cuda_env(cuda="13.0", driver="580.82.07", driver_cuda=(12, 9))
    assert check_driver(env).status == "fail"


@pytest.mark.parametrize(("name", "cc"), [("NVIDIA B300", (10, 3)), ("NVIDIA GB10", (12, 1))])
def test_newer_minors_of_blackwell_need_r570_too(name, cc):
    env = cuda_env(name=name, cc=cc, cuda="12.6", archs=ARCHS_CU126, driver="560.35.03")
    assert check_driver(env).status == "fail"


def test_blackwell_needs_an_r570_driver_whatever_the_build():
    env = cuda_env(name="NVIDIA GeForce RTX 5090", cc=(12, 0), cuda="12.6", archs=ARCHS_CU126, driver="560.35.03")
    finding = check_driver(env)
    assert finding.status == "fail" and "570.26" in finding.message


def test_no_driver_on_a_cuda_build_without_gpu_is_a_plain_warning():
    env = cpu_env(torch=TorchInfo(version="2.13.0+cu130", cuda="13.0", hip=None))
    assert check_driver(env) is None
    finding = check_gpu(env)
    assert finding.status == "warn"
    assert "no NVIDIA GPU or driver found" in finding.message
    assert "580.65.06" in finding.fix and "whl/cpu" in finding.fix
    assert diagnose(env).exit_code == 0


def test_driver_unknown_while_torch_sees_gpus():
    env = cuda_env(driver_version=None, nvml_devices=(), nvml_error="NVMLError_LibraryNotFound")
    assert check_driver(env).status == "warn"


# --- GPU visibility -------------------------------------------------------------------------


def test_cuda_visible_devices_hiding_every_gpu():
    env = cuda_env(count=2, torch_changes={"devices": ()}, variables={"CUDA_VISIBLE_DEVICES": ""})
    finding = check_gpu(env)
    assert finding.status == "fail"
    assert "CUDA_VISIBLE_DEVICES=''" in finding.message and "unset CUDA_VISIBLE_DEVICES" in finding.fix


def test_cuda_visible_devices_hiding_some_gpus_is_noted():
    env = cuda_env(count=2, torch_changes={"devices": (gpu(),)}, variables={"CUDA_VISIBLE_DEVICES": "0"})
    finding = check_gpu(env)
    assert finding.status == "ok" and "hides 1 more" in finding.message


def test_driver_sees_gpus_torch_does_not():
    env = cuda_env(torch_changes={
        "devices": (),
        "warnings": ("CUDA initialization: The NVIDIA driver on your system is too old (found version 12020)",)})
    finding = check_gpu(env)
    assert finding.status == "fail" and "found version 12020" in finding.message


def test_gpus_listed_with_counts():
    assert "NVIDIA H100 80GB HBM3 x8" in check_gpu(cuda_env(count=8)).message


def test_rocm_gpu_visible_and_missing():
    rocm = TorchInfo(version="2.13.0+rocm7.2", cuda=None, hip="7.2.26015", arch_list=("gfx90a", "gfx942"),
                     devices=(replace(gpu("AMD Instinct MI300X", (9, 4)), gcn_arch="gfx942:sramecc+:xnack-"),),
                     cudnn_version=3004000, nccl_version="2.27.3")
    env = cpu_env(torch=rocm)
    assert check_gpu(env).status == "ok" and "ROCm 7.2" in check_gpu(env).message
    assert check_arch(env).status == "ok"
    assert check_precision(env).status == "ok" and "bf16" in check_precision(env).message
    assert check_cudnn(env).message.startswith("MIOpen")
    assert check_nccl(env).message == "RCCL 2.27.3"
    none = cpu_env(torch=replace(rocm, devices=()))
    assert check_gpu(none).status == "fail" and "render groups" in check_gpu(none).fix


def test_rocm_arch_missing_suggests_the_override():
    rocm = TorchInfo(version="2.13.0+rocm7.2", cuda=None, hip="7.2.26015", arch_list=("gfx90a", "gfx942"),
                     devices=(replace(gpu("AMD Radeon RX 6700 XT", (10, 3)), gcn_arch="gfx1031"),))
    finding = check_arch(cpu_env(torch=rocm))
    assert finding.status == "fail" and "HSA_OVERRIDE_GFX_VERSION=10.3.0" in finding.fix


def test_mps_available_and_not():
    mac = dict(os="Darwin", machine="arm64")
    info = TorchInfo(version="2.13.0", cuda=None, hip=None, mps_built=True, mps_available=True,
                     mps_recommended_max_bytes=96 * GiB)
    finding = check_gpu(cpu_env(torch=info, **mac))
    assert finding.status == "ok" and "MPS" in finding.message and "96 GiB" in finding.message
    off = check_gpu(cpu_env(torch=replace(info, mps_available=False), **mac))
    assert off.status == "warn" and "arm64" in off.fix
    assert diagnose(cpu_env(torch=info, **mac)).exit_code == 0


# --- architecture ---------------------------------------------------------------------------


def test_arch_missing_from_the_wheel():
    env = cuda_env(name="NVIDIA GeForce RTX 5090", cc=(12, 0), cuda="12.6", archs=ARCHS_CU126, driver="580.82.07")
    finding = check_arch(env)
    assert finding.status == "fail"
    assert "sm_120" in finding.message and "no kernel image is available" in finding.message
    assert finding.fix.endswith("whl/cu130")


def test_arch_covered_by_same_major_sass():
    env = cuda_env(name="NVIDIA L4", cc=(8, 9), archs=ARCHS_CU130)  # sm_86 SASS runs on 8.9
    assert check_arch(env).status == "ok"


def test_arch_only_through_ptx():
    ptx_only = ("sm_80", "sm_90", "compute_90")
    env = cuda_env(name="NVIDIA B200", cc=(10, 0), archs=ptx_only, driver="580.82.07")
    assert check_arch(env).status == "warn" and "PTX JIT" in check_arch(env).message
    # PTX from CUDA 13.0 cannot be JIT-compiled by an older driver: then it is a failure.
    old = cuda_env(name="NVIDIA B200", cc=(10, 0), archs=ptx_only, driver="575.51.03")
    assert check_arch(old).status == "fail"


def test_arch_specific_code_does_not_cover_a_later_minor():
    env = cuda_env(name="NVIDIA B300", cc=(10, 3), archs=("sm_90", "sm_100a"))
    assert check_arch(env).status == "fail"
    assert check_arch(cuda_env(name="NVIDIA B300", cc=(10, 3), archs=("sm_90", "sm_100"))).status == "ok"


def test_volta_on_cu130_fails_and_points_to_cu126():
    env = cuda_env(name="Tesla V100-SXM2-32GB", cc=(7, 0), archs=ARCHS_CU130)
    finding = check_arch(env)
    assert finding.status == "fail" and finding.fix.endswith("whl/cu126")


# --- precision ------------------------------------------------------------------------------


def test_tf32_off_warns_with_the_catalog_rates():
    env = cuda_env(name="NVIDIA A100-SXM4-80GB", cc=(8, 0), torch_changes={"float32_matmul_precision": "highest"})
    finding = check_precision(env)
    assert finding.status == "warn" and "TF32 matmul is off" in finding.message
    assert "19.5 vs 156 TFLOPS" in finding.message  # A100 datasheet: FP32 19.5, TF32 156 dense
    assert "set_float32_matmul_precision('high')" in finding.fix


def test_tf32_on_is_ok():
    assert check_precision(cuda_env()).status == "ok"


def test_pre_ampere_gets_fp16_advice():
    finding = check_precision(cuda_env(name="Tesla T4", cc=(7, 5)))
    assert finding.status == "ok" and "fp16-mixed" in finding.message


def test_precision_without_gpu_does_not_apply():
    assert check_precision(cpu_env()) is None


# --- cuDNN and NCCL -------------------------------------------------------------------------


def test_cudnn_version_and_errors():
    assert check_cudnn(cuda_env(torch_changes={"cudnn_version": 91002})).message == "cuDNN 9.10.2"
    assert check_cudnn(cuda_env(torch_changes={"cudnn_version": 8907})).message == "cuDNN 8.9.7"
    missing = check_cudnn(cuda_env(torch_changes={"cudnn_version": None}))
    assert missing.status == "warn"
    error = ("RuntimeError: cuDNN version incompatibility: PyTorch was compiled against (9, 10, 2) but found "
             "runtime version (8, 9, 7)")
    broken = check_cudnn(cuda_env(torch_changes={"cudnn_version": None, "cudnn_error": error},
                                  variables={"LD_LIBRARY_PATH": "/usr/local/cuda/lib64:/opt/cudnn8/lib"}))
    assert broken.status == "fail"
    assert "/usr/local/cuda/lib64, /opt/cudnn8/lib" in broken.message and "LD_LIBRARY_PATH" in broken.fix
    assert check_cudnn(cpu_env()) is None


def test_nccl_missing():
    one = check_nccl(cuda_env(torch_changes={"nccl_version": None}))
    assert one.status == "warn"
    many = check_nccl(cuda_env(count=4, torch_changes={"nccl_version": None}))
    assert many.status == "fail" and "--force-reinstall" in many.fix
    assert check_nccl(cuda_env()).message == "NCCL 2.28.9"
    windows = check_nccl(cuda_env(os="Windows", torch_changes={"nccl_version": None}))
    assert windows.status == "ok" and "gloo" in windows.message


# --- memory and processes -------------------------------------------------------------------


def test_other_processes_holding_gpu_memory():
    busy = nvml(index=0, free=60 * GiB, processes=[GpuProcess(pid=4242, name="python3", used_memory_bytes=20 * GiB)])
    idle = nvml(index=1, free=80 * GiB - 300 * MiB)
    finding = check_gpu_memory(cuda_env(count=2, nvml_devices=(busy, idle)))
    assert finding.status == "warn"
    assert "python3 (pid 4242) 20 GiB" in finding.message and "nvidia-smi GPU 0" in finding.message
    # By UUID: CUDA's fastest-first numbering need not match nvidia-smi's PCI order.
    assert f"CUDA_VISIBLE_DEVICES={idle.uuid}" in finding.fix


def test_memory_used_by_invisible_processes():
    env = cuda_env(nvml_devices=(nvml(free=10 * GiB),))
    assert "cannot see" in check_gpu_memory(env).message


def test_gpu_without_memory_figures_is_skipped():
    # Unified-memory parts (GB10) answer NotSupported to NVML's memory query.
    env = cuda_env(nvml_devices=(replace(nvml(), total_memory_bytes=None, free_memory_bytes=None),))
    assert check_gpu_memory(env) is None


def test_free_memory_ok():
    finding = check_gpu_memory(cuda_env(count=2))
    assert finding.status == "ok" and "160 GiB free of 160 GiB on 2 GPU(s)" in finding.message
    assert check_gpu_memory(cpu_env()) is None


# --- allocator configuration ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("variables", "status", "text"),
    [
        ({}, "ok", "expandable_segments:True"),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "ok", "expandable segments on"),
        ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}, "ok", "add expandable_segments:True"),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments"}, "fail", "not 'key:value'"),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segment:True"}, "warn", "expandable_segment"),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:TRUE"}, "fail", "neither True nor False"),
        ({"PYTORCH_ALLOC_CONF": "a:b", "PYTORCH_CUDA_ALLOC_CONF": "c:d"}, "warn", "are all set"),
    ],
)
def test_alloc_conf(variables, status, text):
    finding = check_alloc_conf(cuda_env(variables=variables))
    assert finding.status == status and text in finding.message


def test_expandable_segments_on_windows_is_ignored():
    env = cuda_env(os="Windows", variables={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert check_alloc_conf(env).status == "warn"
    assert check_alloc_conf(cpu_env()) is None


# --- triton ---------------------------------------------------------------------------------


def test_triton():
    assert check_triton(cuda_env()).status == "ok"
    missing = check_triton(cuda_env(triton_version=None, triton_error="triton is not installed"))
    assert missing.status == "warn" and missing.fix == "pip install triton==3.6.0"
    mismatch = check_triton(cuda_env(triton_version="3.5.1"))
    assert mismatch.status == "warn" and "built against 3.6.0" in mismatch.message
    broken = check_triton(cuda_env(triton_error="ImportError: libcuda.so.1: cannot open shared object file"))
    assert broken.status == "fail"
    assert check_triton(cuda_env(os="Windows", triton_version=None)).fix.startswith("pip install triton-windows")
    assert check_triton(cpu_env()) is None


def test_attention_kernels_used_on_a_gpu_with_a_working_triton():
    found = check_attention_kernels(cuda_env())
    assert found.status == "ok" and "runs its Triton kernels (Triton 3.6.0" in found.message


@pytest.mark.parametrize(("env", "status", "why", "fix"), [
    (cpu_env(), "ok", "PyTorch path, not its Triton kernels: they need a GPU", None),
    (cuda_env(triton_version=None, triton_error="triton is not installed"), "warn", "Triton is not installed",
     "pip install triton==3.6.0"),
    (cuda_env(triton_error="ImportError: libcuda.so.1: cannot open shared object file"), "warn",
     "Triton 3.6.0 does not import (ImportError: libcuda.so.1", "pip install --force-reinstall triton==3.6.0"),
    (cuda_env(triton_backend_error="RuntimeError: 0 active drivers ([]). There should only be one."), "warn",
     "cannot launch kernels on this GPU (RuntimeError: 0 active drivers", "a C compiler"),
])
def test_attention_kernels_not_used_says_why(env, status, why, fix):
    found = check_attention_kernels(env)
    assert found.status == status and "runs its PyTorch path" in found.message and why in found.message
    assert (found.fix is None) if fix is None else (fix in found.fix)


def test_attention_kernels_interpreted():
    on_cpu = check_attention_kernels(cpu_env(triton_version="3.6.0", variables={"TRITON_INTERPRET": "1"}))
    assert on_cpu.status == "ok" and "interpreted on the CPU (TRITON_INTERPRET=1)" in on_cpu.message
    without = check_attention_kernels(cpu_env(triton_error="triton is not installed",
                                              variables={"TRITON_INTERPRET": "1"}))
    assert without.status == "warn" and "Triton is not installed" in without.message
    on_gpu = check_attention_kernels(cuda_env(variables={"TRITON_INTERPRET": "1"}))
    assert on_gpu.status == "warn" and on_gpu.fix.startswith("unset TRITON_INTERPRET")
    assert check_attention_kernels(cpu_env(torch=None, torch_error="ModuleNotFoundError: torch")) is None


# --- data loading ---------------------------------------------------------------------------


def test_dataloader_workers_follow_cores_per_gpu():
    assert recommended_workers(cuda_env(count=1)) == 8  # 16 usable cores, capped at 8
    assert recommended_workers(cuda_env(count=4)) == 3  # 4 cores each, one for the training loop
    assert recommended_workers(cpu_env()) == 4
    assert "num_workers=8" in check_dataloader(cuda_env()).message


def test_few_cores_per_gpu_warns():
    env = cuda_env(count=8)  # 16 cores for 8 GPUs
    assert check_dataloader(env).status == "warn"


def test_small_shm_in_a_container_warns():
    env = cuda_env(shm_bytes=64 * MiB, in_container=True)
    finding = check_dataloader(env)
    assert finding.status == "warn" and "--shm-size" in finding.fix and "64 MiB" in finding.message
    assert "remount" in check_dataloader(cuda_env(shm_bytes=64 * MiB, in_container=False)).fix
