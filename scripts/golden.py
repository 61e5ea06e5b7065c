"""Regenerate the golden plan: ``gpuwise plan --model gpt2 --batch 8 --json`` as this tree prints it, less the fields
that depend on the machine it runs on. ``tests/test_golden.py`` fails when the plan drifts from it; this rewrites it.

    python scripts/golden.py           # rewrite tests/data/golden/plan_gpt2.json, list the fields that changed
    python scripts/golden.py --check   # change nothing; exit 1 if the plan drifted

The plan runs with an empty cache folder (no calibrations from ``gpuwise bench --calibrate``, no kept captures), as
the test does.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "golden" / "plan_gpt2.json"
COMMAND = ("plan", "--model", "gpt2", "--batch", "8", "--json")
# Without --gpu the plan's own GPU is this machine's when the catalog knows it (else the default): these top-level
# fields are for that GPU. Every catalog GPU's figures stay, under "gpus".
MACHINE_DEPENDENT = ("gpu", "fits", "max_batch", "remedies")
REL = 1e-9  # floats are compared to this relative tolerance: sums may round differently on another CPU


def without_machine(plan: dict) -> dict:
    return {k: v for k, v in plan.items() if k not in MACHINE_DEPENDENT}


def differences(golden, now, path: str = "") -> list[str]:
    """Where ``now`` differs from ``golden``: one line per field (a JSON path), floats within REL equal."""
    if isinstance(golden, dict) and isinstance(now, dict):
        out = [f"{path}.{k}: only in the golden file" for k in golden if k not in now]
        out += [f"{path}.{k}: new" for k in now if k not in golden]
        return out + [d for k in golden if k in now for d in differences(golden[k], now[k], f"{path}.{k}")]
    if isinstance(golden, list) and isinstance(now, list):
        if len(golden) != len(now):
            return [f"{path}: {len(golden)} items in the golden file, {len(now)} now"]
        return [d for i, (a, b) in enumerate(zip(golden, now, strict=True)) for d in differences(a, b, f"{path}[{i}]")]
    numbers = (int, float)
    if isinstance(golden, numbers) and isinstance(now, numbers) and not isinstance(golden, bool) \
            and not isinstance(now, bool) and (isinstance(golden, float) or isinstance(now, float)):
        return [] if math.isclose(golden, now, rel_tol=REL, abs_tol=1e-15) else [f"{path}: {golden!r} -> {now!r}"]
    return [] if golden == now and type(golden) is type(now) else [f"{path}: {golden!r} -> {now!r}"]


def plan_now() -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "XDG_CACHE_HOME": cache, "PYTHONPATH": str(ROOT / "src")}
        done = subprocess.run([sys.executable, "-m", "gpuwise", *COMMAND], capture_output=True, text=True, env=env,
                              cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"gpuwise {' '.join(COMMAND)} failed ({done.returncode}):\n{done.stderr}")
    return without_machine(json.loads(done.stdout))


def main(argv: list[str]) -> int:
    now = plan_now()
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    changed = differences(golden, now)
    for line in changed[:50]:
        print(line)
    if len(changed) > 50:
        print(f"... and {len(changed) - 50} more")
    if "--check" in argv:
        return 1 if changed else 0
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(now, indent=2) + "\n")
    print(f"wrote {GOLDEN.relative_to(ROOT)} ({len(changed)} fields changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
