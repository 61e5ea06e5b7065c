"""The value of one knob at which a step just fits a GPU: ``gpuwise plan --solve``.

Plan answers "does this fit"; users ask "what is the longest context, the largest batch, the fewest GPUs that fits"
(llmfit#140, Lightning#20447). Each answer is searched with real probes: a probe is the fit plan itself decides
(``fit.fit_on`` of ``Planner.per_gpu``, the captured step), so the answer fits exactly where ``plan`` says it does.
Memory only grows with the context and the micro-batch, and only shrinks with sharded GPUs, so a search brackets the
boundary and bisects it:

- ``max-context``: the longest ``--seq`` (``--context`` for ``--task decode``). Activations are not affine in the
  sequence (eager attention keeps s x s scores), so every probe is a capture: powers of two from 1,024 up (or down)
  to a bracket, then bisection to a multiple of 256 tokens (``CONTEXT_GRAIN``; exact to the token below 256). The
  model's positions cap it (GPT-2: 1,024; a decode step needs one position more than it caches).
- ``max-batch``: the largest ``--micro-batch``. Memory is affine in it (capture/scaling.py), so the captures at 1 and
  2 predict the answer (``fit.max_micro_batch``, the plan's "max micro-batch"); the answer and the answer + 1 are then
  captured to confirm it, and where they disagree the search gallops from there and bisects.
- ``min-gpus``: the fewest ``--gpus``. Under ``--sharding zero1|zero2|fsdp`` the data-parallel degree grows (over
  ``--tp x --pp x --cp`` as given): powers of two, then bisection; one capture serves them all when the micro-batch is
  fixed, as sharding applies after it. With ``--tp`` alone the tensor-parallel degree doubles (1, 2, 4, ...: a capture
  each). DDP replicates the model states, so more GPUs hold no less each: the answer is one GPU or none.

Probes: about log2(answer / 1,024) + log2(answer / 256) for a context, 2-3 for a batch, at most 2 log2(65,536) for
GPUs; each probe captures a few small stacks (read back from the disk cache where kept). ``Solution.probes`` lists
them all.

>>> gpt2 = resolve_source("gpt2", None)                                                    # doctest: +SKIP
>>> s = solve(gpt2, "max-batch", Request(task="decode", context=1000), gpu="p4")          # doctest: +SKIP
>>> s.value, s.failing.value, s.plan.fits                                                 # doctest: +SKIP
(209, 210, True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal, get_args

from gpuwise.errors import GpuwiseError, NotApplicable
from gpuwise.planning.setup import MAX_BATCH, Request, Setup, resolve

if TYPE_CHECKING:  # they import torch; check_goal runs before it loads
    from gpuwise.hardware.calibration import Calibration
    from gpuwise.hardware.catalog import Accelerator, Catalog
    from gpuwise.planning.planner import MemoryPlan

Goal = Literal["max-context", "max-batch", "min-gpus"]
GOALS: tuple[str, ...] = get_args(Goal)
CONTEXT_START = 1024  # the first context probed; the search doubles or halves from it
CONTEXT_GRAIN = 256  # a context answer of this or more is a multiple of it (or the model's cap); below, exact
MAX_CONTEXT = 1 << 24  # Setup's limit on --seq and --context: the cap where the model has no positions limit
MAX_GPUS = 1 << 16  # Setup's limit on --gpus
MAX_TP = 1 << 12  # Setup's limit on --tp


@dataclass(frozen=True, kw_only=True)
class Probe:
    """One value planned: whether the step fits the GPU there, and what it needs (``GpuFit.required_bytes``)."""

    value: int
    fits: bool
    required_bytes: int


@dataclass(frozen=True, kw_only=True)
class Solution:
    """The answer to ``--solve``, the plan at it, and the boundary that makes it the answer."""

    goal: Goal
    flag: str  # the flag the value is for: --seq, --context, --micro-batch or --gpus
    gpu: str  # catalog key fitted on (the plan's ``gpu``)
    memory_bytes: int  # that GPU's
    value: int | None  # the answer; None: no value fits
    # the nearest value past the answer that does not fit: the next one up for max-*, the next count down for
    # min-gpus; without an answer, the most favourable value tried. None where the answer is a bound (``bound``)
    failing: Probe | None
    bound: str | None  # why nothing past the answer was tried: the model's positions, the fewest GPUs...
    reason: str | None  # why no value fits, and the flag that changes that (min-gpus under ddp, say)
    plan: MemoryPlan  # at the value; without one, at the most favourable value tried (with its remedies)
    probes: tuple[Probe, ...]  # in the order run
    captures: int  # fake-tensor captures behind the probes (disk-cache hits included), not counting the plan's


def check_goal(goal: str, request: Request) -> Setup:
    """The setup the search starts from; refuses a goal that is not one, or one whose flag the user also gave, and a
    request ``resolve`` refuses (before torch loads)."""
    if goal not in GOALS:
        raise GpuwiseError(f"--solve {goal!r} is not one of {', '.join(GOALS)}", f"pass --solve {GOALS[0]}")
    task = request.task or "train"
    if goal == "max-context":
        flag, given = ("--context", request.context) if task == "decode" else ("--seq", request.seq)
        if given is not None:
            raise GpuwiseError(f"--solve max-context solves {flag}, and {flag} {given} was given",
                               f"drop {flag} {given}")
    elif goal == "max-batch":
        for flag, given in (("--batch", request.batch), ("--micro-batch", request.micro_batch)):
            if given is not None:
                raise GpuwiseError(f"--solve max-batch solves the micro-batch, and {flag} {given} was given",
                                   f"drop {flag} {given}")
    else:
        if request.gpus is not None:
            raise GpuwiseError(f"--solve min-gpus solves --gpus, and --gpus {request.gpus} was given",
                               f"drop --gpus {request.gpus}")
        if request.nodes is not None:
            raise GpuwiseError("--solve min-gpus counts GPUs, not nodes", f"drop --nodes {request.nodes}")
        if task in ("infer", "decode"):
            raise GpuwiseError(f"--solve min-gpus scales training over GPUs, not --task {task}",
                               "for serving over GPUs run gpuwise recommend --serve")
        if request.sharding not in (None, "ddp"):  # sharded: the fewest data-parallel GPUs the flags allow
            group = (request.tp or 1) * (request.pp or 1) * (request.cp or 1)
            first = None
            for dp in (1 << k for k in range(1, 17)):
                try:
                    return resolve(replace(request, gpus=group * dp))
                except GpuwiseError as exc:
                    first = first or exc
                if group * dp * 2 > MAX_GPUS:
                    break
            raise first
    return resolve(request)


@dataclass(frozen=True, kw_only=True)
class _Found:
    value: int | None
    failing: int | None
    shown: int  # the value whose plan is shown
    setup: Callable[[int], Setup]
    bound: str | None = None
    reason: str | None = None


class _Prober:
    """Plans values on one GPU with one Planner (each capture once), remembering every probe."""

    def __init__(self, source, acc: Accelerator) -> None:
        from gpuwise.planning.planner import Planner

        self.planner = Planner(source)
        self.acc = acc
        self.probes: dict[int, Probe] = {}
        self.captures: dict[int, int] = {}  # id(workload) -> its captures
        self.max_batch = 0  # the batch model's answer, where a probe asked for it

    def fit(self, value: int, setup: Setup, *, batch_model: bool = False) -> Probe:
        from gpuwise.planning.fit import fit_on

        if value in self.probes:
            return self.probes[value]
        try:
            step = self.planner.per_gpu(setup, batch_model=batch_model)
        except NotApplicable as exc:  # the user asked for this setup: the model cannot take it
            raise GpuwiseError(*exc.args) from exc
        fit = fit_on(step, self.acc, timed=False)
        if batch_model:
            self.max_batch = fit.max_batch
        self.captures[id(step.workload)] = sum(len(group) for group in step.workload.captures)
        probe = self.probes[value] = Probe(value=value, fits=fit.fits, required_bytes=fit.required_bytes)
        return probe


def _boundary(ok: Callable[[int], bool], first: int, up: Iterator[int], down: Iterator[int],
              between: Callable[[int, int], int | None]) -> tuple[int | None, int | None]:
    """(lo, hi) of a predicate true up to some value and false past it: lo the largest value found true (None: none
    is), hi the smallest found false (None: every value ``up`` gives is true), adjacent once ``between`` has none
    left. Gallops from ``first`` along ``up`` (increasing) or ``down`` (decreasing), then bisects."""
    lo = hi = None
    if ok(first):
        lo = first
        for v in up:
            if not ok(v):
                hi = v
                break
            lo = v
        else:
            return lo, None
    else:
        hi = first
        for v in down:
            if ok(v):
                lo = v
                break
            hi = v
        else:
            return None, hi
    while (mid := between(lo, hi)) is not None:
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def _max_context(source, request: Request, base: Setup, prober: _Prober) -> _Found:
    decode = base.task == "decode"
    field, flag = ("context", "--context") if decode else ("seq", "--seq")
    positions = getattr(source, "max_positions", None)
    cap = MAX_CONTEXT if positions is None else max(positions - 1 if decode else positions, 1)

    def setup(v: int) -> Setup:
        return resolve(replace(request, **{field: v}))

    first = min(CONTEXT_START, cap)
    try:
        source.check(setup(first))
    except GpuwiseError as exc:  # an image model, a file's model: no sequence to solve for
        raise GpuwiseError(f"--solve max-context varies {flag}: {exc.message}", exc.hint) from exc

    def up() -> Iterator[int]:
        v = first
        while v < cap:
            v = min(2 * v, cap)
            yield v

    def down() -> Iterator[int]:
        v = first
        while v > 1:
            v //= 2
            yield v

    def between(lo: int, hi: int) -> int | None:
        mid = (lo + hi) // 2
        if mid >= CONTEXT_GRAIN:  # a multiple of the grain strictly inside (lo, hi), if any
            mid = mid // CONTEXT_GRAIN * CONTEXT_GRAIN
            mid += CONTEXT_GRAIN if mid <= lo else 0
        return mid if lo < mid < hi else None

    lo, hi = _boundary(lambda v: prober.fit(v, setup(v)).fits, first, up(), down(), between)
    bound = None
    if hi is None:
        bound = (f"{source.name}'s {positions:,} positions" + (", one kept for the token the step adds" if decode
                                                               else "") if positions is not None
                 else f"the longest {flag} gpuwise plans")
    return _Found(value=lo, failing=hi, shown=lo or hi, setup=setup, bound=bound)


def _max_batch(source, request: Request, base: Setup, prober: _Prober) -> _Found:
    def setup(v: int) -> Setup:
        return resolve(replace(request, micro_batch=v))

    if not prober.fit(1, setup(1), batch_model=True).fits:
        return _Found(value=None, failing=1, shown=1, setup=setup)
    guess = min(max(prober.max_batch, 1), MAX_BATCH)  # 0 where the ops change with the batch: no batch model

    def up() -> Iterator[int]:  # guess + 1 first: the confirmation; then galloping
        step = 1
        while guess + step - 1 < MAX_BATCH:
            yield min(guess + step, MAX_BATCH)
            step *= 2

    def down() -> Iterator[int]:  # guess - 1 first; batch 1 fits (probed above)
        step = 1
        while guess - step >= 1:
            yield guess - step
            step *= 2
        yield 1

    def between(lo: int, hi: int) -> int | None:
        mid = (lo + hi) // 2
        return mid if lo < mid < hi else None

    lo, hi = _boundary(lambda v: prober.fit(v, setup(v)).fits, guess, up(), down(), between)
    bound = None if hi is not None else f"the largest --micro-batch gpuwise plans ({MAX_BATCH:,})"
    return _Found(value=lo, failing=hi, shown=lo, setup=setup, bound=bound)


def _min_gpus(source, request: Request, base: Setup, prober: _Prober) -> _Found:
    if base.sharding != "ddp":
        return _data_parallel(request, base, prober)
    if request.tp is not None:
        return _tensor_parallel(request, prober)

    def setup(n: int) -> Setup:
        return base

    if prober.fit(base.gpus, base).fits:
        return _Found(value=base.gpus, failing=None, shown=base.gpus, setup=setup,
                      bound="the fewest GPUs the run takes" if base.gpus > 1 else "one GPU")
    return _Found(value=None, failing=base.gpus, shown=base.gpus, setup=setup,
                  reason="--sharding ddp replicates the model states on every GPU, so no number of GPUs holds less "
                         "each: add --sharding fsdp (or zero2, zero1) to shard them, or --tp N to split the model")


def _data_parallel(request: Request, base: Setup, prober: _Prober) -> _Found:
    """--sharding zero1|zero2|fsdp: the data-parallel degree, --tp x --pp x --cp as given."""
    group = base.tp * base.pp * base.cp
    valid: dict[int, Setup | None] = {}

    def at(dp: int) -> Setup | None:  # the run over dp data-parallel groups; None: one the flags do not allow
        if dp not in valid:
            r = replace(request, gpus=group * dp)
            if dp == 1 and group == 1:  # one GPU: nothing to shard
                r = replace(r, sharding=None)
            try:
                valid[dp] = resolve(r)
            except GpuwiseError:
                valid[dp] = None
        return valid[dp]

    ladder = [d for d in (1 << k for k in range(17)) if group * d <= MAX_GPUS and at(d) is not None]
    if not ladder:
        raise GpuwiseError(f"--solve min-gpus: no data-parallel count of {group} x 1, 2, 4, ... GPUs takes this run",
                           "check --batch against the GPU count (it must split evenly), or drop --ep")

    def ok(dp: int) -> bool:  # true where it does NOT fit: the boundary's low side
        return not prober.fit(group * dp, at(dp)).fits

    def between(lo: int, hi: int) -> int | None:
        mid = (lo + hi) // 2
        return next((d for d in sorted(range(lo + 1, hi), key=lambda d: abs(d - mid)) if at(d) is not None), None)

    lo, hi = _boundary(ok, ladder[0], iter(ladder[1:]), iter(()), between)

    def setup(n: int) -> Setup:  # a count the ladder or the bisection found valid
        return valid[n // group]

    if hi is None:
        n = group * lo
        return _Found(value=None, failing=n, shown=n, setup=setup,
                      reason=f"even {n:,} GPUs do not fit: what {base.sharding} does not shard (the activations, "
                             f"the gathered blocks) is more than one GPU holds; add --checkpointing full, or --tp N")
    return _Found(value=group * hi, failing=None if lo is None else group * lo, shown=group * hi, setup=setup,
                  bound=None if lo is not None else ("one GPU" if group * hi == 1 else "the fewest GPUs the run takes"))


def _tensor_parallel(request: Request, prober: _Prober) -> _Found:
    """--tp alone: the tensor-parallel degree over powers of two (each a capture); the first that fits."""
    setups: dict[int, Setup] = {}
    failing, reason = None, None
    tp = 1
    while tp <= MAX_TP:
        try:
            s = resolve(replace(request, tp=tp))
        except GpuwiseError:  # --sequence-parallel needs --tp 2 or more
            tp *= 2
            continue
        setups[s.gpus] = s
        try:
            probe = prober.fit(s.gpus, s)
        except GpuwiseError as exc:  # the model splits no further (heads not divisible by --tp)
            reason = exc.message
            break
        if probe.fits:
            return _Found(value=s.gpus, failing=failing, shown=s.gpus, setup=setups.__getitem__,
                          bound=None if failing is not None else "the fewest GPUs the run takes")
        failing = s.gpus
        tp *= 2
    if failing is None:
        raise GpuwiseError(reason or "--solve min-gpus: no --tp degree takes this run", "drop --tp")
    return _Found(value=None, failing=failing, shown=failing, setup=setups.__getitem__,
                  reason=f"no --tp degree fits ({reason or f'up to --tp {MAX_TP}'}); add --sharding fsdp to shard "
                         "the states over data-parallel GPUs too")


_SEARCH = {"max-context": _max_context, "max-batch": _max_batch, "min-gpus": _min_gpus}


def solve(source, goal: str, request: Request, *, gpu: str | None = None, primary: str | None = None,
          catalog: Catalog | None = None, calibrations: dict[str, Calibration] | None = None) -> Solution:
    """The largest context or micro-batch, or the fewest GPUs, at which ``request`` fits ``gpu`` (else ``primary``,
    else the H100 SXM: the GPU ``plan`` decides "fits" for), with the plan there (``plan``'s keywords as ``plan``).

    >>> solve(resolve_source("gpt2", None), "max-context", Request(micro_batch=8), gpu="t4").value  # doctest: +SKIP
    """
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.planning.planner import DEFAULT_GPU, plan

    base = check_goal(goal, request)
    catalog = catalog or load_catalog()
    acc = catalog.get(gpu or primary or DEFAULT_GPU)
    if base.task == "decode" and base.context is None and goal != "max-context":  # as plan names the context
        source.check(base)
        request = replace(request, context=source.context(base))
        base = resolve(request)
    prober = _Prober(source, acc)
    found = _SEARCH[goal](source, request, base, prober)
    at = plan(source, found.setup(found.shown), gpu=gpu, primary=primary, catalog=catalog, calibrations=calibrations)
    flag = {"max-context": "--context" if base.task == "decode" else "--seq", "max-batch": "--micro-batch",
            "min-gpus": "--gpus"}[goal]
    return Solution(goal=goal, flag=flag, gpu=acc.key, memory_bytes=acc.memory_bytes, value=found.value,
                    failing=None if found.failing is None else prober.probes[found.failing], bound=found.bound,
                    reason=found.reason, plan=at, probes=tuple(prober.probes.values()),
                    captures=sum(prober.captures.values()))


def solve_here(goal: str, model: str | None, request: Request, *, environ: Mapping[str, str],
               hf_config: str | None = None, gpu: str | None = None, device: str | None = None) -> Solution:
    """``gpuwise plan --solve``: ``solve`` on the GPU ``gpuwise plan`` fits on (``planner.where``)."""
    from gpuwise.planning.planner import where
    from gpuwise.planning.sources.resolve import resolve_source

    return solve(resolve_source(model, hf_config), goal, request, **where(environ, gpu=gpu, device=device))
