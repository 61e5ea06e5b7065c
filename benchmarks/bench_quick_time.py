"""How long `gpuwise bench --quick` takes on this machine (issue 30: 417 s on a 2-core CPU, README: 30-60 s): each run's
wall time, its CPU time (user + sys, from the child's rusage), the load average around it (the machine may be shared),
and how many cases ran or were skipped as too slow.

    python benchmarks/bench_quick_time.py                  # 3 runs
    python benchmarks/bench_quick_time.py --runs 1 --env ONEDNN_MAX_CPU_ISA=AVX2   # a CPU without bf16 units
    python benchmarks/bench_quick_time.py --args "--ops gemm --dtype fp32,bf16"

``ONEDNN_MAX_CPU_ISA=AVX2`` keeps oneDNN off the AVX-512 bf16 instructions, so bf16 GEMMs run emulated, as on the
CPU of the issue.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import time


def one_run(args: list[str], env: dict[str, str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gpuwise", "bench", "--quick", *args, "--json"], capture_output=True,
                          text=True, env=env, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        sys.exit(f"gpuwise bench exited {done.returncode}: {done.stderr.strip()[-500:]}")
    rows = json.loads(done.stdout)["results"]
    return {"wall_s": wall, "cpu_s": cpu, "load_before": load, "load_after": os.getloadavg()[0],
            "ran": sum(1 for r in rows if r["repeats"]), "not_run": [f"{r['op']} {r['dtype']} {r['shape']}"
                                                                    for r in rows if not r["repeats"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--args", default="", help="more gpuwise bench arguments, as one string")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the runs (repeatable)")
    opts = parser.parse_args()
    env = {**os.environ, **dict(e.split("=", 1) for e in opts.env)}
    print(f"{os.cpu_count()} CPUs; gpuwise bench --quick {opts.args} {' '.join(opts.env)}".rstrip())
    for n in range(opts.runs):
        r = one_run(shlex.split(opts.args), env)
        print(f"run {n + 1}: wall {r['wall_s']:.1f} s, CPU {r['cpu_s']:.1f} s (user + sys), load "
              f"{r['load_before']:.1f} -> {r['load_after']:.1f}; {r['ran']} cases ran, {len(r['not_run'])} not: "
              f"{', '.join(r['not_run']) or '-'}")


if __name__ == "__main__":
    main()
