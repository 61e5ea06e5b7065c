"""CPU time of `gpuwise plan` and `gpuwise recommend` from a cold start, against issue 30's targets.

Cold: a fresh process with an empty capture cache (a new ``XDG_CACHE_HOME``), so every capture runs. CPU time is
user + system of the command's process (``resource.getrusage(RUSAGE_CHILDREN)``): on a shared machine wall time grows
with the load, CPU time much less. Each command runs ``--repeat`` times; the least is the figure (the load only adds).

    python benchmarks/cold_start.py              # both commands once
    python benchmarks/cold_start.py --repeat 3   # the least of three
    python benchmarks/cold_start.py --warm       # and again from the capture cache the cold run filled
    python benchmarks/cold_start.py --breakdown  # where a cold run's CPU goes: imports, each capture, the rest
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

# (command, CPU seconds target): issue 30's, on the 2-core machine
COMMANDS = (
    (("plan", "--model", "gpt2"), 3.0),
    (("recommend", "--model", "llama2-7b"), 6.0),
)


def cpu_seconds(args: tuple[str, ...], cache: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of ``gpuwise ARGS`` in a child process whose capture cache is under ``cache``."""
    env = {**os.environ, "XDG_CACHE_HOME": cache}
    env.pop("GPUWISE_CACHE", None)  # the cache on: a cold run fills it, a warm one reads it
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gpuwise", *args], env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, wall


# The breakdown's child: the CLI in one process, CPU read at each stage, every capture timed (workload.capture)
BREAKDOWN = r"""
import json, resource, sys, time
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
marks = {"start": cpu()}
import torch
marks["import torch"] = cpu()
import gpuwise.cli, gpuwise.planning.planner
marks["import gpuwise"] = cpu()
import gpuwise.planning.capture.workload as workload
real, captures = workload.capture, []
def timed(*args, **kwargs):
    t = cpu()
    try:
        return real(*args, **kwargs)
    finally:
        captures.append(cpu() - t)
workload.capture = timed
sys.argv = ["gpuwise", *sys.argv[1:]]
try:
    gpuwise.cli.main()
except SystemExit:
    pass
marks["end"] = cpu()
json.dump({"marks": marks, "captures": captures, "dynamo": type(sys.modules.get("torch._dynamo")).__name__}, sys.stderr)
"""


def breakdown(args: tuple[str, ...], cache: str) -> str:
    """One line: where a cold ``gpuwise ARGS``'s CPU goes (the BREAKDOWN child, run as the CLI runs)."""
    import json

    env = {**os.environ, "XDG_CACHE_HOME": cache}
    env.pop("GPUWISE_CACHE", None)
    out = subprocess.run([sys.executable, "-c", BREAKDOWN, *args], env=env, check=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    got = json.loads(out.stderr.strip().splitlines()[-1])
    m, caps = got["marks"], got["captures"]
    rest = m["end"] - m["import gpuwise"] - sum(caps)
    later = caps[1:] or [0.0]
    return (f"  import torch {m['import torch']:.2f} s, gpuwise {m['import gpuwise'] - m['import torch']:.2f} s; "
            f"{len(caps)} captures {sum(caps):.2f} s (the first {caps[0] if caps else 0:.2f} s with torch's lazy "
            f"imports, the others {sum(later) / len(later):.2f} s each); the rest {rest:.2f} s; total "
            f"{m['end']:.2f} s; torch._dynamo: {got['dynamo']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1, help="runs of each command; the least CPU time is reported")
    ap.add_argument("--warm", action="store_true", help="also time each command again from the cache it filled")
    ap.add_argument("--breakdown", action="store_true", help="also say where each cold run's CPU goes")
    opts = ap.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
          f"python {platform.python_version()}")
    print(f"{'command':38} {'cold CPU s':>10} {'target':>7} {'met':>4} {'wall s':>7}" + (
        f" {'warm CPU s':>10}" if opts.warm else ""))
    for args, target in COMMANDS:
        cold, warm = [], []
        for _ in range(opts.repeat):
            with tempfile.TemporaryDirectory(prefix="gpuwise-cold-") as cache:
                cold.append(cpu_seconds(args, cache))
                if opts.warm:
                    warm.append(cpu_seconds(args, cache)[0])
        cpu, wall = min(cold)
        line = f"{'gpuwise ' + ' '.join(args):38} {cpu:10.2f} {target:7.1f} {'yes' if cpu <= target else 'no':>4} " \
               f"{wall:7.1f}"
        print(line + (f" {min(warm):10.2f}" if opts.warm else ""), flush=True)
        if opts.breakdown:
            with tempfile.TemporaryDirectory(prefix="gpuwise-cold-") as cache:
                print(breakdown(args, cache), flush=True)


if __name__ == "__main__":
    main()
