"""Training: every catalog accelerator and GPU count ranked for one workload.

One capture of the step serves every GPU and count (the step is captured on fake tensors, independent of the
device; sharding and the cost model apply after). For each accelerator and count the search walks plan's remedies
(planning/remedies.py ``settings``: DDP, then with activation checkpointing, then FSDP over the same GPUs, then FSDP
with checkpointing) in the mixed precision the GPU has, at the largest micro-batch that fits, the rest accumulated,
and prices the first that fits: time to the goal, rent, purchase, energy, tokens per joule. Rows that cannot run are
kept with the reason.

A Mixture of Experts trains at its captured step's FLOPs, which are the routed tokens' (each token through its
top-k experts: about 6 x N_active a token plus attention, planning/test_experts.py), never 6 x N_total: the cost model
(cost/step.py ``step_time``) prices every captured op, and no parameter-count shortcut enters the time to the
goal. Its memory holds every expert.

>>> r = recommend(resolve_source("gpt2", None), Setup.for_batch(batch=64, seq=1024), Goal(tokens=1e9))
>>> r.rows[0].gpu, r.rows[0].time_to_goal_s                                           # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from gpuwise.errors import GpuwiseError, NotApplicable
from gpuwise.hardware.calibration import Calibration
from gpuwise.hardware.catalog import Accelerator, Catalog, load_catalog
from gpuwise.planning.setup import MAX_ACCUM, Setup, largest_micro_batch
from gpuwise.precision import PRECISIONS, default_precision, same_bytes
from gpuwise.recommend.option import Option, Recommendation, TrainingOption
from gpuwise.recommend.prices import costs
from gpuwise.recommend.rank import check_goal_for_limits, chosen, pareto, within
from gpuwise.recommend.request import COUNTS, Constraints, Goal, SortKey

if TYPE_CHECKING:  # the engine loads torch: imported where it runs, so the arguments are checked without it
    from gpuwise.planning.cost.step import StepTime
    from gpuwise.planning.parallel.sharding import PerGpu
    from gpuwise.planning.planner import Planner


def time_step(step: PerGpu, acc: Accelerator, calibration: Calibration | None, *, int8: bool = False
              ) -> StepTime | None:
    """The one place recommend (training and serving) asks the cost model for a step's time."""
    from gpuwise.planning.cost.step import step_time

    return step_time(step, acc, calibration=calibration, int8=int8)


def _states_bytes(step: PerGpu) -> float:
    """The most the weights, gradients and optimizer states hold at once: what no checkpointing can free (paged
    optimizer state aside: it can spill to the host)."""
    from gpuwise.planning.capture.tracker import CATEGORIES

    cols = [CATEGORIES.index(c) for c in ("weights", "gradients", "optimizer")]
    return float(step.live[:, cols].sum(axis=1).max()) - step.paged_bytes


def _precision(acc: Accelerator, asked: str | None) -> tuple[str | None, str | None]:
    """The precision to run on ``acc`` and, if it cannot train there, why."""
    if asked is not None:
        spec = PRECISIONS[asked]
        if not acc.peak_tflops.get(spec.rate_key):
            return None, f"no {spec.rate_key} rate on this chip for --precision {asked}"
        return asked, None
    default = default_precision(gpu=True, bf16=acc.bf16)
    if not acc.peak_tflops.get(PRECISIONS[default].rate_key):
        if acc.peak_tflops.get("fp32"):
            return "fp32", None
        return None, "an inference chip: no fp16, bf16 or fp32 rate to train with"
    return default, None


@dataclass
class _Search:
    planner: Planner
    setup: Setup
    sharding: str | None
    checkpointing_given: bool
    calibrations: Mapping[str, Calibration]
    _steps: dict[Setup, PerGpu | None] = field(default_factory=dict)  # runs costed from the probes' captures
    costed: PerGpu | None = None  # the first step priced: whose captures say how a MoE's tokens were routed

    def best(self, acc: Accelerator, n: int, precision: str):
        """The first setup of ``n`` x ``acc`` that fits, in the remedies' order (``remedies.settings``: DDP, then
        with checkpointing, then FSDP, then FSDP with checkpointing), at the largest micro-batch that fits and
        divides the per-GPU batch; with its PerGpu and StepTime. Or (None, why not)."""
        from gpuwise.planning.fit import OVERHEAD_BYTES, fit_on, max_micro_batch
        from gpuwise.planning.remedies import settings

        per_gpu = self.setup.batch // n
        reason = "does not fit even with checkpointing, micro-batch 1 and FSDP"
        if n == 1 and self.sharding not in (None, "ddp"):  # the user's sharding needs GPUs to shard over
            return None, reason
        hopeless: set[str] = set()  # shardings whose weights, gradients and optimizer states alone do not fit
        in_bwd = self.setup.optimizer_in_backward  # steps every micro-batch: the whole batch in one
        base = replace(self.setup, micro_batch=1, grad_accum=1 if in_bwd else min(per_gpu, 2), gpus=n,
                       sharding=self.sharding or "ddp", precision=same_bytes(precision),
                       checkpointing=self.setup.checkpointing if self.checkpointing_given else "none")
        given = frozenset(k for k, v in (("sharding", self.sharding is not None),
                                         ("checkpointing", self.checkpointing_given)) if v)
        for probe in settings(base, given=given):
            if probe.sharding in hopeless:
                continue  # checkpointing frees activations, not states: no capture needed to know
            try:
                step = self._probe(probe)
                micro = largest_micro_batch(per_gpu, max_micro_batch(step, acc))
                if micro == 0 and _states_bytes(step) + OVERHEAD_BYTES > acc.memory_bytes:
                    hopeless.add(probe.sharding)
                if in_bwd and 0 < micro < per_gpu:
                    reason = (f"--optimizer-in-backward cannot accumulate, and a micro-batch of {per_gpu} does not "
                              "fit")
                    continue
                if micro == 0 or per_gpu // micro > MAX_ACCUM:
                    continue
                exact = self._captured(probe, micro, per_gpu // micro)
                while not fit_on(exact, acc, timed=False).fits and micro > 1:  # the affine batch model was a sample off
                    micro = largest_micro_batch(per_gpu, micro - 1)
                    exact = self._captured(probe, micro, per_gpu // micro)
            except NotApplicable as exc:
                reason = exc.args[0]
                continue
            if not fit_on(exact, acc, timed=False).fits:
                continue
            exact = replace(exact, setup=replace(exact.setup, precision=precision))  # the rate of the run's own
            self.costed = self.costed or exact
            t = time_step(exact, acc, self.calibrations.get(acc.key))
            if t is None:  # another sharding or checkpointing gives no rate or link either
                return None, (f"no {precision} rate or memory bandwidth in the catalog" if n == 1 else
                              f"no known link between {n} of these")
            return (exact.setup, exact, t), None
        return None, reason

    def _at(self, probe: Setup, micro: int, accum: int) -> PerGpu | None:
        """The step at ``micro`` x ``accum`` from the captures of ``probe`` with two micro-batches held, without
        capturing it (``Workload.at``: equal to a capture where the step is affine in the batch); None where
        those captures cannot tell."""
        from gpuwise.planning.parallel.sharding import per_gpu

        run = replace(probe, micro_batch=micro, grad_accum=accum)
        if run not in self._steps:
            held = 1 if probe.optimizer_in_backward else 2  # a step in backward cannot accumulate
            w = self.planner.workload(replace(probe, grad_accum=held), batch_model=True).at(micro, accum)
            self._steps[run] = None if w is None else per_gpu(w, replace(run, attention=w.setup.attention))
        return self._steps[run]

    def _probe(self, probe: Setup) -> PerGpu:
        """The probe at micro-batch 1 with its batch model; one sample per GPU (no accumulation) is cut out of the
        probe with two, which the smaller counts captured."""
        if probe.grad_accum == 1 and (step := self._at(probe, 1, 1)) is not None and step.batch_model is not None:
            return step
        return self.planner.per_gpu(probe, batch_model=True)

    def _captured(self, probe: Setup, micro: int, accum: int) -> PerGpu:
        """The step at ``micro`` x ``accum``: from the probe's captures where they tell (they do for the zoo), else
        captured (the capture holds at most two micro-batches and weighs the rest itself)."""
        step = self._at(probe, micro, accum)
        return step if step is not None else self.planner.per_gpu(replace(probe, micro_batch=micro, grad_accum=accum))


def _counts(acc: Accelerator, setup: Setup, c: Constraints, *, beyond_node: bool, even: bool = True) -> list[int]:
    """The GPU counts to try: powers of two the global batch splits over (``even=False``: those it does not),
    within --max-gpus; past one node only with ``beyond_node`` (the model needs it, or --max-gpus asks for it)
    and only for datacenter parts."""
    top = 1 if setup.optimizer_in_backward else c.max_gpus or COUNTS[-1]  # planned on one GPU only
    if not beyond_node or acc.segment != "datacenter":
        top = min(top, acc.node_gpus)
    return [n for n in COUNTS if n <= top and (setup.batch % n == 0) == even]


def recommend(source, setup: Setup, goal: Goal, constraints: Constraints | None = None, *,
              precision: str | None = None, sharding: str | None = None, checkpointing_given: bool = False,
              sort: SortKey = "time", catalog: Catalog | None = None,
              calibrations: Mapping[str, Calibration] | None = None) -> Recommendation:
    """Rank every catalog accelerator and count for training ``source`` as ``setup`` says (its global batch and
    sequence kept) until ``goal``. ``precision`` None: each GPU's default (bf16 autocast where it has bf16);
    ``sharding`` None: DDP if it fits, else FSDP (plan's remedies' order)."""
    from gpuwise.planning.planner import Planner

    c = constraints or Constraints()
    catalog = catalog or load_catalog()
    if not setup.training:
        raise GpuwiseError("recommend() ranks training and fine-tuning runs; serve() ranks serving",
                           "pass --serve (or --task infer) on the command line")
    if sharding is not None and sharding not in ("ddp", "zero1", "zero2", "fsdp"):
        raise GpuwiseError(f"--sharding {sharding!r} is not one of ddp, zero1, zero2, fsdp", "pass --sharding fsdp")
    if setup.optimizer_in_backward and sharding not in (None, "ddp"):
        raise GpuwiseError(f"--optimizer-in-backward is planned on one GPU, so --sharding {sharding} has nothing to "
                           "shard", "drop --sharding, or drop --optimizer-in-backward")
    search = _Search(planner=Planner(source), setup=setup, sharding=sharding,
                     checkpointing_given=checkpointing_given, calibrations=calibrations or {})
    check_goal_for_limits(goal, c)
    per_sample = source.tokens(setup)  # tokens per sequence; 1 for images and your own models' samples
    if goal.tokens is not None and per_sample == 1:
        raise GpuwiseError(f"--tokens for {source.name}, whose samples are not token sequences",
                           "give the goal as --samples (or --epochs with --dataset-size)")
    unit = "tokens" if per_sample > 1 and goal.samples is None else "samples"
    rows: list[Option] = []
    excluded: list[Option] = []
    uneven: set[int] = set()
    for acc in catalog:
        if not chosen(acc, c):
            continue
        run_precision, why = _precision(acc, precision)
        beyond = bool(c.max_gpus and c.max_gpus > acc.node_gpus)
        counts = _counts(acc, setup, c, beyond_node=beyond)
        if why is None:
            uneven.update(_counts(acc, setup, c, beyond_node=beyond, even=False))
        if why is None and not counts:
            why = f"--batch {setup.batch} does not split over {acc.name}'s counts within --max-gpus"
        if why is not None:
            excluded.append(TrainingOption.left_out(acc, counts[0] if counts else 1, why))
            continue
        found = _try_counts(search, acc, counts, run_precision, setup, goal, c, per_sample if unit == "tokens" else 1)
        if not found[0] and acc.segment == "datacenter":  # the model needs more than a node: go past it
            more = [n for n in _counts(acc, setup, c, beyond_node=True) if n not in counts]
            found = _try_counts(search, acc, more, run_precision, setup, goal, c,
                                per_sample if unit == "tokens" else 1) if more else found
        rows.extend(found[0])
        if not found[0]:
            excluded.append(TrainingOption.left_out(acc, counts[-1], found[1]))
    kept, out = within(rows, c)
    cost = training_cost(c)
    if goal.amount is not None:
        front = pareto(kept, cost)
        kept = [replace(r, pareto=i in front) for i, r in enumerate(kept)]
    key = {"time": lambda r: (r.time_to_goal_s or r.step_time_s, cost(r)),
           "cost": lambda r: (cost(r), r.time_to_goal_s or r.step_time_s),
           "energy": lambda r: (-(r.per_joule or 0.0), r.time_to_goal_s or r.step_time_s)}[sort]
    kept.sort(key=key)
    experts = getattr(source, "experts", None)
    routing = None
    if experts is not None and search.costed is not None:  # as plan says it: the stand-in, else any split
        from gpuwise.planning.planner import routing_assumption

        routing = routing_assumption(search.costed.workload, experts, search.costed.setup)
    return Recommendation(model=source.name, setup=setup, goal=goal, constraints=c,
                          unit=unit, sort=sort,
                          rows=tuple(kept), excluded=tuple(excluded + out), uneven_counts=tuple(sorted(uneven)),
                          experts=experts, routing=routing)


def _try_counts(search: _Search, acc: Accelerator, counts: list[int], precision: str, setup: Setup, goal: Goal,
                c: Constraints, per_sample: int) -> tuple[list[Option], str]:
    """The rows of ``acc`` at each count that fits; else the reason the last one did not."""
    rows, reason = [], "does not fit"
    for n in counts:
        result, why = search.best(acc, n, precision)
        if result is None:
            reason = why or reason
            continue
        run, _, t = result
        rows.append(_priced(acc, n, run, setup, t, goal, c, per_sample))
    return rows, reason



def _priced(acc: Accelerator, n: int, run: Setup, base: Setup, t: StepTime, goal: Goal, c: Constraints,
            per_sample: int) -> TrainingOption:
    from gpuwise.planning.remedies import setup_flags

    per_step = run.batch * per_sample  # tokens (or samples) per optimizer step over every GPU
    throughput = per_step / t.seconds
    hours = None if goal.amount is None else goal.amount / throughput / 3600
    asked = run if base.attention else replace(run, attention=None)  # the attention the planner resolved: not a flag
    return TrainingOption(
        gpu=acc.key, name=acc.name, count=n, fits=True, setup=run, flags=setup_flags(asked, base),
        step_time_s=t.seconds, throughput=throughput, mfu=t.mfu, time_to_goal_s=None if hours is None else hours * 3600,
        basis=t.basis, phases_s=t.phases_s, families_s=t.families_s, step_time_error=t.error,
        **costs(acc, gpus=n, throughput=throughput, hours=hours, rent=c.rent, buy=c.buy, kind=c.rent_kind,
              provider=c.provider).figures())


def training_cost(c: Constraints) -> Callable[[Option], float]:
    """Rent of the whole job (to the goal), or the purchase of every GPU."""
    def cost(r: Option) -> float:
        if c.mode == "rent":
            return r.rent_usd if r.rent_usd is not None else math.inf
        return r.buy_usd if r.buy_usd is not None else math.inf
    return cost
