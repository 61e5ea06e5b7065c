"""``gpuwise plan``: the plan, its GPU table and remedies; the built-in models."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from gpuwise.hardware.catalog import load_catalog
from gpuwise.planning.cost.validation import HELD_OUT_ERROR
from gpuwise.render._common import (
    Column,
    Sheet,
    _count,
    _overhead,
    _seconds3,
    print_fields,
    print_fit,
    print_lines,
    print_wrapped,
    step_parts,
    to_jsonable,
)
from gpuwise.units import GiB, MiB, human_bytes

if TYPE_CHECKING:  # these import torch; gpus and doctor render without it
    from gpuwise.models import ZooModel
    from gpuwise.planning import MemoryPlan
    from gpuwise.planning.solve import Solution


def plan_json(plan: MemoryPlan) -> dict[str, Any]:
    """Every field of the plan but the timeline arrays."""
    skip = {"timeline", "timeline_phases"}
    data = {f.name: to_jsonable(getattr(plan, f.name)) for f in dataclasses.fields(plan) if f.name not in skip}
    data["setup"]["batch"] = plan.setup.batch  # global, beside its split (micro_batch, grad_accum, gpus)
    for remedy, raw in zip(data["remedies"], plan.remedies, strict=True):
        remedy.pop("setup")
        remedy["fits"] = raw.fits
    for fit in data["gpus"]:
        fit["fits"] = fit["status"] != "no"
        step = fit.get("step") or {}  # the modelled step's parts, beside its time (cost/step.py's StepTime)
        fit["phases_s"], fit["families_s"] = step.get("phases_s"), step.get("families_s")
        fit["step_time_error"] = step.get("error")
    if plan.experts is not None:
        data["experts"]["active"] = plan.experts.active
    if plan.all_to_all is not None:
        a = plan.all_to_all
        data["all_to_all"] |= {"bytes": a.bytes, "received": a.received, "busiest": a.busiest,
                               "exchanges": a.exchanges}
    return data  # to_jsonable wrote null for a non-finite figure


_FIT_STYLE = {"fits": "green", "tight": "yellow", "no": "red"}
_SEGMENTS = ("consumer", "workstation", "datacenter", "edge")


def _fit_text(row: dict[str, Any]) -> Text:
    if row["missing_dtype"] is not None and row["status"] != "no":
        return Text(f"no {row['missing_dtype']}", style="yellow")
    return Text(row["status"], style=_FIT_STYLE[row["status"]])


def _gib(key: str, signed: bool = False) -> Any:
    def show(row: dict[str, Any]) -> str:
        n = round(row[key] * GiB)
        return f"-{human_bytes(-n)}" if signed and n < 0 else human_bytes(n)
    return show


def _secs(key: str, star: bool = False) -> Any:
    def show(row: dict[str, Any]) -> str:
        value = row[key]
        return "-" if value is None else _seconds3(value) + ("*" if star and row["rates"] == "measured" else "")
    return show


def plan_sheet(plan: MemoryPlan) -> Sheet:
    """The fit on each GPU as rows, for the table and for ``--format csv|md``: memory and headroom in GiB, the
    step (or a decode token) and its bound in seconds, grouped by catalog segment."""
    segments = {a.key: a.segment for a in load_catalog().filter()}
    step = "token" if plan.decode else "step"
    columns = (
        Column(key="gpu"),
        Column(key="memory_gib", header="memory", numeric=True, priority=3, show=_gib("memory_gib")),
        Column(key="headroom_gib", header="headroom", numeric=True, priority=2, show=_gib("headroom_gib", True)),
        Column(key="status", header="fits", show=_fit_text),
        Column(key="max_micro_batch", header="max\nbatch", numeric=True, priority=1),
        Column(key=f"{step}_s", header=step, numeric=True, show=_secs(f"{step}_s", star=True)),
        Column(key="bound_s", header="bound", numeric=True, priority=4, show=_secs("bound_s")),
        Column(key="missing_dtype", table=False), Column(key="rates", table=False),
        Column(key="segment", table=False),
    )
    order = sorted(plan.gpus, key=lambda f: _SEGMENTS.index(s) if (s := segments.get(f.gpu)) in _SEGMENTS
                   else len(_SEGMENTS))
    rows = tuple({"gpu": f.gpu, "memory_gib": f.memory_bytes / GiB, "headroom_gib": f.headroom_bytes / GiB,
                  "status": f.status, "max_micro_batch": f.max_batch,
                  f"{step}_s": None if f.step is None else f.step.seconds, "bound_s": f.step_time_bound_s,
                  "missing_dtype": f.missing_dtype, "rates": f.rates, "segment": segments.get(f.gpu)}
                 for f in order)
    needs = plan.gpus[0].required_bytes if plan.gpus else plan.peak_bytes - plan.paged_bytes + plan.overhead_bytes
    paged = f" - {human_bytes(plan.paged_bytes)} paged" if plan.paged_bytes else ""
    # the same on every GPU, so the title says it once
    return Sheet(title=f"fit: needs {human_bytes(needs)} (peak{paged} + {human_bytes(plan.overhead_bytes)} overhead)",
                 columns=columns, rows=rows)


def render_plan(plan: MemoryPlan, console: Console) -> None:
    s = plan.setup
    per_sample = plan.tokens_per_step > s.micro_batch * s.grad_accum or s.task == "decode"
    unit = "token" if per_sample else "sample"  # per GPU, both
    print_wrapped(console, Text("gpuwise plan", style="bold") + Text(
        f": {plan.model} · {s.describe()} · {plan.tokens_per_step:,} {unit}{'s' if plan.tokens_per_step != 1 else ''}"
        f"{' per GPU' if s.gpus > 1 else ''} per step"))
    head = _Fields()
    trainable = f" ({_count(plan.trainable_params)} trainable)" if s.training and plan.trainable_params != plan.params \
        else ""
    head.add_row("parameters", f"{_count(plan.params)}{trainable}")
    if plan.experts is not None:
        e = plan.experts
        head.add_row("experts", f"{_count(e.active)} active per token of {_count(e.total)} (top-{e.top_k} of "
                     f"{e.experts} routed experts, {_count(e.params)} of expert weights; embeddings, attention and "
                     "shared experts counted, as model cards do)"
                     + (f"; {e.experts // s.ep} expert{'s' if e.experts // s.ep > 1 else ''} a layer on each GPU "
                        f"(--ep {s.ep})" if s.ep > 1 else ""))
    if plan.routing is not None:
        head.add_row("routing", plan.routing)
    for note in getattr(plan, "notes", ()):
        head.add_row("note", Text(note, style="yellow"))
    if plan.all_to_all is not None:
        head.add_row("all-to-all", _all_to_all_text(plan.all_to_all))
    per_token = plan.flops_per_step / max(plan.tokens_per_step, 1)
    head.add_row("FLOPs per step", f"{plan.flops_per_step:.3e} ({per_token:.3g} per {unit}; matmuls and attention)")
    head.add_row("peak memory", f"{human_bytes(plan.peak_bytes)} of tensors (at {plan.peak_at}) + "
                 f"{human_bytes(plan.overhead_bytes)} CUDA context and workspaces")
    _decode_rows(plan, head)
    _parallel_rows(plan, head)
    if plan.paged_bytes:
        head.add_row("paged", f"{human_bytes(plan.paged_bytes)} of optimizer state is paged: it can spill to host "
                     "memory (slower steps), so the fit counts the rest")
    if s.training:
        head.add_row("activations", f"{human_bytes(plan.activations_bytes)} saved for backward at the end of forward")
    accum = plan.accumulation_peak_bytes
    if accum is not None and accum - plan.peak_bytes > max(0.02 * plan.peak_bytes, 64 << 20):
        held = human_bytes(max(plan.timeline[:, list(plan.breakdown).index("gradients")].max(), 0))
        head.add_row("accumulation", Text(f"none planned: with --batch above --micro-batch the {held} of gradients "
                                          f"stay alive through every forward and backward, and the peak is "
                                          f"{human_bytes(accum)}", style="yellow"))
    if plan.captured_blocks:
        small, large = plan.captured_blocks
        head.add_row("captured", f"{small} and {large} blocks on fake tensors, scaled to the full stack")
    if plan.uncosted:
        head.add_row("uncosted ops", Text(", ".join(f"{op} x{n}" for op, n in sorted(plan.uncosted.items()))
                                          + " (no FLOP formula: not counted)", style="yellow"))
    print_fields(console, head.rows)
    _at_peak(plan, console)

    sheet = plan_sheet(plan)
    rows: list[Any] = []
    group = None
    for row in sheet.rows:  # a title row per catalog segment (the sheet's own column), a gap before it
        if row["segment"] != group and len(sheet.rows) > 1:
            group = row["segment"]
            rows.append(Text(group or "other", style="dim italic"))
        rows.append([c.text(row) for c in sheet.shown])
    # never a cut figure nor a split name: at a narrow width the least-needed columns go, and a line says which;
    # narrower than the GPU, fits and step columns, a GPU's figures go on lines under its name
    print_fit(console, sheet.shown, rows, title=sheet.title, edge=False)
    measured = ", ".join(f.gpu for f in plan.gpus if f.rates == "measured")
    rates = f"rates gpuwise bench --calibrate measured (*: {measured}), elsewhere the " if measured else ""
    if plan.decode:
        print_wrapped(console, f"token: one decode step modelled op by op at the {rates}datasheet's rates (planning/"
                      "cost/step.py); bound: max(bytes read / bandwidth, FLOPs / matmul peak), which no step beats; "
                      "llama.cpp and vLLM reach 50-95% of the bandwidth")
    else:
        first = next((f for f in plan.gpus if f.gpu == plan.gpu and f.step is not None), None)
        err = f"±{100 * first.step.error:.0f}% " if first is not None else ""
        print_wrapped(console, f"step: modelled kernel by kernel from the {rates}GPU's facts (planning/cost/step.py), "
                      f"as recommend ranks it, {err}({HELD_OUT_ERROR}); bound: the roofline, max(FLOPs / dense peak, "
                      "bytes / bandwidth), which no step beats")
        if first is not None:
            print_wrapped(console, f"{first.gpu}: {step_parts(first.step.phases_s, first.step.families_s)}")
    missing = [f.gpu for f in plan.gpus if f.missing_dtype]
    if missing:
        verb = "has" if len(missing) == 1 else "have"
        print_wrapped(console, f"no bf16: {', '.join(missing)} {verb} no bf16 tensor cores; torch emulates it many "
                      "times slower: plan and run --precision fp16-mixed there")
    if plan.setup.spec.float8:
        print_wrapped(console, "fp8: the linear layers' GEMMs at the fp8 rate, the rest at bf16's; GPUs without fp8 "
                      "tensor cores (before Ada and Hopper) cannot run it: 'no'")
    if plan.remedies:
        _remedies(plan, console)
    elif not plan.fits and s.training:
        print_wrapped(console, f"does not fit {plan.gpu}, and no remedy gpuwise plans applies to this model")
    if not plan.fits and not s.training and not any(r.fits for r in plan.remedies):
        print_wrapped(console, f"does not fit {plan.gpu} even at batch 1: inference needs more memory per GPU than "
                      "it has" + ("" if s.quantized or plan.remedies else " (try --weights int8, int4 or nf4)"))


class _Fields:
    """The plan's key-value lines, gathered as ``Table.add_row`` would, printed by ``print_fields``."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str | Text]] = []

    def add_row(self, key: str, value: str | Text) -> None:
        self.rows.append((key, value))


_BAR = 30  # the widest bar of the memory at the peak: the whole peak


def _at_peak(plan: MemoryPlan, console: Console) -> None:
    """The peak by category: bytes, share, and a bar as long as the width leaves (none under 5 characters: the
    share says it)."""
    total = max(plan.peak_bytes, 1)
    rows = [(cat, human_bytes(value), f"{100 * value / total:.0f}%", value) for cat, value in plan.breakdown.items()
            if value]
    figures = [Column(key="category"), Column(key="bytes", numeric=True), Column(key="share", numeric=True)]
    taken = sum(max(len(c.title), *(len(r[i]) for r in rows)) for i, c in enumerate(figures)) if rows else 0
    room = min(_BAR, console.width - taken - _overhead(len(figures) + 1))
    bar = room >= 5
    columns = [*figures, Column(key="bar", header=" ")] if bar else figures
    cells = [[cat, size, share, *(["█" * round(room * value / total)] if bar else [])]
             for cat, size, share, value in rows]
    print_fit(console, columns, cells, title="memory at the peak")


def _remedies(plan: MemoryPlan, console: Console) -> None:
    """The remedies as lines: what changes, what it needs and whether it fits, then its flags on a line of their
    own, whole (a flag never apart from its value), to copy into the command."""
    on = "one-GPU" if plan.setup.gpus == 1 else f"{plan.setup.gpus}-GPU"
    print_wrapped(console, Text(f"does not fit {plan.gpu}: remedies in order, each on top of the ones before (LoRA "
                                f"from the {on} step); under each, the flags to add to your command", style="italic"))
    for r in plan.remedies:
        print_wrapped(console, Text(f"{r.name}: needs {human_bytes(r.required_bytes)}, ")
                      + Text(r.status, style=_FIT_STYLE[r.status]))
        print_lines(console, [Text("  ") + Text(r.flags, style="cyan")])


def _decode_rows(plan: MemoryPlan, head: _Fields) -> None:
    """--task decode and --weights: what one step reads, and how the weights are stored."""
    s, d = plan.setup, plan.decode
    if s.quantized:
        fused = plan.experts is not None and plan.experts.fused and s.weights in ("int4", "fp8")  # vLLM's fused MoE
        head.add_row("weights", f"{s.weights} in the blocks' linear layers{' and routed experts' if fused else ''} "
                     "(planning/transforms/quantize.py); embeddings, norms "
                     f"and head {s.spec.compute if s.spec.compute in ('bf16', 'fp16') else 'fp32'}")
    if d is not None:
        seqs = f"{d.batch} sequences" if d.batch > 1 else "1 sequence"
        head.add_row("decode", f"{seqs} x {d.context:,} cached tokens, one more each: a step reads "
                     f"{human_bytes(d.weight_bytes)} of weights + {human_bytes(d.kv_cache_bytes)} of KV cache and "
                     f"does {d.flops:.3g} FLOPs")


def render_models(models: list[ZooModel], console: Console) -> None:
    columns = [Column(key="name"), Column(key="params", numeric=True), Column(key="blocks", numeric=True, priority=2),
               Column(key="input", priority=3), Column(key="default", numeric=True, priority=1)]
    rows = []
    for m in models:
        default = f"{m.default_seq} tokens" if m.default_seq else f"{m.default_image_size}px" if m.default_image_size \
            else f"{m.config.in_features} features"
        rows.append([m.name, _count(m.published_params), str(m.n_layer or "-"), m.inputs, default])
    print_fit(console, columns, rows, title="built-in models (gpuwise plan --model NAME)")


def _all_to_all_text(a) -> str:
    """--ep: the all-to-alls' bytes (parallel.expert.AllToAll), how they are counted, and their time."""
    recompute = " + 1 (the dispatch, recomputed: --checkpointing)" if a.dispatches > 1 else ""
    formula = (f"({a.exchanges} exchanges: dispatch and combine x forward and backward{recompute}) x "
               f"{a.moe_layers} MoE layers x {a.tokens:,} tokens x top-{a.top_k} x hidden {a.hidden} x {a.itemsize} B"
               f" x ({a.ep} - 1) / {a.ep}")
    if a.factor == 1:
        text = f"{human_bytes(a.bytes)} sent per GPU per step, as much received: {formula}"
    else:
        text = (f"the busiest GPU sends {human_bytes(a.bytes)} and receives {human_bytes(a.received)} per step: "
                f"{formula}, its experts' rows {a.factor:g}x (--moe-imbalance) in each dispatch and the combine's "
                "backward, and out in the combine and the dispatch's backward; every exchange waits on its "
                f"{human_bytes(a.busiest)}")
    text += "; the send and receive buffers are in the memory while each exchange runs"
    if a.seconds is not None:
        took = f"{a.seconds * 1e3:.3g} ms" if a.seconds >= 1e-3 else f"{a.seconds * 1e6:.3g} us"
        return text + (f"; {took} a step over the node's link ({a.link}; the experts wait on it), added to the step "
                       "time")
    return text + f"; {a.link or 'not timed'} (not in the step time)"


def _parallel_rows(plan: MemoryPlan, head: _Fields) -> None:
    """--tp/--pp/--cp/--nodes/--offload: how the GPUs split the work, and the host memory offload takes."""
    lay = plan.layout
    if lay is None:
        return
    parts = [f"{lay.gpus} GPUs = {lay.dp} data-parallel"]
    parts += [f"{n} {what}" for what, n in (("tensor-parallel", lay.tp), ("pipeline stages", lay.pp),
                                            ("context-parallel", lay.cp)) if n > 1]
    text = " x ".join(parts)
    if lay.ep > 1:
        text += (f"; experts split {lay.ep} ways over the data-parallel{' and context-parallel' if lay.cp > 1 else ''}"
                 f" GPUs (--ep {lay.ep}): their states shard over {lay.shard_gpus // lay.ep} GPU"
                 f"{'s' if lay.shard_gpus // lay.ep > 1 else ''} under {lay.sharding}, the rest over "
                 f"{lay.shard_gpus}" if lay.sharding != "ddp" else
                 f"; experts split {lay.ep} ways over the data-parallel GPUs (--ep {lay.ep}), replicated "
                 f"{lay.shard_gpus // lay.ep} times")
    if lay.cp > 1:
        text += f"; each GPU holds 1/{lay.cp} of every sequence (ring attention passes the K/V chunks round)"
        if lay.sharding != "ddp" and lay.nodes == 1:
            text += (f"; {lay.sharding} shards the states over {lay.shard_gpus} GPUs ({lay.dp} data-parallel x "
                     f"{lay.cp} context-parallel)")
    if lay.nodes > 1:
        text += (f"; HSDP: states sharded over {lay.shard_gpus} GPU{'s' if lay.shard_gpus > 1 else ''} in each of "
                 f"{lay.nodes} nodes, replicated across")
    if lay.tp > 1 or lay.pp > 1 or lay.ep > 1:
        split = "heads, MLP, the routed experts' FFN width and vocabulary" if plan.experts is not None else \
            "heads, MLP and vocabulary"
        text += f"; parameters and memory are one GPU's ({split} split --tp ways)" if lay.tp > 1 \
            else "; parameters and memory are one GPU's"
    head.add_row("parallel", text)
    if lay.pp > 1 and lay.stage is not None:
        where = "first" if lay.stage == 0 else "last"
        with_ = "the embedding" if lay.stage == 0 else "the final norm, head and loss"
        head.add_row("pipeline", f"the worst stage is the {where} (stage {lay.stage}): {lay.stage_layers} blocks and "
                     f"{with_}, {lay.in_flight} micro-batch{'es' if lay.in_flight > 1 else ''} of activations in "
                     f"flight (1F1B); bubble {lay.bubble:.0%} of the step, (pp - 1) / (micro-batches + pp - 1)")
    if lay.offload != "none":
        node = f" ({human_bytes(lay.host_bytes_per_node)} per node)" if lay.host_bytes_per_node is not None else ""
        what = "fp32 master, optimizer states and gradients" if lay.offload == "optimizer" else \
            "sharded parameters, gradients and optimizer states"
        head.add_row("host memory", f"{human_bytes(lay.host_bytes)} per GPU{node} of pinned host RAM: {what} "
                     "(--offload " + lay.offload + "); not in the GPU fit")



_SOLVED = {"max-context": "max context", "max-batch": "max micro-batch", "min-gpus": "fewest GPUs"}


def _solved_value(solution: Solution, n: int) -> str:
    if solution.goal == "max-context":
        return f"{n:,} {'cached ' if solution.flag == '--context' else ''}token{'s' if n != 1 else ''}"
    if solution.goal == "min-gpus":
        return f"{n:,} GPU{'s' if n != 1 else ''}"
    return f"{n:,}"


def _over(required_bytes: int, memory_bytes: int) -> str:
    """"81.2 GiB > 79.6 GiB"; in MiB where GiB to one decimal would print two equal-looking figures."""
    if abs(required_bytes - memory_bytes) < 0.05 * GiB:
        return f"{required_bytes / MiB:,.1f} MiB > {memory_bytes / MiB:,.1f} MiB"
    return f"{human_bytes(required_bytes)} > {human_bytes(memory_bytes)}"


def solution_line(solution: Solution) -> str:
    """The answer in one line: "max context on h100-sxm: 36,864 tokens (40,960 does not fit: 81.2 GiB > 79.6 GiB;
    ...)"."""
    s, f = solution, solution.failing
    head = f"{_SOLVED[s.goal]} on {s.gpu}: "
    cost = f"{len(s.probes)} probe{'s' if len(s.probes) != 1 else ''}, {s.captures} capture" \
           f"{'s' if s.captures != 1 else ''}"
    over = "" if f is None else _over(f.required_bytes, s.memory_bytes)
    if s.value is None:
        what = ("micro-batch " if s.goal == "max-batch" else "") + ("" if f is None else _solved_value(s, f.value))
        even = "" if f is None else f"{what} need{'s' if f.value == 1 or s.goal == 'max-batch' else ''} {over}"
        return head + "none fits (" + "; ".join(x for x in (even, s.reason, cost) if x) + ")"
    parts = []
    if f is not None:
        verb = "does" if s.goal == "max-batch" or f.value == 1 else "do"
        parts.append(f"{_solved_value(s, f.value)} {verb} not fit: {over}")
    if s.bound is not None:
        parts.append(f"{'capped at ' if s.goal != 'min-gpus' else ''}{s.bound}")
    return head + _solved_value(s, s.value) + " (" + "; ".join([*parts, cost]) + ")"


def solution_json(solution: Solution) -> dict[str, Any]:
    """The plan at the answer (``plan_json``) with a ``solve`` object: the answer, its boundary and the probes."""
    solve = {f.name: to_jsonable(getattr(solution, f.name)) for f in dataclasses.fields(solution) if f.name != "plan"}
    return plan_json(solution.plan) | {"solve": solve}


def render_solution(solution: Solution, console: Console) -> None:
    """The answer line above the plan at it."""
    print_wrapped(console, Text(solution_line(solution), style="bold green" if solution.value is not None else
                                "bold red"))
    render_plan(solution.plan, console)
