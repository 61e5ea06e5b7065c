"""The accelerator catalog: one sourced row per SKU, looked up by normalised name or alias.

The data lives in ``catalog.toml`` beside this file; every row carries the source of its figures.

Users extend it with their own TOML files in the same format, laid over the built-in rows in this order (a later
file wins): ``catalog.toml`` in the user config folder (``$XDG_CONFIG_HOME/gpuwise``, else platformdirs'
``user_config_dir("gpuwise")``: ``~/.config/gpuwise`` on Linux), then each file ``GPUWISE_CATALOG`` names (several
joined by ``os.pathsep``). Every command (plan, recommend, gpus, bench, doctor) sees them through ``load_catalog()``.

- A row with a new ``key`` adds a GPU. It needs the fields every built-in row has: key, name, vendor, segment, arch,
  memory_gib, ecosystem, node_gpus, source. A minimal one::

      [[accelerator]]
      key = "my-card"
      name = "Example Card 48GB"
      vendor = "NVIDIA"                 # one of VENDORS
      segment = "workstation"           # one of SEGMENTS
      arch = "Ada Lovelace (AD102)"     # family (die): the speed model reads both
      memory_gib = 48                   # the vendor's "GB" of device memory
      memory_bandwidth_gbps = 960
      peak_tflops = { fp32 = 91.1, bf16 = 181.0 }   # dense TFLOPS (int8 in TOPS)
      ecosystem = "cuda"                # one of ECOSYSTEMS
      node_gpus = 1
      source = "vendor datasheet https://example.com/card.pdf, 2026-05"

- A row with the ``key`` of an existing row changes only the fields it gives: ``peak_tflops`` per dtype, ``aliases``
  added to the row's own, ``source`` (optional) saying where the new figures come from; a price or measurement it
  sets brings its own source and date (``cloud_price_source``, ``cloud_price_date``). A field cannot be removed.
  ``[[accelerator]] key = "rtx-4090"  cloud_usd_per_hour = 0.59  cloud_price_source = "..."  cloud_price_date =
  "2026-07"`` re-prices the 4090.

Each row is checked with the built-in rows' schema; every problem in the user files comes back as one
``GpuwiseError`` naming the file, the row, the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
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
# The user's catalogs (see the module docstring): the config folder's file and this variable's files.
CATALOG_ENV = "GPUWISE_CATALOG"
USER_FILE = "catalog.toml"
_MONTH = re.compile(r"20\d\d-(0[1-9]|1[0-2])")  # "YYYY-MM", the month a price was seen
_CHOICES = {"segment": SEGMENTS, "vendor": VENDORS, "ecosystem": ECOSYSTEMS}


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


_STRINGS = ("key", "name", "vendor", "segment", "arch", "ecosystem", "source", "memory_type", "interconnect",
            "host_link", "allreduce_source", "cloud_price_source", "street_price_source")
_CC = re.compile(r"\d+\.\d+")  # "8.9"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _row_problems(row: Mapping[str, Any]) -> list[str]:
    """Every way ``row`` breaks the schema, one message each naming the field, the bad value and the fix."""
    if missing := [f for f in _REQUIRED if f not in row]:
        return [f"missing {f!r}" + (f" (one of {', '.join(_CHOICES[f])})" if f in _CHOICES else "") for f in missing]
    problems = []
    if unknown := set(row) - {*_REQUIRED, *_OPTIONAL}:
        close = {k: difflib.get_close_matches(k, [*_REQUIRED, *_OPTIONAL], n=1) for k in sorted(unknown)}
        problems.append(f"unknown keys {sorted(unknown)}" + "".join(
            f"; did you mean {c[0]!r} for {k!r}?" for k, c in close.items() if c))
    for field in _STRINGS:
        if field in row and not isinstance(row[field], str):
            problems.append(f"{field} {row[field]!r} must be a string in quotes")
    for field, choices in _CHOICES.items():
        if isinstance(row[field], str) and row[field] not in choices:
            problems.append(f"{field} {row[field]!r} is not one of {choices}")
    for field in ("aliases", "estimated"):
        if field in row and not (isinstance(row[field], list) and all(isinstance(v, str) for v in row[field])):
            problems.append(f"{field} {row[field]!r} must be a list of strings, e.g. [\"rtx 4090\"]")
    if "compute_capability" in row and not (isinstance(cc := row["compute_capability"], str) and _CC.fullmatch(cc)):
        problems.append(f"compute_capability {row['compute_capability']!r} must be a string like \"8.9\"")
    for field in ("peer_link",):
        if field in row and not isinstance(row[field], bool):
            problems.append(f"{field} {row[field]!r} must be true or false")
    if "launch_year" in row and not (isinstance(year := row["launch_year"], int) and 1990 < year < 2100):
        problems.append(f"launch_year {row['launch_year']!r} must be a year, e.g. 2025")
    node_gpus = row["node_gpus"]
    if isinstance(node_gpus, bool) or not isinstance(node_gpus, int) or node_gpus < 1:
        problems.append(f"node_gpus {node_gpus!r} must be a whole number >= 1 (1 for a single device)")
    for field in _POSITIVE:
        value = row.get(field)
        if value is not None and (not _is_number(value) or value <= 0):
            fix = "write it without quotes" if isinstance(value, str) else (
                "it is required" if field in _REQUIRED else "leave the key out when unknown")
            problems.append(f"{field} {value!r} must be a number > 0; {fix}")
    for field, needs in _NEEDS.items():
        if field in row and (missing := [n for n in needs if not row.get(n)]):
            problems.append(f"{field} needs {missing}: every price and measurement says where and when")
        if field not in row and (orphans := [n for n in needs if n in row]):
            problems.append(f"{orphans} given without {field!r}")
    for field in ("cloud_price_date", "street_price_date"):
        if field in row and not (isinstance(row[field], str) and _MONTH.fullmatch(row[field])):
            problems.append(f"{field} {row[field]!r} is not a month 'YYYY-MM' (e.g. '2026-05')")
    rates = row.get("peak_tflops", {})
    if not isinstance(rates, Mapping):
        problems.append(f"peak_tflops {rates!r} must be a table, e.g. {{ bf16 = 165.2, fp32 = 82.6 }}")
    else:
        if unknown := set(rates) - set(DTYPES):
            problems.append(f"unknown dtypes {sorted(unknown)} in peak_tflops (use {', '.join(DTYPES)})")
        for dtype, value in rates.items():
            if dtype in DTYPES and (not _is_number(value) or value <= 0):
                problems.append(f"peak_tflops.{dtype} {value!r} must be a number > 0 (dense TFLOPS; int8 in TOPS); "
                                "leave the dtype out when unknown")
    if "sm_count" in row and not isinstance(row["sm_count"], int):
        problems.append(f"sm_count {row['sm_count']!r} must be a whole number of SMs (AMD: compute units)")
    base, boost = row.get("base_clock_mhz"), row.get("boost_clock_mhz")
    if _is_number(base) and _is_number(boost) and base > boost:
        problems.append(f"base_clock_mhz {base} is above boost_clock_mhz {boost}; are they swapped?")
    if isinstance(row.get("estimated"), list) and (unknown := set(row["estimated"]) - _ESTIMABLE):
        problems.append(f"unknown fields {sorted(unknown)} in estimated (use {', '.join(sorted(_ESTIMABLE))})")
    return problems


def _check_row(row: Mapping[str, Any]) -> None:
    """Raise ValueError naming the row, the field and the bad value; the fix is an edit of catalog.toml."""
    if problems := _row_problems(row):
        raise ValueError(f"catalog row {row.get('key', '?')!r}: {problems[0]}")


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
    return _catalog_of(tomllib.loads(text).get("accelerator", []))


def _catalog_of(rows: Iterable[Mapping[str, Any]]) -> Catalog:
    accelerators = tuple(_row_to_accelerator(row) for row in rows)
    keys = [a.key for a in accelerators]
    if dupes := {k for k in keys if keys.count(k) > 1}:
        raise ValueError(f"duplicate catalog keys: {sorted(dupes)}")
    return Catalog(accelerators)


def user_catalog_files(environ: Mapping[str, str]) -> tuple[Path, ...]:
    """The user catalogs laid over the built-in rows, in the order they apply (a later file wins): the config folder's
    ``catalog.toml`` when it exists, then each file ``GPUWISE_CATALOG`` names (``os.pathsep``-separated).

    >>> user_catalog_files({"GPUWISE_CATALOG": "", "XDG_CONFIG_HOME": "/nowhere"})
    ()
    """
    if config := environ.get("XDG_CONFIG_HOME"):
        folder = Path(config) / "gpuwise"
    else:
        import platformdirs

        folder = Path(platformdirs.user_config_dir("gpuwise"))
    found = [folder / USER_FILE] if (folder / USER_FILE).is_file() else []
    for entry in environ.get(CATALOG_ENV, "").split(os.pathsep):
        if not entry.strip():
            continue
        path = Path(entry).expanduser()
        if not path.is_file():
            raise GpuwiseError(f"{CATALOG_ENV} names {entry}, which is not a file",
                               f"fix the path, or unset {CATALOG_ENV}")
        found.append(path)
    return tuple(found)


def load_catalog(path: Path | None = None, *, environ: Mapping[str, str] = os.environ) -> Catalog:
    """The catalog shipped with gpuwise with the user's catalogs (``user_catalog_files(environ)``) laid over it; with
    ``path``, the rows of that file alone."""
    if path is not None:
        return _file_catalog(*_stamp(Path(path)))
    return _merged_catalog(tuple(_stamp(p) for p in user_catalog_files(environ)))


def _stamp(path: Path) -> tuple[Path, int, int]:
    """A file with its modification time and size: the cache key, so an edited file is read again."""
    try:
        stat = path.stat()
    except OSError:  # the read that follows names the problem
        return path, -1, -1
    return path, stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=8)
def _file_catalog(path: Path, _mtime_ns: int, _size: int) -> Catalog:
    return parse_catalog(path.read_text(encoding="utf-8"))


@functools.cache
def _builtin_rows() -> tuple[Mapping[str, Any], ...]:
    text = resources.files("gpuwise.hardware").joinpath("catalog.toml").read_text(encoding="utf-8")
    return tuple(tomllib.loads(text).get("accelerator", []))


@functools.lru_cache(maxsize=8)
def _merged_catalog(stamps: tuple[tuple[Path, int, int], ...]) -> Catalog:
    """The built-in rows with each user file laid over them in turn; every problem in the user files as one error."""
    rows: dict[str, Mapping[str, Any]] = {row["key"]: row for row in _builtin_rows()}
    origin: dict[str, Path] = {}  # the user file that last set a row
    problems: list[str] = []
    for path, _, _ in stamps:
        user_rows, file_problems = _read_user_file(path)
        problems += file_problems
        names = {normalize_name(label): key for key, row in rows.items()
                 for label in (key, row.get("name", ""), *row.get("aliases", ())) if isinstance(label, str)}
        seen: set[str] = set()
        for number, user_row in enumerate(user_rows, 1):
            key = user_row.get("key")
            if not isinstance(key, str) or not key.strip():
                problems.append(f"{path}: row {number}: missing 'key' (a short id such as \"rtx-4090\")")
                continue
            where = f"{path}: row {key!r}"
            if key in seen:
                problems.append(f"{where}: the key is given twice in this file; merge the two rows")
                continue
            seen.add(key)
            if key in rows:
                row, found = _overlay(rows[key], user_row, path), _provenance_problems(user_row)
            elif (other := names.get(normalize_name(key))) is not None:
                problems.append(f"{where}: {key!r} already names row {other!r}; write key = \"{other}\" to change "
                                "that row, or pick another key to add a GPU")
                continue
            else:
                row, found = dict(user_row), []
                if isinstance(row.get("source"), str):
                    row["source"] = f"user catalog {path}: {row['source']}"
            found += _row_problems(row)
            problems += [f"{where}: {p}" for p in found]
            if not found:
                rows[key], origin[key] = row, path
    if not problems:
        try:
            return _catalog_of(rows.values())
        except ValueError as exc:  # two rows answer to one name
            files = sorted({str(p) for k, p in origin.items() if repr(k) in str(exc)})
            problems.append(f"{', '.join(files) or 'user catalog'}: {exc}; drop or rename the alias")
    raise GpuwiseError(f"bad user catalog: {'; '.join(problems)}",
                       "fix each row as said (the format: python -c 'help(\"gpuwise.hardware.catalog\")'), "
                       f"or unset {CATALOG_ENV}")


def _read_user_file(path: Path) -> tuple[list[Mapping[str, Any]], list[str]]:
    """The ``[[accelerator]]`` tables of a user catalog, and what keeps it from being read."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        return [], [f"{path}: cannot be read ({exc.strerror or exc})"]
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        return [], [f"{path}: not valid TOML ({exc})"]
    problems = []
    if unknown := sorted(set(data) - {"accelerator"}):
        problems.append(f"{path}: unknown top-level keys {unknown}; each GPU is an [[accelerator]] table")
    rows = data.get("accelerator", [])
    if not (isinstance(rows, list) and all(isinstance(r, dict) for r in rows)):
        return [], [*problems, f"{path}: 'accelerator' must be [[accelerator]] tables, one per GPU"]
    return rows, problems


def _overlay(base: Mapping[str, Any], user: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """``base`` with the fields ``user`` gives replaced: peak_tflops per dtype, aliases added to the built-in ones, the
    estimates ``user`` makes in ``estimated`` (a figure it sets is no longer the built-in estimate)."""
    row = {**base, **user}
    rates = user.get("peak_tflops")
    if isinstance(rates, Mapping):
        row["peak_tflops"] = {**base.get("peak_tflops", {}), **rates}
    if isinstance(user.get("aliases"), list):
        row["aliases"] = list(dict.fromkeys([*base.get("aliases", ()), *user["aliases"]]))
    set_fields = [f for f in user if f not in ("key", "source", "aliases", "estimated", "peak_tflops")]
    set_fields += list(rates) if isinstance(rates, Mapping) else []
    estimated = user.get("estimated", [])
    if isinstance(estimated, list):
        row["estimated"] = [f for f in base.get("estimated", ()) if f not in set_fields] + estimated
    if row.get("estimated") == []:
        del row["estimated"]
    note = user.get("source", "no source given")
    if isinstance(note, str):
        changed = ", ".join(set_fields) or "aliases"
        row["source"] = f"user catalog {path} sets {changed}: {note}. Built-in: {base['source']}"
    return row


def _provenance_problems(user: Mapping[str, Any]) -> list[str]:
    """A price or measurement a user row changes comes with its own source and date, not the built-in row's."""
    return [f"{field} needs {missing} in the same row: every price and measurement says where and when"
            for field, needs in _NEEDS.items() if field in user and (missing := [n for n in needs if not user.get(n)])]
