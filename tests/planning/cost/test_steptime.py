"""One step time: plan's fit table, its JSON and recommend's ranking read the same ``StepTime`` (cost/step.py), and
the roofline bound rides on it as a field."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from gpuwise.hardware.catalog import load_catalog
from gpuwise.planning.cost.roofline import roofline_bound
from gpuwise.planning.cost.step import step_time
from gpuwise.planning.planner import plan
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.resolve import resolve_source
from gpuwise.recommend.request import Constraints, Goal
from gpuwise.recommend.search import recommend
from gpuwise.render._common import _seconds3
from gpuwise.render.plan import plan_json, render_plan

GPUS = ("rtx-4090", "h100-sxm")


@pytest.fixture(scope="module")
def ranked():
    catalog = load_catalog()
    source = resolve_source("gpt2", None)
    r = recommend(source, Setup.for_batch(batch=16, micro_batch=16, seq=256), Goal(tokens=1e9),
                  Constraints(gpus=GPUS), catalog=catalog)
    return source, catalog, {o.gpu: o for o in r.rows if o.count == 1 and o.fits}


@pytest.mark.parametrize("gpu", GPUS)
def test_plan_shows_the_step_time_recommend_ranks_by(ranked, gpu):
    """gpt2 at the setup recommend chose for one GPU: plan's GpuFit, its --json and its printed fit table give the
    figure recommend's row ranks by, and the bound beside it is the roofline's, below it."""
    source, catalog, rows = ranked
    row = rows[gpu]
    p = plan(source, row.setup, gpu=gpu, catalog=catalog)
    (fit,) = p.gpus
    assert fit.step is not None and fit.step.seconds == pytest.approx(row.step_time_s, rel=1e-6)
    assert fit.step.mfu == pytest.approx(row.mfu, rel=1e-6)
    data = json.loads(json.dumps(plan_json(p)))["gpus"][0]
    assert data["step"]["seconds"] == pytest.approx(row.step_time_s, rel=1e-6)
    assert data["step_time_s"] == data["step"]["seconds"]
    assert data["step_time_bound_s"] == pytest.approx(fit.step.bound_s)
    assert fit.step.bound_s < fit.step.seconds
    buf = io.StringIO()
    render_plan(p, Console(file=buf, width=120))
    line = next(ln for ln in buf.getvalue().splitlines() if ln.startswith(gpu + " "))
    assert line.split()[-4:] == [*_seconds3(row.step_time_s).split(), *_seconds3(fit.step_time_bound_s).split()]


def test_the_bound_is_the_roofline_of_the_whole_step(ranked):
    """StepTime.bound_s is max(FLOPs / peak, bytes / bandwidth) at the datasheet's bf16 peak (H100 SXM: 989.5
    TFLOPS dense, 3.35 TB/s; NVIDIA H100 datasheet), never above the modelled time."""
    source, catalog, rows = ranked
    h100 = catalog.get("h100-sxm")
    from gpuwise.planning.planner import Planner

    step = Planner(source).per_gpu(rows["h100-sxm"].setup)
    t = step_time(step, h100)
    w = step.workload
    expected = max(w.flops_per_step / (h100.peak_tflops.get("bf16") * 1e12),
                   w.bytes_per_step / (h100.memory_bandwidth_gbps * 1e9))
    assert t.bound_s == pytest.approx(expected) == roofline_bound(step, h100).seconds
    assert t.rates == "datasheet" and t.bound_s < t.seconds
