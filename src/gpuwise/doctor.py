"""``gpuwise doctor``: is this PyTorch / CUDA / driver / GPU stack right, and how to fix it if not.

Every check is a pure function of one ``Environment`` snapshot and returns a ``Finding`` (or
``None`` when it does not apply to this machine), so each branch is tested by building an
environment by hand. Compatibility facts come from ``gpuwise.stack``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from gpuwise.environment import Environment, NvmlDevice, TorchDevice, suggested_workers
from gpuwise.hardware.catalog import load_catalog
from gpuwise.hardware.detect import bf16_capable, describe_local
from gpuwise.hardware.device import resolve_device
from gpuwise.stack import (
    arch_coverage,
    base_version,
    choose_wheel,
    driver_max_cuda,
    driver_need,
    first_cuda_for,
    format_version,
    parse_version,
    sm_name,
)
from gpuwise.units import GiB, human_bytes

Status = Literal["ok", "warn", "fail"]
MIN_PYTHON = (3, 10)
PYTHON_END_OF_LIFE = {(3, 10): "October 2026"}  # PEP 619
MIN_TORCH = (2, 5)
# Keys the CUDA caching allocator knows (c10/cuda/CUDAAllocatorConfig, torch 2.5 - 2.13).
ALLOC_CONF_KEYS = frozenset({
    "backend", "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
    "roundup_power2_divisions", "expandable_segments", "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
    "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb", "pinned_reserve_segment_size_mb",
    "per_process_memory_fraction", "graph_capture_record_stream_reuse", "large_segment_size_mb",
})  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One check's verdict: a one-line message and, when something should change, the fix."""

    check: str
    status: Status
    message: str
    fix: str | None = None


@dataclass(frozen=True, kw_only=True)
class DoctorReport:
    findings: tuple[Finding, ...]

    @property
    def failed(self) -> bool:
        return any(f.status == "fail" for f in self.findings)

    @property
    def exit_code(self) -> int:
        """0 when no check fails, 1 when one does."""
        return 1 if self.failed else 0


# ---------------------------------------------------------------------------------------------
# Helpers


def _torch_base(env: Environment) -> str:
    return base_version(env.torch.version) if env.torch else "2.13.0"


def _build_cuda(env: Environment) -> tuple[int, int]:
    """The CUDA the torch wheel was built with, e.g. (13, 0); only for CUDA builds."""
    return tuple(parse_version(env.torch.cuda)[:2])  # type: ignore[arg-type, union-attr, return-value]


def _is_cuda(env: Environment) -> bool:
    return bool(env.torch and env.torch.cuda)


def _nvml_caps(env: Environment) -> tuple[tuple[int, int], ...]:
    return tuple(d.compute_capability for d in env.nvml_devices if d.compute_capability)


def _wheel_fix(env: Environment, *, fallback: str) -> str:
    """The pip command for a CUDA wheel that fits this driver and these GPUs."""
    driver = parse_version(env.driver_version) if env.driver_version else None
    caps = _nvml_caps(env) or tuple(d.compute_capability for d in env.gpus)
    choice = choose_wheel(_torch_base(env), driver=driver, capabilities=caps, os_name=env.os)
    return choice.command if choice else fallback


def _names(devices: tuple[TorchDevice, ...] | tuple[NvmlDevice, ...]) -> str:
    counts = Counter(d.name for d in devices)
    return ", ".join(f"{n} x{c}" if c > 1 else n for n, c in counts.items())


def _driver_text(env: Environment) -> str:
    cuda = env.driver_cuda or driver_max_cuda(parse_version(env.driver_version or ""))
    limit = f", supports CUDA <= {cuda[0]}.{cuda[1]}" if cuda else ""
    return f"driver {env.driver_version}{limit}"


# ---------------------------------------------------------------------------------------------
# Checks: Environment -> Finding | None


def check_python(env: Environment) -> Finding:
    version = ".".join(map(str, env.python_version))
    where = f"Python {version} ({env.os} {env.machine})"
    if env.python_version[:2] < MIN_PYTHON:
        return Finding(check="python", status="fail", message=f"{where}: gpuwise needs Python >= 3.10",
                       fix="install Python 3.12 and recreate the venv")
    if env.python_version[:2] in PYTHON_END_OF_LIFE:
        return Finding(check="python", status="warn",
                       message=f"{where}: end of life since {PYTHON_END_OF_LIFE[env.python_version[:2]]} "
                               "(no more security fixes; new PyTorch releases drop such versions)",
                       fix="move to Python 3.12 or newer and recreate the venv")
    return Finding(check="python", status="ok", message=where)


def check_torch(env: Environment) -> Finding:
    torch = env.torch
    if torch is None:
        error = env.torch_error or "not installed"
        if "libcudnn" in error or "libcu" in error or "libnccl" in error:
            fix = ("a CUDA library is missing or shadowed: remove cuda/cudnn folders from LD_LIBRARY_PATH, "
                   "or reinstall: pip install --force-reinstall torch==2.13.0")
        else:
            fix = "pip install torch==2.13.0"
        return Finding(check="torch", status="fail", message=f"torch does not import ({error})", fix=fix)
    if parse_version(torch.version)[:2] < MIN_TORCH:
        return Finding(check="torch", status="fail",
                       message=f"torch {torch.version} is older than gpuwise supports (>= 2.5)",
                       fix="pip install torch==2.13.0 (add --index-url for a CUDA build, see pytorch.org)")
    if torch.cuda:
        return Finding(check="torch", status="ok", message=f"torch {torch.version}, built with CUDA {torch.cuda}")
    if torch.hip:
        return Finding(check="torch", status="ok", message=f"torch {torch.version}, built for {torch.build}")
    if env.nvml_devices:
        return Finding(
            check="torch", status="fail",
            message=(f"torch {torch.version} is the CPU-only build, but this machine has "
                     f"{_names(env.nvml_devices)} ({_driver_text(env)})"),
            fix=_wheel_fix(env, fallback="upgrade the NVIDIA driver, then install a CUDA build of torch"),
        )
    extra = " with Apple MPS" if torch.mps_built else ""
    return Finding(check="torch", status="ok", message=f"torch {torch.version}, CPU build{extra}")


def check_driver(env: Environment) -> Finding | None:
    """The NVIDIA driver against the minimum for the wheel's CUDA, and for each GPU's architecture."""
    if env.driver_version is None:
        if _is_cuda(env) and env.gpus:
            return Finding(check="driver", status="warn",
                           message=f"torch sees GPUs but the driver version is unknown ({env.nvml_error})",
                           fix="check that nvidia-smi runs; NVML (libnvidia-ml) ships with the driver")
        return None  # no NVIDIA driver: check_gpu explains what that means here
    driver = parse_version(env.driver_version)
    for dev in env.nvml_devices:
        first = first_cuda_for(dev.compute_capability) if dev.compute_capability else None
        needed = driver_need(first, env.os).toolkit_driver if first else None
        if needed and driver < needed:
            return Finding(
                check="driver", status="fail",
                message=(f"{dev.name} ({sm_name(dev.compute_capability)}) needs driver >= "
                         f"{format_version(needed)} (CUDA {first[0]}.{first[1]}); this is {env.driver_version}"),
                fix=f"upgrade the NVIDIA driver to R{needed[0]} or newer",
            )
    if not _is_cuda(env):
        return Finding(check="driver", status="ok", message=f"NVIDIA {_driver_text(env)}")
    cuda = _build_cuda(env)
    need = driver_need(cuda, env.os)
    build = f"torch's CUDA {env.torch.cuda} build"
    supported = env.driver_cuda or driver_max_cuda(driver)
    too_old = need.floor is not None and driver < need.floor
    if supported is not None and supported[0] < cuda[0]:  # no minor-version compatibility across majors
        too_old = True
    if too_old:
        floor = format_version(need.floor) if need.floor else f"a CUDA {cuda[0]}.x driver"
        return Finding(
            check="driver", status="fail",
            message=(f"{_driver_text(env)}: too old for {build}, which needs >= {floor} "
                     "('The NVIDIA driver on your system is too old')"),
            fix=(f"upgrade the driver to >= {floor}, or install a build this driver runs: "
                 + _wheel_fix(env, fallback="see https://pytorch.org/get-started/previous-versions/")),
        )
    if need.toolkit_driver is not None and driver < need.toolkit_driver:
        return Finding(
            check="driver", status="warn",
            message=(f"{_driver_text(env)} runs {build} only through minor-version compatibility: PTX JIT "
                     f"fails ('the provided PTX was compiled with an unsupported toolchain')"),
            fix=(f"upgrade the driver to >= {format_version(need.toolkit_driver)}, or use a build for this "
                 f"driver: {_wheel_fix(env, fallback='an older cuXXX wheel')}"),
        )
    return Finding(check="driver", status="ok", message=f"NVIDIA {_driver_text(env)} runs {build}")


def _visible_devices_hides_all(value: str | None) -> bool:
    return value is not None and value.strip() in ("", "-1", "none", "NoDevFiles")


def check_gpu(env: Environment) -> Finding | None:
    """Is there a GPU, and can torch see it? On a CPU-only machine: one plain explanation."""
    torch = env.torch
    if torch is None:
        return None
    visible = env.variables.get("CUDA_VISIBLE_DEVICES")
    if torch.mps_built:
        if torch.mps_available:
            limit = torch.mps_recommended_max_bytes
            extra = f", recommended working set {human_bytes(limit)}" if limit else ""
            return Finding(check="gpu", status="ok",
                           message=f"Apple GPU through MPS ({env.cpu.model}, "
                                   f"{human_bytes(env.cpu.memory_total_bytes)} unified memory{extra})")
        return Finding(check="gpu", status="warn",
                       message="torch has MPS support but the Apple GPU is not available",
                       fix="MPS needs Apple silicon, macOS 14 or newer, and an arm64 Python "
                           "(python -c 'import platform; print(platform.machine())' must print arm64)")
    if torch.hip:
        if torch.devices:
            return Finding(check="gpu", status="ok",
                           message=f"{len(torch.devices)} AMD GPU(s) through {torch.build}: {_names(torch.devices)}")
        return Finding(check="gpu", status="fail", message=f"torch ({torch.build}) sees no AMD GPU",
                       fix="check rocm-smi, that you are in the video and render groups (/dev/kfd, /dev/dri), "
                           "and HIP_VISIBLE_DEVICES")
    if not torch.cuda:
        if env.nvml_devices:
            return None  # check_torch already says: CPU build on a GPU machine
        return Finding(
            check="gpu", status="warn",
            message=(f"no GPU: torch {torch.version} is the CPU build and this machine has no NVIDIA GPU, "
                     "so everything runs on the CPU"),
            fix=("to train on an NVIDIA GPU, on a machine with one install its driver (R580 or newer) and "
                 f"pip install torch=={_torch_base(env)} --index-url https://download.pytorch.org/whl/cu130"),
        )
    if torch.devices:
        hidden = len(env.nvml_devices) - len(torch.devices)
        note = f" (CUDA_VISIBLE_DEVICES={visible} hides {hidden} more)" if visible is not None and hidden > 0 else ""
        return Finding(check="gpu", status="ok",
                       message=f"{len(torch.devices)} GPU(s) visible to torch: {_names(torch.devices)}{note}")
    if env.nvml_devices and _visible_devices_hides_all(visible):
        return Finding(check="gpu", status="fail",
                       message=(f"torch sees no GPU because CUDA_VISIBLE_DEVICES={visible!r} hides all "
                                f"{len(env.nvml_devices)} of them"),
                       fix=f"unset CUDA_VISIBLE_DEVICES, or set it to GPU indexes 0-{len(env.nvml_devices) - 1}")
    if env.nvml_devices:
        reason = torch.cuda_error or next(iter(torch.warnings), "torch.cuda.is_available() is False")
        if visible is not None:
            reason += f"; CUDA_VISIBLE_DEVICES={visible!r}"
        return Finding(check="gpu", status="fail",
                       message=f"the driver sees {_names(env.nvml_devices)} but torch sees no GPU ({reason})",
                       fix="fix the driver finding above if there is one; otherwise run nvidia-smi and "
                           "python -c 'import torch; torch.cuda.init()' to see the error")
    need = driver_need(_build_cuda(env), env.os).floor
    floor = f" (>= {format_version(need)} for this build)" if need else ""
    return Finding(
        check="gpu", status="warn",
        message=(f"no NVIDIA GPU or driver found ({env.nvml_error or 'NVML sees no GPU'}): torch's CUDA "
                 f"{torch.cuda} build will run everything on the CPU"),
        fix=(f"on a machine with an NVIDIA GPU, install its driver{floor} and check nvidia-smi (in a container: "
             f"--gpus all); without one, the CPU wheel is far smaller: pip install torch=={_torch_base(env)} "
             "--index-url https://download.pytorch.org/whl/cpu"),
    )


def check_arch(env: Environment) -> Finding | None:
    """Each GPU's architecture must have kernels in the wheel, else 'no kernel image is available'."""
    if env.torch is None or not env.gpus:
        return None
    if env.torch.hip:
        return _check_rocm_arch(env)
    built = ", ".join(env.torch.arch_list) or "none listed"
    for dev in env.gpus:
        cc = dev.compute_capability
        coverage = arch_coverage(cc, env.torch.arch_list)
        if coverage == "sass":
            continue
        driver = parse_version(env.driver_version) if env.driver_version else None
        toolkit = driver_need(_build_cuda(env), env.os).toolkit_driver
        jit_ok = driver is None or toolkit is None or driver >= toolkit
        fix = _wheel_fix(env, fallback=f"no wheel of torch {_torch_base(env)} that we know has {sm_name(cc)}: "
                                       "see https://pytorch.org/get-started/locally/")
        if coverage == "ptx" and jit_ok:
            return Finding(check="arch", status="warn",
                           message=(f"{dev.name} ({sm_name(cc)}) has no native kernels in this build ({built}); "
                                    "it runs through PTX JIT: slow first launches, some kernels slower"),
                           fix=fix)
        return Finding(check="arch", status="fail",
                       message=(f"{dev.name} is {sm_name(cc)} but this build has kernels for {built}: expect "
                                "'no kernel image is available for execution on the device'"),
                       fix=fix)
    archs = sorted({sm_name(d.compute_capability) for d in env.gpus})
    return Finding(check="arch", status="ok",
                   message=f"native kernels for {', '.join(archs)} are in this build")


_RDNA_OVERRIDE = {"gfx103": "10.3.0", "gfx110": "11.0.0", "gfx120": "12.0.0"}


def _check_rocm_arch(env: Environment) -> Finding:
    built = set(env.torch.arch_list)  # type: ignore[union-attr]
    for dev in env.gpus:
        arch = (dev.gcn_arch or "").split(":")[0]
        if arch and arch not in built:
            override = _RDNA_OVERRIDE.get(arch[:6])
            fix = (f"HSA_OVERRIDE_GFX_VERSION={override} makes ROCm use a close target (unsupported by AMD)"
                   if override else f"use a ROCm build of torch compiled for {arch}")
            return Finding(check="arch", status="fail",
                           message=f"{dev.name} is {arch} but this ROCm build has kernels for "
                                   f"{', '.join(sorted(built)) or 'none listed'}", fix=fix)
    archs = sorted({(d.gcn_arch or "?").split(":")[0] for d in env.gpus})
    return Finding(check="arch", status="ok", message=f"kernels for {', '.join(archs)} are in this ROCm build")


def check_precision(env: Environment) -> Finding | None:
    """bf16 and TF32 support, and whether fp32 matmuls use TF32."""
    if env.torch is None or not env.gpus:
        return None
    dev = min(env.gpus, key=lambda d: d.compute_capability)
    if env.torch.hip:
        bf16 = bf16_capable("rocm", (dev.gcn_arch or "").split(":")[0])
        return Finding(check="precision", status="ok",
                       message=f"{dev.name}: " + ("bf16 supported: train in bf16-mixed" if bf16 else
                                                  "no fast bf16: train in fp16-mixed with a GradScaler"))
    if not bf16_capable("cuda", sm_name(dev.compute_capability)):
        return Finding(check="precision", status="ok",
                       message=(f"{dev.name} ({sm_name(dev.compute_capability)}) has no bf16 or TF32 tensor cores: "
                                "train in fp16-mixed with a GradScaler"))
    tf32_on = env.torch.float32_matmul_precision in ("high", "medium")
    if tf32_on:
        return Finding(check="precision", status="ok",
                       message=(f"{dev.name}: bf16 supported; TF32 matmul on "
                                f"(float32_matmul_precision={env.torch.float32_matmul_precision!r})"))
    row = resolve_device(f"cuda:{dev.index}", describe_local(env, load_catalog())).row
    rates = ""
    if row and row.peak_tflops.fp32 and row.peak_tflops.tf32:
        rates = f" ({row.peak_tflops.fp32:g} vs {row.peak_tflops.tf32:g} TFLOPS TF32 on this GPU)"
    return Finding(
        check="precision", status="warn",
        message=(f"{dev.name}: bf16 and TF32 supported, but TF32 matmul is off "
                 f"(float32_matmul_precision='highest'): fp32 matmuls run at the plain fp32 rate{rates}"),
        fix="call torch.set_float32_matmul_precision('high') at the start of training, or train in bf16-mixed",
    )


def _ld_cuda_dirs(env: Environment) -> list[str]:
    return [p for p in env.variables.get("LD_LIBRARY_PATH", "").split(":") if "cud" in p.lower()]


def check_cudnn(env: Environment) -> Finding | None:
    if env.torch is None or not (env.torch.cuda or env.torch.hip):
        return None
    library = "MIOpen" if env.torch.hip else "cuDNN"
    reinstall = f"pip install --force-reinstall torch=={_torch_base(env)} (with your --index-url)"
    if env.torch.cudnn_error:
        dirs = _ld_cuda_dirs(env)
        where = f"; LD_LIBRARY_PATH has {', '.join(dirs)}" if dirs else ""
        return Finding(check="cudnn", status="fail", message=f"{library}: {env.torch.cudnn_error}{where}",
                       fix=f"remove other {library} copies from LD_LIBRARY_PATH, or {reinstall}")
    if env.torch.cudnn_version is None:
        return Finding(check="cudnn", status="warn",
                       message=f"{library} is not available: convolutions fall back to slow kernels",
                       fix=reinstall)
    return Finding(check="cudnn", status="ok", message=f"{library} {_cudnn_text(env.torch.cudnn_version, library)}")


def _cudnn_text(code: int, library: str) -> str:
    """torch.backends.cudnn.version() as x.y.z: 91002 -> 9.10.2 (cuDNN 9), 8907 -> 8.9.7 (cuDNN 8)."""
    if library != "cuDNN":
        return f"(version code {code})"
    if code >= 90000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def check_nccl(env: Environment) -> Finding | None:
    if env.torch is None or not (env.torch.cuda or env.torch.hip):
        return None
    name = "RCCL" if env.torch.hip else "NCCL"
    if env.os == "Windows":
        return Finding(check="nccl", status="ok",
                       message="Windows has no NCCL: multi-GPU training uses the gloo backend (slower)")
    if env.torch.nccl_version is None:
        many = len(env.gpus) > 1
        return Finding(check="nccl", status="fail" if many else "warn",
                       message=f"{name} is not available: multi-GPU DDP/FSDP cannot use the nccl backend",
                       fix=f"pip install --force-reinstall torch=={_torch_base(env)} (with your --index-url)")
    return Finding(check="nccl", status="ok", message=f"{name} {env.torch.nccl_version}")


def check_gpu_memory(env: Environment) -> Finding | None:
    """Free memory per GPU and other processes holding it (what nvidia-smi shows)."""
    if not env.nvml_devices:
        return None
    measured = [d for d in env.nvml_devices if d.total_memory_bytes is not None and d.free_memory_bytes is not None]
    if not measured:
        return None
    busy = []
    for dev in measured:
        used = dev.total_memory_bytes - dev.free_memory_bytes  # type: ignore[operator]
        if used > max(GiB, 0.03 * dev.total_memory_bytes):
            procs = ", ".join(
                f"{p.name or '?'} (pid {p.pid}) {human_bytes(p.used_memory_bytes)}" for p in dev.processes
            ) or "processes this container cannot see"
            busy.append(f"nvidia-smi GPU {dev.index} ({dev.name}): {human_bytes(used)} of "
                        f"{human_bytes(dev.total_memory_bytes)} in use by {procs}")
    if busy:
        # By UUID: CUDA numbers GPUs fastest-first, nvidia-smi by PCI bus, so an index could name the wrong card.
        free = [d.uuid for d in measured if d.total_memory_bytes - d.free_memory_bytes <= GiB]  # type: ignore[operator]
        pick = f", or use a free GPU: CUDA_VISIBLE_DEVICES={free[0]}" if free else ""
        return Finding(check="gpu_memory", status="warn", message="; ".join(busy),
                       fix=f"stop those processes (kill PID) before training{pick}")
    total_free = sum(d.free_memory_bytes for d in measured)  # type: ignore[misc]
    total = sum(d.total_memory_bytes for d in measured)  # type: ignore[misc]
    return Finding(check="gpu_memory", status="ok",
                   message=(f"{human_bytes(total_free)} free of {human_bytes(total)} on "
                            f"{len(measured)} GPU(s); no other processes"))


def check_alloc_conf(env: Environment) -> Finding | None:
    """PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF: valid, and expandable segments where useful."""
    if not env.gpus or env.torch is None or not (env.torch.cuda or env.torch.hip):
        return None
    names = [n for n in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
             if n in env.variables]
    tip = "PYTORCH_ALLOC_CONF=expandable_segments:True"
    if not names:
        return Finding(check="alloc_conf", status="ok",
                       message=("allocator settings are the defaults; if an OOM says 'reserved but unallocated "
                                f"memory is large', set {tip} to cut fragmentation"))
    if len(names) > 1:
        return Finding(check="alloc_conf", status="warn", message=f"{' and '.join(names)} are all set",
                       fix="keep one of them (PYTORCH_ALLOC_CONF is the current name, torch >= 2.9)")
    name, value = names[0], env.variables[names[0]]
    options: dict[str, str] = {}
    for item in filter(None, (i.strip() for i in value.split(","))):
        key, sep, val = item.partition(":")
        if not sep:
            return Finding(check="alloc_conf", status="fail",
                           message=f"{name}={value!r}: {item!r} is not 'key:value'; torch will refuse it",
                           fix=f"write key:value pairs separated by commas, e.g. {tip}")
        options[key.strip()] = val.strip()
    if unknown := sorted(set(options) - ALLOC_CONF_KEYS):
        return Finding(check="alloc_conf", status="warn",
                       message=f"{name} has keys this check does not know: {', '.join(unknown)} "
                               "(torch raises 'Unrecognized key' for a misspelt one)",
                       fix="check the spelling against https://pytorch.org/docs/stable/notes/cuda.html")
    expandable = options.get("expandable_segments")
    if expandable not in (None, "True", "False"):
        return Finding(check="alloc_conf", status="fail",
                       message=f"{name}: expandable_segments:{expandable} is neither True nor False; torch "
                               "refuses it",
                       fix=f"write {tip}")
    if expandable == "True":
        if env.os == "Windows":
            return Finding(check="alloc_conf", status="warn",
                           message=f"{name}: expandable_segments is not supported on Windows and is ignored",
                           fix=f"unset {name}")
        return Finding(check="alloc_conf", status="ok",
                       message=f"{name}={value} (expandable segments on: less fragmentation)")
    return Finding(check="alloc_conf", status="ok",
                   message=f"{name}={value}; if OOMs report large 'reserved but unallocated' memory, add "
                           "expandable_segments:True")


def _triton_wanted(env: Environment) -> str:
    """The Triton to install: the release this torch wheel pins, for this OS."""
    package = "triton-windows" if env.os == "Windows" else "triton"
    pin = env.torch.triton_pin if env.torch else None
    return f"{package}=={pin}" if pin else package


def check_triton(env: Environment) -> Finding | None:
    """Triton, which torch.compile and gpuwise.ops need, on machines with a CUDA GPU."""
    if not _is_cuda(env) or not env.gpus:
        return None
    pin = env.torch.triton_pin  # type: ignore[union-attr]
    want = _triton_wanted(env)
    if env.triton_version is None:
        return Finding(check="triton", status="warn",
                       message="Triton is not installed: torch.compile and gpuwise.ops cannot build GPU kernels",
                       fix=f"pip install {want}")
    if env.triton_error:
        return Finding(check="triton", status="fail",
                       message=f"Triton {env.triton_version} does not import ({env.triton_error})",
                       fix=f"pip install --force-reinstall {want}")
    if pin and parse_version(pin) != parse_version(env.triton_version):
        return Finding(check="triton", status="warn",
                       message=f"Triton {env.triton_version}, but torch {env.torch.version} "  # type: ignore[union-attr]
                               f"was built against {pin}: torch.compile may fail",
                       fix=f"pip install {want}")
    return Finding(check="triton", status="ok", message=f"Triton {env.triton_version}")


def check_attention_kernels(env: Environment) -> Finding | None:
    """Whether ``gpuwise.ops.attention`` runs its Triton kernels here (GPU tensors; CPU tensors when
    TRITON_INTERPRET=1 was set) or its PyTorch path, and why: the same reasons ``ops.attention.kernel_status``
    gives inside a process."""
    if env.torch is None:
        return None  # check_torch says what to do
    interpret = env.variables.get("TRITON_INTERPRET", "0") not in ("", "0")
    fallback = "gpuwise attention runs its PyTorch path, not its Triton kernels"
    if not env.gpus and not interpret:
        return Finding(check="attention", status="ok",
                       message=f"{fallback}: they need a GPU (TRITON_INTERPRET=1 runs them interpreted on the "
                               "CPU, for tests)")
    if env.triton_version is None:
        return Finding(check="attention", status="warn", message=f"{fallback}: Triton is not installed",
                       fix=f"pip install {_triton_wanted(env)}")
    if env.triton_error:
        return Finding(check="attention", status="warn",
                       message=f"{fallback}: Triton {env.triton_version} does not import ({env.triton_error})",
                       fix=f"pip install --force-reinstall {_triton_wanted(env)}")
    if interpret:
        message = (f"gpuwise attention runs its Triton kernels interpreted on the CPU (TRITON_INTERPRET="
                   f"{env.variables['TRITON_INTERPRET']}): right answers, slowly; for tests")
        if env.gpus:
            return Finding(check="attention", status="warn", message=message,
                           fix="unset TRITON_INTERPRET to compile the kernels for the GPU")
        return Finding(check="attention", status="ok", message=message)
    if env.triton_backend_error:
        return Finding(check="attention", status="warn",
                       message=f"{fallback}: Triton {env.triton_version} cannot launch kernels on this GPU "
                               f"({env.triton_backend_error})",
                       fix="Triton needs the driver's libcuda.so and a C compiler (apt install gcc) to build its "
                           "launcher; fix what the error names")
    return Finding(check="attention", status="ok",
                   message=f"gpuwise attention runs its Triton kernels (Triton {env.triton_version}; head_dim 64 "
                           "and 128)")


def recommended_workers(env: Environment) -> int:
    """DataLoader workers per process for this environment (``environment.suggested_workers``, the one rule)."""
    return suggested_workers(env.cpu.usable_cores, len(env.gpus))


def check_dataloader(env: Environment) -> Finding:
    """CPU cores against DataLoader num_workers, and /dev/shm, which workers pass batches through."""
    workers = recommended_workers(env)
    cores = env.cpu.usable_cores
    shm = env.shm_bytes
    if workers > 0 and shm is not None and shm < GiB:
        return Finding(check="dataloader", status="warn",
                       message=(f"/dev/shm is {human_bytes(shm)}: DataLoader workers (and NCCL) crash with "
                                "'bus error' or 'No space left on device' once batches outgrow it"),
                       fix=("start the container with --ipc=host or --shm-size=16g" if env.in_container
                            else "remount /dev/shm larger (mount -o remount,size=16G /dev/shm)")
                           + ", or use num_workers=0")
    per_gpu = cores / len(env.gpus) if env.gpus else cores
    where = f"{len(env.gpus)} GPU(s)" if env.gpus else "CPU training"
    advice = f"DataLoader(num_workers={workers}, pin_memory={bool(env.gpus)}, persistent_workers={workers > 0})"
    if env.gpus and per_gpu < 4:
        return Finding(check="dataloader", status="warn",
                       message=f"{cores} usable CPU cores for {where}: decoding and augmentation may starve "
                               f"the GPU; use {advice}",
                       fix="preprocess data offline, augment on the GPU, or use a machine with more cores")
    return Finding(check="dataloader", status="ok", message=f"{cores} usable CPU cores for {where}: use {advice}")


CHECKS: tuple[Callable[[Environment], Finding | None], ...] = (
    check_python, check_torch, check_driver, check_gpu, check_arch, check_precision, check_cudnn,
    check_nccl, check_gpu_memory, check_alloc_conf, check_triton, check_attention_kernels, check_dataloader,
)  # fmt: skip


def diagnose(env: Environment) -> DoctorReport:
    """Run every check on one snapshot.

    >>> from gpuwise.environment import gather_environment
    >>> diagnose(gather_environment({})).exit_code  # doctest: +SKIP
    0
    """
    return DoctorReport(findings=tuple(f for check in CHECKS if (f := check(env)) is not None))
