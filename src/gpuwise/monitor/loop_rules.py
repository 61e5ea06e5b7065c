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
from gpuwise.monitor.host_rules import Cores, cores_free, other_cores
from gpuwise.monitor.samples import HostSample
from gpuwise.monitor.thresholds import (
    CPU_HOST_BUSY_PCT,
    CPU_HOST_ONE_CORE_PCT,
    CPU_HOST_STEP_S,
    FREE_CORE_SLACK,
    HOST_BUSY_UTIL_PCT,
    HOST_PROCESS_CPU_PCT,
    HOST_SM_ACTIVE_PCT,
    HOST_UTIL_PCT,
    INPUT_GPU_BUSY_PCT,
    INPUT_RUNQ_SHARE,
    INPUT_WAIT_SHARE,
    IO_CPU_SHARE,
    IO_RUNQ_SHARE,
    IOWAIT_PCT,
    LAUNCH_COST_S,
    LOADER_MIN_CORE,
    LOADER_STARVED_CORE,
    MIN_JUDGED_STEPS,
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
    runq = median([s.data_wait_runq_s / s.data_wait_s for s in steps
                   if s.data_wait_runq_s is not None and s.data_wait_s > 0])
    if runq is not None and runq >= INPUT_RUNQ_SHARE:  # the thread waited for a core, not for the data
        checked.update(data_wait_runq_share=rounded(runq, 3), data_wait_runq_threshold=INPUT_RUNQ_SHARE,
                       input_bound="not the data: the loop's thread spent the wait in next() runnable with no core "
                                   "free (CPU contention: see oversubscribed)")
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
    # wait says; with workers, each worker's share of a core does. Either against the CPU it could have had.
    if w0 == 0:
        cpu_share = median([s.data_wait_cpu_s / s.data_wait_s for s in steps
                             if s.data_wait_cpu_s is not None and s.data_wait_s > 0])
    else:
        cpu_share = median([h.workers_cpu_pct / 100 / h.workers for h in view.hosts
                             if h.workers and h.workers_cpu_pct is not None])
    runq = median([s.data_wait_runq_s / s.data_wait_s for s in steps
                   if s.data_wait_runq_s is not None and s.data_wait_s > 0]) if w0 == 0 else None
    cause = loader_cause(cpu_share, cores_free(view.hosts, ctx.usable_cores, ctx.world_size), max(1, w0),
                         main_computes=w0 > 0, runq_share=runq)
    waits_on_io = cause["loading_cause"] == "io"
    cap = _cap(ctx, cause, waits_on_io=waits_on_io)  # a core stays with each process
    needed = max(1, math.ceil(load / compute - 1e-9))  # workers whose joint rate covers the compute time
    w_new = min(needed, cap)
    evidence: dict[str, Any] = {
        **checked, "steps_judged": len(steps), "windows_held": f"{p.windows_held}/{p.windows}",
        "data_wait_s_median": rounded(wait, 6), "compute_s_median": rounded(compute, 6),
        "step_s_median": rounded(step, 6),
        "load_s_per_batch": rounded(load, 6), "num_workers_now": w0, "num_workers_from": w_src,
        "usable_cores": ctx.usable_cores, "world_size": ctx.world_size, "workers_cap": cap,
        "workers_to_cover_load": needed, "loading_waits_on_io": waits_on_io, **cause,
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
        free = cause.get("free_cores")
        cores_text = (f"{ctx.usable_cores} usable cores" if free is None or waits_on_io else
                      f"{ctx.usable_cores} usable cores, {free:.1f} free of other work")
        fix.append(f"a faster dataset: {_workers_text(max(w0, cap))} per process is all this machine has "
                   f"({cores_text} / {ctx.world_size} process(es), one kept for training) and "
                   f"{needed} are needed; pre-tokenize or cache decoded samples, lighten augmentation, or decode on "
                   "the GPU (DALI)")
        if cause["loading_cause"] == "unclear":
            fix.append("if each batch waits on a disk or network read, more workers help beyond the cores: "
                       f"up to {workers_cap(ctx.usable_cores, ctx.world_size, waits_on_io=True)}; if it waits for "
                       "a core, free the cores first")
        if cause["loading_cause"] in ("cpu-starved", "unclear"):
            fix.insert(0, f"free the cores: other work keeps {cause['busy_cores_other_work']:.1f} of the "
                          f"{cause['host_cores']} cores busy and the loading gets only what is left (stop, renice "
                          "or move that work); more workers would split the same cycles")
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
    if ctx.device == "cpu":
        return _cpu_host_bound(view, earlier)
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


_CPU_HOST_FIX = ("a larger batch (e.g. 8×, the learning rate scaled with it): each op costs about the same "
                 "Python/dispatch time, so the same ops carry 8× the samples, and ops past ~32k elements run on "
                 "every intra-op thread",
                 "fewer, larger ops: fuse small layers, vectorise per-sample Python loops, no .item() or .cpu() "
                 "inside the step",
                 "torch.compile(model): fuses the small ops into fewer, larger kernels (needs a C++ compiler)")


def _cpu_host_bound(view: Window, earlier: Earlier) -> Judged:
    """A CPU run held by Python overhead: short steps on about one core while torch has >= 2 intra-op threads and
    >= 2 cores free of other work (the pool never engages: the ops are too small). Needs step timings, torch's
    thread count and host samples; says nothing when the data wait or oversubscription explains the time."""
    ctx = view.context
    threads = ctx.threads
    checked: dict[str, Any] = {"cpu_host": "not judged"}
    if not view.timed:
        checked["cpu_host"] = "not judged: no step timings"
        return None, checked
    if threads is None:
        checked["cpu_host"] = "not judged: torch's thread count is not known (gpuwise.Monitor in the loop gives it)"
        return None, checked
    hosts = [h for h in view.hosts if h.cpu_pct and h.process_cpu_pct is not None]
    if len(hosts) < MIN_JUDGED_STEPS:
        checked["cpu_host"] = "not judged: no host samples with the process's CPU"
        return None, checked
    cores = cores_free(hosts, ctx.usable_cores, ctx.world_size)
    assert cores is not None
    step = statistics.median(s.seconds for s in view.steps)
    wait = statistics.median(s.data_wait_s for s in view.steps)
    cpu = [h.process_cpu_pct for h in hosts]
    one = persistent(cpu, CPU_HOST_ONE_CORE_PCT, WINDOW_SAMPLES, below=True)  # type: ignore[arg-type]
    busy = persistent(cpu, CPU_HOST_BUSY_PCT, WINDOW_SAMPLES)  # type: ignore[arg-type]
    room = min(threads, cores.free_whole)  # cores the intra-op pool could run on
    checked = {"intra_op_threads": threads, "process_cpu_median_pct": rounded(one.median, 1),
               "one_core_band_pct": [CPU_HOST_BUSY_PCT, CPU_HOST_ONE_CORE_PCT], "step_s_median": rounded(step, 6),
               "short_step_threshold_s": CPU_HOST_STEP_S, "free_cores": rounded(cores.free, 2),
               "busy_cores_other_work": rounded(cores.other, 2)}
    if any(earlier.get(r, (None, {}))[0] is not None for r in ("input-bound", "oversubscribed")):
        return None, checked
    if threads < 2 or room < 2:
        checked["cpu_host"] = (f"{threads} intra-op thread(s) with {cores.free:.1f} free cores: the pool could not "
                               "have run wider")
        return None, checked
    if not (one.fires and busy.fires and step <= CPU_HOST_STEP_S):
        return None, checked
    used = (one.median or 0.0) / 100
    share = max(0.0, min(1.0, 1 - used / room))
    items = median([s.items for s in view.steps if s.items])
    k = 8
    evidence: dict[str, Any] = {**checked, "samples": len(hosts), "windows_held": f"{one.windows_held}/{one.windows}",
                                "cores_used": rounded(used, 2), "cores_the_pool_could_use": room,
                                "pool_idle_share": rounded(share, 3), "data_wait_s_median": rounded(wait, 6),
                                "steps_judged": len(view.steps)}
    rate = ""
    if items:
        evidence["samples_per_s"] = rounded(items / step, 1)
        rate = f" ({items / step:.0f} → up to ~{k * items / step:.0f} samples/s)"
    expected = (f"the step ({ms(step)}) uses {used:.1f} of the {room} cores its {threads} threads could have: its ops "
                f"are too small for the intra-op pool, so per-op overhead is the step. A batch {k}× larger costs "
                f"about the same overhead: samples/s up to ~{k}×{rate} while the ops stay small, then the pool "
                f"engages its {room} cores (measured here: a 64-wide MLP, batch 32 → 2048, ~100× the samples/s)")
    return Verdict(bottleneck="host-bound", share=share, evidence=evidence, fix=_CPU_HOST_FIX, expected=expected,
                   source="torch's intra-op grain (at::internal::GRAIN_SIZE = 32768 elements); the process on ~one "
                          "core with free cores and idle threads; issue 29 (a larger batch gave 5-10×)",
                   summary=f"Python overhead: {ms(step)} steps on {used:.1f} core while {threads} threads and "
                           f"{room} free cores wait"), checked


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
    # each worker's CPU against what it could have had: the cores other work and the main process leave, shared
    # (a worker starved of cores on a saturated host is as stuck as one at 100 % of an idle one)
    per_worker = [h.workers_cpu_pct / h.workers for h in hosts if h.workers and h.workers_cpu_pct is not None]
    of_offered = [100 * (h.workers_cpu_pct / 100 / h.workers) / _offered(h, ctx.usable_cores, ctx.world_size)
                  for h in hosts
                  if h.workers and h.workers_cpu_pct is not None]
    workers = persistent(of_offered, WORKERS_BUSY_PCT, WINDOW_SAMPLES)
    checked.update(main_process_cpu_median_pct=rounded(hot.median, 1),
                   workers_cpu_median_pct_each=rounded(median(per_worker), 1),
                   workers_cpu_of_offered_median_pct=rounded(workers.median, 1))
    idle_share = (1 - low.median / 100) if low is not None and low.median is not None else None
    if low is not None:
        checked.update(gpu_util_median_pct=rounded(low.median, 1), gpu_util_threshold_pct=HOST_UTIL_PCT)
    now = median([h.workers for h in hosts if h.workers is not None])
    cores = cores_free(hosts, ctx.usable_cores, ctx.world_size)
    if workers.fires:
        cause = loader_cause(median(per_worker) / 100, cores, max(1, round(now or 1)), main_computes=True)  # type: ignore[operator]
    elif io.fires:
        cause = {**(cores.evidence() if cores else {}), "loading_cause": "io",
                 "loading_cause_reading": f"I/O wait {io.median:.0f}% of the CPU time"}
    else:
        cause = {**(cores.evidence() if cores else {})}
    loader_fix = _generic_loader_fix(ctx, round(now) if now is not None else None, cause)
    if io.fires or workers.fires:
        why = (f"I/O wait {io.median:.0f}% of the CPU time" if io.fires else
               f"the loader workers run at {median(per_worker):.0f}% of a core each, "
               f"{workers.median:.0f}% of what they could have had")
        evidence = {**checked, **cause, "samples": len(hosts),
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


def loader_cause(cpu_share: float | None, cores: Cores | None, loaders: int, *, main_computes: bool,
                 runq_share: float | None = None) -> dict[str, Any]:
    """Does the loading burn CPU or wait (I/O, a sleep, the network)? ``cpu_share``: what each loader (the main process
    with no workers, else each worker) used, in cores; judged against the CPU each could have had: the cores other
    work leaves free (less the main process's own compute when workers load beside it), shared among the loaders,
    at most one core each. A loader that used what it was offered burns CPU; one offered under LOADER_STARVED_CORE of
    a core is CPU-starved; one that used under IO_CPU_SHARE of its offer waits on I/O."""
    out: dict[str, Any] = {"loading_cpu_share": rounded(cpu_share, 3)}
    if cores is not None:
        out.update(cores.evidence())
        room = cores.free - ((cores.main or 0.0) if main_computes else 0.0)
        offered = max(LOADER_MIN_CORE, min(1.0, room / loaders))
        out["loading_cpu_offered"] = rounded(offered, 3)
    else:
        offered = 1.0
        out["busy_cores"] = "not sampled: judged against a whole core"
    if cpu_share is None:
        out.update(loading_cause="unknown", loading_cause_reading="the loading's CPU time was not measured: "
                   "sized as CPU-bound (the cores cap the workers)")
        return out
    used = cpu_share / offered
    out["loading_cpu_of_offered"] = rounded(used, 3)
    whom = "each worker" if main_computes else "the process"
    if used < IO_CPU_SHARE and offered < LOADER_STARVED_CORE and runq_share is not None \
            and runq_share < IO_RUNQ_SHARE:
        # the kernel's run-queue time settles it: the loop's thread was off the CPU without waiting for a core
        cause, why = "io", (f"{whom} used {cpu_share:.2f} core and waited for a core only {pct(runq_share)} of the "
                            "wait (schedstat): it waits on I/O, a sleep or the network, not on the busy cores")
    elif used < IO_CPU_SHARE and offered < LOADER_STARVED_CORE:
        # off the CPU on a host that leaves it under a core: waiting on I/O and waiting in the run queue look the
        # same in CPU time; the safe side caps the workers by the free cores
        cause, why = "unclear", (f"{whom} used {cpu_share:.2f} of the {offered:.2f} core other work leaves it: it "
                                 "waits, on I/O or for a core (the CPU time cannot tell which); sized as CPU-bound")
    elif used < IO_CPU_SHARE:
        cause, why = "io", (f"{whom} used {cpu_share:.2f} of the {offered:.2f} core it could have had "
                            f"({pct(used)} < {pct(IO_CPU_SHARE)}): it waits on I/O, not on the CPU")
    elif offered < LOADER_STARVED_CORE:
        cause, why = "cpu-starved", (f"{whom} used {cpu_share:.2f} core, all of the {offered:.2f} other work leaves "
                                     "it: CPU-bound and starved of cores, not waiting on I/O")
    else:
        cause, why = "cpu", f"{whom} used {cpu_share:.2f} of the {offered:.2f} core it could have had: CPU-bound"
    out.update(loading_cause=cause, loading_cause_reading=why)
    return out


def _cap(ctx: Context, cause: dict[str, Any], *, waits_on_io: bool) -> int:
    """Workers per process: CPU-bound loading within the cores other work leaves free (one kept for training);
    loading that waits on I/O may take more than the cores."""
    free = cause.get("free_cores")
    whole = None if free is None or waits_on_io else max(0, math.floor(free + FREE_CORE_SLACK))
    return workers_cap(ctx.usable_cores, ctx.world_size, waits_on_io=waits_on_io, free_cores=whole)


def _offered(h: HostSample, usable: int, processes: int) -> float:
    """The cores one loader worker could have had in this sample: what other work and the main process leave,
    shared among the workers, at most one core (at least LOADER_MIN_CORE)."""
    if not h.cpu_pct or not h.workers:
        return 1.0
    free = max(0.0, min(float(usable), len(h.cpu_pct) - other_cores(h, processes)))
    return max(LOADER_MIN_CORE, min(1.0, (free - (h.process_cpu_pct or 0.0) / 100) / h.workers))


def _workers_text(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


def _generic_loader_fix(ctx: Context, now: int | None, cause: dict[str, Any] | None = None) -> tuple[str, ...]:
    """Loader advice without step timings: double the workers seen (4 to start from none), within the cores other
    work leaves free (CPU-bound) or IO_WORKERS_PER_CORE a core (waiting on I/O)."""
    loader = ctx.loader or Loader()
    now = loader.num_workers if loader.num_workers is not None else now
    cause = cause or {}
    waits_on_io = cause.get("loading_cause") == "io"
    cap = _cap(ctx, cause, waits_on_io=waits_on_io)
    new = min(cap, 2 * now if now else 4)
    free = cause.get("free_cores")
    cores_text = (f"{ctx.usable_cores} usable cores" if free is None or waits_on_io else
                  f"{ctx.usable_cores} usable cores, {free:.1f} free of other work")
    dataset = "a faster dataset: pre-tokenize or cache decoded samples, lighter augmentation"
    if new <= (now or 0):
        return (f"{dataset} ({_workers_text(now or 0)} already use the {cores_text})",)
    args = [f"num_workers={new}"]
    if ctx.device == "cuda" and loader.pin_memory is not True:
        args.append("pin_memory=True")
    args += ["prefetch_factor=2", "persistent_workers=True"]
    seen = "" if now is None else f" (now {now})"
    return (f"DataLoader(..., {', '.join(args)}){seen}: up to {_workers_text(cap)} per process on {cores_text}"
            + (" (the loading waits on I/O: more workers than cores)" if waits_on_io else ""), dataset)
