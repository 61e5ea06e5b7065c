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


@pytest.mark.parametrize("name", [ro.BERT_LARGE.name, ro.RESNET50.name])
def test_training_order_is_the_measured_one_exactly(scores, name):
    """With the power cap (cost.step.POWER) no pair of the nine GPUs is ordered wrongly; for ResNet-50 none of its
    points was fitted on, for BERT-large four were (their order is partly fitted)."""
    assert scores[name].wrong_pairs == ()


@pytest.mark.xfail(strict=True, reason=(
    "LLaMA 3 F16: measured h100-pcie 27% faster than a100-80gb-sxm, one HBM decode fit (A100 only) for both"))
def test_no_noticeable_pair_is_ordered_wrongly_known_gaps(scores):
    assert scores[ro.LLAMA3_F16.name].noticeable == []


@pytest.mark.parametrize("name", [ro.LLAMA3_Q4.name, ro.LLAMA3_F16.name])
def test_decode_error_budget_on_held_out_gpus(scores, name):
    held = scores[name].held_out_errors()
    assert len(held) == 5
    assert statistics.median(held) <= 0.25 and max(held) <= 0.40


def test_bert_large_error_budget_on_held_out_gpus(scores):
    """cost.step.POWER fitted on a10, rtx-6000-ada, a100-40gb-pcie, h100-pcie; the other five held out: median
    14.7%, worst +26.0% (h100-sxm) in benchmarks/RESULTS.md."""
    held = scores[ro.BERT_LARGE.name].held_out_errors()
    assert len(held) == 5
    assert statistics.median(held) <= 0.20 and max(held) <= 0.32


@pytest.mark.xfail(strict=True, reason=(
    "ResNet-50, all held out: median 44%, worst +119% (h100-sxm), +61..+119% on every HBM GPU: predicted "
    "memory-bound at the assumed HBM share 0.80; the share that fits it (~0.31) sends nanoGPT (anchor 13) to -28%, "
    "and the captured op costs carry no op family (conv vs GEMM, batch norm vs fused elementwise) to split it by"))
def test_resnet50_error_budget_on_held_out_gpus(scores):
    held = scores[ro.RESNET50.name].held_out_errors()
    assert statistics.median(held) <= 0.25 and max(held) <= 0.40
