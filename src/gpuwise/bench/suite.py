"""The benchmark suite: GEMM, copies, attention backends, conv2d, a transformer block and a training step,
on the chosen device and on the CPU as the baseline.

No flattered numbers: inputs are random (never zeros, which some hardware shortcuts), every call reads the
next of several input buffers that together exceed the caches, and warm-up calls (compilation, autotuning,
lazy loading) are never counted. Sizes fit the device: a case predicted (pace.py) to take longer than the limit
runs smaller or not at all, and says so; results are handed over as each case finishes, and Ctrl-C keeps them.
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
from gpuwise.bench.pace import (
    MIN_REPEAT_S,
    MIN_REPEATS,
    SHARES,
    Pace,
    case_seconds,
    flop_rate,
    force_hint,
)
from gpuwise.compat import scaled_mm
from gpuwise.errors import GpuwiseError, first_line
from gpuwise.hardware.catalog import Accelerator
from gpuwise.hardware.device import Device, device_for
from gpuwise.precision import ELEMENT_TYPES, PRECISIONS, Precision, default_precision, tf32_matmuls

MEMORY_OPS = ("copy", "h2d")  # rated in GB/s (the others in TFLOPS)
MIN_ROTATE_BYTES = 64 * 2**20
CPU_BASELINE_MAX_S = 10.0  # a CPU baseline expected to take longer (all its runs) is skipped


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
    """What to time, sized where it is built: ``dims`` and ``bytes`` are numbers, ``shape`` their label.
    ``estimate`` is its FLOPs known before anything is built (what pace.py sizes it by), ``compute`` the element
    type whose GEMM rate predicts its time; ``smaller`` runs instead when this size would take too long."""

    op: str
    dtype: str
    dims: Mapping[str, int]
    shape: str
    make: Callable[[torch.device], tuple[Callable[[], object], float | None]]  # fn, flops
    bytes: float | None = None  # the least the op moves (see BenchResult.bytes)
    backend: str | None = None
    cpu: bool = True  # has a CPU baseline
    estimate: float | None = None
    compute: str = "fp32"
    smaller: Case | None = None
    limit_s: float | None = None  # the most its runs may take: run_case cuts warm-up, then repeats, to fit

    @property
    def label(self) -> str:
        return f"{self.op} {self.dtype} {self.shape}{' ' + self.backend if self.backend else ''}"


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


def _rotating(shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype, device: torch.device) -> Callable[[], tuple]:
    """Input buffers cycled call by call, together twice the largest cache (so no call reads warm data): one
    tuple of tensors of ``shapes`` a call. Each shape's buffers are one allocation, filled by one call: hundreds of
    small ones cost a scheduler slice each on a busy CPU (7 s for a 256 x 256 GEMM's)."""
    size = torch.empty((), dtype=dtype).element_size()
    nbytes = sum(math.prod(s) for s in shapes) * size
    total = max(2 * cache_bytes(device), MIN_ROTATE_BYTES)
    count = max(2, min(4096, math.ceil(total / max(nbytes, 1))))
    stacks = [_randn((count, *s), dtype, device).unbind(0) for s in shapes]
    cycle = itertools.cycle(list(zip(*stacks, strict=True)))
    return lambda: next(cycle)


def _randn(shape, dtype, device) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=torch.float32).to(dtype)


def _gemm(m: int, n: int, k: int, dtype: str) -> Case:
    def make(device: torch.device):
        if dtype == "fp8":
            if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
                raise GpuwiseError("fp8 GEMM needs an NVIDIA GPU of compute capability 8.9 or newer", "")
            one = torch.ones((), device=device)
            nxt = _rotating(((m, k), (n, k)), torch.float8_e4m3fn, device)

            def fn():
                a, b = nxt()
                # fast accumulation, as fp8 training recipes use it forward (torchao's default)
                return scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)
        else:
            if dtype == "tf32" and device.type != "cuda":
                raise GpuwiseError("TF32 is an NVIDIA tensor-core format", "")
            nxt = _rotating(((m, k), (k, n)), ELEMENT_TYPES[dtype].torch_dtype, device)

            def fn():
                a, b = nxt()
                return a @ b
        return fn, 2.0 * m * n * k

    size = ELEMENT_TYPES[dtype].bytes
    out = ELEMENT_TYPES["bf16"].bytes if dtype == "fp8" else size  # fp8 GEMMs write bf16 (out_dtype above)
    return Case(op="gemm", dtype=dtype, dims={"m": m, "n": n, "k": k}, shape=f"{m}x{k} @ {k}x{n}", make=make,
                bytes=float((m * k + k * n) * size + m * n * out), cpu=dtype in ("fp32", "bf16"),
                estimate=2.0 * m * n * k, compute=dtype)


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
        nxt = _rotating(((b, h, s, d),) * 3, ELEMENT_TYPES[dtype].torch_dtype, device)

        def fn():
            q, k, v = nxt()
            with sdpa_kernel([which]):  # only this backend may run: it runs, or the call fails
                return F.scaled_dot_product_attention(q, k, v)

        fn()  # fails here, before timing, if the backend cannot run these inputs
        return fn, 4.0 * b * h * s * s * d

    return Case(op="attention", dtype=dtype, dims={"batch": b, "heads": h, "seq": s, "head_dim": d},
                shape=f"b{b} h{h} s{s} d{d}", make=make, backend=backend, estimate=4.0 * b * h * s * s * d,
                compute=dtype)


def _conv2d(b: int, c: int, hw: int, dtype: str) -> Case:
    def make(device: torch.device):
        t = ELEMENT_TYPES[dtype].torch_dtype
        w = _randn((c, c, 3, 3), t, device)
        nxt = _rotating(((b, c, hw, hw),), t, device)
        return (lambda: F.conv2d(nxt()[0], w, padding=1)), 2.0 * b * c * hw * hw * c * 9

    return Case(op="conv2d", dtype=dtype, dims={"batch": b, "channels": c, "height": hw, "width": hw, "kernel": 3},
                shape=f"{b}x{c}x{hw}x{hw} 3x3", make=make, estimate=2.0 * b * c * hw * hw * c * 9, compute=dtype)


def _block(b: int, s: int, h: int, heads: int, dtype: str) -> Case:
    """A GPT-2 block, forward + backward; FLOPs counted by the planner's tracker on fake tensors."""

    def make(device: torch.device):
        from gpuwise.models.gpt import Block, GPTConfig

        cfg = GPTConfig(n_layer=1, n_head=heads, n_embd=h)
        t = ELEMENT_TYPES[dtype].torch_dtype
        with torch.device(device):
            block = Block(cfg).to(t)
        nxt = _rotating(((b, s, h),), t, device)

        def fn():
            block(nxt()[0].detach().requires_grad_()).float().square().mean().backward()

        return fn, _fake_flops(lambda: Block(cfg), (b, s, h))

    # forward: the 12 h^2 weights of attention and MLP per token, the s x s scores; backward twice that
    return Case(op="block", dtype=dtype, dims={"batch": b, "seq": s, "hidden": h, "heads": heads},
                shape=f"b{b} s{s} h{h}", make=make, estimate=3.0 * (24.0 * b * s * h * h + 4.0 * b * s * s * h),
                compute=dtype)


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
    from gpuwise.models import get_model

    def make(device: torch.device):
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

    zoo = get_model(model)
    cfg = zoo.config  # 6 N per token (forward 2, backward 4), and the attention scores of every layer
    estimate = 6.0 * zoo.published_params * batch * seq + 12.0 * cfg.n_layer * batch * seq * seq * cfg.n_embd
    return Case(op="train-step", dtype=precision, dims={"batch": batch, "seq": seq},
                shape=f"{model} b{batch} s{seq}", make=make, estimate=estimate, compute=PRECISIONS[precision].compute)


def cases(device: torch.device, *, quick: bool, ops: tuple[str, ...], dtypes: tuple[str, ...],
          bf16: bool = True) -> list[Case]:
    """What to run on ``device`` (``bf16``: whether it computes in bf16, which sets the training step's
    default precision). The full suite's attention, conv2d, block and training step carry the --quick size as
    ``smaller``, for a device too slow for theirs."""
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

    def sized(small: Case, full: Callable[[], Case]) -> Case:
        return small if quick else replace(full(), smaller=small)

    if "attention" in ops:
        dtype = half if gpu else "fp32"
        for backend in (("flash", "efficient", "math", "cudnn") if gpu else ("flash", "math")):
            out.append(sized(_attention(2, 8, 512, 64, dtype, backend),
                             functools.partial(_attention, 8, 16, 4096, 64, dtype, backend)))
    if "conv2d" in ops:
        out.append(sized(_conv2d(8, 64, 56, half if gpu else "fp32"), lambda: _conv2d(64, 64, 56, half if gpu else
                                                                                        "fp32")))
    if "block" in ops:
        out.append(sized(_block(2, 256, 256, 4, "fp32"), lambda: _block(8, 1024, 768, 12, half if gpu else "fp32")))
    if "train-step" in ops:
        precision = default_precision(gpu=device.type == "cuda", bf16=bf16)  # MPS and CPU: fp32
        out.append(sized(_train_step("gpt2", 1, 128, precision), lambda: _train_step("gpt2", 8, 1024, precision)))
    return out


def _peak(acc: Accelerator | None, case: Case) -> float | None:
    if acc is None:
        return None
    if case.op == "copy":
        return acc.memory_bandwidth_gbps
    if case.op == "h2d":
        return None
    return acc.peak_tflops.get(PRECISIONS[case.dtype].rate_key if case.dtype in PRECISIONS else case.dtype)


class CaseTooLong(GpuwiseError):
    """The first call of a case took so long (``call_s``) that its repeats would run far past the limit: not run."""

    def __init__(self, message: str, call_s: float) -> None:
        super().__init__(message, "")
        self.call_s = call_s


def run_case(case: Case, dev: Device, *, warmup: int, repeats: int) -> tuple[Measurement, float | None, float | None]:
    """Time one case. A short op runs several times per timed repeat (at least MIN_REPEAT_S), and the
    figures are per call: synchronising around every single call would count its latency as work. With
    ``case.limit_s``, a slow op gives up warm-up runs (its first, untimed call warmed it), then repeats down to
    MIN_REPEATS, to stay within it; one so slow that even those would take twice the limit is not run."""
    device = torch.device(dev.name)
    nbytes = case.bytes
    with tf32_matmuls(case.dtype == "tf32"):
        fn, flops = case.make(device)
        with measure(case.op, device=dev, warmup=1, repeats=1) as probe:
            for _ in probe:
                fn()
        first = probe.result.median_s
        calls = max(1, min(1000, math.ceil(MIN_REPEAT_S / max(first, 1e-9))))
        if case.limit_s is not None:
            run_s = calls * max(first, 1e-9)
            runs = int((case.limit_s - first) / run_s)  # what still fits after the probe
            if runs < warmup + repeats:
                if case_seconds(first) > 2 * case.limit_s:
                    raise CaseTooLong(f"one call took {first:.2g} s: its {MIN_REPEATS} repeats would pass the "
                                      f"{case.limit_s:g} s a case may take; {force_hint(case_seconds(first))}", first)
                fewest = min(MIN_REPEATS, repeats)
                warmup = max(0, min(warmup, runs - fewest))
                repeats = max(fewest, min(repeats, runs - warmup))

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


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or another stop) during ``run_suite``: ``results`` holds every case that finished, ``planned`` how
    many were to run. The case it stopped in is dropped: half a measurement is none."""

    def __init__(self, results: list[BenchResult], planned: int) -> None:
        super().__init__(f"interrupted after {len(results)} of {planned} cases")
        self.results, self.planned = results, planned


def _probe(pace: Pace, dev: Device, dtype: str) -> None:
    """A rate for ``dtype`` on ``dev`` where none is measured yet: square GEMMs of growing size, each timed twice,
    until one call takes a tenth of a second (a CPU emulating bf16 stops at the first); the largest one's."""
    device = torch.device(dev.name)

    def gemm(n: int) -> Callable[[], object]:
        if dtype == "fp8":  # scaled_mm with bf16 output, as _gemm runs it
            a, b = (_randn((n, n), torch.float32, device).to(torch.float8_e4m3fn) for _ in range(2))
            one = torch.ones((), device=device)
            return lambda: scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        a, b = (_randn((n, n), ELEMENT_TYPES[dtype].torch_dtype, device) for _ in range(2))
        return lambda: a @ b

    with tf32_matmuls(dtype == "tf32"), contextlib.suppress(GpuwiseError, RuntimeError, ValueError, TypeError):
        for n in ((256, 512) if device.type == "cpu" else (1024, 4096)):
            fn = gemm(n)
            with measure(device=dev, warmup=1, repeats=2) as m:
                for _ in m:
                    fn()
            pace.learn(dtype, flops=2.0 * n**3, seconds=min(m.result.times_s))
            if min(m.result.times_s) > 0.1:
                break


def _call_seconds(pace: Pace, dev: Device, case: Case) -> float | None:
    """How long one call of ``case`` should take on ``dev``; None where nothing predicts it (the first GEMM of a
    dtype, which is the smallest: it is the probe)."""
    if case.op == "gemm":
        call = pace.call_seconds(case.dtype, case.estimate)
        measured = pace.measured_at(case.dtype)
        if call is not None and not pace.fits(call) and 0 < measured < case.estimate / 8:
            # a small GEMM predicts a large one badly on a busy machine (each call may wait a scheduler slice):
            # time one of half the size first, where that is cheap
            half = _gemm(*(max(1, v // 2) for v in (case.dims["m"], case.dims["n"], case.dims["k"])), case.dtype)
            if pace.left_s is None or 2 * call / 8 <= pace.left_s / 2:  # its probe call and one repeat
                with contextlib.suppress(GpuwiseError, RuntimeError, ValueError, TypeError):
                    m, _, _ = run_case(replace(half, limit_s=pace.left_s), dev, warmup=0, repeats=1)
                    pace.learn(case.dtype, flops=half.estimate, seconds=min(m.times_s))
                call = pace.call_seconds(case.dtype, case.estimate)
        return call
    if case.op in MEMORY_OPS:
        return pace.copy_seconds(case.bytes) if case.op == "copy" else None
    if case.estimate is None:
        return None
    if pace.rate(case.compute) is None:
        _probe(pace, dev, case.compute)
    return pace.call_seconds(case.compute, case.estimate, share=_share(case))


def _share(case: Case) -> float:
    return SHARES.get(f"{case.op} {case.backend}", SHARES.get(case.op, 1.0))


def _why(pace: Pace, case: Case) -> str:
    """What a prediction for ``case`` comes from, for its note."""
    if case.op == "copy":
        return f"{pace.gbps:,.1f} GB/s measured"
    rate = pace.rate(case.compute)
    source = f"{case.compute} GEMMs at {flop_rate(rate)}" if rate else "no rate"
    share = "" if case.op == "gemm" else f", {case.op} at {_share(case):.0%} of it"
    return f"{source}{share}{pace.emulated(case.compute)}"


def _sized(pace: Pace, dev: Device, case: Case) -> tuple[Case, str | None]:
    """The size of ``case`` that fits the limit (``case`` or its ``smaller``) and a note on the choice; or the case
    with the note saying why it is not run ("not run: ..."), when no size fits."""
    call = _call_seconds(pace, dev, case)
    if pace.fits(call):
        return replace(case, limit_s=pace.left_s), None
    if case.smaller is not None:
        small, note = _sized(pace, dev, case.smaller)
        if note is None:
            return small, f"smaller than the full suite's {case.shape}: {pace.over(call, _why(pace, case))}"
        return small, note
    return case, f"not run: {pace.over(call, _why(pace, case))}"


def _not_run(case: Case, dev: Device, note: str) -> BenchResult:
    return BenchResult(
        op=case.op, dtype=case.dtype, shape=case.shape, dims=case.dims, device=dev.name, median_s=math.nan,
        p10_s=math.nan, p90_s=math.nan, repeats=0, flops=None, bytes=None, tflops=None, gbps=None,
        peak_memory_bytes=None, pct_of_peak=None, speedup_vs_cpu=None, backend=case.backend, note=note)


def run_suite(device: str, *, quick: bool = False, ops: tuple[str, ...] = OPS,
              dtypes: tuple[str, ...] = ("fp32", "bf16"), accelerator: Accelerator | None = None,
              bf16: bool = True, progress: Callable[[str], None] | None = None, limit_s: float | None = None,
              budget_s: float | None = None, on_start: Callable[[list[Case]], None] | None = None,
              on_result: Callable[[BenchResult], None] | None = None) -> list[BenchResult]:
    """Every case on ``device`` (and on the CPU for the speed-up), as results; ``accelerator`` is the
    device's catalog row (``pct_of_peak``), ``bf16`` whether it computes in bf16. ``limit_s`` is the most one
    case may take, ``budget_s`` all of them together (pace.py; None: no limit). ``on_start`` gets the cases
    planned before the first runs, ``on_result`` each result as its case finishes; Ctrl-C raises ``Interrupted``
    with the finished ones."""
    dev = device_for(device)
    target = torch.device(dev.name)
    cpu = device_for("cpu")
    warmup, repeats = (1, 3) if quick else (3, 10)
    pace = Pace(limit_s=limit_s, quick=quick, budget_s=budget_s)
    cpu_pace = Pace(limit_s=CPU_BASELINE_MAX_S if limit_s is None else min(CPU_BASELINE_MAX_S, limit_s), quick=quick,
                    budget_s=budget_s, started=pace.started)  # the baselines spend the same budget
    planned = cases(target, quick=quick, ops=ops, dtypes=dtypes, bf16=bf16)
    results: list[BenchResult] = []
    try:
        if on_start:
            on_start(planned)
        for case in planned:
            results.append(_run_one(case, dev, cpu, pace, cpu_pace, warmup=warmup, repeats=repeats,
                                    accelerator=accelerator, progress=progress))
            if on_result:
                on_result(results[-1])
    except KeyboardInterrupt as exc:
        raise Interrupted(results, len(planned)) from exc
    return results


def _run_one(case: Case, dev: Device, cpu: Device, pace: Pace, cpu_pace: Pace, *, warmup: int, repeats: int,
             accelerator: Accelerator | None, progress: Callable[[str], None] | None) -> BenchResult:
    target = torch.device(dev.name)
    if progress:
        progress(case.label)
    case, sized = _sized(pace, dev, case)
    if sized is not None and sized.startswith("not run"):
        return _not_run(case, dev, sized)
    if progress and sized is not None:
        progress(case.label)
    try:
        m, flops, nbytes = run_case(case, dev, warmup=warmup, repeats=repeats)
    except CaseTooLong as exc:
        if case.op == "gemm":  # one call, measured: the next sizes are predicted from it
            pace.learn(case.dtype, flops=case.estimate, seconds=exc.call_s)
        return _not_run(case, dev, f"not run: {exc.message}")
    except (GpuwiseError, RuntimeError, ValueError, TypeError) as exc:  # a backend or dtype this device lacks
        return _not_run(case, dev, f"not run: {first_line(exc, limit=100)}")
    _learn(pace, case, m)
    speedup, baseline = None, None
    if target.type != "cpu" and case.cpu:
        speedup, baseline = _cpu_baseline(case, m, cpu, cpu_pace, quick=warmup == 1)
    note = "; ".join(n for n in (sized, baseline) if n) or None
    peak = _peak(accelerator, case)
    gbps = m.gbps if case.op in MEMORY_OPS else None  # a GEMM's bytes place it on the roofline, not rate it
    rate = gbps if case.op in MEMORY_OPS else m.tflops
    return BenchResult(
        op=case.op, dtype=case.dtype, shape=case.shape, dims=case.dims, device=dev.name, median_s=m.median_s,
        p10_s=m.p10_s, p90_s=m.p90_s, repeats=m.repeats, flops=flops, bytes=nbytes, tflops=m.tflops, gbps=gbps,
        peak_memory_bytes=m.peak_memory_bytes, pct_of_peak=None if rate is None or not peak else 100 * rate / peak,
        speedup_vs_cpu=speedup, backend=case.backend, note=note,
    )


def _cpu_baseline(case: Case, m: Measurement, cpu: Device, pace: Pace, *, quick: bool) -> tuple[float | None,
                                                                                                 str | None]:
    """The case on the CPU: (its speed-up over it, None), or (None, why there is none): a CPU that would take
    longer than its limit (``pace``: 10 s at most) is not asked."""
    case = replace(case, smaller=None)
    call = _call_seconds(pace, cpu, case)
    if call is None and case.estimate is not None:  # the first GEMM of a dtype: no rate on this CPU yet
        _probe(pace, cpu, case.compute)
        call = _call_seconds(pace, cpu, case)
    if not pace.fits(call):
        if call is None:  # nothing predicts it (a first copy): only a spent budget stops it
            return None, f"no CPU baseline: {pace.over(None, '')}"
        return None, f"no CPU baseline: about {case_seconds(call):.0f} s at this CPU's rate{pace.emulated(case.dtype)}"
    try:
        base, _, _ = run_case(replace(case, limit_s=pace.left_s), cpu, warmup=1, repeats=2 if quick else 3)
    except CaseTooLong as exc:
        return None, f"no CPU baseline: one call took {exc.call_s:.2g} s on it"
    except (GpuwiseError, RuntimeError, ValueError, TypeError):
        return None, "the CPU cannot run this case"
    _learn(pace, case, base)
    return base.median_s / m.median_s, None


def _learn(pace: Pace, case: Case, m: Measurement) -> None:
    """What a GEMM's or a copy's least-disturbed call took predicts the next size on the same device best."""
    if case.op == "gemm":
        pace.learn(case.dtype, flops=case.estimate, seconds=min(m.times_s))
    elif case.op == "copy":
        pace.learn_copy(nbytes=case.bytes, seconds=min(m.times_s))


def compare(a: list[BenchResult], b: list[BenchResult]) -> list[tuple[BenchResult, BenchResult, float]]:
    """Pairs of results of the same op, dtype, shape and backend, with b's speed over a's (b median / a median
    inverted: above 1 means b is faster)."""
    key = lambda r: (r.op, r.dtype, r.shape, r.backend)  # noqa: E731
    index = {key(r): r for r in a if r.repeats and r.median_s > 0}
    return [(index[key(r)], r, index[key(r)].median_s / r.median_s) for r in b
            if r.repeats and r.median_s > 0 and key(r) in index]

