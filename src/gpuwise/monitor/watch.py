"""``gpuwise watch``: run a command (or attach to a running process) and sample it from outside, then diagnose.

>>> from gpuwise.monitor.watch import watch                               # doctest: +SKIP
>>> result = watch(["python", "train.py"], interval_s=1.0, log="run.jsonl")  # doctest: +SKIP
>>> result.exit_code, result.diagnosis.bottleneck                         # doctest: +SKIP
(0, 'input-bound')

Every ``interval_s`` the watcher reads NVML (every GPU; the command's own memory from its process tree) and the host
(psutil: every core, memory, the process and its children) in this process, the command untouched: it runs as it
would alone, writing straight to the terminal. The loop's own timings come from the command itself where it runs a
``gpuwise.Monitor`` (``gpuwise train`` does): the child's environment names a file (``GPUWISE_WATCH_EVENTS``) the
Monitor appends its step and OOM events to, and the watcher reads it as it grows. ``--pid`` attaches to a running
process instead, and reads its events file too where that process was started with one.

The command itself (starting it, passing Ctrl-C on, waiting for it, its exit code) is ``monitor.child``'s; here it is
sampled until it ends, and what was recorded is judged (the log is written line by line: an interrupted watch loses
nothing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from gpuwise.environment import usable_cores
from gpuwise.errors import GpuwiseError
from gpuwise.monitor.child import Signals, Waiter, attach, exit_status, kill, resolve_command, spawn
from gpuwise.monitor.host import HostReader
from gpuwise.monitor.report import Report, build_report, device_summary, host_summary, step_summary
from gpuwise.monitor.rules import judge
from gpuwise.monitor.sampler import EVENTS_ENV
from gpuwise.monitor.samples import OomEvent, Record, Sample, StepEvent, from_line, to_line
from gpuwise.monitor.verdict import Context, Diagnosis

EVENT_POLL_S = 0.1  # how often the events file is read between samples: step times land within 0.1 s of the truth


@dataclass(frozen=True, kw_only=True)
class WatchStart:
    """What the watcher knows once the command runs: handed to ``on_start`` (the CLI prints the note, sizes the
    live view)."""

    pid: int
    command: tuple[str, ...] | None
    gpus: int  # GPUs NVML reads (0: the CPU side only)
    note: str | None  # why there are no GPU counters, in one line
    metrics_url: str | None = None  # --prometheus: the endpoint (its port resolved where 0 was asked for)
    metrics_note: str | None = None  # said when the endpoint is reachable from other machines


@dataclass(frozen=True, kw_only=True)
class Tick:
    """One sample as it is taken, with the loop's step events so far: handed to ``on_sample`` (the live view)."""

    t: float  # seconds since the command started
    sample: Sample
    samples: int
    steps: int
    last_step: StepEvent | None
    pid: int


@dataclass(frozen=True, kw_only=True)
class WatchResult:
    """A watched command: how it ended, what was recorded, and the diagnosis."""

    command: tuple[str, ...] | None  # None: attached with --pid
    pid: int
    exit_code: int | None  # the command's code (a signal N as 128 + N); None for --pid (not our child)
    seconds: float
    record: Record = field(repr=False)
    diagnosis: Diagnosis
    note: str | None = None  # no GPU counters, and why ("no NVIDIA GPU (...): watching the CPU side")
    interrupted: bool = False  # Ctrl-C (or SIGTERM) reached the watcher
    devices_used: tuple[int, ...] = ()  # NVML indices where the command held memory; () when NVML could not say
    log: str | None = None
    log_error: str | None = None  # the log stopped early (a full disk): the run went on
    report: Report | None = field(default=None, repr=False)  # monitor.report: what --json prints as "report"
    metrics_url: str | None = None  # --prometheus: where the metrics were served while the command ran

    @property
    def failed(self) -> bool:
        return self.exit_code not in (None, 0)


# -- while it runs -----------------------------------------------------------------------------------------------


class _Events:
    """Tails the events file a Monitor inside the command appends to, and puts each event on the watch's clock.

    The Monitor's ``t`` counts from its own start, which the watcher cannot see; the offset to the watch's clock is
    estimated as the smallest (read time - event t) seen so far: events are read within ``EVENT_POLL_S`` of being
    written, so the estimate is that close. An event earlier than the previous one means a new Monitor (a second
    run in the same command): the estimate starts over.

    Under torchrun every rank's Monitor appends to the one file, each event with its rank, each rank's ``t`` on its
    own clock (its Monitor started when that rank did): the offset, and the rule above, are kept per rank
    (``StepEvent.rank``; None for one process). One estimate for all would put a rank that started later early, and
    its events, interleaved with another's, would each look like a new Monitor."""

    def __init__(self, path: Path, *, from_end: bool = False) -> None:
        self.path = path
        self._f: IO[str] | None = None
        self._pos = 0
        self._partial = ""
        self.offsets: dict[int | None, float] = {}  # rank -> offset of its clock to the watch's
        self._last_child_t: dict[int | None, float] = {}
        if from_end:
            with contextlib.suppress(OSError):
                self._pos = path.stat().st_size

    @property
    def offset(self) -> float | None:
        """One process's offset, else the lowest rank's (None before any event)."""
        if None in self.offsets:
            return self.offsets[None]
        ranks = [k for k in self.offsets if k is not None]
        return self.offsets[min(ranks)] if ranks else None

    def read(self, now: float) -> list[StepEvent | OomEvent]:
        try:
            if self._f is None:
                self._f = self.path.open()
                self._f.seek(self._pos)
            chunk = self._f.read()
        except (OSError, UnicodeDecodeError):
            return []
        if not chunk:
            return []
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()  # a line the Monitor is still writing
        out: list[StepEvent | OomEvent] = []
        for line in lines:
            try:
                item = from_line(line)
            except (ValueError, TypeError, KeyError):
                continue
            if not isinstance(item, (StepEvent, OomEvent)):
                continue
            rank = getattr(item, "rank", None)  # an OOM event carries none: its process's clock is the None one
            last = self._last_child_t.get(rank)
            if last is not None and item.t < last:
                self.offsets.pop(rank, None)  # a new Monitor in that rank, with its own clock
            self._last_child_t[rank] = item.t
            guess = now - item.t
            offset = self.offsets[rank] = min(self.offsets.get(rank, guess), guess)
            out.append(dataclasses.replace(item, t=item.t + offset))
        return out

    def close(self) -> None:
        if self._f is not None:
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None


class _Log:
    """``--log``: every sample and event as a JSON line, flushed as it comes; a full disk stops the log, never the
    run."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        from gpuwise.files import open_log

        self.path = None if path is None else str(path)
        self._f = None if path is None else open_log(path)
        self.error: str | None = None

    def write(self, item: Sample | StepEvent | OomEvent) -> None:
        if self._f is None:
            return
        try:
            self._f.write(to_line(item) + "\n")
            self._f.flush()
        except OSError as exc:
            self.error = f"the log stopped: {exc.strerror or exc}"
            self.close()

    def close(self) -> None:
        if self._f is not None:
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None


class _Live:
    """The report of the watch so far, for a scrape (``--prometheus``): built from the samples and steps recorded
    until then, at most once per new sample or step (a scrape between two samples reuses it), on the scraper's
    thread. Before the watch begins: None (the exporter serves no figures)."""

    def __init__(self) -> None:
        self._record: Callable[[], Record] | None = None
        self._context: Context | None = None
        self._key: tuple[int, int] | None = None
        self._report: Report | None = None
        self.final: Report | None = None
        self._lock = threading.Lock()

    def bind(self, record: Callable[[], Record], context: Context) -> None:
        self._record, self._context = record, context

    def report(self) -> Report | None:
        if self.final is not None:
            return self.final
        if self._record is None or self._context is None:
            return None
        with self._lock:
            record = self._record()  # tuples of the lists as they are: appends on the watch's thread are atomic
            if not record.samples and not record.steps:
                return None
            key = (len(record.samples), len(record.steps))
            if key != self._key:
                used = devices_used(record)
                judged = record if not used else _only_devices(record, used)
                self._report = build_report(record, judge(judged, self._context), used=used)
                self._key = key
            return self._report


# -- the watch ---------------------------------------------------------------------------------------------------


def watch(command: Sequence[str] | None = None, *, pid: int | None = None, interval_s: float = 1.0,
          log: str | os.PathLike | None = None, nvml: Any = None, reader: Any = None,
          on_start: Callable[[WatchStart], None] | None = None, on_sample: Callable[[Tick], None] | None = None,
          stdin: Any = None, stdout: Any = None, stderr: Any = None, env: dict[str, str] | None = None,
          cwd: str | os.PathLike | None = None, prometheus: str | None = None) -> WatchResult:
    """Run ``command`` (or attach to ``pid``) and sample it every ``interval_s`` until it ends; diagnose what was seen.

    ``log``: a JSON-lines file every sample and event is appended to as it comes (checked before the command starts).
    ``nvml``: a module with pynvml's names (tests pass a fake); ``reader``: an object with ``read(pids)`` and
    ``close()`` used instead of NVML. ``on_start`` / ``on_sample``: called once the command runs / after each sample
    (the live view). ``stdin``/``stdout``/``stderr``: as ``subprocess.Popen`` takes them (None: the command shares
    this process's terminal). ``env``: the command's environment (this one's by default). ``prometheus``:
    ``HOST:PORT`` (or ``PORT``: loopback) to serve ``gpuwise_*`` metrics on while the command runs
    (``monitor.export``), bound before the command starts: a port in use is an error and nothing runs."""
    if pid is not None and command:
        raise GpuwiseError("give a command or --pid, not both", "gpuwise watch -- CMD ..., or gpuwise watch --pid N")
    if not interval_s > 0:
        raise GpuwiseError(f"the interval must be positive, not {interval_s}", "pass e.g. --interval 1")
    argv = resolve_command(command or ()) if pid is None else None
    target = attach(pid) if pid is not None else None
    out = _Log(log)  # before anything runs: an unwritable log loses nothing
    events_path: Path | None = None
    own_events = False
    live = _Live()
    exporter = None
    try:
        if prometheus is not None:
            from gpuwise.monitor.export import start_exporter

            exporter = start_exporter(prometheus, live.report)  # before anything runs: a busy port loses nothing
        if reader is None:
            from gpuwise.monitor.nvml import open_nvml

            reader, why = open_nvml(nvml=nvml)
            # "no NVIDIA or AMD GPU" unless the GPU may be there and only the binding is missing
            what = "no GPU counters" if why and why.startswith("nvidia-ml-py") else "no NVIDIA or AMD GPU"
            note = (getattr(reader, "note", None) if reader is not None  # e.g. MIG: utilisation not available
                    else f"{what} ({why}): watching the CPU side")
        else:
            note = None
        gpus = len(getattr(reader, "indices", ())) if reader is not None else 0
        if target is None:
            fd, name = tempfile.mkstemp(prefix="gpuwise-watch-", suffix=".jsonl")
            os.close(fd)
            events_path, own_events = Path(name), True
            child_env = dict(os.environ if env is None else env)
            child_env[EVENTS_ENV] = str(events_path)
            child_env.setdefault("PYTHONUNBUFFERED", "1")  # a Python child's prints appear as they happen
            t0 = time.perf_counter()
            child = spawn(argv, env=child_env, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd)
            watched_pid = child.pid
            threads = _threads(child_env)
        else:
            child = None
            watched_pid = target.pid
            t0 = time.perf_counter()
            threads = None
            with contextlib.suppress(psutil.Error, AttributeError):
                threads = _threads(target.environ())
                named = target.environ().get(EVENTS_ENV)
                if named:
                    events_path = Path(named)
        return _run(argv, child, target, watched_pid, t0, interval_s=interval_s, reader=reader, note=note,
                    gpus=gpus, out=out, events_path=events_path, own_events=own_events, on_start=on_start,
                    on_sample=on_sample, live=live, exporter=exporter, threads=threads)
    finally:
        if exporter is not None:
            exporter.close()
        out.close()
        if reader is not None:
            with contextlib.suppress(Exception):
                reader.close()
        if own_events and events_path is not None:
            with contextlib.suppress(OSError):
                events_path.unlink()


def _run(argv: list[str] | None, child: subprocess.Popen | None, target: psutil.Process | None, watched_pid: int,
         t0: float, *, interval_s: float, reader: Any, note: str | None, gpus: int, out: _Log,
         events_path: Path | None, own_events: bool, on_start: Callable[[WatchStart], None] | None,
         on_sample: Callable[[Tick], None] | None, live: _Live, exporter: Any = None,
         threads: int | None = None) -> WatchResult:
    host = HostReader(watched_pid)
    events = None if events_path is None else _Events(events_path, from_end=not own_events)
    samples: list[Sample] = []
    steps: list[StepEvent] = []
    ooms: list[OomEvent] = []
    cores = _cores(target)
    device_kind = "cuda" if reader is not None else "cpu"
    live.bind(lambda: Record(samples=tuple(samples), steps=tuple(steps), ooms=tuple(ooms), interval_s=interval_s,
                             device_kind=device_kind), Context(device=device_kind, usable_cores=cores))

    def take() -> Sample:
        t = time.perf_counter() - t0
        try:
            h = host.read()
        except Exception:  # a sensor must never stop the watch
            h = None
        devices: tuple = ()
        if reader is not None:
            try:
                devices = tuple(reader.read(host.pids()))
            except Exception:  # likewise
                devices = ()
        s = Sample(t=t, devices=devices, host=h)
        samples.append(s)
        out.write(s)
        return s

    def drain() -> None:
        if events is None:
            return
        for item in events.read(time.perf_counter() - t0):
            (steps if isinstance(item, StepEvent) else ooms).append(item)
            out.write(item)

    def notify(s: Sample) -> None:
        if on_sample is not None:
            with contextlib.suppress(Exception):  # a view that fails must not stop the watch
                on_sample(Tick(t=s.t, sample=s, samples=len(samples), steps=len(steps),
                               last_step=steps[-1] if steps else None, pid=watched_pid))

    if on_start is not None:
        try:
            on_start(WatchStart(pid=watched_pid, command=None if argv is None else tuple(argv), gpus=gpus, note=note,
                                metrics_url=None if exporter is None else exporter.url,
                                metrics_note=None if exporter is None else exporter.note))
        except BaseException:
            if child is not None:  # nothing left to watch it: do not leave it running alone
                kill(child)
            raise
    code: int | None = None
    ended = Waiter(child, target, host)
    with Signals(child) as signals, contextlib.closing(ended):
        next_sample = time.perf_counter()
        while True:
            now = time.perf_counter()
            if now >= next_sample:
                drain()
                notify(take())
                next_sample += interval_s
                if next_sample <= time.perf_counter():  # a slow sensor: skip the missed beats, do not burst
                    next_sample = time.perf_counter() + interval_s
            else:
                drain()
            if target is not None and signals.count:
                break  # --pid: Ctrl-C ends the watch, the process runs on
            wait = max(0.0, min(next_sample - time.perf_counter(), EVENT_POLL_S))
            if not ended(wait):
                continue
            if child is not None:
                code = exit_status(child.wait())
            break
        seconds = time.perf_counter() - t0
        drain()
        take()  # at the end, at once: the last moments count, and no interval is slept after the command ended
        drain()
    record = Record(samples=tuple(samples), steps=tuple(steps), ooms=tuple(ooms), interval_s=interval_s,
                    device_kind=device_kind, note=note,
                    extra={"command": argv, "pid": watched_pid, "exit_code": code,
                           "events_offset_s": None if events is None else events.offset,
                           "events_offsets_s": {} if events is None else {
                               str(k): v for k, v in events.offsets.items() if k is not None}})
    if events is not None:
        events.close()
    used = devices_used(record)
    judged = record if not used else _only_devices(record, used)
    # the note was said once when the watch began; the diagnosis keeps to what it found
    diagnosis = judge(dataclasses.replace(judged, note=None), Context(device=record.device_kind, usable_cores=cores,
                                                                      threads=threads))
    report = build_report(record, diagnosis, used=used)
    live.final = report  # a scrape from here until the exporter closes reads the final report
    return WatchResult(command=None if argv is None else tuple(argv), pid=watched_pid, exit_code=code,
                       seconds=seconds, record=record, diagnosis=diagnosis, note=note,
                       interrupted=signals.count > 0, devices_used=used, log=out.path, log_error=out.error,
                       report=report, metrics_url=None if exporter is None else exporter.url)


def _threads(environ: dict[str, str]) -> int | None:
    """torch's intra-op threads in the watched command where its environment says (OMP_NUM_THREADS); None when it
    does not: torch's own default depends on the machine the command asked, and is not guessed."""
    value = environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def _cores(target: psutil.Process | None) -> int:
    """Cores the command may run on: its own affinity with --pid, else ours (the child inherits it)."""
    if target is not None:
        with contextlib.suppress(psutil.Error, AttributeError):
            return max(1, len(target.cpu_affinity()))
    return usable_cores()


# -- what the record says ----------------------------------------------------------------------------------------


def devices_used(record: Record) -> tuple[int, ...]:
    """NVML indices where the command's processes held memory in some sample; () when NVML never said (no GPU, no
    per-process figures, a container's pid namespace): then every GPU counts."""
    return tuple(sorted({d.index for s in record.samples for d in s.devices if d.process_memory_bytes}))


def _only_devices(record: Record, indices: Sequence[int]) -> Record:
    keep = set(indices)
    return dataclasses.replace(record, samples=tuple(dataclasses.replace(
        s, devices=tuple(d for d in s.devices if d.index in keep)) for s in record.samples))


__all__ = ["Tick", "WatchResult", "WatchStart", "device_summary", "devices_used", "host_summary", "step_summary",
           "watch"]
