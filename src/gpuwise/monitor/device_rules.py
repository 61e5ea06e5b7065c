"""The rules of the device: is it throttled, full, fragmented, or on which side of the roofline?

Each rule is ``(Window, earlier) -> (Verdict | None, checked) | None`` (``monitor.rules.Rule``).
"""

from __future__ import annotations

import re
import statistics
from typing import Any

from gpuwise.monitor.samples import DeviceSample
from gpuwise.monitor.thresholds import (
    ALLOC_RETRIES_MIN,
    BUSY_UTIL_PCT,
    FRAG_GAP_SHARE,
    FRAG_MIN_GAP_BYTES,
    GPM_DRAM_HEAVY_PCT,
    GPM_SM_HEAVY_PCT,
    GPM_SM_LOW_PCT,
    GPM_TENSOR_HEAVY_PCT,
    GPM_TENSOR_SM_PCT,
    MEMORY_FULL_SHARE,
    POWER_LOWERED_RATIO,
    THROTTLE_CLOCK_RATIO,
    WINDOW_SAMPLES,
)
from gpuwise.monitor.verdict import LOSS, Verdict
from gpuwise.monitor.window import Earlier, Judged, Window, device_total, median, ms, pct, persistent, rounded
from gpuwise.units import human_bytes


def throttle_kind(reason: str) -> str | None:
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


def throttled(view: Window, earlier: Earlier) -> Judged | None:
    """A throttling clock-event reason with the SM clock under ``THROTTLE_CLOCK_RATIO`` of max, in most busy
    samples; a power cap counts only where someone lowered the limit."""
    readings = [d for d in view.devices if d.clock_reasons is not None and d.sm_clock_mhz and d.sm_clock_max_mhz
                and (d.util_pct is None or d.util_pct >= BUSY_UTIL_PCT)]
    if not readings:
        return None, {"throttle": "no clock reasons with clocks sampled on a busy GPU"}

    def lowered(d: DeviceSample) -> bool:
        return bool(d.power_limit_w and d.power_default_limit_w
                    and d.power_limit_w < POWER_LOWERED_RATIO * d.power_default_limit_w)

    def kinds(d: DeviceSample) -> set[str]:
        return {k for r in d.clock_reasons or () if (k := throttle_kind(r)) is not None
                and (k != "power cap" or lowered(d))}

    def throttled(d: DeviceSample) -> bool:
        return bool(kinds(d)) and d.sm_clock_mhz < THROTTLE_CLOCK_RATIO * d.sm_clock_max_mhz  # type: ignore[operator]

    flags = [1.0 if throttled(d) else 0.0 for d in readings]
    p = persistent(flags, 1.0, WINDOW_SAMPLES)
    hit = [d for d in readings if throttled(d)]
    ratios = [d.sm_clock_mhz / d.sm_clock_max_mhz for d in readings]  # type: ignore[operator]
    checked = {"busy_samples": len(readings), "throttled_fraction": rounded(p.fraction, 3),
               "sm_clock_ratio_median": rounded(median(ratios), 3), "clock_ratio_threshold": THROTTLE_CLOCK_RATIO}
    if not p.fires:
        return None, checked
    loss = statistics.median(1 - d.sm_clock_mhz / d.sm_clock_max_mhz for d in hit)  # type: ignore[operator]
    share = loss * p.fraction
    counts: dict[str, int] = {}
    for d in hit:
        for k in kinds(d):
            counts[k] = counts.get(k, 0) + 1
    reasons = sorted(counts, key=lambda k: -counts[k])
    power = median([d.power_w for d in hit if d.power_w is not None])
    limit = median([d.power_limit_w for d in hit if d.power_limit_w is not None])
    temp = median([d.temperature_c for d in hit if d.temperature_c is not None])
    slow = median([d.temperature_slowdown_c for d in hit if d.temperature_slowdown_c is not None])
    evidence = {**checked, "reasons": {k: counts[k] for k in reasons}, "clock_loss_median": rounded(loss, 3),
                "sm_clock_mhz_median": rounded(median([d.sm_clock_mhz for d in hit]), 0),  # type: ignore[misc]
                "sm_clock_max_mhz": rounded(median([d.sm_clock_max_mhz for d in hit]), 0),  # type: ignore[misc]
                "power_w_median": rounded(power, 1), "power_limit_w": rounded(limit, 1),
                "temperature_c_median": rounded(temp, 1),
                "temperature_slowdown_c": rounded(slow, 1), "windows_held": f"{p.windows_held}/{p.windows}"}
    fix: list[str] = []
    for k in reasons:
        if k == "power cap":
            default = median([d.power_default_limit_w for d in hit if d.power_default_limit_w is not None])
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
    expected = (f"SM clock {pct(1 - loss)} of max in {pct(p.fraction)} of busy samples: compute-bound steps up to "
                f"{pct(share)} shorter with full clocks ({1 / max(1e-9, 1 - share):.2f}×); memory-bound steps gain "
                "less")
    return Verdict(bottleneck="throttled", share=share, evidence=evidence, fix=tuple(fix), expected=expected,
                   source="NVML clock-event reasons with SM clock < 90% of max (gpustat#135), > 50% of busy samples",
                   summary=f"clocks {pct(loss)} below max ({', '.join(reasons)})"), checked


def fragmentation(view: Window, earlier: Earlier) -> Judged | None:
    """A quarter of the pool reserved above the peak use (and at least ``FRAG_MIN_GAP_BYTES``), or allocator
    retries rising after the warm-up."""
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
    p = persistent(shares, FRAG_GAP_SHARE, WINDOW_SAMPLES)
    gap = statistics.median(gaps)
    retries = [a.alloc_retries for a in allocs if a.alloc_retries is not None]
    rise = (retries[-1] - retries[0]) if len(retries) >= 2 else 0
    split = median([a.inactive_split_bytes for a in allocs if a.inactive_split_bytes is not None])
    checked = {"reserved_gap_share_median": rounded(p.median), "gap_threshold": FRAG_GAP_SHARE,
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
    summary = (f"{human_bytes(gap)} reserved above peak use ({pct(p.median or 0)} of the pool)" if by_gap else
               f"{rise} allocator retries after the warm-up")
    return Verdict(bottleneck="fragmentation", share=None, evidence=evidence, fix=fix, expected="; ".join(parts),
                   source="torch memory docs (reserved >> allocated); torchtitan num_alloc_retries > 0; Composer "
                          "retries rising = thrashing",
                   summary=summary), checked


def memory_full(view: Window, earlier: Earlier) -> Judged | None:
    """An OOM, or the peak past ``MEMORY_FULL_SHARE`` of the device; the fix is the plan's remedies in order."""
    ctx = view.context
    total = device_total(view)
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
    checked = {"peak_memory_share": rounded(peak), "memory_full_threshold": MEMORY_FULL_SHARE}
    if device_wide and fracs is not device_wide and max(device_wide)[0] >= MEMORY_FULL_SHARE > (peak or 0):
        checked["device_memory_share"] = rounded(max(device_wide)[0])  # full, but by other processes: say so only
    oom = view.ooms[0] if view.ooms else None
    if oom is None and (peak is None or peak < MEMORY_FULL_SHARE):
        return None, checked
    evidence: dict[str, Any] = {**checked, "peak_from": where, "memory_total_bytes": None if total is None else
                                int(total), "ooms": len(view.ooms)}
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
        expected = (f"peak {pct(peak or 0)} of the device leaves {pct(1 - (peak or 0))} headroom: one longer "
                    "batch or a fragmentation spike away from an OOM; the first remedy restores headroom")
        summary = f"peak memory {pct(peak or 0)} of the device"
    return Verdict(bottleneck="memory-full", share=None, evidence=evidence, fix=fix, expected=expected,
                   source="an OomEvent; else TB plugin peak > 90% of device, raised to 95% (NVML counts the context)",
                   summary=summary), checked


def roofline(view: Window, earlier: Earlier) -> Judged | None:
    """Which side of the roofline the step sits on (the plan's FLOPs and bytes, else GPM activity); said only when
    no loss class fired."""
    if any(verdict is not None and verdict.bottleneck in LOSS for verdict, _ in earlier.values()):
        return None
    ctx = view.context
    step = median([s.seconds for s in view.steps])
    flops = median([s.flops for s in view.steps if s.flops])
    gpm = {k: median([v for d in view.devices if (v := getattr(d, f"{k}_pct")) is not None])
           for k in ("sm_active", "tensor_active", "dram_active")}
    gpm_ev = {f"{k}_median_pct": rounded(v, 1) for k, v in gpm.items() if v is not None}
    checked: dict[str, Any] = {}
    if step and flops and ctx.peak_tflops:
        checked.update(achieved_tflops=rounded(flops / step / 1e12, 2),
                       mfu=rounded(flops / step / 1e12 / ctx.peak_tflops))
    if step and flops and ctx.peak_tflops and ctx.planned_bytes_per_step and ctx.bandwidth_gbps:
        t_math = flops / (ctx.peak_tflops * 1e12)
        t_mem = ctx.planned_bytes_per_step / (ctx.bandwidth_gbps * 1e9)
        intensity = flops / ctx.planned_bytes_per_step
        ridge = ctx.peak_tflops * 1e12 / (ctx.bandwidth_gbps * 1e9)
        gbps = ctx.planned_bytes_per_step / step / 1e9
        evidence = {**checked, "achieved_gbps": rounded(gbps, 1), "bandwidth_util": rounded(gbps / ctx.bandwidth_gbps),
                    "peak_tflops": ctx.peak_tflops, "bandwidth_gbps": ctx.bandwidth_gbps,
                    "flops_per_step": flops, "bytes_per_step": ctx.planned_bytes_per_step,
                    "arithmetic_intensity": rounded(intensity, 2), "ridge_flops_per_byte": rounded(ridge, 2),
                    "step_s_median": rounded(step, 6), "t_math_s": rounded(t_math, 6), "t_memory_s": rounded(t_mem, 6),
                    "steps_judged": len(view.steps), **gpm_ev}
        mfu = checked["mfu"]
        if intensity < ridge:
            return Verdict(
                bottleneck="memory-bound", share=t_mem / step, evidence=evidence,
                fix=("torch.compile(model): fuses elementwise ops (norms, activations, residual adds) so their "
                     "tensors cross HBM once", "a larger micro-batch: the weights are read once for more tokens",
                     "bf16 (or fp8) activations and weights: half the bytes per step"),
                expected=(f"{gbps:.0f} GB/s of {ctx.bandwidth_gbps:.0f} ({pct(gbps / ctx.bandwidth_gbps)}), MFU "
                          f"{pct(mfu)}: the step moves {intensity:.0f} FLOP/byte, below the ridge at {ridge:.0f}; "
                          f"fewer bytes shorten it down to the math floor {ms(t_math)} (now {ms(step)})"),
                source="roofline: the plan's FLOPs and bytes per step vs the catalog's peak and bandwidth",
                summary=f"{intensity:.0f} FLOP/byte < ridge {ridge:.0f}; {gbps:.0f} GB/s, MFU {pct(mfu)}"), checked
        return Verdict(
            bottleneck="compute-bound", share=t_math / step, evidence=evidence,
            fix=("nothing wrong in the loop: the step sits on the compute side of the roofline",
                 "lower precision: fp8 matmuls (torchao float8 / Transformer Engine) on Hopper or newer",
                 "a faster GPU (by its dense TFLOPS at this precision)"),
            expected=(f"MFU {pct(mfu)} ({flops / step / 1e12:.0f} of {ctx.peak_tflops:.0f} TFLOPS): fp8 doubles the "
                      "dense matmul rate, so up to ~2× on the matmul share of the step"),
            source="roofline: the plan's FLOPs and bytes per step vs the catalog's peak and bandwidth",
            summary=f"MFU {pct(mfu)}, {flops / step / 1e12:.0f} TFLOPS; {intensity:.0f} FLOP/byte ≥ ridge "
                    f"{ridge:.0f}"), checked
    sm, tensor, dram = gpm["sm_active"], gpm["tensor_active"], gpm["dram_active"]
    if sm is None:
        return None, checked
    evidence = {**checked, **gpm_ev, "samples": len(view.devices), "steps_judged": len(view.steps)}
    if dram is not None and dram >= GPM_DRAM_HEAVY_PCT and sm < GPM_SM_LOW_PCT:
        return Verdict(
            bottleneck="memory-bound", share=dram / 100, evidence=evidence,
            fix=("torch.compile(model): fuses elementwise ops so their tensors cross HBM once",
                 "a larger micro-batch: the weights are read once for more tokens",
                 "bf16 (or fp8): half the bytes per step"),
            expected=f"DRAM active {dram:.0f}%, SM active {sm:.0f}%: every byte not moved shortens the step",
            source="KempnerPulse class 6: DRAM >= 50% and SM < 50%",
            summary=f"DRAM active {dram:.0f}%, SM active {sm:.0f}%"), checked
    if sm >= GPM_SM_HEAVY_PCT or (tensor is not None and tensor >= GPM_TENSOR_HEAVY_PCT and sm >= GPM_TENSOR_SM_PCT):
        return Verdict(
            bottleneck="compute-bound", share=sm / 100, evidence=evidence,
            fix=("nothing wrong in the loop: the SMs are busy",
                 "lower precision: fp8 matmuls (torchao float8 / Transformer Engine) on Hopper or newer",
                 "a faster GPU (by its dense TFLOPS at this precision)"),
            expected=f"SM active {sm:.0f}%" + (f", tensor active {tensor:.0f}%" if tensor is not None else "") +
                     ": fp8 doubles the dense matmul rate, so up to ~2× on the matmul share",
            source="KempnerPulse classes 7 (SM >= 80%) and 2 (Tensor >= 50% and SM >= 60%)",
            summary=f"SM active {sm:.0f}%" + (f", tensor {tensor:.0f}%" if tensor is not None else "")), checked
    return None, checked
