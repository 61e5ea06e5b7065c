"""The host side of a sample, through psutil: every core, memory, a process and its children (DataLoader workers).

psutil's CPU percentages are over the interval since the previous call, so a reader is kept between samples; its
first read primes the counters (and reports what it can). Any sensor psutil lacks on this platform gives None.
"""

from __future__ import annotations

import contextlib
import os
import time

import psutil

from gpuwise.monitor.samples import HostSample


class HostReader:
    """Reads the host and the process ``pid`` (this process by default) with its children, once per sample."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid or os.getpid()
        try:
            self.process = psutil.Process(self.pid)
        except psutil.Error:
            self.process = None
        self._children: dict[int, psutil.Process] = {}
        self._is_worker: dict[int, bool] = {}  # pid -> forked from its parent (a DataLoader worker), cached
        self._last_times: psutil._common.scputimes | None = None  # type: ignore[name-defined]
        self._runq: tuple[float, int] | None = None  # (when, run-queue wait ns of the tree's threads so far)
        psutil.cpu_percent(percpu=True)  # prime: the next call measures from here
        with contextlib.suppress(psutil.Error, AttributeError):
            if self.process is not None:
                self.process.cpu_percent()
        with contextlib.suppress(Exception):
            self._last_times = psutil.cpu_times()

    def alive(self) -> bool:
        try:
            return self.process is not None and self.process.is_running() and \
                self.process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def pids(self) -> set[int]:
        """The process and its descendants as of the last ``read`` (for NVML's per-process memory)."""
        return {self.pid, *self._children}

    def _worker(self, child: psutil.Process) -> bool:
        """A DataLoader worker is forked: the same command line as its parent. torchrun's ranks, mp.spawn's
        processes and compile workers are started anew, with their own command lines: not workers."""
        hit = self._is_worker.get(child.pid)
        if hit is None:
            try:
                parent = child.parent()
                hit = parent is not None and child.cmdline() == parent.cmdline()
            except psutil.Error:
                hit = False
            self._is_worker[child.pid] = hit
        return hit

    def _runq_threads(self) -> float | None:
        """How many of the run's threads waited for a core, on average, since the last read: the run-queue time
        the kernel keeps per thread (schedstat's second field, ns), summed over the process tree. Linux only."""
        if not os.path.isdir("/proc/self/task"):
            return None
        total, seen = 0, False
        for pid in self.pids():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        total += int(f.read().split()[1])
                        seen = True
                except (OSError, ValueError, IndexError):
                    continue
        if not seen:
            return None
        now, last = time.monotonic(), self._runq
        self._runq = (now, total)
        if last is None or now <= last[0]:
            return None
        # threads that ended since the last read take their wait with them: never below zero
        return max(0.0, (total - last[1]) / 1e9 / (now - last[0]))

    def read(self) -> HostSample:
        per_core = tuple(float(x) for x in psutil.cpu_percent(percpu=True))
        vm = psutil.virtual_memory()
        process_cpu = workers = workers_cpu = rss = workers_rss = threads = tree = tree_threads = tree_rss = None
        if self.process is not None:
            with contextlib.suppress(psutil.Error):
                process_cpu = float(self.process.cpu_percent())
            with contextlib.suppress(psutil.Error):
                rss = int(self.process.memory_info().rss) or None  # 0: a zombie the parent has not reaped
            with contextlib.suppress(psutil.Error):
                threads = int(self.process.num_threads())
            with contextlib.suppress(psutil.Error):
                children = self.process.children(recursive=True)  # once a sample: pids() reuses it
                known, self._children = self._children, {}
                total, n, w_rss, t_all, r_all = 0.0, 0, 0, threads or 0, rss or 0
                for child in children:
                    proc = known.get(child.pid, child)
                    self._children[child.pid] = proc
                    with contextlib.suppress(psutil.Error):
                        t_all += proc.num_threads()
                    with contextlib.suppress(psutil.Error):
                        r_all += proc.memory_info().rss
                    if not self._worker(proc):
                        continue
                    n += 1
                    with contextlib.suppress(psutil.Error):
                        total += proc.cpu_percent()  # a child's first call primes it (0.0); it counts from the next
                    with contextlib.suppress(psutil.Error):
                        w_rss += proc.memory_info().rss
                workers, workers_cpu = n, total
                workers_rss = w_rss if n else None
                tree, tree_threads, tree_rss = 1 + len(children), t_all, r_all or None
        iowait = None
        with contextlib.suppress(Exception):
            now = psutil.cpu_times()
            if self._last_times is not None and hasattr(now, "iowait"):
                busy = sum(now) - sum(self._last_times)
                iowait = 100.0 * (now.iowait - self._last_times.iowait) / busy if busy > 0 else 0.0
            self._last_times = now
        runq = self._runq_threads()
        load = None
        with contextlib.suppress(OSError, AttributeError):
            load = float(os.getloadavg()[0])
        return HostSample(cpu_pct=per_core, memory_used_bytes=int(vm.total - vm.available),
                          memory_total_bytes=int(vm.total), process_cpu_pct=process_cpu, workers=workers,
                          workers_cpu_pct=workers_cpu, iowait_pct=iowait, process_rss_bytes=rss,
                          workers_rss_bytes=workers_rss, process_threads=threads, tree_processes=tree,
                          tree_threads=tree_threads, tree_rss_bytes=tree_rss, load_1m=load,
                          runq_threads=runq)
