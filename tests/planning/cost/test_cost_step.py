"""Per-op step time against hand arithmetic, NCCL volumes (nccl-tests PERFORMANCE.md) and held-out anchors."""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from gpuwise.hardware.calibration import Calibration
from gpuwise.hardware.catalog import load_catalog
from gpuwise.models import get_model
from gpuwise.planning.capture.tracker import MATMUL, OTHER, OpCosts
from gpuwise.planning.capture.workload import simulate
from gpuwise.planning.cost import step as costmodel
from gpuwise.planning.cost.step import allreduce_link, comm_bytes, step_time
from gpuwise.planning.parallel.sharding import capture_setup, per_gpu
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.zoo import ZooSource

CATALOG = load_catalog()
H100, A100, RTX5090, RTX4090 = (CATALOG.get(k) for k in ("h100-sxm", "a100-80gb-sxm", "rtx-5090", "rtx-4090"))


def _step(model: str, setup: Setup, **workload):
    w = simulate(ZooSource(zoo=get_model(model)), capture_setup(setup), batch_model=False)
    return per_gpu(dataclasses.replace(w, **workload), setup)


@pytest.fixture(scope="module")
def gpt2_step():
    return _step("gpt2", Setup(micro_batch=2, seq=128))


def _only(flops: float, nbytes: float, kind: int) -> OpCosts:
    one = np.ones(1)
    return OpCosts(flops=one * flops, bytes=one * nbytes, kind=np.array([kind], np.int8),
                   phase=np.zeros(1, np.int8), count=one)


@pytest.mark.parametrize(("model", "setup", "blocks"), [
    ("resnet50", Setup(micro_batch=2, precision="bf16-mixed"), None),
    ("llama3.2-1b", Setup(micro_batch=1, seq=256, grad_accum=3), (2, 3)),
])
def test_op_costs_sum_to_the_steps_totals(model, setup, blocks):
    w = simulate(ZooSource(zoo=get_model(model)), setup, batch_model=False)
    assert w.captured_blocks == blocks
    assert w.costs.total_flops == pytest.approx(w.flops_per_step, rel=1e-12)
    assert w.costs.total_bytes == pytest.approx(w.bytes_per_step, rel=1e-12)
    assert len(w.costs) < 300  # merged: identical ops share a row


def test_a_pure_gemm_runs_at_its_efficiency_times_the_peak(gpt2_step):
    step = dataclasses.replace(gpt2_step, workload=dataclasses.replace(gpt2_step.workload,
                                                                       costs=_only(1e15, 1e6, MATMUL)))
    t = step_time(step, H100)
    share = 1.11 * 700 / 989.5  # the clock a 700 W H100 SXM holds (cost.step.POWER)
    assert t.seconds == pytest.approx(1e15 / (0.57 * share * 989.5e12))  # the matmul share, bf16 dense peak
    assert t.compute_s == t.seconds and t.memory_s == t.launch_s == t.comm_s == 0
    assert "989.5 TFLOPS" in t.basis and "anchors 5,13 (A100), 6" in t.basis and "700 W" in t.basis


@pytest.mark.parametrize(("gpu", "share"), [
    ("rtx-3090", 1.0), ("rtx-4090", 1.0), ("a100-80gb-sxm", 1.0), ("a40", 1.0),  # their power holds the clock
    ("a10", 0.50 * 150 / 125.0), ("a100-40gb-pcie", 0.84 * 250 / 312.0), ("rtx-6000-ada", 0.46 * 300 / 364.2),
    ("h100-sxm", 1.11 * 700 / 989.5), ("h100-pcie", 1.11 * 350 / 756.5),
    ("rtx-5090", 1.0), ("t4", 1.0),  # no POWER entry for Blackwell or Turing: the datasheet clock
])
def test_clock_share_at_board_power(gpu, share):
    assert costmodel.clock_share(CATALOG.get(gpu))[0] == pytest.approx(share)


def test_a_pure_elementwise_step_is_bandwidth_bound(gpt2_step):
    step = dataclasses.replace(gpt2_step, workload=dataclasses.replace(gpt2_step.workload,
                                                                       costs=_only(0, 1e12, OTHER)))
    t = step_time(step, A100)
    assert t.seconds == pytest.approx(1e12 / (0.8 * 2039e9)) == t.memory_s
    assert step_time(step, RTX4090).seconds == pytest.approx(1e12 / (0.85 * 1008e9))  # GDDR's share


def test_a_measured_peak_replaces_the_datasheet_and_its_share_is_not_applied_twice(gpt2_step):
    step = dataclasses.replace(gpt2_step, workload=dataclasses.replace(gpt2_step.workload,
                                                                       costs=_only(1e15, 1e6, MATMUL)))
    t = step_time(step, H100, calibration=Calibration(device="h100-sxm", tflops={"bf16": 700.0}, gbps=None))
    assert t.seconds == pytest.approx(1e15 / (0.57 / 0.8 * 700e12))  # no power cap: the GEMM ran at the board's clock
    assert "measured" in t.basis


def test_the_launch_floor_dominates_a_tiny_model(gpt2_step):
    """1,000 kernels of a 64x64 matmul (0.5 MFLOP, 48 KiB): nanoseconds of GPU time each, 5 us of launch."""
    tiny = _only(2 * 64**3, 3 * 64 * 64 * 4, MATMUL)
    costs = dataclasses.replace(tiny, count=tiny.count * 1000)
    step = dataclasses.replace(gpt2_step, workload=dataclasses.replace(gpt2_step.workload, costs=costs))
    t = step_time(step, H100)
    assert t.seconds == t.launch_s == pytest.approx(1000 * 5e-6)
    assert t.mfu == pytest.approx(1000 * 2 * 64**3 / (5e-3 * 989.5e12))


def test_no_rate_or_bandwidth_is_no_time(gpt2_step):
    assert step_time(gpt2_step, CATALOG.get("t4")) is None  # bf16 before Ampere


def _grads(n: int, sharding: str, gpus_params: float = 8e9):
    setup = Setup(micro_batch=2, seq=128, precision="bf16", gpus=n, sharding=sharding)
    w = simulate(ZooSource(zoo=get_model("gpt2")), capture_setup(setup), batch_model=False)
    return per_gpu(dataclasses.replace(w, trainable_params=int(gpus_params), params=int(gpus_params)), setup)


def _with_busbw(acc, gbps, node_gpus=8):
    fields = {f.name: getattr(acc, f.name) for f in dataclasses.fields(acc)}
    return types.SimpleNamespace(**{**fields, "allreduce_busbw_gbps": gbps, "allreduce_source": "test",
                                    "node_gpus": node_gpus})


def test_ring_all_reduce_of_8b_bf16_gradients():
    """2(n-1)/n x S / busbw: 8 x H100 ring at 370 GB/s ~76 ms; 8 PCIe RTX 5090 at 28 GB/s ~1.0 s (anchors A4)."""
    step = _grads(8, "ddp")
    volume, _ = comm_bytes(step)
    assert volume == 2 * 7 / 8 * 16e9
    assert step_time(step, _with_busbw(H100, 370.0)).comm_s == pytest.approx(0.0757, rel=0.01)
    assert step_time(step, _with_busbw(RTX5090, 28.0)).comm_s == pytest.approx(1.0, rel=0.01)
    # without a measured figure: NVLink 4's 450 GB/s per direction less ~20% protocol (nccl-tests#212)
    derived = allreduce_link(_with_busbw(H100, None), 8)
    assert derived.busbw_gbps == pytest.approx(370, rel=0.01) and "nccl-tests#212" in derived.source
    assert allreduce_link(_with_busbw(RTX5090, None), 4).busbw_gbps == pytest.approx(31.5, rel=0.01)  # PCIe 5 x16
    # the catalog's measured figures: a PCIe consumer card is an order of magnitude slower than NVLink, and
    # beyond the catalog's 4 cards a box the ring crosses a network
    assert step_time(step, RTX5090).comm_s > 5 * step_time(step, H100).comm_s
    assert allreduce_link(RTX5090, 8).busbw_gbps < allreduce_link(RTX5090, 4).busbw_gbps
    assert step_time(step, H100).comm_s == pytest.approx(volume / (H100.allreduce_busbw_gbps * 1e9))


def test_fsdp_moves_one_and_a_half_times_ddp_and_nodes_cap_the_bandwidth():
    assert comm_bytes(_grads(8, "fsdp"))[0] == pytest.approx(1.5 * comm_bytes(_grads(8, "ddp"))[0])
    assert comm_bytes(_grads(8, "zero2"))[0] == pytest.approx(comm_bytes(_grads(8, "ddp"))[0])
    assert allreduce_link(H100, 16).busbw_gbps < allreduce_link(H100, 8).busbw_gbps / 5  # 400 Gb/s IB per GPU


def test_backward_hides_most_of_the_all_reduce():
    step = _step("llama3.2-1b", Setup(micro_batch=4, seq=1024, precision="bf16", gpus=8))
    t = step_time(step, H100)
    assert 0 < t.exposed_comm_s < t.comm_s
    assert t.seconds == pytest.approx(t.compute_s + t.memory_s + t.launch_s + t.exposed_comm_s)
    assert 0.2 < t.mfu < 0.6


@pytest.fixture(scope="module")
def validation():
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "speed_validation.py"
    spec = importlib.util.spec_from_file_location("speed_validation", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_held_out_training_anchors_within_the_error_budget(validation):
    """Issue 12's target: median |error| <= 25%, worst <= 40% on anchors the efficiencies were not fitted on."""
    errors = [abs(validation.error(validation.predict(a), a.measured_tok_s_per_gpu))
              for a in validation.ANCHORS if a.id in validation.HELD_OUT]
    assert len(errors) == 3
    assert statistics.median(errors) <= 0.20 and max(errors) <= 0.25  # 13.9% / 16.6% (benchmarks/RESULTS.md)


def test_step_time_is_cheap_enough_for_every_gpu_and_count(validation):
    """recommend calls it ~400 times per run on one capture."""
    anchor = next(a for a in validation.ANCHORS if a.id == 3)
    step = validation.step_of(anchor)
    rows = [acc for acc in CATALOG]
    t = time.perf_counter()
    for acc in rows * (400 // len(rows) + 1):
        step_time(step, acc)
    assert time.perf_counter() - t < 2.0
    assert costmodel.efficiency("matmul", H100) == costmodel.efficiency("matmul", A100)  # one share; power differs
    assert costmodel.clock_share(H100)[0] < costmodel.clock_share(A100)[0] == 1.0


# a small Mixtral (issue 17): hidden 512, 4 experts of width 1024, top-2, 2 blocks, 2 x 128 tokens
_MOE = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 1000, "hidden_size": 512,
        "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
        "num_local_experts": 4, "num_experts_per_tok": 2}


def test_fp32_expert_matmuls_of_a_bf16_mixed_step_run_at_the_fp32_rate(tmp_path):
    pytest.importorskip("transformers")
    import json

    from gpuwise.planning.capture.tracker import MATMUL_FP32
    from gpuwise.planning.sources.hf import HFSource

    path = tmp_path / "mixtral.json"
    path.write_text(json.dumps(_MOE))
    h, ffn, k, layers, tokens = 512, 1024, 2, 2, 2 * 128
    # each routed (token, expert) row meets the expert's gate/up (h x 2 ffn) and down (ffn x h) matrices: 2 x 3 h ffn
    # FLOPs forward, twice that backward (the input's and the weights' gradients), each block
    hand = 3 * 2 * 3 * h * ffn * tokens * k * layers
    steps = {}
    for precision in ("bf16-mixed", "bf16"):
        setup = Setup(micro_batch=2, seq=128, precision=precision)
        steps[precision] = per_gpu(simulate(HFSource.from_path(path), setup, batch_model=False), setup)
    costs = steps["bf16-mixed"].workload.costs
    wide = costs.kind == MATMUL_FP32
    # fp32 master weights under bf16 autocast: the grouped expert matmuls take fp32 operands (autocast.py), and only
    # they; in pure bf16 none do
    assert float(costs.flops[wide] @ costs.count[wide]) == hand
    assert not (steps["bf16"].workload.costs.kind == MATMUL_FP32).any()
    mixed = steps["bf16-mixed"]
    only = dataclasses.replace(mixed, workload=dataclasses.replace(mixed.workload, costs=costs.where(wide)))
    t = step_time(only, H100)
    share = costmodel.clock_share(H100)[0]
    # at 0.57 x the fp32 rate (67 TFLOPS: allow_tf32 is off by default), not bf16's 989.5: 15x slower
    assert t.compute_s == pytest.approx(hand / (0.57 * share * 67.0e12)) == t.seconds
    assert "fp32 67 TFLOPS (allow_tf32 off" in t.basis
    whole = step_time(mixed, H100)
    assert whole.compute_s >= t.compute_s and "matmuls on fp32 operands" in whole.basis  # the rest: launch-bound
