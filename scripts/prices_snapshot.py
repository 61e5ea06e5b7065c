"""Reduce SkyPilot's cloud catalog to ``src/gpuwise/recommend/data/cloud_prices.csv``: per provider, GPU, kind
(on-demand, spot) and GPUs per instance, the cheapest USD per GPU-hour over every region.

    git clone https://github.com/skypilot-org/skypilot-catalog /tmp/skypilot-catalog
    python scripts/prices_snapshot.py /tmp/skypilot-catalog --commit $(git -C /tmp/skypilot-catalog rev-parse HEAD) \
        --date 2026-12-04 lambda nebius hyperstack
    python scripts/prices_snapshot.py ... --check     # change nothing; exit 1 if the committed CSV differs

The committed snapshot was made from the excerpt in tests/recommend/data/skypilot-catalog (its README names the
commit of each file; one ``--commit provider=SHA`` per provider then):

    python scripts/prices_snapshot.py tests/recommend/data/skypilot-catalog --date 2026-12-04 \
        --commit lambda=0f4070387edc953d7004cff197940e1918a1d6aa \
        --commit nebius=0082b0435f3912ae4c566856b272455cc78f4f61 \
        --commit hyperstack=fdc9d908ab0b2af9f468f139fb3f662c8c6b3257 \
        --commit aws=e385a0d348eda9cefd9806423e7725944dc249e4 \
        --commit cudo=113567a74b2f208af08e0c9236e26cc354a2bf65 \
        --commit vast=01b8cdda287814b30ff0acb49746cca19fbd4355 \
        --commit verda=000c1d0bf24621f4ac37cfa585f0897c1aa1d9cf \
        lambda nebius hyperstack aws cudo vast verda

Each ``catalogs/v8/<provider>/vms.csv`` has (in any order) the columns InstanceType, AcceleratorName,
AcceleratorCount, Price, SpotPrice and Region; Price and SpotPrice are USD per hour for the whole instance, so a
GPU-hour is ``Price / AcceleratorCount``. Instance sizes stay apart (a one-GPU job cannot rent an eighth of an
8-GPU machine); within one, the cheapest region, not the median, is kept: a renter picks the region and size
they can use, and the cheapest offer is the one a recommendation should beat. Rows without a GPU, with a fraction of
one (AWS g6f: a quarter of an L4), with a price of 0 or none, or with an accelerator name not in NAMES (listed at the
end, "unmapped") are left out. Cells holding commas (Vast's regions: "Texas, US, NA") are quoted in the output.

GCP's file prices its GPUs in rows of their own (no InstanceType) apart from the host VM (a2/a3/g2 rows carry no
AcceleratorName); this script reads such a GPU row as the GPU's whole price, so it leaves the host out.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "src" / "gpuwise" / "recommend" / "data" / "cloud_prices.csv"
COLUMNS = ("provider", "gpu", "kind", "instance_gpus", "usd_per_gpu_hour", "instance", "region", "source", "date")
REPO = "https://github.com/skypilot-org/skypilot-catalog"

# SkyPilot's accelerator name -> gpuwise catalog key, only where the name fixes the SKU (memory and form factor).
# SkyPilot's own names: "A100" is the 40 GB SXM4 board (AWS p4d, GCP a2-highgpu), "A100-80GB" the 80 GB SXM4
# (p4de, a2-ultragpu), "H100" the SXM5 board (p5, a3, Nebius gpu-h100-sxm), with the exceptions in INSTANCES.
NAMES = {
    "A100": "a100-40gb-sxm",
    "A100-80GB": "a100-80gb-sxm",
    "A100-80G-PCIe": "a100-80gb-pcie",  # Hyperstack
    "A100-80G-PCIe-NVLink": "a100-80gb-pcie",  # PCIe cards joined by NVLink bridges
    "H100": "h100-sxm",
    "H100-SXM": "h100-sxm",  # Cudo
    "H100-80G-SXM5": "h100-sxm",
    "H100-80G-PCIe": "h100-pcie",
    "H100-80G-PCIe-NVLink": "h100-pcie",
    "H200": "h200",
    "B200": "b200",
    "L4": "l4",
    "L40": "l40",
    "L40S": "l40s",
    "A40": "a40",
    "T4": "t4",
    "A10": "a10",
    "A10G": "a10g",
    "A6000": "rtx-a6000",  # Lambda
    "RTX-A6000": "rtx-a6000",  # Hyperstack
    "RTXA6000": "rtx-a6000",
    "RTX-6000-Ada": "rtx-6000-ada",  # Verda
    "RTX6000-Ada": "rtx-6000-ada",  # Vast
    "RTX5090": "rtx-5090",
    "RTX4090": "rtx-4090",
    "RTX3090": "rtx-3090",
    "RTX3070": "rtx-3070",  # 8 GB only
    "MI300X": "mi300x",
}

# Instances whose name says more than the accelerator name: (provider, pattern on InstanceType) -> key, or None to
# leave the row out because its form factor is not stated.
INSTANCES: tuple[tuple[str, re.Pattern[str], str | None], ...] = (
    ("lambda", re.compile(r"_h100_pcie$"), "h100-pcie"),
    # gpu_1x_a100 is a PCIe board and gpu_{2,4,8}x_a100 do not say; gpu_1x_a100_sxm4 says SXM4
    ("lambda", re.compile(r"^gpu_\d+x_a100$"), None),
    # Cudo's "A100" is a PCIe board (epyc-genoa-a100-pcie_*, intel-ice-lake-a100-pci_*) whose memory the name omits
    ("cudo", re.compile(r"-a100-pci"), None),
    # Vast names the board in the instance: H100_SXM, H100_NVL, H100_PCIE under one AcceleratorName "H100"; its
    # "A100" covers 40 GB SXM4 and 80 GB PCIe cards alike, and the memory is not in the name
    ("vast", re.compile(r"-H100_SXM-"), "h100-sxm"),
    ("vast", re.compile(r"-H100_NVL-"), "h100-nvl"),
    ("vast", re.compile(r"-H100_PCIE-"), "h100-pcie"),
    ("vast", re.compile(r"-A100_"), None),
    ("vast", re.compile(r"_NVL-"), None),  # H200 NVL: not the SXM H200 of the catalog
)


def key_of(provider: str, instance: str, accelerator: str) -> str | None:
    """The catalog key of one row's GPU, or None when unmapped."""
    for who, pattern, key in INSTANCES:
        if who == provider and pattern.search(instance):
            return key
    return NAMES.get(accelerator)


def _usd(cell: str | None) -> float | None:
    try:
        value = float(cell) if cell else None
    except ValueError:
        return None
    return value if value is not None and value > 0 else None


def offers(provider: str, path: Path) -> tuple[dict[tuple[str, str, int], dict[str, str]], Counter[str]]:
    """The cheapest row per (catalog key, kind, GPUs per instance) in one provider's vms.csv (ties: the first in the
    file), and the accelerator names that map to no key with their row counts."""
    best: dict[tuple[str, str, int], tuple[float, dict[str, str]]] = {}
    unmapped: Counter[str] = Counter()
    with path.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            name = (row.get("AcceleratorName") or "").strip()
            count = _usd(row.get("AcceleratorCount"))
            if not name or count is None or count < 1:  # no GPU, or a slice of one (AWS g6f)
                continue
            instance = (row.get("InstanceType") or "").strip()
            key = key_of(provider, instance, name)
            if key is None:
                unmapped[name] += 1
                continue
            for kind, column in (("on-demand", "Price"), ("spot", "SpotPrice")):
                usd = _usd(row.get(column))
                if usd is None:
                    continue
                per_gpu, at = usd / count, (key, kind, round(count))
                if at not in best or per_gpu < best[at][0]:
                    best[at] = (per_gpu, {"instance": instance, "region": (row.get("Region") or "").strip()})
    return {k: {"usd_per_gpu_hour": f"{v[0]:.6g}", **v[1]} for k, v in best.items()}, unmapped


def snapshot(root: Path, providers: list[str], commits: dict[str, str], date: str) -> tuple[list[dict[str, str]],
                                                                                              dict[str, Counter[str]]]:
    """The snapshot's rows, sorted by provider, GPU and kind, and each provider's unmapped names."""
    rows, unmapped = [], {}
    for provider in providers:
        rel = f"catalogs/v8/{provider}/vms.csv"
        found, unmapped[provider] = offers(provider, root / rel)
        source = f"{REPO}/blob/{commits[provider]}/{rel}"
        for (gpu, kind, n), cells in sorted(found.items()):
            rows.append({"provider": provider, "gpu": gpu, "kind": kind, "instance_gpus": str(n), **cells,
                         "source": source, "date": date})
    return rows, unmapped


def render(rows: list[dict[str, str]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")  # quotes only cells that need it (a comma in a region)
    writer.writerow(COLUMNS)
    writer.writerows([row[c] for c in COLUMNS] for row in rows)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("catalog", type=Path, help="a local copy of skypilot-catalog (the folder holding catalogs/)")
    p.add_argument("providers", nargs="+", help="folders under catalogs/v8, e.g. aws gcp lambda nebius")
    p.add_argument("--commit", action="append", default=[], required=True,
                   help="the copy's commit (SHA), or provider=SHA for one provider's file")
    p.add_argument("--date", required=True, help="the day the copy was taken, YYYY-MM-DD")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if --out differs")
    args = p.parse_args(argv)
    commits = {k: v for k, _, v in (c.partition("=") for c in args.commit if "=" in c)}
    default = next((c for c in args.commit if "=" not in c), None)
    missing = [pr for pr in args.providers if pr not in commits and default is None]
    if missing:
        p.error(f"no --commit for {', '.join(missing)}")
    commits = {pr: commits.get(pr, default or "") for pr in args.providers}
    rows, unmapped = snapshot(args.catalog, args.providers, commits, args.date)
    text = render(rows)
    for provider, names in unmapped.items():
        if names:
            left = ", ".join(f"{n} ({c} rows)" for n, c in sorted(names.items()))
            print(f"{provider}: left out (name unmapped, or form not stated): {left}", file=sys.stderr)
    if args.check:
        same = args.out.is_file() and args.out.read_text(encoding="utf-8") == text
        print("snapshot up to date" if same else f"{args.out} differs from the catalog copy", file=sys.stderr)
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {len(rows)} rows to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
