"""What the planner says of one training run, decided once before the Trainer starts: the micro-batch ``--auto``
chose, the FLOPs per step (MFU's numerator), the memory the step holds, and on a catalog GPU the planned step
time and whether the step fits; the remedies, and the step at an OOM retry's micro-batch, are planned from the same
``Planner`` session when first asked. The Trainer and the monitor ask the ``RunPlan``, never the planner.

>>> # run = plan_run(task.source, config, target, ranks=ranks, seq=task.seq, free_bytes=None, why="as asked")
>>> # run.flops_per_step, run.peak_bytes(run.setup.micro_batch)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING

from gpuwise.errors import GpuwiseError, NotApplicable
from gpuwise.hardware.catalog import Accelerator
from gpuwise.planning.capture.scaling import Timeline
from gpuwise.planning.capture.tracker import CATEGORIES, NONE
from gpuwise.planning.fit import fit_on
from gpuwise.planning.planner import Planner, RemedyGpu
from gpuwise.planning.remedies import Remedy, remedies
from gpuwise.planning.setup import Setup
from gpuwise.units import human_bytes

if TYPE_CHECKING:
    from gpuwise.hardware.device import Target
    from gpuwise.training.config import TrainConfig
    from gpuwise.training.distributed import Ranks


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """The plan of one process's step as the run takes it; every figure None where the planner could not capture
    the model (the run goes on without them)."""

    setup: Setup | None = None  # one process's step (gpus=1, ddp), the micro-batch decided
    micro_batch: int | None = None  # --auto's choice for the run (None: not asked, or the model was not captured)
    auto: str | None = None  # what --auto chose and why, in words
    flops_per_step: float | None = None  # per process, as the device's peak is: MFU's numerator
    # live bytes by category after each op, exact at setup.micro_batch
    memory: Timeline | None = field(default=None, repr=False, compare=False)
    # the same, affine in the micro-batch (--auto's capture): the peak at a micro-batch an OOM retry falls back to
    batch_memory: Timeline | None = field(default=None, repr=False, compare=False)
    gpu: str | None = None  # the catalog GPU the figures below are for (None off a catalog GPU)
    fits: bool | None = None
    step_s: float | None = None  # the cost model's step time on ``gpu`` (planning/cost/step.py)
    bytes_per_step: float | None = None
    kernels_per_step: int | None = None  # ops of the captured step that launch a kernel
    # the session and catalog row the figures came from: what an OOM (or the end of a monitored run) asks later, the
    # remedies and the step at a retry's micro-batch, is planned from them only then
    planner: Planner | None = field(default=None, repr=False, compare=False)
    row: Accelerator | None = field(default=None, repr=False, compare=False)

    @cached_property
    def remedies(self) -> tuple[Remedy, ...]:
        """Those that fit, in order; none where the step fits (or off the catalog). Planned on first use."""
        if self.fits is not False or self.planner is None or self.row is None or self.setup is None:
            return ()
        try:
            return tuple(r for r in remedies(self.setup, RemedyGpu(self.planner, self.row)) if r.fits)
        except (GpuwiseError, NotApplicable):
            return ()

    def at(self, micro: int) -> RunPlan:
        """The plan at another micro-batch (an OOM retry's, the same samples a step), from the same session."""
        if self.setup is None or self.planner is None or micro < 1 or micro == self.setup.micro_batch:
            return self
        per = self.setup.micro_batch * self.setup.grad_accum
        return planned(self.planner, replace(self.setup, micro_batch=micro, grad_accum=max(1, per // micro)),
                       self.row, micro_batch=self.micro_batch, auto=self.auto, batch_memory=self.batch_memory)

    def _live(self, micro: int):
        if self.setup is not None and micro == self.setup.micro_batch and self.memory is not None:
            return self.memory.live(micro), self.memory.labels
        if self.batch_memory is not None and micro >= 1:
            return self.batch_memory.live(micro), self.batch_memory.labels
        exact = self.at(micro)
        if exact is not self and exact.memory is not None:
            return exact.memory.live(micro), exact.memory.labels
        return None, ()

    def peak_bytes(self, micro: int) -> float | None:
        """The step's peak bytes at ``micro``: captured at the plan's micro-batch, from the batch model elsewhere."""
        live, _ = self._live(micro)
        return None if live is None else float(live.sum(axis=1).max())

    def oom_advice(self, micro: int, *, count: int = 3) -> str | None:
        """At an OOM on a catalog GPU: the plan's peak at ``micro`` by category and its first ``count`` remedies,
        each as the flags to add (or, where the plan fits, that another process may hold memory)."""
        live, labels = self._live(micro)
        plan = self.at(micro)
        if live is None or plan.gpu is None:
            return None
        i = int(live.sum(axis=1).argmax())
        phase, block = labels[i]
        parts = ", ".join(f"{k} {human_bytes(int(v))}" for k, v in zip(CATEGORIES, live[i], strict=True) if int(v))
        at = phase if block is None or block < 0 else f"{phase}, block {block}"
        text = f"the plan's peak at micro-batch {micro}: {human_bytes(int(live.sum(axis=1)[i]))} in {at} ({parts})"
        if plan.remedies:
            text += "; remedies in order: " + "; ".join(f"{r.name} ({r.flags})" if r.flags else r.name
                                                        for r in plan.remedies[:count])
        elif plan.fits:
            text += f"; the plan fits it on {plan.gpu}: another process may hold memory (nvidia-smi)"
        return text

    def oom_note(self, micro: int) -> list[str]:
        """What the plan adds to an OOM's explanation at ``micro``: its predicted peak, and its advice."""
        peak, advice = self.peak_bytes(micro), self.oom_advice(micro)
        return ([f"the plan predicted a peak of {human_bytes(peak)}"] if peak is not None else []) + (
            [advice] if advice else [])


def plan_run(source, config: TrainConfig, target: Target, *, ranks: Ranks, seq: int | None, free_bytes: int | None,
             why: str) -> RunPlan:
    """The run's plan, from one Planner session: with ``free_bytes`` (``--auto``) the largest micro-batch that fits
    them (every process takes the smallest process's choice), then the step at the decided micro-batch; ``why``
    says how the precision was decided (for the auto line)."""
    import torch

    from gpuwise.training.auto import choose
    from gpuwise.training.distributed import agree_min

    planner, world = Planner(source), ranks.world_size
    given: dict = {}
    if free_bytes is not None:
        try:
            choice = choose(planner, config.to_setup(gpus=world, seq=seq), free_bytes=free_bytes, gpu=target.gpu)
        except GpuwiseError as exc:
            given["auto"] = f"the planner could not capture the model ({exc.message}): the whole batch at once"
        else:
            asked = config.micro_batch
            micro = asked or agree_min(ranks, choice.micro_batch, torch.device(target.name))  # one choice for all
            config = replace(config, micro_batch=micro)
            given = {"micro_batch": micro, "batch_memory": choice.memory,
                     "auto": f"{config.precision} ({why}); {choice.reason}"
                             + (f" (--micro-batch {asked} as asked)" if asked else "")}
    one = replace(config.to_setup(gpus=world, seq=seq), gpus=1, sharding="ddp")  # one process's step
    return planned(planner, one, target.row if target.gpu else None, **given)


def planned(planner: Planner, setup: Setup, row: Accelerator | None, **given) -> RunPlan:
    """``setup`` (one process's step) from ``planner``'s capture; on the catalog GPU ``row`` its fit, step time and
    (where it does not fit) the remedies that do."""
    try:
        step = planner.per_gpu(setup)
    except (GpuwiseError, NotApplicable):  # the model cannot be captured: the run goes on without a plan
        return RunPlan(setup=setup, **given)
    w = step.workload
    figures = {"flops_per_step": w.flops_per_step, "memory": step.timeline, "planner": planner}
    if row is not None:
        try:
            fit = fit_on(step, row)
        except (GpuwiseError, NotApplicable):  # no figures on this GPU: the run goes on without them
            return RunPlan(setup=setup, **given, **figures)
        figures |= {"gpu": row.key, "row": row, "fits": fit.fits, "step_s": fit.step_time_s,
                    "bytes_per_step": float(w.bytes_per_step),
                    "kernels_per_step": int(w.costs.count[w.costs.kind != NONE].sum())}
    return RunPlan(setup=setup, **given, **figures)
