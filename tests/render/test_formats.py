"""--format table|json|csv|md: csv that csv.DictReader reads back whole, GitHub Markdown tables, and one checked
choice of format (--json its alias)."""

from __future__ import annotations

import csv
import io
import json

import pytest

from conftest import run_cli
from gpuwise.bench.results import save
from gpuwise.bench.suite import BenchResult
from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import DTYPES, load_catalog
from gpuwise.render._common import Column, Sheet
from gpuwise.render.formats import check_format, to_csv, to_markdown
from gpuwise.units import GiB

_NUMERIC = ("memory_gib", "memory_bytes", "memory_bandwidth_gbps", "interconnect_gbps", "tdp_w", "launch_year",
            "cloud_usd_per_hour", *(f"{d}_tflops" for d in DTYPES if d != "int8"), "int8_tops")


def _float_or_empty(text: str) -> float | None:
    return None if text == "" else float(text)


def test_gpus_csv_holds_every_catalog_row_with_numbers_that_parse(capsys):
    code, out, err = run_cli(capsys, "gpus", "--format", "csv")
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    catalog = load_catalog().filter()
    assert len(rows) == len(catalog) and [r["key"] for r in rows] == [a.key for a in catalog]
    assert out.count("key,name,") == 1  # the header once
    for row in rows:
        values = {k: _float_or_empty(row[k]) for k in _NUMERIC}  # each numeric column: a float or empty
        assert values["memory_gib"] * GiB == values["memory_bytes"]
    h100 = next(r for r in rows if r["key"] == "h100-sxm")  # NVIDIA H100 SXM datasheet: 80 GB HBM3 at 3.35 TB/s,
    assert (float(h100["memory_gib"]), float(h100["memory_bandwidth_gbps"])) == (80, 3350)  # 989.5 dense BF16
    assert float(h100["bf16_tflops"]) == 989.5 and h100["vendor"] == "NVIDIA"
    mi250x = next(r for r in rows if r["key"] == "mi250x")
    assert mi250x["arch"] == "CDNA 2 (gfx90a, 2 GCDs)"  # a comma inside a field, quoted and read back


def test_gpus_markdown_is_a_github_table(capsys):
    code, out, _ = run_cli(capsys, "gpus", "--segment", "datacenter", "--format", "md")
    assert code == 0
    table = [line for line in out.splitlines() if line.startswith("|")]
    keys = [a.key for a in load_catalog().filter(segment="datacenter")]
    assert len(table) == len(keys) + 2 and table[0] == "| key | memory | GB/s | fp32 | bf16 | fp8 | link GB/s | $/h |"
    assert table[1] == "|---|---:|---:|---:|---:|---:|---|---:|"  # figures right-aligned
    assert all(line.endswith("|") and line.count("|") == 9 for line in table)
    assert [line.split("|")[1].strip() for line in table[2:]] == keys
    assert "dense TFLOPS" in out.split("\n\n", 1)[1]  # the note as a paragraph under the table


def test_markdown_escapes_pipes_and_line_breaks():
    sheet = Sheet(title="t", columns=(Column(key="a"), Column(key="b", numeric=True)),
                  rows=({"a": "x | y\nz", "b": 1.5},))
    assert to_markdown(sheet) == "| a | b |\n|---|---:|\n| x \\| y<br>z | 1.5 |\n"


def test_csv_keeps_every_column_raw():
    sheet = Sheet(title="t", columns=(Column(key="name"), Column(key="rate_tflops", table=False),
                                      Column(key="ok"), Column(key="tags")),
                  rows=({"name": 'a "quoted", name', "rate_tflops": 0.1 + 0.2, "ok": True, "tags": ("x", "y")},
                        {"name": "b", "rate_tflops": float("nan"), "ok": False, "tags": ()}))
    rows = list(csv.DictReader(io.StringIO(to_csv(sheet))))
    assert rows[0] == {"name": 'a "quoted", name', "rate_tflops": "0.30000000000000004", "ok": "true", "tags": "x;y"}
    assert rows[1] == {"name": "b", "rate_tflops": "", "ok": "false", "tags": ""}  # not a number: empty


def test_one_format_is_chosen_and_checked():
    assert check_format(None) == "table" and check_format(None, json_flag=True) == "json"
    assert check_format("CSV") == "csv" and check_format("markdown") == "md" and check_format("json", True) == "json"
    with pytest.raises(GpuwiseError, match=r"--format 'cvs' is not one of table, json, csv, md.*--format csv"):
        check_format("cvs")
    with pytest.raises(GpuwiseError, match="--json and --format md"):
        check_format("md", json_flag=True)


@pytest.mark.parametrize("argv", [["gpus", "--format", "xml"], ["gpus", "--json", "--format", "csv"],
                                  ["bench", "--format", "html"], ["gpus", "--local", "--format", "yaml"]])
def test_a_bad_format_is_one_line(capsys, argv):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: --")


def test_json_is_the_same_by_either_flag(capsys):
    _, by_flag, _ = run_cli(capsys, "gpus", "h100", "--json")
    _, by_format, _ = run_cli(capsys, "gpus", "h100", "--format", "json")
    assert by_flag == by_format and json.loads(by_flag)["accelerators"][0]["key"] == "h100-sxm"


def test_one_accelerator_and_this_machine_as_csv(capsys):
    code, out, _ = run_cli(capsys, "gpus", "h100", "--format", "csv")
    (row,) = csv.DictReader(io.StringIO(out))  # no "note: 'h100' matches ..." line in the csv
    assert code == 0 and row["key"] == "h100-sxm"
    code, out, _ = run_cli(capsys, "gpus", "--local", "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and rows[-1]["device"] == "cpu" and float(rows[-1]["memory_gib"]) > 0


def _result(op: str, median_s: float) -> BenchResult:
    return BenchResult(op=op, dtype="fp32", shape="1024x1024 @ 1024x1024", device="cpu", median_s=median_s,
                       p10_s=median_s, p90_s=median_s, repeats=3, flops=2 * 1024**3, bytes=None,
                       tflops=2 * 1024**3 / median_s / 1e12, gbps=None, peak_memory_bytes=None, pct_of_peak=None,
                       speedup_vs_cpu=None)


def test_bench_comparison_as_csv_and_markdown(capsys, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    save([_result("gemm", 0.02)], a, machine={})
    save([_result("gemm", 0.01)], b, machine={})
    code, out, err = run_cli(capsys, "bench", "--compare", str(a), "--compare", str(b), "--format", "csv")
    assert code == 0, err
    (row,) = csv.DictReader(io.StringIO(out))
    assert (float(row["a_median_s"]), float(row["b_median_s"]), float(row["speedup"])) == (0.02, 0.01, 2.0)
    code, out, _ = run_cli(capsys, "bench", "--compare", str(a), "--compare", str(b), "--format", "md")
    assert code == 0 and "| gemm | fp32 | 1024x1024 @ 1024x1024 | 20.00 ms | 10.00 ms | 2.00x |" in out
    code, out, _ = run_cli(capsys, "bench", "--compare", str(a), "--compare", str(b), "--json")
    data = json.loads(out)
    assert data["schema_version"] == 1 and data["pairs"][0]["speedup"] == 2.0 and data["b"] == str(b)
