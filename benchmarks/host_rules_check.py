"""Real runs for the host rules (issue 29), each cause made by construction, each diagnosed by ``gpuwise.Monitor``:

    python benchmarks/host_rules_check.py            # all scenarios, a table of what was true and what was said

- tiny: a 64-wide 3-layer MLP at batch 32 with torch's default threads on an otherwise quiet host: host-bound
  (Python overhead); the same at batch 256 measures the samples/s a larger batch gives.
- oversub: the same host saturated by busy-loop processes (one a core), a 256-wide MLP at batch 256 with 2 threads:
  oversubscribed; the same with OMP_NUM_THREADS=1 measures the step the fix gives.
- loader: a loader that burns CPU (0 workers) on the saturated host: input-bound, cause CPU (starved), and no more
  workers than the free cores; the same loader sleeping instead: cause I/O.

The host is shared: figures are medians of one short run each; rerun to see the spread. The busy loops are this
script's own children, stopped by their pid.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
CHECKED = ("oversubscription", "samples_oversubscribed", "busy_pct_median", "process_cpu_median_pct", "free_cores",
           "busy_cores_other_work", "cpu_host", "step_s_median", "load_1m_per_core_median")


def child(args: argparse.Namespace) -> None:
    import torch

    from gpuwise import Monitor

    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(),
                                torch.nn.Linear(w, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(args.batch, w), torch.randint(0, 10, (args.batch,))

    def data():
        while True:
            if args.load == "cpu":  # decode-like work in Python: burns the CPU
                t = time.process_time()
                while time.process_time() - t < args.load_s:
                    pass
            elif args.load == "sleep":  # waits (I/O-like)
                time.sleep(args.load_s)
            yield x, y

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(10):
        step()
    times = []
    with Monitor(interval_s=0.25) as mon:
        it = mon.loader(data())
        t_end = time.perf_counter() + args.seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            next(it)
            step()
            mon.step(items=args.batch)
            times.append(time.perf_counter() - t0)
        d = mon.diagnose()
        from gpuwise.monitor.host_rules import oversubscribed
        from gpuwise.monitor.loop_rules import host_bound
        from gpuwise.monitor.window import window

        view = window(mon.record(), mon.default_context())
        said = {"oversubscribed": oversubscribed(view, {}), "host-bound": host_bound(view, {})}
    keep = ("cause", "reading", "threads_new", "process_cpu_median_pct", "cores_used", "free_cores",
            "busy_cores_other_work", "loading_cause", "loading_cause_reading", "workers_cap", "num_workers_new",
            "load_1m_per_core_median", "samples_per_s")
    judged = times[len(times) // 10:]
    print(json.dumps({"threads": torch.get_num_threads(), "bottleneck": d.bottleneck,
                      "findings": [f.bottleneck for f in d.findings],
                      "evidence": {k: v for f in d.findings for k, v in f.evidence.items() if k in keep},
                      "fix": list(d.fix[:1]),
                      "checked": {k: {n: v for n, v in j[1].items() if n in CHECKED}
                                  for k, j in said.items() if j}, "step_ms": 1e3 * statistics.median(judged),
                      "samples_per_s": args.batch * len(judged) / sum(judged)}))


def run(name: str, *, threads: int | None = None, **kw) -> dict:
    cmd = [sys.executable, HERE, "--child"] + [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise SystemExit(f"{name}: {out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{name:<34} threads={res['threads']} step {res['step_ms']:8.2f} ms  {res['samples_per_s']:10.0f} "
          f"samples/s  -> {res['bottleneck']} {res['findings']}\n    {json.dumps(res['evidence'])}\n"
          f"    fix: {res['fix']}\n    checked: {json.dumps(res['checked'])}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--load", default="none", choices=("none", "cpu", "sleep"))
    ap.add_argument("--load-s", type=float, default=0.005)
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy loops for the saturated scenarios")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    print(f"load before: {os.getloadavg()}")
    tiny = run("tiny, batch 32 (quiet host)", width=64, batch=32)
    big = run("tiny, batch 256 (quiet host)", width=64, batch=256)
    print(f"  larger batch: {big['samples_per_s'] / tiny['samples_per_s']:.1f}x the samples/s\n")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    try:
        time.sleep(2.0)
        two = run("oversub, 2 threads (saturated)", width=256, batch=256)
        one = run("oversub, OMP_NUM_THREADS=1", threads=1, width=256, batch=256)
        print(f"  fewer threads: step {two['step_ms']:.1f} -> {one['step_ms']:.1f} ms "
              f"({two['step_ms'] / one['step_ms']:.1f}x)\n")
        run("loader burns CPU, 0 workers (saturated)", threads=1, width=64, batch=32, load="cpu", load_s=0.01)
        run("loader sleeps, 0 workers (saturated)", threads=1, width=64, batch=32, load="sleep", load_s=0.01)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
