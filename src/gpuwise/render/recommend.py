"""``gpuwise recommend``: the ranked table, the rows left out and why, and the JSON the issue specifies."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from gpuwise.planning.cost.validation import HELD_OUT_ERROR
from gpuwise.render._common import (
    Column,
    Sheet,
    _num,
    _seconds3,
    print_fit,
    print_lines,
    print_wrapped,
    step_parts,
    to_jsonable,
)

if TYPE_CHECKING:
    from gpuwise.recommend.guide import Guide
    from gpuwise.recommend.option import Option, Recommendation
    from gpuwise.recommend.prices import Price

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
    s = getattr(o, "setup", None)  # a training row's run; None for a row left out (and a serving row)
    if s is None:
        return "-"
    parts = [s.sharding] if s.gpus > 1 else []
    parts += {"full": ["ckpt"], "selective": ["sel-ckpt"]}.get(s.checkpointing, [])
    parts += [("fp8" if s.spec.float8 else s.spec.compute)] if s.precision != "bf16-mixed" else []  # fp16, fp32, bf16
    parts.append(f"mb {s.micro_batch}" + (f"x{s.grad_accum}" if s.grad_accum > 1 else ""))
    return " ".join(parts)


def _shown(r: Recommendation) -> list[Option]:
    """The first rows, and every Pareto row after them (the choices worth a look)."""
    top = list(r.rows[:SHOWN])
    return top + [o for o in r.rows[SHOWN:] if o.pareto]


_PRIORITY = {"MFU": 2, "kWh": 4, "settings": 1, "TTFT": 1, "seqs": 2, "latency": 1, "batch": 2, "reps": 2}


def _fill(console: Console, title: str, columns: list[tuple[str, str]], rows: list[tuple[str, ...]]) -> None:
    """Print the rows as a table as wide as the console at most: a name is never split nor a figure cut; at a narrow
    width the least-needed columns go (a line says which) and the settings wrap at spaces; narrower than the
    GPU and the figures that rank it, each row is lines: its GPU, then its columns as "header: value"."""
    cols = [Column(key=name or "pareto", header=name or "*", numeric=justify == "right", wrap=name == "settings",
                   priority=_PRIORITY.get(name, 3 if "/J" in name or "/M" in name else 0))
            for name, justify in columns]
    print_fit(console, cols, [list(row) for row in rows], title=title)


def recommend_sheet(r: Recommendation) -> Sheet:
    """Every ranked row with its raw figures, for ``--format csv|md``: units in the keys, rent per GPU-hour with
    its provider and kind."""
    u = r.unit
    keys = ["gpu", "count", f"{u}_per_s", "step_time_s", "mfu", "time_to_goal_s", "rent_usd_per_gpu_hour",
            "rent_provider", "rent_kind", "rent_usd", "buy_usd", "energy_kwh", f"{u}_per_joule", "pareto", "flags"]
    if r.traffic is not None:
        keys += ["runtime", "tp", "pp", "replicas", "gpus_total", "decode_tokens_per_s", "ttft_s", "max_concurrency",
                 "kv_bytes_per_seq", "vllm_command"]
    rows = []
    for o in r.rows:
        price = o.rent_usd_per_hour
        d = {"gpu": o.gpu, "count": o.count, f"{u}_per_s": o.throughput, "step_time_s": o.step_time_s,
             "mfu": o.mfu, "time_to_goal_s": o.time_to_goal_s, "rent_usd_per_gpu_hour": price and price.usd,
             "rent_provider": price and price.provider, "rent_kind": price and price.kind, "rent_usd": o.rent_usd,
             "buy_usd": o.buy_usd, "energy_kwh": o.energy_kwh, f"{u}_per_joule": o.per_joule, "pareto": o.pareto,
             "flags": o.flags}
        if r.traffic is not None:
            par = dict(getattr(o, "parallel", None) or ())
            d |= {"runtime": getattr(o, "runtime", None), "tp": par.get("tp"), "pp": par.get("pp"),
                  "replicas": o.replicas, "gpus_total": o.gpus_total, "decode_tokens_per_s": o.per_user,
                  "ttft_s": o.ttft_s, "max_concurrency": o.max_concurrency,
                  "kv_bytes_per_seq": getattr(o, "kv_bytes_per_seq", None), "vllm_command": vllm_command(r, o)}
        rows.append(d)
    numeric = {"count", f"{u}_per_s", "step_time_s", "mfu", "time_to_goal_s", "rent_usd_per_gpu_hour", "rent_usd",
               "buy_usd", "energy_kwh", f"{u}_per_joule", "replicas", "gpus_total", "decode_tokens_per_s", "ttft_s",
               "max_concurrency", "kv_bytes_per_seq", "tp", "pp"}
    return Sheet(title=f"{r.model}: ranked by {r.sort}", rows=tuple(rows),
                 columns=tuple(Column(key=k, numeric=k in numeric) for k in keys))


def _rent_line(p: Price) -> str:
    """A rent price and where it comes from: the cloud, the kind, the instance and region of a snapshot offer."""
    where = " ".join(x for x in (p.provider, p.kind) if x)
    offer = ", ".join(x for x in ((f"{p.instance}" + (f" x{p.instance_gpus}" if p.instance_gpus else ""))
                                  if p.instance else None, p.region) if x)
    return (f"${p.usd:.2f}/GPU-hour" + (f" {where}" if where else "") + (f" ({offer})" if offer else "")
            + f", {p.source}" + (f" ({p.date})" if p.date else ""))


def _serving(r: Recommendation, console: Console) -> None:
    t = r.traffic
    decoder = r.unit == "tokens"
    demand = (f"{t.tokens_per_s:g} {r.unit}/s" if t.tokens_per_s is not None else
              f"{t.concurrency} users" if decoder else f"batch {r.setup.micro_batch}")
    slo = " ".join(x for x in ((f"TTFT <= {t.ttft_s * 1e3:g} ms" if t.ttft_s else ""),
                               (f"TPOT <= {t.tpot_s * 1e3:g} ms" if t.tpot_s else "")) if x)
    what = (f"{t.prompt_tokens} in / {t.output_tokens} out, {t.weights} weights, runtime {t.served_by}"
            f"{'' if t.runtime else ' (default)'}" if decoder else f"{t.weights}")
    title = f"{r.model} · serve {demand} · {what}{' · ' + slo if slo else ''} · ranked by {r.sort}"
    u = "tok" if decoder else "img"
    cols = [("", "left"), ("gpu", "left"), ("GPUs", "right"), ("per user" if decoder else "latency", "right"),
            (f"{u}/s", "right"), ("TTFT" if decoder else "batch", "right"), ("seqs" if decoder else "reps", "right"),
            ("$/h" if r.constraints.mode == "rent" else "buy", "right"), (f"$/M{u}", "right"), (f"{u}/J", "right")]
    rows = []
    for o in _shown(r):
        fleet = o.rent_usd_per_hour.usd * o.gpus_total if o.rent_usd_per_hour is not None else None
        per_m = None if fleet is None else fleet / (o.throughput * 3600) * 1e6
        gpus = f"{o.replicas}x{o.count}" if o.count > 1 else str(o.gpus_total)
        rows.append(("*" if o.pareto else "", o.gpu, gpus,
                     f"{o.per_user:.3g}" if decoder else f"{o.step_time_s * 1e3:.3g}ms",
                     _rate(o.throughput), f"{o.ttft_s * 1e3:.3g}ms" if decoder else str(r.setup.micro_batch),
                     _num(o.max_concurrency) if decoder else str(o.replicas),
                     _usd(fleet) if r.constraints.mode == "rent" else _usd(o.buy_usd), _usd(per_m),
                     _num(o.per_joule, ".3g")))
    _fill(console, title, cols, rows)
    notes = (["*: on the Pareto front of latency (time per output token) against cost. GPUs: replicas x GPUs per "
              "replica (its layout in the basis); per user: one stream's tokens/s; tok/s: output tokens of the "
              f"fleet, prompts sharing each step with decode ({t.served_by}'s batching); seqs: sequences one "
              f"replica's KV cache holds at the full context ({t.memory_share:.0%} of memory; a replica decodes at "
              f"most {t.seqs_limit} at once, --max-num-seqs); $/M: per million output tokens at the rent; per joule "
              "at board power."]
             if decoder else
             ["*: on the Pareto front of latency against cost. latency: one batch through the model; reps: "
              "replicas for --tokens-per-s; $/M: per million images at the rent; per joule at board power."])
    if (more := len(r.rows) - len(_shown(r))) > 0:
        notes.append(f"{more} more rows with --json.")
    if (moe := _moe(r)) is not None:
        notes.append(moe)
    if r.kv is not None:
        notes.append(f"KV cache: {r.kv.bytes / 2**20:,.1f} MiB a sequence at {r.kv.context:,} tokens on one GPU "
                     f"({r.kv.basis}).")
    if r.best is not None:
        notes.append(f"basis of the first row: {r.best.basis}")
        if decoder:
            from gpuwise.planning.cost.validation import SERVING_HELD_OUT

            notes.append(f"speeds: {SERVING_HELD_OUT}")
        if r.best.rent_usd_per_hour is not None and r.constraints.mode == "rent":
            notes.append(f"its price: {_rent_line(r.best.rent_usd_per_hour)}")
    for note in notes:
        print_wrapped(console, note)
    if r.best is not None and getattr(r.best, "runtime_command", None):
        print_wrapped(console, "to run the first row, each replica:")
        print_lines(console, [Text("  " + r.best.runtime_command)])  # whole: it pastes into a shell as printed
    elif r.best is not None and getattr(r.best, "vllm_args", None) is not None:
        print_wrapped(console, "to run the first row, each replica:")
        # never wrapped by rich: it pastes into a shell as printed
        from gpuwise.recommend.serve import served_name

        words = ("vllm", "serve", served_name(r.model), *r.best.vllm_args)
        print_lines(console, [Text(line) for line in _shell(words, min(80, console.width)).splitlines()])
    _left_out(r, console)


def _shell(words: tuple[str, ...], width: int = 80) -> str:
    """``vllm serve MODEL`` and its flag-value pairs in lines of at most ``width`` columns, continued with
    backslashes, a flag never apart from its value: a shell takes it as one line."""
    rest = words[3:]
    pieces = [" ".join(words[:3])] + [f"{rest[i]} {rest[i + 1]}" for i in range(0, len(rest), 2)]
    lines, line = [], "  " + pieces[0]
    for piece in pieces[1:]:
        if len(line) + 1 + len(piece) + 2 > width:
            lines.append(line + " \\")
            line = "    " + piece
        else:
            line += " " + piece
    return "\n".join([*lines, line])


def vllm_command(r: Recommendation, o: Option) -> str | None:
    """The ``vllm serve`` line of a serving row, copy-pasteable; None where the row has none (not a decoder)."""
    args = getattr(o, "vllm_args", None)
    from gpuwise.recommend.serve import served_name

    return None if args is None else " ".join(("vllm", "serve", served_name(r.model), *args))


def _billions(n: float) -> str:
    return f"{n / 1e9:.3g} B"


def _moe(r: Recommendation) -> str | None:
    """What a Mixture of Experts changes, and the routing the figures assume; None for a dense model."""
    e = r.experts
    if e is None:
        return None
    head = (f"Mixture of Experts: {_billions(e.total)} parameters, {_billions(e.active)} active per token "
            f"(top-{e.top_k} of {e.experts} routed experts a MoE layer).")
    if r.traffic is None:
        return (f"{head} Training FLOPs are the captured step's, each token through its {e.top_k} experts (~6 x "
                f"{_billions(e.active)} a token, not 6 x {_billions(e.total)}); memory holds every expert. Routing: "
                f"{r.routing or 'as captured'}.")
    from gpuwise.planning.cost.serving import experts_touched, moe_weights_read

    full = 16
    return (f"{head} Memory holds all {_billions(e.total)}; a decode step at batch B reads the dense weights and the "
            f"experts its B tokens touch, E(1 - (1 - k/E)^B) a layer: {e.top_k} of {e.experts} at batch 1 "
            f"({_billions(e.active)} read, why it decodes faster than a dense {_billions(e.total)} model), "
            f"{experts_touched(e.experts, e.top_k, full):.3g} at batch {full} "
            f"({_billions(moe_weights_read(e.total, e.active, experts=e.experts, top_k=e.top_k, tokens=full))}); "
            f"FLOPs 2 x {_billions(e.active)} a token. Assumes {r.routing}.")


def _left_out(r: Recommendation, console: Console) -> None:
    if not r.excluded:
        return
    rows, seen = [], set()
    for o in r.excluded:
        if (o.gpu, o.excluded) in seen:
            continue
        seen.add((o.gpu, o.excluded))
        rows.append([o.gpu, str(o.count), o.excluded or ""])
    print_fit(console, [Column(key="gpu"), Column(key="n", numeric=True), Column(key="why", wrap=True)], rows,
              title="left out")


def render_recommend(r: Recommendation, console: Console) -> None:
    if r.traffic is not None:
        _serving(r, console)
        return
    goal = f"{r.goal.amount:.3g} {r.unit}" if r.goal.amount is not None else "no goal (give --tokens)"
    cost_col = "rent" if r.constraints.mode == "rent" else "buy"
    title = f"{r.model} · {r.setup.task} · global batch {r.setup.batch} · goal {goal} · ranked by {r.sort}"
    u = "tok" if r.unit == "tokens" else "smp"
    cols = [("", "left"), ("gpu", "left"), ("n", "right"), (f"{u}/s", "right"), ("MFU", "right"), ("time", "right"),
            (cost_col, "right"), ("kWh", "right"), (f"{u}/J", "right"), ("settings", "left")]
    rows = []
    for o in _shown(r):
        cost = o.rent_usd if r.constraints.mode == "rent" else o.buy_usd
        rows.append(("*" if o.pareto else "", o.gpu, str(o.count), _rate(o.throughput),
                     _num(None if o.mfu is None else o.mfu * 100, ".0f") + ("%" if o.mfu is not None else ""),
                     _duration(o.time_to_goal_s), _usd(cost), _num(o.energy_kwh, ".3g"), _num(o.per_joule, ".3g"),
                     _settings(o)))
    _fill(console, title, cols, rows)
    more = len(r.rows) - len(_shown(r))
    notes = ["*: on the time-cost Pareto front (nothing else is both faster and cheaper)."]
    if more > 0:
        notes.append(f"{more} more rows with --json.")
    notes.append("time: to the goal at the predicted rate; kWh and per-joule at board power (TDP), an upper "
                 "bound; settings: sharding, ckpt = activation checkpointing (sel-ckpt: selective), mb = micro-batch x "
                 "accumulation.")
    if (moe := _moe(r)) is not None:
        notes.append(moe)
    if r.best is not None:
        if not r.best.flags:
            notes.append("the first row runs as given")
        err = getattr(r.best, "step_time_error", None)
        parts = step_parts(getattr(r.best, "phases_s", None), getattr(r.best, "families_s", None))
        notes.append(f"the first row's step: {_seconds3(r.best.step_time_s)}"
                     + (f" ±{100 * err:.0f}%" if err else "") + (f" ({parts})" if parts else "")
                     + f"; {HELD_OUT_ERROR}")
        notes.append(f"basis of the first row: {r.best.basis}")
        if r.best.rent_usd_per_hour is not None and r.constraints.mode == "rent":
            notes.append(f"its price: {_rent_line(r.best.rent_usd_per_hour)}")
    if r.uneven_counts:
        n = r.uneven_counts
        fit = next(b for b in range(r.setup.batch, r.setup.batch * n[-1] + 1) if all(b % k == 0 for k in n))
        notes.append(f"not tried: {', '.join(map(str, n))} GPUs, which --batch {r.setup.batch} does not split over "
                     f"evenly (--batch {fit} does).")
    for note in notes:
        print_wrapped(console, note)
    if r.best is not None and r.best.flags:  # the command on a line of its own, whole, to copy
        print_wrapped(console, "to run the first row (gpuwise plan takes the same flags):")
        print_lines(console, [Text(f"  gpuwise train ... {r.best.flags}")])
    _left_out(r, console)


def recommend_json(r: Recommendation) -> dict[str, Any]:
    def row(o: Option) -> dict[str, Any]:
        d = o.to_dict()  # training's and serving's figures both: this shape has either kind's
        return {"gpu": o.gpu, "name": o.name, "count": o.count, "fits": o.fits, "flags": o.flags,
                "setup": to_jsonable(d["setup"]), "step_time_s": o.step_time_s, f"{r.unit}_per_s": o.throughput,
                f"{r.unit}_per_s_per_gpu": o.per_gpu, "mfu": o.mfu, "time_to_goal_s": o.time_to_goal_s,
                "rent_usd_per_gpu_hour": to_jsonable(o.rent_usd_per_hour), "rent_usd": o.rent_usd,
                "buy_usd": o.buy_usd, "buy_price": to_jsonable(o.buy_price), "energy_kwh": o.energy_kwh,
                f"{r.unit}_per_joule": o.per_joule, "pareto": o.pareto, "basis": o.basis, "excluded": o.excluded,
                "phases_s": d["phases_s"], "families_s": d["families_s"], "step_time_error": d["step_time_error"],
                **({} if r.traffic is None else {
                    "decode_tokens_per_s": d["per_user"], "ttft_s": d["ttft_s"], "tpot_s": o.step_time_s,
                    "runtime": d.get("runtime"), "parallel": dict(d["parallel"]) if d.get("parallel") else None,
                    "prefill_share": d.get("prefill_share"), "runtime_command": d.get("runtime_command"),
                    "max_concurrency": d["max_concurrency"], "replicas": d["replicas"], "gpus_total": o.gpus_total,
                    "decode_batch": d["decode_batch"], "weight_bytes_read_per_gpu": d["weight_bytes_read"],
                    "kv_bytes_per_seq": d["kv_bytes_per_seq"],
                    "vllm_args": None if d["vllm_args"] is None else list(d["vllm_args"]),
                    "vllm_command": vllm_command(r, o)})}

    return {"workload": {"model": r.model, "setup": to_jsonable(r.setup)},
            "goal": {"unit": r.unit, "amount": r.goal.amount}, "sort": r.sort, "traffic": to_jsonable(r.traffic),
            "constraints": to_jsonable(r.constraints), "uneven_counts": list(r.uneven_counts),
            "experts": _experts_json(r), "routing": r.routing, "kv_cache": to_jsonable(r.kv),
            "rows": [row(o) for o in r.rows] + [row(o) for o in r.excluded]}


def _experts_json(r: Recommendation) -> dict[str, Any] | None:
    """A Mixture of Experts' counts; serving adds the weights a decode step reads at a few batch sizes."""
    e = r.experts
    if e is None:
        return None
    data: dict[str, Any] = {"experts": e.experts, "top_k": e.top_k, "routed_params": e.params, "total": e.total,
                            "active": e.active}
    if r.traffic is not None:
        from gpuwise.planning.cost.serving import experts_touched, moe_weights_read

        data["decode_read"] = [
            {"batch": b, "experts_touched": experts_touched(e.experts, e.top_k, b),
             "params_read": moe_weights_read(e.total, e.active, experts=e.experts, top_k=e.top_k, tokens=b)}
            for b in (1, 2, 4, 8, 16, 64, 256)]
    return data


def _pick(o: Option | None, serving: bool) -> str:
    if o is None:
        return "-"
    gpus = f"{o.replicas}x{o.count}" if serving and o.count > 1 else str(o.gpus_total)
    if serving:
        money = f", ${o.rent_usd_per_hour.usd * o.gpus_total:,.2f}/h" if o.rent_usd_per_hour else ""
        speed = f"{o.per_user:.3g} tok/s/user" if o.max_concurrency is not None else f"{o.step_time_s * 1e3:.2g} ms"
        return f"{gpus} {o.gpu}: {speed}{money}"
    money = f", {_usd(o.rent_usd)}" if o.rent_usd is not None else ""
    return f"{gpus} {o.gpu}: {_duration(o.time_to_goal_s)}{money}"


def render_guide(g: Guide, console: Console) -> None:
    columns = [Column(key="job", wrap=True), *(Column(key=name, wrap=True) for name in
                                                ("fastest", "cheapest (rent)", "most work per joule"))]
    rows = [[s.name, _pick(s.fastest, "serve" in s.command), _pick(s.cheapest, "serve" in s.command),
             _pick(s.most_per_joule, "serve" in s.command)] for s in g.scenarios]
    print_fit(console, columns, rows, title="which GPU for what: six jobs ranked over the catalog (gpuwise recommend "
              "--model ... ranks yours)", lines=True)
    print_wrapped(console, "Each row is the engine's own ranking of the job; rerun its command for the whole table "
                  "and the basis of each figure:")
    print_lines(console, [Text(f"  {s.command}") for s in g.scenarios])  # each whole on its line, to copy


def guide_json(g: Guide) -> dict[str, Any]:
    return {"mode": g.mode, "scenarios": [
        {"name": s.name, "command": s.command, **{pick: None if o is None else to_jsonable(o.to_dict()) for pick, o in
                                                  (("fastest", s.fastest), ("cheapest", s.cheapest),
                                                   ("most_per_joule", s.most_per_joule))}}
        for s in g.scenarios]}
