"""Per-GPU memory under data parallelism, from a single-GPU timeline.

Sharding changes where the model states live, so it is applied to the weights, gradients and
optimizer columns of each sample (and to the optimizer's temporaries, which follow the shard):

- ``ddp``: every GPU holds everything, plus DDP's gradient buckets, one more copy of the gradients
  (``gradient_as_bucket_view=False`` is DDP's default; PyTorch DDP notes).
- ``zero1`` / ``zero2`` (DeepSpeed, Rajbhandari et al. 2020) and ``fsdp`` (FSDP2 ``fully_shard``
  with a bf16 ``MixedPrecisionPolicy``, = ZeRO-3) do not autocast: they compute with 16-bit
  parameters. So under mixed precision the step is captured in pure 16 bits (``capture_setup``) and
  the fp32 copies are added here.
  ZeRO-1: 16-bit model and gradients, fp32 master + Adam states sharded: 4P + KP/N (K = 12).
  States that follow the parameters' dtype (AdamW, SGD, Adafactor, Lion) are fp32 beside the master;
  bitsandbytes' 8-bit states are uint8 (and fp32 absmax) whatever the parameters are, so they stay
  as captured (K = 4 + 2 for AdamW8bit: the master and two bytes of state).
  ZeRO-2: the 16-bit gradients sharded too: 2P + (2 + K)P/N.
  FSDP: fp32 weights, gradients and states all sharded, 16P/N (frozen weights keep their dtype,
  sharded too), plus while forward and backward run the 16-bit parameters of the block computing
  and of the one prefetched, and in backward one block's unsharded fp32 gradient (reduce-scatter
  in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from gpuwise.planning.optimizers import SPECS
from gpuwise.planning.scaling import Timeline
from gpuwise.planning.setup import Setup
from gpuwise.planning.tracker import CATEGORIES
from gpuwise.planning.workload import Workload

W, G, OPT, T = (CATEGORIES.index(c) for c in ("weights", "gradients", "optimizer", "temporaries"))


def capture_setup(setup: Setup) -> Setup:
    """The single-GPU setup whose capture ``shard`` starts from. A sharded mixed step computes with 16-bit
    parameters: captured as pure bf16, fp16-mixed too (the same bytes; the run's setup, not this one, picks the
    catalog rate in the cost model)."""
    if setup.sharding != "ddp" and setup.mixed:
        return replace(setup, gpus=1, sharding="ddp", precision="bf16")
    return replace(setup, gpus=1, sharding="ddp")


def shard(tl: Timeline, setup: Setup, *, trainable_params: int, block_bytes: int, block_trainable_params: int
          ) -> Timeline:
    """The timeline one of ``setup.gpus`` GPUs sees under ``setup.sharding`` (``tl`` from ``capture_setup``)."""
    n = setup.gpus
    if n == 1 or not setup.training:
        return tl
    half = setup.compute_dtype.itemsize
    widen = 4 / half if setup.mixed and setup.sharding != "ddp" else 1.0  # 16-bit capture -> fp32 states
    widen_states = widen if SPECS[setup.optimizer].states_follow_params else 1.0
    grad_total = tl.base[:, G].max()
    phases = np.array([ph for ph, _ in tl.labels])
    opt = phases == "optimizer"

    def apply(x: np.ndarray, constant: float) -> np.ndarray:
        """Linear in each column; ``constant`` is 1 for the base, 0 for the slope (constants join the base only)."""
        x = x.copy()
        if setup.sharding == "ddp":
            x[:, G] += constant * grad_total
            return x
        x[opt, T] *= widen / n  # the optimizer steps its own shard, in fp32
        if setup.sharding in ("zero1", "zero2"):
            x[:, OPT] = (x[:, OPT] * widen_states + constant * (trainable_params * 4 if setup.mixed else 0)) / n
            if setup.sharding == "zero2":
                x[:, G] /= n
        else:  # fsdp: frozen weights (LoRA's base) keep their dtype, trainable ones get an fp32 master
            x[:, W] = (x[:, W] + constant * trainable_params * (widen - 1) * half) / n
            x[:, G] *= widen / n
            x[:, OPT] *= widen_states / n
            x[~opt, T] += constant * 2 * block_bytes  # this block and the prefetched one, gathered
            x[phases == "backward", T] += constant * block_trainable_params * (4 if setup.mixed else half)
        return x

    return replace(tl, base=apply(tl.base, 1.0), slope=apply(tl.slope, 0.0))


@dataclass(frozen=True, kw_only=True)
class PerGpu:
    """A captured Workload as each GPU of the run holds it: sharded once, then fitted on any number of GPUs."""

    workload: Workload  # captured with capture_setup(setup)
    setup: Setup  # the run: micro-batch, accumulation, GPUs and sharding
    timeline: Timeline = field(repr=False)  # exact at setup.micro_batch
    batch_model: Timeline | None = field(repr=False)  # affine in the micro-batch, when captured for it
    live: np.ndarray = field(repr=False)  # (samples, categories) bytes at setup.micro_batch
    peak_bytes: int  # the step's tensors at their peak
    paged_bytes: int = 0  # of which optimizer state in paged memory: the driver can evict it to the host


def per_gpu(w: Workload, setup: Setup) -> PerGpu:
    """``w`` (the capture of ``setup``) as one of ``setup.gpus`` GPUs holds it under ``setup.sharding``."""
    if w.setup != capture_setup(setup):
        raise ValueError(f"the workload was captured for {w.setup}, not for {capture_setup(setup)}")

    def sharded(tl: Timeline) -> Timeline:
        return shard(tl, setup, trainable_params=w.trainable_params, block_bytes=w.block_bytes,
                     block_trainable_params=w.block_trainable_params)

    timeline = sharded(w.timeline)
    live = timeline.live(setup.micro_batch)
    paged = w.paged_bytes // setup.gpus if setup.sharding != "ddp" else w.paged_bytes  # each rank its shard's
    return PerGpu(workload=w, setup=setup, timeline=timeline, live=live, peak_bytes=int(live.sum(axis=1).max()),
                  paged_bytes=paged,
                  batch_model=None if w.batch_model is None else sharded(w.batch_model))
