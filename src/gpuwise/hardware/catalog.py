"""The accelerator catalog: one sourced row per SKU, looked up by normalised name or alias.

The data lives in ``catalog.toml`` beside this file; every row carries the source of its figures.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from gpuwise.errors import GpuwiseError
from gpuwise.units import GiB

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8")
SEGMENTS = ("consumer", "workstation", "datacenter", "edge")
VENDORS = ("NVIDIA", "AMD", "Intel", "Huawei", "Google", "Apple", "Qualcomm")
# The software stack PyTorch work runs on, which decides what a row can be used for: "cuda" and "rocm" run
# stock PyTorch; "cann" (Ascend, torch_npu), "xla" (TPU, torch_xla) and "gaudi" (Intel HPU) need a port;
# "mps" is the Apple GPU; "coreml" (Apple Neural Engine), "qnn" (Qualcomm AI Engine Direct) and "edgetpu"
# (Coral) run exported inference graphs only, no training.
ECOSYSTEMS = ("cuda", "rocm", "cann", "xla", "gaudi", "mps", "coreml", "qnn", "edgetpu")
# Words that carry no identity in a device name: "NVIDIA GeForce RTX 4090" and "rtx 4090" are one card.
_NOISE_WORDS = frozenset({"nvidia", "geforce", "amd", "radeon", "instinct", "intel", "google", "apple",
                          "huawei", "tesla", "qualcomm"})
# The chip facts a speed model needs (SMs or CUs, clocks, last-level cache): optional, positive when present.
CHIP_FACTS = ("sm_count", "boost_clock_mhz", "base_clock_mhz", "l2_mib")
_ESTIMABLE = frozenset({"memory_gib", "memory_bandwidth_gbps", "tdp_w", "launch_price_usd", *DTYPES, *CHIP_FACTS})
_REQUIRED = ("key", "name", "vendor", "segment", "arch", "memory_gib", "ecosystem", "node_gpus", "source")
_OPTIONAL = ("compute_capability", "aliases", "memory_type", "memory_bandwidth_gbps", "peak_tflops", "tdp_w",
             "interconnect", "interconnect_gbps", "peer_link", "host_link", "allreduce_busbw_gbps",
             "allreduce_source", "launch_year", "launch_price_usd", "cloud_usd_per_hour", "cloud_price_source",
             "cloud_price_date", "street_price_usd", "street_price_source", "street_price_date", "estimated",
             *CHIP_FACTS)
# A figure that needs its provenance: the keys that must come with it when it is present.
_NEEDS = {
    "cloud_usd_per_hour": ("cloud_price_source", "cloud_price_date"),
    "street_price_usd": ("street_price_source", "street_price_date"),
    "allreduce_busbw_gbps": ("allreduce_source",),
}
_POSITIVE = ("memory_gib", "memory_bandwidth_gbps", "tdp_w", "interconnect_gbps", "allreduce_busbw_gbps",
             "launch_price_usd", "cloud_usd_per_hour", "street_price_usd", *CHIP_FACTS)
_MONTH = re.compile(r"20\d\d-(0[1-9]|1[0-2])")  # "YYYY-MM", the month a price was seen


def normalize_name(name: str) -> str:
    """The form names are matched in: lower case, vendor words and punctuation dropped.

    >>> normalize_name("NVIDIA GeForce RTX 4090") == normalize_name("rtx-4090") == "rtx4090"
    True
    """
    words = re.sub(r"[^a-z0-9]+", " ", name.lower()).split()
    return "".join(w for w in words if w not in _NOISE_WORDS)


@dataclass(frozen=True, kw_only=True)
class PeakRates:
    """Dense peak rates in TFLOPS (int8 in TOPS); ``None`` where the vendor gives no figure."""

    fp32: float | None = None
    tf32: float | None = None
    fp16: float | None = None  # tensor-core rate with fp32 accumulate on GeForce (what AMP uses)
    bf16: float | None = None
    fp8: float | None = None
    int8: float | None = None  # TOPS

    def get(self, dtype: str) -> float | None:
        if dtype not in DTYPES:
            raise GpuwiseError(f"unknown dtype {dtype!r}", hint=f"use one of {', '.join(DTYPES)}")
        return getattr(self, dtype)


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """One catalog row. Capacity in bytes, bandwidth in GB/s (10^9 bytes/s), power in watts."""

    key: str
    name: str
    vendor: str
    segment: str
    arch: str
    compute_capability: tuple[int, int] | None  # NVIDIA only, e.g. (9, 0)
    aliases: tuple[str, ...]
    memory_bytes: int
    memory_type: str | None
    memory_bandwidth_gbps: float | None
    peak_tflops: PeakRates
    tdp_w: float | None
    interconnect: str | None  # card-to-card link kind, e.g. "NVLink 4" or "PCIe 4.0 x16"
    interconnect_gbps: float | None  # total bidirectional, as vendors quote it
    peer_link: bool  # a dedicated card-to-card link exists (NVLink, Infinity Fabric, ICI, ...)
    host_link: str | None
    node_gpus: int  # accelerators one server holds on the card-to-card link (8 on an HGX board, 1 for a laptop)
    sm_count: int | None  # streaming multiprocessors (AMD: compute units) of the whole row (MI250X: both dies)
    boost_clock_mhz: float | None  # the boost clock the datasheet peak rates assume
    base_clock_mhz: float | None
    l2_mib: float | None  # last-level on-chip cache in MiB (L2 on NVIDIA; Infinity Cache on MI300/MI355; see source)
    allreduce_busbw_gbps: float | None  # measured NCCL all_reduce_perf busbw of a full node, GB/s
    allreduce_source: str | None
    ecosystem: str  # one of ECOSYSTEMS: the stack PyTorch work runs on
    launch_year: int | None
    launch_price_usd: float | None  # list price at launch (in launch_year)
    cloud_usd_per_hour: float | None  # on-demand, per accelerator
    cloud_price_source: str | None
    cloud_price_date: str | None  # "YYYY-MM" the source states
    street_price_usd: float | None  # a dated retail price, new or used (the source says which)
    street_price_source: str | None
    street_price_date: str | None  # "YYYY-MM"
    estimated: tuple[str, ...]  # fields derived rather than read off a datasheet (see source)
    source: str

    @property
    def bf16(self) -> bool:
        """Whether the chip has bf16 matrix units (a catalog rate): none before Ampere, CDNA2, RDNA3. The one rule for
        a catalog row; a probed device asks ``hardware.detect.bf16_capable`` of its arch."""
        return bool(self.peak_tflops.get("bf16"))

    @property
    def fp8(self) -> bool:
        """Whether the chip has fp8 matrix units (a catalog rate): from Ada and Hopper, CDNA3 on."""
        return bool(self.peak_tflops.get("fp8"))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the dataclass fields, with the capability as "9.0"."""
        data = dataclasses.asdict(self)
        cc = self.compute_capability
        data["compute_capability"] = f"{cc[0]}.{cc[1]}" if cc else None
        data["aliases"] = list(self.aliases)
        data["estimated"] = list(self.estimated)
        return data


def _check_row(row: Mapping[str, Any]) -> None:
    """Raise ValueError naming the row, the field and the bad value; the fix is an edit of catalog.toml."""
    where = f"catalog row {row.get('key', '?')!r}"
    for field in _REQUIRED:
        if field not in row:
            raise ValueError(f"{where}: missing {field!r}")
    if unknown := set(row) - {*_REQUIRED, *_OPTIONAL}:
        close = {k: difflib.get_close_matches(k, [*_REQUIRED, *_OPTIONAL], n=1) for k in sorted(unknown)}
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}" + "".join(
            f"; did you mean {c[0]!r} for {k!r}?" for k, c in close.items() if c))
    if row["segment"] not in SEGMENTS:
        raise ValueError(f"{where}: segment {row['segment']!r} is not one of {SEGMENTS}")
    if row["vendor"] not in VENDORS:
        raise ValueError(f"{where}: vendor {row['vendor']!r} is not one of {VENDORS}")
    if row["ecosystem"] not in ECOSYSTEMS:
        raise ValueError(f"{where}: ecosystem {row['ecosystem']!r} is not one of {ECOSYSTEMS}")
    node_gpus = row["node_gpus"]
    if isinstance(node_gpus, bool) or not isinstance(node_gpus, int) or node_gpus < 1:
        raise ValueError(f"{where}: node_gpus {node_gpus!r} must be a whole number >= 1 (1 for a single device)")
    for field in _POSITIVE:
        value = row.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
            raise ValueError(f"{where}: {field} {value!r} must be a number > 0; leave the key out when unknown")
    for field, needs in _NEEDS.items():
        if field in row and (missing := [n for n in needs if not row.get(n)]):
            raise ValueError(f"{where}: {field} needs {missing}: every price and measurement says where and when")
        if field not in row and (orphans := [n for n in needs if n in row]):
            raise ValueError(f"{where}: {orphans} given without {field!r}")
    for field in ("cloud_price_date", "street_price_date"):
        if field in row and not (isinstance(row[field], str) and _MONTH.fullmatch(row[field])):
            raise ValueError(f"{where}: {field} {row[field]!r} is not a month 'YYYY-MM' (e.g. '2026-05')")
    rates = row.get("peak_tflops", {})
    if unknown := set(rates) - set(DTYPES):
        raise ValueError(f"{where}: unknown dtypes {sorted(unknown)} in peak_tflops")
    if "sm_count" in row and not isinstance(row["sm_count"], int):
        raise ValueError(f"{where}: sm_count {row['sm_count']!r} must be a whole number of SMs (AMD: compute units)")
    base, boost = row.get("base_clock_mhz"), row.get("boost_clock_mhz")
    if base is not None and boost is not None and base > boost:
        raise ValueError(f"{where}: base_clock_mhz {base} is above boost_clock_mhz {boost}; are they swapped?")
    if unknown := set(row.get("estimated", ())) - _ESTIMABLE:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)} in estimated")


def _row_to_accelerator(row: Mapping[str, Any]) -> Accelerator:
    _check_row(row)
    rates = row.get("peak_tflops", {})
    cc = row.get("compute_capability")
    return Accelerator(
        key=row["key"],
        name=row["name"],
        vendor=row["vendor"],
        segment=row["segment"],
        arch=row["arch"],
        compute_capability=tuple(int(p) for p in cc.split(".")) if cc else None,  # type: ignore[arg-type]
        aliases=tuple(row.get("aliases", ())),
        memory_bytes=round(row["memory_gib"] * GiB),
        memory_type=row.get("memory_type"),
        memory_bandwidth_gbps=row.get("memory_bandwidth_gbps"),
        peak_tflops=PeakRates(**{k: float(v) for k, v in rates.items()}),
        tdp_w=row.get("tdp_w"),
        interconnect=row.get("interconnect"),
        interconnect_gbps=row.get("interconnect_gbps"),
        peer_link=bool(row.get("peer_link", False)),
        host_link=row.get("host_link"),
        node_gpus=row["node_gpus"],
        sm_count=row.get("sm_count"),
        boost_clock_mhz=row.get("boost_clock_mhz"),
        base_clock_mhz=row.get("base_clock_mhz"),
        l2_mib=row.get("l2_mib"),
        allreduce_busbw_gbps=row.get("allreduce_busbw_gbps"),
        allreduce_source=row.get("allreduce_source"),
        ecosystem=row["ecosystem"],
        launch_year=row.get("launch_year"),
        launch_price_usd=row.get("launch_price_usd"),
        cloud_usd_per_hour=row.get("cloud_usd_per_hour"),
        cloud_price_source=row.get("cloud_price_source"),
        cloud_price_date=row.get("cloud_price_date"),
        street_price_usd=row.get("street_price_usd"),
        street_price_source=row.get("street_price_source"),
        street_price_date=row.get("street_price_date"),
        estimated=tuple(row.get("estimated", ())),
        source=row["source"],
    )


class Catalog:
    """The accelerators, with look-up by normalised name, key or alias.

    >>> load_catalog().get("4090").memory_bandwidth_gbps
    1008
    """

    def __init__(self, accelerators: tuple[Accelerator, ...]) -> None:
        self.accelerators = accelerators
        self._by_name: dict[str, Accelerator] = {}
        for acc in accelerators:
            for label in (acc.key, acc.name, *acc.aliases):
                norm = normalize_name(label)
                other = self._by_name.setdefault(norm, acc)
                if other is not acc:
                    raise ValueError(f"catalog name {label!r} of {acc.key!r} clashes with {other.key!r}")

    def __iter__(self) -> Iterator[Accelerator]:
        return iter(self.accelerators)

    def __len__(self) -> int:
        return len(self.accelerators)

    def find(self, name: str) -> Accelerator | None:
        """The row whose key, name or alias matches ``name`` once normalised, else None."""
        return self._by_name.get(normalize_name(name))

    def match_device(self, name: str, memory_bytes: int | None = None) -> Accelerator | None:
        """The row for a device as the driver names it, if its memory agrees with the row.

        Names are ambiguous across memory variants ("NVIDIA GeForce RTX 3060" is a 12 GB and an 8 GB
        card; torch names every Jetson "Orin"), so a device whose memory is not 90-102% of the
        row's is not that row. Apple chips come with several memory sizes under one name, and the
        row holds the largest: they are matched by name alone.
        """
        row = self.find(name)
        if row is None or memory_bytes is None or row.vendor == "Apple":
            return row
        return row if 0.90 * row.memory_bytes <= memory_bytes <= 1.02 * row.memory_bytes else None

    def get(self, name: str) -> Accelerator:
        """The row for ``name``; an unknown name raises an error that lists the closest names."""
        if found := self.find(name):
            return found
        raise GpuwiseError(f"unknown GPU {name!r}", hint=self._suggest(name))

    def variants(self, name: str) -> list[str]:
        """The keys of every row ``name`` could mean: ``"a100"`` -> a100-40gb-sxm, a100-80gb-sxm, a100-40gb-pcie
        (the rows whose key starts with it); one key, or none, when the name is not ambiguous."""
        norm = normalize_name(name)
        return [a.key for a in self.filter() if normalize_name(a.key).startswith(norm)]

    def _suggest(self, name: str) -> str:
        norm = normalize_name(name)
        # A model number the user typed ("a100" in "a100 pcie") picks its rows first, then spelling.
        models = re.findall(r"[a-z]{0,3}\d+", name.lower())
        close = [n for n in self._by_name if any(m in n for m in models)]
        close += difflib.get_close_matches(norm, list(self._by_name), n=8, cutoff=0.5)
        keys = list(dict.fromkeys(self._by_name[n].key for n in close))[:4]
        if not keys:
            return "run 'gpuwise gpus' to list the catalog"
        return f"closest: {', '.join(keys)}; run 'gpuwise gpus' to list the catalog"

    def filter(
        self,
        *,
        segment: str | None = None,
        vendor: str | None = None,
        min_memory_bytes: int | None = None,
    ) -> list[Accelerator]:
        """Rows matching every given filter, in catalog order."""
        if segment is not None:
            if segment.lower() not in SEGMENTS:
                raise GpuwiseError(f"unknown segment {segment!r}", hint=f"use one of {', '.join(SEGMENTS)}")
            segment = segment.lower()
        if vendor is not None:
            by_lower = {v.lower(): v for v in VENDORS}
            if vendor.lower() not in by_lower:
                raise GpuwiseError(f"unknown vendor {vendor!r}", hint=f"use one of {', '.join(VENDORS)}")
            vendor = by_lower[vendor.lower()]
        return [
            a
            for a in self.accelerators
            if (segment is None or a.segment == segment)
            and (vendor is None or a.vendor == vendor)
            and (min_memory_bytes is None or a.memory_bytes >= min_memory_bytes)
        ]


def parse_catalog(text: str) -> Catalog:
    """Build a catalog from TOML text (the schema of ``catalog.toml``)."""
    rows = tomllib.loads(text).get("accelerator", [])
    accelerators = tuple(_row_to_accelerator(row) for row in rows)
    keys = [a.key for a in accelerators]
    if dupes := {k for k in keys if keys.count(k) > 1}:
        raise ValueError(f"duplicate catalog keys: {sorted(dupes)}")
    return Catalog(accelerators)


@functools.cache
def load_catalog(path: Path | None = None) -> Catalog:
    """The catalog shipped with gpuwise, or one read from ``path``."""
    if path is None:
        text = resources.files("gpuwise.hardware").joinpath("catalog.toml").read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    return parse_catalog(text)
