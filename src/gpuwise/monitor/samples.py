"""What the monitor records: device, allocator and host samples at a fixed rate, and the loop's own step events.

Plain frozen dataclasses, device independent; every field a sensor may lack is ``None`` (never an error). A record
is written as JSON lines (``--log``): one ``{"kind": "sample", ...}`` or ``{"kind": "step", ...}`` object a line,
and read back the same way (``read_log``), so a run can be diagnosed again later, on any machine.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from gpuwise.errors import GpuwiseError
from gpuwise.files import load_json


@dataclass(frozen=True, kw_only=True)
class DeviceSample:
    """One GPU at one moment, through NVML. Utilisation is NVML's duty cycle: the share of the last sample period
    in which at least one kernel ran, not how busy the SMs were (``sm_active_pct``, GPM, says that)."""

    index: int
    name: str | None = None
    util_pct: float | None = None  # nvmlDeviceGetUtilizationRates .gpu: kernel duty cycle
    mem_util_pct: float | None = None  # .memory: memory-controller duty cycle
    memory_used_bytes: int | None = None  # the whole device (nvmlDeviceGetMemoryInfo)
    memory_total_bytes: int | None = None
    process_memory_bytes: int | None = None  # the watched processes only (nvmlDeviceGetComputeRunningProcesses)
    power_w: float | None = None
    power_limit_w: float | None = None  # enforced limit
    power_default_limit_w: float | None = None  # the board's default limit: a lower enforced one was set by someone
    energy_j: float | None = None  # nvmlDeviceGetTotalEnergyConsumption since the driver loaded (Volta+)
    sm_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    mem_clock_mhz: float | None = None
    mem_clock_max_mhz: float | None = None
    clock_reasons: tuple[str, ...] | None = None  # decoded clock-event (throttle) reasons; () none; None unknown
    temperature_c: float | None = None
    temperature_slowdown_c: float | None = None  # the threshold at which the GPU slows itself down
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    nvlink_tx_bytes_per_s: float | None = None
    nvlink_rx_bytes_per_s: float | None = None
    # GPM (Hopper and newer): percentages over the interval since the previous sample
    sm_active_pct: float | None = None
    sm_occupancy_pct: float | None = None
    tensor_active_pct: float | None = None
    dram_active_pct: float | None = None
    vendor: str | None = None  # "nvidia" (NVML) or "amd" (amdsmi); None in logs written before it was recorded
    mig: str | None = None  # a MIG instance of GPU ``index``: "MIG-<uuid> (GI 1, CI 0)"; None for a whole GPU
    note: str | None = None  # why an expected figure is missing ("utilisation not available under MIG")


@dataclass(frozen=True, kw_only=True)
class AllocatorSample:
    """torch's caching allocator on one device (``torch.cuda.memory_stats``)."""

    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int | None = None
    inactive_split_bytes: int | None = None  # reserved, unused, in blocks split for smaller requests
    alloc_retries: int | None = None  # cudaMalloc failed, the cache was flushed and the call retried
    ooms: int | None = None
    small_pool_allocated_bytes: int | None = None  # of allocated, in blocks under 1 MB (scalars, small tensors)
    allocations: int | None = None  # live allocations (allocation.all.current): kept tensors add one each


@dataclass(frozen=True, kw_only=True)
class HostSample:
    """The host: every core, memory, and the watched process with its children (the data-loader workers)."""

    cpu_pct: tuple[float, ...] = ()  # per logical core, 0-100
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    process_cpu_pct: float | None = None  # the main process, in % of one core (200 = two cores busy)
    workers: int | None = None  # its child processes (DataLoader workers under torch)
    workers_cpu_pct: float | None = None  # all of them together, in % of one core
    iowait_pct: float | None = None  # Linux only
    process_rss_bytes: int | None = None  # the main process's resident memory (a leak grows it step by step)
    workers_rss_bytes: int | None = None  # its loader workers' together (pages shared with the parent counted in
    # each: an upper bound)
    process_threads: int | None = None  # OS threads of the main process (torch's intra-op pool among them)
    tree_processes: int | None = None  # the process and every descendant (torchrun's ranks, workers, compilers)
    tree_threads: int | None = None  # their threads together: against the cores, the oversubscription
    tree_rss_bytes: int | None = None  # the resident memory of the process and every descendant (torchrun's ranks)
    load_1m: float | None = None  # the run queue, 1-minute load average (os.getloadavg), whole machine
    runq_threads: float | None = None  # the run's own threads (process and descendants) runnable but waiting for a
    # core, on average over the interval (Linux /proc/PID/task/TID/schedstat); ~0 when it has the cores it wants


@dataclass(frozen=True, kw_only=True)
class Sample:
    t: float  # seconds since the monitor started
    devices: tuple[DeviceSample, ...] = ()
    allocator: AllocatorSample | None = None
    host: HostSample | None = None


@dataclass(frozen=True, kw_only=True)
class StepEvent:
    """One optimizer step, timed by the loop itself (``Monitor.step``)."""

    step: int
    t: float  # when it ended, seconds since the monitor started
    seconds: float  # wall time of the whole step, the wait for its data included
    data_wait_s: float = 0.0  # blocked in next() on the data
    data_wait_cpu_s: float | None = None  # CPU time this process spent meanwhile: ~data_wait_s if it made the batch
    # itself on the CPU (decoding), ~0 if it waited on I/O, a sleep or its workers
    data_wait_runq_s: float | None = None  # of the wait, the time the loop's thread was runnable but had no core
    # (Linux schedstat): a wait that is mostly this is CPU contention, not the data
    compute_s: float | None = None  # forward + backward (with the exposed part of any collective)
    optimizer_s: float | None = None
    comm_s: float | None = None  # collectives in flight (DDP all-reduce buckets), overlapped or not
    exposed_comm_s: float | None = None  # the part of comm_s that backward did not hide
    peak_memory_bytes: int | None = None  # torch.cuda.max_memory_allocated over the step
    flops: float | None = None  # the plan's FLOPs of the step (per process): achieved rate and MFU
    items: int | None = None  # samples (or tokens) the step consumed, over this process: wall-clock throughput
    micro_batches: int | None = None  # forward/backward passes per optimizer step (gradient accumulation applied)
    rank: int | None = None  # the torch.distributed rank that timed it (None: one process)


@dataclass(frozen=True, kw_only=True)
class OomEvent:
    """An out-of-memory error where it happened, with the allocator at that moment."""

    step: int
    t: float
    message: str
    allocator: AllocatorSample | None = None


@dataclass(frozen=True, kw_only=True)
class Record:
    """Everything a monitor saw, in order."""

    samples: tuple[Sample, ...] = ()
    steps: tuple[StepEvent, ...] = ()
    ooms: tuple[OomEvent, ...] = ()
    interval_s: float = 1.0
    device_kind: str = "cpu"  # "cuda" when NVML saw GPUs, else what ran: "cpu", "mps"
    note: str | None = None  # why device counters are missing ("no NVIDIA GPU: watching the CPU side")
    extra: dict[str, Any] = field(default_factory=dict)


# -- JSON lines --------------------------------------------------------------------------------------------------

_KINDS = {"sample": Sample, "step": StepEvent, "oom": OomEvent}


def to_line(item: Sample | StepEvent | OomEvent) -> str:
    kind = {Sample: "sample", StepEvent: "step", OomEvent: "oom"}[type(item)]
    return json.dumps({"kind": kind, **dataclasses.asdict(item)}, separators=(",", ":"))


def _from_dict(cls, data: dict):
    if cls is Sample:
        return Sample(t=data["t"], devices=tuple(DeviceSample(**{**d, "clock_reasons": None if d.get(
            "clock_reasons") is None else tuple(d["clock_reasons"])}) for d in data.get("devices", ())),
            allocator=None if data.get("allocator") is None else AllocatorSample(**data["allocator"]),
            host=None if data.get("host") is None else HostSample(**{**data["host"], "cpu_pct": tuple(
                data["host"].get("cpu_pct", ()))}))
    if cls is OomEvent:
        return OomEvent(**{**data, "allocator": None if data.get("allocator") is None else AllocatorSample(
            **data["allocator"])})
    return cls(**data)


def from_line(line: str) -> Sample | StepEvent | OomEvent | None:
    """One log line back; None for a blank line or a kind this version does not know."""
    if not line.strip():
        return None
    data = load_json(line)
    try:
        cls = _KINDS.get(data.pop("kind", None))
        return None if cls is None else _from_dict(cls, data)
    except AttributeError as exc:  # JSON, but not our objects (a list, a device that is a number): as bad as no JSON
        raise ValueError(str(exc)) from None


def write_lines(items: Iterable[Sample | StepEvent | OomEvent], f: IO[str]) -> None:
    for item in items:
        f.write(to_line(item) + "\n")


def read_log(path: str | Path) -> Record:
    """A ``--log`` file back as a Record (lines in any order of kinds; a cut-off last line is skipped)."""
    samples, steps, ooms = [], [], []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise GpuwiseError(f"no such log: {path}", "pass the file gpuwise watch --log or train --log wrote") from None
    except (UnicodeDecodeError, IsADirectoryError) as exc:
        raise GpuwiseError(f"{path} is not a gpuwise log: {exc}", "pass a JSON-lines --log file") from None
    for i, line in enumerate(lines):
        try:
            item = from_line(line)
        except (ValueError, TypeError, KeyError) as exc:  # TooDeep is a ValueError
            if i == len(lines) - 1:
                break  # the writer was stopped mid-line
            raise GpuwiseError(f"{path} line {i + 1} is not a gpuwise log line: {exc}",
                               "pass a JSON-lines --log file") from None
        if isinstance(item, Sample):
            samples.append(item)
        elif isinstance(item, StepEvent):
            steps.append(item)
        elif isinstance(item, OomEvent):
            ooms.append(item)
    return Record(samples=tuple(samples), steps=tuple(steps), ooms=tuple(ooms))


def iter_devices(record: Record) -> Iterator[tuple[float, DeviceSample]]:
    for s in record.samples:
        for d in s.devices:
            yield s.t, d
