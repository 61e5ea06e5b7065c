"""recommend/prices.py: the cloud snapshot (provider, on-demand and spot), the order rent is looked up in (the user's
quotes, the snapshot, the catalog), and scripts/prices_snapshot.py that makes the snapshot from SkyPilot's catalog."""

from __future__ import annotations

import csv
import importlib.util
import re
from importlib import resources
from pathlib import Path

import pytest

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import load_catalog
from gpuwise.recommend.prices import KINDS, Price, costs, offers, providers, read_prices, rent_price

ROOT = Path(__file__).resolve().parents[2]
EXCERPT = Path(__file__).parent / "data" / "skypilot-catalog"
CATALOG = load_catalog()
H100 = CATALOG.get("h100-sxm")
# the commits of the excerpt's files (data/skypilot-catalog/README.md)
COMMITS = {"lambda": "0f4070387edc953d7004cff197940e1918a1d6aa", "nebius": "0082b0435f3912ae4c566856b272455cc78f4f61",
           "hyperstack": "fdc9d908ab0b2af9f468f139fb3f662c8c6b3257"}


def _script():
    spec = importlib.util.spec_from_file_location("prices_snapshot", ROOT / "scripts" / "prices_snapshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows() -> list[dict[str, str]]:
    text = resources.files("gpuwise.recommend").joinpath("data", "cloud_prices.csv").read_text(encoding="utf-8")
    return list(csv.DictReader(text.splitlines()))


def test_the_snapshot_ships_small_and_every_row_is_a_catalog_gpu_with_its_source():
    path = resources.files("gpuwise.recommend").joinpath("data", "cloud_prices.csv")
    assert len(path.read_bytes()) < 50_000
    rows = _rows()
    assert providers() == ("hyperstack", "lambda", "nebius")
    for row in rows:
        assert CATALOG.get(row["gpu"]).key == row["gpu"]
        assert row["kind"] in KINDS and float(row["usd_per_gpu_hour"]) > 0 and int(row["instance_gpus"]) >= 1
        assert re.fullmatch(r"https://github.com/skypilot-org/skypilot-catalog/blob/[0-9a-f]{40}/catalogs/v8/"
                            + row["provider"] + "/vms.csv", row["source"])
        assert row["source"].split("/")[6] == COMMITS[row["provider"]] and re.fullmatch(r"\d{4}-\d{2}-\d{2}",
                                                                                         row["date"])


def test_the_script_remakes_the_committed_snapshot_from_the_catalog_excerpt(tmp_path):
    out = tmp_path / "cloud_prices.csv"
    args = [str(EXCERPT), "lambda", "nebius", "hyperstack", "--date", _rows()[0]["date"], "--out", str(out),
            *(f"--commit={p}={c}" for p, c in COMMITS.items())]
    assert _script().main(args) == 0
    shipped = resources.files("gpuwise.recommend").joinpath("data", "cloud_prices.csv").read_text(encoding="utf-8")
    assert out.read_text(encoding="utf-8") == shipped


def test_the_script_maps_only_names_that_fix_the_sku():
    script = _script()
    assert all(CATALOG.get(key).key == key for key in script.NAMES.values())
    assert script.key_of("lambda", "gpu_1x_h100_pcie", "H100") == "h100-pcie"  # Lambda's H100 is either board
    assert script.key_of("lambda", "gpu_8x_h100_sxm5", "H100") == "h100-sxm"
    assert script.key_of("lambda", "gpu_1x_a100", "A100") is None  # PCIe or SXM4: not stated
    assert script.key_of("lambda", "gpu_1x_a100_sxm4", "A100") == "a100-40gb-sxm"
    assert script.key_of("lambda", "gpu_8x_v100", "V100") is None  # 16 GB: not in the catalog


def test_spot_is_below_on_demand_for_the_same_provider_gpu_and_size():
    """True of every pair in the data (Nebius's H100 and H200); there must be some pairs to compare."""
    by = {(r["provider"], r["gpu"], r["instance_gpus"], r["kind"]): float(r["usd_per_gpu_hour"]) for r in _rows()}
    pairs = [(by[k], by[(*k[:3], "on-demand")]) for k in by if k[3] == "spot" and (*k[:3], "on-demand") in by]
    assert len(pairs) >= 4 and all(spot < demand for spot, demand in pairs)


def test_known_rows_cost_what_the_catalog_file_says():
    """Nebius's gpu-h100-sxm_1gpu: 2.95 $/h on demand, 1.25 spot; Hyperstack's n3-H100-SXM5x8: 19.2 $/h for 8."""
    one = offers(H100, gpus=1)
    assert [(o.provider, o.kind, o.usd) for o in one[:2]] == [("nebius", "spot", 1.25), ("nebius", "on-demand", 2.95)]
    assert all(o.instance_gpus == 1 for o in one)
    eight = costs(H100, gpus=8, throughput=1.0, hours=10.0, rent={}, buy={})
    assert eight.rent_usd_per_hour.provider == "hyperstack" and eight.rent_usd_per_hour.instance == "n3-H100-SXM5x8"
    assert eight.rent_usd == pytest.approx(19.2 / 8 * 8 * 10.0)
    single = costs(H100, gpus=1, throughput=1.0, hours=10.0, rent={}, buy={})
    assert single.rent_usd_per_hour.usd == 2.95 and single.rent_usd == pytest.approx(29.5)
    spot = costs(H100, gpus=1, throughput=1.0, hours=10.0, rent={}, buy={}, kind="spot")
    assert spot.rent_usd == pytest.approx(12.5) and spot.rent_usd_per_hour.kind == "spot"
    lam = rent_price(H100, {}, provider="lambda", gpus=2)
    assert (lam.usd, lam.instance, lam.region) == (pytest.approx(8.38 / 2), "gpu_2x_h100_sxm5", "europe-central-1")


def test_the_users_quote_wins_then_the_snapshot_then_the_catalog(tmp_path):
    f = tmp_path / "quotes.csv"
    f.write_text("gpu,rent_usd_per_hour,buy_usd\nh100,2.10,\n")
    rent, _ = read_prices(f)
    for kind in KINDS:
        assert rent_price(H100, rent, kind=kind) == Price(usd=2.10, source="your quote (quotes.csv)")
    l4 = CATALOG.get("l4")  # no snapshot offer: the catalog's hand-kept on-demand figure
    assert offers(l4) == ()
    assert rent_price(l4, {}) == Price(usd=l4.cloud_usd_per_hour, source=l4.cloud_price_source,
                                       date=l4.cloud_price_date, kind="on-demand")
    assert rent_price(l4, {}, kind="spot") is None and rent_price(l4, {}, provider="nebius") is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"provider": "awz"}, "--provider awz: no prices for it"),
    ({"kind": "preemptible"}, "rent kind 'preemptible' is not one of on-demand, spot"),
])
def test_an_unknown_provider_or_kind_is_one_line_naming_the_fix(kwargs, message):
    with pytest.raises(GpuwiseError, match=message) as caught:
        rent_price(H100, {}, **kwargs)
    assert "hyperstack, lambda, nebius" in caught.value.hint or "--spot" in caught.value.hint
