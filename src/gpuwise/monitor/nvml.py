"""The device side of a sample, through NVML (nvidia-ml-py's ``pynvml``): one ``DeviceSample`` per GPU per read.

Every field is its own NVML query: a query the device, driver or binding lacks (``NVMLError_NotSupported``,
``NoPermission``, a function an old binding or driver does not have, ...) gives ``None`` for that field only, and a
query that answered "not supported" once is not asked again on that device. Static facts (name, maximum clocks,
slowdown temperature) are read once. Rates that NVML only has as counters (NVLink bytes) and the GPM metrics (SM
activity, occupancy, tensor and DRAM activity, Hopper and newer) are taken over the interval since the previous read,
so the first read has them as ``None``. Units: bytes, bytes/s, W, J, MHz, degrees C, percent.

MIG (A100, H100 and newer, nvitop#5): a GPU in MIG mode (``nvmlDeviceGetMigMode``) is read as the whole GPU (power,
clocks, temperature: shared by every instance) followed by one ``DeviceSample`` per MIG device (``mig`` names it by
UUID and GPU/compute instance ids; same ``index``), each with its own memory and the watched processes' memory on it.
NVML gives no utilisation under MIG ("On MIG-enabled GPUs, querying device utilization rates is not currently
supported"; nvidia_gpu_exporter#203): ``util_pct`` is None and ``note`` says so, never an error. The MIG devices are
found on the first read; instances created later are not seen. A driver or binding without the MIG calls
(NotSupported, FunctionNotFound, no such function) reads every GPU whole.

No NVIDIA GPU: ``open_nvml`` falls back to AMD GPUs through ``amdsmi`` (``monitor.amd``), where present.

NVML itself (init, shutdown, device handles) is ``gpuwise.nvml.NvmlSession``'s: a reader starts its own session,
or reads through one the caller holds (``session=``) and leaves it open. The nvml module is injectable (``nvml=``):
tests pass a fake with the same function names, constants and ``NVMLError`` (tests/fakes/nvml.py), so none
of this needs a GPU to be checked.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpuwise.errors import first_line
from gpuwise.monitor.samples import DeviceSample
from gpuwise.nvml import NvmlSession
from gpuwise.nvml import text as nvml_text

if TYPE_CHECKING:
    from gpuwise.monitor.amd import AmdReader

try:  # only for the clock-event mask constants; the reader itself takes the module it is given
    import pynvml as _pynvml
except Exception:  # pragma: no cover - nvidia-ml-py is a dependency; the numbers below stand in for it
    _pynvml = None

# -- clock-event (throttle) reasons ------------------------------------------------------------------------------


def _mask(name: str, value: int) -> int:
    """pynvml's ``nvmlClocksEventReason<name>`` (nvidia-ml-py >= 12.535), else the older ``...ThrottleReason...``
    spelling, else the value from nvml.h (the C ABI: these bits do not move)."""
    for prefix in ("nvmlClocksEventReason", "nvmlClocksThrottleReason"):
        found = getattr(_pynvml, prefix + name, None)
        if isinstance(found, int):
            return found
    return value


# Bit -> short word, in bit order. Words after nvidia-smi -q's "Clocks Event Reasons" section. BoardLimit (0x200)
# and Reliability (0x400) exist only under the older ThrottleReason names in nvidia-ml-py 13.615.
CLOCK_REASONS: tuple[tuple[int, str], ...] = (
    (_mask("GpuIdle", 0x1), "idle"),  # nothing running, clocks lowered to save power
    (_mask("ApplicationsClocksSetting", 0x2), "applications clocks setting"),  # nvidia-smi -ac
    (_mask("SwPowerCap", 0x4), "power cap (software)"),  # the power-management algorithm holds power at the limit
    (_mask("HwSlowdown", 0x8), "hardware slowdown"),  # HW: temperature, power brake or supply, by 2x or more
    (_mask("SyncBoost", 0x10), "sync boost"),  # held to the clock of the others in its sync-boost group
    (_mask("SwThermalSlowdown", 0x20), "thermal (software)"),  # GPU or memory temperature above its maximum
    (_mask("HwThermalSlowdown", 0x40), "thermal (hardware)"),
    (_mask("HwPowerBrakeSlowdown", 0x80), "power brake (hardware)"),  # the external power-brake signal
    (_mask("DisplayClockSetting", 0x100), "display clock setting"),
    (_mask("BoardLimit", 0x200), "board limit"),
    (_mask("Reliability", 0x400), "reliability"),
)

# The reasons that mean the GPU is being slowed against its will (power, heat, an external brake). Not these: idle
# (nothing to do), applications clocks (someone set them), sync boost, display clock, and the board-limit and
# reliability bits (GPU Boost's ordinary ceilings, undocumented in nvml.h beyond their names).
THROTTLING = frozenset({"power cap (software)", "hardware slowdown", "thermal (software)", "thermal (hardware)",
                        "power brake (hardware)"})


def decode_clock_reasons(mask: int) -> tuple[str, ...]:
    """A clock-event reason bit mask as words, in bit order; a bit NVML has no name for is ``"reason 0x..."``.

    >>> decode_clock_reasons(0x4 | 0x40)
    ('power cap (software)', 'thermal (hardware)')
    """
    mask = int(mask)
    words = []
    for bit, word in CLOCK_REASONS:
        if mask & bit:
            words.append(word)
            mask &= ~bit
    while mask:
        low = mask & -mask  # the lowest unknown bit
        words.append(f"reason {low:#x}")
        mask &= ~low
    return tuple(words)


# -- the reader --------------------------------------------------------------------------------------------------

_SUCCESS = 0
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_FUNCTION_NOT_FOUND = 13
_ALL_LINKS = 0xFFFFFFFF  # nvml.h: "A scopeId of UINT_MAX returns aggregate value summed up across all links"
_NVLINK_MAX_LINKS = 18  # nvml.h NVML_NVLINK_MAX_LINKS before 13.x, when the binding lacks the constant
# nvmlValueType_t -> the c_nvmlValue_t union member that holds it
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
# GPM metric id constants (nvml.h nvmlGpmMetricId_t) -> DeviceSample field; values are 0-100 percentages
_GPM_METRICS = (("NVML_GPM_METRIC_SM_UTIL", 2, "sm_active_pct"), ("NVML_GPM_METRIC_SM_OCCUPANCY", 3,
                "sm_occupancy_pct"), ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", 5, "tensor_active_pct"),
                ("NVML_GPM_METRIC_DRAM_BW_UTIL", 10, "dram_active_pct"))
_GPM_FIELDS = tuple(name for _, _, name in _GPM_METRICS)
_MIG_ENABLE = 1  # nvml.h NVML_DEVICE_MIG_ENABLE: nvmlDeviceGetMigMode's current mode when MIG is on
MIG_NO_UTIL = "utilisation not available under MIG"


@dataclass
class _Device:
    """What the reader keeps per GPU between reads."""

    index: int
    handle: Any
    unsupported: set[str] = field(default_factory=set)  # queries answered "not supported": not asked again
    resolved: dict[str, str] = field(default_factory=dict)  # query key -> the function name that exists
    static: dict[str, Any] = field(default_factory=dict)  # name, max clocks, slowdown temperature
    nvlink_mode: str = "aggregate"  # "aggregate" (scope UINT_MAX), "links" (sum of per-link scopes), "off"
    nvlink_prev: tuple[float, float, float] | None = None  # (time, tx KiB, rx KiB)
    gpm: str = "unknown"  # "unknown" (not probed yet), "on", "off"
    gpm_samples: list[Any] = field(default_factory=list)  # [previous, spare] nvmlGpmSample_t
    mig_on: bool = False  # the GPU is in MIG mode
    mig: list[_Device] | None = None  # its MIG devices; None until probed, [] when not in MIG mode
    mig_slot: int | None = None  # a MIG device: its index under nvmlDeviceGetMigDeviceHandleByIndex


class NoSuchGpu(LookupError):
    """A requested NVML index that NVML cannot open (``NvmlReader(indices=...)``); ``gpus``: how many NVML counts."""

    def __init__(self, message: str, gpus: int = 0) -> None:
        super().__init__(message)
        self.gpus = gpus


class NvmlReader:
    """Reads every ``DeviceSample`` field of the chosen GPUs (all by default), once per ``read``.

    ``nvml`` is the pynvml module (imported when None) or a stand-in with its names; ``session``: an NVML session
    the caller holds (then ``nvml`` is its module, and ``close`` leaves it open); ``indices`` are NVML indices (PCI
    bus order, which is not CUDA's order unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``); ``clock`` times the counter
    rates. Raises what the module raises when NVML cannot start; ``open_nvml`` turns that into a reason.
    """

    def __init__(self, indices: Sequence[int] | None = None, *, nvml: Any = None,
                 clock: Callable[[], float] = time.monotonic, session: NvmlSession | None = None) -> None:
        self._own_session = session is None
        self.session = NvmlSession.start(nvml) if session is None else session
        self.nvml = self.session.nvml
        self._clock = clock
        self._error: type[BaseException] = self.session.error
        self._closed = False
        try:
            count = self.session.count()
            wanted = list(range(count)) if indices is None else list(indices)
            self._devices: list[_Device] = []
            self.skipped: dict[int, str] = {}  # GPUs NVML counts but cannot open (lost, fallen off the bus)
            for i in wanted:
                try:
                    self._devices.append(_Device(i, self.session.handle(i)))
                except Exception as exc:
                    if indices is not None:  # asked for by name: not there is an error
                        raise NoSuchGpu(f"NVML has no GPU {i} ({first_line(exc)})", count) from exc
                    self.skipped[i] = first_line(exc)
        except BaseException:
            self._shutdown()
            raise

    vendor = "nvidia"

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(d.index for d in self._devices)

    @property
    def note(self) -> str | None:
        """One line on what these GPUs cannot give by design (MIG: no utilisation); None when nothing."""
        if self._closed:
            return None
        for dev in self._devices:
            self._mig_devices(dev)  # found on the first read, or now
        mig = [(d.index, len(d.mig or ())) for d in self._devices if d.mig_on]
        if not mig:
            return None
        where = ", ".join(f"GPU {i} ({n} MIG device{'' if n == 1 else 's'})" for i, n in mig)
        return f"MIG mode on {where}: {MIG_NO_UTIL}"

    # -- one query -------------------------------------------------------------------------------------------

    def _const(self, name: str, default: int) -> int:
        value = getattr(self.nvml, name, default)
        return value if isinstance(value, int) else default

    def _call(self, dev: _Device, key: str, names: str | tuple[str, ...], *args: Any) -> Any:
        """``nvml.<name>(handle, *args)`` for the first of ``names`` the binding and driver have; None on any error.

        A name the module lacks, or that the driver answers FunctionNotFound, falls through to the next (newer names
        first). NotSupported, NoPermission or no function at all put ``key`` on the device's skip list."""
        if key in dev.unsupported:
            return None
        candidates = (dev.resolved[key],) if key in dev.resolved else (names,) if isinstance(names, str) else names
        for name in candidates:
            fn = getattr(self.nvml, name, None)
            if fn is None:
                continue
            try:
                result = fn(dev.handle, *args)
            except self._error as exc:
                code = getattr(exc, "value", None)
                if code == self._const("NVML_ERROR_FUNCTION_NOT_FOUND", _FUNCTION_NOT_FOUND):
                    continue
                if code in (self._const("NVML_ERROR_NOT_SUPPORTED", _NOT_SUPPORTED),
                            self._const("NVML_ERROR_NO_PERMISSION", _NO_PERMISSION)):
                    dev.unsupported.add(key)
                return None  # anything else (Timeout, GpuIsLost, Unknown) may pass: ask again next read
            except Exception:  # a binding bug or a ctypes surprise: a monitor does not die of one sensor
                return None
            dev.resolved[key] = name
            return result
        dev.unsupported.add(key)
        return None

    def _static(self, dev: _Device, key: str, name: str, *args: Any) -> Any:
        """A value that does not change while the driver is loaded: asked until it answers, then kept."""
        if key not in dev.static:
            value = self._call(dev, key, name, *args)
            if value is None:
                return None
            dev.static[key] = value
        return dev.static[key]

    # -- a read ----------------------------------------------------------------------------------------------

    def read(self, pids: Collection[int] | None = None) -> tuple[DeviceSample, ...]:
        """Every device now: each GPU, and after a GPU in MIG mode each of its MIG devices (same ``index``, ``mig``
        set). ``pids``: the processes whose GPU memory is ``process_memory_bytes`` (None: not read)."""
        if self._closed:
            return ()
        out: list[DeviceSample] = []
        for dev in self._devices:
            instances = [self._read_mig(dev, mig, pids) for mig in self._mig_devices(dev)]
            out.append(self._read_device(dev, pids, instances))
            out.extend(instances)
        return tuple(out)

    # -- MIG ---------------------------------------------------------------------------------------------------

    def _mig_devices(self, dev: _Device) -> list[_Device]:
        """The MIG devices of a GPU in MIG mode, found once (``nvmlDeviceGetMaxMigDeviceCount`` slots, each through
        ``nvmlDeviceGetMigDeviceHandleByIndex``; an empty slot answers NotFound). [] off MIG, and where the driver or
        binding has no MIG calls; a passing error (Timeout) leaves the question open for the next read."""
        if dev.mig is not None:
            return dev.mig
        mode = self._call(dev, "mig_mode", "nvmlDeviceGetMigMode")  # [current, pending]
        if mode is None:
            if "mig_mode" in dev.unsupported:  # no MIG on this GPU, driver or binding
                dev.mig = []
            return []
        try:
            current = int(mode[0])
        except (TypeError, ValueError, IndexError):
            dev.mig = []
            return []
        if current != self._const("NVML_DEVICE_MIG_ENABLE", _MIG_ENABLE):
            dev.mig = []
            return []
        dev.mig_on = True
        count = self._call(dev, "mig_count", "nvmlDeviceGetMaxMigDeviceCount")
        if count is None:
            if "mig_count" in dev.unsupported:
                dev.mig = []
            return []
        get = getattr(self.nvml, "nvmlDeviceGetMigDeviceHandleByIndex", None)
        found = []
        for slot in range(int(count) if get is not None else 0):
            try:
                handle = get(dev.handle, slot)
            except Exception:  # NVMLError_NotFound: no MIG device in this slot
                continue
            found.append(_Device(dev.index, handle, mig_slot=slot))
        dev.mig = found
        return found

    def _read_mig(self, gpu: _Device, mig: _Device, pids: Collection[int] | None) -> DeviceSample:
        """One MIG device: its name (``... MIG 1g.10gb``), memory, and the watched processes' memory on it (the
        per-instance list: "Per-instance information can be queried by using specific MIG device handles", NVML).
        Utilisation is asked once in case a driver gives it; NVML answers NotSupported."""
        uuid = self._static(mig, "uuid", "nvmlDeviceGetUUID")
        gi = self._static(mig, "gpu_instance", "nvmlDeviceGetGpuInstanceId")
        ci = self._static(mig, "compute_instance", "nvmlDeviceGetComputeInstanceId")
        name = self._static(mig, "name", "nvmlDeviceGetName")
        util = self._call(mig, "util", "nvmlDeviceGetUtilizationRates")
        memory = self._call(mig, "memory", "nvmlDeviceGetMemoryInfo")
        return DeviceSample(
            index=gpu.index, vendor=self.vendor, mig=mig_label(uuid, gi, ci, mig.mig_slot),
            name=None if name is None else nvml_text(name),
            util_pct=None if util is None else float(util.gpu),
            mem_util_pct=None if util is None else float(util.memory),
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            process_memory_bytes=None if pids is None else self._process_memory(mig, pids),
            note=MIG_NO_UTIL if util is None else None,
        )

    # -- the whole GPU -----------------------------------------------------------------------------------------

    def _read_device(self, dev: _Device, pids: Collection[int] | None,
                     instances: Sequence[DeviceSample] = ()) -> DeviceSample:
        c = self._const
        name = self._static(dev, "name", "nvmlDeviceGetName")
        util = self._call(dev, "util", "nvmlDeviceGetUtilizationRates")  # N/A under MIG
        memory = self._call(dev, "memory", "nvmlDeviceGetMemoryInfo")
        power = self._call(dev, "power", "nvmlDeviceGetPowerUsage")  # mW; Ampere+ (not GA100): a 1 s average
        limit = self._call(dev, "power_limit", "nvmlDeviceGetEnforcedPowerLimit")  # mW
        default_limit = self._static(dev, "power_default_limit", "nvmlDeviceGetPowerManagementDefaultLimit")  # mW
        energy = self._call(dev, "energy", "nvmlDeviceGetTotalEnergyConsumption")  # mJ since driver load; Volta+
        sm_clock, mem_clock = c("NVML_CLOCK_SM", 1), c("NVML_CLOCK_MEM", 2)
        reasons = self._call(dev, "clock_reasons", ("nvmlDeviceGetCurrentClocksEventReasons",
                                                    "nvmlDeviceGetCurrentClocksThrottleReasons"))
        # nvmlDeviceGetTemperature is deprecated ("will be removed in CUDA 14.0") for ...TemperatureV
        temperature = self._call(dev, "temperature", ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"),
                                 c("NVML_TEMPERATURE_GPU", 0))
        # KB/s over NVML's 20 ms window; NVML's KB are KiB (nvitop and nvtop read them so)
        pcie_tx = self._call(dev, "pcie_tx", "nvmlDeviceGetPcieThroughput", c("NVML_PCIE_UTIL_TX_BYTES", 0))
        pcie_rx = self._call(dev, "pcie_rx", "nvmlDeviceGetPcieThroughput", c("NVML_PCIE_UTIL_RX_BYTES", 1))
        slowdown = self._static(dev, "temperature_slowdown", "nvmlDeviceGetTemperatureThreshold",
                                c("NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", 1))
        nvlink_tx, nvlink_rx = self._nvlink(dev)
        process = None if pids is None else self._process_memory(dev, pids)
        if process is None and instances:  # the whole-GPU list needs privileges under MIG: the instances' sum
            on = [d.process_memory_bytes for d in instances if d.process_memory_bytes is not None]
            process = sum(on) if on else None
        return DeviceSample(
            index=dev.index,
            vendor=self.vendor,
            note=MIG_NO_UTIL if dev.mig_on and util is None else None,
            name=None if name is None else nvml_text(name),
            util_pct=None if util is None else float(util.gpu),
            mem_util_pct=None if util is None else float(util.memory),
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            process_memory_bytes=process,
            power_w=_scaled(power, 1e-3),
            power_limit_w=_scaled(limit, 1e-3),
            power_default_limit_w=_scaled(default_limit, 1e-3),
            energy_j=_scaled(energy, 1e-3),
            sm_clock_mhz=_scaled(self._call(dev, "sm_clock", "nvmlDeviceGetClockInfo", sm_clock), 1),
            sm_clock_max_mhz=_scaled(self._static(dev, "sm_clock_max", "nvmlDeviceGetMaxClockInfo", sm_clock), 1),
            mem_clock_mhz=_scaled(self._call(dev, "mem_clock", "nvmlDeviceGetClockInfo", mem_clock), 1),
            mem_clock_max_mhz=_scaled(self._static(dev, "mem_clock_max", "nvmlDeviceGetMaxClockInfo", mem_clock), 1),
            clock_reasons=None if reasons is None else decode_clock_reasons(reasons),
            temperature_c=_scaled(temperature, 1),
            temperature_slowdown_c=_scaled(slowdown, 1),
            pcie_tx_bytes_per_s=_scaled(pcie_tx, 1024),
            pcie_rx_bytes_per_s=_scaled(pcie_rx, 1024),
            nvlink_tx_bytes_per_s=nvlink_tx,
            nvlink_rx_bytes_per_s=nvlink_rx,
            **self._gpm(dev),
        )

    def _process_memory(self, dev: _Device, pids: Collection[int]) -> int | None:
        """GPU memory of the watched processes on this device. None when NVML cannot list processes, when none of
        them is listed (not using this GPU, or in another pid namespace: a container sees its own pids, NVML the
        host's), or when NVML has no per-process figure (Windows WDDM; pynvml gives usedGpuMemory None)."""
        processes = self._call(dev, "processes", "nvmlDeviceGetComputeRunningProcesses")
        if processes is None:
            return None
        used = [p.usedGpuMemory for p in processes if p.pid in pids and getattr(p, "usedGpuMemory", None) is not None]
        return sum(int(u) for u in used) if used else None

    def _nvlink(self, dev: _Device) -> tuple[float | None, float | None]:
        """NVLink data bytes/s each way since the previous read, from NVML's cumulative KiB counters (field values
        NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX). The counters are per link, chosen by scopeId; pynvml sets it only
        from a ``(fieldId, scopeId)`` tuple, and a bare id reads link 0 alone. All links at once (scope UINT_MAX), or
        summed per link where a driver rejects that scope; no link answers (no NVLink): None from then on."""
        if dev.nvlink_mode == "off":
            return None, None
        tx_id = self._const("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", 138)
        rx_id = self._const("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", 139)
        if dev.nvlink_mode == "aggregate":
            counters = self._nvlink_counters(dev, [(tx_id, _ALL_LINKS), (rx_id, _ALL_LINKS)], tx_id)
            if counters == "rejected":
                dev.nvlink_mode, dev.nvlink_prev = "links", None
        if dev.nvlink_mode == "links":
            links = range(self._const("NVML_NVLINK_MAX_LINKS", _NVLINK_MAX_LINKS))
            counters = self._nvlink_counters(dev, [(f, link) for link in links for f in (tx_id, rx_id)], tx_id)
            if counters == "rejected":
                dev.nvlink_mode = "off"
        if "nvlink" in dev.unsupported:  # the whole call: NotSupported, NoPermission, no such function
            dev.nvlink_mode = "off"
        if not isinstance(counters, tuple):
            return None, None
        now = self._clock()
        prev, dev.nvlink_prev = dev.nvlink_prev, (now, *counters)
        if prev is None or now <= prev[0]:
            return None, None
        dt = now - prev[0]
        # a counter that went back (reset, wrapped) gives no rate for this interval
        tx, rx = (None if new < old else (new - old) * 1024 / dt for new, old in zip(counters, prev[1:], strict=True))
        return tx, rx

    def _nvlink_counters(self, dev: _Device, fields: list[tuple[int, int]], tx_id: int,
                         ) -> tuple[float, float] | str:
        """(tx KiB, rx KiB) summed over the fields that answered; "rejected" when a field of the aggregate scope, or
        every field of one direction, answered an error; "error" when the call itself failed."""
        values = self._call(dev, "nvlink", "nvmlDeviceGetFieldValues", fields)
        if values is None:
            return "error"
        aggregate = fields[0][1] == _ALL_LINKS
        totals, seen = [0.0, 0.0], [False, False]
        for v in values:
            if v.nvmlReturn != _SUCCESS:
                if aggregate:
                    return "rejected"
                continue
            side = 0 if v.fieldId == tx_id else 1
            totals[side] += float(getattr(v.value, _VALUE_MEMBER.get(v.valueType, "ullVal")))
            seen[side] = True
        return (totals[0], totals[1]) if all(seen) else "rejected"

    def _gpm(self, dev: _Device) -> dict[str, float | None]:
        """SM activity, SM occupancy, tensor activity and DRAM bandwidth use over the interval since the previous
        read, from two GPM samples (NVML GPM: "Hopper or newer fully supported devices"). Any failure turns GPM off
        for the device (no retry each read); a single metric that NVML answers with an error is None alone."""
        none = dict.fromkeys(_GPM_FIELDS)
        nvml = self.nvml
        if dev.gpm == "off":
            return none
        try:
            if dev.gpm == "unknown":
                dev.gpm = "off"
                if not getattr(nvml.nvmlGpmQueryDeviceSupport(dev.handle), "isSupportedDevice", 0):
                    return none
                dev.gpm_samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
                nvml.nvmlGpmSampleGet(dev.handle, dev.gpm_samples[0])
                dev.gpm = "on"
                return none  # one sample: no interval yet
            previous, spare = dev.gpm_samples
            nvml.nvmlGpmSampleGet(dev.handle, spare)
            request = nvml.c_nvmlGpmMetricsGet_t()
            request.version = self._const("NVML_GPM_METRICS_GET_VERSION", 1)
            request.numMetrics = len(_GPM_METRICS)
            request.sample1, request.sample2 = previous, spare
            for i, (const, default, _) in enumerate(_GPM_METRICS):
                request.metrics[i].metricId = self._const(const, default)
            nvml.nvmlGpmMetricsGet(request)
            dev.gpm_samples = [spare, previous]  # the newest becomes the start of the next interval
            found = {}
            for i, (_, _, name) in enumerate(_GPM_METRICS):
                metric = request.metrics[i]
                found[name] = float(metric.value) if metric.nvmlReturn == _SUCCESS else None
            return found
        except Exception:
            dev.gpm = "off"
            self._free_gpm(dev)
            return none

    # -- the end ---------------------------------------------------------------------------------------------

    def _free_gpm(self, dev: _Device) -> None:
        for sample in dev.gpm_samples:
            with contextlib.suppress(Exception):
                self.nvml.nvmlGpmSampleFree(sample)
        dev.gpm_samples = []

    def _shutdown(self) -> None:
        if self._own_session:
            self.session.close()

    def close(self) -> None:
        """Frees the GPM samples and ends the reader's own NVML session (NVML counts inits; a session the caller
        handed in stays open); a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        for dev in self._devices:
            self._free_gpm(dev)
        self._shutdown()

    def __enter__(self) -> NvmlReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _scaled(value: Any, factor: float) -> float | None:
    return None if value is None else float(value) * factor


def mig_label(uuid: Any, gpu_instance: Any, compute_instance: Any, slot: int | None = None) -> str:
    """A MIG device's name as nvidia-smi and CUDA_VISIBLE_DEVICES know it: ``"MIG-<uuid> (GI 1, CI 0)"``; the ids
    alone without a UUID, the slot alone without either.

    >>> mig_label("MIG-5c2d", 1, 0)
    'MIG-5c2d (GI 1, CI 0)'
    """
    ids = ", ".join(f"{what} {v}" for what, v in (("GI", gpu_instance), ("CI", compute_instance)) if v is not None)
    if uuid is not None:
        return f"{nvml_text(uuid)} ({ids})" if ids else nvml_text(uuid)
    return ids or f"MIG device {slot}"


def open_nvml(indices: Sequence[int] | None = None, nvml: Any = None, *, clock: Callable[[], float] = time.monotonic,
              session: NvmlSession | None = None, amdsmi: Any = None,
              ) -> tuple[NvmlReader | AmdReader | None, str | None]:
    """``(reader, None)``, or ``(None, why)`` in one line when there is no GPU to read; never raises.

    NVML first: nvidia-ml-py missing, no driver (nvmlInit fails), no GPU, or a requested index NVML does not have
    are its reasons. Where NVML finds no GPU at all (not for a missing index: then NVIDIA GPUs are here), AMD GPUs
    through ``amdsmi`` (``monitor.amd.open_amd``): its reader has the same interface. ``amdsmi``: the module (a
    test's fake); by default it is imported only when the caller passed neither ``nvml`` nor ``session``, so a
    caller's own NVML stand-in is never mixed with a real AMD probe. ``session``: read through an NVML session the
    caller holds (``gpuwise.nvml``) instead of starting one."""
    reader, why, gpus_here = _open_nvidia(indices, nvml, clock, session)
    if reader is not None:
        return reader, None
    if gpus_here or (amdsmi is None and (nvml is not None or session is not None)):
        return None, why
    from gpuwise.monitor.amd import open_amd

    amd, amd_why = open_amd(indices, amdsmi, clock=clock)
    if amd is not None:
        return amd, None
    return None, why if amd_why is None else f"{why}; {amd_why}"


def _open_nvidia(indices: Sequence[int] | None, nvml: Any, clock: Callable[[], float], session: NvmlSession | None,
                 ) -> tuple[NvmlReader | None, str | None, bool]:
    """``(reader, why, NVIDIA GPUs are here)``."""
    if nvml is None and session is None:
        try:
            import pynvml as nvml
        except Exception as exc:
            return None, f"nvidia-ml-py is not importable ({first_line(exc)}): pip install nvidia-ml-py", False
    try:
        reader = NvmlReader(indices, nvml=nvml, clock=clock, session=session)
    except NoSuchGpu as exc:
        return None, str(exc), exc.gpus > 0
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None, f"NVML could not start ({first_line(exc)}): no NVIDIA driver here", False
    if not reader.indices:
        reader.close()
        lost = "; ".join(f"GPU {i}: {why}" for i, why in reader.skipped.items())
        return None, f"NVML sees no GPU it can open ({lost})" if lost else "NVML sees no GPU", bool(lost)
    return reader, None, True
