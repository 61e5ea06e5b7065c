"""plot.py: axes in plain numbers with units (never "3×10⁻¹"), and --plot as PNG or SVG by the file's suffix."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest

from gpuwise.cli._app import check_plot
from gpuwise.errors import GpuwiseError
from gpuwise.plot import dollars, hours, plain, plot_recommend, recommend_figure


def _option(gpu: str, count: int, hours_to_goal: float, usd: float, pareto: bool) -> SimpleNamespace:
    return SimpleNamespace(gpu=gpu, count=count, gpus_total=count, time_to_goal_s=hours_to_goal * 3600,
                           rent_usd=usd, buy_usd=None, pareto=pareto)


def _recommendation() -> SimpleNamespace:
    """What plot_recommend reads of a Recommendation: a training goal rented, from 3 minutes to 30 hours."""
    rows = (_option("h100-sxm", 8, 0.05, 40.0, True), _option("h100-sxm", 1, 0.3, 1.0, True),
            _option("rtx-4090", 1, 2.5, 1.7, False), _option("rtx-4090", 2, 30.0, 41.0, False))
    return SimpleNamespace(constraints=SimpleNamespace(mode="rent"), traffic=None, rows=rows, model="gpt2",
                           goal=SimpleNamespace(amount=1e9), unit="tokens",
                           setup=SimpleNamespace(task="train", batch=64))


def test_numbers_as_people_write_them():
    assert [plain(x) for x in (0.3, 0.30000000000000004, 0.003, 12, 1500, 2e6)] == \
        ["0.3", "0.3", "0.003", "12", "1,500", "2,000,000"]
    assert [hours(h) for h in (0.01, 0.25, 1, 3, 1200)] == ["36 s", "15 min", "1 h", "3 h", "1,200 h"]
    assert [dollars(x) for x in (0.3, 12, 1500, 25_000, 3e6)] == ["$0.3", "$12", "$1,500", "$25k", "$3M"]


def test_the_recommend_axes_read_in_hours_and_dollars():
    fig = recommend_figure(_recommendation())
    fig.canvas.draw()
    ax = fig.axes[0]
    x = [t.get_text() for t in ax.get_xticklabels() + ax.get_xticklabels(minor=True) if t.get_text()]
    y = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True) if t.get_text()]
    assert x and y and not any("10^" in t or "times" in t or "×" in t or "$\\" in t for t in x + y), (x, y)
    assert {"6 min", "1 h", "10 h"} <= set(x), x  # the decades 0.1, 1 and 10 hours
    assert {"$1", "$10"} <= set(y) and all(t.startswith("$") for t in y), y
    assert ax.get_xlabel() == "time to 1,000,000,000 tokens"
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_the_plot_is_an_svg_by_its_suffix(tmp_path):
    svg = tmp_path / "rank.svg"
    plot_recommend(_recommendation(), svg)
    root = ET.parse(svg).getroot()  # well-formed XML
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert "×10" not in svg.read_text() and "1 h" in svg.read_text()  # matplotlib keeps each text as a comment
    png = tmp_path / "rank.PNG"
    plot_recommend(_recommendation(), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_takes_png_and_svg_only():
    for ok in (None, "a.png", "b.SVG", "dir/c.svg"):
        check_plot(ok)
    with pytest.raises(GpuwiseError, match=r"--plot a\.jpg: the picture is a PNG or an SVG.*a\.png or \.svg"):
        check_plot("a.jpg")
