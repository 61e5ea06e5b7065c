"""Is ``gpuwise watch`` / ``gpuwise.Monitor`` right? Scenarios whose bottleneck is known by construction (issue 29).

Each scenario is a small plain-PyTorch script in ``benchmarks/watch_scenarios/`` (CPU, tiny models, a few seconds),
run through the real tools: ``gpuwise watch --json -- python SCRIPT`` (a watch from outside) or the script's own
``gpuwise.Monitor`` (it prints the diagnosis, ``Monitor.report()`` and what was true: samples over wall-clock seconds,
the RSS growth a step, the step times). Each row checks the class against the one the scenario was built to have,
and a key figure against its construction:

    a  sleepy loader, no Monitor, under watch      not-judged (watch cannot see the loop: never "healthy")
    b  the same loop with Monitor                   input-bound
    c  every 10th step sleeps 250-400 ms           stalls, period 10; report's samples/s within 10% of wall clock
    d  8 MiB of tensors kept a step                memory-leak, its rate within 25% of the RSS growth measured
    e  CPU-burning loader on a host a hog fills     input-bound, workers proposed <= usable cores
    f  a user's DDP loop (2 gloo ranks), mon.ddp    communication-bound, exposed communication reported (second
                                                    to oversubscribed where other jobs fill the host)
    g  default threads on a host a hog fills        oversubscribed; OMP_NUM_THREADS=1 measured faster
    h  a tiny model on the CPU                      host-bound; 64x the batch gives >= 3x the samples/s (measured)
    i  a healthy CPU loop (torch's threads)         healthy (oversubscribed where other jobs fill the host)
    j  b's loop under watch (Monitor inside)        input-bound (the watch joins the loop's events)
    k  one slow step (300 ms) in 100               healthy: one slow step is no stall
    l  8 MiB a step for 15 steps, then flat         healthy: a full cache is no leak

    .venv/bin/python benchmarks/watch_truth.py                 # every scenario, the table
    .venv/bin/python benchmarks/watch_truth.py --fast          # the ones that take a few seconds (a, b, c, j, k)
    .venv/bin/python benchmarks/watch_truth.py --only a,b --json

A scenario that errors (a script that fails, a figure the diagnosis lacks) shows the error in its row, and the
harness goes on. e and g start a busy loop on every usable core for their own duration only, and stop it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCENARIOS = HERE / "watch_scenarios"
MARK = "WATCH_TRUTH "  # watch_scenarios/_common.py prints its JSON after it

RATE_TOLERANCE = 0.10  # issue 29: the stall run's samples/s within 10% of items over wall time
LEAK_TOLERANCE = 0.25  # issue 29: the leak named with its rate, within 25% of the RSS growth measured
STALL_PERIOD = 10  # scenario c's construction
# Scenario h: the issue measured 5-10x samples/s from a larger batch with a tiny model (Python overhead); 64x the
# batch here measured 60x on an idle core. 3x is the least that still says "the step was overhead".
LARGER_BATCH_GAIN_MIN = 3.0
# A host "busy with other work" before or during a run: half of its cores busy with work not the run's own (psutil,
# over 1 s before; the Monitor's host samples during). Scenarios i and f are built
# for a quiet host; on a busy one oversubscription is true too (the run queue holds other jobs' threads), so there
# it may come first, with the built-in class still among the findings (f) or in its place (i).
BUSY_HOST_SHARE = 0.5
TIMEOUT_S = 120  # per script: each takes a few seconds alone, several times that on a loaded host


class ScenarioError(Exception):
    """A scenario that could not produce its figures: shown in its row."""


@dataclass(frozen=True, kw_only=True)
class Row:
    key: str
    scenario: str
    how: str
    expected: str
    got: str
    figure: str
    passed: bool
    seconds: float
    error: str | None = None
    raw: dict[str, Any] | None = field(default=None, repr=False)


@dataclass(frozen=True, kw_only=True)
class Outcome:
    got: str
    figure: str
    passed: bool
    raw: dict[str, Any] | None = field(default=None, repr=False)  # what the run printed (--keep saves it)


# -- running the scripts -------------------------------------------------------------------------------------------


def _env(**more: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                                     os.environ.get("PYTHONPATH")]))}
    for k, v in more.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ScenarioError(f"timed out after {TIMEOUT_S} s") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no stderr)"]
        where = next((ln.strip() for ln in reversed(lines) if ln.strip().startswith('File "')), None)
        raise ScenarioError(f"exit {done.returncode}: {lines[-1][:300]}" + (f" ({where[:200]})" if where else ""))
    return done


def script(name: str, *args: str, **env: str | None) -> dict[str, Any]:
    """Run a scenario script with this Python; its JSON line (``MARK``)."""
    done = _run([sys.executable, str(SCENARIOS / name), *args], _env(**env))
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise ScenarioError(f"{name} printed no result")


def watched(name: str, *args: str, **env: str | None) -> dict[str, Any]:
    """``gpuwise watch --json -- python SCRIPT``: the watch's JSON (the script's own stdout goes to stderr)."""
    argv = [sys.executable, "-m", "gpuwise", "watch", "--json", "--interval", "0.5", "--",
            sys.executable, str(SCENARIOS / name), *args]
    done = _run(argv, _env(**env))
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        raise ScenarioError(f"watch printed no JSON: {done.stdout[:200]!r}") from None


@contextlib.contextmanager
def cpu_hog() -> Iterator[int]:
    """A busy Python loop on every usable core while the block runs (a host other jobs fill); stopped after."""
    from gpuwise.environment import usable_cores

    n = usable_cores()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)  # the hogs running before the scenario starts
        yield n
    finally:
        for p in hogs:
            p.terminate()
        for p in hogs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def host_busy_cores(seconds: float = 1.0) -> float:
    """Cores busy before a scenario starts (other jobs on a shared host)."""
    import psutil

    return sum(psutil.cpu_percent(interval=seconds, percpu=True)) / 100


def _busy(cores: float) -> bool:
    import psutil

    return cores >= BUSY_HOST_SHARE * (psutil.cpu_count() or 1)


def other_work_during(r: dict) -> float:
    """Cores other work kept busy while the scenario ran: the host's busy cores less the run's own process and
    workers, from the report's host summary (the Monitor's raw psutil samples, not any rule's verdict)."""
    host = (r.get("report") or {}).get("host") or {}
    busy = host.get("busy_cores_median")
    if busy is None:
        return 0.0
    own = ((host.get("process_cpu_median_pct") or 0.0) + (host.get("workers_cpu_median_pct") or 0.0)) / 100
    return max(0.0, busy - own)


# -- reading the results ----------------------------------------------------------------------------------------


def find(obj: Any, key: str) -> Any:
    """The first value under ``key`` anywhere in nested dicts and lists (None if absent)."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        children = list(obj.values())
    elif isinstance(obj, list):
        children = obj
    else:
        return None
    for v in children:
        found = find(v, key)
        if found is not None:
            return found
    return None


def finding(diagnosis: dict[str, Any], bottleneck: str) -> dict[str, Any] | None:
    """The finding of that class, fired as primary or not."""
    return next((f for f in diagnosis.get("findings") or () if f.get("bottleneck") == bottleneck), None)


def classes(diagnosis: dict[str, Any]) -> str:
    """The primary class, and the others that fired after it: "stalls (+memory-leak)"."""
    others = [f["bottleneck"] for f in diagnosis.get("findings") or () if f["bottleneck"] != diagnosis["bottleneck"]]
    return diagnosis["bottleneck"] + (f" (+{', '.join(others)})" if others else "")


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


# -- the scenarios ----------------------------------------------------------------------------------------------


def sleepy_unwatched() -> Outcome:
    r = watched("sleepy_loader.py")
    d = r["diagnosis"]
    missing = d.get("evidence", {}).get("missing")
    return Outcome(got=classes(d), figure=f"steps seen {r['steps']['count']}; missing {missing}",
                   passed=d["bottleneck"] == "not-judged", raw=r)


def sleepy_monitor() -> Outcome:
    r = script("sleepy_loader.py", "--monitor")
    d = r["diagnosis"]
    f = finding(d, "input-bound") or {}
    share = find(f, "data_wait_share_median")
    return Outcome(got=classes(d), figure=f"data wait {pct(share)} (slept {pct(r['slept_share'])} of the loop)",
                   passed=d["bottleneck"] == "input-bound", raw=r)


def sleepy_watched_monitor() -> Outcome:
    r = watched("sleepy_loader.py", "--monitor")
    d = r["diagnosis"]
    share = find(finding(d, "input-bound") or {}, "data_wait_share_median")
    return Outcome(got=classes(d), figure=f"steps joined {r['steps']['count']}; data wait {pct(share)}",
                   passed=d["bottleneck"] == "input-bound", raw=r)


def stalls() -> Outcome:
    r = script("mlp_loop.py", "--stall-every", str(STALL_PERIOD), "--steps", str(6 * STALL_PERIOD))
    d = r["diagnosis"]
    f = finding(d, "stalls") or {}
    period = find(f, "period_steps")
    rate = find(r["report"], "items_per_s") if "error" not in r["report"] else None
    truth = r["samples_per_s"]
    rate_txt = (f"report {r['report']['error']}" if rate is None and "error" in r["report"]
                else f"{rate:,.0f} samples/s reported vs {truth:,.0f} wall ({rate / truth - 1:+.0%})" if rate
                else f"no samples/s reported ({truth:,.0f} wall)")
    figure = (f"stall share {pct(find(f, 'stall_share'))} (true {pct(r['stall_share'])}), period {period}; "
              f"{rate_txt}")
    ok = (d["bottleneck"] == "stalls" and period == STALL_PERIOD and rate is not None
          and abs(rate / truth - 1) <= RATE_TOLERANCE)
    return Outcome(got=classes(d), figure=figure, passed=ok, raw=r)


def _leak_rate_mib(f: dict[str, Any] | None) -> float | None:
    rate = find(f or {}, "rate_bytes_per_step")
    return None if rate is None else rate / (1 << 20)


def leak() -> Outcome:
    r = script("mlp_loop.py", "--leak-mib", "8", "--interval", "0.1")
    d = r["diagnosis"]
    rate, truth = _leak_rate_mib(finding(d, "memory-leak")), r["rss_mib_per_step"]
    figure = (f"{rate:.2f} MiB/step reported vs RSS +{truth:.2f} measured ({rate / truth - 1:+.0%})" if rate
              else f"no rate reported (RSS +{truth:.2f} MiB/step measured)")
    ok = d["bottleneck"] == "memory-leak" and rate is not None and abs(rate / truth - 1) <= LEAK_TOLERANCE
    return Outcome(got=classes(d), figure=figure, passed=ok, raw=r)


def cpu_loader() -> Outcome:
    with cpu_hog():
        r = script("cpu_loader.py")
    d = r["diagnosis"]
    f = finding(d, "input-bound") or {}
    workers = (f.get("change") or {}).get("num_workers")  # None: no more workers proposed (a faster dataset)
    cause, io = find(f, "loading_cause"), find(f, "loading_waits_on_io")
    cores = r["usable_cores"]
    figure = (f"workers proposed {workers or 'none'} vs {cores} usable cores; loader cause {cause}; loader CPU "
              f"{r['item_cpu_ms']:.1f} ms an item, {pct(r['loader_cpu_share'])} of wall")
    ok = d["bottleneck"] == "input-bound" and (workers or 0) <= cores and io is not True
    return Outcome(got=classes(d), figure=figure, passed=ok, raw=r)


def ddp() -> Outcome:
    busy = host_busy_cores()
    r = script("ddp_loop.py")
    d = r["diagnosis"]
    f = finding(d, "communication-bound") or {}
    share = find(f, "exposed_comm_share_median")
    exposed = r["exposed_comm_median_s"]
    figure = (f"exposed comm {pct(share)} of the step ({1e3 * exposed:.0f} ms of {1e3 * r['step_median_s']:.0f}); "
              f"{r['grad_mb']:.0f} MB all-reduced" if exposed is not None
              else "exposed communication not timed") + f"; host busy {busy:.1f} cores before"
    loaded = _busy(busy) or _busy(other_work_during(r))
    first = d["bottleneck"] == "communication-bound" or (loaded and d["bottleneck"] == "oversubscribed" and bool(f))
    return Outcome(got=classes(d), figure=figure, passed=first and exposed is not None and share is not None, raw=r)


def threads() -> Outcome:
    with cpu_hog():
        default = script("threads.py", OMP_NUM_THREADS=None)
        one = script("threads.py", OMP_NUM_THREADS="1")
    d = default["diagnosis"]
    ratio = default["step_median_s"] / one["step_median_s"]
    figure = (f"{default['threads']} threads {1e3 * default['step_median_s']:.0f} ms/step, OMP_NUM_THREADS=1 "
              f"{1e3 * one['step_median_s']:.0f} ms ({ratio:.1f}x faster; judged {one['diagnosis']['bottleneck']})")
    return Outcome(got=classes(d), figure=figure, passed=d["bottleneck"] == "oversubscribed" and ratio > 1,
                   raw={"default": default, "omp1": one})


def tiny() -> Outcome:
    r = script("tiny_model.py")
    d = r["diagnosis"]
    figure = (f"batch {r['small_batch']}: {r['small_samples_per_s']:,.0f} samples/s, batch {r['large_batch']}: "
              f"{r['large_samples_per_s']:,.0f} ({r['gain']:.0f}x)")
    return Outcome(got=classes(d), figure=figure,
                   passed=d["bottleneck"] == "host-bound" and r["gain"] >= LARGER_BATCH_GAIN_MIN, raw=r)


def _mlp_figure(r: dict[str, Any]) -> str:
    rep = r["report"]
    p95 = find(rep, "p95_s") if "error" not in rep else None
    return (f"step median {1e3 * r['step_median_s']:.0f} ms" + (f", p95 {1e3 * p95:.0f} ms" if p95 else "")
            + f"; {r['threads']} threads, load {r['load_1m']:.1f}")


def healthy() -> Outcome:
    busy = host_busy_cores()
    r = script("mlp_loop.py", "--threads", "0")
    got = r["diagnosis"]["bottleneck"]
    during = other_work_during(r)
    ok = got == "healthy" or ((_busy(busy) or _busy(during)) and got == "oversubscribed")
    return Outcome(got=classes(r["diagnosis"]), figure=_mlp_figure(r) + f"; other work {busy:.1f} cores before, "
                   f"{during:.1f} during",
                   passed=ok, raw=r)


def one_slow_step() -> Outcome:
    r = script("mlp_loop.py", "--slow-step", "50")
    return Outcome(got=classes(r["diagnosis"]), figure=f"one step of 300 ms, {pct(r['stall_share'])} of wall; "
                   + _mlp_figure(r), passed=r["diagnosis"]["bottleneck"] == "healthy", raw=r)


def plateau() -> Outcome:
    r = script("mlp_loop.py", "--leak-mib", "8", "--plateau", "15", "--interval", "0.1")
    d = r["diagnosis"]
    rate = _leak_rate_mib(finding(d, "memory-leak"))
    figure = f"RSS +{r['rss_mib_per_step']:.2f} MiB/step over the loop (flat after step 15)" + (
        f"; leak rate said {rate:.2f} MiB/step" if rate else "")
    return Outcome(got=classes(d), figure=figure, passed=d["bottleneck"] == "healthy", raw=r)


@dataclass(frozen=True, kw_only=True)
class Scenario:
    key: str
    name: str
    how: str
    expected: str
    run: Callable[[], Outcome]
    fast: bool = False  # a few seconds: run by --fast and in CI
    rule_pending: bool = False  # its rule lands with issue 29 (the tests mark it xfail until then)


SCENARIOS_ALL: tuple[Scenario, ...] = (
    Scenario(key="a", name="sleepy loader, no Monitor", how="watch -- python sleepy_loader.py",
             expected="not-judged", run=sleepy_unwatched, fast=True),
    Scenario(key="b", name="sleepy loader, Monitor", how="python sleepy_loader.py --monitor",
             expected="input-bound", run=sleepy_monitor, fast=True),
    Scenario(key="c", name="periodic stalls", how="python mlp_loop.py --stall-every 10 --steps 60",
             expected="stalls", run=stalls, fast=True, rule_pending=True),
    Scenario(key="d", name="memory leak 8 MiB/step", how="python mlp_loop.py --leak-mib 8 --interval 0.1",
             expected="memory-leak", run=leak, rule_pending=True),
    Scenario(key="e", name="CPU-bound loader, busy host", how="python cpu_loader.py + hog on every core",
             expected="input-bound", run=cpu_loader, rule_pending=True),
    Scenario(key="f", name="user DDP loop, 2 gloo ranks", how="python ddp_loop.py (mp.spawn, mon.ddp)",
             expected="communication-bound", run=ddp, rule_pending=True),
    Scenario(key="g", name="threads on a saturated host", how="python threads.py + hog; again OMP_NUM_THREADS=1",
             expected="oversubscribed", run=threads, rule_pending=True),
    Scenario(key="h", name="tiny model on the CPU", how="python tiny_model.py (batch 4, then 256)",
             expected="host-bound", run=tiny, rule_pending=True),
    Scenario(key="i", name="healthy CPU loop", how="python mlp_loop.py --threads 0",
             expected="healthy", run=healthy),
    Scenario(key="j", name="sleepy loader, Monitor, watched", how="watch -- python sleepy_loader.py --monitor",
             expected="input-bound", run=sleepy_watched_monitor, fast=True),
    Scenario(key="k", name="one slow step", how="python mlp_loop.py --slow-step 50",
             expected="healthy", run=one_slow_step, fast=True, rule_pending=True),
    Scenario(key="l", name="memory plateau", how="python mlp_loop.py --leak-mib 8 --plateau 15 --interval 0.1",
             expected="healthy", run=plateau, rule_pending=True),
)
BY_KEY = {s.key: s for s in SCENARIOS_ALL}


def run_scenario(s: Scenario) -> Row:
    t = time.perf_counter()
    try:
        out = s.run()
    except Exception as exc:  # any failure is the row's, never the harness's
        return Row(key=s.key, scenario=s.name, how=s.how, expected=s.expected, got="error", figure="",
                   passed=False, seconds=time.perf_counter() - t, error=f"{type(exc).__name__}: {exc}")
    return Row(key=s.key, scenario=s.name, how=s.how, expected=s.expected, got=out.got, figure=out.figure,
               passed=out.passed, seconds=time.perf_counter() - t, raw=out.raw)


def select(only: str | None, fast: bool) -> list[Scenario]:
    if only:
        keys = [k.strip() for k in only.split(",") if k.strip()]
        unknown = [k for k in keys if k not in BY_KEY]
        if unknown:
            raise SystemExit(f"unknown scenario {', '.join(unknown)}: pick from {', '.join(BY_KEY)}")
        return [BY_KEY[k] for k in keys]
    return [s for s in SCENARIOS_ALL if s.fast or not fast]


def table(rows: list[Row]) -> str:
    lines = ["| | scenario | how it is run | expected | got | key figure | pass |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        figure = r.figure if r.error is None else f"error: {r.error}"
        lines.append(f"| {r.key} | {r.scenario} | `{r.how}` | {r.expected} | {r.got} | {figure} | "
                     f"{'yes' if r.passed else 'NO'} |")
    passed = sum(r.passed for r in rows)
    lines.append(f"\n{passed}/{len(rows)} pass, {sum(r.seconds for r in rows):.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="scenarios to run, by key: a,b,c")
    ap.add_argument("--fast", action="store_true", help="only the scenarios that take a few seconds")
    ap.add_argument("--json", action="store_true", help="the rows as JSON")
    ap.add_argument("--keep", metavar="DIR", help="save what each scenario's run printed to DIR/KEY.json")
    args = ap.parse_args(argv)
    rows = []
    for s in select(args.only, args.fast):
        rows.append(run_scenario(s))
        if args.keep and rows[-1].raw is not None:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            (Path(args.keep) / f"{s.key}.json").write_text(json.dumps(rows[-1].raw, indent=1))
        if not args.json:
            r = rows[-1]
            print(f"{r.key}: {r.got} ({'pass' if r.passed else 'FAIL'}, {r.seconds:.0f} s)", file=sys.stderr)
    print(json.dumps([{k: v for k, v in asdict(r).items() if k != "raw"} for r in rows], indent=2) if args.json
          else table(rows))
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
