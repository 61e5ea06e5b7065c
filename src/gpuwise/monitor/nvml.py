"""The device side of a sample, through NVML (nvidia-ml-py's ``pynvml``): one ``DeviceSample`` per GPU per read.

Every field is its own NVML query: a query the device, driver or binding lacks (``NVMLError_NotSupported``,
``NoPermission``, a function an old binding or driver does not have, ...) gives ``None`` for that field only, and a
query that answered "not supported" once is not asked again on that device. Static facts (name, maximum clocks,
slowdown temperature) are read once. Rates that NVML only has as counters (NVLink bytes) and the GPM metrics (SM
activity, occupancy, tensor and DRAM activity, Hopper and newer) are taken over the interval since the previous read,
so the first read has them as ``None``. Units: bytes, bytes/s, W, J, MHz, degrees C, percent.

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
from typing import Any

from gpuwise.errors import first_line
from gpuwise.monitor.samples import DeviceSample
from gpuwise.nvml import NvmlSession
from gpuwise.nvml import text as nvml_text

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


class NoSuchGpu(LookupError):
    """A requested NVML index that NVML cannot open (``NvmlReader(indices=...)``)."""


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
            wanted = list(range(self.session.count())) if indices is None else list(indices)
            self._devices: list[_Device] = []
            self.skipped: dict[int, str] = {}  # GPUs NVML counts but cannot open (lost, fallen off the bus)
            for i in wanted:
                try:
                    self._devices.append(_Device(i, self.session.handle(i)))
                except Exception as exc:
                    if indices is not None:  # asked for by name: not there is an error
                        raise NoSuchGpu(f"NVML has no GPU {i} ({first_line(exc)})") from exc
                    self.skipped[i] = first_line(exc)
        except BaseException:
            self._shutdown()
            raise

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(d.index for d in self._devices)

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
        """Every device now. ``pids``: the processes whose GPU memory is ``process_memory_bytes`` (None: not read)."""
        if self._closed:
            return ()
        return tuple(self._read_device(dev, pids) for dev in self._devices)

    def _read_device(self, dev: _Device, pids: Collection[int] | None) -> DeviceSample:
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
        return DeviceSample(
            index=dev.index,
            name=None if name is None else nvml_text(name),
            util_pct=None if util is None else float(util.gpu),
            mem_util_pct=None if util is None else float(util.memory),
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            process_memory_bytes=None if pids is None else self._process_memory(dev, pids),
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


def open_nvml(indices: Sequence[int] | None = None, nvml: Any = None, *, clock: Callable[[], float] = time.monotonic,
              session: NvmlSession | None = None) -> tuple[NvmlReader | None, str | None]:
    """``(reader, None)``, or ``(None, why)`` in one line when there is no NVML to read: nvidia-ml-py missing, no
    driver (nvmlInit fails), no GPU, or a requested index NVML does not have. Never raises. ``session``: read
    through an NVML session the caller holds (``gpuwise.nvml``) instead of starting one."""
    if nvml is None and session is None:
        try:
            import pynvml as nvml
        except Exception as exc:
            return None, f"nvidia-ml-py is not importable ({first_line(exc)}): pip install nvidia-ml-py"
    try:
        reader = NvmlReader(indices, nvml=nvml, clock=clock, session=session)
    except NoSuchGpu as exc:
        return None, str(exc)
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None, f"NVML could not start ({first_line(exc)}): no NVIDIA driver here"
    if not reader.indices:
        reader.close()
        lost = "; ".join(f"GPU {i}: {why}" for i, why in reader.skipped.items())
        return None, f"NVML sees no GPU it can open ({lost})" if lost else "NVML sees no GPU"
    return reader, None
