"""What training and serving rank alike: the user's filters, budget and deadline, and the time-cost Pareto front.

>>> pareto(rows, lambda o: o.rent_usd)                                                   # doctest: +SKIP
{0, 3}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import Accelerator
from gpuwise.recommend.option import Option
from gpuwise.recommend.request import Constraints, Goal


def chosen(acc: Accelerator, c: Constraints) -> bool:
    """The user's own filters: rows they ruled out are not listed at all."""
    if c.gpus and acc.key not in c.gpus:
        return False
    if c.segments and acc.segment not in c.segments:
        return False
    if c.vendors and acc.vendor.lower() not in {v.lower() for v in c.vendors}:
        return False
    return not (c.ecosystem and acc.ecosystem != c.ecosystem)


def check_goal_for_limits(goal: Goal, c: Constraints) -> None:
    """A deadline is on the time to a goal, and so is a rent budget; without a goal neither can be judged."""
    asks = [f for f, v in (("--deadline", c.deadline_s),
                           ("--budget", c.budget_usd if c.mode == "rent" else None)) if v is not None]
    if asks and goal.amount is None:
        raise GpuwiseError(f"{asks[0]} is judged against a goal, and none was given",
                           "add --tokens (or --samples, or --epochs with --dataset-size)")


def over(r: Option, c: Constraints) -> str | None:
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


def within(rows: Iterable[Option], c: Constraints) -> tuple[list[Option], list[Option]]:
    """(the rows within the budget and deadline, the rest with why)."""
    kept, out = [], []
    for r in rows:
        why = over(r, c)
        (out if why else kept).append(replace(r, excluded=why) if why else r)
    return kept, out


def pareto(rows: list[Option], cost: Callable[[Option], float]) -> set[int]:
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
