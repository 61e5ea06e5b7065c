"""The engine's GPU order and error against published per-GPU measurements of one workload (issue 12: "the order
of GPUs for one workload as measured"). The data and sources are in benchmarks/recommend_order.py; the table in
benchmarks/RESULTS.md. Predictions only (fake-tensor captures), no GPU.

What holds today is asserted; what does not is an xfail(strict=True) that names the gap, so the test turns red
(XPASS) the day the cost model closes it and the bound can be tightened."""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "recommend_order.py"
_spec = importlib.util.spec_from_file_location("recommend_order", _PATH)
ro = importlib.util.module_from_spec(_spec)
sys.modules["recommend_order"] = ro
_spec.loader.exec_module(ro)

WORKLOADS = {w.name: w for w in ro.WORKLOADS}


@pytest.fixture(scope="module")
def scores():
    return {name: ro.score(w) for name, w in WORKLOADS.items()}


def test_spearman_and_pair_count_by_hand():
    assert ro.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert ro.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert list(ro.ranks([5, 1, 5])) == [2.5, 1, 2.5]
    w = ro.Workload(name="t", unit="x", source="", kind="decode", weight_gib=4.58,
                    points=(ro.Point("rtx-3090", 1.0), ro.Point("h100-pcie", 2.0)))
    s = ro.score(w)
    assert s.wrong_pairs == () and s.spearman == pytest.approx(1.0)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_the_order_of_gpus_is_the_measured_one(scores, name):
    s = scores[name]
    detail = [(p.gpu, p.measured, round(q, 1)) for p, q in zip(s.workload.points, s.predicted, strict=True)]
    assert s.spearman >= 0.8, detail
    assert len(s.wrong_pairs) <= 4  # of 36, and only close ones (next test)


@pytest.mark.parametrize("name", [ro.BERT_LARGE.name, ro.RESNET50.name, ro.LLAMA3_Q4.name])
def test_no_noticeable_pair_is_ordered_wrongly(scores, name):
    assert scores[name].noticeable == []


def test_training_order_is_the_measured_one(scores):
    """Nothing of the kernel-time model is fitted on these runs: ResNet-50's nine GPUs come out in the measured order
    but for pairs measured within 2% of each other (rtx-a6000 916 vs rtx-3090 905 samples/s: run-to-run noise);
    BERT-large's with one pair swapped (rtx-4090 measured 18% faster than rtx-6000-ada), none with a gap a user would
    notice (the noticeable test above)."""
    assert all(gap < 0.02 for *_, gap in scores[ro.RESNET50.name].wrong_pairs)
    assert len(scores[ro.BERT_LARGE.name].wrong_pairs) <= 1


@pytest.mark.xfail(strict=True, reason=(
    "LLaMA 3 F16: measured h100-pcie 27% faster than a100-80gb-sxm; llama.cpp's HBM streaming share, fitted on "
    "the A100 SXM alone, prices both"))
def test_no_noticeable_pair_is_ordered_wrongly_known_gaps(scores):
    assert scores[ro.LLAMA3_F16.name].noticeable == []


@pytest.mark.parametrize("name", [ro.LLAMA3_Q4.name, ro.LLAMA3_F16.name])
def test_decode_error_budget_on_held_out_gpus(scores, name):
    """The llama.cpp constants are fitted on the 3090, 4090 and A100 SXM points (benchmarks/serving_truth.py FIT);
    the other six GPUs are held out."""
    held = scores[name].held_out_errors()
    assert len(held) == 6
    assert statistics.median(held) <= 0.25 and max(held) <= 0.40


@pytest.mark.parametrize(("name", "median", "worst"), [(ro.BERT_LARGE.name, 0.20, 0.25),
                                                        (ro.RESNET50.name, 0.20, 0.30)])
def test_training_error_budget_on_lambdas_gpus(scores, name, median, worst):
    """Issue 26: ResNet-50 and BERT-large on Lambda's GPUs within 20% median, every point held out (the kernel model
    is fitted on per-kernel data only): 13.6% / 21.7% and 19.0% / 26.8% in benchmarks/RESULTS.md (2026-12-03)."""
    held = scores[name].held_out_errors()
    assert len(held) == 9
    assert statistics.median(held) <= median and max(held) <= worst
