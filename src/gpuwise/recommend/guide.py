"""The buying guide: what the guides say in prose, computed. Six common jobs (a table, ``JOBS``), each ranked over
the whole catalog by the same engine, with the fastest, the cheapest and the most work per joule.

The jobs share nothing (each has its own model, captures and ranking), so where the process may use more than one
core they run in worker processes, one job each at a time; the scenarios are the same either way.

>>> [s.name for s in guide().scenarios][:1]                                           # doctest: +SKIP
['learn: GPT-2 (124M) on 1B tokens within a day']
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from gpuwise.hardware.calibration import Calibration
from gpuwise.hardware.catalog import Catalog, load_catalog
from gpuwise.planning.setup import Setup
from gpuwise.recommend.option import Option, Recommendation
from gpuwise.recommend.request import Constraints, Goal, Mode, Traffic
from gpuwise.recommend.search import recommend, training_cost
from gpuwise.recommend.serve import serve, serving_cost

DAY = 86400


@dataclass(frozen=True, kw_only=True)
class Job:
    """One scenario: a model and either a training run (``setup``, ``goal``) or serving ``traffic``, within
    ``limits`` (Constraints' fields); ``flags`` is the same job as gpuwise recommend's command line."""

    name: str
    flags: str
    model: str
    setup: Setup | None = None
    goal: Goal = field(default_factory=Goal)
    traffic: Traffic | None = None
    limits: Mapping[str, object] = field(default_factory=dict)


JOBS: tuple[Job, ...] = (
    Job(name="learn: GPT-2 (124M) on 1B tokens within a day",
        flags="--model gpt2 --seq 1024 --batch 32 --tokens 1e9 --deadline 1d",
        model="gpt2", setup=Setup.for_batch(batch=32, micro_batch=32, seq=1024), goal=Goal(tokens=1e9),
        limits={"deadline_s": DAY}),
    Job(name="LoRA fine-tune of a 7B model, 50M tokens within a day",
        flags="--model llama2-7b --task finetune-lora --seq 2048 --batch 16 --tokens 5e7 --deadline 1d",
        model="llama2-7b", setup=Setup.for_batch(batch=16, micro_batch=16, seq=2048, task="finetune-lora"),
        goal=Goal(tokens=5e7), limits={"deadline_s": DAY}),
    Job(name="full fine-tune of a 7B model, 1B tokens within 3 days",
        flags="--model llama2-7b --seq 2048 --batch 64 --tokens 1e9 --deadline 3d",
        model="llama2-7b", setup=Setup.for_batch(batch=64, micro_batch=64, seq=2048), goal=Goal(tokens=1e9),
        limits={"deadline_s": 3 * DAY}),
    Job(name="pre-train an 8B model on 1T tokens within 30 days",
        flags="--model llama3-8b --seq 8192 --batch 512 --tokens 1e12 --max-gpus 512 --deadline 30d",
        model="llama3-8b", setup=Setup.for_batch(batch=512, micro_batch=512, seq=8192), goal=Goal(tokens=1e12),
        limits={"max_gpus": 512, "deadline_s": 30 * DAY}),
    Job(name="serve a 70B model to 100 users (TTFT <= 450 ms, TPOT <= 40 ms)",
        flags="--model llama2-70b --serve --concurrency 100 --ttft-ms 450 --tpot-ms 40",
        model="llama2-70b", traffic=Traffic(concurrency=100, ttft_s=0.45, tpot_s=0.04)),
    Job(name="edge vision: MobileNetV2 at int8, batch 1",
        flags="--model mobilenet-v2 --serve --weights int8 --segment edge",
        model="mobilenet-v2", traffic=Traffic(weights="int8"), limits={"segments": ("edge",)}),
)


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


def _picks(r: Recommendation, cost: Callable[[Option], float]) -> tuple[Option | None, Option | None,
                                                                          Option | None]:
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
    """Each of ``JOBS`` ranked over ``catalog`` by ``recommend`` or ``serve``, and its picks. Nothing here is
    typed in but the jobs: the picks are the extremes of the engine's ranking."""
    catalog = catalog or load_catalog()
    c = Constraints()
    return Guide(scenarios=tuple(_scenarios(JOBS, catalog, c, calibrations)), mode=c.mode)


def _scenarios(jobs: tuple[Job, ...], catalog: Catalog, c: Constraints,
               calibrations: Mapping[str, Calibration] | None) -> list[Scenario]:
    """Each job's scenario, in the jobs' order: in worker processes where this process may use more than one core
    (each job captures its own model's steps: most of a minute of CPU together, and nothing shared between them), else
    here. Workers are spawned, not forked (this process may already hold torch's threads), each with one torch thread
    (the captures run on fake tensors: more threads only spin beside the other workers, 20-30% more CPU here)."""
    from gpuwise.environment import usable_cores

    workers = min(len(jobs), usable_cores())
    if workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        from concurrent.futures.process import BrokenProcessPool

        try:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                     initializer=_one_thread) as pool:
                done = [pool.submit(_scenario, job, catalog, c, calibrations) for job in jobs]
                return [f.result() for f in done]
        except (OSError, BrokenProcessPool):  # no processes here (a sandbox without semaphores), or one was killed
            pass
    return [_scenario(job, catalog, c, calibrations) for job in jobs]


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _scenario(job: Job, catalog: Catalog, c: Constraints, calibrations: Mapping[str, Calibration] | None
              ) -> Scenario:
    """``job`` ranked over ``catalog`` within ``c`` and its limits, and its picks."""
    from gpuwise.planning.sources.resolve import resolve_source

    source, limits = resolve_source(job.model, None), replace(c, **job.limits)
    if job.traffic is not None:
        r = serve(source, job.traffic, limits, catalog=catalog, calibrations=calibrations)
        cost = serving_cost(r.constraints)
    else:
        r = recommend(source, job.setup, job.goal, limits, catalog=catalog, calibrations=calibrations)
        cost = training_cost(r.constraints)
    fastest, cheapest, green = _picks(r, cost)
    return Scenario(name=job.name, command=f"gpuwise recommend {job.flags}", fastest=fastest, cheapest=cheapest,
                    most_per_joule=green)
