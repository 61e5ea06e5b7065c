"""Workload.at: the step at another micro-batch and accumulation, predicted from the batch model's captures, equals
the step captured there (per-op costs, totals, memory), for a whole-model capture and a 2/3-block scaled one."""

from dataclasses import replace

import numpy as np
import pytest

from gpuwise.hardware.catalog import load_catalog
from gpuwise.planning.capture.scaling import Misaligned, capture_at
from gpuwise.planning.capture.step import capture
from gpuwise.planning.capture.workload import simulate_if_applicable
from gpuwise.planning.cost.step import step_time
from gpuwise.planning.parallel.sharding import per_gpu
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.resolve import resolve_source

# (micro-batch, accumulation): 1 -> 32, odd sizes, and no accumulation cut out of a probe that held two
POINTS = [(1, 1), (2, 1), (3, 5), (8, 4), (32, 1), (32, 2)]
CASES = [
    ("gpt2", Setup(micro_batch=1, grad_accum=2, seq=128)),  # 12 blocks: 2/3-block captures scaled
    ("llama2-7b", Setup(micro_batch=1, grad_accum=2, seq=128, precision="bf16", checkpointing="full")),
    ("mlp", Setup(micro_batch=1, grad_accum=2)),  # the whole model captured
]


@pytest.fixture(scope="module", params=CASES, ids=[name for name, _ in CASES])
def probe(request):
    name, setup = request.param
    source = resolve_source(name, None)
    return source, setup, simulate_if_applicable(source, setup)


@pytest.mark.parametrize(("micro", "accum"), POINTS)
def test_at_equals_the_capture_there(probe, micro, accum):
    source, setup, w = probe
    predicted = w.at(micro, accum)
    assert predicted is not None
    run = replace(setup, micro_batch=micro, grad_accum=accum)
    exact = simulate_if_applicable(source, run)
    assert predicted.setup == exact.setup
    assert predicted.costs.total_flops == pytest.approx(exact.costs.total_flops, rel=1e-9)
    assert predicted.costs.total_bytes == pytest.approx(exact.costs.total_bytes, rel=1e-9)
    assert (predicted.flops_per_step, predicted.bytes_per_step, predicted.tokens_per_step) == (
        exact.flops_per_step, exact.bytes_per_step, exact.tokens_per_step)
    for f in ("flops", "bytes", "kind", "phase", "count"):  # row by row, not only in total
        np.testing.assert_array_equal(getattr(predicted.costs, f), getattr(exact.costs, f))
    assert predicted.uncosted == exact.uncosted
    assert predicted.timeline.labels == exact.timeline.labels
    np.testing.assert_array_equal(predicted.timeline.live(micro), exact.timeline.live(micro))
    np.testing.assert_array_equal(predicted.batch_model.slope, exact.batch_model.slope)
    for acc in (load_catalog().get("h100-sxm"), load_catalog().get("rtx-4090")):
        for gpus in (1, 4):
            step = replace(run, gpus=gpus)
            t_pred, t_exact = step_time(per_gpu(predicted, step), acc), step_time(per_gpu(exact, step), acc)
            assert t_pred.seconds == pytest.approx(t_exact.seconds, rel=1e-6)


def test_at_the_captured_point_gives_the_workload_back(probe):
    _, setup, w = probe
    same = w.at(setup.micro_batch, setup.grad_accum)
    assert (same.setup, same.flops_per_step, same.bytes_per_step, same.params) == (
        w.setup, w.flops_per_step, w.bytes_per_step, w.params)
    np.testing.assert_array_equal(same.costs.count, w.costs.count)
    np.testing.assert_array_equal(same.timeline.base, w.timeline.base)


def test_at_says_none_where_the_captures_cannot_tell():
    source = resolve_source("mlp", None)
    held_one = simulate_if_applicable(source, Setup(micro_batch=2, grad_accum=1))
    assert held_one.at(4, 2) is None  # accumulation holds a second micro-batch: never captured
    assert held_one.at(1, 1) is None  # below the batch model
    assert simulate_if_applicable(source, Setup(micro_batch=2), batch_model=False).at(4, 1) is None


def test_captures_that_allocate_differently_do_not_pair():
    source = resolve_source("mlp", None)
    a = capture(source, Setup(micro_batch=1), batch=1)
    b = capture(source, Setup(micro_batch=2, grad_accum=2), batch=2)  # a second micro-batch: more ops
    with pytest.raises(Misaligned):
        capture_at(a, b, 4)
