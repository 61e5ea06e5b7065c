"""``gpuwise gpus``: the catalog, one accelerator with its sources, this machine."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from gpuwise.hardware.catalog import DTYPES, Accelerator
from gpuwise.hardware.detect import LocalMachine
from gpuwise.render._common import Column, Sheet, _num, _short, print_fields, print_table, to_jsonable
from gpuwise.units import GiB, human_bytes

if TYPE_CHECKING:  # these import torch; gpus and doctor render without it
    pass


def _link(row: dict[str, Any]) -> str:
    """ "NVLink 900" or "PCIe 64": the card-to-card link kind and its GB/s, compact."""
    kind = (row["interconnect"] or "-").split()[0].replace("Infinity", "IF")
    return f"{kind} {row['interconnect_gbps']:.0f}" if row["interconnect_gbps"] else kind


def _rate(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda row: _short(row[key])


def _rate_key(dtype: str) -> str:
    """The csv key of a peak rate: "bf16_tflops"; int8 counts integer operations: "int8_tops"."""
    return f"{dtype}_{'tops' if dtype == 'int8' else 'tflops'}"


# Stable keys with units: what csv readers and spreadsheets rely on. The table shows the columns with a header, the
# most important first to stay when the terminal is narrow (priority 0 always).
_CATALOG_COLUMNS = (
    Column(key="key", priority=0),
    Column(key="name", table=False),
    Column(key="vendor", table=False),
    Column(key="segment", table=False),
    Column(key="arch", table=False),
    Column(key="memory_gib", header="memory", priority=1, numeric=True,
           show=lambda r: human_bytes(r["memory_bytes"])),
    Column(key="memory_bytes", table=False),
    Column(key="memory_bandwidth_gbps", header="GB/s", priority=3, numeric=True,
           show=_rate("memory_bandwidth_gbps")),
    *(Column(key=_rate_key(d), header=d, numeric=True, priority={"fp32": 5, "bf16": 2, "fp8": 6}.get(d, 0),
             table=d in ("fp32", "bf16", "fp8"), show=_rate(_rate_key(d))) for d in DTYPES),
    Column(key="interconnect", header="link GB/s", priority=7, show=_link),
    Column(key="interconnect_gbps", table=False),
    Column(key="tdp_w", table=False),
    Column(key="launch_year", table=False),
    Column(key="cloud_usd_per_hour", header="$/h", priority=4, numeric=True,
           show=lambda r: _num(r["cloud_usd_per_hour"], ".2f")),
)


def _catalog_row(a: Accelerator) -> dict[str, Any]:
    return {"key": a.key, "name": a.name, "vendor": a.vendor, "segment": a.segment, "arch": a.arch,
            "memory_gib": a.memory_bytes / GiB, "memory_bytes": a.memory_bytes,
            "memory_bandwidth_gbps": a.memory_bandwidth_gbps,
            **{_rate_key(d): a.peak_tflops.get(d) for d in DTYPES},
            "interconnect": a.interconnect, "interconnect_gbps": a.interconnect_gbps, "tdp_w": a.tdp_w,
            "launch_year": a.launch_year, "cloud_usd_per_hour": a.cloud_usd_per_hour}


def catalog_sheet(rows: list[Accelerator]) -> Sheet:
    """The catalog rows for every format: memory in GiB, rates dense in TFLOPS (int8 in TOPS), links in GB/s."""
    return Sheet(title=f"gpuwise hardware catalog: {len(rows)} accelerator{'s' * (len(rows) != 1)}",
                 columns=_CATALOG_COLUMNS, rows=tuple(_catalog_row(a) for a in rows),
                 notes=("fp32/bf16/fp8: dense TFLOPS (no 2:4 sparsity; GeForce with fp32 accumulate); IF: Infinity "
                        "Fabric. 'gpuwise gpus KEY' shows a row with all its figures and sources.",))


def render_catalog(rows: list[Accelerator], console: Console) -> None:
    print_table(catalog_sheet(rows), console)


def catalog_json(rows: list[Accelerator]) -> dict[str, Any]:
    """``gpus --json``: every row with all its fields (one accelerator too: a list of one), under "accelerators"."""
    return {"accelerators": [a.to_dict() for a in rows]}


def render_accelerator(a: Accelerator, console: Console) -> None:
    """Every field of one row, beside its name; a value with a word too wide for beside (a source's URL) goes under
    its name instead, whole (render._common.print_fields)."""
    cc = f"{a.compute_capability[0]}.{a.compute_capability[1]}" if a.compute_capability else "-"
    rows = [
        ("key", a.key), ("vendor", a.vendor), ("segment", a.segment), ("architecture", a.arch),
        ("compute capability", cc), ("aliases", ", ".join(a.aliases) or "-"),
        ("memory", f"{human_bytes(a.memory_bytes)} {a.memory_type or ''} ({a.memory_bytes:,} bytes)"),
        ("memory bandwidth", f"{_num(a.memory_bandwidth_gbps)} GB/s"),
    ]
    for dtype in DTYPES:
        unit = "TOPS" if dtype == "int8" else "TFLOPS"
        rows.append((f"{dtype} dense", f"{_num(a.peak_tflops.get(dtype))} {unit}"))
    rows += [
        ("TDP", f"{_num(a.tdp_w)} W"),
        ("chip", "-" if a.sm_count is None else
         f"{a.sm_count} {'CUs' if a.vendor == 'AMD' else 'SMs'}, {_num(a.boost_clock_mhz)} MHz boost"
         + (f" ({_num(a.base_clock_mhz)} base)" if a.base_clock_mhz else "")
         + (f", {_num(a.l2_mib)} MiB last-level cache" if a.l2_mib else "")),
        ("interconnect", f"{a.interconnect or '-'} ({_num(a.interconnect_gbps)} GB/s); "
                         f"{'cards link directly' if a.peer_link else 'no card-to-card link (PCIe only)'}"),
        ("host link", a.host_link or "-"),
        ("launched", f"{_num(a.launch_year)}" + (f" at ${a.launch_price_usd:,.0f}" if a.launch_price_usd else "")),
        ("cloud price", f"${a.cloud_usd_per_hour:.2f}/h ({a.cloud_price_source})" if a.cloud_usd_per_hour else "-"),
        ("estimated", ", ".join(a.estimated) or "none: all from vendor documents"),
        ("source", a.source),
    ]
    print_fields(console, rows, title=Text(a.name, style="bold"))


def _device_name(row: dict[str, Any]) -> Text:
    name = Text(row["name"])
    if row["note"]:
        name.append(f"\n{row['note']}", style="dim")
    return name


def _gib(n: int | None) -> float | None:
    return None if n is None else n / GiB


_LOCAL_COLUMNS = (
    Column(key="device", priority=0),
    Column(key="name", priority=0, wrap=True, show=_device_name),
    Column(key="memory_gib", header="memory", priority=1, numeric=True,
           show=lambda r: human_bytes(r["memory_total_bytes"])),
    Column(key="free_gib", header="free", priority=3, numeric=True,
           show=lambda r: human_bytes(r["memory_free_bytes"])),
    Column(key="arch", priority=4),
    Column(key="catalog", priority=2),
    Column(key="memory_total_bytes", table=False),
    Column(key="memory_free_bytes", table=False),
    Column(key="note", table=False),
)


def local_sheet(machine: LocalMachine) -> Sheet:
    """This machine's devices for every format: memory in GiB, and the catalog row each one matched."""
    rows = tuple({"device": d.backend if d.index is None else f"{d.backend}:{d.index}", "name": d.name,
                  "memory_gib": _gib(d.memory_total_bytes), "free_gib": _gib(d.memory_free_bytes),
                  "arch": d.arch, "catalog": d.catalog_match.key if d.catalog_match else None,
                  "memory_total_bytes": d.memory_total_bytes, "memory_free_bytes": d.memory_free_bytes,
                  "note": d.note} for d in machine.devices)
    return Sheet(title=f"this machine (torch build: {machine.torch_build})", columns=_LOCAL_COLUMNS, rows=rows)


def render_local(machine: LocalMachine, console: Console) -> None:
    print_table(local_sheet(machine), console)


def local_json(machine: LocalMachine) -> dict[str, Any]:
    data = to_jsonable(machine)
    for device, raw in zip(data["devices"], machine.devices, strict=True):
        device["catalog_match"] = raw.catalog_match.key if raw.catalog_match else None
    return data
