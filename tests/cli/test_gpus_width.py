"""``gpuwise gpus`` at any terminal width (issue 30, item 10): one accelerator's figures, sources and the note that
names a key's other rows are wrapped at spaces, never split inside a number or a key; the width is COLUMNS, never
under render.MIN_WIDTH."""

from __future__ import annotations

import re

import pytest

from conftest import run_cli
from gpuwise.hardware.catalog import DTYPES, load_catalog


def _words(text: str) -> list[str]:
    return text.split()


@pytest.mark.parametrize("width", [40, 60, 80, 120])
@pytest.mark.parametrize("name", ["h200", "rtx-4090"])
def test_one_accelerator_keeps_every_figure_and_word_whole(capsys, monkeypatch, width, name):
    """At 40 columns the boxed table folded 'memory 141 GiB HBM3e (151,397,597,18' / '4 bytes)' and split its source
    mid-word; now each value is wrapped at spaces beside its field, or under it where it is too wide to sit beside."""
    monkeypatch.setenv("COLUMNS", str(width))
    code, out, _ = run_cli(capsys, "gpus", name)
    assert code == 0 and "…" not in out
    assert max(len(line) for line in out.splitlines()) <= width
    a = load_catalog().get(name)
    shown = set(_words(out))
    rates = (a.peak_tflops.get(d) for d in DTYPES)
    figures = [f"{a.memory_bytes:,}", a.key, *(f"{v:g}" for v in rates if v is not None)]
    assert all(f in shown or f"({f}" in shown for f in figures), out
    price = f"${a.cloud_usd_per_hour:.2f}/h ({a.cloud_price_source})" if a.cloud_usd_per_hour else ""
    texts = [a.source, price, a.arch, ", ".join(a.aliases)]  # as the fields print them
    # every word of every text whole; only one wider than a whole line (a long URL) may be cut, where a terminal
    # would fold it
    split = [w for text in texts for w in _words(text) if len(w) <= width - 2 and w not in shown]
    assert not split, split
    assert re.search(rf"^key\s+{re.escape(a.key)}$", out, re.M)  # a short value beside its field


@pytest.mark.parametrize("width", [40, 60])
def test_the_note_naming_a_keys_other_rows_splits_no_key(capsys, monkeypatch, width):
    """'gpus a100' names the rows the alias matches; textwrap at a fixed 80 columns split 'a100-80gb-' / 'pcie' at
    its hyphen, and ran past a narrower terminal."""
    monkeypatch.setenv("COLUMNS", str(width))
    code, out, _ = run_cli(capsys, "gpus", "a100")
    assert code == 0
    note = out[:out.index("(name one for the others)") + len("(name one for the others)")]
    assert max(len(line) for line in note.splitlines()) <= width
    assert {"a100-40gb-sxm,", "a100-80gb-sxm,", "a100-40gb-pcie,", "a100-80gb-pcie;"} <= set(note.split()), note


def test_a_terminal_narrower_than_the_least_width_prints_at_it(capsys, monkeypatch):
    """COLUMNS=5: laid out at render.MIN_WIDTH (20), every key whole on its line, the hidden columns named."""
    from gpuwise.render import MIN_WIDTH, terminal

    monkeypatch.setenv("COLUMNS", "5")
    assert terminal().width == MIN_WIDTH
    monkeypatch.setenv("COLUMNS", "0")  # no width at all: as if unset (80)
    assert terminal().width == 80
    monkeypatch.setenv("COLUMNS", "5")
    code, out, _ = run_cli(capsys, "gpus")
    assert code == 0 and "…" not in out
    keys = [a.key for a in load_catalog().filter()]
    assert all(re.search(rf"^ {re.escape(k)}\s*$", out, re.M) for k in keys), out
    assert "7 columns hidden at 20 columns" in " ".join(out.split())
