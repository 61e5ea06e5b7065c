"""How long `gpuwise recommend` takes over the whole catalog (issue 12), and how many captures it runs.

Each command runs in a fresh interpreter, as `time python -m gpuwise recommend ...` would: the wall time printed
includes the interpreter and the imports; "in recommend" is the command itself; "captures" counts the steps
captured on fake tensors (planning/capture/step.py), which are almost all of the time on a first run. Each command
runs twice over an empty capture cache (planning/capture/cache.py): cold, then warm, and the rows must agree.

    python benchmarks/recommend_speed.py          # gpt2, llama2-7b, llama2-70b; cold and warm
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

COMMANDS = (("gpt2", "1e9"), ("llama2-7b", "1e10"), ("llama2-70b", "1e12"))
TARGET_S = {"llama2-7b": 5.0, "llama2-70b": 15.0}  # issue 12, on a 2-core CPU


def one(model: str, tokens: str, out: str | None) -> None:
    """In a fresh interpreter: run the command once, print seconds and captures as JSON."""
    t0 = time.perf_counter()
    from gpuwise.cli import main
    from gpuwise.planning.capture import workload

    captures = 0
    capture = workload.capture

    def counted(*args, **kwargs):
        nonlocal captures
        captures += 1
        return capture(*args, **kwargs)

    workload.capture = counted
    t1 = time.perf_counter()
    argv = ["recommend", "--model", model, "--tokens", tokens, "--json"]
    with open(out or os.devnull, "w") as sink:
        stdout, sys.stdout = sys.stdout, sink
        try:
            rc = main(argv)
        finally:
            sys.stdout = stdout
    print(json.dumps({"rc": rc, "imports_s": t1 - t0, "recommend_s": time.perf_counter() - t1, "captures": captures}))


def run(model: str, tokens: str, out: str, cache: str) -> dict:
    t = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--one", model, tokens, out], check=True, capture_output=True,
                          text=True, env={**os.environ, "XDG_CACHE_HOME": cache, "GPUWISE_CACHE": "on"})
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, "wall_s": time.perf_counter() - t}


def _rows(path: str) -> list:
    with open(path) as f:
        data = json.load(f)
    return [(r["gpu"], r["count"], r.get("flags"), r.get("step_time_s")) for r in data.get("rows", [])]


def main() -> None:
    print(f"{'command':44} {'cache':>5} {'wall s':>7} {'in recommend':>13} {'captures':>9}  target")
    with tempfile.TemporaryDirectory() as tmp:
        for model, tokens in COMMANDS:
            label = f"recommend --model {model} --tokens {tokens}"
            cache = os.path.join(tmp, f"cache-{model}")
            outs = {}
            for state in ("cold", "warm"):
                outs[state] = os.path.join(tmp, f"{model}-{state}.json")
                r = run(model, tokens, outs[state], cache)
                target = TARGET_S.get(model)
                verdict = "" if target is None else f"<= {target:g} s: {'yes' if r['wall_s'] <= target else 'NO'}"
                print(f"{label:44} {state:>5} {r['wall_s']:7.2f} {r['recommend_s']:13.2f} {r['captures']:9d}  "
                      f"{verdict}", flush=True)
            same = _rows(outs["cold"]) == _rows(outs["warm"])
            print(f"  same rows (gpu, count, settings, step time) cold and warm: {same}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        one(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
    else:
        main()
