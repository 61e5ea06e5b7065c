"""ZeRO / FSDP model states, offload and HSDP on each GPU (planning/parallel/sharding.py), each against a reference
whose source is given: Rajbhandari et al. 2020 (ZeRO) for the bytes per parameter of each stage, DeepSpeed's ZeRO
estimators for offload, torchtitan's pipeline policy for FSDP under --pp, FSDP over one node for HSDP. The model
states on a small MLP; the rest on tiny models (fakes/small_models.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fakes.small_models import GPT, PLANNERS, SEQ
from gpuwise.models import get_model
from gpuwise.planning.capture.tracker import CATEGORIES
from gpuwise.planning.capture.workload import simulate
from gpuwise.planning.parallel.sharding import capture_setup, per_gpu
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.zoo import ZooSource

W, G, OPT, T = (CATEGORIES.index(c) for c in ("weights", "gradients", "optimizer", "temporaries"))
STATES = [CATEGORIES.index(c) for c in ("weights", "gradients", "optimizer")]
MLP = ZooSource(zoo=get_model("mlp"))


def _model_states(setup: Setup) -> tuple[float, int]:
    """Weights + gradients + optimizer state per GPU once all gradients exist, and the parameter count."""
    w = simulate(MLP, capture_setup(setup), batch_model=False)
    return float(per_gpu(w, setup).live[:, STATES].sum(axis=1).max()), w.params


@pytest.mark.parametrize(("setup", "bytes_per_param"), [
    (Setup(precision="bf16-mixed"), 16),  # ZeRO paper: 2 + 2 + 12; PyTorch AMP: 4 + 4 + 8
    (Setup(precision="fp32"), 16),  # 4 + 4 + 8
    (Setup(precision="bf16"), 8),  # pure bf16 AdamW: bf16 states, 2 + 2 + 4
    (Setup(precision="fp32", optimizer="sgd"), 12),  # weights, gradients, momentum
])
def test_model_states_bytes_per_parameter(setup, bytes_per_param):
    states, params = _model_states(setup)
    assert states == pytest.approx(bytes_per_param * params, rel=1e-4)


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize(("sharding", "formula"), [
    ("ddp", lambda p, n: 16 * p + 4 * p),  # + DDP's fp32 gradient buckets
    ("zero1", lambda p, n: 4 * p + 12 * p / n),  # Rajbhandari et al. 2020, P_os
    ("zero2", lambda p, n: 2 * p + 14 * p / n),  # P_os+g
    ("fsdp", lambda p, n: 16 * p / n),  # P_os+g+p
])
def test_zero_model_states_per_gpu(sharding, formula, n):
    states, params = _model_states(Setup(precision="bf16-mixed", gpus=n, sharding=sharding))
    assert states == pytest.approx(formula(params, n), rel=1e-3)


def test_fsdp_under_pipeline_keeps_the_stage_gathered():
    """torchtitan's reshard_after_forward_policy "default" with PP (torchtitan/models/llama3/infra/parallelize.py:
    "For PP, do not reshard after forward to avoid per-microbatch all-gathers") and pipelining's gradient sync on
    the last micro-batch only: the stage's bf16 parameters (2P) and its unsharded fp32 gradients (4P) on top of
    the 16P/N shard."""
    n = 4
    step = PLANNERS[GPT.name].per_gpu(Setup(micro_batch=1, grad_accum=2, seq=SEQ, gpus=2 * n, pp=2, stage=0,
                                            sharding="fsdp"))
    P = step.workload.trainable_params
    eof = step.live[step.timeline.end_of_forward]
    assert eof[W] == 2 * P + 4 * P // n and eof[OPT] == 8 * P // n
    assert step.live[:, G].max() == 4 * P  # accumulated unsharded until the last micro-batch's backward


FSDP_PP = Setup(micro_batch=1, grad_accum=4, seq=SEQ, gpus=4, pp=2, sharding="fsdp")


def _at_peak(step, col: int) -> float:
    return float(step.live[np.argmax(step.live.sum(axis=1)), col])


@pytest.mark.parametrize("offload", ["params", "optimizer"])
def test_offload_under_fsdp_pipeline_keeps_the_gathered_stage(offload):
    """torchtitan under PP keeps the stage's 16-bit parameters gathered and its gradients unsharded through the
    micro-batches: offload moves the sharded state to the host, not those (they were zeroed: gpt2 pp 2 --offload
    params showed weights and gradients 0, a peak 464 MiB low)."""
    planner = PLANNERS[GPT.name]
    kept = planner.per_gpu(FSDP_PP)
    off = planner.per_gpu(replace(FSDP_PP, offload=offload))
    w = planner.workload(FSDP_PP)
    assert _at_peak(off, G) == pytest.approx(_at_peak(kept, G))  # the accumulated fp32 gradients
    gathered = w.timeline.base[:, W].max()  # the stage's 16-bit parameters, as captured
    assert _at_peak(off, W) >= gathered > 0
    assert off.host_bytes > 0 and off.peak_bytes < kept.peak_bytes


def _states(step) -> tuple[int, int]:
    """Model-state bytes on the GPU at the start of forward (weights + gradients + optimizer), and on the host."""
    first = step.live[0]
    return int(first[W] + first[G] + first[OPT]), step.host_bytes


def test_offload_matches_deepspeed_estimators():
    """deepspeedai/DeepSpeed runtime/zero/stage_1_and_2.py estimate_zero2_model_states_mem_needs and stage3.py
    estimate_zero3_model_states_mem_needs (without their 1.5 buffer factor), mixed-precision Adam, N GPUs:
    ZeRO-2 + offload_optimizer: GPU 2P; ZeRO-3 + offload_optimizer: GPU 2P/N + 4LL (the gathered layer);
    ZeRO-3 + offload_param: GPU 4LL; the host per GPU 16P/N (offload_optimizer: fp32 master, m, v, fp32 grads).
    DeepSpeed's offload_param host figure is 18P/N (a 16-bit copy too): FSDP2's CPUOffloadPolicy keeps 16P/N."""
    n = 4
    planner = PLANNERS[GPT.name]
    base = Setup(micro_batch=1, seq=SEQ, gpus=n)
    P = planner.workload(replace(base, sharding="zero2", offload="optimizer")).trainable_params
    zero2 = planner.per_gpu(replace(base, sharding="zero2", offload="optimizer"))
    assert _states(zero2) == (2 * P, 16 * P // n)
    zero3 = planner.per_gpu(replace(base, sharding="fsdp", offload="optimizer"))
    gpu, host = _states(zero3)
    assert gpu == pytest.approx(2 * P / n, abs=1) and host == 16 * P // n
    ll = zero3.workload.block_bytes // 2  # largest layer's parameters (16-bit)
    assert zero3.live[zero3.timeline.end_of_forward, T] >= 4 * ll  # this block and the prefetched one, gathered
    params = planner.per_gpu(replace(base, sharding="fsdp", offload="params"))
    assert _states(params) == (0, 16 * P // n)
    assert params.peak_bytes < zero3.peak_bytes


def test_single_gpu_optimizer_offload_is_zero_offload():
    """ZeRO-Offload on one GPU (Ren et al. 2021: '10B on a single V100'): the GPU keeps the 16-bit weights and one
    block's gradients at a time; fp32 master, Adam states and fp32 gradients (16P) go to the host."""
    planner = PLANNERS[GPT.name]
    on_gpu = planner.per_gpu(Setup(micro_batch=1, seq=SEQ))
    off = planner.per_gpu(Setup(micro_batch=1, seq=SEQ, offload="optimizer"))
    P = off.workload.trainable_params
    assert off.live[0, W] == 2 * P and off.live[:, OPT].max() == 0 and off.host_bytes == 16 * P
    assert off.live[:, G].max() <= off.workload.block_trainable_params * 2
    assert off.peak_bytes < on_gpu.peak_bytes


def test_hsdp_is_fsdp_within_a_node():
    """HSDP on M nodes of k GPUs shards the model states as FSDP over k GPUs does (torchtitan's dp_shard x
    dp_replicate); the global batch spans all M x k."""
    planner = PLANNERS[GPT.name]
    hsdp = planner.per_gpu(Setup(micro_batch=1, seq=SEQ, gpus=8, sharding="fsdp", nodes=2))
    fsdp = planner.per_gpu(Setup(micro_batch=1, seq=SEQ, gpus=4, sharding="fsdp"))
    assert (hsdp.live == fsdp.live).all()
    assert hsdp.setup.shard_gpus == 4 and hsdp.setup.batch == 8
