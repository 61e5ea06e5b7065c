"""The benchmark suite: GEMM, copies, attention backends, conv2d, a transformer block and a training step,
on the chosen device and on the CPU as the baseline.

No flattered numbers: inputs are random (never zeros, which some hardware shortcuts), every call reads the
next of several input buffers that together exceed the caches, and warm-up calls (compilation, autotuning,
lazy loading) are never counted.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from gpuwise.bench import OPS
from gpuwise.bench.measure import Measurement, measure
from gpuwise.compat import scaled_mm
from gpuwise.errors import GpuwiseError, first_line
from gpuwise.hardware.catalog import Accelerator
from gpuwise.hardware.device import Device, device_for
from gpuwise.precision import ELEMENT_TYPES, PRECISIONS, Precision, default_precision, tf32_matmuls

MEMORY_OPS = ("copy", "h2d")  # rated in GB/s (the others in TFLOPS)
MIN_ROTATE_BYTES = 64 * 2**20
CPU_BASELINE_MAX_S = 10.0  # a CPU baseline expected to take longer (all its runs) is skipped
MIN_REPEAT_S = 1e-3  # a timed repeat runs the op enough times to last this long: sync and launch costs vanish


@dataclass(frozen=True, kw_only=True)
class BenchResult:
    """One timed case. ``dims`` holds its sizes as numbers ({"m", "n", "k"} for a GEMM, {"batch", "heads",
    "seq", "head_dim"} for attention, ...); ``shape`` is their label for people, never parsed back. ``bytes``
    is the least an op must move (a GEMM: A and B read, C written once), None where not worked out."""

    op: str
    dtype: str
    shape: str
    device: str
    median_s: float
    p10_s: float
    p90_s: float
    repeats: int
    flops: float | None
    bytes: float | None
    tflops: float | None
    gbps: float | None
    peak_memory_bytes: int | None
    pct_of_peak: float | None  # of the catalog's dense peak for this dtype (bandwidth for copies)
    speedup_vs_cpu: float | None
    backend: str | None = None  # the SDPA kernel that ran
    note: str | None = None
    dims: Mapping[str, int] = field(default_factory=dict)  # empty in files saved before dims existed


@dataclass(frozen=True, kw_only=True)
class Case:
    """What to time, sized where it is built: ``dims`` and ``bytes`` are numbers, ``shape`` their label."""

    op: str
    dtype: str
    dims: Mapping[str, int]
    shape: str
    make: Callable[[torch.device], tuple[Callable[[], object], float | None]]  # fn, flops
    bytes: float | None = None  # the least the op moves (see BenchResult.bytes)
    backend: str | None = None
    cpu: bool = True  # has a CPU baseline


@functools.cache
def cache_bytes(device: torch.device) -> int:
    """The largest cache in front of ``device``'s memory: the GPU's L2, the CPU's last level (sysfs)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return 0
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        with contextlib.suppress(ValueError):
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[text[-1]] if text[-1] in "KMG"
                         else int(text))
    return max(sizes, default=0)


def _rotating(make_one: Callable[[], tuple], nbytes: int, device: torch.device) -> Callable[[], tuple]:
    """Input buffers cycled call by call, together twice the largest cache (so no call reads warm data)."""
    total = max(2 * cache_bytes(device), MIN_ROTATE_BYTES)
    count = max(2, min(4096, math.ceil(total / max(nbytes, 1))))
    pool = [make_one() for _ in range(count)]
    cycle = itertools.cycle(pool)
    return lambda: next(cycle)


def _randn(shape, dtype, device) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=torch.float32).to(dtype)


def _gemm(m: int, n: int, k: int, dtype: str) -> Case:
    def make(device: torch.device):
        if dtype == "fp8":
            if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
                raise GpuwiseError("fp8 GEMM needs an NVIDIA GPU of compute capability 8.9 or newer", "")
            e4m3 = torch.float8_e4m3fn
            one = torch.ones((), device=device)
            nxt = _rotating(lambda: (_randn((m, k), torch.float32, device).to(e4m3),
                                     _randn((n, k), torch.float32, device).to(e4m3).t()), (m + n) * k, device)

            def fn():
                a, b = nxt()
                # fast accumulation, as fp8 training recipes use it forward (torchao's default)
                return scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)
        else:
            if dtype == "tf32" and device.type != "cuda":
                raise GpuwiseError("TF32 is an NVIDIA tensor-core format", "")
            t = ELEMENT_TYPES[dtype].torch_dtype
            nxt = _rotating(lambda: (_randn((m, k), t, device), _randn((k, n), t, device)),
                            (m + n) * k * t.itemsize, device)

            def fn():
                a, b = nxt()
                return a @ b
        return fn, 2.0 * m * n * k

    size = ELEMENT_TYPES[dtype].bytes
    out = ELEMENT_TYPES["bf16"].bytes if dtype == "fp8" else size  # fp8 GEMMs write bf16 (out_dtype above)
    return Case(op="gemm", dtype=dtype, dims={"m": m, "n": n, "k": k}, shape=f"{m}x{k} @ {k}x{n}", make=make,
                bytes=float((m * k + k * n) * size + m * n * out), cpu=dtype in ("fp32", "bf16"))


def _copy(nbytes: int) -> Case:
    def make(device: torch.device):
        src = torch.rand(nbytes // 4, device=device)
        dst = torch.empty_like(src)
        return (lambda: dst.copy_(src)), None

    return Case(op="copy", dtype="fp32", dims={"bytes": nbytes}, shape=f"{nbytes // 2**20} MiB", make=make,
                bytes=2.0 * nbytes)  # read + write


def _h2d(nbytes: int, pinned: bool) -> Case:
    def make(device: torch.device):
        if device.type != "cuda":
            raise GpuwiseError("host-to-device copies need a CUDA GPU", "")
        host = torch.rand(nbytes // 4)
        if pinned:
            host = host.pin_memory()
        dst = torch.empty(nbytes // 4, device=device)
        return (lambda: dst.copy_(host, non_blocking=pinned)), None

    return Case(op="h2d", dtype="fp32", dims={"bytes": nbytes, "pinned": int(pinned)},
                shape=f"{nbytes // 2**20} MiB {'pinned' if pinned else 'pageable'}", make=make,
                bytes=float(nbytes), cpu=False)


_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH",
             "cudnn": "CUDNN_ATTENTION"}


def _attention(b: int, h: int, s: int, d: int, dtype: str, backend: str) -> Case:
    def make(device: torch.device):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        which = getattr(SDPBackend, _BACKENDS[backend], None)
        if which is None:
            raise GpuwiseError(f"this torch has no {backend} attention backend", "")
        t = ELEMENT_TYPES[dtype].torch_dtype
        nxt = _rotating(lambda: tuple(_randn((b, h, s, d), t, device) for _ in range(3)),
                        3 * b * h * s * d * t.itemsize, device)

        def fn():
            q, k, v = nxt()
            with sdpa_kernel([which]):  # only this backend may run: it runs, or the call fails
                return F.scaled_dot_product_attention(q, k, v)

        fn()  # fails here, before timing, if the backend cannot run these inputs
        return fn, 4.0 * b * h * s * s * d

    return Case(op="attention", dtype=dtype, dims={"batch": b, "heads": h, "seq": s, "head_dim": d},
                shape=f"b{b} h{h} s{s} d{d}", make=make, backend=backend)


def _conv2d(b: int, c: int, hw: int, dtype: str) -> Case:
    def make(device: torch.device):
        t = ELEMENT_TYPES[dtype].torch_dtype
        w = _randn((c, c, 3, 3), t, device)
        nxt = _rotating(lambda: _randn((b, c, hw, hw), t, device), b * c * hw * hw * t.itemsize, device)
        return (lambda: F.conv2d(nxt(), w, padding=1)), 2.0 * b * c * hw * hw * c * 9

    return Case(op="conv2d", dtype=dtype, dims={"batch": b, "channels": c, "height": hw, "width": hw, "kernel": 3},
                shape=f"{b}x{c}x{hw}x{hw} 3x3", make=make)


def _block(b: int, s: int, h: int, heads: int, dtype: str) -> Case:
    """A GPT-2 block, forward + backward; FLOPs counted by the planner's tracker on fake tensors."""

    def make(device: torch.device):
        from gpuwise.models.gpt import Block, GPTConfig

        cfg = GPTConfig(n_layer=1, n_head=heads, n_embd=h)
        t = ELEMENT_TYPES[dtype].torch_dtype
        with torch.device(device):
            block = Block(cfg).to(t)
        nxt = _rotating(lambda: _randn((b, s, h), t, device).requires_grad_(), b * s * h * t.itemsize, device)

        def fn():
            block(nxt()).float().square().mean().backward()

        return fn, _fake_flops(lambda: Block(cfg), (b, s, h))

    return Case(op="block", dtype=dtype, dims={"batch": b, "seq": s, "hidden": h, "heads": heads},
                shape=f"b{b} s{s} h{h}", make=make)


def _fake_flops(build: Callable[[], torch.nn.Module], shape: tuple[int, ...]) -> float:
    from gpuwise.compat import FakeTensorMode
    from gpuwise.planning.capture.tracker import Tracker

    with FakeTensorMode():
        module = build()
        x = torch.randn(shape, requires_grad=True)
        with Tracker() as tracker:
            module(x).float().square().mean().backward()
    return float(tracker.flops)


def _train_step(model: str, batch: int, seq: int, precision: Precision) -> Case:
    """One AdamW step of a built-in model in ``precision``; FLOPs from the planner."""

    def make(device: torch.device):
        from gpuwise.models import get_model
        from gpuwise.planning.capture.workload import simulate
        from gpuwise.planning.setup import Setup
        from gpuwise.planning.sources.zoo import ZooSource

        zoo = get_model(model)
        with torch.device(device):
            net = zoo.instantiate()
            (idx,), targets = zoo.make_inputs(batch, seq=seq, image_size=None, dtype=torch.float32)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        spec = PRECISIONS[precision]

        def fn():
            with torch.autocast(device.type, dtype=spec.compute_dtype, enabled=spec.autocast):
                loss = net(idx, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        flops = simulate(ZooSource(zoo=zoo), Setup(micro_batch=batch, seq=seq, precision=precision),
                         batch_model=False).flops_per_step
        return fn, float(flops)

    return Case(op="train-step", dtype=precision, dims={"batch": batch, "seq": seq},
                shape=f"{model} b{batch} s{seq}", make=make)


def cases(device: torch.device, *, quick: bool, ops: tuple[str, ...], dtypes: tuple[str, ...],
          bf16: bool = True) -> list[Case]:
    """What to run on ``device`` (``bf16``: whether it computes in bf16, which sets the training step's
    default precision)."""
    gpu = device.type != "cpu"
    out: list[Case] = []
    if "gemm" in ops:
        sizes = (256, 1024, 2048) if quick else ((256, 512, 1024, 2048, 4096, 8192, 16384) if gpu else
                                                (256, 512, 1024, 2048, 4096))
        for dtype in dtypes:
            if not gpu and dtype in ("tf32", "fp8"):
                continue
            out += [_gemm(n, n, n, dtype) for n in sizes]
            if not quick and gpu:  # LLM shapes: Llama-3-8B projections at 8192 tokens
                out += [_gemm(8192, 4096, 4096, dtype), _gemm(8192, 14336, 4096, dtype), _gemm(8192, 4096, 14336,
                                                                                               dtype)]
    if "copy" in ops:  # more than the caches hold, so the figure is the memory's, not the cache's
        beyond = max(MIN_ROTATE_BYTES, 2 * cache_bytes(device))
        out += [_copy(n) for n in ((beyond,) if quick else sorted({beyond, 1024 * 2**20}))]
    if "h2d" in ops and device.type == "cuda":
        out += [_h2d(256 * 2**20, pinned=False), _h2d(256 * 2**20, pinned=True)]
    half = "fp16" if "fp16" in dtypes and "bf16" not in dtypes else "bf16"  # attention, conv2d, block on a GPU
    if "attention" in ops:
        s = 512 if quick else 4096
        dtype = half if gpu else "fp32"
        for backend in (("flash", "efficient", "math", "cudnn") if gpu else ("flash", "math")):
            out.append(_attention(2 if quick else 8, 8 if quick else 16, s, 64, dtype, backend))
    if "conv2d" in ops:
        out.append(_conv2d(8 if quick else 64, 64, 56, half if gpu else "fp32"))
    if "block" in ops:
        out.append(_block(2, 256, 256, 4, "fp32") if quick else _block(8, 1024, 768, 12, half if gpu else "fp32"))
    if "train-step" in ops:
        precision = default_precision(gpu=device.type == "cuda", bf16=bf16)  # MPS and CPU: fp32
        out.append(_train_step("gpt2", 1, 128, precision) if quick else _train_step("gpt2", 8, 1024, precision))
    return out


def _peak(acc: Accelerator | None, case: Case) -> float | None:
    if acc is None:
        return None
    if case.op == "copy":
        return acc.memory_bandwidth_gbps
    if case.op == "h2d":
        return None
    return acc.peak_tflops.get(PRECISIONS[case.dtype].rate_key if case.dtype in PRECISIONS else case.dtype)


def run_case(case: Case, dev: Device, *, warmup: int, repeats: int) -> tuple[Measurement, float | None, float | None]:
    """Time one case. A short op runs several times per timed repeat (at least MIN_REPEAT_S), and the
    figures are per call: synchronising around every single call would count its latency as work."""
    device = torch.device(dev.name)
    nbytes = case.bytes
    with tf32_matmuls(case.dtype == "tf32"):
        fn, flops = case.make(device)
        with measure(case.op, device=dev, warmup=1, repeats=1) as probe:
            for _ in probe:
                fn()
        calls = max(1, min(1000, math.ceil(MIN_REPEAT_S / max(probe.result.median_s, 1e-9))))

        def batch():
            for _ in range(calls):
                fn()

        with measure(case.op, device=dev, warmup=warmup, repeats=repeats) as m:
            for _ in m:
                batch()
    r = m.result
    per_call = tuple(t / calls for t in r.times_s)
    return replace(r, times_s=per_call, median_s=r.median_s / calls, p10_s=r.p10_s / calls, p90_s=r.p90_s / calls,
                   flops=flops, bytes=nbytes), flops, nbytes


def run_suite(device: str, *, quick: bool = False, ops: tuple[str, ...] = OPS,
              dtypes: tuple[str, ...] = ("fp32", "bf16"), accelerator: Accelerator | None = None,
              bf16: bool = True, progress: Callable[[str], None] | None = None) -> list[BenchResult]:
    """Every case on ``device`` (and on the CPU for the speed-up), as results; ``accelerator`` is the
    device's catalog row (``pct_of_peak``), ``bf16`` whether it computes in bf16."""
    dev = device_for(device)
    target = torch.device(dev.name)
    cpu = device_for("cpu")
    warmup, repeats = (1, 3) if quick else (3, 10)
    cpu_rate = None  # FLOP/s of this CPU, to skip baselines that would take minutes
    results = []
    for case in cases(target, quick=quick, ops=ops, dtypes=dtypes, bf16=bf16):
        if progress:
            progress(f"{case.op} {case.dtype} {case.shape}{' ' + case.backend if case.backend else ''}")
        try:
            m, flops, nbytes = run_case(case, dev, warmup=warmup, repeats=repeats)
        except (GpuwiseError, RuntimeError, ValueError, TypeError) as exc:  # a backend or dtype this device lacks
            results.append(BenchResult(
                op=case.op, dtype=case.dtype, shape=case.shape, dims=case.dims, device=dev.name, median_s=math.nan,
                p10_s=math.nan, p90_s=math.nan, repeats=0, flops=None, bytes=None, tflops=None, gbps=None,
                peak_memory_bytes=None, pct_of_peak=None, speedup_vs_cpu=None, backend=case.backend,
                note=f"not run: {first_line(exc, limit=100)}"))
            continue
        speedup, note = None, None
        if target.type != "cpu" and case.cpu:
            if cpu_rate is None:
                cpu_rate = run_case(_gemm(1024, 1024, 1024, "fp32"), cpu, warmup=1, repeats=2)[0].tflops * 1e12
            runs = 6  # probe warm-up and call, warm-up, 3 repeats
            if flops and flops * runs / cpu_rate > CPU_BASELINE_MAX_S:
                note = f"no CPU baseline: about {flops * runs / cpu_rate:.0f} s at this CPU's rate"
            else:
                try:
                    base, _, _ = run_case(case, cpu, warmup=1, repeats=2 if quick else 3)
                    speedup = base.median_s / m.median_s
                except (GpuwiseError, RuntimeError, ValueError, TypeError):
                    note = "the CPU cannot run this case"
        peak = _peak(accelerator, case)
        gbps = m.gbps if case.op in MEMORY_OPS else None  # a GEMM's bytes place it on the roofline, not rate it
        rate = gbps if case.op in MEMORY_OPS else m.tflops
        results.append(BenchResult(
            op=case.op, dtype=case.dtype, shape=case.shape, dims=case.dims, device=dev.name, median_s=m.median_s,
            p10_s=m.p10_s, p90_s=m.p90_s, repeats=m.repeats, flops=flops, bytes=nbytes, tflops=m.tflops, gbps=gbps,
            peak_memory_bytes=m.peak_memory_bytes, pct_of_peak=None if rate is None or not peak else 100 * rate / peak,
            speedup_vs_cpu=speedup, backend=case.backend, note=note,
        ))
    return results


def compare(a: list[BenchResult], b: list[BenchResult]) -> list[tuple[BenchResult, BenchResult, float]]:
    """Pairs of results of the same op, dtype, shape and backend, with b's speed over a's (b median / a median
    inverted: above 1 means b is faster)."""
    key = lambda r: (r.op, r.dtype, r.shape, r.backend)  # noqa: E731
    index = {key(r): r for r in a if r.repeats and r.median_s > 0}
    return [(index[key(r)], r, index[key(r)].median_s / r.median_s) for r in b
            if r.repeats and r.median_s > 0 and key(r) in index]

