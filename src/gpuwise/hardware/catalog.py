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
VENDORS = ("NVIDIA", "AMD", "Intel", "Huawei", "Google", "Apple")
# Words that carry no identity in a device name: "NVIDIA GeForce RTX 4090" and "rtx 4090" are one card.
_NOISE_WORDS = frozenset({"nvidia", "geforce", "amd", "radeon", "instinct", "intel", "google", "apple",
                          "huawei", "tesla"})
_ESTIMABLE = frozenset({"memory_gib", "memory_bandwidth_gbps", "tdp_w", "launch_price_usd", *DTYPES})


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
    launch_year: int | None
    launch_price_usd: float | None
    cloud_usd_per_hour: float | None
    cloud_price_source: str | None
    estimated: tuple[str, ...]  # fields derived rather than read off a datasheet (see source)
    source: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the dataclass fields, with the capability as "9.0"."""
        data = dataclasses.asdict(self)
        cc = self.compute_capability
        data["compute_capability"] = f"{cc[0]}.{cc[1]}" if cc else None
        data["aliases"] = list(self.aliases)
        data["estimated"] = list(self.estimated)
        return data


def _row_to_accelerator(row: Mapping[str, Any]) -> Accelerator:
    where = f"catalog row {row.get('key', '?')!r}"
    for field in ("key", "name", "vendor", "segment", "arch", "memory_gib", "source"):
        if field not in row:
            raise ValueError(f"{where}: missing {field!r}")
    if row["segment"] not in SEGMENTS:
        raise ValueError(f"{where}: segment {row['segment']!r} is not one of {SEGMENTS}")
    if row["vendor"] not in VENDORS:
        raise ValueError(f"{where}: vendor {row['vendor']!r} is not one of {VENDORS}")
    rates = row.get("peak_tflops", {})
    if unknown := set(rates) - set(DTYPES):
        raise ValueError(f"{where}: unknown dtypes {sorted(unknown)} in peak_tflops")
    if unknown := set(row.get("estimated", ())) - _ESTIMABLE:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)} in estimated")
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
        launch_year=row.get("launch_year"),
        launch_price_usd=row.get("launch_price_usd"),
        cloud_usd_per_hour=row.get("cloud_usd_per_hour"),
        cloud_price_source=row.get("cloud_price_source"),
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
