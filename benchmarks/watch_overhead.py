"""What `gpuwise watch` adds to the command it watches (issue 13: nothing measurable).

The command times its own work (a pure-Python loop), alone and under `watch`, alternated; the watcher samples every
0.1 s (ten times its default rate) and at the default 1 s. Prints the medians and their ratio.

    python benchmarks/watch_overhead.py [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORK = """
import sys, time
t = time.perf_counter()
x = 0
for i in range(4_000_000):
    x += i * i
open(sys.argv[1], "w").write(repr(time.perf_counter() - t))
"""


def main() -> None:
    from gpuwise.monitor.watch import watch

    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "seconds"
        for interval in (0.1, 1.0):
            alone, watched = [], []
            for _ in range(args.runs):
                subprocess.run([sys.executable, "-c", WORK, str(out)], check=True)
                alone.append(float(out.read_text()))
                r = watch([sys.executable, "-c", WORK, str(out)], interval_s=interval)
                assert r.exit_code == 0
                watched.append(float(out.read_text()))
            a, w = statistics.median(alone), statistics.median(watched)
            print(f"interval {interval:g} s: the command's own time alone {a:.3f} s, watched {w:.3f} s, "
                  f"ratio {w / a:.3f} (runs: alone {', '.join(f'{x:.2f}' for x in alone)}; watched "
                  f"{', '.join(f'{x:.2f}' for x in watched)})")


if __name__ == "__main__":
    main()
