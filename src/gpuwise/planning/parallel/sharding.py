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

Offload (``--offload``, host memory reported apart: ``PerGpu.host_bytes``, per GPU):
  ``optimizer``: ZeRO-Offload (Ren et al. 2021; DeepSpeed ``offload_optimizer``), on ZeRO-2 (a ``ddp``
  run on one GPU is ZeRO-2 over one) or ZeRO-3 (``fsdp``): the fp32 master, the optimizer states and
  the fp32 gradients live on the host, where the step runs (DeepSpeedCPUAdam, fused: no temporaries);
  the GPU keeps the 16-bit parameters (sharded under fsdp) and each block's 16-bit gradients until
  they are copied out. DeepSpeed's estimators: GPU 2P (ZeRO-2), 4LL + 2P/N (ZeRO-3); host 16P/N.
  ``params``: FSDP2's ``CPUOffloadPolicy`` (= ZeRO-3 ``offload_param``): the sharded parameters,
  gradients and states all on the host; the GPU holds the gathered blocks (and one block's gradients)
  only. DeepSpeed: GPU 4LL, host 18P/N (it keeps a 16-bit copy of the parameters there too; FSDP2
  keeps the fp32 shard only: 16P/N).
FSDP under pipeline parallelism runs as torchtitan runs it (``reshard_after_forward_policy`` "default" with PP):
the stage's 16-bit parameters are gathered once and kept through every micro-batch, and the gradients accumulate
unsharded (fp32 under mixed precision) until the last micro-batch's backward reduce-scatters them.
HSDP (``--nodes M`` with fsdp): the states shard over the GPUs of one node's data-parallel group
(``Setup.shard_gpus``) and are replicated across nodes: per GPU what FSDP over that group holds.
Tensor, pipeline and context parallelism change the capture itself (planning/parallel/); the
data-parallel degree is what is left, ``gpus / (tp x pp x cp)``.
Expert parallelism (``--ep``) changes the capture too: the GPU holds E / ep of the routed experts (planning/parallel/).
Their states then shard over the ``shard_gpus / ep`` ranks of torchtitan's ``dp_shard_mod_ep`` mesh, the others'
over all ``shard_gpus`` (``dp_shard_cp``): with Pn the captured non-expert parameters and Pe the captured
expert ones (``Workload.expert_params``), each state column, a sum over both in proportion to their parameters,
divides by ``shard_gpus x (Pn + Pe) / (Pn + ep Pe)`` (``state_divisor``): per GPU Pn / N + Pe / (N / ep), i.e. the
whole model's states over N as without EP (EP saves the experts' all-gathers, not their shards). DDP replicates
what the GPU holds; DDP's buckets and FSDP's gathered blocks are of the captured (E / ep) experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from gpuwise.planning.capture.optimizers import SPECS
from gpuwise.planning.capture.scaling import Timeline
from gpuwise.planning.capture.tracker import CATEGORIES
from gpuwise.planning.capture.workload import Workload
from gpuwise.planning.parallel.pipeline import in_flight
from gpuwise.planning.setup import Setup

W, G, OPT, T = (CATEGORIES.index(c) for c in ("weights", "gradients", "optimizer", "temporaries"))


def capture_setup(setup: Setup) -> Setup:
    """The setup whose capture ``shard`` starts from: one GPU of the run, data parallelism and offload taken out
    (tensor, pipeline and context parallelism stay: they change what the GPU runs). A sharded or offloaded mixed
    step computes with 16-bit parameters: captured as pure bf16, fp16-mixed too (the same bytes; the run's setup,
    not this one, picks the catalog rate in the cost model)."""
    # --ep stays (the GPU holds E / ep experts), with the ep data-parallel ranks it borrows
    one = replace(setup, gpus=setup.tp * setup.pp * setup.cp * setup.ep, sharding="ddp", nodes=1, offload="none")
    if (setup.sharding != "ddp" or setup.offload != "none") and setup.mixed:  # fp8: its linears in fp8 still
        return replace(one, precision="fp8-bf16" if setup.spec.float8 else "bf16")
    return one


def state_divisor(setup: Setup, params: int, expert_params: int) -> float:
    """What a sharded state column divides by: ``shard_gpus``, less where --ep leaves the experts' states fewer ranks
    to shard over (module docstring): ``shard_gpus x (Pn + Pe) / (Pn + ep Pe)``."""
    n = setup.shard_gpus
    if setup.ep == 1 or not expert_params:
        return n
    return n * params / (params - expert_params + setup.ep * expert_params)


def shard(tl: Timeline, setup: Setup, *, trainable_params: int, block_bytes: int, block_trainable_params: int,
          params: int = 0, expert_params: int = 0) -> tuple[Timeline, int]:
    """The timeline one GPU of ``setup`` sees under ``setup.sharding`` and ``setup.offload`` (``tl`` from
    ``capture_setup``), and the host memory that GPU's process holds for it (bytes). ``params`` and ``expert_params``
    (the captured GPU's, all and routed experts') matter under --ep only."""
    n = state_divisor(setup, params, expert_params)
    mode = setup.sharding
    if setup.offload == "optimizer" and mode == "ddp":
        mode = "zero2"  # ZeRO-Offload on one GPU: DeepSpeed's stage 2 over one rank
    if not setup.training or (mode == "ddp" and setup.dp * setup.cp == 1):  # context-parallel ranks reduce too
        return tl, 0
    half = setup.compute_dtype.itemsize
    widen = 4 / half if setup.mixed and mode != "ddp" else 1.0  # 16-bit capture -> fp32 states
    widen_states = widen if SPECS[setup.optimizer].states_follow_params else 1.0
    grad_total = tl.base[:, G].max()
    phases = np.array([ph for ph, _ in tl.labels])
    opt = phases == "optimizer"
    master = trainable_params * 4 if setup.mixed else 0  # the fp32 copy a 16-bit step updates
    host = 0.0
    if setup.offload == "optimizer":  # the states (with the master) and fp32 gradients, this GPU's shard
        host = (tl.base[:, OPT].max() * widen_states + master + trainable_params * (4 if setup.mixed else half)) / n
    elif setup.offload == "params":  # FSDP2: the whole sharded state, as the fsdp columns below hold it
        host = (tl.base[:, W].max() + trainable_params * (widen - 1) * half + tl.base[:, G].max() * widen
                + tl.base[:, OPT].max() * widen_states) / n

    def apply(x: np.ndarray, constant: float) -> np.ndarray:
        """Linear in each column; ``constant`` is 1 for the base, 0 for the slope (constants join the base only)."""
        x = x.copy()
        stage = None  # (gathered 16-bit parameters, unsharded gradients) of a pipeline stage under fsdp
        if mode == "ddp":
            x[:, G] += constant * grad_total
            return x
        x[opt, T] *= widen / n  # the optimizer steps its own shard, in fp32
        if mode in ("zero1", "zero2"):
            x[:, OPT] = (x[:, OPT] * widen_states + constant * master) / n
            if mode == "zero2":
                x[:, G] /= n
        else:  # fsdp: frozen weights (LoRA's base) keep their dtype, trainable ones get an fp32 master
            unsharded = x[:, W].copy()  # the 16-bit parameters as captured
            x[:, W] = (x[:, W] + constant * trainable_params * (widen - 1) * half) / n
            x[:, G] *= widen / n
            x[:, OPT] *= widen_states / n
            x[phases == "backward", T] += constant * block_trainable_params * (4 if setup.mixed else half)
            if setup.pp > 1:  # torchtitan under PP: no reshard after forward, gradients reduced after the last
                # micro-batch (pipelining's backward_maybe_with_nosync): the stage's 16-bit parameters stay gathered
                # through the step, its gradients accumulate unsharded in the reduce dtype
                x[~opt, W] += unsharded[~opt]
                x[~opt, G] *= n
                stage = unsharded[~opt], x[~opt, G].copy()
            else:
                x[~opt, T] += constant * 2 * block_bytes  # this block and the prefetched one, gathered
        if setup.offload == "optimizer":  # states and master on the host; gradients leave block by block
            if mode == "fsdp":
                x[:, W] -= constant * trainable_params * (widen - 1) * half / n  # no fp32 master on the GPU
                x[:, G] = np.minimum(x[:, G] / widen, constant * block_trainable_params * half)
            else:
                x[:, G] = np.minimum(x[:, G], constant * block_trainable_params * half)
            x[:, OPT] = 0
            x[opt, T] = 0  # the step runs on the host
        elif setup.offload == "params":  # only the gathered blocks (in T) stay on the GPU
            x[:, [W, G, OPT]] = 0
            x[opt, T] = 0
        if stage is not None:  # under PP the gathered stage and its accumulated gradients stay on the GPU, offload
            # or not (torchtitan keeps them through the step; only the sharded state moves to the host)
            x[~opt, W] = np.maximum(x[~opt, W], stage[0])
            x[~opt, G] = stage[1]
        return x

    return replace(tl, base=apply(tl.base, 1.0), slope=apply(tl.slope, 0.0)), int(host)


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
    host_bytes: int = 0  # host memory this GPU's process holds for offloaded state (--offload); not in the fit


def per_gpu(w: Workload, setup: Setup) -> PerGpu:
    """``w`` (the capture of ``setup``) as one of ``setup.gpus`` GPUs holds it under ``setup.sharding``."""
    if w.setup != capture_setup(setup):
        raise ValueError(f"the workload was captured for {w.setup}, not for {capture_setup(setup)}")

    def sharded(tl: Timeline) -> tuple[Timeline, int]:
        tl = in_flight(tl, setup)
        return shard(tl, setup, trainable_params=w.trainable_params, block_bytes=w.block_bytes,
                     block_trainable_params=w.block_trainable_params, params=w.params, expert_params=w.expert_params)

    timeline, host = sharded(w.timeline)
    live = timeline.live(setup.micro_batch)
    # each rank its shard's, over the same divisor as the optimizer column it is part of (fewer ranks for the
    # experts' states under --ep)
    paged = int(w.paged_bytes / state_divisor(setup, w.params, w.expert_params)) if setup.sharding != "ddp" \
        else w.paged_bytes
    if setup.offload != "none":  # the optimizer state is on the host (Setup refuses bitsandbytes' with --offload)
        paged = 0
    return PerGpu(workload=w, setup=setup, timeline=timeline, live=live, peak_bytes=int(live.sum(axis=1).max()),
                  paged_bytes=paged, host_bytes=host,
                  batch_model=None if w.batch_model is None else sharded(w.batch_model)[0])
