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
           "hyperstack": "fdc9d908ab0b2af9f468f139fb3f662c8c6b3257", "aws": "e385a0d348eda9cefd9806423e7725944dc249e4",
           "cudo": "113567a74b2f208af08e0c9236e26cc354a2bf65", "vast": "01b8cdda287814b30ff0acb49746cca19fbd4355",
           "verda": "000c1d0bf24621f4ac37cfa585f0897c1aa1d9cf"}


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
    assert providers() == ("aws", "cudo", "hyperstack", "lambda", "nebius", "vast", "verda")
    for row in rows:
        assert CATALOG.get(row["gpu"]).key == row["gpu"]
        assert row["kind"] in KINDS and float(row["usd_per_gpu_hour"]) > 0 and int(row["instance_gpus"]) >= 1
        assert re.fullmatch(r"https://github.com/skypilot-org/skypilot-catalog/blob/[0-9a-f]{40}/catalogs/v8/"
                            + row["provider"] + "/vms.csv", row["source"])
        assert row["source"].split("/")[6] == COMMITS[row["provider"]] and re.fullmatch(r"\d{4}-\d{2}-\d{2}",
                                                                                         row["date"])


def test_the_script_remakes_the_committed_snapshot_from_the_catalog_excerpt(tmp_path):
    out = tmp_path / "cloud_prices.csv"
    args = [str(EXCERPT), *COMMITS, "--date", _rows()[0]["date"], "--out", str(out),
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
    # Vast puts the board in the instance name under one accelerator name; its "A100" is 40 GB SXM4 or 80 GB PCIe
    assert script.key_of("vast", "1x-H100_NVL-32-65536", "H100") == "h100-nvl"
    assert script.key_of("vast", "1x-H100_SXM-32-65536", "H100") == "h100-sxm"
    assert script.key_of("vast", "1x-A100_PCIE-32-65536", "A100") is None
    assert script.key_of("vast", "1x-A100_SXM4-32-65536", "A100") is None
    assert script.key_of("cudo", "epyc-genoa-a100-pcie_1x2v4gb", "A100") is None  # PCIe, memory not named
    assert script.key_of("aws", "g6e.xlarge", "L40S") == "l40s" and script.key_of("aws", "g6.xlarge", "L4") == "l4"


def test_a_slice_of_a_gpu_and_a_free_spot_price_are_left_out(tmp_path):
    """AWS g6f.large holds an eighth of an L4 (AcceleratorCount 0.125); Vast's SpotPrice 0.00 is no offer."""
    root = tmp_path / "catalogs" / "v8" / "aws"
    root.mkdir(parents=True)
    (root / "vms.csv").write_text("InstanceType,AcceleratorName,AcceleratorCount,Price,SpotPrice,Region\n"
                                  "g6f.large,L4,0.125,0.29296,0.112400,ap-northeast-1\n"
                                  "g6.xlarge,L4,1.0,0.8048,0.00,us-east-1\n")
    found, unmapped = _script().offers("aws", root / "vms.csv")
    assert found == {("l4", "on-demand", 1): {"usd_per_gpu_hour": "0.8048", "instance": "g6.xlarge",
                                               "region": "us-east-1"}} and not unmapped


def test_a_region_with_commas_stays_one_cell():
    rows = [r for r in _rows() if r["provider"] == "vast" and r["instance"] == "1x-H100_SXM-32-65536"]
    assert [(r["region"], r["usd_per_gpu_hour"]) for r in rows] == [("Texas, US, NA", "1.87")]


def test_spot_is_below_on_demand_for_the_same_provider_gpu_and_size():
    """True of every pair in the data (Nebius's H100 and H200, AWS's L4 and L40S, Verda's); there must be pairs."""
    by = {(r["provider"], r["gpu"], r["instance_gpus"], r["kind"]): float(r["usd_per_gpu_hour"]) for r in _rows()}
    pairs = [(by[k], by[(*k[:3], "on-demand")]) for k in by if k[3] == "spot" and (*k[:3], "on-demand") in by]
    assert len(pairs) >= 4 and all(spot < demand for spot, demand in pairs)


def test_known_rows_cost_what_the_catalog_file_says():
    """One H100 SXM: Verda's 1H100.80S.32V 0.8015 $/h spot, Nebius's gpu-h100-sxm_1gpu 1.25 spot (2.95 on demand),
    Cudo's sapphire-rapids-h100_1x2v4gb 1.8214 on demand in no-kristiansand-1 (2.5354 in ca-montreal-3);
    Hyperstack's n3-H100-SXM5x8: 19.2 $/h for 8; AWS g6e.48xlarge: 30.13118 $/h for 8 L40S in us-east-1."""
    one = offers(H100, gpus=1)
    assert [(o.provider, o.kind, o.usd) for o in one[:3]] == [("verda", "spot", 0.8015), ("nebius", "spot", 1.25),
                                                              ("cudo", "on-demand", 1.8214)]
    assert all(o.instance_gpus == 1 for o in one)
    assert one[2].region == "no-kristiansand-1" and one[2].instance == "sapphire-rapids-h100_1x2v4gb"
    assert [o.usd for o in offers(H100, provider="nebius", gpus=1)] == [1.25, 2.95]
    hyper = rent_price(H100, {}, provider="hyperstack", gpus=8)
    assert (hyper.instance, hyper.usd) == ("n3-H100-SXM5x8", pytest.approx(19.2 / 8))
    single = costs(H100, gpus=1, throughput=1.0, hours=10.0, rent={}, buy={})
    assert single.rent_usd_per_hour.usd == 1.8214 and single.rent_usd == pytest.approx(18.214)
    spot = costs(H100, gpus=1, throughput=1.0, hours=10.0, rent={}, buy={}, kind="spot")
    assert spot.rent_usd == pytest.approx(8.015) and spot.rent_usd_per_hour.kind == "spot"
    l40s = [o for o in offers(CATALOG.get("l40s"), kind="on-demand", provider="aws") if o.instance_gpus == 8]
    assert [(o.usd, o.instance, o.region) for o in l40s] == [(pytest.approx(30.13118 / 8), "g6e.48xlarge",
                                                              "us-east-1")]
    assert rent_price(CATALOG.get("l40s"), {}, provider="aws", gpus=8).instance == "g6e.xlarge"  # 1.861 $/h for 1
    lam = rent_price(H100, {}, provider="lambda", gpus=2)
    assert (lam.usd, lam.instance, lam.region) == (pytest.approx(8.38 / 2), "gpu_2x_h100_sxm5", "europe-central-1")


def test_the_users_quote_wins_then_the_snapshot_then_the_catalog(tmp_path):
    f = tmp_path / "quotes.csv"
    f.write_text("gpu,rent_usd_per_hour,buy_usd\nh100,2.10,\n")
    rent, _ = read_prices(f)
    for kind in KINDS:
        assert rent_price(H100, rent, kind=kind) == Price(usd=2.10, source="your quote (quotes.csv)")
    a10g = CATALOG.get("a10g")  # no snapshot offer (AWS g5 is not in it): the catalog's hand-kept on-demand figure
    assert offers(a10g) == ()
    assert rent_price(a10g, {}) == Price(usd=a10g.cloud_usd_per_hour, source=a10g.cloud_price_source,
                                         date=a10g.cloud_price_date, kind="on-demand")
    assert rent_price(a10g, {}, kind="spot") is None and rent_price(a10g, {}, provider="nebius") is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"provider": "awz"}, "--provider awz: no prices for it"),
    ({"kind": "preemptible"}, "rent kind 'preemptible' is not one of on-demand, spot"),
])
def test_an_unknown_provider_or_kind_is_one_line_naming_the_fix(kwargs, message):
    with pytest.raises(GpuwiseError, match=message) as caught:
        rent_price(H100, {}, **kwargs)
    assert "aws, cudo, hyperstack, lambda, nebius, vast, verda" in caught.value.hint or "--spot" in caught.value.hint
