"""From a monitor's record to the bottleneck, its evidence and the fix.

How it judges (``diagnose``):

1. Warm-up: the first ``max(WARMUP_MIN_STEPS, 10 %)`` step events are skipped (never leaving fewer than
   ``MIN_JUDGED_STEPS``), and the samples taken before the last skipped step ended. Without step events, the samples
   from the first to the last one where a GPU was busy (else all but the first 10 %).
2. Windows with a patience, as SageMaker Debugger's rules do: the judged steps (samples) are cut into windows of
   ``WINDOW_STEPS`` (``WINDOW_SAMPLES``); a condition holds in a window when its median is past the threshold AND at
   least ``PATIENCE`` of the window's steps are; a class fires when the condition holds in at least half the windows.
   One slow step never fires anything.
3. Loss classes (time a fix would win back, ``share`` = fraction of step time): input-bound, communication-bound,
   host-bound (GPU runs only), throttled. Risks (``share`` None): memory-full, fragmentation. Roofline sides
   (memory-bound, compute-bound) are said only when no loss class fired and the roofline is known.
4. The primary bottleneck (``PRIMARY_RULE``): memory-full first when an OOM happened; then the loss class with the
   largest share; then the risks (memory-full before fragmentation); then the roofline side. Every class that fired
   is listed in ``findings``, the primary first. "healthy" when nothing fired, with what was checked as evidence.

Thresholds are relative to step time (shares), each with its source below; the published values are from
``/work/shared/reference/recommend-watch-anchors.md`` §B4 and the §B6 CPU runs.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gpuwise.monitor.samples import DeviceSample, HostSample, Record, Sample, StepEvent
from gpuwise.units import MiB, human_bytes

Bottleneck = Literal["input-bound", "host-bound", "memory-bound", "compute-bound", "communication-bound",
                     "fragmentation", "throttled", "memory-full", "healthy"]
BOTTLENECKS: tuple[str, ...] = ("input-bound", "host-bound", "memory-bound", "compute-bound", "communication-bound",
                                "fragmentation", "throttled", "memory-full", "healthy")

# -- thresholds ----------------------------------------------------------------------------------------------------

# Warm-up: step 1 carries CUDA context creation, cuDNN autotuning, torch.compile, the workers' first batches all at
# once; step 2 the optimizer's lazy state allocation (peak memory differs); recompiles and new shapes can follow for a
# few more, hence 10 % of a long run. SageMaker keeps initialisation apart too (MaxInitializationTime).
WARMUP_MIN_STEPS = 2
WARMUP_FRACTION = 0.10
MIN_JUDGED_STEPS = 3  # fewer judged steps than this: step-based classes are not judged (a median of 2 is a guess)

# Windows and patience: SageMaker's rules judge windows with a patience (LowGPUUtilization window=500 samples;
# CPUBottleneck/IOBottleneck fire when the condition holds "> 50 % of the time"). 20 steps is short enough that a
# phase change (an epoch with a cold cache) shows as its own window and long enough that its median ignores up to 9
# slow steps; 30 samples is 30 s at the monitor's 1 Hz.
WINDOW_STEPS = 20
WINDOW_SAMPLES = 30
PATIENCE = 0.5  # SageMaker CPUBottleneck/IOBottleneck threshold=50 (% of the time the condition holds)

# Input-bound: PyTorch TB plugin says DataLoader > 5 % of the step. Deviation: §B6 measured 0.18-0.27 data-wait share
# on a healthy no-sleep 0-worker CPU loop (collate and tensor creation) and 0.13-0.15 with 4 workers on a 5 ms/sample
# dataset, while the truly input-bound 0-worker case was 0.69-0.73. 0.30 sits above every healthy figure with margin
# and far below the input-bound one.
INPUT_WAIT_SHARE = 0.30
# How many workers a process may be told to start. Loading that burns CPU (decode, augment) gets the cores less one
# kept for training. Loading that mostly waits (disk, network, a sleep: the process's CPU time during the wait, or
# each worker's CPU, under IO_CPU_SHARE of the wall time) gains from more workers than cores, as PyTorch's own
# DataLoader allows past its "suggested max" warning: up to IO_WORKERS_PER_CORE per usable core.
IO_CPU_SHARE = 0.5
IO_WORKERS_PER_CORE = 4

# Communication-bound: the TB plugin's "communication > 10 % of the step" rule, kept: we count only the exposed part
# (what backward did not hide), which is pure loss, so the published value needs no margin.
COMM_EXPOSED_SHARE = 0.10

# Host-bound, low duty cycle: TB plugin "GPU util < 50 % => increase batch"; KempnerPulse/NVIDIA DCGM guidance
# "SM_ACTIVE < 50 % likely indicates ineffective GPU usage". SageMaker LowGPUUtilization uses p95 < 70 %; we take the
# lower, median-based 50 % because the data wait and exposed comm (which also idle the GPU) are ruled out first.
HOST_UTIL_PCT = 50.0
# Host-bound, "busy, low SM use": KempnerPulse class 10, GR >= 40 % and SM < 25 % ("overhead, sync, or small kernels").
HOST_BUSY_UTIL_PCT = 40.0
HOST_SM_ACTIVE_PCT = 25.0
# Per-kernel CPU cost in eager PyTorch: HTA's launch statistics put the CPU launch at 5-20 us (train-monitor-anchors
# §3); 10 us is the middle, used only as evidence (kernels_per_step x this vs the step time).
LAUNCH_COST_S = 10e-6
# Watch without step timings: SageMaker CPUBottleneck (GPU < 10 % while CPU > 90 %); a Python main process pinned at
# >= 90 % of one core is the GIL-bound version of "CPU > 90 %".
HOST_PROCESS_CPU_PCT = 90.0
WORKERS_BUSY_PCT = 90.0  # loader workers each >= 90 % of a core: they are the ones who cannot keep up
IOWAIT_PCT = 50.0  # SageMaker IOBottleneck(io_threshold=50)

# A GPU is "busy" in a sample at >= 10 % duty cycle: SageMaker's gpu_threshold=10 (below it the GPU counts as idle).
BUSY_UTIL_PCT = 10.0

# Throttled: a throttling clock-event reason (power cap, thermal, hardware slowdown, power brake) in a busy sample AND
# the SM clock below 90 % of max (gpustat#135 compares current with max clocks). GPU Boost moves the clock a few bins
# with temperature and voltage in a healthy run, so a reason with the clock within 10 % of max is not called a loss.
THROTTLE_CLOCK_RATIO = 0.90
# A power cap is a loss only when someone lowered the limit: at the board's default limit a busy H100/H200 runs at its
# power design point (a GEMM at 699 of 700 W holds ~1.6 of 1.98 GHz), which no setting of ours changes. Lowered =
# the enforced limit under 95% of nvmlDeviceGetPowerManagementDefaultLimit; unknown default: not judged.
POWER_LOWERED_RATIO = 0.95
# Input-bound needs the GPU to wait too: a loop that does not synchronise each step (a user's own, under Monitor)
# times next() while the GPU still runs queued work, so a high duty cycle over the same span vetoes it.
INPUT_GPU_BUSY_PCT = 90

# Fragmentation: no published share; torch's docs say reserved >> allocated. We call it when a quarter of the pool is
# reserved above the peak allocation (the caching allocator's rounding to 2 MiB / 20 MiB blocks explains a few %), and
# the gap is >= 512 MiB (a tiny model's 50 MiB gap is harmless), or when alloc retries rise after the warm-up
# (torchtitan logs any num_alloc_retries > 0; Composer calls 2 consecutive rises thrashing).
FRAG_GAP_SHARE = 0.25
FRAG_MIN_GAP_BYTES = 512 * MiB
ALLOC_RETRIES_MIN = 1

# Memory-full without an OOM: the TB plugin warns at peak > 90 % of the device. Deviation: 95 %, because a planned run
# aims near the device (90 % is a fine operating point) and NVML's "used" includes the CUDA context (~0.5 GiB).
MEMORY_FULL_SHARE = 0.95

# Roofline from GPM alone: KempnerPulse class 6 memory-bound DRAM >= 50 % & SM < 50 %; class 7 compute-heavy SM >= 80 %
# and class 2 tensor-heavy Tensor >= 50 % & SM >= 60 %.
GPM_DRAM_HEAVY_PCT = 50.0
GPM_SM_LOW_PCT = 50.0
GPM_SM_HEAVY_PCT = 80.0
GPM_TENSOR_HEAVY_PCT = 50.0
GPM_TENSOR_SM_PCT = 60.0

PRIMARY_RULE = ("memory-full first when an OOM happened; then the loss class (input-bound, communication-bound, "
                "host-bound, throttled) with the largest share of step time; then the risks (memory-full near the "
                "limit, then fragmentation); then the roofline side (memory-bound or compute-bound), which only "
                "fires when no loss class did")

_LOSS = ("input-bound", "communication-bound", "host-bound", "throttled")
_RISK = ("memory-full", "fragmentation")
_ROOFLINE = ("memory-bound", "compute-bound")
_TIE_ORDER = {name: i for i, name in enumerate(("memory-full", *_LOSS, "fragmentation", *_ROOFLINE, "healthy"))}


@dataclass(frozen=True, kw_only=True)
class Loader:
    """How the data is loaded now, where known (a torch DataLoader's own settings)."""

    num_workers: int | None = None
    pin_memory: bool | None = None
    prefetch_factor: int | None = None
    persistent_workers: bool | None = None
    batch_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class Context:
    """What the diagnosis knows beyond the record: the machine, the loader, and the plan where there is one."""

    device: str = "cpu"  # "cuda", "mps" or "cpu": what the loop ran on
    usable_cores: int = 1
    world_size: int = 1  # processes (DDP/FSDP ranks) on this machine
    loader: Loader | None = None
    peak_tflops: float | None = None  # the device's dense rate at the run's precision (catalog or calibration)
    bandwidth_gbps: float | None = None  # its memory bandwidth
    memory_total_bytes: int | None = None
    planned_step_s: float | None = None  # the plan's predicted step time on this device
    planned_peak_bytes: float | None = None  # the plan's peak memory per device
    planned_bytes_per_step: float | None = None  # bytes the step moves (roofline with the FLOPs of each step)
    kernels_per_step: int | None = None  # kernel launches of the captured step (host-bound evidence)
    remedies: tuple[str, ...] = ()  # the plan's remedies in order, each as the flags to add (memory-full)


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One class that fired: what it costs, why we say so, and what to change."""

    bottleneck: Bottleneck
    share: float | None  # fraction of step time it costs (None: a risk rather than time: memory-full, fragmentation)
    evidence: dict[str, Any]
    fix: tuple[str, ...]  # concrete changes, most useful first
    expected: str | None = None  # the expected effect, in words with numbers
    source: str = ""  # where the threshold comes from
    summary: str = ""  # the headline in a few words ("data wait 71% of each step")
    change: dict[str, Any] = field(default_factory=dict)  # the fix as settings ({"num_workers": 3, ...}) where
    # it is one a program can apply (gpuwise train --fix-input)


@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    bottleneck: Bottleneck
    evidence: dict[str, Any]
    fix: tuple[str, ...]
    expected: str | None = None
    findings: tuple[Finding, ...] = ()  # every class that fired, the primary first
    steps: int = 0  # step events the diagnosis saw (after the warm-up it skips)
    observed_vs_planned: dict[str, Any] = field(default_factory=dict)  # step time and peak memory, where planned
    note: str | None = None  # what it could not see ("no GPU counters: CPU side only")
    summary: str = ""  # the primary finding's headline


# -- small helpers -------------------------------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _windows(values: Sequence[float], size: int) -> list[Sequence[float]]:
    """Consecutive windows of ``size``; a last window shorter than half a window joins the one before."""
    if len(values) <= size:
        return [values] if values else []
    out = [values[i:i + size] for i in range(0, len(values), size)]
    if len(out) > 1 and len(out[-1]) < size / 2:
        out[-2] = [*out[-2], *out[-1]]
        out.pop()
    return out


@dataclass(frozen=True)
class _Persist:
    fires: bool
    median: float | None
    fraction: float  # of all values past the threshold
    windows: int
    windows_held: int


def _persistent(values: Sequence[float], threshold: float, size: int, *, below: bool = False) -> _Persist:
    """Does ``value >= threshold`` (``<`` with ``below``) hold in at least half the windows, each by its median and
    in at least PATIENCE of its values?"""
    if not values:
        return _Persist(False, None, 0.0, 0, 0)

    def past(v: float) -> bool:
        return v < threshold if below else v >= threshold

    wins = _windows(values, size)
    held = sum(1 for w in wins if past(statistics.median(w)) and sum(map(past, w)) >= PATIENCE * len(w))
    fraction = sum(map(past, values)) / len(values)
    return _Persist(held >= len(wins) / 2, statistics.median(values), fraction, len(wins), held)


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(float(x), digits)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"


def _throttle_kind(reason: str) -> str | None:
    """A decoded NVML clock-event reason -> the throttling it means, or None for the benign ones (GpuIdle,
    ApplicationsClocksSetting, SyncBoost, DisplayClockSetting). Accepts NVML's names in any case/spacing
    ("SwPowerCap", "sw_power_cap", "power cap", "clocks_event_reason_hw_thermal_slowdown")."""
    key = re.sub(r"[^a-z]", "", reason.lower())
    if "powerbrake" in key:
        return "power brake"
    if "thermal" in key:
        return "thermal"
    if "powercap" in key:
        return "power cap"
    if "slowdown" in key:
        return "hardware slowdown"
    return None


# -- the judged window ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _View:
    """What the diagnosis judges: steps after the warm-up and the samples in the same span."""

    steps: tuple[StepEvent, ...]
    warmup: int
    samples: tuple[Sample, ...]
    devices: tuple[DeviceSample, ...]  # every (sample, device) reading in the span
    hosts: tuple[HostSample, ...]
    sample_warmup: str


def _warmup_steps(n: int) -> int:
    skip = max(WARMUP_MIN_STEPS, math.ceil(WARMUP_FRACTION * n))
    return max(0, min(skip, n - MIN_JUDGED_STEPS))


def _view(record: Record) -> _View:
    steps = tuple(s for s in sorted(record.steps, key=lambda s: s.t) if s.seconds > 0)
    warm = _warmup_steps(len(steps))
    judged = steps[warm:]
    samples = tuple(sorted(record.samples, key=lambda s: s.t))
    if judged:
        t0 = steps[warm - 1].t if warm else judged[0].t - judged[0].seconds
        t1 = judged[-1].t + record.interval_s
        chosen = tuple(s for s in samples if t0 < s.t <= t1)
        how = f"samples from {t0:.1f} s to {t1:.1f} s (the judged steps)"
        if not chosen and samples:
            chosen, how = samples, "all samples (none fell within the judged steps)"
    else:
        busy = [i for i, s in enumerate(samples) if any((d.util_pct or 0) >= BUSY_UTIL_PCT for d in s.devices)]
        if busy:
            chosen = samples[busy[0]:busy[-1] + 1]
            how = "samples from the first to the last with a busy GPU"
        else:
            skip = math.ceil(WARMUP_FRACTION * len(samples)) if len(samples) >= 3 else 0
            chosen, how = samples[skip:], f"all samples but the first {skip}"
    return _View(steps=judged, warmup=warm, samples=chosen,
                 devices=tuple(d for s in chosen for d in s.devices),
                 hosts=tuple(s.host for s in chosen if s.host is not None), sample_warmup=how)


# -- the classes ---------------------------------------------------------------------------------------------------


def _input_bound(view: _View, ctx: Context) -> tuple[Finding | None, dict[str, Any]]:
    steps = view.steps
    shares = [min(1.0, s.data_wait_s / s.seconds) if s.seconds > 0 else 0.0 for s in steps]
    p = _persistent(shares, INPUT_WAIT_SHARE, WINDOW_STEPS)
    checked = {"data_wait_share_median": _r(p.median), "data_wait_threshold": INPUT_WAIT_SHARE,
               "steps_over_threshold": _r(p.fraction, 3)}
    if not p.fires:
        return None, checked
    busy = _median([d.util_pct for d in view.devices if d.util_pct is not None])
    if busy is not None and busy >= INPUT_GPU_BUSY_PCT:  # the GPU ran queued work through the waits
        checked.update(gpu_util_median=_r(busy, 1), gpu_busy_veto=INPUT_GPU_BUSY_PCT)
        return None, checked
    wait = statistics.median(s.data_wait_s for s in steps)
    compute = max(statistics.median(s.seconds - s.data_wait_s for s in steps), 1e-9)
    step = statistics.median(s.seconds for s in steps)
    loader = ctx.loader or Loader()
    host_workers = _median([h.workers for h in view.hosts if h.workers is not None])
    if loader.num_workers is not None:
        w0, w_src = loader.num_workers, "the DataLoader"
    elif host_workers is not None:
        w0, w_src = round(host_workers), "child processes seen on the host"
    else:
        w0, w_src = 0, "assumed (not known)"
    # Steady state with w workers, each taking `load` per batch: a batch is ready every load/w, so
    # step = max(compute, load/w) and wait = max(0, load/w - compute); with 0 workers the wait IS the load.
    load = wait if w0 == 0 else w0 * (wait + compute)
    cap = max(0, ctx.usable_cores // max(1, ctx.world_size) - 1)  # a core stays with each training process
    # Does loading burn CPU or wait? With no workers the process makes each batch itself: its CPU time during the
    # wait says; with workers, each worker's share of a core does.
    if w0 == 0:
        cpu_share = _median([s.data_wait_cpu_s / s.data_wait_s for s in steps
                             if s.data_wait_cpu_s is not None and s.data_wait_s > 0])
    else:
        cpu_share = _median([h.workers_cpu_pct / 100 / h.workers for h in view.hosts
                             if h.workers and h.workers_cpu_pct is not None])
    waits_on_io = cpu_share is not None and cpu_share < IO_CPU_SHARE
    if waits_on_io:
        cap = max(cap, IO_WORKERS_PER_CORE * ctx.usable_cores // max(1, ctx.world_size))
    needed = max(1, math.ceil(load / compute - 1e-9))  # workers whose joint rate covers the compute time
    w_new = min(needed, cap)
    evidence: dict[str, Any] = {
        **checked, "steps_judged": len(steps), "windows_held": f"{p.windows_held}/{p.windows}",
        "data_wait_s_median": _r(wait, 6), "compute_s_median": _r(compute, 6), "step_s_median": _r(step, 6),
        "load_s_per_batch": _r(load, 6), "num_workers_now": w0, "num_workers_from": w_src,
        "usable_cores": ctx.usable_cores, "world_size": ctx.world_size, "workers_cap": cap,
        "workers_to_cover_load": needed, "loading_cpu_share": _r(cpu_share, 3), "loading_waits_on_io": waits_on_io,
    }
    change: dict[str, Any] = {}
    fix: list[str] = []
    bursty = p.fraction < 0.8  # some steps wait and some do not: deeper prefetch evens out the bursts
    prefetch = max(4 if bursty else 2, loader.prefetch_factor or 2)
    expected: str
    if w_new > w0:
        new_step = max(compute, load / w_new)
        new_wait = max(0.0, load / w_new - compute)
        args = [f"num_workers={w_new}"]
        change["num_workers"] = w_new
        if ctx.device == "cuda" and loader.pin_memory is not True:
            args.append("pin_memory=True")
            change["pin_memory"] = True
        args += [f"prefetch_factor={prefetch}"]
        change["prefetch_factor"] = prefetch
        if loader.persistent_workers is not True:
            args.append("persistent_workers=True")
            change["persistent_workers"] = True
        fix.append(f"DataLoader(..., {', '.join(args)}): with {_workers(w_new)} a batch is ready every "
                   f"{_ms(load / w_new)}, the step computes for {_ms(compute)}")
        expected = (f"load ≈ {_ms(load)}/batch, compute ≈ {_ms(compute)}: with num_workers={w_new} the step goes "
                    f"{_ms(step)} → {_ms(new_step)} ({step / new_step:.1f}× faster), data wait "
                    f"{_pct(p.median)} → {_pct(new_wait / new_step)}")
        if ctx.device == "cpu":
            expected += " (less on a CPU run: the workers share the cores with the compute threads)"
        evidence.update(num_workers_new=w_new, step_s_new=_r(new_step, 6), speedup=_r(step / new_step, 3))
        if needed > cap:
            fix.append(f"even {_workers(cap)} cannot keep up ({needed} needed): make each batch cheaper to load "
                       "(pre-tokenize or cache decoded samples, lighter augmentation, decode on the GPU with DALI)")
    else:
        if ctx.device == "cuda" and loader.pin_memory is not True:
            fix.append("DataLoader(..., pin_memory=True) and .to(device, non_blocking=True): copies overlap compute")
        if w0 > 0 and loader.persistent_workers is not True:
            fix.append("DataLoader(..., persistent_workers=True): the workers survive the epoch (no restart stall)")
        fix.append(f"a faster dataset: {_workers(max(w0, cap))} per process is all this machine has "
                   f"({ctx.usable_cores} usable cores / {ctx.world_size} process(es), one kept for training) and "
                   f"{needed} are needed; pre-tokenize or cache decoded samples, lighten augmentation, or decode on "
                   "the GPU (DALI)")
        best = max(compute, load / max(1, max(w0, cap)))
        expected = (f"load ≈ {_ms(load)}/batch vs compute {_ms(compute)}: the step stays ≈ {_ms(best)} until a batch "
                    f"loads in ≤ {_ms(compute * max(1, max(w0, cap)))}; at that point it is {_ms(compute)} "
                    f"({step / compute:.1f}× faster)")
    return Finding(bottleneck="input-bound", share=p.median, evidence=evidence, fix=tuple(fix), expected=expected,
                   source=f"TB plugin DataLoader > 5% of step, raised to {INPUT_WAIT_SHARE:.0%} by the §B6 CPU runs; "
                          "SageMaker window/patience",
                   summary=f"data wait {_pct(p.median)} of each step", change=change), checked


def _communication_bound(view: _View, ctx: Context) -> tuple[Finding | None, dict[str, Any]]:
    steps = [s for s in view.steps if s.exposed_comm_s is not None]
    if len(steps) < MIN_JUDGED_STEPS:
        return None, {"exposed_comm": "not timed"}
    shares = [s.exposed_comm_s / s.seconds for s in steps]  # type: ignore[operator]
    p = _persistent(shares, COMM_EXPOSED_SHARE, WINDOW_STEPS)
    checked = {"exposed_comm_share_median": _r(p.median), "exposed_comm_threshold": COMM_EXPOSED_SHARE}
    if not p.fires:
        return None, checked
    step = statistics.median(s.seconds for s in steps)
    exposed = statistics.median(s.exposed_comm_s for s in steps)  # type: ignore[type-var]
    comm = _median([s.comm_s for s in steps if s.comm_s is not None])
    k = min(8, max(2, math.ceil(p.median / COMM_EXPOSED_SHARE)))
    step_k = step - exposed * (1 - 1 / k)
    evidence = {**checked, "steps_judged": len(steps), "windows_held": f"{p.windows_held}/{p.windows}",
                "exposed_comm_s_median": _r(exposed, 6), "comm_s_median": _r(comm, 6), "step_s_median": _r(step, 6),
                "world_size": ctx.world_size, "accumulation_suggested": k}
    fix = (f"gradient accumulation: {k} micro-batches per optimizer step, the first {k - 1} under model.no_sync(), "
           f"so one all-reduce serves {k} batches (exposed comm per sample ÷{k}; scale the LR for the larger batch)",
           "DDP(model, bucket_cap_mb=...): the default is 25; try 50 or 100 (fewer, larger all-reduces) and "
           "gradient_as_bucket_view=True; a smaller value if only the last bucket is exposed",
           "a faster link: NVLink / InfiniBand instead of PCIe / Ethernet; NCCL_DEBUG=INFO shows the transport NCCL "
           "picked (a P2P or IB path disabled by NCCL_P2P_DISABLE / NCCL_IB_DISABLE falls back to sockets)")
    expected = (f"at most {_pct(p.median)} off each step if all communication were hidden ({_ms(step)} → "
                f"{_ms(step - exposed)}); with {k}-step accumulation ≈ {_ms(step_k)} per micro-batch "
                f"({step / step_k:.2f}×)")
    return Finding(bottleneck="communication-bound", share=p.median, evidence=evidence, fix=fix, expected=expected,
                   source="TB plugin communication > 10% of step (exposed part only); SageMaker window/patience",
                   summary=f"exposed communication {_pct(p.median)} of each step"), checked


_HOST_FIX = ("torch.compile(model): fuses the small ops, so fewer kernels to launch",
             "torch.compile(model, mode=\"reduce-overhead\"): CUDA graphs, one launch for the whole step "
             "(static shapes)",
             "a larger micro-batch (e.g. 2×, with half the accumulation steps): the same launches carry twice the work")


def _host_bound(view: _View, ctx: Context, *, other_fired: bool,
                input_checked: dict[str, Any]) -> tuple[Finding | None, dict[str, Any]]:
    utils = [d.util_pct for d in view.devices if d.util_pct is not None]
    if ctx.device != "cuda" or not utils:
        return None, {"gpu_util": "no GPU duty cycle sampled"}
    low = _persistent(utils, HOST_UTIL_PCT, WINDOW_SAMPLES, below=True)
    checked: dict[str, Any] = {"gpu_util_median_pct": _r(low.median, 1), "gpu_util_threshold_pct": HOST_UTIL_PCT}
    busy = [d for d in view.devices if d.util_pct is not None and d.sm_active_pct is not None
            and d.util_pct >= HOST_BUSY_UTIL_PCT]
    sm = _persistent([d.sm_active_pct for d in busy], HOST_SM_ACTIVE_PCT, WINDOW_SAMPLES,  # type: ignore[misc]
                     below=True)
    if busy:
        checked.update(sm_active_median_pct=_r(sm.median, 1), sm_active_threshold_pct=HOST_SM_ACTIVE_PCT)
    if other_fired:
        return None, checked
    step = _median([s.seconds for s in view.steps])
    evidence: dict[str, Any] = {**checked}
    if ctx.kernels_per_step is not None and step:
        launch = ctx.kernels_per_step * LAUNCH_COST_S
        evidence.update(kernels_per_step=ctx.kernels_per_step, launch_cost_s=LAUNCH_COST_S,
                        launch_s_per_step=_r(launch, 6), launch_share=_r(launch / step))
    if low.fires and low.median is not None and view.steps:  # without step timings the idle is not explained
        share = 1 - low.median / 100
        evidence.update(samples=len(utils), windows_held=f"{low.windows_held}/{low.windows}",
                        steps_judged=len(view.steps), **{k: v for k, v in input_checked.items() if k != "steps"})
        if not view.steps:
            evidence["step_timings"] = "not available: the GPU idles but the cause (data or host) is not timed"
        expected = (f"the GPU ran kernels {low.median:.0f}% of the time: up to {1 / max(1e-9, 1 - share):.1f}× "
                    f"if the host kept it fed")
        if "launch_s_per_step" in evidence:
            expected += (f"; ~{ctx.kernels_per_step} launches × {LAUNCH_COST_S * 1e6:.0f} µs ≈ "
                         f"{_ms(evidence['launch_s_per_step'])} of the {_ms(step)} step")  # type: ignore[arg-type]
        return Finding(bottleneck="host-bound", share=share, evidence=evidence, fix=_HOST_FIX, expected=expected,
                       source="TB plugin GPU util < 50%; NVIDIA DCGM SM_ACTIVE < 50% ineffective; SageMaker "
                              "LowGPUUtilization window/patience",
                       summary=f"GPU idle {_pct(share)} of the time while data wait and communication are small"), \
            checked
    if sm.fires and sm.median is not None:
        util = statistics.median(d.util_pct for d in busy)  # type: ignore[type-var]
        share = max(0.0, min(1.0, 1 - sm.median / max(util, 1e-9)))
        evidence.update(gpu_util_busy_median_pct=_r(util, 1), samples=len(busy),
                        windows_held=f"{sm.windows_held}/{sm.windows}")
        expected = (f"kernels run {util:.0f}% of the time but keep only {sm.median:.0f}% of the SMs busy: at most "
                    f"{_pct(share)} of the busy time is launch, sync or tiny-kernel overhead")
        return Finding(bottleneck="host-bound", share=share, evidence=evidence, fix=_HOST_FIX, expected=expected,
                       source="KempnerPulse class 10 'busy, low SM use' (GR >= 40%, SM < 25%)",
                       summary=f"busy, low SM use: SM active {sm.median:.0f}% at {util:.0f}% duty cycle"), checked
    return None, checked


def _watch_host(view: _View, ctx: Context) -> tuple[Finding | None, dict[str, Any]]:
    """No step timings: SageMaker CPUBottleneck / IOBottleneck from the device and host samples alone."""
    utils = [d.util_pct for d in view.devices if d.util_pct is not None]
    hosts = view.hosts
    checked: dict[str, Any] = {"step_timings": "not available"}
    iowait = [h.iowait_pct for h in hosts if h.iowait_pct is not None]
    io = _persistent(iowait, IOWAIT_PCT, WINDOW_SAMPLES)
    if iowait:
        checked.update(iowait_median_pct=_r(io.median, 1), iowait_threshold_pct=IOWAIT_PCT)
    low = _persistent(utils, HOST_UTIL_PCT, WINDOW_SAMPLES, below=True) if utils else None
    gpu_low = low is not None and low.fires
    if ctx.device == "cuda" and utils and not gpu_low:
        return None, checked
    main = [h.process_cpu_pct for h in hosts if h.process_cpu_pct is not None]
    hot = _persistent(main, HOST_PROCESS_CPU_PCT, WINDOW_SAMPLES)
    per_worker = [h.workers_cpu_pct / h.workers for h in hosts
                  if h.workers and h.workers_cpu_pct is not None]
    workers = _persistent(per_worker, WORKERS_BUSY_PCT, WINDOW_SAMPLES)
    checked.update(main_process_cpu_median_pct=_r(hot.median, 1), workers_cpu_median_pct_each=_r(workers.median, 1))
    idle_share = (1 - low.median / 100) if low is not None and low.median is not None else None
    if low is not None:
        checked.update(gpu_util_median_pct=_r(low.median, 1), gpu_util_threshold_pct=HOST_UTIL_PCT)
    now = _median([h.workers for h in hosts if h.workers is not None])
    loader_fix = _generic_loader_fix(ctx, round(now) if now is not None else None)
    if io.fires or workers.fires:
        why = (f"I/O wait {io.median:.0f}% of the CPU time" if io.fires else
               f"the loader workers run at {workers.median:.0f}% of a core each")
        evidence = {**checked, "samples": len(hosts),
                    "reading": f"{why}: the data cannot be read or prepared fast enough"}
        fix = loader_fix if workers.fires else (
            "read from local NVMe or RAM (copy the data set to /dev/shm or local disk), not a network file system",
            *loader_fix)
        return Finding(bottleneck="input-bound", share=idle_share, evidence=evidence, fix=fix,
                       expected=("step timings were not available: add gpuwise.Monitor to the loop to size the "
                                 "fix" + (f"; the GPU idles {_pct(idle_share)} of the time" if idle_share else "")),
                       source="SageMaker IOBottleneck (iowait > 50%) / Dataloader rule, > 50% of the time",
                       summary=why), checked
    if gpu_low and hot.fires:
        evidence = {**checked, "samples": len(hosts),
                    "reading": "input-bound or host-bound: the GPU waits on the Python process (one core at "
                               f"{hot.median:.0f}%); step timings were not available to tell which"}
        return Finding(bottleneck="host-bound", share=idle_share, evidence=evidence,
                       fix=(*(f"if it waits on data: {f}" for f in loader_fix[:1]),
                            *(f"if it waits on launches: {f}" for f in _HOST_FIX[:2]),
                            "time the loop (gpuwise.Monitor.step) to tell data wait from launch overhead"),
                       expected=f"the GPU idles {_pct(idle_share or 0)} of the time: up to "
                                f"{1 / max(1e-9, 1 - (idle_share or 0)):.1f}× if the Python process kept it fed",
                       source="SageMaker CPUBottleneck (GPU < 10% while CPU > 90%, > 50% of the time), one core of "
                              "a Python process as the CPU",
                       summary=f"GPU idle {_pct(idle_share or 0)} while the Python process holds a core at "
                               f"{hot.median:.0f}%"), checked
    if gpu_low:
        checked["reading"] = (f"the GPU idles {_pct(idle_share or 0)} of the time but neither the Python process nor "
                              "the loader workers are busy: waiting on I/O, the network or another process; time "
                              "the loop to tell")
    return None, checked


def _workers(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


def _generic_loader_fix(ctx: Context, now: int | None) -> tuple[str, ...]:
    """Loader advice without step timings: double the workers seen (4 to start from none), within the cores."""
    loader = ctx.loader or Loader()
    now = loader.num_workers if loader.num_workers is not None else now
    cap = max(0, ctx.usable_cores // max(1, ctx.world_size) - 1)
    new = min(cap, 2 * now if now else 4)
    dataset = "a faster dataset: pre-tokenize or cache decoded samples, lighter augmentation"
    if new <= (now or 0):
        return (f"{dataset} ({_workers(now or 0)} already use the {ctx.usable_cores} usable cores)",)
    args = [f"num_workers={new}"]
    if ctx.device == "cuda" and loader.pin_memory is not True:
        args.append("pin_memory=True")
    args += ["prefetch_factor=2", "persistent_workers=True"]
    seen = "" if now is None else f" (now {now})"
    return (f"DataLoader(..., {', '.join(args)}){seen}: up to {_workers(cap)} per process on {ctx.usable_cores} "
            "usable cores", dataset)


def _throttled(view: _View) -> tuple[Finding | None, dict[str, Any]]:
    readings = [d for d in view.devices if d.clock_reasons is not None and d.sm_clock_mhz and d.sm_clock_max_mhz
                and (d.util_pct is None or d.util_pct >= BUSY_UTIL_PCT)]
    if not readings:
        return None, {"throttle": "no clock reasons with clocks sampled on a busy GPU"}

    def lowered(d: DeviceSample) -> bool:
        return bool(d.power_limit_w and d.power_default_limit_w
                    and d.power_limit_w < POWER_LOWERED_RATIO * d.power_default_limit_w)

    def kinds(d: DeviceSample) -> set[str]:
        return {k for r in d.clock_reasons or () if (k := _throttle_kind(r)) is not None
                and (k != "power cap" or lowered(d))}

    def throttled(d: DeviceSample) -> bool:
        return bool(kinds(d)) and d.sm_clock_mhz < THROTTLE_CLOCK_RATIO * d.sm_clock_max_mhz  # type: ignore[operator]

    flags = [1.0 if throttled(d) else 0.0 for d in readings]
    p = _persistent(flags, 1.0, WINDOW_SAMPLES)
    hit = [d for d in readings if throttled(d)]
    ratios = [d.sm_clock_mhz / d.sm_clock_max_mhz for d in readings]  # type: ignore[operator]
    checked = {"busy_samples": len(readings), "throttled_fraction": _r(p.fraction, 3),
               "sm_clock_ratio_median": _r(_median(ratios), 3), "clock_ratio_threshold": THROTTLE_CLOCK_RATIO}
    if not p.fires:
        return None, checked
    loss = statistics.median(1 - d.sm_clock_mhz / d.sm_clock_max_mhz for d in hit)  # type: ignore[operator]
    share = loss * p.fraction
    counts: dict[str, int] = {}
    for d in hit:
        for k in kinds(d):
            counts[k] = counts.get(k, 0) + 1
    reasons = sorted(counts, key=lambda k: -counts[k])
    power = _median([d.power_w for d in hit if d.power_w is not None])
    limit = _median([d.power_limit_w for d in hit if d.power_limit_w is not None])
    temp = _median([d.temperature_c for d in hit if d.temperature_c is not None])
    slow = _median([d.temperature_slowdown_c for d in hit if d.temperature_slowdown_c is not None])
    evidence = {**checked, "reasons": {k: counts[k] for k in reasons}, "clock_loss_median": _r(loss, 3),
                "sm_clock_mhz_median": _r(_median([d.sm_clock_mhz for d in hit]), 0),  # type: ignore[misc]
                "sm_clock_max_mhz": _r(_median([d.sm_clock_max_mhz for d in hit]), 0),  # type: ignore[misc]
                "power_w_median": _r(power, 1), "power_limit_w": _r(limit, 1), "temperature_c_median": _r(temp, 1),
                "temperature_slowdown_c": _r(slow, 1), "windows_held": f"{p.windows_held}/{p.windows}"}
    fix: list[str] = []
    for k in reasons:
        if k == "power cap":
            default = _median([d.power_default_limit_w for d in hit if d.power_default_limit_w is not None])
            at = f" ({power:.0f} W of a {limit:.0f} W limit" if power is not None and limit is not None else " ("
            at += f", lowered from the board's {default:.0f} W)" if default is not None else ")"
            fix.append(f"power cap{at}: restore the default with `sudo nvidia-smi -pl {default or 0:.0f}` (or ask the "
                       "admin who lowered it); `nvidia-smi -q -d POWER` shows the limits")
        elif k == "thermal":
            at = f" ({temp:.0f} °C, slowdown at {slow:.0f} °C)" if temp is not None and slow is not None else ""
            fix.append(f"thermal slowdown{at}: improve cooling (fans, airflow, blanking panels, room temperature); "
                       "`nvidia-smi -q -d TEMPERATURE,PERFORMANCE` shows the state")
        else:
            fix.append(f"{k}: the board slows itself on an external signal (power supply, power brake); ask the "
                       "admin to check the PSU and `nvidia-smi -q -d PERFORMANCE`")
    expected = (f"SM clock {_pct(1 - loss)} of max in {_pct(p.fraction)} of busy samples: compute-bound steps up to "
                f"{_pct(share)} shorter with full clocks ({1 / max(1e-9, 1 - share):.2f}×); memory-bound steps gain "
                "less")
    return Finding(bottleneck="throttled", share=share, evidence=evidence, fix=tuple(fix), expected=expected,
                   source="NVML clock-event reasons with SM clock < 90% of max (gpustat#135), > 50% of busy samples",
                   summary=f"clocks {_pct(loss)} below max ({', '.join(reasons)})"), checked


def _fragmentation(view: _View) -> tuple[Finding | None, dict[str, Any]]:
    allocs = [s.allocator for s in view.samples if s.allocator is not None and s.allocator.reserved_bytes > 0]
    if not allocs:
        return None, {"allocator": "not sampled"}
    # The peak use over the whole window: the trainer resets the allocator's peak every step, so a sample taken
    # while the loop waits for data sees only the weights and states; the steps' own peaks and the largest sampled
    # peak say what the pool is for.
    seen_peak = max([a.allocated_bytes for a in allocs] + [a.peak_allocated_bytes or 0 for a in allocs]
                    + [s.peak_memory_bytes or 0 for s in view.steps])
    gaps = [max(0, a.reserved_bytes - max(a.allocated_bytes, seen_peak)) for a in allocs]
    shares = [g / a.reserved_bytes for g, a in zip(gaps, allocs, strict=True)]
    p = _persistent(shares, FRAG_GAP_SHARE, WINDOW_SAMPLES)
    gap = statistics.median(gaps)
    retries = [a.alloc_retries for a in allocs if a.alloc_retries is not None]
    rise = (retries[-1] - retries[0]) if len(retries) >= 2 else 0
    split = _median([a.inactive_split_bytes for a in allocs if a.inactive_split_bytes is not None])
    checked = {"reserved_gap_share_median": _r(p.median), "gap_threshold": FRAG_GAP_SHARE,
               "alloc_retries_rise": rise}
    by_gap = p.fires and gap >= FRAG_MIN_GAP_BYTES
    if not (by_gap or rise >= ALLOC_RETRIES_MIN):
        return None, checked
    reserved = statistics.median(a.reserved_bytes for a in allocs)
    evidence = {**checked, "reserved_bytes_median": int(reserved), "gap_bytes_median": int(gap),
                "peak_allocated_bytes": seen_peak,
                "inactive_split_bytes_median": None if split is None else int(split),
                "min_gap_bytes": FRAG_MIN_GAP_BYTES, "samples": len(allocs),
                "alloc_retries_first_last": [retries[0], retries[-1]] if len(retries) >= 2 else None}
    fix = ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before the first CUDA call): segments grow in "
           "place instead of splitting into blocks that cannot be reused",
           "keep shapes fixed (pad sequences to a few bucket lengths) so freed blocks fit the next step",
           "if retries keep rising: a smaller micro-batch with gradient accumulation")
    parts = []
    if by_gap:
        parts.append(f"up to {human_bytes(gap)} of the {human_bytes(reserved)} pool back for use")
    if rise:
        parts.append(f"alloc retries (each a cache flush and a synchronising cudaMalloc) {rise} → 0")
    summary = (f"{human_bytes(gap)} reserved above peak use ({_pct(p.median or 0)} of the pool)" if by_gap else
               f"{rise} allocator retries after the warm-up")
    return Finding(bottleneck="fragmentation", share=None, evidence=evidence, fix=fix, expected="; ".join(parts),
                   source="torch memory docs (reserved >> allocated); torchtitan num_alloc_retries > 0; Composer "
                          "retries rising = thrashing",
                   summary=summary), checked


def _memory_full(record: Record, view: _View, ctx: Context) -> tuple[Finding | None, dict[str, Any]]:
    total = ctx.memory_total_bytes or _median([d.memory_total_bytes for d in view.devices
                                               if d.memory_total_bytes])
    fracs: list[tuple[float, str]] = []
    if total:
        fracs += [(s.peak_memory_bytes / total, "step peak (max_memory_allocated)") for s in view.steps
                  if s.peak_memory_bytes is not None]
        fracs += [(s.allocator.reserved_bytes / total, "allocator reserved") for s in view.samples
                  if s.allocator is not None]
    fracs += [(d.process_memory_bytes / d.memory_total_bytes, "this process on the device (NVML)")
              for d in view.devices if d.process_memory_bytes and d.memory_total_bytes]
    # The device-wide figure counts other processes too: it judges only where nothing says what is ours.
    device_wide = [(d.memory_used_bytes / d.memory_total_bytes, "device used (NVML; other processes included)")
                   for d in view.devices if d.memory_used_bytes is not None and d.memory_total_bytes]
    if not fracs:
        fracs = device_wide
    peak, where = max(fracs) if fracs else (None, None)
    checked = {"peak_memory_share": _r(peak), "memory_full_threshold": MEMORY_FULL_SHARE}
    if device_wide and fracs is not device_wide and max(device_wide)[0] >= MEMORY_FULL_SHARE > (peak or 0):
        checked["device_memory_share"] = _r(max(device_wide)[0])  # full, but by other processes: say so only
    oom = record.ooms[0] if record.ooms else None
    if oom is None and (peak is None or peak < MEMORY_FULL_SHARE):
        return None, checked
    evidence: dict[str, Any] = {**checked, "peak_from": where, "memory_total_bytes": None if total is None else
                                int(total), "ooms": len(record.ooms)}
    if oom is not None:
        evidence.update(oom_step=oom.step, oom_message=oom.message[:2000])
        if oom.allocator is not None:
            evidence.update(oom_reserved_bytes=oom.allocator.reserved_bytes,
                            oom_allocated_bytes=oom.allocator.allocated_bytes)
    fix: tuple[str, ...]
    if ctx.remedies:
        fix = tuple(ctx.remedies)
    else:
        fix = ("activation checkpointing (recompute activations in backward: memory of about one layer's instead of "
               "all layers')",
               "halve the micro-batch and double gradient accumulation (same effective batch, about half the "
               "activation memory)",
               "bf16 mixed precision (activations at 2 bytes instead of 4)")
    gap = 0 if oom is None or oom.allocator is None else oom.allocator.reserved_bytes - oom.allocator.allocated_bytes
    if oom is not None and oom.allocator is not None and gap >= FRAG_MIN_GAP_BYTES and \
            gap >= FRAG_GAP_SHARE * oom.allocator.reserved_bytes:  # the fragmentation rule, at the OOM
        fix = (f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: at the OOM {human_bytes(gap)} was reserved but "
               "unallocated", *fix)
    if oom is not None:
        expected = "the run completes: the first remedy that fits; each later one trades speed for memory"
        summary = f"out of memory at step {oom.step}"
    else:
        expected = (f"peak {_pct(peak or 0)} of the device leaves {_pct(1 - (peak or 0))} headroom: one longer "
                    "batch or a fragmentation spike away from an OOM; the first remedy restores headroom")
        summary = f"peak memory {_pct(peak or 0)} of the device"
    return Finding(bottleneck="memory-full", share=None, evidence=evidence, fix=fix, expected=expected,
                   source="an OomEvent; else TB plugin peak > 90% of device, raised to 95% (NVML counts the context)",
                   summary=summary), checked


def _roofline(view: _View, ctx: Context) -> tuple[Finding | None, dict[str, Any]]:
    step = _median([s.seconds for s in view.steps])
    flops = _median([s.flops for s in view.steps if s.flops])
    gpm = {k: _median([v for d in view.devices if (v := getattr(d, f"{k}_pct")) is not None])
           for k in ("sm_active", "tensor_active", "dram_active")}
    gpm_ev = {f"{k}_median_pct": _r(v, 1) for k, v in gpm.items() if v is not None}
    checked: dict[str, Any] = {}
    if step and flops and ctx.peak_tflops:
        checked.update(achieved_tflops=_r(flops / step / 1e12, 2), mfu=_r(flops / step / 1e12 / ctx.peak_tflops))
    if step and flops and ctx.peak_tflops and ctx.planned_bytes_per_step and ctx.bandwidth_gbps:
        t_math = flops / (ctx.peak_tflops * 1e12)
        t_mem = ctx.planned_bytes_per_step / (ctx.bandwidth_gbps * 1e9)
        intensity = flops / ctx.planned_bytes_per_step
        ridge = ctx.peak_tflops * 1e12 / (ctx.bandwidth_gbps * 1e9)
        gbps = ctx.planned_bytes_per_step / step / 1e9
        evidence = {**checked, "achieved_gbps": _r(gbps, 1), "bandwidth_util": _r(gbps / ctx.bandwidth_gbps),
                    "peak_tflops": ctx.peak_tflops, "bandwidth_gbps": ctx.bandwidth_gbps,
                    "flops_per_step": flops, "bytes_per_step": ctx.planned_bytes_per_step,
                    "arithmetic_intensity": _r(intensity, 2), "ridge_flops_per_byte": _r(ridge, 2),
                    "step_s_median": _r(step, 6), "t_math_s": _r(t_math, 6), "t_memory_s": _r(t_mem, 6),
                    "steps_judged": len(view.steps), **gpm_ev}
        mfu = checked["mfu"]
        if intensity < ridge:
            return Finding(
                bottleneck="memory-bound", share=t_mem / step, evidence=evidence,
                fix=("torch.compile(model): fuses elementwise ops (norms, activations, residual adds) so their "
                     "tensors cross HBM once", "a larger micro-batch: the weights are read once for more tokens",
                     "bf16 (or fp8) activations and weights: half the bytes per step"),
                expected=(f"{gbps:.0f} GB/s of {ctx.bandwidth_gbps:.0f} ({_pct(gbps / ctx.bandwidth_gbps)}), MFU "
                          f"{_pct(mfu)}: the step moves {intensity:.0f} FLOP/byte, below the ridge at {ridge:.0f}; "
                          f"fewer bytes shorten it down to the math floor {_ms(t_math)} (now {_ms(step)})"),
                source="roofline: the plan's FLOPs and bytes per step vs the catalog's peak and bandwidth",
                summary=f"{intensity:.0f} FLOP/byte < ridge {ridge:.0f}; {gbps:.0f} GB/s, MFU {_pct(mfu)}"), checked
        return Finding(
            bottleneck="compute-bound", share=t_math / step, evidence=evidence,
            fix=("nothing wrong in the loop: the step sits on the compute side of the roofline",
                 "lower precision: fp8 matmuls (torchao float8 / Transformer Engine) on Hopper or newer",
                 "a faster GPU (by its dense TFLOPS at this precision)"),
            expected=(f"MFU {_pct(mfu)} ({flops / step / 1e12:.0f} of {ctx.peak_tflops:.0f} TFLOPS): fp8 doubles the "
                      "dense matmul rate, so up to ~2× on the matmul share of the step"),
            source="roofline: the plan's FLOPs and bytes per step vs the catalog's peak and bandwidth",
            summary=f"MFU {_pct(mfu)}, {flops / step / 1e12:.0f} TFLOPS; {intensity:.0f} FLOP/byte ≥ ridge "
                    f"{ridge:.0f}"), checked
    sm, tensor, dram = gpm["sm_active"], gpm["tensor_active"], gpm["dram_active"]
    if sm is None:
        return None, checked
    evidence = {**checked, **gpm_ev, "samples": len(view.devices), "steps_judged": len(view.steps)}
    if dram is not None and dram >= GPM_DRAM_HEAVY_PCT and sm < GPM_SM_LOW_PCT:
        return Finding(
            bottleneck="memory-bound", share=dram / 100, evidence=evidence,
            fix=("torch.compile(model): fuses elementwise ops so their tensors cross HBM once",
                 "a larger micro-batch: the weights are read once for more tokens",
                 "bf16 (or fp8): half the bytes per step"),
            expected=f"DRAM active {dram:.0f}%, SM active {sm:.0f}%: every byte not moved shortens the step",
            source="KempnerPulse class 6: DRAM >= 50% and SM < 50%",
            summary=f"DRAM active {dram:.0f}%, SM active {sm:.0f}%"), checked
    if sm >= GPM_SM_HEAVY_PCT or (tensor is not None and tensor >= GPM_TENSOR_HEAVY_PCT and sm >= GPM_TENSOR_SM_PCT):
        return Finding(
            bottleneck="compute-bound", share=sm / 100, evidence=evidence,
            fix=("nothing wrong in the loop: the SMs are busy",
                 "lower precision: fp8 matmuls (torchao float8 / Transformer Engine) on Hopper or newer",
                 "a faster GPU (by its dense TFLOPS at this precision)"),
            expected=f"SM active {sm:.0f}%" + (f", tensor active {tensor:.0f}%" if tensor is not None else "") +
                     ": fp8 doubles the dense matmul rate, so up to ~2× on the matmul share",
            source="KempnerPulse classes 7 (SM >= 80%) and 2 (Tensor >= 50% and SM >= 60%)",
            summary=f"SM active {sm:.0f}%" + (f", tensor {tensor:.0f}%" if tensor is not None else "")), checked
    return None, checked


# -- the diagnosis -------------------------------------------------------------------------------------------------


def _rank(f: Finding, oom: bool) -> tuple[int, float, int]:
    if f.bottleneck == "memory-full" and oom:
        tier = 0
    elif f.bottleneck in _LOSS:
        tier = 1
    elif f.bottleneck in _RISK:
        tier = 2
    else:
        tier = 3
    return tier, -(f.share or 0.0), _TIE_ORDER[f.bottleneck]


def _observed_vs_planned(view: _View, ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {}
    step = _median([s.seconds for s in view.steps])
    if ctx.planned_step_s and step:
        out["step_s"] = {"observed": _r(step, 6), "planned": _r(ctx.planned_step_s, 6),
                         "ratio": _r(step / ctx.planned_step_s, 3)}
    if ctx.planned_peak_bytes:
        candidates: list[tuple[Callable[[], list[int]], str]] = [
            (lambda: [s.peak_memory_bytes for s in view.steps if s.peak_memory_bytes is not None],
             "step peak (max_memory_allocated)"),
            (lambda: [s.allocator.peak_allocated_bytes or s.allocator.allocated_bytes for s in view.samples
                      if s.allocator is not None], "allocator peak"),
            (lambda: [d.process_memory_bytes for d in view.devices if d.process_memory_bytes is not None],
             "process memory (NVML)"),
        ]
        for get, source in candidates:
            values = get()
            if values:
                peak = max(values)
                out["peak_bytes"] = {"observed": int(peak), "planned": int(ctx.planned_peak_bytes),
                                     "ratio": _r(peak / ctx.planned_peak_bytes, 3), "from": source}
                break
    return out


def diagnose(record: Record, context: Context | None = None) -> Diagnosis:
    """The bottleneck of a recorded run, its evidence and the fix.

    >>> diagnose(Record()).bottleneck
    'healthy'
    """
    ctx = context or Context(device=record.device_kind)
    if not record.samples and not record.steps and not record.ooms:
        return Diagnosis(bottleneck="healthy", evidence={"recorded": "nothing"}, fix=(), note="nothing recorded",
                         summary="nothing recorded")
    view = _view(record)
    findings: list[Finding] = []
    checked: dict[str, Any] = {"steps_judged": len(view.steps), "warmup_steps_skipped": view.warmup,
                               "samples_judged": len(view.samples), "samples_span": view.sample_warmup}
    notes: list[str] = []
    has_steps = len(view.steps) >= MIN_JUDGED_STEPS
    if record.steps and not has_steps:
        notes.append(f"only {len(view.steps)} step(s): too few to judge the step timings")
    loss_fired = False
    input_checked: dict[str, Any] = {}
    if has_steps:
        f, input_checked = _input_bound(view, ctx)
        checked.update(input_checked)
        findings += [f] if f else []
        f, c = _communication_bound(view, ctx)
        checked.update(c)
        findings += [f] if f else []
        loss_fired = bool(findings)
        f, c = _host_bound(view, ctx, other_fired=loss_fired, input_checked=input_checked)
        checked.update(c)
        findings += [f] if f else []
    else:
        f, c = _watch_host(view, ctx)
        checked.update(c)
        if f is None:
            f, c = _host_bound(view, ctx, other_fired=False, input_checked={})
            checked.update(c)
        findings += [f] if f else []
    f, c = _throttled(view)
    checked.update(c)
    findings += [f] if f else []
    loss_fired = any(f.bottleneck in _LOSS for f in findings)
    for judge in (lambda: _memory_full(record, view, ctx), lambda: _fragmentation(view)):
        f, c = judge()
        checked.update(c)
        findings += [f] if f else []
    if not loss_fired:
        f, c = _roofline(view, ctx)
        checked.update(c)
        findings += [f] if f else []

    findings.sort(key=lambda f: _rank(f, bool(record.ooms)))
    if not view.devices:
        notes.append("no GPU counters: the diagnosis used the loop's own timings and the CPU side only"
                     if record.steps else "no GPU counters and no step timings: the host side only")
    elif not record.steps:
        notes.append("no step timings: judged from the device and host samples alone")
    if record.note:
        notes.insert(0, record.note)
    note = "; ".join(notes) or None
    ovp = _observed_vs_planned(view, ctx)
    if not findings:
        fix: tuple[str, ...] = ()
        if not record.steps:
            fix = ("time the loop with gpuwise.Monitor (monitor.step each iteration) to judge data wait and "
                   "communication",)
        return Diagnosis(bottleneck="healthy", evidence=checked, fix=fix, expected=None, findings=(),
                         steps=len(view.steps), observed_vs_planned=ovp, note=note,
                         summary=f"nothing fired over {len(view.steps)} steps" if view.steps else
                         f"nothing fired over {len(view.samples)} samples" if len(view.samples) >= MIN_JUDGED_STEPS
                         else f"too short to judge: {len(view.samples)} samples and no step timings")
    top = findings[0]
    evidence = {**top.evidence, "steps_judged": len(view.steps), "warmup_steps_skipped": view.warmup}
    return Diagnosis(bottleneck=top.bottleneck, evidence=evidence, fix=top.fix, expected=top.expected,
                     findings=tuple(findings), steps=len(view.steps), observed_vs_planned=ovp, note=note,
                     summary=top.summary)


# -- output --------------------------------------------------------------------------------------------------------


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def _finding_json(f: Finding) -> dict[str, Any]:
    return {"bottleneck": f.bottleneck, "share": _r(f.share), "summary": f.summary, "evidence": f.evidence,
            "fix": list(f.fix), "expected": f.expected, "source": f.source, "change": _jsonable(f.change)}


def diagnosis_json(d: Diagnosis) -> dict[str, Any]:
    """A plain dict json.dumps takes: bottleneck, summary, evidence, fix, expected, findings, observed_vs_planned,
    note, steps."""
    return _jsonable({"bottleneck": d.bottleneck, "summary": d.summary, "evidence": d.evidence, "fix": list(d.fix),
                      "expected": d.expected, "findings": [_finding_json(f) for f in d.findings],
                      "observed_vs_planned": d.observed_vs_planned, "note": d.note, "steps": d.steps})


def render_lines(d: Diagnosis) -> list[str]:
    """Short lines for people: the bottleneck, the fix, the expected effect, the other findings, the plan, the note."""
    lines = [f"bottleneck: {d.bottleneck}" + (f" ({d.summary})" if d.summary else "")]
    for i, fix in enumerate(d.fix):
        lines.append(("fix: " if i == 0 else "     ") + fix)
    if d.expected:
        lines.append(f"expected: {d.expected}")
    for f in d.findings[1:]:
        lines.append(f"also: {f.bottleneck}" + (f" ({f.summary})" if f.summary else ""))
    ovp = d.observed_vs_planned
    if "step_s" in ovp:
        s = ovp["step_s"]
        lines.append(f"step: {_ms(s['observed'])} observed vs {_ms(s['planned'])} planned ({s['ratio']:.2f}×)")
    if "peak_bytes" in ovp:
        p = ovp["peak_bytes"]
        lines.append(f"peak memory: {human_bytes(p['observed'])} observed vs {human_bytes(p['planned'])} planned "
                     f"({p['ratio']:.2f}×)")
    if d.note:
        lines.append(f"note: {d.note}")
    return lines


__all__ = ["BOTTLENECKS", "PRIMARY_RULE", "Bottleneck", "Context", "Diagnosis", "Finding", "Loader", "diagnose",
           "diagnosis_json", "render_lines"]
