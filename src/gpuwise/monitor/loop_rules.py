"""The rules of the loop's own time: is it waiting on data, on communication, or on the host (Python, launches)?

Each rule is ``(Window, earlier) -> (Verdict | None, checked) | None`` (``monitor.rules.Rule``): None when it does
not apply to this window (a step-timed rule without step timings), else the verdict (None: did not fire) and what it
checked, which is the evidence of a "healthy" diagnosis.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from gpuwise.environment import workers_cap
from gpuwise.monitor.thresholds import (
    HOST_BUSY_UTIL_PCT,
    HOST_PROCESS_CPU_PCT,
    HOST_SM_ACTIVE_PCT,
    HOST_UTIL_PCT,
    INPUT_GPU_BUSY_PCT,
    INPUT_WAIT_SHARE,
    IO_CPU_SHARE,
    IOWAIT_PCT,
    LAUNCH_COST_S,
    WINDOW_SAMPLES,
    WINDOW_STEPS,
    WORKERS_BUSY_PCT,
)
from gpuwise.monitor.verdict import Context, Loader, Verdict
from gpuwise.monitor.window import Earlier, Judged, Window, median, ms, pct, persistent, rounded


def input_bound(view: Window, earlier: Earlier) -> Judged | None:
    """Data wait past ``INPUT_WAIT_SHARE`` of the step, persistently, while the GPU waits too; the fix sizes the
    workers from the measured load and compute times. Needs step timings."""
    if not view.timed:
        return None
    ctx = view.context
    steps = view.steps
    shares = [min(1.0, s.data_wait_s / s.seconds) if s.seconds > 0 else 0.0 for s in steps]
    p = persistent(shares, INPUT_WAIT_SHARE, WINDOW_STEPS)
    checked = {"data_wait_share_median": rounded(p.median), "data_wait_threshold": INPUT_WAIT_SHARE,
               "steps_over_threshold": rounded(p.fraction, 3)}
    if not p.fires:
        return None, checked
    busy = median([d.util_pct for d in view.devices if d.util_pct is not None])
    if busy is not None and busy >= INPUT_GPU_BUSY_PCT:  # the GPU ran queued work through the waits
        checked.update(gpu_util_median=rounded(busy, 1), gpu_busy_veto=INPUT_GPU_BUSY_PCT)
        return None, checked
    wait = statistics.median(s.data_wait_s for s in steps)
    compute = max(statistics.median(s.seconds - s.data_wait_s for s in steps), 1e-9)
    step = statistics.median(s.seconds for s in steps)
    loader = ctx.loader or Loader()
    host_workers = median([h.workers for h in view.hosts if h.workers is not None])
    if loader.num_workers is not None:
        w0, w_src = loader.num_workers, "the DataLoader"
    elif host_workers is not None:
        w0, w_src = round(host_workers), "child processes seen on the host"
    else:
        w0, w_src = 0, "assumed (not known)"
    # Steady state with w workers, each taking `load` per batch: a batch is ready every load/w, so
    # step = max(compute, load/w) and wait = max(0, load/w - compute); with 0 workers the wait IS the load.
    load = wait if w0 == 0 else w0 * (wait + compute)
    # Does loading burn CPU or wait? With no workers the process makes each batch itself: its CPU time during the
    # wait says; with workers, each worker's share of a core does.
    if w0 == 0:
        cpu_share = median([s.data_wait_cpu_s / s.data_wait_s for s in steps
                             if s.data_wait_cpu_s is not None and s.data_wait_s > 0])
    else:
        cpu_share = median([h.workers_cpu_pct / 100 / h.workers for h in view.hosts
                             if h.workers and h.workers_cpu_pct is not None])
    waits_on_io = cpu_share is not None and cpu_share < IO_CPU_SHARE
    cap = workers_cap(ctx.usable_cores, ctx.world_size, waits_on_io=waits_on_io)  # a core stays with each process
    needed = max(1, math.ceil(load / compute - 1e-9))  # workers whose joint rate covers the compute time
    w_new = min(needed, cap)
    evidence: dict[str, Any] = {
        **checked, "steps_judged": len(steps), "windows_held": f"{p.windows_held}/{p.windows}",
        "data_wait_s_median": rounded(wait, 6), "compute_s_median": rounded(compute, 6),
        "step_s_median": rounded(step, 6),
        "load_s_per_batch": rounded(load, 6), "num_workers_now": w0, "num_workers_from": w_src,
        "usable_cores": ctx.usable_cores, "world_size": ctx.world_size, "workers_cap": cap,
        "workers_to_cover_load": needed, "loading_cpu_share": rounded(cpu_share, 3), "loading_waits_on_io": waits_on_io,
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
        fix.append(f"DataLoader(..., {', '.join(args)}): with {_workers_text(w_new)} a batch is ready every "
                   f"{ms(load / w_new)}, the step computes for {ms(compute)}")
        expected = (f"load ≈ {ms(load)}/batch, compute ≈ {ms(compute)}: with num_workers={w_new} the step goes "
                    f"{ms(step)} → {ms(new_step)} ({step / new_step:.1f}× faster), data wait "
                    f"{pct(p.median)} → {pct(new_wait / new_step)}")
        if ctx.device == "cpu":
            expected += " (less on a CPU run: the workers share the cores with the compute threads)"
        evidence.update(num_workers_new=w_new, step_s_new=rounded(new_step, 6), speedup=rounded(step / new_step, 3))
        if needed > cap:
            fix.append(f"even {_workers_text(cap)} cannot keep up ({needed} needed): make each batch cheaper to load "
                       "(pre-tokenize or cache decoded samples, lighter augmentation, decode on the GPU with DALI)")
    else:
        if ctx.device == "cuda" and loader.pin_memory is not True:
            fix.append("DataLoader(..., pin_memory=True) and .to(device, non_blocking=True): copies overlap compute")
        if w0 > 0 and loader.persistent_workers is not True:
            fix.append("DataLoader(..., persistent_workers=True): the workers survive the epoch (no restart stall)")
        fix.append(f"a faster dataset: {_workers_text(max(w0, cap))} per process is all this machine has "
                   f"({ctx.usable_cores} usable cores / {ctx.world_size} process(es), one kept for training) and "
                   f"{needed} are needed; pre-tokenize or cache decoded samples, lighten augmentation, or decode on "
                   "the GPU (DALI)")
        best = max(compute, load / max(1, max(w0, cap)))
        expected = (f"load ≈ {ms(load)}/batch vs compute {ms(compute)}: the step stays ≈ {ms(best)} until a batch "
                    f"loads in ≤ {ms(compute * max(1, max(w0, cap)))}; at that point it is {ms(compute)} "
                    f"({step / compute:.1f}× faster)")
    return Verdict(bottleneck="input-bound", share=p.median, evidence=evidence, fix=tuple(fix), expected=expected,
                   source=f"TB plugin DataLoader > 5% of step, raised to {INPUT_WAIT_SHARE:.0%} by the §B6 CPU runs; "
                          "SageMaker window/patience",
                   summary=f"data wait {pct(p.median)} of each step", change=change), checked


_HOST_FIX = ("torch.compile(model): fuses the small ops, so fewer kernels to launch",
             "torch.compile(model, mode=\"reduce-overhead\"): CUDA graphs, one launch for the whole step "
             "(static shapes)",
             "a larger micro-batch (e.g. 2×, with half the accumulation steps): the same launches carry twice the work")


def host_bound(view: Window, earlier: Earlier) -> Judged | None:
    """The GPU idles (low duty cycle) while data wait and communication are small, or it is busy with few SMs in
    use. With step timings it is judged after input-bound and communication-bound (and says nothing when either
    fired); without, only when ``watch_host`` did not fire."""
    ctx = view.context
    if view.timed:
        other_fired = any(earlier.get(rule, (None, {}))[0] is not None
                          for rule in ("input-bound", "communication-bound"))
        input_checked = earlier.get("input-bound", (None, {}))[1]
    elif earlier.get("watch-host", (None, {}))[0] is not None:
        return None
    else:
        other_fired, input_checked = False, {}
    utils = [d.util_pct for d in view.devices if d.util_pct is not None]
    if ctx.device != "cuda" or not utils:
        return None, {"gpu_util": "no GPU duty cycle sampled"}
    low = persistent(utils, HOST_UTIL_PCT, WINDOW_SAMPLES, below=True)
    checked: dict[str, Any] = {"gpu_util_median_pct": rounded(low.median, 1), "gpu_util_threshold_pct": HOST_UTIL_PCT}
    busy = [d for d in view.devices if d.util_pct is not None and d.sm_active_pct is not None
            and d.util_pct >= HOST_BUSY_UTIL_PCT]
    sm = persistent([d.sm_active_pct for d in busy], HOST_SM_ACTIVE_PCT, WINDOW_SAMPLES,  # type: ignore[misc]
                     below=True)
    if busy:
        checked.update(sm_active_median_pct=rounded(sm.median, 1), sm_active_threshold_pct=HOST_SM_ACTIVE_PCT)
    if other_fired:
        return None, checked
    step = median([s.seconds for s in view.steps])
    evidence: dict[str, Any] = {**checked}
    if ctx.kernels_per_step is not None and step:
        launch = ctx.kernels_per_step * LAUNCH_COST_S
        evidence.update(kernels_per_step=ctx.kernels_per_step, launch_cost_s=LAUNCH_COST_S,
                        launch_s_per_step=rounded(launch, 6), launch_share=rounded(launch / step))
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
                         f"{ms(evidence['launch_s_per_step'])} of the {ms(step)} step")  # type: ignore[arg-type]
        return Verdict(bottleneck="host-bound", share=share, evidence=evidence, fix=_HOST_FIX, expected=expected,
                       source="TB plugin GPU util < 50%; NVIDIA DCGM SM_ACTIVE < 50% ineffective; SageMaker "
                              "LowGPUUtilization window/patience",
                       summary=f"GPU idle {pct(share)} of the time while data wait and communication are small"), \
            checked
    if sm.fires and sm.median is not None:
        util = statistics.median(d.util_pct for d in busy)  # type: ignore[type-var]
        share = max(0.0, min(1.0, 1 - sm.median / max(util, 1e-9)))
        evidence.update(gpu_util_busy_median_pct=rounded(util, 1), samples=len(busy),
                        windows_held=f"{sm.windows_held}/{sm.windows}")
        expected = (f"kernels run {util:.0f}% of the time but keep only {sm.median:.0f}% of the SMs busy: at most "
                    f"{pct(share)} of the busy time is launch, sync or tiny-kernel overhead")
        return Verdict(bottleneck="host-bound", share=share, evidence=evidence, fix=_HOST_FIX, expected=expected,
                       source="KempnerPulse class 10 'busy, low SM use' (GR >= 40%, SM < 25%)",
                       summary=f"busy, low SM use: SM active {sm.median:.0f}% at {util:.0f}% duty cycle"), checked
    return None, checked


def watch_host(view: Window, earlier: Earlier) -> Judged | None:
    """No step timings: SageMaker CPUBottleneck / IOBottleneck from the device and host samples alone."""
    if view.timed:
        return None
    ctx = view.context
    utils = [d.util_pct for d in view.devices if d.util_pct is not None]
    hosts = view.hosts
    checked: dict[str, Any] = {"step_timings": "not available"}
    iowait = [h.iowait_pct for h in hosts if h.iowait_pct is not None]
    io = persistent(iowait, IOWAIT_PCT, WINDOW_SAMPLES)
    if iowait:
        checked.update(iowait_median_pct=rounded(io.median, 1), iowait_threshold_pct=IOWAIT_PCT)
    low = persistent(utils, HOST_UTIL_PCT, WINDOW_SAMPLES, below=True) if utils else None
    gpu_low = low is not None and low.fires
    if ctx.device == "cuda" and utils and not gpu_low:
        return None, checked
    main = [h.process_cpu_pct for h in hosts if h.process_cpu_pct is not None]
    hot = persistent(main, HOST_PROCESS_CPU_PCT, WINDOW_SAMPLES)
    per_worker = [h.workers_cpu_pct / h.workers for h in hosts
                  if h.workers and h.workers_cpu_pct is not None]
    workers = persistent(per_worker, WORKERS_BUSY_PCT, WINDOW_SAMPLES)
    checked.update(main_process_cpu_median_pct=rounded(hot.median, 1),
                   workers_cpu_median_pct_each=rounded(workers.median, 1))
    idle_share = (1 - low.median / 100) if low is not None and low.median is not None else None
    if low is not None:
        checked.update(gpu_util_median_pct=rounded(low.median, 1), gpu_util_threshold_pct=HOST_UTIL_PCT)
    now = median([h.workers for h in hosts if h.workers is not None])
    loader_fix = _generic_loader_fix(ctx, round(now) if now is not None else None)
    if io.fires or workers.fires:
        why = (f"I/O wait {io.median:.0f}% of the CPU time" if io.fires else
               f"the loader workers run at {workers.median:.0f}% of a core each")
        evidence = {**checked, "samples": len(hosts),
                    "reading": f"{why}: the data cannot be read or prepared fast enough"}
        fix = loader_fix if workers.fires else (
            "read from local NVMe or RAM (copy the data set to /dev/shm or local disk), not a network file system",
            *loader_fix)
        return Verdict(bottleneck="input-bound", share=idle_share, evidence=evidence, fix=fix,
                       expected=("step timings were not available: add gpuwise.Monitor to the loop to size the "
                                 "fix" + (f"; the GPU idles {pct(idle_share)} of the time" if idle_share else "")),
                       source="SageMaker IOBottleneck (iowait > 50%) / Dataloader rule, > 50% of the time",
                       summary=why), checked
    if gpu_low and hot.fires:
        evidence = {**checked, "samples": len(hosts),
                    "reading": "input-bound or host-bound: the GPU waits on the Python process (one core at "
                               f"{hot.median:.0f}%); step timings were not available to tell which"}
        return Verdict(bottleneck="host-bound", share=idle_share, evidence=evidence,
                       fix=(*(f"if it waits on data: {f}" for f in loader_fix[:1]),
                            *(f"if it waits on launches: {f}" for f in _HOST_FIX[:2]),
                            "time the loop (gpuwise.Monitor.step) to tell data wait from launch overhead"),
                       expected=f"the GPU idles {pct(idle_share or 0)} of the time: up to "
                                f"{1 / max(1e-9, 1 - (idle_share or 0)):.1f}× if the Python process kept it fed",
                       source="SageMaker CPUBottleneck (GPU < 10% while CPU > 90%, > 50% of the time), one core of "
                              "a Python process as the CPU",
                       summary=f"GPU idle {pct(idle_share or 0)} while the Python process holds a core at "
                               f"{hot.median:.0f}%"), checked
    if gpu_low:
        checked["reading"] = (f"the GPU idles {pct(idle_share or 0)} of the time but neither the Python process nor "
                              "the loader workers are busy: waiting on I/O, the network or another process; time "
                              "the loop to tell")
    return None, checked


def _workers_text(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


def _generic_loader_fix(ctx: Context, now: int | None) -> tuple[str, ...]:
    """Loader advice without step timings: double the workers seen (4 to start from none), within the cores."""
    loader = ctx.loader or Loader()
    now = loader.num_workers if loader.num_workers is not None else now
    cap = workers_cap(ctx.usable_cores, ctx.world_size)
    new = min(cap, 2 * now if now else 4)
    dataset = "a faster dataset: pre-tokenize or cache decoded samples, lighter augmentation"
    if new <= (now or 0):
        return (f"{dataset} ({_workers_text(now or 0)} already use the {ctx.usable_cores} usable cores)",)
    args = [f"num_workers={new}"]
    if ctx.device == "cuda" and loader.pin_memory is not True:
        args.append("pin_memory=True")
    args += ["prefetch_factor=2", "persistent_workers=True"]
    seen = "" if now is None else f" (now {now})"
    return (f"DataLoader(..., {', '.join(args)}){seen}: up to {_workers_text(cap)} per process on {ctx.usable_cores} "
            "usable cores", dataset)
