"""What a row costs: the rent or purchase price of its GPUs, the rent for the job, and the energy at board power.

Rent comes from the user's quotes (``--prices``) first, then the cloud snapshot (``data/cloud_prices.csv``: per
provider, kind and instance size, the cheapest USD per GPU-hour in SkyPilot's catalog, made by
``scripts/prices_snapshot.py``), then the catalog's hand-kept figure; purchase from the quotes, then the catalog.

>>> costs(acc, gpus=8, throughput=1e5, hours=1.0, rent={}, buy={}).energy_kwh            # doctest: +SKIP
5.6
>>> [(p.provider, p.kind, p.usd) for p in offers(catalog.find("h100"), gpus=1)][:2]    # doctest: +SKIP
[('verda', 'spot', 0.8015), ('nebius', 'spot', 1.25)]
"""

from __future__ import annotations

import csv
import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import Accelerator, Catalog, load_catalog

KINDS = ("on-demand", "spot")  # how a GPU is rented: at list price, or spare capacity the provider may take back


@dataclass(frozen=True, kw_only=True)
class Price:
    """USD per GPU-hour (rent) or per GPU (purchase), and where it comes from."""

    usd: float
    source: str
    date: str | None = None
    provider: str | None = None  # the cloud of a snapshot offer (aws, lambda, nebius...); None: a quote or the catalog
    kind: str | None = None  # rent only: "on-demand" or "spot"; None where the quote does not say
    instance: str | None = None  # the instance type the offer is for (a snapshot offer only)
    region: str | None = None  # its cheapest region (a snapshot offer only)
    instance_gpus: int | None = None  # GPUs in that instance: the smallest number one can rent at this price


@dataclass(frozen=True, kw_only=True)
class Costs:
    """The money and energy of ``gpus`` GPUs running for a job (``seconds``; None: no goal, so no job figures)."""

    rent_usd_per_hour: Price | None  # per GPU
    rent_usd: float | None  # the whole job
    buy_usd: float | None  # every GPU
    buy_price: Price | None
    energy_kwh: float | None  # at board power (TDP): an upper bound
    per_joule: float | None  # tokens (or samples) per joule at board power

    def figures(self) -> dict[str, Any]:
        """The cost figures by name, shallow (a Price stays a Price): what an Option takes from them."""
        return {f.name: getattr(self, f.name) for f in fields(Costs)}


# -- cloud offers ---------------------------------------------------------------------------------------------

SNAPSHOT = "cloud_prices.csv"  # in gpuwise/recommend/data, written by scripts/prices_snapshot.py


@functools.cache
def _snapshot() -> tuple[tuple[str, Price], ...]:
    """Every row of the shipped snapshot: (catalog key, offer)."""
    text = resources.files("gpuwise.recommend").joinpath("data", SNAPSHOT).read_text(encoding="utf-8")
    return tuple((row["gpu"], Price(usd=float(row["usd_per_gpu_hour"]), source=row["source"], date=row["date"] or None,
                                    provider=row["provider"], kind=row["kind"], instance=row["instance"] or None,
                                    region=row["region"] or None, instance_gpus=int(row["instance_gpus"])))
                 for row in csv.DictReader(text.splitlines()))


def providers() -> tuple[str, ...]:
    """The clouds the snapshot has offers from, sorted."""
    return tuple(sorted({o.provider for _, o in _snapshot() if o.provider}))


def offers(acc: Accelerator, *, kind: str | None = None, provider: str | None = None,
           gpus: int | None = None) -> tuple[Price, ...]:
    """Every snapshot offer for ``acc`` (USD per GPU-hour), cheapest first: of one ``kind`` and ``provider`` when
    given (None: all), and in instances of at most ``gpus`` GPUs when given. An unknown kind or provider is an error
    naming the flag and the valid values."""
    check_offer_filter(kind=kind, provider=provider)
    found = [o for gpu, o in _snapshot() if gpu == acc.key and kind in (None, o.kind)
             and provider in (None, o.provider) and (gpus is None or (o.instance_gpus or 1) <= gpus)]
    return tuple(sorted(found, key=lambda o: (o.usd, o.provider or "", o.kind or "", o.instance_gpus or 0)))


def check_offer_filter(*, kind: str | None = None, provider: str | None = None) -> None:
    """A GpuwiseError for a kind other than KINDS or a provider the snapshot lacks (``--spot``, ``--provider``)."""
    if kind is not None and kind not in KINDS:
        raise GpuwiseError(f"rent kind {kind!r} is not one of {', '.join(KINDS)}", "rent on-demand, or pass --spot")
    if provider is not None and provider not in providers():
        raise GpuwiseError(f"--provider {provider}: no prices for it in the snapshot",
                           f"use one of {', '.join(providers())}, or give your own with --prices")


def rent_price(acc: Accelerator, quotes: Mapping[str, Price], *, kind: str = "on-demand",
               provider: str | None = None, gpus: int | None = None) -> Price | None:
    """USD per GPU-hour: the user's quote, else the cheapest of the snapshot's offers of that ``kind`` (from
    ``provider`` when given; in an instance of at most ``gpus`` GPUs when given) and, on-demand from any provider,
    the catalog's dated market price (the snapshot holds a few clouds; the catalog's figure may be a cheaper one's);
    None if none."""
    if acc.key in quotes:
        return quotes[acc.key]
    found = list(offers(acc, kind=kind, provider=provider, gpus=gpus))
    if acc.cloud_usd_per_hour and kind == "on-demand" and provider is None:
        found.append(Price(usd=acc.cloud_usd_per_hour, source=acc.cloud_price_source or "catalog",
                           date=acc.cloud_price_date, kind="on-demand"))
    return min(found, key=lambda p: p.usd) if found else None


def buy_price(acc: Accelerator, quotes: Mapping[str, Price]) -> Price | None:
    """USD per GPU: the user's quote, else the street price, else the launch price."""
    if acc.key in quotes:
        return quotes[acc.key]
    if acc.street_price_usd:
        return Price(usd=acc.street_price_usd, source=acc.street_price_source or "catalog",
                     date=acc.street_price_date)
    if acc.launch_price_usd:
        return Price(usd=acc.launch_price_usd, source="launch price",
                     date=str(acc.launch_year) if acc.launch_year else None)
    return None


def costs(acc: Accelerator, *, gpus: int, throughput: float, hours: float | None, rent: Mapping[str, Price],
          buy: Mapping[str, Price], kind: str = "on-demand", provider: str | None = None) -> Costs:
    """``gpus`` of ``acc`` doing ``throughput`` units a second (over all of them) for ``hours`` (None: no goal),
    renting ``kind`` (on-demand, spot) from ``provider`` (None: the cheapest)."""
    per_hour, price = rent_price(acc, rent, kind=kind, provider=provider, gpus=gpus), buy_price(acc, buy)
    watts = acc.tdp_w * gpus if acc.tdp_w else None
    return Costs(rent_usd_per_hour=per_hour,
                 rent_usd=None if per_hour is None or hours is None else per_hour.usd * gpus * hours,
                 buy_usd=None if price is None else price.usd * gpus, buy_price=price,
                 energy_kwh=None if watts is None or hours is None else watts * hours / 1000,
                 per_joule=None if watts is None else throughput / watts)


# -- the user's prices ---------------------------------------------------------------------------------------

_DATE = re.compile(r"^\d{4}(-\d{2}){0,2}$")


def read_prices(path: str | Path, catalog: Catalog | None = None) -> tuple[dict[str, Price], dict[str, Price]]:
    """A CSV of the user's quotes: a header ``gpu,rent_usd_per_hour,buy_usd[,date]`` (either price may be empty),
    one row per GPU (any name the catalog knows). Returns (rent, buy) keyed by catalog key."""
    catalog = catalog or load_catalog()
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # Excel's "CSV UTF-8" starts with a byte-order mark
        rows = list(csv.reader(text.splitlines()))
    except OSError as exc:
        raise GpuwiseError(f"--prices {path}: {exc.strerror or exc}", "pass a readable CSV file") from exc
    except (UnicodeDecodeError, csv.Error) as exc:
        raise GpuwiseError(f"--prices {path} is not a text CSV file ({type(exc).__name__})",
                           "save it as CSV (UTF-8): gpu,rent_usd_per_hour,buy_usd[,date]") from exc
    header = [h.strip().lower() for h in rows[0]] if rows else []
    if not header or header[0] != "gpu" or not {"rent_usd_per_hour", "buy_usd"} & set(header):
        raise GpuwiseError(f"--prices {path}: the first line must be gpu,rent_usd_per_hour,buy_usd[,date]",
                           "write the header, then one GPU per line, e.g. rtx-4090,0.69,1599,2026-11")
    rent: dict[str, Price] = {}
    buy: dict[str, Price] = {}
    for line, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue
        if len([c for c in row if c.strip()]) > len(header):
            raise GpuwiseError(f"--prices {path} line {line}: {len(row)} cells for the header's {len(header)} "
                               f"columns ({','.join(row)}): a decimal comma?",
                               "write prices with a decimal point (1.99), or quote them (\"1,99\")")
        cells = dict(zip(header, (cell.strip() for cell in row), strict=False))
        acc = catalog.find(cells.get("gpu", ""))
        if acc is None:
            raise GpuwiseError(f"--prices {path} line {line}: unknown GPU {cells.get('gpu', '')!r}",
                               "use a name from 'gpuwise gpus'")
        date = cells.get("date") or None
        if date is not None and not _DATE.match(date):
            raise GpuwiseError(f"--prices {path} line {line}: date {date!r} is not YYYY-MM-DD",
                               "write the date the quote was given, e.g. 2026-11-30")
        for column, into in (("rent_usd_per_hour", rent), ("buy_usd", buy)):
            value = cells.get(column, "")
            if not value:
                continue
            try:
                usd = float(value)
            except ValueError:
                usd = math.nan
            if not (math.isfinite(usd) and usd > 0):
                raise GpuwiseError(f"--prices {path} line {line}: {column} {value!r} is not a positive number",
                                   "write plain dollars, e.g. 1.99")
            into[acc.key] = Price(usd=usd, source=f"your quote ({p.name})", date=date)
        if acc.key in rent and acc.key in buy and buy[acc.key].usd < MIN_BUY_RENT_HOURS * rent[acc.key].usd:
            r, b = rent[acc.key].usd, buy[acc.key].usd
            raise GpuwiseError(f"--prices {path} line {line}: buying {acc.key} for ${b:g} costs less than "
                               f"{MIN_BUY_RENT_HOURS} hours of its rent (${r:g}/h): a decimal comma split the rent "
                               f"({r:g},{b:g})?", "write prices with a decimal point (1.99), or quote them (\"1,99\")")
    return rent, buy


# A purchase price under this many hours of the same GPU's rent is not a price anyone quotes (cloud rent recovers a
# GPU's price in ~1-2 years of use: 9,000-18,000 hours); it is what "h100,2,99" gives when 2,99 meant 2.99 an hour.
MIN_BUY_RENT_HOURS = 100
