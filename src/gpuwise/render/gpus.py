"""``gpuwise gpus``: the catalog, one accelerator with its sources, this machine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuwise.hardware.catalog import DTYPES, Accelerator
from gpuwise.hardware.detect import LocalMachine
from gpuwise.render._common import _num, _short, to_jsonable
from gpuwise.units import human_bytes

if TYPE_CHECKING:  # these import torch; gpus and doctor render without it
    pass


def _link(a: Accelerator) -> str:
    """ "NVLink 900" or "PCIe 64": the card-to-card link kind and its GB/s, compact."""
    kind = (a.interconnect or "-").split()[0].replace("Infinity", "IF")
    return f"{kind} {a.interconnect_gbps:.0f}" if a.interconnect_gbps else kind


def render_catalog(rows: list[Accelerator], console: Console) -> None:
    table = Table(title=f"gpuwise hardware catalog: {len(rows)} accelerators", box=box.SIMPLE_HEAD,
                  padding=(0, 1), pad_edge=False)
    table.add_column("key", no_wrap=True)
    table.add_column("memory", justify="right", no_wrap=True)
    for column in ("GB/s", "fp32", "bf16", "fp8"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("link GB/s", no_wrap=True)
    table.add_column("$/h", justify="right", no_wrap=True)
    for a in rows:
        rates = [_short(a.peak_tflops.get(d)) for d in ("fp32", "bf16", "fp8")]
        table.add_row(a.key, human_bytes(a.memory_bytes), _short(a.memory_bandwidth_gbps), *rates,
                      _link(a), _num(a.cloud_usd_per_hour, ".2f"))
    console.print(table)
    console.print("fp32/bf16/fp8: dense TFLOPS (no 2:4 sparsity; GeForce with fp32 accumulate); IF: "
                  "Infinity Fabric. 'gpuwise gpus KEY' shows a row with all its figures and sources.")


def render_accelerator(a: Accelerator, console: Console) -> None:
    table = Table(title=a.name, show_header=False)
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
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
    for field, value in rows:
        table.add_row(field, value)
    console.print(table)


def render_local(machine: LocalMachine, console: Console) -> None:
    table = Table(title=f"this machine (torch build: {machine.torch_build})", box=box.SIMPLE_HEAD)
    table.add_column("device", no_wrap=True)
    table.add_column("name", overflow="fold")
    table.add_column("memory", justify="right", no_wrap=True)
    table.add_column("free", justify="right", no_wrap=True)
    table.add_column("arch", no_wrap=True)
    table.add_column("catalog", no_wrap=True)
    for d in machine.devices:
        device = d.backend if d.index is None else f"{d.backend}:{d.index}"
        name = Text(d.name)
        if d.note:
            name.append(f"\n{d.note}", style="dim")
        table.add_row(device, name, human_bytes(d.memory_total_bytes), human_bytes(d.memory_free_bytes),
                      d.arch or "-", d.catalog_match.key if d.catalog_match else "-")
    console.print(table)


def local_json(machine: LocalMachine) -> dict[str, Any]:
    data = to_jsonable(machine)
    for device, raw in zip(data["devices"], machine.devices, strict=True):
        device["catalog_match"] = raw.catalog_match.key if raw.catalog_match else None
    return data
