"""``gpuwise.Monitor``: an in-process sampler (a background thread) joined with the loop's own step events.

>>> from gpuwise import Monitor                                          # doctest: +SKIP
>>> with Monitor() as mon:                                               # doctest: +SKIP
...     for x, y in mon.loader(dataloader):   # times the wait in next()
...         train_step(x, y)
...         mon.step()                        # ends a step: its time, and the wait inside it
>>> print(mon.diagnose().bottleneck)                                     # doctest: +SKIP

Each sample reads every GPU through NVML (``monitor.nvml``), torch's caching allocator, and the host (psutil):
cheap calls, once per ``interval_s`` (1 s), in a daemon thread, so the loop pays nothing but the step hook
(``benchmarks/monitor_overhead.py``). A sensor that is missing gives None; a machine without NVIDIA GPUs is
watched on its CPU side, and ``Record.note`` says so in one line.

``GPUWISE_WATCH_EVENTS=FILE`` (set by ``gpuwise watch``): step and OOM events are also appended to FILE as
JSON lines, so a watch from outside joins the loop's own timings with what it samples.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpuwise.environment import usable_cores
from gpuwise.monitor.host import HostReader
from gpuwise.monitor.rules import judge
from gpuwise.monitor.samples import AllocatorSample, OomEvent, Record, Sample, StepEvent, to_line
from gpuwise.monitor.verdict import Context, Diagnosis, Loader

EVENTS_ENV = "GPUWISE_WATCH_EVENTS"
MAX_SAMPLES = 7200  # kept in memory: two hours at 1 Hz (--log keeps them all); older ones are dropped
MAX_STEPS = 100_000  # likewise for step events (about 20 MB)


def allocator_sample(device: Any) -> AllocatorSample | None:
    """torch's caching allocator on a CUDA ``device`` (None elsewhere, or before CUDA is initialised)."""
    import torch

    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda" or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    try:
        s = torch.cuda.memory_stats(dev)
    except (RuntimeError, AssertionError):
        return None
    return AllocatorSample(allocated_bytes=int(s.get("allocated_bytes.all.current", 0)),
                           reserved_bytes=int(s.get("reserved_bytes.all.current", 0)),
                           peak_allocated_bytes=s.get("allocated_bytes.all.peak"),
                           inactive_split_bytes=s.get("inactive_split_bytes.all.current"),
                           alloc_retries=s.get("num_alloc_retries"), ooms=s.get("num_ooms"),
                           small_pool_allocated_bytes=s.get("allocated_bytes.small_pool.current"),
                           allocations=s.get("allocation.all.current"))


_SCHEDSTAT_FDS: dict[int, int] = {}  # thread id -> an open /proc/self/task/TID/schedstat (pread, no reopen)


def runq_ns() -> int | None:
    """The calling thread's time runnable but waiting for a core so far, in ns (Linux; None elsewhere). The file
    stays open per thread and is read with pread: ~2 us a call instead of an open and close each time."""
    tid = threading.get_native_id()
    fd = _SCHEDSTAT_FDS.get(tid)
    try:
        if fd is None:
            fd = _SCHEDSTAT_FDS[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
        return int(os.pread(fd, 128, 0).split()[1])
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def loader_settings(data: Any) -> Loader | None:
    """A torch DataLoader's own loading settings (None for any other iterable)."""
    try:
        from torch.utils.data import DataLoader
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    if not isinstance(data, DataLoader):
        return None
    workers = data.num_workers
    return Loader(num_workers=workers, pin_memory=data.pin_memory,
                  prefetch_factor=data.prefetch_factor if workers > 0 else None,
                  persistent_workers=data.persistent_workers if workers > 0 else None, batch_size=data.batch_size)


class Monitor:
    """Samples devices, allocator and host at ``interval_s`` in a thread, and takes the loop's step events.

    ``device``: the torch device the loop runs on ("cuda:0", "cpu"; default: cuda if available) for the allocator.
    ``log``: a JSON-lines file every sample and event is appended to as it comes. ``nvml``: a module with
    pynvml's interface (tests pass a fake). ``pid``: the process whose children are its loader workers (this one).
    ``prometheus``: "HOST:PORT" (or ":PORT", loopback) serves the ``gpuwise_*`` metrics while it runs (``metrics_url``).
    """

    def __init__(self, *, interval_s: float = 1.0, device: Any = None, log: str | os.PathLike | None = None,
                 nvml: Any = None, pid: int | None = None, context: Context | None = None,
                 gpus: bool = True, prometheus: str | None = None) -> None:
        if not interval_s > 0:
            from gpuwise.errors import GpuwiseError

            raise GpuwiseError(f"the monitor's interval must be positive, not {interval_s}", "pass e.g. 1.0")
        self.interval_s = float(interval_s)
        self.device = device
        self.context = context
        self._nvml_module, self._want_gpus = nvml, gpus
        self._pid = pid
        self._samples: list[Sample] = []
        self._steps: list[StepEvent] = []
        self._ooms: list[OomEvent] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.perf_counter()
        self._last_step_end: float | None = None
        self._wait = 0.0  # seconds blocked in next() since the last step ended
        self._wait_cpu = 0.0  # this process's CPU seconds meanwhile
        self._wait_runq: float | None = None  # the loop thread's run-queue seconds meanwhile (Linux)
        self._n_steps = 0
        self._start_device: Any = None
        self._loader: Loader | None = None
        self._log_path = None if log is None else Path(log)
        self._log = None
        self._events = None
        self._reader = None
        self._host: HostReader | None = None
        self.note: str | None = None
        self.device_kind = "cpu"
        self._comm: Any = None  # times a DDP model's all-reduce (``ddp``)
        self._prometheus, self._exporter = prometheus, None
        self._rank: int | None = None

    # -- life --------------------------------------------------------------------------------------------------

    def start(self) -> Monitor:
        if self._thread is not None:
            return self
        from gpuwise.files import open_log

        self._stop.clear()  # a monitor can be started again after stop()
        if self._prometheus is not None and self._exporter is None:  # first: a busy port is an error before the run
            from gpuwise.monitor.export import start_exporter

            self._exporter = start_exporter(self._prometheus, self._snapshot)
        self.device = self._resolve_device(self.device)
        self._start_device = None
        import torch

        if self.device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            self._start_device = torch.device("cuda", torch.cuda.current_device())

        if self._log_path is not None:
            self._log = open_log(self._log_path)
        events = os.environ.get(EVENTS_ENV)
        if events:  # under torchrun every rank appends its own events (each carries its rank)
            with contextlib.suppress(OSError):
                self._events = open(events, "a")  # noqa: SIM115 - kept open for the run, closed in stop()
        self._t0 = time.perf_counter()
        self._last_step_end = self._t0
        self._host = HostReader(self._pid)
        if self._want_gpus:
            from gpuwise.monitor.nvml import open_nvml

            self._reader, why = open_nvml(self._nvml_indices(), nvml=self._nvml_module)
            if self._reader is None and "has no GPU" in (why or ""):  # the mapping was wrong: every GPU then
                self._reader, why = open_nvml(nvml=self._nvml_module)
            self.note = (getattr(self._reader, "note", None) if self._reader is not None  # e.g. MIG: no utilisation
                         else f"no GPU counters ({why}): watching the CPU side")
        else:
            self.note = "a CPU run"
        self.device_kind = "cuda" if self._reader is not None else self._torch_kind()
        self._sample()  # one at the start: the run's first seconds are part of it
        self._thread = threading.Thread(target=self._run, name="gpuwise-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Record:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=max(5.0, 2 * self.interval_s))
            self._thread = None
            self._sample()  # and one at the end
        for f in (self._log, self._events):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self._log = self._events = None
        if self._exporter is not None:
            with contextlib.suppress(Exception):
                self._exporter.close()
            self._exporter = None
        if self._reader is not None:
            with contextlib.suppress(Exception):
                self._reader.close()
            self._reader = None
        return self.record()

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @staticmethod
    def _resolve_device(device: Any) -> Any:
        """``cuda`` without an index means the current device of the thread that starts the monitor (the
        sampler thread's own current device is always 0)."""
        if device is None:
            return None
        import torch

        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return dev

    def _allocator_device(self) -> Any:
        """The CUDA device whose allocator to read: the loop's, else the current device of the thread that started
        the monitor once CUDA is up (never initialising CUDA for a program that does not use it)."""
        return self.device if self.device is not None else self._start_device

    def _learn_device(self) -> None:
        """On the loop's thread (``step``): its current CUDA device, once CUDA is up."""
        if self.device is None and self._start_device is None and self.device_kind == "cuda":
            import torch

            if torch.cuda.is_initialized():
                self._start_device = torch.device("cuda", torch.cuda.current_device())

    def _nvml_indices(self) -> list[int] | None:
        """NVML's index of the loop's own CUDA device (NVML ignores CUDA_VISIBLE_DEVICES and counts every GPU of
        the node); None (every GPU, filtered later to those holding this process's memory) when unknown."""
        if self.device is None:
            return None
        try:
            import torch

            dev = torch.device(self.device)
            if dev.type != "cuda" or not torch.cuda.is_available():
                return None
            return [int(torch.cuda._get_nvml_device_index(dev))]  # honours CUDA_VISIBLE_DEVICES and UUIDs
        except Exception:  # an older torch, or no mapping: fall back to the process filter
            return None

    def _torch_kind(self) -> str:
        """What the loop runs on: the device given, else CUDA where NVML sees GPUs, else the CPU (the monitor
        does not choose a device: pass ``device`` for MPS)."""
        import torch

        if self.device is not None:
            return torch.device(self.device).type
        return "cuda" if self._reader is not None else "cpu"

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        t = time.perf_counter() - self._t0
        host = devices = None
        try:
            host = self._host.read() if self._host is not None else None
        except Exception:  # a sensor must never stop the run
            host = None
        try:
            pids = self._host.pids() if self._host is not None else None
            devices = self._reader.read(pids) if self._reader is not None else ()
        except Exception:  # likewise
            devices = ()
        device = self._allocator_device()
        try:
            alloc = allocator_sample(device)
        except Exception:  # likewise
            alloc = None
        sample = Sample(t=t, devices=tuple(devices or ()), allocator=alloc, host=host)
        with self._lock:
            self._samples.append(sample)
            if len(self._samples) > MAX_SAMPLES:
                del self._samples[: len(self._samples) - MAX_SAMPLES]
            self._write(sample, events=False)

    def _write(self, item, *, events: bool) -> None:
        """Append to --log (and, for step and OOM events, the watch's events file); a full disk stops the log,
        never the run."""
        line = to_line(item) + "\n"
        for f, name in ((self._log, "_log"), (self._events if events else None, "_events")):
            if f is None:
                continue
            try:
                f.write(line)
                f.flush()
            except (OSError, ValueError):  # a full disk, or a file closed under a thread that outlived stop()
                setattr(self, name, None)

    # -- the loop's events ---------------------------------------------------------------------------------------

    def loader(self, data: Iterable) -> Iterator:
        """Iterate ``data``, timing each wait in ``next()`` (counted into the next ``step()``); a torch
        DataLoader's settings (workers, pinning, prefetch) go to the diagnosis."""
        self._loader = loader_settings(data) or self._loader
        it = iter(data)
        while True:
            t, cpu, rq = time.perf_counter(), time.process_time(), runq_ns()
            try:
                item = next(it)
            except StopIteration:
                return
            self._wait += time.perf_counter() - t
            self._wait_cpu += time.process_time() - cpu
            if rq is not None:
                rq2 = runq_ns()
                if rq2 is not None:
                    self._wait_runq = (self._wait_runq or 0.0) + (rq2 - rq) / 1e9
            yield item

    def ddp(self, model: Any) -> Any:
        """Time the all-reduce of a DistributedDataParallel ``model`` (a communication hook, before its first
        backward): each ``step()`` then carries the communication backward did not hide. Returns ``model``."""
        from gpuwise.monitor.comm import attach

        self._comm = attach(model)
        return model

    def _current_rank(self) -> int | None:
        """The torch.distributed rank of this process (None when not distributed)."""
        if self._rank is None:
            try:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                    self._rank = dist.get_rank()
            except Exception:  # a rank is a label: never an error
                self._rank = None
        return self._rank

    def step(self, *, seconds: float | None = None, data_wait_s: float | None = None,
             data_wait_cpu_s: float | None = None, data_wait_runq_s: float | None = None,
             compute_s: float | None = None,
             optimizer_s: float | None = None, comm_s: float | None = None,
             exposed_comm_s: float | None = None, peak_memory_bytes: int | None = None,
             flops: float | None = None, items: int | None = None, micro_batches: int | None = None
             ) -> StepEvent:
        """End a step. Without ``seconds``: the time since the previous step ended (or since start); without
        ``data_wait_s``: the waits ``loader()`` timed since then; without ``comm_s``/``exposed_comm_s``: what the
        ``ddp`` hook timed since the last step. ``items``: samples (or tokens) the step consumed, for the
        throughput over wall-clock time; ``micro_batches``: gradient-accumulation passes in the step."""
        now = time.perf_counter()
        self._learn_device()
        if self._comm is not None and comm_s is None and exposed_comm_s is None:
            comm_s, exposed_comm_s = self._comm.take()
        if seconds is None:
            seconds = now - (self._last_step_end if self._last_step_end is not None else self._t0)
        runq = data_wait_runq_s
        if data_wait_s is None:
            data_wait_s, data_wait_cpu_s, runq = self._wait, self._wait_cpu, self._wait_runq
        self._wait, self._wait_cpu, self._wait_runq, self._last_step_end = 0.0, 0.0, None, now
        data_wait_s = min(data_wait_s, seconds)  # the wait is part of the step: a step given without it holds it
        with self._lock:
            self._n_steps += 1
            event = StepEvent(step=self._n_steps, t=now - self._t0, seconds=float(seconds),
                              data_wait_s=float(data_wait_s), data_wait_cpu_s=data_wait_cpu_s,
                              data_wait_runq_s=runq,
                              compute_s=compute_s, optimizer_s=optimizer_s,
                              comm_s=comm_s, exposed_comm_s=exposed_comm_s, peak_memory_bytes=peak_memory_bytes,
                              flops=flops, items=items, micro_batches=micro_batches, rank=self._current_rank())
            self._steps.append(event)
            if len(self._steps) > MAX_STEPS:
                del self._steps[: len(self._steps) - MAX_STEPS]
            self._write(event, events=True)
        return event

    def oom(self, step: int, message: str) -> OomEvent:
        """Record an out-of-memory error with the allocator as it is now."""
        device = self._allocator_device()
        with self._lock:
            event = OomEvent(step=step, t=time.perf_counter() - self._t0, message=message,
                             allocator=allocator_sample(device))
            self._ooms.append(event)
            self._write(event, events=True)
        return event

    # -- results ----------------------------------------------------------------------------------------------

    def record(self, *, last_steps: int | None = None) -> Record:
        """What the monitor saw (the last MAX_SAMPLES samples and MAX_STEPS steps); ``last_steps``: only the last
        steps and the samples since the first of them. Reading every GPU of the node (the loop's own was not
        mapped), the samples keep the GPUs that hold this process's memory, where NVML says which."""
        with self._lock:
            steps, samples = self._steps, self._samples
            if last_steps is not None and len(steps) > last_steps:
                steps = steps[-last_steps:]
                since = steps[0].t - steps[0].seconds
                samples = samples[bisect.bisect_left(samples, since, key=lambda s: s.t):]
            samples, ooms = list(samples), tuple(self._ooms)
        mine = {d.index for s in samples for d in s.devices if d.process_memory_bytes}
        if mine and any(d.index not in mine for s in samples for d in s.devices):
            samples = [replace(s, devices=tuple(d for d in s.devices if d.index in mine)) for s in samples]
        return Record(samples=tuple(samples), steps=tuple(steps), ooms=ooms, interval_s=self.interval_s,
                      device_kind=self.device_kind, note=self.note)

    def default_context(self) -> Context:
        """What the monitor knows of the machine and the loader, for the diagnosis."""
        import torch

        world = 1
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        return Context(device=self.device_kind if self.device is None else self._torch_kind(),
                       usable_cores=usable_cores(), world_size=world, loader=self._loader,
                       threads=torch.get_num_threads())

    def diagnose(self, context: Context | None = None, *, last_steps: int | None = None) -> Diagnosis:
        """The bottleneck so far (or over the ``last_steps``), its evidence and the fix. ``context`` adds the
        plan; the loader is filled in from what ``loader()`` saw where the context leaves it out."""
        base = self.default_context()
        ctx = context or self.context or base
        if ctx.loader is None and base.loader is not None:
            ctx = replace(ctx, loader=base.loader)
        return judge(self.record(last_steps=last_steps), ctx)

    def _snapshot(self):
        """The report for a Prometheus scrape (None while nothing is recorded; a failure is an empty scrape)."""
        try:
            return self.report()
        except Exception:
            return None

    @property
    def metrics_url(self) -> str | None:
        """Where ``prometheus=`` serves the ``gpuwise_*`` metrics while the monitor runs."""
        return None if self._exporter is None else self._exporter.url

    def report(self, context: Context | None = None):
        """What ``gpuwise watch --json`` prints, for this loop: the diagnosis (judged or not, and why), the step
        time's median, p95 and max, throughput over wall-clock time, memory (process RSS, allocator) and the
        ranks (``monitor.report.Report``)."""
        from gpuwise.monitor.report import build_report

        return build_report(self.record(), self.diagnose(context))
