"""How long `gpuwise recommend` takes over the whole catalog (issue 12), and how many captures it runs.

Each command runs in a fresh interpreter, as `time python -m gpuwise recommend ...` would: the wall time printed
includes the interpreter and the imports; "in recommend" is the command itself; "captures" counts the steps
captured on fake tensors (planning/capture.py), which are almost all of the time.

``--at``: also run with recommend's search taking each run's step from its probe's captures (``Workload.at``)
instead of capturing it, the change proposed for planning/recommend.py, monkeypatched here until it lands (a
no-op once it has), and check that both give the same rows.

    python benchmarks/recommend_speed.py          # gpt2, llama2-7b, llama2-70b as recommend runs them today
    python benchmarks/recommend_speed.py --at     # and with Workload.at
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

COMMANDS = (("gpt2", "1e9"), ("llama2-7b", "1e10"), ("llama2-70b", "1e12"))
TARGET_S = {"llama2-7b": 5.0, "llama2-70b": 15.0}  # issue 12, on a 2-core CPU


def _patch_search() -> None:
    """recommend's search with each run's step taken from its probe's captures (``Workload.at``), and a probe
    without accumulation (one sample per GPU) cut out of the probe with two."""
    from gpuwise.planning import recommend
    from gpuwise.planning.sharding import per_gpu

    search, planner = recommend._Search, recommend.Planner
    if ".at(" in inspect.getsource(search):
        return  # landed
    captured, probe_step = search._captured, planner.per_gpu

    def at(planner, probe, micro: int, accum: int):
        w = planner.workload(replace(probe, grad_accum=2), batch_model=True).at(micro, accum)
        return None if w is None else per_gpu(w, replace(probe, micro_batch=micro, grad_accum=accum))

    def _captured(self, probe, micro: int, accum: int):
        return at(self.planner, probe, micro, accum) or captured(self, probe, micro, accum)

    def per_gpu_of(self, setup, *, batch_model: bool = False):
        if batch_model and setup.training and (setup.micro_batch, setup.grad_accum) == (1, 1):
            step = at(self, setup, 1, 1)
            if step is not None:
                return step
        return probe_step(self, setup, batch_model=batch_model)

    search._captured = _captured
    planner.per_gpu = per_gpu_of


def one(model: str, tokens: str, at: bool, out: str | None) -> None:
    """In a fresh interpreter: run the command once, print seconds and captures as JSON."""
    t0 = time.perf_counter()
    from gpuwise.cli import main
    from gpuwise.planning import workload

    captures = 0
    capture = workload.capture

    def counted(*args, **kwargs):
        nonlocal captures
        captures += 1
        return capture(*args, **kwargs)

    workload.capture = counted
    if at:
        _patch_search()
    t1 = time.perf_counter()
    argv = ["recommend", "--model", model, "--tokens", tokens, "--json"]
    with open(out or os.devnull, "w") as sink:
        stdout, sys.stdout = sys.stdout, sink
        try:
            rc = main(argv)
        finally:
            sys.stdout = stdout
    print(json.dumps({"rc": rc, "imports_s": t1 - t0, "recommend_s": time.perf_counter() - t1, "captures": captures}))


def run(model: str, tokens: str, at: bool, out: str) -> dict:
    t = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--one", model, tokens, "1" if at else "0", out],
                          check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, "wall_s": time.perf_counter() - t}


def _rows(path: str) -> list:
    with open(path) as f:
        data = json.load(f)
    return [(r["gpu"], r["count"], r.get("flags"), r.get("step_time_s")) for r in data.get("rows", [])]


def main() -> None:
    at = "--at" in sys.argv[1:]
    print(f"{'command':44} {'wall s':>7} {'in recommend':>13} {'captures':>9}  target")
    with tempfile.TemporaryDirectory() as tmp:
        for model, tokens in COMMANDS:
            label = f"recommend --model {model} --tokens {tokens}"
            variants = [False, True] if at else [False]
            outs = {}
            for v in variants:
                outs[v] = os.path.join(tmp, f"{model}-{v}.json")
                r = run(model, tokens, v, outs[v])
                target = TARGET_S.get(model)
                verdict = "" if target is None else f"<= {target:g} s: {'yes' if r['wall_s'] <= target else 'NO'}"
                print(f"{label + (' (Workload.at)' if v else ''):44} {r['wall_s']:7.2f} {r['recommend_s']:13.2f} "
                      f"{r['captures']:9d}  {verdict}", flush=True)
            if at:
                same = _rows(outs[False]) == _rows(outs[True])
                print(f"  same rows (gpu, count, settings, step time) with and without Workload.at: {same}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        one(sys.argv[2], sys.argv[3], sys.argv[4] == "1", sys.argv[5] if len(sys.argv) > 5 else None)
    else:
        main()
