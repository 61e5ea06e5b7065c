"""The speed model's exam: published end-to-end GPU runs with exact configs, each predicted as `gpuwise plan` predicts
it, and the error of each.

Three sections:
(1) per-kernel held-out error: scripts/fit_kernels.py's ``held_out_table()`` (the kernel model's own check), if present;
(2) every run: benchmarks/data/published_runs.toml, plus the rows benchmarks/speed_validation.py (planner anchors) and
    benchmarks/recommend_order.py (Lambda BERT-large and ResNet-50 fp16, llama.cpp decode) hold, imported from them;
    each priced by ``gpuwise.planning.planner.plan`` (what ``gpuwise plan`` runs) on that run's GPU: its
    ``GpuFit.step_time_s``, converted to the published unit with the step's global batch (``Setup.batch``);
(3) the summary: median and worst |error| over every run, by GPU, model family, source and confidence; Spearman's rank
    correlation of predicted and measured over the GPUs of one workload (Lambda's ResNet-50 and BERT-large, ...); the
    scaling efficiency of multi-GPU runs against their smaller counterpart.

Error = predicted / measured - 1 on throughput: positive, the model is too optimistic. Nothing here is fitted, and
nothing may be fitted to these rows (they are the exam); a row some constant of today's model was fitted on says so in
the "fit" column (its error is not a held-out one). One capture per distinct (model, setup), every GPU of it priced
from that capture. Predictions only: nothing runs on a GPU.

    OMP_NUM_THREADS=1 python benchmarks/speed_truth.py               # all three sections
    python benchmarks/speed_truth.py --only lambda --json            # the runs whose id contains 'lambda', as JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the tomli backport gpuwise depends on there
    import tomli as tomllib

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import Accelerator, Catalog, load_catalog
from gpuwise.models import get_model
from gpuwise.planning.planner import plan
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.resolve import resolve_source
from gpuwise.planning.sources.zoo import ZooSource
from gpuwise.units import GiB

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DATA = HERE / "data" / "published_runs.toml"
KERNELS = ROOT / "scripts" / "fit_kernels.py"
UNITS = ("samples/s", "samples/s/gpu", "tokens/s", "tokens/s/gpu")
CONFIDENCE = ("exact", "recipe-defaults")
BANDS = (0.10, 0.25, 0.50)  # the share of runs within each |error|

# The planner anchors as speed_validation.py captures them simplify two facts of the published runs (torchtitan
# docs/performance.md): #3-#5 ran torchtitan's selective (op-level) activation checkpointing, which speed_validation
# captures as none, and #3/#4 ran on H100 96GB boards held at their default 500 W, not the catalog's 700 W. The exam
# prices the runs as they ran.
ANCHOR_TRUTH: dict[int, dict[str, Any]] = {
    3: {"setup": {"checkpointing": "selective"}, "gpu_override": {"tdp_w": 500}},
    4: {"setup": {"checkpointing": "selective"}, "gpu_override": {"tdp_w": 500}},
    5: {"setup": {"checkpointing": "selective"}},
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """One published run: what ran (model, setup, GPU) and its measured throughput."""

    id: str
    what: str
    source: str  # the citation
    model: str  # zoo name
    gpu: str  # catalog key
    setup: Setup
    measured: float
    unit: str  # one of UNITS
    family: str
    model_name: str | None = None  # the overridden zoo model's name (mpt-7b as a GPT, llama3-70b)
    model_config: tuple[tuple[str, Any], ...] = ()  # zoo config fields replaced
    hf_config: str | None = None  # a Hugging Face config.json (its JSON text) instead of the zoo
    gpu_override: tuple[tuple[str, float], ...] = ()  # memory_gib / tdp_w of this board
    order: str | None = None  # the order check this run belongs to
    scaling_from: str | None = None  # the id of the same run on fewer GPUs
    confidence: str = "exact"
    fitted: str | None = None  # the constant of today's model fitted on this run (None: held out)
    notes: str = ""
    source_factory: Callable[[], Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"run {self.id}: unit {self.unit!r} is not one of {', '.join(UNITS)}")
        if self.confidence not in CONFIDENCE:
            raise ValueError(f"run {self.id}: confidence {self.confidence!r} is not one of {', '.join(CONFIDENCE)}")
        if not self.measured > 0:
            raise ValueError(f"run {self.id}: measured {self.measured} is not positive")

    @property
    def workload(self) -> tuple:
        """What one capture serves: every run with this key shares it, whatever its GPU."""
        return (self.model, self.model_name, self.model_config, self.hf_config, self.setup,
                id(self.source_factory) if self.source_factory else None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scored:
    run: Run
    predicted: float | None  # in the run's unit; None: not predicted (``why``)
    step_s: float | None = None  # the modelled step (GpuFit.step_time_s)
    why: str = ""

    @property
    def error(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.run.measured - 1


# ---------------------------------------------------------------------------------------------------------------- rows

def _frozen(table: dict | None) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((table or {}).items()))


def load_runs(path: Path = DATA) -> list[Run]:
    """The runs of ``path`` (benchmarks/data/published_runs.toml's schema, described at its top)."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    sources = data.get("sources", {})
    runs = []
    for row in data["run"]:
        row = dict(row)
        try:
            setup = Setup(**row.pop("setup"))
        except (GpuwiseError, TypeError) as exc:
            raise ValueError(f"run {row.get('id')}: its setup is not a gpuwise Setup: {exc}") from exc
        src = row.pop("source")
        model_name = row.pop("model_name", None)
        try:
            runs.append(Run(
                setup=setup, source=sources.get(src, src), model_name=model_name,
                model_config=_frozen(row.pop("model_config", None)),
                gpu_override=_frozen(row.pop("gpu_override", None)),
                hf_config=json.dumps(row.pop("hf_config"), sort_keys=True) if "hf_config" in row else None,
                family=row.pop("family", None) or model_name or row["model"], measured=float(row.pop("measured")),
                **row))
        except TypeError as exc:  # a field Run does not have, or one missing
            raise ValueError(f"run {row.get('id')}: {exc}") from exc
    return runs


def imported_runs() -> tuple[list[Run], str | None]:
    """The rows benchmarks/speed_validation.py and benchmarks/recommend_order.py hold, as runs (and why not, if their
    modules no longer import)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    try:
        import recommend_order as ro
        import speed_validation as sv
    except ImportError as exc:
        return [], f"the rows of speed_validation.py and recommend_order.py are left out: {exc}"
    runs = []
    family = {"llama3-8b": "llama", "mpt-7b": "mpt", "gpt2": "gpt2"}
    for a in sv.ANCHORS:
        truth = ANCHOR_TRUTH.get(a.id, {})
        override = {"memory_gib": a.memory_gib} if a.memory_gib else {}
        override.update(truth.get("gpu_override", {}))
        runs.append(Run(
            id=f"planner-anchor-{a.id}", what=a.what, source=f"{a.source} (planner-anchors.md #{a.id})",
            model=a.model, gpu=a.gpu, setup=dataclasses.replace(a.setup, **truth.get("setup", {})),
            measured=a.measured_tok_s_per_gpu, unit="tokens/s/gpu", family=family.get(a.model, a.model),
            gpu_override=_frozen(override), source_factory=sv.SOURCES[a.model],
            fitted=None))
    for w in (ro.BERT_LARGE, ro.RESNET50):
        optimizer = "sgd" if w.model == "resnet50" else "adamw"  # DLE ConvNets: SGD momentum; BERT: BertAdam
        # DLE's BERT (modeling.py: matmul, softmax, dropout, matmul) runs the eager math path, not SDPA
        attention = "eager" if w.model.startswith("bert") else None
        for p in w.points:
            runs.append(Run(
                id=f"lambda-fp16-{w.model}-{p.gpu}", what=f"{w.name}, {p.gpu}", source=w.source, model=w.model,
                gpu=p.gpu, setup=Setup(micro_batch=p.batch, seq=w.seq, image_size=w.image_size, precision=w.precision,
                                       optimizer=optimizer, attention=attention),
                measured=p.measured, unit="samples/s", family=w.model, order=f"lambda-{w.model}-fp16",
                fitted=None, notes=p.note))
    for p in ro.LLAMA3_F16.points:  # llama-bench tg1024: 1024 tokens from an empty cache, the mean context 512
        runs.append(Run(
            id=f"llamacpp-f16-{p.gpu}", what=f"{ro.LLAMA3_F16.name}, {p.gpu}", source=ro.LLAMA3_F16.source,
            model="llama3-8b", gpu=p.gpu, setup=Setup(task="decode", micro_batch=1, context=512,
                                                      precision="fp16-mixed"),
            measured=p.measured, unit="tokens/s", family="llama decode (llama.cpp)", order="llamacpp-llama3-8b-f16",
            fitted="llama.cpp constants (serving_truth.FIT)" if p.fit else None,
            notes="llama.cpp (CUDA graphs, its own kernels), priced as a PyTorch decode step"))
    return runs, None


def check_ids(runs: list[Run]) -> None:
    seen = set()
    for r in runs:
        if r.id in seen:
            raise ValueError(f"run id {r.id!r} appears twice: published_runs.toml repeats a row the imported "
                             "modules hold, or itself")
        seen.add(r.id)
    for r in runs:
        if r.scaling_from and r.scaling_from not in seen:
            raise ValueError(f"run {r.id}: scaling_from {r.scaling_from!r} is no run's id")


# ------------------------------------------------------------------------------------------------------------- predict

def source_of(run: Run, scratch: Path):
    """The planner source of ``run``'s model: a zoo model (its config overridden), or a Hugging Face config."""
    if run.source_factory is not None:
        return run.source_factory()
    if run.hf_config is not None:
        path = scratch / f"{run.id}.json"
        path.write_text(run.hf_config, encoding="utf-8")
        return resolve_source(None, str(path))
    zoo = get_model(run.model)
    if run.model_config:
        config = dataclasses.replace(zoo.config, **dict(run.model_config))
        seq = {"max_seq": config.block_size} if hasattr(config, "block_size") else {}  # learned positions
        zoo = dataclasses.replace(zoo, name=run.model_name or zoo.name, config=config, **seq)
    return ZooSource(zoo=zoo)


def board(run: Run, catalog: Catalog) -> Accelerator | None:
    acc = catalog.find(run.gpu)
    if acc is None:
        return None
    change = dict(run.gpu_override)
    if "memory_gib" in change:
        change["memory_bytes"] = round(change.pop("memory_gib") * GiB)
    return dataclasses.replace(acc, **change)


def throughput(run: Run, step_s: float) -> float:
    """The step's throughput in ``run.unit``: the global batch (every GPU, every accumulated micro-batch) per step."""
    s = run.setup
    per_sample = 1 if ("samples" in run.unit or s.task == "decode") else s.seq  # decode: one token per sequence
    if per_sample is None:
        raise ValueError(f"run {run.id}: {run.unit} needs the setup's seq")
    rate = s.batch * per_sample / step_s
    return rate / s.gpus if run.unit.endswith("/gpu") else rate


def _batches(runs: list[Run], boards: dict[str, Accelerator]) -> list[list[Run]]:
    """Runs split so that no catalog key means two boards in one plan (a 96 GB H100 beside the 80 GB one)."""
    out: list[tuple[dict[str, Accelerator], list[Run]]] = []
    for r in runs:
        acc = boards[r.id]
        for held, group in out:
            if held.get(acc.key, acc) == acc:
                held[acc.key] = acc
                group.append(r)
                break
        else:
            out.append(({acc.key: acc}, [r]))
    return [group for _, group in out]


def score_workload(runs: list[Run], catalog: Catalog, scratch: Path) -> list[Scored]:
    """Every run of one workload, from one plan per set of boards (``plan``: what ``gpuwise plan`` prints)."""
    out, boards = [], {}
    for r in runs:
        acc = board(r, catalog)
        if acc is None:
            out.append(Scored(run=r, predicted=None, why=f"{r.gpu} is not in the catalog"))
        else:
            boards[r.id] = acc
    for group in _batches([r for r in runs if r.id in boards], boards):
        accs = {boards[r.id].key: boards[r.id] for r in group}
        primary = max(accs.values(), key=lambda a: a.memory_bytes)  # the remedies (if it fits nowhere) are for it
        try:
            planned = plan(source_of(group[0], scratch), group[0].setup, primary=primary.key,
                           catalog=Catalog(tuple(accs.values())))
        except (GpuwiseError, ValueError, NotImplementedError, RuntimeError) as exc:
            out += [Scored(run=r, predicted=None, why=f"{type(exc).__name__}: {exc}") for r in group]
            continue
        fits = {f.gpu: f for f in planned.gpus}
        for r in group:
            fit = fits[boards[r.id].key]
            if fit.step_time_s is None:
                why = f"no {fit.missing_dtype} rate" if fit.missing_dtype else "no step time modelled"
                out.append(Scored(run=r, predicted=None, why=why))
                continue
            note = "" if fit.fits else f"does not fit ({fit.required_bytes / GiB:.1f} GiB needed)"
            out.append(Scored(run=r, predicted=throughput(r, fit.step_time_s), step_s=fit.step_time_s, why=note))
    return out


def score_all(runs: list[Run]) -> list[Scored]:
    catalog = load_catalog()
    order = {r.id: i for i, r in enumerate(runs)}
    scored: list[Scored] = []
    with tempfile.TemporaryDirectory() as scratch:
        workloads: dict[tuple, list[Run]] = {}
        for r in runs:
            workloads.setdefault(r.workload, []).append(r)
        for group in workloads.values():
            scored += score_workload(group, catalog, Path(scratch))
    return sorted(scored, key=lambda s: order[s.run.id])


# ------------------------------------------------------------------------------------------------------------- summary

def ranks(x: list[float]) -> list[float]:
    """Ranks from 1, ties averaged."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    r = [0.0] * len(x)
    for _, same in itertools.groupby(order, key=lambda i: x[i]):
        same = list(same)
        first = order.index(same[0])
        for i in same:
            r[i] = first + (len(same) + 1) / 2
    return r


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    if len(set(ra)) < 2 or len(set(rb)) < 2:
        return float("nan")  # every GPU predicted (or measured) the same: no order to check
    return statistics.correlation(ra, rb)


def error_stats(scored: list[Scored]) -> dict[str, Any]:
    """n, median and worst |error| (with its run), and the share within each band."""
    done = [s for s in scored if s.error is not None]
    if not done:
        return {"n": 0}
    worst = max(done, key=lambda s: abs(s.error))
    errs = [abs(s.error) for s in done]
    return {"n": len(done), "median_abs_error": statistics.median(errs), "worst_abs_error": abs(worst.error),
            "worst": worst.run.id, "median_error": statistics.median(s.error for s in done),
            **{f"within_{b:.0%}": sum(e <= b for e in errs) / len(errs) for b in BANDS}}


def by(scored: list[Scored], key: Callable[[Run], str]) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[Scored]] = {}
    for s in scored:
        groups.setdefault(key(s.run), []).append(s)
    return {k: error_stats(v) for k, v in sorted(groups.items())}


def order_checks(scored: list[Scored]) -> dict[str, dict[str, Any]]:
    """Per order group: Spearman of predicted vs measured over its GPUs, and the pairs the model orders wrongly."""
    out = {}
    groups: dict[str, list[Scored]] = {}
    for s in scored:
        if s.run.order and s.predicted is not None:
            groups.setdefault(s.run.order, []).append(s)
    for name, group in sorted(groups.items()):
        if len(group) < 3:
            continue
        meas, pred = [s.run.measured for s in group], [s.predicted for s in group]
        wrong = [(a.run.gpu, b.run.gpu) if a.run.measured > b.run.measured else (b.run.gpu, a.run.gpu)
                 for a, b in itertools.combinations(group, 2)
                 if (a.run.measured - b.run.measured) * (a.predicted - b.predicted) < 0]
        out[name] = {"gpus": len(group), "spearman": spearman(meas, pred), "wrong_pairs": wrong,
                     "pairs": len(group) * (len(group) - 1) // 2}
    return out


def scaling_checks(scored: list[Scored]) -> list[dict[str, Any]]:
    """Per multi-GPU run with a smaller counterpart: its throughput per GPU over the counterpart's, measured and
    predicted."""
    by_id = {s.run.id: s for s in scored}
    out = []
    for s in scored:
        base = by_id.get(s.run.scaling_from) if s.run.scaling_from else None
        if base is None:
            continue

        def per_gpu(x: Scored, value: float | None) -> float | None:
            return None if value is None else value / (1 if x.run.unit.endswith("/gpu") else x.run.setup.gpus)

        m = per_gpu(s, s.run.measured) / per_gpu(base, base.run.measured)
        p_run, p_base = per_gpu(s, s.predicted), per_gpu(base, base.predicted)
        p = None if p_run is None or p_base is None else p_run / p_base
        out.append({"id": s.run.id, "from": base.run.id, "gpus": s.run.setup.gpus, "from_gpus": base.run.setup.gpus,
                    "measured_efficiency": m, "predicted_efficiency": p})
    return out


def summarize(scored: list[Scored]) -> dict[str, Any]:
    held = [s for s in scored if s.run.fitted is None]
    return {
        "all": error_stats(scored),
        "held_out_from_todays_fits": error_stats(held),
        "fitted_by_today": error_stats([s for s in scored if s.run.fitted is not None]),
        "exact_configs": error_stats([s for s in held if s.run.confidence == "exact"]),
        "by_gpu": by(held, lambda r: r.gpu),
        "by_family": by(held, lambda r: r.family),
        "by_precision": by(held, lambda r: r.setup.precision),
        "by_task": by(held, lambda r: r.setup.task + (" multi-GPU" if r.setup.gpus > 1 else "")),
        "by_source": by(held, lambda r: r.source.split(" ")[0]),
        "order": order_checks(scored),
        "scaling": scaling_checks(scored),
        "not_predicted": {s.run.id: s.why for s in scored if s.predicted is None},
    }


# -------------------------------------------------------------------------------------------------------------- output

def kernel_table() -> tuple[Any, str | None]:
    """scripts/fit_kernels.py's ``held_out_table()`` (the per-kernel model's held-out error), or None and why not: the
    script or function is not there, or cannot run here (its data lives outside the repository)."""
    if not KERNELS.exists():
        return None, f"{KERNELS.relative_to(ROOT)} is missing"
    try:
        spec = importlib.util.spec_from_file_location("fit_kernels", KERNELS)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = getattr(module, "held_out_table", None)
        if fn is None:
            return None, f"{KERNELS.relative_to(ROOT)} has no held_out_table()"
        return fn(), None
    except (ImportError, OSError) as exc:
        return None, f"{KERNELS.relative_to(ROOT)} could not run: {type(exc).__name__}: {exc}"


def kernel_section() -> Any:
    """Section (1): print scripts/fit_kernels.py's ``held_out_table()`` and return it, or say why it is not there."""
    table, why = kernel_table()
    if why is not None:
        print(f"(1) per-kernel held-out error: not reported: {why}")
        return None
    print("(1) per-kernel held-out error (scripts/fit_kernels.py held_out_table(): fitted without the GPU scored)")
    print(f"  {'family':<26} {'held out':<18} {'kernels':>8} {'median':>7} {'p90':>7}")
    for family, gpu, n, median, p90 in table:
        print(f"  {family:<26} {gpu:<18} {n:>8,} {median:>7.1%} {p90:>7.1%}")
    print(f"  median over the {len(table)} held-out groups: {statistics.median(r[3] for r in table):.1%}")
    best = json.loads((ROOT / "src" / "gpuwise" / "planning" / "cost" / "data" / "kernel_fit.json").read_text()
                      )["errors"].get("best_matmul", {}).get("held_out", {})
    if best:
        print("  each board's best square matmul from its class's other boards (zzc0721's database; GeForce tensor, "
              "paired-lane sgemm):")
        errs = [(unit, key, e) for unit, by in best.items() for key, e in by.items()]
        print("   " + ", ".join(f"{key} {'sgemm' if unit == 'simt' else unit} {e:.0%}" for unit, key, e in errs))
        print(f"  median over those {len(errs)} boards: {statistics.median(e for *_, e in errs):.1%}")
    return table


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.1%}"


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:,.4g}" if x < 100 else f"{x:,.0f}"


def print_runs(scored: list[Scored]) -> None:
    print(f"\n(2) published runs ({len(scored)}): error = predicted / measured - 1; 'fit': a constant of today's "
          "model was fitted on it")
    print(f"  {'run':<46} {'gpu':<15} {'measured':>9} {'predicted':>9} {'error':>7} {'unit':<12} {'step':>8}  note")
    for s in scored:
        r = s.run
        flags = [f for f in ("fit" if r.fitted else "", "defaults" if r.confidence != "exact" else "") if f]
        step = "" if s.step_s is None else f"{s.step_s:.3g} s" if s.step_s >= 1 else f"{s.step_s * 1e3:.3g} ms"
        print(f"  {r.id:<46} {r.gpu:<15} {_fmt(r.measured):>9} {_fmt(s.predicted):>9} {_pct(s.error):>7} "
              f"{r.unit:<12} {step:>8}  {' '.join(flags)}{' ' if flags and s.why else ''}{s.why}")


def _stat_line(name: str, st: dict[str, Any]) -> str:
    if not st.get("n"):
        return f"  {name:<34} n=0"
    return (f"  {name:<34} n={st['n']:<3} median |err| {st['median_abs_error']:6.1%} "
            f"(signed {st['median_error']:+.1%})  worst {st['worst_abs_error']:6.1%} ({st['worst']})  "
            f"within 25%: {st['within_25%']:.0%}")


def print_summary(summary: dict[str, Any]) -> None:
    print("\n(3) summary")
    for key in ("all", "held_out_from_todays_fits", "fitted_by_today", "exact_configs"):
        print(_stat_line(key.replace("_", " "), summary[key]))
    for key in ("by_family", "by_gpu", "by_precision", "by_task", "by_source"):
        print(f" {key.replace('_', ' ')} (held out from today's fits)")
        for name, st in summary[key].items():
            print(_stat_line(name, st))
    print(" order: Spearman of predicted vs measured over the GPUs of one workload")
    for name, o in summary["order"].items():
        print(f"  {name:<34} {o['gpus']} GPUs  Spearman {o['spearman']:+.3f}  "
              f"{len(o['wrong_pairs'])} of {o['pairs']} pairs ordered wrongly")
    print(" scaling efficiency: throughput per GPU over the smaller run's (measured / predicted)")
    for sc in summary["scaling"]:
        pred = "—" if sc["predicted_efficiency"] is None else f"{sc['predicted_efficiency']:.2f}"
        print(f"  {sc['id']:<46} {sc['from_gpus']:>3} -> {sc['gpus']:<4} {sc['measured_efficiency']:.2f} / {pred}")
    if summary["not_predicted"]:
        print(" not predicted")
        for rid, why in summary["not_predicted"].items():
            print(f"  {rid:<46} {why}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--only", default=None, help="score only the runs whose id contains this")
    ap.add_argument("--data", type=Path, default=DATA, help="the runs' TOML file")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    table, kernel_why = kernel_table() if args.json else (kernel_section(), None)
    runs = load_runs(args.data)
    extra, why = imported_runs()
    runs = extra + runs
    check_ids(runs)
    if args.only:
        runs = [r for r in runs if args.only in r.id]
    scored = score_all(runs)
    summary = summarize(scored)
    seconds = time.perf_counter() - t0
    if args.json:
        rows = [{"id": s.run.id, "gpu": s.run.gpu, "family": s.run.family, "unit": s.run.unit,
                 "measured": s.run.measured, "predicted": s.predicted, "error": s.error, "step_s": s.step_s,
                 "fitted": s.run.fitted, "confidence": s.run.confidence, "note": s.why, "source": s.run.source}
                for s in scored]
        kernels = table if isinstance(table, (str, dict, list)) else None if table is None else str(table)
        print(json.dumps({"kernels": kernels, "kernels_not_reported": kernel_why, "runs": rows, "summary": summary,
                          "left_out": why, "seconds": seconds}, indent=1))
        return 0
    if why:
        print(why)
    print_runs(scored)
    print_summary(summary)
    print(f"\n{seconds:.0f} s; python {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
