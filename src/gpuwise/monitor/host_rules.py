"""The rules of the host's cores: threads and processes against the cores, and the cores other work leaves free.

Each rule is ``(Window, earlier) -> (Verdict | None, checked) | None`` (``monitor.rules.Rule``). ``cores_free`` reads
the host samples once for every rule that needs to know what other work takes (the loader's cause, the workers' cap,
host-bound on a CPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuwise.monitor.samples import HostSample
from gpuwise.monitor.thresholds import (
    FREE_CORE_SLACK,
    MIN_JUDGED_STEPS,
    OVERSUB_BUSY_PCT,
    OVERSUB_GOT_RATIO,
    OVERSUB_HOST_CPU_PCT,
    OVERSUB_LOAD_RATIO,
    OVERSUB_RUNQ_THREADS,
    WINDOW_SAMPLES,
)
from gpuwise.monitor.verdict import Verdict
from gpuwise.monitor.window import Earlier, Judged, Window, median, pct, persistent, rounded


@dataclass(frozen=True)
class Cores:
    """The host's cores over the judged samples (medians), in cores (1.0 = one core busy)."""

    host: int  # logical cores the host samples list
    usable: int  # cores this run may use (affinity, quota)
    busy: float  # all work together
    ours: float  # the watched process and its loader workers
    main: float | None  # the watched process alone
    workers: float | None  # its loader workers together
    other: float  # busy less ours: other processes on the machine
    free: float  # what other work leaves this run: min(usable, host - other)
    samples: int

    @property
    def free_whole(self) -> int:
        """Whole free cores (a core 0.8 free counts: the percentages are read a few ms apart)."""
        return max(0, math.floor(self.free + FREE_CORE_SLACK))

    def evidence(self) -> dict[str, Any]:
        return {"host_cores": self.host, "busy_cores": rounded(self.busy, 2),
                "busy_cores_this_run": rounded(self.ours, 2), "busy_cores_other_work": rounded(self.other, 2),
                "free_cores": rounded(self.free, 2)}


def _ours(h: HostSample, processes: int) -> float:
    return max(1, processes) * ((h.process_cpu_pct or 0.0) + (h.workers_cpu_pct or 0.0)) / 100


def other_cores(h: HostSample, processes: int = 1) -> float:
    """Cores busy with other work in one sample: all busy time less this run's CPU time. A process sees only itself
    and its workers; its ``processes - 1`` sibling ranks on the machine are taken to use as much."""
    return max(0.0, sum(h.cpu_pct) / 100 - _ours(h, processes))


def cores_free(hosts: Sequence[HostSample], usable: int, processes: int = 1) -> Cores | None:
    """Busy and free cores from the per-core samples (None without any): what other work takes is the cores'
    busy time less this run's own CPU time (``processes`` ranks alike, each with its workers)."""
    seen = [h for h in hosts if h.cpu_pct]
    if not seen:
        return None
    n = round(median([len(h.cpu_pct) for h in seen]) or 0)
    busy = median([sum(h.cpu_pct) / 100 for h in seen]) or 0.0
    ours = median([_ours(h, processes) for h in seen]) or 0.0
    main = median([h.process_cpu_pct / 100 for h in seen if h.process_cpu_pct is not None])
    workers = median([h.workers_cpu_pct / 100 for h in seen if h.workers_cpu_pct is not None])
    other = median([other_cores(h, processes) for h in seen]) or 0.0
    free = max(0.0, min(float(usable), n - other))
    return Cores(host=n, usable=usable, busy=busy, ours=ours, main=main, workers=workers, other=other, free=free,
                 samples=len(seen))


def oversubscribed(view: Window, earlier: Earlier) -> Judged | None:
    """Runnable threads past the cores, persistently: the cores saturated and this run's compute threads (torch's
    intra-op threads x processes) more than the cores (ranks x threads > cores), or the run queue past the cores
    (load_1m), or (a CPU run) the process getting well under the cores its threads would run on. The fix: fewer
    threads (``OMP_NUM_THREADS`` / ``torch.set_num_threads``), fewer workers. Needs host samples."""
    ctx = view.context
    hosts = [h for h in view.hosts if h.cpu_pct and h.process_cpu_pct is not None]
    if len(hosts) < MIN_JUDGED_STEPS:
        return None, {"oversubscription": "not judged: no host samples with per-core and process CPU"}
    procs = max(1, ctx.world_size)
    threads = ctx.threads
    os_threads = median([h.process_threads for h in hosts if h.process_threads is not None])
    checked: dict[str, Any] = {"intra_op_threads": threads, "processes": procs}
    if threads is None:
        checked["oversubscription"] = ("not judged: torch's thread count in the loop is not known (gpuwise.Monitor "
                                       "in the loop reports it)")
        if os_threads is not None:
            checked["os_threads_of_process"] = round(os_threads)
        return None, checked
    cores = cores_free(hosts, ctx.usable_cores, procs)
    assert cores is not None  # every judged sample has per-core figures
    n = cores.host
    usable = min(ctx.usable_cores, n)
    demand = threads * procs
    busy_pct = [100 * sum(h.cpu_pct) / (100 * len(h.cpu_pct)) for h in hosts]
    loads = [h.load_1m / len(h.cpu_pct) for h in hosts if h.load_1m is not None]
    cpu_run = ctx.device == "cpu"
    main_cpu = median([h.process_cpu_pct for h in hosts]) or 0.0  # type: ignore[misc]
    checked.update(threads_x_processes=demand, usable_cores=usable, **cores.evidence(),
                   busy_pct_median=rounded(median(busy_pct), 1), busy_threshold_pct=OVERSUB_BUSY_PCT,
                   load_1m_per_core_median=rounded(median(loads), 3), load_ratio_threshold=OVERSUB_LOAD_RATIO,
                   process_cpu_median_pct=rounded(main_cpu, 1),
                   runq_threads_median=rounded(median([h.runq_threads for h in hosts if h.runq_threads is not None]),
                                               2), runq_threads_threshold=OVERSUB_RUNQ_THREADS)
    if demand < 2:
        checked["oversubscription"] = "one compute thread: nothing to cut"
        return None, checked
    if not cpu_run and main_cpu < OVERSUB_HOST_CPU_PCT:  # a CPU run's threads are its compute, starved or not
        checked["oversubscription"] = (f"the process holds {main_cpu:.0f}% of a core: its host side is not the "
                                       "load")
        return None, checked
    per_process = max(1.0, usable / procs)  # the cores each process's threads would run on

    def why(h: HostSample) -> str | None:
        c = len(h.cpu_pct)
        if sum(h.cpu_pct) / c < OVERSUB_BUSY_PCT:
            return None
        if h.runq_threads is not None and h.runq_threads < OVERSUB_RUNQ_THREADS:
            return None  # the run's own threads hardly wait for a core: the load is someone else's problem
        if demand > usable:
            return "threads"
        if h.load_1m is not None and h.load_1m >= OVERSUB_LOAD_RATIO * c:
            return "run-queue"
        got = (h.process_cpu_pct or 0.0) / 100
        if cpu_run and got < OVERSUB_GOT_RATIO * min(threads, per_process):
            return "starved"
        return None

    reasons = [why(h) for h in hosts]
    p = persistent([1.0 if r else 0.0 for r in reasons], 1.0, WINDOW_SAMPLES)
    checked.update(samples_oversubscribed=rounded(p.fraction, 3))
    if not p.fires:
        return None, checked
    said = [r for r in reasons if r]
    kind = max(set(said), key=said.count)
    load = median([h.load_1m for h in hosts if h.load_1m is not None])
    got = main_cpu / 100
    # the share of the time a runnable thread waits for a core: fair scheduling gives each of L runnable threads
    # n/L of a core; without the run queue, the process's threads together get `got` of `min(threads, cores)` cores
    waits = [1 - n / load if load and load > n else 0.0,
             1 - usable / demand if demand > usable else 0.0,
             1 - got / min(threads, per_process) if cpu_run else 0.0]
    share = max(0.0, min(1.0, max(waits)))
    # free of other work and of the run's own loader workers (every rank's)
    room = max(0.0, cores.free - procs * (cores.workers or 0.0))
    k = max(1, math.floor(room + FREE_CORE_SLACK) // procs)
    k = min(k, threads - 1) if threads > 1 else 1
    reading = {"threads": f"{procs} process(es) x {threads} threads = {demand} compute threads on {usable} cores",
               "run-queue": f"the run queue holds {load or 0:.1f} runnable threads on {n} cores",
               "starved": f"the process gets {got:.2f} cores for its {threads} threads"}[kind]
    evidence: dict[str, Any] = {**checked, "samples": len(hosts), "windows_held": f"{p.windows_held}/{p.windows}",
                                "cause": kind, "reading": f"{reading}, all cores {median(busy_pct):.0f}% busy "
                                f"({cores.other:.1f} of them with other work)", "threads_new": k,
                                "wait_share": rounded(share, 3)}
    if os_threads is not None:
        evidence["os_threads_of_process"] = round(os_threads)
    tree = median([h.tree_threads for h in hosts if h.tree_threads is not None])
    if tree is not None:
        evidence["os_threads_of_tree"] = round(tree)
    fix = []
    if k < threads:  # never the thread count the loop already runs with
        fix.append(f"OMP_NUM_THREADS={k} (or torch.set_num_threads({k}) first thing in each process): {procs} "
                   f"process(es) x {k} = {procs * k} compute thread(s) for the {cores.free:.1f} cores other work "
                   "leaves free" + ("; torchrun sets OMP_NUM_THREADS=1 per process unless told otherwise"
                                    if procs > 1 else ""))
    w = median([h.workers for h in hosts if h.workers is not None])
    if w and cores.workers is not None and cores.workers >= 0.5:
        fix.append(f"fewer DataLoader workers: {round(w)} workers hold {cores.workers:.1f} cores beside the "
                   f"{demand} compute threads")
    if cores.other >= 1.0 or not fix:
        fix.append(f"move or stop the other work on this machine: it keeps {cores.other:.1f} of the {n} cores busy"
                   + ("" if fix else f" and the run already uses {threads} thread(s) a process"))
    expected = (f"each runnable thread waits for a core ~{pct(share)} of the time now; with {k} thread(s) a process "
                "the threads stop waiting on each other: OpenMP's barriers hold every thread until the preempted one "
                "runs, so the step gains far more than that share (issue 29: 2 → 1 threads on a 2-core box "
                "saturated by other work took a step from 793 ms to 31 ms, 25×); re-measure after the change")
    if not cpu_run:
        expected = ("the host side (Python, launches, collation) gets its core back: " + expected)
    return Verdict(bottleneck="oversubscribed", share=share, evidence=evidence, fix=tuple(fix), expected=expected,
                   source="run queue (load_1m) and per-core busy time against the cores; torchrun's "
                          "OMP_NUM_THREADS=1 default; issue 29's 2-core measurement",
                   summary=f"{reading} on saturated cores", change={"threads": k} if k < threads else {}), checked


__all__ = ["Cores", "cores_free", "other_cores", "oversubscribed"]
