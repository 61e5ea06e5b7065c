"""Derive ``src/gpuwise/planning/cost/data/collectives.json`` from OpenXLA's measured collective table, and fit the
alpha-beta link model that prices GPUs the table does not have.

    python scripts/derive_collectives.py            # rewrite the JSON, print the fit and its held-out error
    python scripts/derive_collectives.py --check    # change nothing; exit 1 if the committed JSON differs

Source: ``default_collective_perf_table.txtpb.gz`` in /work/shared/data/openxla/ (openxla/xla
``xla/service/gpu/model/``, mirror ROCm/xla main 183fa00cb5d82384463a1a7aed1ab06bc9026974, Apache-2.0). Its
generator (``xla/tools/collective_perf_table_gen.cc``) runs each collective 20 times and stores
``network_throughput_bytes_per_sec = tensor_size_bytes / median runtime`` (a collective-permute's runtime is that of
one of the 100 in its while loop), where ``tensor_size_bytes`` is the buffer nccl-tests calls the size: all-reduce
and all-to-all their buffer, all-gather its output, reduce-scatter its input. So each row here is
(arch, op, pattern, dtype, group, groups, bytes, throughput): ``bytes / throughput`` seconds for one collective over
``group`` GPUs, ``groups`` such groups running at once (a collective-permute's group is the devices it spans).

The fit (``fit``): per op, a latency ``alpha`` and a share ``efficiency`` of the link's line rate per direction, so
that ``alpha + bytes x busfactor / (efficiency x line rate)`` (cost/comm.py ``link_seconds``) matches the table's
seconds on the FIT architectures in least squares of log time; the other architectures are held out and their error
is reported (median and 90th percentile of |model / measured - 1|).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpuwise.planning.cost.comm import OPS, Link, link_seconds  # noqa: E402

SOURCE = Path("/work/shared/data/openxla/default_collective_perf_table.txtpb.gz")
OUT = ROOT / "src" / "gpuwise" / "planning" / "cost" / "data" / "collectives.json"
ORIGIN = ("openxla/xla xla/service/gpu/model/default_collective_perf_table.txtpb (mirror ROCm/xla main "
          "183fa00cb5d82384463a1a7aed1ab06bc9026974, 2026-08-22), Apache-2.0: see collectives.NOTICE beside this "
          "file; derived by scripts/derive_collectives.py")
OPCODES = {"all-reduce": "all-reduce", "all-gather": "all-gather", "reduce-scatter": "reduce-scatter",
           "all-to-all": "all-to-all", "collective-permute": "send/recv"}
ITEMSIZE = {"F32": 4, "BF16": 2}

# The links the table's machines have, per direction per GPU (half the bidirectional figure vendors quote).
# sm_90: HGX H100, NVLink 4 through NVSwitch, 900 GB/s (catalog h100-sxm); sm_100_B200: HGX B200 and sm_100_GB200:
# GB200 NVL72, NVLink 5, 1800 GB/s (catalog b200, gb200); sm_103: GB300 NVL72 (the table's 64/72-GPU groups), NVLink
# 5, 1800 GB/s (NVIDIA GB300 NVL72 datasheet: 130 TB/s over 72 GPUs); gfx950: MI355X, a full mesh of 7 Infinity
# Fabric links of 153.6 GB/s each (AMD Instinct MI355X datasheet: 1075.2 GB/s), one link to each peer.
LINKS = {
    "sm_90": Link(kind="switch", gbps=450.0, source="NVLink 4 900/2 GB/s"),
    "sm_100_B200": Link(kind="switch", gbps=900.0, source="NVLink 5 1800/2 GB/s"),
    "sm_100_GB200": Link(kind="switch", gbps=900.0, source="NVLink 5 1800/2 GB/s"),
    "sm_103": Link(kind="switch", gbps=900.0, source="NVLink 5 1800/2 GB/s"),
    "gfx950": Link(kind="mesh", gbps=7 * 76.8, links=7, source="Infinity Fabric 7 x 153.6/2 GB/s"),
}
# Fitted on the two 8-GPU NVSwitch boards (the link model's main use: HGX A100/V100-class boxes); held out: the
# 72-GPU NVLink domains (groups of 4 to 72) and the AMD mesh.
FIT = ("sm_90", "sm_100_B200")
PATTERNS = {"one-way", "mutual", "ring"}
ALPHAS_US = np.geomspace(1.0, 300.0, 241)
EFFICIENCIES = np.linspace(0.2, 1.2, 201)


_TOKEN = re.compile(r'\s*(?:(#[^\n]*)|(\w+)\s*:?\s*(\{)|(\w+)\s*:\s*("(?:[^"\\]|\\.)*"|[^\s{}]+)|(\}))')


def parse(text: str) -> dict:
    """A text proto as nested dicts of lists: ``{"entries": [{"key": ["sm_90"], "value": [{...}]}, ...]}``."""
    root: dict = {}
    stack, pos = [root], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            if text[pos:].strip():
                raise ValueError(f"cannot parse the text proto at {pos}: {text[pos:pos + 80]!r}")
            break
        pos = m.end()
        if m.group(3):
            child: dict = {}
            stack[-1].setdefault(m.group(2), []).append(child)
            stack.append(child)
        elif m.group(4):
            stack[-1].setdefault(m.group(4), []).append(m.group(5).strip('"'))
        elif m.group(6):
            stack.pop()
    return root


def _pattern(pairs: list[tuple[int, int]], devices: int) -> str:
    """XLA's permute cost-model types (collective_perf_table_gen.cc BuildSourceTargetPairs): one-way {i -> i + n/2},
    mutual {2i <-> 2i + 1}, ring {i -> i + 1 mod n}."""
    if all(t == s + devices // 2 for s, t in pairs):
        return "one-way"
    if all(t == s ^ 1 for s, t in pairs):
        return "mutual"
    if all(t == (s + 1) % devices for s, t in pairs):
        return "ring"
    raise ValueError(f"unknown collective-permute pattern {pairs[:4]}...")


def rows(table: dict) -> list[list]:
    """[arch, op, pattern, dtype, group, groups, bytes, throughput] per measured entry (those with a throughput)."""
    out = []
    for entry in table["entries"]:
        arch = entry["key"][0]
        for profile in entry["value"][0]["entries"]:
            if "network_throughput_bytes_per_sec" not in profile:
                continue  # the generator found it too small to time
            ins = profile["instruction"][0]
            shape = ins["shape"][0]
            dtype = shape["element_type"][0]
            elements = int(shape["dimensions"][0])
            op = OPCODES[ins["opcode"][0]]
            pattern = ""
            if op == "send/recv":
                pairs = [(int(p.get("source", ["0"])[0]), int(p.get("target", ["0"])[0]))
                         for p in ins["source_target_pairs"]]
                group = max(max(p) for p in pairs) + 1
                groups, pattern = 1, _pattern(pairs, group)
            else:
                devices = ins["iota_collective_device_list"][0]
                group = int(devices["num_devices_per_group"][0])
                groups = int(devices["num_replica_groups"][0])
            nbytes = elements * ITEMSIZE[dtype] * (group if op == "reduce-scatter" else 1)  # its input
            out.append([arch, op, pattern, dtype.lower(), group, groups, nbytes,
                        int(profile["network_throughput_bytes_per_sec"][0])])
    out.sort(key=lambda r: (r[0], OPS.index(r[1]), r[2], r[3], r[4], r[6]))
    return out


def _points(table: list[list], archs, op: str):
    """(seconds measured, bytes, group, link) of ``op`` on ``archs``: f32 rows (the BF16 ones repeat them on
    gfx950), send/recv in its one-way pattern where measured, else the mutual one (the 72-GPU domains)."""
    chosen = [r for r in table if r[0] in archs and r[1] == op and r[3] == "f32"]
    if op == "send/recv":
        one_way = {r[0] for r in chosen if r[2] == "one-way"}
        chosen = [r for r in chosen if r[2] == ("one-way" if r[0] in one_way else "mutual")]
    seconds = np.array([r[6] / r[7] for r in chosen])
    nbytes = np.array([float(r[6]) for r in chosen])
    group = np.array([2 if op == "send/recv" else r[4] for r in chosen])
    return seconds, nbytes, group, [LINKS[r[0]] for r in chosen], [r[0] for r in chosen]


def _model(op, nbytes, group, links, alpha_s, efficiency):
    return np.array([link_seconds(op, b, int(n), link, alpha_s=alpha_s, efficiency=efficiency)
                     for b, n, link in zip(nbytes, group, links, strict=True)])


def fit(table: list[list]) -> dict:
    """Per op: the (alpha, efficiency) on the grids minimising the squared log error of time on FIT; the error there
    and on each held-out architecture."""
    out = {}
    for op in OPS:
        seconds, nbytes, group, links, _ = _points(table, FIT, op)
        # the model is alpha + x / efficiency with x the seconds at the line rate: x on every grid point at once
        x = _model(op, nbytes, group, links, 0.0, 1.0)
        grid = ALPHAS_US[:, None, None] * 1e-6 + x[None, None, :] / EFFICIENCIES[None, :, None]
        loss = (np.log(grid / seconds) ** 2).sum(axis=2)
        i, j = np.unravel_index(loss.argmin(), loss.shape)
        alpha, eff = float(ALPHAS_US[i]), float(EFFICIENCIES[j])
        errors = {}
        for arch in LINKS:
            s, b, n, lk, _ = _points(table, (arch,), op)
            if len(s):
                err = np.abs(_model(op, b, n, lk, alpha * 1e-6, eff) / s - 1)
                big = b >= 2**24  # bandwidth-bound: 16 MiB and up
                errors[arch] = {"points": len(s), "median": round(float(np.median(err)), 3),
                                "p90": round(float(np.quantile(err, 0.9)), 3),
                                "median_16mib_up": round(float(np.median(err[big])), 3) if big.any() else None}
        out[op] = {"alpha_us": round(alpha, 2), "efficiency": round(eff, 3), "error": errors}
    return out


def derive() -> dict:
    with gzip.open(SOURCE, "rt") as f:
        table = rows(parse(f.read()))
    return {
        "source": ORIGIN,
        "columns": ["arch", "op", "pattern", "dtype", "group", "groups", "bytes", "throughput_bytes_per_s"],
        "rows": table,
        "link_fit": {"fit_on": list(FIT), "held_out": [a for a in LINKS if a not in FIT],
                     "links": {a: {"kind": lk.kind, "gbps": lk.gbps, "links": lk.links, "source": lk.source}
                               for a, lk in LINKS.items()},
                     "method": "least squares of log time over a grid: alpha 1-300 us (log), efficiency 0.2-1.2; "
                               "error = |model / measured - 1| over every size, and over 16 MiB and up",
                     "ops": fit(table)},
    }


def dump(data: dict) -> str:
    """One row a line: the file stays diffable."""
    rows_text = ",\n".join("    " + json.dumps(r) for r in data["rows"])
    head = {k: v for k, v in data.items() if k != "rows"}
    text = json.dumps(head, indent=1)
    return text[:-2] + ',\n "rows": [\n' + rows_text + "\n ]\n}\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed JSON differs")
    args = parser.parse_args()
    text = dump(derive())
    fitted = json.loads(text)["link_fit"]
    for op, f in fitted["ops"].items():
        held = "; ".join(f"{a} {e['median']:.0%} (p90 {e['p90']:.0%}, >=16 MiB {e['median_16mib_up'] or 0:.0%})"
                         for a, e in f["error"].items())
        print(f"{op}: alpha {f['alpha_us']} us, efficiency {f['efficiency']} | {held}")
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print("collectives.json is current" if same else "collectives.json differs from the source")
        return 0 if same else 1
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}: {len(json.loads(text)['rows'])} rows, {len(text) / 1e3:.0f} kB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
