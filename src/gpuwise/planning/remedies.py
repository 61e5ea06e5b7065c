"""What to change when a step does not fit: small ``Setup -> Setup | None`` steps, tried in order, each on top
of the ones before, each row with the flags that run it in ``gpuwise plan`` and ``gpuwise train``.

>>> [r.name for r in remedies(setup, gpu)]                                             # doctest: +SKIP
['bf16 mixed precision', 'activation checkpointing', 'FSDP over 8 GPUs (global batch 8)', ...]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Protocol

from gpuwise.errors import NotApplicable
from gpuwise.planning.fit import OVERHEAD_BYTES, GpuFit, Status
from gpuwise.planning.setup import MAX_ACCUM, Setup, largest_micro_batch
from gpuwise.precision import half_precision

FSDP_GPUS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Gpu(Protocol):
    """The GPU the remedies are for: fits a setup of the model planned (NotApplicable if the model cannot take it)."""

    bf16: bool  # the GPU has bf16 (Ampere and later)

    def fit(self, setup: Setup, *, batch_model: bool = False) -> GpuFit:
        """``batch_model``: with the largest micro-batch (``GpuFit.max_batch``), which costs a second capture."""
        ...


@dataclass(frozen=True, kw_only=True)
class Remedy:
    name: str
    flags: str  # every flag to add to the user's command for this setup
    setup: Setup
    peak_bytes: int
    required_bytes: int
    status: Status

    @property
    def fits(self) -> bool:
        return self.status != "no"


def setup_flags(setup: Setup, base: Setup) -> str:
    """The flags that, added to the command that gave ``base``, give ``setup`` in ``gpuwise plan`` and ``train``.

    The batch speaks the shared vocabulary: ``--batch`` (global) when it changes, ``--micro-batch`` when the
    split does. A command without accumulation may have given either alone (``--batch 8`` or ``--micro-batch
    8``), so once a remedy accumulates, both are stated; a command with accumulation gave both already.

    >>> setup_flags(Setup(micro_batch=2, grad_accum=4, checkpointing="full"), Setup(micro_batch=8))
    '--batch 8 --micro-batch 2 --checkpointing full'
    """
    both_given = base.grad_accum > 1
    newly_split = setup.grad_accum > 1 and not both_given
    flags = []
    for f in fields(Setup):
        value, old = getattr(setup, f.name), getattr(base, f.name)
        if f.name == "grad_accum":
            continue  # what --batch leaves over --micro-batch x --gpus
        if f.name == "micro_batch":
            if setup.batch != base.batch or newly_split:
                flags.append(f"--batch {setup.batch}")
            if value != old or newly_split:
                flags.append(f"--micro-batch {value}")
            continue
        lora = f.name == "lora_rank" and setup.task == "finetune-lora" and base.task != "finetune-lora"
        # --qlora as PEFT runs it turns checkpointing on unless --checkpointing is given (Setup.recipe_defaults)
        peft_none = f.name == "checkpointing" and setup.peft_qlora and value == "none"
        if value == old and not lora and not peft_none:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "")
        else:
            flags.append(f"{flag} {value}")
    return " ".join(f for f in flags if f)


def _split(s: Setup, micro: int, per_gpu: int) -> Setup:
    """``s`` with ``per_gpu`` samples per GPU per optimizer step, ``micro`` at a time."""
    return replace(s, micro_batch=micro, grad_accum=per_gpu // micro)


def _largest_micro(s: Setup, per_gpu: int, gpu: Gpu) -> int:
    """The largest micro-batch that fits ``gpu`` and divides ``per_gpu`` samples (0 if none)."""
    if per_gpu == 1 or not s.training:
        fit = gpu.fit(replace(s, micro_batch=1, grad_accum=1), batch_model=per_gpu > 1)
        return 0 if not fit.fits else 1 if per_gpu == 1 else min(fit.max_batch, per_gpu)
    # captured with accumulation: from the second micro-batch on, the first one's gradients are alive
    fit = gpu.fit(replace(s, micro_batch=per_gpu, grad_accum=2), batch_model=True)
    return largest_micro_batch(per_gpu, fit.max_batch)


def mixed_precision(s: Setup, gpu: Gpu) -> Setup | None:
    """fp32 or tf32 -> 16-bit autocast: bf16 where the GPU has it, else fp16 with a GradScaler."""
    return replace(s, precision=half_precision(bf16=gpu.bf16)) if s.spec.compute == "fp32" else None


def checkpointing(s: Setup, gpu: Gpu) -> Setup | None:
    """Selective checkpointing (torchtitan's op policy) where it fits with room to spare: it recomputes less than
    whole blocks, so it runs faster; else every block whole. Selective keeps at least what full keeps, so it is
    captured only when full checkpointing fits with room."""
    if s.checkpointing != "none":
        return None
    full, selective = replace(s, checkpointing="full"), replace(s, checkpointing="selective")
    try:
        if gpu.fit(full).status == "fits" and gpu.fit(selective).status == "fits":
            return selective
    except NotApplicable:
        pass
    return full


def accumulation(s: Setup, gpu: Gpu) -> Setup | None:
    """The same batch in smaller micro-batches (not with the optimizer in backward: it cannot accumulate)."""
    if s.optimizer_in_backward:
        return None
    per_gpu = s.micro_batch * s.grad_accum
    micro = _largest_micro(s, per_gpu, gpu) if s.micro_batch > 1 else 0
    return _split(s, micro, per_gpu) if 0 < micro < s.micro_batch and per_gpu // micro <= MAX_ACCUM else None


def fsdp(s: Setup, gpu: Gpu) -> Setup | None:
    """The fewest GPUs that fit with room to spare, else the fewest that fit tightly, else the last tried; the
    global batch kept (at least one sample per GPU). Not with the optimizer in backward: planned on one GPU."""
    if s.optimizer_in_backward or s.nodes > 1:  # HSDP: the user chose how the states shard
        return None
    best: tuple[Setup, GpuFit] | None = None
    for n in FSDP_GPUS:  # data-parallel GPUs, each a --tp x --pp x --cp group
        if n * s.cp % s.ep:  # --ep borrows from the data- and context-parallel GPUs: it must divide them
            continue
        per_gpu = max(s.batch // n, 1)
        sharded = replace(s, gpus=n * s.tp * s.pp * s.cp, sharding="fsdp")
        try:
            micro = max(_largest_micro(sharded, per_gpu, gpu), 1)
            if per_gpu // micro > MAX_ACCUM:
                continue
            sharded = _split(sharded, micro, per_gpu)
            fit = gpu.fit(sharded)
        except NotApplicable:
            break
        if best is None or not best[1].fits or fit.status == "fits":  # a tight fit stays; a misfit gives way
            best = sharded, fit
        if fit.status == "fits":
            break
    return None if best is None else best[0]


def _adapter_precision(s: Setup) -> str:
    """LoRA in the run's precision; bf16 autocast where the run trains in fp8 (torchao's float8: full training)."""
    return "bf16-mixed" if s.spec.float8 else s.precision


def lora(s: Setup, gpu: Gpu) -> Setup | None:  # not under --ep: expert parallelism is planned for full training
    return replace(s, task="finetune-lora", precision=_adapter_precision(s)) if s.task == "train" and s.ep == 1 \
        else None


def qlora(s: Setup, gpu: Gpu) -> Setup | None:
    return (replace(s, task="finetune-lora", qlora=True, precision=_adapter_precision(s))
            if s.task == "train" and s.ep == 1 else None)


def quantized_weights(s: Setup, gpu: Gpu) -> Setup | None:
    """Inference with the blocks' linear layers in 8 bits (bitsandbytes LLM.int8) where that fits with room to spare,
    else in 4 (NF4): weight-only quantisation as people serve on one card (planning/transforms/quantize.py)."""
    if s.training or s.weights is not None or gpu.fit(s).fits:  # a smaller batch that fits, even tightly, is kept
        return None
    int8 = replace(s, weights="int8")
    return int8 if gpu.fit(int8).status == "fits" else replace(s, weights="nf4")


def smaller_batch(s: Setup, gpu: Gpu) -> Setup | None:
    micro = _largest_micro(s, s.micro_batch, gpu) if s.micro_batch > 1 else 0
    return replace(s, micro_batch=micro) if micro else None


def _model_split(s: Setup) -> str:
    """"tp 2 x pp 2", the tensor/pipeline/context split of ``s`` ("" without one)."""
    return " x ".join(f"{k} {n}" for k, n in (("tp", s.tp), ("pp", s.pp), ("cp", s.cp)) if n > 1)


def _where(s: Setup) -> str:
    """Where a LoRA row runs: "one GPU", or the GPUs and the split the run keeps ("2 GPUs (tp 2)")."""
    if s.gpus == 1:
        return "one GPU"
    split = _model_split(s)
    return f"{s.gpus} GPUs" + (f" ({split})" if split else "")


def _fsdp_name(s: Setup) -> str:
    """The GPUs FSDP really shards the states over (the data- and context-parallel ranks), and the split kept."""
    split = _model_split(s)
    over = f"FSDP over {s.shard_gpus} GPU{'s' if s.shard_gpus > 1 else ''}"
    return over + (f" x {split} = {s.gpus} GPUs" if split else "") + f" (global batch {s.batch})"


def _rest_dtype(s: Setup) -> str:
    return s.spec.compute if s.spec.compute in ("bf16", "fp16") else "fp32"


@dataclass(frozen=True, kw_only=True)
class Step:
    change: Callable[[Setup, Gpu], Setup | None]  # None: does not apply
    name: Callable[[Setup], str]  # the row's name, from the setup the change gives
    keep: bool = True  # the steps after build on it (FSDP and LoRA do not: LoRA starts from the one-GPU step)
    while_short: bool = False  # only while the rows before leave no room to spare
    # the change as a search that sizes the batch and picks the GPUs itself tries it (recommend): no fit needed;
    # None where the search decides it otherwise (the precision per GPU, the micro-batch per count)
    setting: Callable[[Setup], Setup | None] | None = None
    knob: str = ""  # the Setup field the step sets: a search leaves the step out where the user gave that field


def _whole_blocks(s: Setup) -> Setup | None:
    """Checkpointing in a search: every block whole (judging selective's room takes a fit)."""
    return replace(s, checkpointing="full") if s.checkpointing == "none" else None


def _sharded(s: Setup) -> Setup | None:
    """FSDP in a search over GPU counts: the same GPUs, the states sharded (as ``fsdp``, not with the optimizer in
    backward, nor across nodes)."""
    if s.gpus == 1 or s.sharding == "fsdp" or s.optimizer_in_backward or s.nodes > 1:
        return None
    return replace(s, sharding="fsdp")


TRAINING: tuple[Step, ...] = (
    Step(change=mixed_precision, name=lambda s: f"{s.spec.compute} mixed precision"),
    Step(change=checkpointing, name=lambda s: "activation checkpointing"
         + (" (selective: torchtitan's op policy)" if s.checkpointing == "selective" else ""),
         setting=_whole_blocks, knob="checkpointing"),
    Step(change=accumulation, while_short=True,
         name=lambda s: f"micro-batch {s.micro_batch} x {s.grad_accum} accumulation (same batch)"),
    Step(change=fsdp, keep=False, while_short=True, name=_fsdp_name, setting=_sharded, knob="sharding"),
    Step(change=lora, keep=False, name=lambda s: f"LoRA rank {s.lora_rank}, {_where(s)} (fine-tuning only)"),
    Step(change=qlora, keep=False, name=lambda s: f"QLoRA, 4-bit base, {_where(s)} (fine-tuning only)"),
)
INFERENCE: tuple[Step, ...] = (
    Step(change=smaller_batch, name=lambda s: f"smaller batch {s.micro_batch}"),
    Step(change=quantized_weights,
         name=lambda s: f"{s.weights} weights in the blocks (embeddings and head {_rest_dtype(s)})"),
)


def settings(setup: Setup, *, given: frozenset[str] = frozenset()) -> list[Setup]:
    """The setups a search tries on a fixed number of GPUs, in the remedies' order: each step's ``setting`` that
    applies, a later step only once every combination of the earlier ones was tried; a step whose ``knob`` the
    user ``given`` is left out.

    >>> [(s.sharding, s.checkpointing) for s in settings(Setup(gpus=2))]
    [('ddp', 'none'), ('ddp', 'full'), ('fsdp', 'none'), ('fsdp', 'full')]
    """
    out = [setup]
    for step in TRAINING:
        if step.setting is not None and step.knob not in given:
            out += [changed for s in out if (changed := step.setting(s)) is not None]
    return out


def remedies(setup: Setup, gpu: Gpu) -> tuple[Remedy, ...]:
    """The steps that apply to ``setup``, in order, each on top of the kept ones before; a step whose change
    the model cannot take (LoRA without linear layers in its blocks, ...) is left out."""
    out: list[Remedy] = []
    s = setup
    for step in TRAINING if setup.training else INFERENCE:
        if step.while_short and out and out[-1].status == "fits":  # a tight fit goes on: more may leave room
            continue
        try:
            changed = step.change(s, gpu)
            if changed is None:
                continue
            fit = gpu.fit(changed)
        except NotApplicable:
            continue
        out.append(Remedy(name=step.name(changed), flags=setup_flags(changed, setup), setup=changed,
                          peak_bytes=fit.required_bytes - OVERHEAD_BYTES, required_bytes=fit.required_bytes,
                          status=fit.status))
        if step.keep:
            s = changed
    return tuple(out)
