"""The device side of a sample on AMD GPUs, through ``amdsmi`` (AMD SMI's Python binding, shipped with ROCm under
/opt/rocm/share/amd_smi; not a gpuwise dependency: imported only where present).

``AmdReader`` has the NVML reader's interface (``read(pids) -> tuple[DeviceSample, ...]``, ``close()``,
``indices``, ``skipped``, ``note``, ``vendor``) and the same rule for sensors: every field is its own query, a query
the GPU, driver or binding lacks gives ``None`` for that field alone, and one answered "not supported" (or "not yet
implemented", or "permission denied") is not asked again on that GPU. ``monitor.nvml.open_nvml`` falls back to it
when NVML finds no GPU, so every caller of ``open_nvml`` reads AMD GPUs without knowing it.

What it reads, per GPU (the amdsmi Python interface's own function names and dict keys):

- utilisation: ``amdsmi_get_gpu_activity`` ``gfx_activity`` (%; the graphics/compute engine's activity, the nearest
  to NVML's kernel duty cycle) and ``umc_activity`` (%, the memory controller);
- memory: ``amdsmi_get_gpu_vram_usage`` ``vram_used`` / ``vram_total``, in MB that are MiB (amdsmi divides the
  driver's bytes by 1024 * 1024);
- the watched processes' memory: ``amdsmi_get_gpu_process_list``, each process's ``memory_usage["vram_mem"]`` in
  bytes. ROCm >= 6.2 returns dicts; ROCm 6.0-6.1 return process handles, each read through
  ``amdsmi_get_gpu_process_info`` (the same keys);
- power: ``amdsmi_get_power_info``, W: ``current_socket_power`` (MI300 and newer), else ``average_socket_power``
  (Navi, MI200 and older), else ``socket_power`` (ROCm 7); "N/A" or UINT_MAX where the GPU lacks one;
- power cap: ``amdsmi_get_power_cap_info`` ``power_cap`` and ``default_power_cap`` (``power_cap_default`` before
  ROCm 6.1), in uW on bare metal. ``amdsmi_get_power_info``'s ``power_limit`` is not used: its unit moved from W
  (ROCm 7.1) to uW (7.13 preview);
- energy: ``amdsmi_get_energy_count``, ``energy_accumulator`` (``power`` before ROCm 6.1) x ``counter_resolution``
  (uJ);
- clocks: ``amdsmi_get_clock_info(h, AmdSmiClkType.GFX / MEM)``, MHz: ``clk`` (``cur_clk`` before ROCm 6.1) and
  ``max_clk``;
- temperature: ``amdsmi_get_temp_metric(h, AmdSmiTemperatureType.HOTSPOT, AmdSmiTemperatureMetric.CURRENT)``, deg C;
  ``JUNCTION`` where the enum has no ``HOTSPOT`` (before ROCm 6.1), else ``EDGE``.

ROCm 6.0 and newer (the processor-handle API); ROCm 5.x's ``amdsmi_dev_*`` names are not read.

Not read (``None``): clock-event (throttle) reasons (amdsmi's throttle status bits differ by ASIC), the slowdown
temperature, PCIe and xGMI rates, SM-level activity (NVIDIA GPM only). The ``amdsmi`` module is injectable
(``amdsmi=``): tests pass a fake with the same names, so none of this needs an AMD GPU to be checked.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuwise.errors import first_line
from gpuwise.monitor.samples import DeviceSample

# amdsmi_status_t codes (amdsmi.h) that mean "never on this GPU": ask no more
_NOT_SUPPORTED = 2  # AMDSMI_STATUS_NOT_SUPPORTED
_NOT_YET_IMPLEMENTED = 3  # AMDSMI_STATUS_NOT_YET_IMPLEMENTED
_NO_PERM = 10  # AMDSMI_STATUS_NO_PERM
_FOR_GOOD = frozenset({_NOT_SUPPORTED, _NOT_YET_IMPLEMENTED, _NO_PERM})
# What amdsmi puts where a sensor has no value: "N/A" from the Python interface, else the C struct's filler
# ("Unsupported struct members are set to UINT32_MAX", amdsmi.h), and 0xFFFF from ROCm 6.0-6.1's activity and power
# fields (the interface compared them to 0xFFFF). 0xFFFF is a sentinel only for percentages, watts, MHz and deg C.
_UINT_MAX = frozenset({0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF})
_SHORT_MAX = 0xFFFF
_MIB = 1024 * 1024
# The ROCm kernel driver's compute interface: present where an AMD GPU and its driver are, whatever Python has
KFD_DEVICE = "/dev/kfd"
INSTALL_HINT = "pip install /opt/rocm/share/amd_smi (the amdsmi binding ROCm ships)"


def _num(value: Any, *, short: bool = False) -> float | None:
    """A reading as a number; None for "N/A", a non-number, or the filler of an unsupported member."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if value in _UINT_MAX or (short and value == _SHORT_MAX):
        return None
    return float(value)


def _code(exc: BaseException) -> int | None:
    """The amdsmi status code of an ``AmdSmiLibraryException`` (``err_code``, or ``get_error_code()``)."""
    code = getattr(exc, "err_code", None)
    if code is None:
        getter = getattr(exc, "get_error_code", None)
        try:
            code = getter() if callable(getter) else None
        except Exception:
            code = None
    try:
        return None if code is None else abs(int(code))
    except (TypeError, ValueError):
        return None


@dataclass
class _AmdDevice:
    index: int  # position in amdsmi_get_processor_handles()
    handle: Any
    unsupported: set[str] = field(default_factory=set)
    resolved: dict[str, Any] = field(default_factory=dict)  # query key -> the function name (or sensor) that answered
    static: dict[str, Any] = field(default_factory=dict)


class NoSuchAmdGpu(LookupError):
    """A requested index amdsmi has no GPU at."""


class AmdReader:
    """Reads the ``DeviceSample`` fields amdsmi has, for the chosen GPUs (all by default), once per ``read``.

    ``amdsmi``: the amdsmi module (imported when None) or a stand-in with its names; ``indices``: positions in
    ``amdsmi_get_processor_handles()`` (amdsmi's order, by PCI bus like ``rocm-smi``; HIP's device order can differ
    unless ``HIP_VISIBLE_DEVICES``/``ROCR_VISIBLE_DEVICES`` is set). Raises what amdsmi raises when it cannot start
    (no driver); ``open_amd`` turns that into a reason."""

    vendor = "amd"

    def __init__(self, indices: Sequence[int] | None = None, *, amdsmi: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if amdsmi is None:
            import amdsmi
        self.amdsmi = amdsmi
        self._clock = clock
        self._closed = False
        self.skipped: dict[int, str] = {}
        amdsmi.amdsmi_init()
        try:
            handles = list(amdsmi.amdsmi_get_processor_handles())
            wanted = list(range(len(handles))) if indices is None else list(indices)
            for i in wanted:
                if not 0 <= i < len(handles):
                    raise NoSuchAmdGpu(f"amdsmi has no GPU {i} (it sees {len(handles)})")
            self._devices = [_AmdDevice(i, handles[i]) for i in wanted]
        except BaseException:
            self._shutdown()
            raise

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(d.index for d in self._devices)

    @property
    def note(self) -> str | None:
        """What the samples lack by design on this vendor: the clock-event reasons (so throttling is not judged)."""
        return "AMD GPU through amdsmi: no clock-event (throttle) reasons, PCIe/xGMI rates or SM activity"

    # -- one query -------------------------------------------------------------------------------------------

    def _member(self, enum: str, *names: str) -> Any:
        """The first of ``names`` that amdsmi's enum ``enum`` has (None: neither)."""
        cls = getattr(self.amdsmi, enum, None)
        for name in names:
            member = getattr(cls, name, None)
            if member is not None:
                return member
        return None

    def _call(self, dev: _AmdDevice, key: str, names: str | tuple[str, ...], *args: Any) -> Any:
        """``amdsmi.<name>(handle, *args)`` for the first of ``names`` the binding has; None on any error.
        NOT_SUPPORTED, NOT_YET_IMPLEMENTED, NO_PERM or no such function put ``key`` on the GPU's skip list; any other
        error (a busy device, a retry, a binding bug) passes: asked again next read."""
        if key in dev.unsupported:
            return None
        candidates = (dev.resolved[key],) if key in dev.resolved else (names,) if isinstance(names, str) else names
        for name in candidates:
            fn = getattr(self.amdsmi, name, None)
            if fn is None:
                continue
            try:
                result = fn(dev.handle, *args)
            except Exception as exc:  # AmdSmiLibraryException (with a code), AmdSmiParameterException, ...
                if _code(exc) in _FOR_GOOD:
                    dev.unsupported.add(key)
                return None
            dev.resolved[key] = name
            return result
        dev.unsupported.add(key)
        return None

    def _static(self, dev: _AmdDevice, key: str, names: str | tuple[str, ...], *args: Any) -> Any:
        if key not in dev.static:
            value = self._call(dev, key, names, *args)
            if value is None:
                return None
            dev.static[key] = value
        return dev.static[key]

    # -- a read ----------------------------------------------------------------------------------------------

    def read(self, pids: Collection[int] | None = None) -> tuple[DeviceSample, ...]:
        """Every GPU now. ``pids``: the processes whose VRAM is ``process_memory_bytes`` (None: not read)."""
        if self._closed:
            return ()
        return tuple(self._read_device(dev, pids) for dev in self._devices)

    def _read_device(self, dev: _AmdDevice, pids: Collection[int] | None) -> DeviceSample:
        asic = self._static(dev, "name", "amdsmi_get_gpu_asic_info")
        activity = _dict(self._call(dev, "activity", "amdsmi_get_gpu_activity"))
        vram = _dict(self._call(dev, "vram", "amdsmi_get_gpu_vram_usage"))
        power = _dict(self._call(dev, "power", "amdsmi_get_power_info"))
        cap = _dict(self._call(dev, "power_cap", "amdsmi_get_power_cap_info"))
        energy = _dict(self._call(dev, "energy", "amdsmi_get_energy_count"))
        gfx_clock = self._clock_info(dev, "GFX")
        mem_clock = self._clock_info(dev, "MEM")
        used, total = _num(vram.get("vram_used")), _num(vram.get("vram_total"))
        counter = _num(energy.get("energy_accumulator", energy.get("power")))  # "power" before ROCm 6.1
        resolution = _num(energy.get("counter_resolution"))  # uJ per count
        default_cap = _num(cap.get("default_power_cap", cap.get("power_cap_default")))
        return DeviceSample(
            index=dev.index,
            vendor=self.vendor,
            name=_text(asic.get("market_name")) if isinstance(asic, dict) else None,
            util_pct=_num(activity.get("gfx_activity"), short=True),
            mem_util_pct=_num(activity.get("umc_activity"), short=True),
            memory_used_bytes=None if used is None else int(used) * _MIB,
            memory_total_bytes=None if total is None or total <= 0 else int(total) * _MIB,
            process_memory_bytes=None if pids is None else self._process_memory(dev, pids),
            power_w=_first_watts(power),
            power_limit_w=_micro(_num(cap.get("power_cap"))),
            power_default_limit_w=_micro(default_cap),
            energy_j=None if counter is None or resolution is None else counter * resolution * 1e-6,
            sm_clock_mhz=_num(gfx_clock.get("clk", gfx_clock.get("cur_clk")), short=True),  # cur_clk: ROCm < 6.1
            sm_clock_max_mhz=_num(gfx_clock.get("max_clk"), short=True),
            mem_clock_mhz=_num(mem_clock.get("clk", mem_clock.get("cur_clk")), short=True),
            mem_clock_max_mhz=_num(mem_clock.get("max_clk"), short=True),
            temperature_c=self._temperature(dev),
        )

    def _clock_info(self, dev: _AmdDevice, kind: str) -> dict:
        member = self._member("AmdSmiClkType", kind)
        if member is None:  # the enum is what the binding checks its argument against: no guessing its value
            dev.unsupported.add(f"clock_{kind}")
            return {}
        return _dict(self._call(dev, f"clock_{kind}", "amdsmi_get_clock_info", member))

    def _temperature(self, dev: _AmdDevice) -> float | None:
        """The hotspot (junction) temperature, the one the GPU throttles on; the edge sensor where there is none.
        The sensor that answered first is the one read from then on."""
        current = self._member("AmdSmiTemperatureMetric", "CURRENT")
        if current is None:
            return None
        sensors = (dev.resolved["temperature"],) if "temperature" in dev.resolved else ("HOTSPOT", "JUNCTION", "EDGE")
        tried: list[Any] = []
        for sensor in sensors:
            member = self._member("AmdSmiTemperatureType", sensor)
            if member is None or member in tried:  # JUNCTION is HOTSPOT's old name (an alias of the same sensor)
                continue
            tried.append(member)
            value = _num(self._call(dev, f"temperature_{sensor}", "amdsmi_get_temp_metric", member, current),
                         short=True)
            if value is not None:
                dev.resolved["temperature"] = sensor
                return value
            if "temperature" in dev.resolved:  # the chosen sensor failed this once: no other sensor's figure
                return None
        return None

    def _process_memory(self, dev: _AmdDevice, pids: Collection[int]) -> int | None:
        """VRAM of the watched processes on this GPU; None when amdsmi cannot list processes, none of them is listed
        (not on this GPU, or another pid namespace), or none has a VRAM figure."""
        processes = self._call(dev, "processes", "amdsmi_get_gpu_process_list")
        if processes is None:
            return None
        used = []
        for p in processes:
            info = p if isinstance(p, dict) else self._process_info(dev, p)  # handles before ROCm 6.2
            if not info or info.get("pid") not in pids:
                continue
            usage = info.get("memory_usage")
            vram = _num(usage.get("vram_mem")) if isinstance(usage, dict) else None
            if vram is None:
                vram = _num(info.get("mem"))
            if vram is not None:
                used.append(int(vram))
        return sum(used) if used else None

    def _process_info(self, dev: _AmdDevice, process: Any) -> dict | None:
        if "process_info" in dev.unsupported:
            return None
        fn = getattr(self.amdsmi, "amdsmi_get_gpu_process_info", None)
        if fn is None:
            dev.unsupported.add("process_info")
            return None
        try:
            info = fn(dev.handle, process)
        except Exception as exc:  # the process ended between the list and the query, or never supported
            if _code(exc) in _FOR_GOOD:
                dev.unsupported.add("process_info")
            return None
        return info if isinstance(info, dict) else None

    # -- the end ---------------------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.amdsmi.amdsmi_shut_down()

    def close(self) -> None:
        """``amdsmi_shut_down``, once; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._shutdown()

    def __enter__(self) -> AmdReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if not isinstance(value, str) or value.strip() in ("", "N/A"):
        return None
    return value.strip()


def _micro(value: float | None) -> float | None:
    """uW -> W; a cap of 0 is no cap read."""
    return None if value is None or value <= 0 else value * 1e-6


def _first_watts(power: dict) -> float | None:
    """The socket power in W: the current figure (MI300 and newer), else the average (older), else ROCm 7's
    ``socket_power``; a 0 is a field the GPU does not fill."""
    for key in ("current_socket_power", "average_socket_power", "socket_power"):
        value = _num(power.get(key), short=True)
        if value is not None and value > 0:
            return value
    return None


def rocm_present() -> bool:
    """The ROCm kernel driver's device is here: an AMD GPU may be, even if Python cannot import amdsmi."""
    return os.path.exists(KFD_DEVICE)


def open_amd(indices: Sequence[int] | None = None, amdsmi: Any = None, *,
             clock: Callable[[], float] = time.monotonic) -> tuple[AmdReader | None, str | None]:
    """``(reader, None)``, or ``(None, why)`` in one line; never raises. ``why`` is None when there is no sign of an
    AMD GPU at all (amdsmi not importable and no ``/dev/kfd``): nothing worth saying beside NVML's reason."""
    if amdsmi is None:
        try:
            import amdsmi
        except Exception as exc:  # ImportError, or OSError when the binding cannot load libamd_smi.so
            if not rocm_present():
                return None, None
            return None, f"amdsmi is not importable ({first_line(exc)}): {INSTALL_HINT}"
    try:
        reader = AmdReader(indices, amdsmi=amdsmi, clock=clock)
    except NoSuchAmdGpu as exc:
        return None, str(exc)
    except Exception as exc:  # AMDSMI_STATUS_INIT_ERROR, DRIVER_NOT_LOADED, ...
        return None, f"amdsmi could not start ({first_line(exc)}): no AMD GPU driver here"
    if not reader.indices:
        reader.close()
        return None, "amdsmi sees no GPU"
    return reader, None


__all__ = ["AmdReader", "NoSuchAmdGpu", "open_amd", "rocm_present"]
