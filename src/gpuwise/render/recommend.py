"""``gpuwise recommend``: the ranked table, the rows left out and why, and the JSON the issue specifies."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table

from gpuwise.render._common import _num, to_jsonable

if TYPE_CHECKING:
    from gpuwise.planning.recommend import Option, Recommendation

SHOWN = 15  # rows in the table; --json has every one


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    for unit, size in (("y", 365 * 86400), ("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.3g} {unit}"
    return f"{s:.3g} s"


def _usd(x: float | None) -> str:
    if x is None:
        return "-"
    return f"${x:,.0f}" if x >= 100 else f"${x:,.2f}"


def _rate(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.3g}"


def _settings(o: Option) -> str:
    """The run in a few words: sharding, checkpointing, precision if not bf16 autocast, micro-batch x accumulation."""
    s = o.setup
    if s is None:
        return "-"
    parts = [s.sharding] if s.gpus > 1 else []
    parts += ["ckpt"] if s.checkpointing == "full" else []
    parts += [s.spec.compute] if s.precision != "bf16-mixed" else []  # fp16 (autocast), fp32, or bf16 (pure)
    parts.append(f"mb {s.micro_batch}" + (f"x{s.grad_accum}" if s.grad_accum > 1 else ""))
    return " ".join(parts)


def _shown(r: Recommendation) -> list[Option]:
    """The first rows, and every Pareto row after them (the choices worth a look)."""
    top = list(r.rows[:SHOWN])
    return top + [o for o in r.rows[SHOWN:] if o.pareto]


def render_recommend(r: Recommendation, console: Console) -> None:
    goal = f"{r.goal.amount:.3g} {r.unit}" if r.goal.amount is not None else "no goal (give --tokens)"
    cost_col = "rent" if r.constraints.mode == "rent" else "buy"
    table = Table(title=f"{r.model} · {r.setup.task} · global batch {r.setup.batch} · goal {goal} · "
                        f"ranked by {r.sort}", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for name, justify in (("", "left"), ("gpu", "left"), ("n", "right"), (f"{r.unit}/s", "right"),
                          ("MFU", "right"), ("time", "right"), (cost_col, "right"), ("kWh", "right"),
                          (f"{r.unit}/J", "right"), ("settings", "left")):
        table.add_column(name, justify=justify, no_wrap=True)
    for o in _shown(r):
        cost = o.rent_usd if r.constraints.mode == "rent" else o.buy_usd
        table.add_row("*" if o.pareto else "", o.gpu, str(o.count), _rate(o.throughput),
                      _num(None if o.mfu is None else o.mfu * 100, ".0f") + ("%" if o.mfu is not None else ""),
                      _duration(o.time_to_goal_s), _usd(cost), _num(o.energy_kwh, ".3g"), _num(o.per_joule, ".3g"),
                      _settings(o))
    console.print(table)
    more = len(r.rows) - len(_shown(r))
    notes = ["*: on the time-cost Pareto front (nothing else is both faster and cheaper)."]
    if more > 0:
        notes.append(f"{more} more rows with --json.")
    notes.append("time: to the goal at the predicted rate; kWh and per-joule at board power (TDP), an upper "
                 "bound; settings: sharding, ckpt = activation checkpointing, mb = micro-batch x accumulation.")
    if r.best is not None:
        notes.append(f"to run the first row: gpuwise train (or plan) ... {r.best.flags}".rstrip()
                     if r.best.flags else "the first row runs as given")
        notes.append(f"basis of the first row: {r.best.basis}")
        if r.best.rent_usd_per_hour is not None and r.constraints.mode == "rent":
            p = r.best.rent_usd_per_hour
            notes.append(f"its price: ${p.usd:.2f}/GPU-hour, {p.source}" + (f" ({p.date})" if p.date else ""))
    console.print("\n".join(notes))
    if r.excluded:
        out = Table(title="left out", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
        out.add_column("gpu", no_wrap=True)
        out.add_column("n", justify="right")
        out.add_column("why", overflow="fold")
        seen = set()
        for o in r.excluded:
            if (o.gpu, o.excluded) in seen:
                continue
            seen.add((o.gpu, o.excluded))
            out.add_row(o.gpu, str(o.count), o.excluded or "")
        console.print(out)


def recommend_json(r: Recommendation) -> dict[str, Any]:
    def row(o: Option) -> dict[str, Any]:
        return {"gpu": o.gpu, "name": o.name, "count": o.count, "fits": o.fits, "flags": o.flags,
                "setup": to_jsonable(o.setup), "step_time_s": o.step_time_s, f"{r.unit}_per_s": o.throughput,
                f"{r.unit}_per_s_per_gpu": o.per_gpu, "mfu": o.mfu, "time_to_goal_s": o.time_to_goal_s,
                "rent_usd_per_gpu_hour": to_jsonable(o.rent_usd_per_hour), "rent_usd": o.rent_usd,
                "buy_usd": o.buy_usd, "buy_price": to_jsonable(o.buy_price), "energy_kwh": o.energy_kwh,
                f"{r.unit}_per_joule": o.per_joule, "pareto": o.pareto, "basis": o.basis, "excluded": o.excluded}

    return {"workload": {"model": r.model, "setup": to_jsonable(r.setup)},
            "goal": {"unit": r.unit, "amount": r.goal.amount}, "sort": r.sort,
            "constraints": to_jsonable(r.constraints),
            "rows": [row(o) for o in r.rows] + [row(o) for o in r.excluded]}
