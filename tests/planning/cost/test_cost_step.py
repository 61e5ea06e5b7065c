"""The step-time assembly (cost/step.py): each row priced by the kernel model (cost/kernels.py, checked against
measured kernels in test_kernels.py) at the precision PyTorch runs it in, phases that take the longer of their
kernels and their eager launches, and the collectives of cost/comm.py (test_comm.py)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from gpuwise.hardware.calibration import Calibration
from gpuwise.hardware.catalog import load_catalog
from gpuwise.models import get_model
from gpuwise.planning.capture.tracker import (
    F_BMM,
    F_CONV,
    F_ELEMENTWISE,
    F_MATMUL,
    FAMILIES,
    MATMUL,
    MATMUL_FP32,
    OTHER,
    OpCosts,
)
from gpuwise.planning.capture.workload import simulate
from gpuwise.planning.cost import kernels
from gpuwise.planning.cost.step import LAUNCH_S, step_time
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


CHIP_H100 = kernels.Chip.of(H100)


def _only(flops: float, nbytes: float, kind: int, family: int, dims=(0, 0, 0, 0), count: float = 1) -> OpCosts:
    one = np.ones(1)
    return OpCosts(flops=one * flops, bytes=one * nbytes, kind=np.array([kind], np.int8),
                   phase=np.zeros(1, np.int8), count=one * count, family=np.array([family], np.int8),
                   dims=np.array([dims], dtype=np.float64))


def _with(step, costs):
    return dataclasses.replace(step, workload=dataclasses.replace(step.workload, costs=costs))


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


def test_a_gemm_row_is_priced_by_the_kernel_model(gpt2_step):
    """One 8192^3 bf16 GEMM: the step is the kernel model's time for it (its launch hides under it), all forward, all
    matmul; below the roofline's peak and above it by no more than the best-shape share (stas00's list: 794.5 of
    989.5 TFLOPS on an H100 SXM)."""
    d = 8192
    step = _with(gpt2_step, _only(2 * d**3, 3 * d * d * 2, MATMUL, F_MATMUL, (1, d, d, d)))
    t = step_time(step, H100)
    alone = kernels.kernel_seconds(np.array([F_MATMUL], np.int8), np.array([kernels.RATE_KEYS.index("bf16")], np.int8),
                                   *np.array([[1], [d], [d], [d]], float), np.array([2.0 * d**3]),
                                   np.array([6.0 * d * d]), CHIP_H100)[0]
    assert t.seconds == pytest.approx(alone) == t.phases_s["forward"]
    assert set(t.families_s) == {"matmul"} and t.model == "kernels"
    assert 0.5 < 2 * d**3 / t.seconds / 989.5e12 < 794.5 / 989.5 * 1.05


def test_pytorch_defaults_decide_the_precision_of_fp32_rows(gpt2_step):
    """fp32 operands: a matmul on the SIMT units (torch.backends.cuda.matmul.allow_tf32 False), but --precision tf32
    on the tensor cores; a convolution on TF32 either way (torch.backends.cudnn.allow_tf32 True)."""
    d = 4096
    mm = _only(2 * d**3, 3 * d * d * 4, MATMUL_FP32, F_MATMUL, (1, d, d, d))
    conv = _only(2 * d**3, 3 * d * d * 4, MATMUL_FP32, F_CONV, (1, d, d, d))
    fp32, tf32 = (_step("gpt2", Setup(micro_batch=2, seq=128, precision=p)) for p in ("fp32", "tf32"))
    assert step_time(_with(fp32, mm), A100).seconds > 4 * step_time(_with(tf32, mm), A100).seconds
    assert step_time(_with(fp32, conv), A100).seconds == pytest.approx(step_time(_with(tf32, conv), A100).seconds)
    # the SIMT rate: within the fp32 datasheet (19.5 TFLOPS on an A100), above half of it for a large GEMM
    assert 0.5 * 19.5e12 < 2 * d**3 / step_time(_with(fp32, mm), A100).seconds < 19.5e12


def test_a_memory_bound_row_moves_its_bytes_at_most_at_the_bandwidth(gpt2_step):
    step = _with(gpt2_step, _only(0, 1e10, OTHER, F_ELEMENTWISE))
    t = step_time(step, A100)
    assert 1e10 / 2039e9 < t.seconds < 1e10 / (0.6 * 2039e9)
    assert set(t.families_s) == {"elementwise"}


def test_eager_launches_bound_a_tiny_model(gpt2_step):
    """1,000 forward kernels of a 64x64 matmul: microseconds of GPU time each, more of the CPU's launching them."""
    step = _with(gpt2_step, _only(2 * 64**3, 3 * 64 * 64 * 2, MATMUL, F_MATMUL, (1, 64, 64, 64), count=1000))
    t = step_time(step, H100)
    # an eager forward linear: NeuSight's hosts took 45-88 us from Python to its kernel (median over hosts 51 us)
    assert 45e-6 < t.seconds / 1000 < 88e-6
    assert t.families_s["launch"] > 0 and t.families_s["launch"] + t.families_s["matmul"] == pytest.approx(t.seconds)
    # compiled, inductor's wrapper launches the kernels at the C++ launch cost, far below Python's: the GPU's time or
    # the launches', whichever is longer
    compiled = step_time(dataclasses.replace(step, setup=dataclasses.replace(step.setup, compile=True)), H100)
    assert compiled.seconds == pytest.approx(max(1000 * LAUNCH_S[0], t.families_s["matmul"]))
    assert compiled.seconds < t.seconds / 5


def test_a_measured_rate_rescales_the_gemms(gpt2_step):
    d = 8192
    step = _with(gpt2_step, _only(2 * d**3, 3 * d * d * 2, MATMUL, F_MATMUL, (1, d, d, d)))
    base = step_time(step, H100).seconds
    half = step_time(step, H100, calibration=Calibration(device="h100-sxm", tflops={"bf16": 0.5 * 2 * d**3 / base
                                                                                      / 1e12}, gbps=None))
    assert half.seconds == pytest.approx(2 * base, rel=0.02) and "calibrate" in half.basis


def test_no_rate_is_no_time_and_a_gpu_without_sm_facts_falls_back_to_the_roofline(gpt2_step):
    assert step_time(gpt2_step, CATALOG.get("t4")) is None  # bf16 before Ampere
    tpu = step_time(gpt2_step, CATALOG.get("tpu-v5p"))
    assert tpu.model == "roofline" and "roofline op by op" in tpu.basis
    assert tpu.seconds >= tpu.bound_s


def test_phases_add_up_and_data_parallel_hides_part_of_its_all_reduce():
    one = _step("llama3.2-1b", Setup(micro_batch=4, seq=1024, precision="bf16"))
    step = _step("llama3.2-1b", Setup(micro_batch=4, seq=1024, precision="bf16", gpus=8))
    t = step_time(step, H100)
    assert t.seconds == pytest.approx(sum(t.phases_s.values()))
    assert 0 < t.exposed_comm_s < t.comm_s and t.phases_s["communication"] == t.exposed_comm_s
    single = step_time(one, H100)
    assert single.phases_s["communication"] == 0 and 0.7 < single.seconds / t.seconds < 1.0  # scaling below perfect
    assert 0.2 < t.mfu < 0.7


def test_step_time_is_cheap_enough_for_every_gpu_and_count(gpt2_step):
    """recommend calls it once per GPU and count on one capture."""
    rows = list(CATALOG)
    start = time.perf_counter()
    for acc in rows * 2:
        step_time(gpt2_step, acc)
    assert time.perf_counter() - start < 2.0
    assert set(FAMILIES) >= set(step_time(gpt2_step, H100).families_s) - {"launch"}


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
    fp32 = kernels.RATE_KEYS.index("fp32")
    c = only.workload.costs
    b, m, n, k = c.dims.T
    alone = kernels.kernel_seconds(c.family, np.full(len(c), fp32, np.int8), b, m, n, k, c.flops, c.bytes, CHIP_H100)
    # on the SIMT fp32 units (allow_tf32 is off by default), not bf16's tensor cores: slower, though these small
    # GEMMs (a few hundred tokens an expert) are far from the 15x of the two peaks: their waves are latency-bound
    assert t.families_s["bmm"] == pytest.approx(float(alone[c.family == F_BMM] @ c.count[c.family == F_BMM]))
    bf16 = np.full(len(c), kernels.RATE_KEYS.index("bf16"), np.int8)
    assert t.families_s["bmm"] > 1.5 * float(kernels.kernel_seconds(c.family, bf16, b, m, n, k, c.flops, c.bytes,
                                                                      CHIP_H100)[c.family == F_BMM]
                                              @ c.count[c.family == F_BMM])
