"""render/_common.py: tables that fit the terminal by leaving columns out (never a cut number or a split name), the
JSON document with its schema version, and the progress line that only a terminal gets."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from conftest import run_cli
from gpuwise.bench.suite import BenchResult
from gpuwise.hardware.catalog import load_catalog
from gpuwise.render._common import (
    SCHEMA_VERSION,
    Column,
    fit_table,
    hidden_note,
    json_document,
    progress,
    show_progress,
)
from gpuwise.units import parse_bytes


def _render(table, width: int) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, highlight=False).print(table)
    return buf.getvalue()


@pytest.mark.parametrize("width", [60, 80, 200])
def test_gpus_keeps_every_key_and_number_whole_at_any_width(capsys, monkeypatch, width):
    monkeypatch.setenv("COLUMNS", str(width))  # what rich reads for a pipe
    code, out, _ = run_cli(capsys, "gpus")
    assert code == 0 and "…" not in out
    assert max(len(line) for line in out.splitlines()) <= width
    catalog = load_catalog()
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    for a in catalog.filter():  # each key whole at the start of its own line, its memory beside it
        assert a.key in rows, (a.key, out)
        assert parse_bytes(" ".join(rows[a.key][1:3])) == pytest.approx(a.memory_bytes, rel=0.01), rows[a.key]
    h100 = rows["h100-sxm"]
    assert "3350" in h100 and "990" in h100  # HBM3 3.35 TB/s, dense BF16 989.5 TFLOPS (NVIDIA H100 datasheet)
    hidden = re.search(r"(\d) columns? hidden at (\d+) columns \(([^)]*)\)", " ".join(out.split()))
    if width == 200:
        assert hidden is None and "link GB/s" in out and "$/h" in out
    if width == 60:  # 8 columns need 78 characters: the least important went (link, fp8), not memory or bf16
        assert hidden.group(2) == "60" and int(hidden.group(1)) == len(hidden.group(3).split(", "))
        assert {"fp8", "link GB/s"} <= set(hidden.group(3).split(", ")) and "bf16" in out


def test_columns_go_by_priority_and_words_wrap_whole():
    columns = [Column(key="name"), Column(key="shape", priority=3, wrap=True),
               Column(key="median", priority=1, numeric=True), Column(key="extra", priority=9)]
    rows = [["attention-flash", "b8 h32 s4096 d128 causal", "12.35 ms", "x" * 30]]
    table, hidden = fit_table(columns, rows, 50)
    assert [c.key for c in hidden] == ["extra"]  # 30 characters that cannot wrap: the first to go
    out = _render(table, 50)
    assert "12.35 ms" in out and "attention-flash" in out and "…" not in out
    words = {w for line in out.splitlines() for w in line.split()}
    assert {"b8", "h32", "s4096", "d128", "causal"} <= words  # the shape wrapped between words, none split
    assert max(len(line) for line in out.splitlines()) <= 50
    table, hidden = fit_table(columns, rows, 10)  # narrower than any column: priority 0 stays, whole
    assert [c.key for c in hidden] == ["shape", "median", "extra"] and "attention-flash" in _render(table, 40)
    assert hidden_note(hidden, 10).startswith("3 columns hidden at 10 columns (shape, median, extra)")
    assert hidden_note((), 80) == ""


def test_a_one_text_row_starts_a_group():
    columns = [Column(key="gpu"), Column(key="memory", priority=1, numeric=True)]
    table, hidden = fit_table(columns, ["consumer", ["rtx-4090", "24 GiB"], "datacenter", ["h100-sxm", "80 GiB"]], 40)
    out = _render(table, 40)
    assert not hidden and re.search(r"^ consumer\s*$", out, re.M) and re.search(r"^ datacenter\s*$", out, re.M)
    assert re.search(r"^ h100-sxm\s+80 GiB\s*$", out, re.M)


@pytest.mark.parametrize("width", [50, 60, 80, 200])
def test_bench_table_keeps_its_figures_whole(width):
    from gpuwise.render import render_bench

    r = BenchResult(op="attention", dtype="bf16", shape="b8 h32 s4096 d128 causal", device="cuda:0",
                    median_s=0.012345, p10_s=0.0121, p90_s=0.0131, repeats=20, flops=1e12, bytes=None, tflops=812.3,
                    gbps=None, peak_memory_bytes=None, pct_of_peak=82.0, speedup_vs_cpu=1234.5, backend="flash")
    skipped = BenchResult(op="gemm", dtype="fp8", shape="8192x8192 @ 8192x8192", device="cuda:0", median_s=0.0,
                          p10_s=0.0, p90_s=0.0, repeats=0, flops=None, bytes=None, tflops=None, gbps=None,
                          peak_memory_bytes=None, pct_of_peak=None, speedup_vs_cpu=None,
                          note="not run: torch._scaled_mm needs compute capability 8.9")
    buf = io.StringIO()
    render_bench([r, skipped], "NVIDIA H100 80GB HBM3 (cuda:0)", Console(file=buf, width=width))
    out = buf.getvalue()
    assert "…" not in out and "12.35 ms" in out and "812 TF/s" in out
    assert max(len(line) for line in out.splitlines()) <= width
    assert re.search(r"^ attention flash\s", out, re.M)  # the op whole at the start of its row
    assert "needs compute capability 8.9" in " ".join(out.split())  # why a case did not run, under the table
    hidden = re.search(r"hidden at \d+ columns \(([^)]*)\)", " ".join(out.split()))
    if width == 200:
        assert "1234.5x" in out and "82%" in out and hidden is None
    elif width == 80:  # 81 characters at the least: the least important column goes
        assert "82%" in out and hidden.group(1) == "vs CPU"
    else:
        assert hidden is not None and "vs CPU" in hidden.group(1)


def test_the_json_document_is_one_object_with_its_schema_version_first():
    doc = json_document({"rows": [1.0, float("inf")], "schema_version": 0})
    assert list(doc) == ["schema_version", "rows"] and doc == {"schema_version": SCHEMA_VERSION, "rows": [1.0, None]}
    with pytest.raises(TypeError, match="one JSON object"):
        json_document([1, 2])


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_only_for_a_table_on_a_terminal(capsys):
    assert show_progress("table", _Stream(True))
    assert not show_progress("table", _Stream(False))
    assert not any(show_progress(fmt, _Stream(True)) for fmt in ("json", "csv", "md"))
    with progress("capturing", enabled=False) as say:
        say("costing 51 GPUs")
    assert capsys.readouterr() == ("", "")
