"""What gpuwise.Monitor costs a training loop (issue 13: at most 1% of step time).

Two measurements, both on this machine:

1. The parts, timed directly: one sample (NVML if there is a GPU, the allocator, psutil's host and process
   readings) and one step hook (``Monitor.step``). The loop pays the hook every step; the sampler thread takes the
   GIL for one sample per interval, so its share of the loop is at most sample time / interval.
2. End to end: ``gpuwise train`` (the built-in character GPT, fixed micro-batch) with ``--monitor`` and with
   ``--no-monitor``, alternated, several runs each; the ratio of the median step times. On a noisy 2-core VM this
   is the weaker figure: the parts bound the cost more tightly than run-to-run noise can.

    OMP_NUM_THREADS=1 python benchmarks/monitor_overhead.py [--runs 5] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

from gpuwise.training.meter import LIVE_WINDOW


def parts(n: int = 200) -> tuple[float, float]:
    from gpuwise.monitor.sampler import Monitor

    mon = Monitor(interval_s=3600.0)  # the thread sleeps: we call the sample ourselves
    mon.start()
    try:
        t = time.perf_counter()
        for _ in range(n):
            mon._sample()
        sample = (time.perf_counter() - t) / n
        t = time.perf_counter()
        for _ in range(n * 50):
            mon.step(seconds=0.1, data_wait_s=0.01, compute_s=0.08, optimizer_s=0.01)
        hook = (time.perf_counter() - t) / (n * 50)
    finally:
        mon.stop()
    return sample, hook


def live_diagnosis(n: int = 200) -> float:
    """What the progress line's diagnosis costs at a log step: the last LIVE_WINDOW steps and their samples."""
    from gpuwise.monitor.sampler import Monitor
    from gpuwise.monitor.samples import HostSample, Sample, StepEvent

    mon = Monitor(gpus=False)
    mon._steps = [StepEvent(step=i, t=0.1 * i, seconds=0.1, data_wait_s=0.01) for i in range(1, 1001)]
    mon._samples = [Sample(t=float(t), host=HostSample(cpu_pct=(50.0, 50.0))) for t in range(100)]
    t = time.perf_counter()
    for _ in range(n):
        mon.diagnose(last_steps=LIVE_WINDOW)
    return (time.perf_counter() - t) / n


def end_to_end(runs: int, steps: int) -> tuple[list[float], list[float]]:
    from gpuwise.training.config import TrainConfig, TrainOptions
    from gpuwise.training.run import run_training

    on, off = [], []
    for i in range(2 * runs):
        monitor = i % 2 == 0
        opts = TrainOptions(auto=False, monitor=monitor,
                            config=TrainConfig(steps=steps, batch=8, micro_batch=8, log_every=steps))
        summary = run_training(opts)
        (on if monitor else off).append(summary.seconds / summary.steps)  # the loop alone, not the set-up
    return on, off


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    sample, hook = parts()
    live = live_diagnosis()
    print(f"one sample: {1e3 * sample:.2f} ms -> {100 * sample / 1.0:.3f}% of the loop at the default 1 s interval")
    print(f"one step hook: {1e6 * hook:.1f} us")
    on, off = end_to_end(args.runs, args.steps)
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"gpuwise train, {args.steps} steps x {args.runs} runs each, per step: monitor {1e3 * m_on:.2f} ms, "
          f"no monitor {1e3 * m_off:.2f} ms, ratio {m_on / m_off:.3f}")
    print(f"  hook share of that step: {100 * hook / m_on:.3f}%")
    print(f"diagnosis of the last {LIVE_WINDOW} steps (the progress line's, each log step): {1e3 * live:.2f} ms")
    print(f"  runs with the monitor: {', '.join(f'{1e3 * x:.2f}' for x in on)} ms")
    print(f"  runs without:          {', '.join(f'{1e3 * x:.2f}' for x in off)} ms")


if __name__ == "__main__":
    main()
