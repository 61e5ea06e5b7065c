"""Which accelerator, how many, how fast and for how much: every catalog row and GPU count ranked for one workload.

One capture of the step serves every GPU and count (the step is captured on fake tensors, independent of the
device; sharding and the cost model apply after). For each accelerator and count the engine finds the first
settings that make the step fit, in the order of plan's remedies (mixed precision the GPU has; DDP, then with
activation checkpointing, then FSDP over the same GPUs, then FSDP with checkpointing; the largest micro-batch that
fits, the rest accumulated), and prices it: time to the goal, rent, purchase,
energy, tokens per joule. Rows that cannot run are kept with the reason.

A Mixture of Experts trains at its captured step's FLOPs, which are the routed tokens' (each token through its
top-k experts: about 6 x N_active a token plus attention, tests/test_moe.py), never 6 x N_total: the cost model
(costmodel.step_time) prices every captured op, and no parameter-count shortcut enters the time to the goal. Its
memory holds every expert. Serving reads the experts a decode step's batch touches (serving.moe_weights_read).

>>> r = recommend(resolve_source("gpt2", None), Setup.for_batch(batch=64, seq=1024), Goal(tokens=1e9))
>>> r.rows[0].gpu, r.rows[0].time_to_goal_s                                           # doctest: +SKIP
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

from gpuwise.errors import GpuwiseError, NotApplicable
from gpuwise.hardware.calibration import Calibration
from gpuwise.hardware.catalog import ECOSYSTEMS, SEGMENTS, VENDORS, Accelerator, Catalog, load_catalog
from gpuwise.planning.setup import MAX_ACCUM, Setup, Weights, largest_micro_batch
from gpuwise.precision import PRECISIONS, default_precision, same_bytes

if TYPE_CHECKING:  # the engine loads torch: imported where it runs, so the arguments are checked without it
    from gpuwise.planning.parallel.sharding import PerGpu
    from gpuwise.planning.planner import Planner
    from gpuwise.planning.sources import Experts

COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# serving.WEIGHT_BYTES' keys, named without importing it (it loads torch): plan's formats, fp32 and llama.cpp's Q4_K_M
SERVED_WEIGHTS = ("fp32", *get_args(Weights), "q4_k_m")
Mode = Literal["rent", "buy"]
SortKey = Literal["time", "cost", "energy"]


@dataclass(frozen=True, kw_only=True)
class Goal:
    """How much work: tokens (language models) or samples, to train or fine-tune on."""

    tokens: float | None = None
    samples: float | None = None

    def __post_init__(self) -> None:
        given = [(n, v) for n, v in (("tokens", self.tokens), ("samples", self.samples)) if v is not None]
        if len(given) > 1:
            raise GpuwiseError("--tokens and --samples both set the goal", "give one of them")
        for name, value in given:
            if not (math.isfinite(value) and value > 0):
                raise GpuwiseError(f"--{name} {value:g} is not a positive number", f"pass e.g. --{name} 1e9")

    @property
    def unit(self) -> str:
        return "samples" if self.samples is not None else "tokens"

    @property
    def amount(self) -> float | None:
        return self.samples if self.samples is not None else self.tokens


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """Serving: requests of ``prompt_tokens`` in and ``output_tokens`` out, ``concurrency`` users at once (or an
    aggregate ``tokens_per_s`` of output), within optional latency targets, with weights stored as ``weights``."""

    prompt_tokens: int = 512
    output_tokens: int = 256
    concurrency: int = 1
    tokens_per_s: float | None = None
    ttft_s: float | None = None  # time to first token
    tpot_s: float | None = None  # time per output token
    weights: str = "bf16"  # weight-only format: fp32, fp16, bf16, fp8, int8, int4, nf4

    def __post_init__(self) -> None:
        for name, value, limit in (("--prompt-tokens", self.prompt_tokens, 1 << 24),
                                   ("--output-tokens", self.output_tokens, 1 << 24),
                                   ("--concurrency", self.concurrency, 1 << 24)):
            if not 1 <= value <= limit:
                raise GpuwiseError(f"{name} {value} is outside 1..{limit}", f"pass e.g. {name} 256")
        for name, value, scale in (("--tokens-per-s", self.tokens_per_s, 1), ("--ttft-ms", self.ttft_s, 1e3),
                                   ("--tpot-ms", self.tpot_s, 1e3)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise GpuwiseError(f"{name} {value * scale:g} is not a positive number", f"pass e.g. {name} 50")
        if self.weights not in SERVED_WEIGHTS:
            raise GpuwiseError(f"--weights {self.weights!r} is not one of {', '.join(SERVED_WEIGHTS)}",
                               "pass --weights int4 (GPTQ/AWQ) or --weights bf16")

    @property
    def context(self) -> int:
        """Tokens a sequence holds in its KV cache at the end."""
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True, kw_only=True)
class Price:
    usd: float
    source: str
    date: str | None = None


@dataclass(frozen=True, kw_only=True)
class Constraints:
    """What the user rules out. Empty tuples mean "any"."""

    mode: Mode = "rent"
    budget_usd: float | None = None  # for the job when renting, for the GPUs when buying
    deadline_s: float | None = None
    max_gpus: int | None = None
    gpus: tuple[str, ...] = ()  # catalog keys
    segments: tuple[str, ...] = ()
    vendors: tuple[str, ...] = ()
    ecosystem: str | None = None  # "cuda": leave out stacks that need a port
    rent: Mapping[str, Price] = field(default_factory=dict)  # catalog key -> USD per GPU-hour (the user's quotes)
    buy: Mapping[str, Price] = field(default_factory=dict)  # catalog key -> USD per GPU

    def __post_init__(self) -> None:
        if self.mode not in ("rent", "buy"):
            raise GpuwiseError(f"unknown cost mode {self.mode!r}", "pass --rent or --buy")
        for name, value in (("--budget", self.budget_usd), ("--deadline", self.deadline_s)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise GpuwiseError(f"{name} {value:g} is not a positive number", f"pass e.g. {name} 1000")
        if self.max_gpus is not None and not 1 <= self.max_gpus <= COUNTS[-1]:
            raise GpuwiseError(f"--max-gpus {self.max_gpus} is outside 1..{COUNTS[-1]}", "pass e.g. --max-gpus 8")
        if bad := [s for s in self.segments if s not in SEGMENTS]:
            raise GpuwiseError(f"unknown --segment {bad[0]!r}", f"use one of {', '.join(SEGMENTS)}")
        if bad := [v for v in self.vendors if v.lower() not in {x.lower() for x in VENDORS}]:
            raise GpuwiseError(f"unknown --vendor {bad[0]!r}", f"use one of {', '.join(VENDORS)}")
        if self.ecosystem is not None and self.ecosystem not in ECOSYSTEMS:
            raise GpuwiseError(f"unknown --ecosystem {self.ecosystem!r}", f"use one of {', '.join(ECOSYSTEMS)}")


@dataclass(frozen=True, kw_only=True)
class Option:
    """One accelerator at one count: the settings that fit, how fast, and what it costs. ``excluded`` says why a
    row is not among the recommendations (then the figures may be missing)."""

    gpu: str  # catalog key
    name: str
    count: int
    fits: bool
    setup: Setup | None  # the run: micro-batch, accumulation, precision, checkpointing, sharding
    flags: str  # the flags to paste into gpuwise plan / gpuwise train for this setup
    step_time_s: float | None
    throughput: float | None  # tokens/s (or samples/s) over all the GPUs
    mfu: float | None
    time_to_goal_s: float | None
    rent_usd_per_hour: Price | None  # per GPU
    rent_usd: float | None  # the whole job
    buy_usd: float | None  # every GPU
    buy_price: Price | None
    energy_kwh: float | None  # at board power (TDP): an upper bound
    per_joule: float | None  # tokens (or samples) per joule at board power
    basis: str
    excluded: str | None = None
    pareto: bool = False
    # serving: one replica is ``count`` GPUs (tensor parallel); ``throughput`` is over every replica
    per_user: float | None = None  # output tokens/s each user sees (1 / time per output token)
    ttft_s: float | None = None
    max_concurrency: int | None = None  # sequences one replica's memory holds at the full context
    replicas: int | None = None
    decode_batch: int | None = None  # sequences a replica decodes in one step (a decoder)
    weight_bytes_read: float | None = None  # by one GPU in that step: all its weights, a MoE's experts touched

    @property
    def gpus_total(self) -> int:
        return self.count * (self.replicas or 1)

    @property
    def per_gpu(self) -> float | None:
        return None if self.throughput is None else self.throughput / self.gpus_total


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    model: str
    setup: Setup  # as the user gave it (the global batch is kept on every row)
    goal: Goal
    constraints: Constraints
    unit: str  # "tokens" or "samples"
    sort: SortKey
    rows: tuple[Option, ...]  # ranked, fastest (or cheapest) first
    excluded: tuple[Option, ...]
    traffic: Traffic | None = None  # serving: what the replicas must sustain
    uneven_counts: tuple[int, ...] = ()  # GPU counts in range not tried: the global batch does not split over them
    # a Mixture of Experts: its routed experts (total and active parameters), and the routing its figures assume
    # (training: the captured step's, as plan reports it; serving: serving.UNIFORM_ROUTING)
    experts: Experts | None = None
    routing: str | None = None

    @property
    def best(self) -> Option | None:
        return self.rows[0] if self.rows else None


# -- the search over settings ---------------------------------------------------------------------------------

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
    bf16 = acc.bf16
    chosen = default_precision(gpu=True, bf16=bf16)
    if not acc.peak_tflops.get(PRECISIONS[chosen].rate_key):
        if acc.peak_tflops.get("fp32"):
            return "fp32", None
        return None, "an inference chip: no fp16, bf16 or fp32 rate to train with"
    return chosen, None


def _variants(setup: Setup, n: int, sharding: str | None, checkpointing_given: bool) -> list[tuple[str, str]]:
    """(sharding, checkpointing) pairs to try on ``n`` GPUs: the user's where given."""
    if n == 1:
        shardings = [] if sharding not in (None, "ddp") else ["ddp"]
    else:
        shardings = [sharding] if sharding else ["ddp", "fsdp"]
    ckpts = [setup.checkpointing] if checkpointing_given else ["none", "full"]
    return [(s, c) for s in shardings for c in ckpts]


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
        """The first setup of ``n`` x ``acc`` that fits, in the remedies' order (DDP, then with checkpointing,
        then FSDP, then FSDP with checkpointing), at the largest micro-batch that fits and divides the per-GPU
        batch; with its PerGpu and StepTime. Or (None, why not)."""
        from gpuwise.planning.cost.step import step_time
        from gpuwise.planning.fit import OVERHEAD_BYTES, fit_on, max_micro_batch

        per_gpu = self.setup.batch // n
        reason = "does not fit even with checkpointing, micro-batch 1 and FSDP"
        hopeless: set[str] = set()  # shardings whose weights, gradients and optimizer states alone do not fit
        for sharding, ckpt in _variants(self.setup, n, self.sharding, self.checkpointing_given):
            if sharding in hopeless:
                continue  # checkpointing frees activations, not states: no capture needed to know
            in_bwd = self.setup.optimizer_in_backward  # steps every micro-batch: the whole batch in one
            probe = replace(self.setup, micro_batch=1, grad_accum=1 if in_bwd else min(per_gpu, 2), gpus=n,
                            sharding=sharding, checkpointing=ckpt, precision=same_bytes(precision))
            try:
                step = self._probe(probe)
                micro = largest_micro_batch(per_gpu, max_micro_batch(step, acc))
                if micro == 0 and _states_bytes(step) + OVERHEAD_BYTES > acc.memory_bytes:
                    hopeless.add(sharding)
                if in_bwd and 0 < micro < per_gpu:
                    reason = (f"--optimizer-in-backward cannot accumulate, and a micro-batch of {per_gpu} does not "
                              "fit")
                    continue
                if micro == 0 or per_gpu // micro > MAX_ACCUM:
                    continue
                exact = self._captured(probe, micro, per_gpu // micro)
                while not fit_on(exact, acc).fits and micro > 1:  # the affine batch model was a sample off
                    micro = largest_micro_batch(per_gpu, micro - 1)
                    exact = self._captured(probe, micro, per_gpu // micro)
            except NotApplicable as exc:
                reason = exc.args[0]
                continue
            if not fit_on(exact, acc).fits:
                continue
            exact = replace(exact, setup=replace(exact.setup, precision=precision))  # the rate of the run's own
            self.costed = self.costed or exact
            t = step_time(exact, acc, calibration=self.calibrations.get(acc.key))
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
            self._steps[run] = None if w is None else per_gpu(w, run)
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


# -- prices and filters --------------------------------------------------------------------------------------

def _rent(acc: Accelerator, c: Constraints) -> Price | None:
    if acc.key in c.rent:
        return c.rent[acc.key]
    if acc.cloud_usd_per_hour:
        return Price(usd=acc.cloud_usd_per_hour, source=acc.cloud_price_source or "catalog",
                     date=acc.cloud_price_date)
    return None


def _buy(acc: Accelerator, c: Constraints) -> Price | None:
    if acc.key in c.buy:
        return c.buy[acc.key]
    if acc.street_price_usd:
        return Price(usd=acc.street_price_usd, source=acc.street_price_source or "catalog",
                     date=acc.street_price_date)
    if acc.launch_price_usd:
        return Price(usd=acc.launch_price_usd, source="launch price",
                     date=str(acc.launch_year) if acc.launch_year else None)
    return None


def _chosen(acc: Accelerator, c: Constraints) -> bool:
    """The user's own filters: rows they ruled out are not listed at all."""
    if c.gpus and acc.key not in c.gpus:
        return False
    if c.segments and acc.segment not in c.segments:
        return False
    if c.vendors and acc.vendor.lower() not in {v.lower() for v in c.vendors}:
        return False
    return not (c.ecosystem and acc.ecosystem != c.ecosystem)


def _counts(acc: Accelerator, setup: Setup, c: Constraints, *, beyond_node: bool, even: bool = True) -> list[int]:
    """The GPU counts to try: powers of two the global batch splits over (``even=False``: those it does not),
    within --max-gpus; past one node only with ``beyond_node`` (the model needs it, or --max-gpus asks for it)
    and only for datacenter parts."""
    top = 1 if setup.optimizer_in_backward else c.max_gpus or COUNTS[-1]  # planned on one GPU only
    if not beyond_node or acc.segment != "datacenter":
        top = min(top, acc.node_gpus)
    return [n for n in COUNTS if n <= top and (setup.batch % n == 0) == even]


def _pareto(rows: list[Option], cost) -> set[int]:
    """Indices of the rows no other row beats on both time and cost (equal rows are both on the front)."""
    front: set[int] = set()
    best: tuple[float, float] | None = None  # (time, cost) of the cheapest row so far, in order of time
    for i in sorted(range(len(rows)), key=lambda i: (rows[i].time_to_goal_s, cost(rows[i]))):
        point = (rows[i].time_to_goal_s, cost(rows[i]))
        if point[1] == math.inf:
            continue
        if best is None or point[1] < best[1] or point == best:
            front.add(i)
            best = point
    return front


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
    _goal_for_limits(goal, c)
    per_sample = source.tokens(setup)  # tokens per sequence; 1 for images and your own models' samples
    if goal.tokens is not None and per_sample == 1:
        raise GpuwiseError(f"--tokens for {source.name}, whose samples are not token sequences",
                           "give the goal as --samples (or --epochs with --dataset-size)")
    unit = "tokens" if per_sample > 1 and goal.samples is None else "samples"
    rows: list[Option] = []
    excluded: list[Option] = []
    uneven: set[int] = set()
    for acc in catalog:
        if not _chosen(acc, c):
            continue
        chosen, why = _precision(acc, precision)
        beyond = bool(c.max_gpus and c.max_gpus > acc.node_gpus)
        counts = _counts(acc, setup, c, beyond_node=beyond)
        if why is None:
            uneven.update(_counts(acc, setup, c, beyond_node=beyond, even=False))
        if why is None and not counts:
            why = f"--batch {setup.batch} does not split over {acc.name}'s counts within --max-gpus"
        if why is not None:
            excluded.append(_excluded(acc, counts[0] if counts else 1, why))
            continue
        found = _try_counts(search, acc, counts, chosen, setup, goal, c, per_sample if unit == "tokens" else 1)
        if not found[0] and acc.segment == "datacenter":  # the model needs more than a node: go past it
            more = [n for n in _counts(acc, setup, c, beyond_node=True) if n not in counts]
            found = _try_counts(search, acc, more, chosen, setup, goal, c,
                                   per_sample if unit == "tokens" else 1) if more else found
        rows.extend(found[0])
        if not found[0]:
            excluded.append(_excluded(acc, counts[-1], found[1]))
    kept, out = [], []
    for r in rows:
        why = _over(r, c)
        (out if why else kept).append(replace(r, excluded=why) if why else r)
    cost = (lambda r: r.rent_usd if r.rent_usd is not None else math.inf) if c.mode == "rent" else (
        lambda r: r.buy_usd if r.buy_usd is not None else math.inf)
    if goal.amount is not None:
        front = _pareto(kept, cost)
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


def _goal_for_limits(goal: Goal, c: Constraints, *, serving: bool = False) -> None:
    """A deadline is on the time to a goal, and so is a rent budget; without a goal neither can be judged."""
    asks = [f for f, v in (("--deadline", c.deadline_s),
                           ("--budget", c.budget_usd if c.mode == "rent" and not serving else None)) if v is not None]
    if asks and goal.amount is None:
        raise GpuwiseError(f"{asks[0]} is judged against a goal, and none was given",
                           "add --tokens (or --samples, or --epochs with --dataset-size)")


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


def _excluded(acc: Accelerator, n: int, why: str) -> Option:
    return Option(gpu=acc.key, name=acc.name, count=n, fits=False, setup=None, flags="", step_time_s=None,
                  throughput=None, mfu=None, time_to_goal_s=None, rent_usd_per_hour=None, rent_usd=None,
                  buy_usd=None, buy_price=None, energy_kwh=None, per_joule=None, basis="", excluded=why)


def _priced(acc: Accelerator, n: int, run: Setup, base: Setup, t, goal: Goal, c: Constraints,
            per_sample: int) -> Option:
    from gpuwise.planning.remedies import setup_flags

    per_step = run.batch * per_sample  # tokens (or samples) per optimizer step over every GPU
    throughput = per_step / t.seconds
    hours = None if goal.amount is None else goal.amount / throughput / 3600
    rent, buy = _rent(acc, c), _buy(acc, c)
    watts = acc.tdp_w * n if acc.tdp_w else None
    flags = setup_flags(run, base)
    return Option(
        gpu=acc.key, name=acc.name, count=n, fits=True, setup=run, flags=flags, step_time_s=t.seconds,
        throughput=throughput, mfu=t.mfu, time_to_goal_s=None if hours is None else hours * 3600,
        rent_usd_per_hour=rent, rent_usd=None if rent is None or hours is None else rent.usd * n * hours,
        buy_usd=None if buy is None else buy.usd * n, buy_price=buy,
        energy_kwh=None if watts is None or hours is None else watts * hours / 1000,
        per_joule=None if watts is None else throughput / watts, basis=t.basis)


def _over(r: Option, c: Constraints) -> str | None:
    """Why a fitting row breaks the user's budget or deadline, or has no price to judge it by."""
    if c.deadline_s is not None and r.time_to_goal_s is not None and r.time_to_goal_s > c.deadline_s:
        return f"misses the deadline: {r.time_to_goal_s / 3600:.3g} h"
    if c.budget_usd is not None:
        cost = r.rent_usd if c.mode == "rent" else r.buy_usd
        if cost is None:
            return f"no {'rent' if c.mode == 'rent' else 'purchase'} price known (add it with --prices)"
        if cost > c.budget_usd:
            return f"over budget: ${cost:,.0f}"
    return None


# -- the user's prices ---------------------------------------------------------------------------------------

_DATE = re.compile(r"^\d{4}(-\d{2}){0,2}$")


def read_prices(path: str | Path, catalog: Catalog | None = None) -> tuple[dict[str, Price], dict[str, Price]]:
    """A CSV of the user's quotes: a header ``gpu,rent_usd_per_hour,buy_usd[,date]`` (either price may be empty),
    one row per GPU (any name the catalog knows). Returns (rent, buy) keyed by catalog key."""
    catalog = catalog or load_catalog()
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # Excel's "CSV UTF-8" starts with a byte-order mark
        rows = list(csv.reader(text.splitlines()))
    except OSError as exc:
        raise GpuwiseError(f"--prices {path}: {exc.strerror or exc}", "pass a readable CSV file") from exc
    except (UnicodeDecodeError, csv.Error) as exc:
        raise GpuwiseError(f"--prices {path} is not a text CSV file ({type(exc).__name__})",
                           "save it as CSV (UTF-8): gpu,rent_usd_per_hour,buy_usd[,date]") from exc
    header = [h.strip().lower() for h in rows[0]] if rows else []
    if not header or header[0] != "gpu" or not {"rent_usd_per_hour", "buy_usd"} & set(header):
        raise GpuwiseError(f"--prices {path}: the first line must be gpu,rent_usd_per_hour,buy_usd[,date]",
                           "write the header, then one GPU per line, e.g. rtx-4090,0.69,1599,2026-11")
    rent: dict[str, Price] = {}
    buy: dict[str, Price] = {}
    for line, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue
        cells = dict(zip(header, (cell.strip() for cell in row), strict=False))
        acc = catalog.find(cells.get("gpu", ""))
        if acc is None:
            raise GpuwiseError(f"--prices {path} line {line}: unknown GPU {cells.get('gpu', '')!r}",
                               "use a name from 'gpuwise gpus'")
        date = cells.get("date") or None
        if date is not None and not _DATE.match(date):
            raise GpuwiseError(f"--prices {path} line {line}: date {date!r} is not YYYY-MM-DD",
                               "write the date the quote was given, e.g. 2026-11-30")
        for column, into in (("rent_usd_per_hour", rent), ("buy_usd", buy)):
            value = cells.get(column, "")
            if not value:
                continue
            try:
                usd = float(value)
            except ValueError:
                usd = math.nan
            if not (math.isfinite(usd) and usd > 0):
                raise GpuwiseError(f"--prices {path} line {line}: {column} {value!r} is not a positive number",
                                   "write plain dollars, e.g. 1.99")
            into[acc.key] = Price(usd=usd, source=f"your quote ({p.name})", date=date)
    return rent, buy


# -- serving --------------------------------------------------------------------------------------------------

def serve(source, traffic: Traffic, constraints: Constraints | None = None, *, batch: int = 1,
          precision: str | None = None, image_size: int | None = None, sort: SortKey = "cost", goal: Goal | None = None,
          catalog: Catalog | None = None, calibrations: Mapping[str, Calibration] | None = None) -> Recommendation:
    """Rank every accelerator for serving ``source``: a decoder by its decode model (time per output token from
    the bytes each step reads, time to first token from the prompt's FLOPs, sequences per replica from the KV
    cache that fits, replicas for the users); any other model by its captured inference step at ``batch``
    (int8 end to end with ``--weights int8``, and on chips that only have an int8 rate). ``goal`` in tokens (or
    samples) to produce prices the whole job."""
    from gpuwise.planning.planner import Planner

    c = constraints or Constraints()
    catalog = catalog or load_catalog()
    goal = goal or Goal()
    _goal_for_limits(goal, c)
    calibrations = calibrations or {}
    dims = getattr(source, "decoder", None)
    rows: list[Option] = []
    excluded: list[Option] = []
    planner = Planner(source)
    experts = getattr(source, "experts", None) if dims is not None else None
    if dims is not None:
        if goal.samples is not None:
            raise GpuwiseError("a language model's serving goal is in tokens", "pass --tokens")
        if batch != 1 or precision is not None or image_size is not None:
            flag = "--batch" if batch != 1 else "--precision" if precision is not None else "--image-size"
            raise GpuwiseError(f"{flag} does not apply to serving a language model",
                               f"drop {flag}: --concurrency sets the batch, --weights the storage")
        limit = source.max_positions
        if limit is not None and traffic.context > limit:
            raise GpuwiseError(f"--prompt-tokens + --output-tokens = {traffic.context} is more than {source.name}'s "
                               f"{limit} positions", f"keep the two under {limit + 1}")
        # the formats plan simulates are captured as stored (quantize.py: embeddings and head stay 16-bit)
        from gpuwise.planning.transforms.quantize import FORMATS

        setup = Setup(task="infer", micro_batch=1, seq=traffic.prompt_tokens, precision="bf16",
                      weights=traffic.weights if traffic.weights in FORMATS else None)
        try:
            step = planner.per_gpu(setup)
        except NotApplicable as exc:
            raise GpuwiseError(*exc.args) from exc
        for acc in catalog:
            if _chosen(acc, c):
                found, why = _serve_decoder(acc, dims, step, traffic, c, goal, calibrations.get(acc.key),
                                            experts=experts)
                rows.extend(found)
                if not found:
                    excluded.append(_excluded(acc, 1, why))
        unit = "tokens"
    else:
        if goal.tokens is not None:
            raise GpuwiseError(f"{source.name} does not generate tokens", "give the serving goal as --samples")
        if traffic.weights not in ("bf16", "fp16", "int8"):
            raise GpuwiseError(f"--weights {traffic.weights} applies to language models",
                               "pass --weights int8 (or bf16) for this model")
        for acc in catalog:
            if _chosen(acc, c):
                option, why = _serve_step(acc, planner, Setup(task="infer", micro_batch=batch, image_size=image_size,
                                                              precision=precision or _infer_precision(acc)),
                                          traffic, c, goal, calibrations.get(acc.key))
                if option is None:
                    excluded.append(_excluded(acc, 1, why))
                else:
                    rows.append(option)
        unit = "samples"
    kept, out = [], []
    for r in rows:
        why = _over(r, c)
        (out if why else kept).append(replace(r, excluded=why) if why else r)
    cost = _serving_cost(c)
    front = _pareto([replace(r, time_to_goal_s=r.step_time_s) for r in kept], cost)
    kept = [replace(r, pareto=i in front) for i, r in enumerate(kept)]
    key = {"time": lambda r: (r.step_time_s, cost(r)), "cost": lambda r: (cost(r), r.step_time_s),
           "energy": lambda r: (-(r.per_joule or 0.0), cost(r))}[sort]
    kept.sort(key=key)
    routing = None
    if experts is not None:
        from gpuwise.planning.cost.serving import UNIFORM_ROUTING as routing
    return Recommendation(model=source.name, setup=Setup(task="infer", micro_batch=batch), goal=goal,
                          constraints=c, unit=unit, sort=sort, rows=tuple(kept), excluded=tuple(excluded + out),
                          traffic=traffic, experts=experts, routing=routing)


def _serving_cost(c: Constraints):
    """Rent of the whole fleet per hour, or the purchase of every GPU in it."""
    def cost(r: Option) -> float:
        if c.mode == "rent":
            return r.rent_usd_per_hour.usd * r.gpus_total if r.rent_usd_per_hour is not None else math.inf
        return r.buy_usd if r.buy_usd is not None else math.inf
    return cost


# Tensor parallelism past 8 GPUs pays per-layer all-reduce latencies the decode model leaves out; serving stacks
# stop at a node of 8 (vLLM and TensorRT-LLM publish TP <= 8), and so does the search.
MAX_TENSOR_PARALLEL = 8


def _powers_within(acc: Accelerator, c: Constraints) -> list[int]:
    top = min(acc.node_gpus, MAX_TENSOR_PARALLEL, c.max_gpus or COUNTS[-1])
    return [n for n in COUNTS if n <= top]


def _serve_decoder(acc: Accelerator, dims, step: PerGpu, traffic: Traffic, c: Constraints, goal: Goal,
                   calibration: Calibration | None, *, experts: Experts | None = None) -> tuple[list[Option], str]:
    """One row per replica size (1, 2, 4, ... GPUs of a node, tensor parallel) that holds the weights and at
    least one sequence at the full context, within the latency targets.

    A Mixture of Experts (``experts``) holds every expert, but a step reads the dense weights and the experts its
    batch touches (serving.moe_weights_read, uniform routing); tensor parallelism splits every expert's matrices
    over the replica's GPUs, so each GPU reads that share of its slice."""
    from gpuwise.planning.capture.tracker import CATEGORIES
    from gpuwise.planning.cost.serving import bytes_per_weight, decode_time, kv_bytes_per_token, max_concurrency
    from gpuwise.planning.cost.step import allreduce_link

    params = step.workload.params
    weights = params * bytes_per_weight(traffic.weights)
    if step.setup.quantized:  # as captured: the quantised layers and the 16-bit rest, the figure plan shows
        weights = float(step.live[:, CATEGORIES.index("weights")].max())
    live = step.live[int(step.live.sum(axis=1).argmax())]
    activations = float(live.sum() - live[CATEGORIES.index("weights")] - live[CATEGORIES.index("kv_cache")])
    mean_context = traffic.prompt_tokens + traffic.output_tokens // 2

    def moe(n: int) -> dict:
        """decode_time's MoE arguments for one of ``n`` GPUs: its share of the active parameters (the captured
        step's parameters are the total, source.Experts')."""
        if experts is None:
            return {}
        return {"active_params": params / n * experts.active / experts.total, "experts": experts.experts,
                "top_k": experts.top_k}

    if not any(acc.peak_tflops.get(k) for k in ("bf16", "fp16", "fp32")):
        return [], "no 16- or 32-bit rate: runs exported int8 graphs only, not a language model's decode"
    rows, why = [], "the weights and one sequence's KV cache do not fit even on a full node"
    latent = getattr(dims, "kv_latent", 0)  # MLA's latent cache is whole on every GPU (source.Decoder)
    for n in _powers_within(acc, c):
        if dims.heads % n:
            why = f"{dims.heads} attention heads do not split over {n} GPUs"
            continue
        kv_heads = math.ceil(dims.kv_heads / n)  # tensor parallel splits the KV heads (replicated below one a GPU)
        kv_seq = kv_bytes_per_token(layers=dims.layers, kv_heads=kv_heads, head_dim=dims.head_dim,
                                    latent=latent) * traffic.context
        fits = max_concurrency(acc, weight_bytes=weights / n, kv_bytes_per_sequence=kv_seq,
                               activation_bytes=activations)
        if fits == 0:
            continue
        comm_per_seq, link_note = 0.0, ""
        if n > 1:
            link = allreduce_link(acc, n)
            if link is None:
                why = f"no known link between {n} of these"
                continue
            # two all-reduces of each token's hidden state per layer (Megatron tensor parallel), 16-bit
            hidden = dims.heads * dims.head_dim
            comm_per_seq = 2 * dims.layers * hidden * 2 * 2 * (n - 1) / n / (link.busbw_gbps * 1e9)
            link_note = f" · tensor parallel over {n}: 2 all-reduces a layer at {link.source} (latency not modelled)"

        def at(batch: int, n: int = n, kv_heads: int = kv_heads, comm_per_seq: float = comm_per_seq):
            d = decode_time(acc, params=params / n, layers=dims.layers, kv_heads=kv_heads, head_dim=dims.head_dim,
                            heads=max(1, dims.heads // n), weight_bytes=weights / n, batch=batch,
                            context=mean_context, prompt_tokens=traffic.prompt_tokens, calibration=calibration,
                            kv_latent=latent, **moe(n))
            return None if d is None else (d, d.seconds_per_token + comm_per_seq * batch)

        batch = min(fits, traffic.concurrency) if traffic.tokens_per_s is None else fits
        got = at(batch)
        if got is None:
            return [], "no memory bandwidth in the catalog"
        while traffic.tpot_s is not None and got[1] > traffic.tpot_s and batch > 1:
            batch = max(1, batch // 2)
            got = at(batch)
        d, tpot = got
        if traffic.tpot_s is not None and tpot > traffic.tpot_s:
            why = f"{tpot * 1e3:.3g} ms per output token, over --tpot-ms {traffic.tpot_s * 1e3:g}"
            continue
        if traffic.ttft_s is not None and d.ttft_s > traffic.ttft_s:
            why = f"{d.ttft_s * 1e3:.3g} ms to the first token, over --ttft-ms {traffic.ttft_s * 1e3:g}"
            continue
        per_replica = batch / tpot
        replicas = (math.ceil(traffic.tokens_per_s / per_replica) if traffic.tokens_per_s is not None
                    else math.ceil(traffic.concurrency / batch))
        if c.max_gpus is not None and replicas * n > c.max_gpus:
            why = f"needs {replicas * n} GPUs ({replicas} replicas of {n}), over --max-gpus {c.max_gpus}"
            continue
        rows.append(_served(acc, n, replicas, per_replica * replicas, tpot, d.ttft_s, fits, goal, c,
                            d.basis + link_note, flags=f"--weights {traffic.weights}" if traffic.weights != "bf16"
                            else "", decode_batch=batch, weight_bytes_read=d.weight_bytes_read))
    return rows, why


def _infer_precision(acc: Accelerator) -> str:
    """Inference holds its weights in the compute dtype: pure bf16 where the chip has it, else fp16."""
    return "bf16" if acc.bf16 else default_precision(gpu=True, bf16=False)


def _serve_step(acc: Accelerator, planner: Planner, setup: Setup, traffic: Traffic, c: Constraints, goal: Goal,
                calibration: Calibration | None) -> tuple[Option | None, str]:
    """A non-decoder model served one batch at a time on one GPU per replica: the captured inference step."""
    from gpuwise.planning.cost.step import step_time

    int8 = traffic.weights == "int8"
    sixteen = acc.peak_tflops.get("bf16") or acc.peak_tflops.get("fp16")
    if not int8 and not sixteen:
        if not acc.peak_tflops.get("int8"):
            return None, "no bf16, fp16 or int8 rate in the catalog"
        int8 = True  # an int8-only chip (Coral, NPUs) runs the model quantised
    if int8 and not acc.peak_tflops.get("int8"):
        return None, "no int8 rate in the catalog"
    batch = setup.micro_batch
    try:
        step = planner.per_gpu(setup)
    except NotApplicable as exc:
        return None, exc.args[0]
    need = step.peak_bytes / (step.setup.compute_dtype.itemsize if int8 else 1)
    if need > acc.memory_bytes:
        return None, f"needs {need / 2**30:.3g} GiB, has {acc.memory_bytes / 2**30:.3g}"
    t = step_time(step, acc, calibration=calibration, int8=int8)
    if t is None:
        return None, "no rate or memory bandwidth in the catalog"
    per_replica = batch / t.seconds
    replicas = math.ceil(traffic.tokens_per_s / per_replica) if traffic.tokens_per_s is not None else 1
    if c.max_gpus is not None and replicas > c.max_gpus:
        return None, f"needs {replicas} GPUs, over --max-gpus {c.max_gpus}"
    return _served(acc, 1, replicas, per_replica * replicas, t.seconds, t.seconds, None, goal, c, t.basis,
                   flags="--weights int8" if int8 else "", mfu=t.mfu), ""


def _served(acc: Accelerator, n: int, replicas: int, throughput: float, latency: float, first: float,
            fits: int | None, goal: Goal, c: Constraints, basis: str, *, flags: str, mfu: float | None = None,
            decode_batch: int | None = None, weight_bytes_read: float | None = None) -> Option:
    rent, buy = _rent(acc, c), _buy(acc, c)
    gpus = n * replicas
    hours = None if goal.amount is None else goal.amount / throughput / 3600
    watts = acc.tdp_w * gpus if acc.tdp_w else None
    return Option(
        gpu=acc.key, name=acc.name, count=n, fits=True, setup=None, flags=flags, step_time_s=latency,
        throughput=throughput, mfu=mfu, time_to_goal_s=None if hours is None else hours * 3600,
        rent_usd_per_hour=rent, rent_usd=None if rent is None or hours is None else rent.usd * gpus * hours,
        buy_usd=None if buy is None else buy.usd * gpus, buy_price=buy,
        energy_kwh=None if watts is None or hours is None else watts * hours / 1000,
        per_joule=None if watts is None else throughput / watts, basis=basis, per_user=1 / latency,
        ttft_s=first, max_concurrency=fits, replicas=replicas, decode_batch=decode_batch,
        weight_bytes_read=weight_bytes_read)


# -- the guide: canonical scenarios, ranked by the same engine ------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    command: str  # the gpuwise recommend line that ranks it in full
    fastest: Option | None
    cheapest: Option | None  # by rent for the goal (training) or fleet rent per hour (serving)
    most_per_joule: Option | None


@dataclass(frozen=True, kw_only=True)
class Guide:
    scenarios: tuple[Scenario, ...]
    mode: Mode


def _picks(r: Recommendation, cost) -> tuple[Option | None, Option | None, Option | None]:
    rows = list(r.rows)
    if not rows:
        return None, None, None
    timed = [o for o in rows if (o.time_to_goal_s or o.step_time_s) is not None]
    fastest = min(timed, key=lambda o: o.time_to_goal_s or o.step_time_s) if r.traffic is None else min(
        rows, key=lambda o: o.step_time_s)
    priced = [o for o in rows if cost(o) < math.inf]
    cheapest = min(priced, key=cost) if priced else None
    powered = [o for o in rows if o.per_joule is not None]
    return fastest, cheapest, max(powered, key=lambda o: o.per_joule) if powered else None


def guide(*, catalog: Catalog | None = None, calibrations: Mapping[str, Calibration] | None = None) -> Guide:
    """What the buying guides say in prose, computed: six common jobs, each ranked over the whole catalog, with
    the fastest, the cheapest and the most work per joule. Nothing here is typed in: it is ``recommend``'s and
    ``serve``'s ranking of each job."""
    from gpuwise.planning.sources import resolve_source

    catalog = catalog or load_catalog()
    kw = {"catalog": catalog, "calibrations": calibrations}
    c = Constraints()
    jobs = [
        ("learn: GPT-2 (124M) on 1B tokens within a day", "--model gpt2 --seq 1024 --batch 32 --tokens 1e9 "
         "--deadline 1d",
         lambda: recommend(resolve_source("gpt2", None), Setup.for_batch(batch=32, micro_batch=32, seq=1024),
                           Goal(tokens=1e9), replace(c, deadline_s=86400), **kw)),
        ("LoRA fine-tune of a 7B model, 50M tokens within a day",
         "--model llama2-7b --task finetune-lora --seq 2048 --batch 16 --tokens 5e7 --deadline 1d",
         lambda: recommend(resolve_source("llama2-7b", None), Setup.for_batch(
             batch=16, micro_batch=16, seq=2048, task="finetune-lora"), Goal(tokens=5e7), replace(c, deadline_s=86400),
             **kw)),
        ("full fine-tune of a 7B model, 1B tokens within 3 days",
         "--model llama2-7b --seq 2048 --batch 64 --tokens 1e9 --deadline 3d",
         lambda: recommend(resolve_source("llama2-7b", None), Setup.for_batch(batch=64, micro_batch=64, seq=2048),
                           Goal(tokens=1e9), replace(c, deadline_s=3 * 86400), **kw)),
        ("pre-train an 8B model on 1T tokens within 30 days",
         "--model llama3-8b --seq 8192 --batch 512 --tokens 1e12 --max-gpus 512 --deadline 30d",
         lambda: recommend(resolve_source("llama3-8b", None), Setup.for_batch(batch=512, micro_batch=512, seq=8192),
                           Goal(tokens=1e12), replace(c, max_gpus=512, deadline_s=30 * 86400), **kw)),
        ("serve a 70B model to 100 users (TTFT <= 450 ms, TPOT <= 40 ms)",
         "--model llama2-70b --serve --concurrency 100 --ttft-ms 450 --tpot-ms 40",
         lambda: serve(resolve_source("llama2-70b", None), Traffic(concurrency=100, ttft_s=0.45, tpot_s=0.04), c,
                       **kw)),
        ("edge vision: MobileNetV2 at int8, batch 1", "--model mobilenet-v2 --serve --weights int8 --segment edge",
         lambda: serve(resolve_source("mobilenet-v2", None), Traffic(weights="int8"), replace(c, segments=("edge",)),
                       **kw)),
    ]
    scenarios = []
    for name, flags, run in jobs:
        r = run()
        cost = _serving_cost(r.constraints) if r.traffic is not None else (
            lambda o: o.rent_usd if o.rent_usd is not None else math.inf)
        fastest, cheapest, green = _picks(r, cost)
        scenarios.append(Scenario(name=name, command=f"gpuwise recommend {flags}", fastest=fastest, cheapest=cheapest,
                                  most_per_joule=green))
    return Guide(scenarios=tuple(scenarios), mode=c.mode)
