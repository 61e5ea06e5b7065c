"""How long one case of ``gpuwise bench`` may take, and how long this run's measurements say it will: a case
predicted to run past the limit runs at a smaller size, or not at all, and says why and how to run it.

Predictions come from what the same run measured on the same device: the largest GEMM timed per element type (a
short probe where none is yet), and the best copy bandwidth. A CPU without bf16 units (bf16 emulated, tens to
hundreds of times slower than fp32) so times a small bf16 GEMM and skips the large ones, where each took a minute.
Timings stay real: a prediction only decides what runs, never a figure.

>>> pace = Pace(limit_s=5.0)
>>> pace.learn("fp32", flops=2 * 1024**3, seconds=0.01)
>>> round(pace.call_seconds("fp32", 2 * 2048**3), 3)
0.08
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

MIN_REPEAT_S = 1e-3  # a timed repeat runs the op enough times to last this long (suite.run_case)
MIN_REPEATS = 3  # a case that must save time keeps at least these timed repeats (its warm-up goes first)
QUICK_LIMIT_S = 5.0  # the most one case may take, its probe, warm-up and repeats together: --quick
FULL_LIMIT_S = 30.0  # the same for the full suite
QUICK_BUDGET_S = 40.0  # --quick's cases together (torch's start comes on top): the last ones run smaller or not at all
# The share of the device's GEMM rate other ops reach, at the low end of what 2-core CPUs measured (one idle, one
# shared: attention 0.63/0.7 with the flash kernel, 0.28/0.15 with math, conv2d 0.94/0.38, a GPT-2 block 0.54/0.23, a
# GPT-2 training step 0.3/0.1-0.2); one that runs slower still takes longer than predicted, and run_case cuts its
# repeats, or stops it after one call.
SHARES = {"attention": 0.25, "attention math": 0.12, "conv2d": 0.3, "block": 0.2, "train-step": 0.1}
EMULATED_SHARE = 0.25  # a 16-bit GEMM below this share of fp32's rate on the same device has no native units


def limit_for(quick: bool, case_limit_s: float | None) -> tuple[float | None, float | None]:
    """(the seconds one case may take, the seconds all may take): ``--case-limit`` when given (0: no limit, None
    here), and then no budget for all, so that the limit a note suggests runs its case; else --quick's (and its
    budget) or the full suite's (no budget)."""
    if case_limit_s is None:
        return (QUICK_LIMIT_S, QUICK_BUDGET_S) if quick else (FULL_LIMIT_S, None)
    return (None if case_limit_s == 0 else case_limit_s), None


def case_seconds(call_s: float, repeats: int = MIN_REPEATS) -> float:
    """What a case of calls of ``call_s`` takes at the least: the probe call, then ``repeats`` timed repeats of at
    least MIN_REPEAT_S each (run_case batches short calls)."""
    return call_s + repeats * max(call_s, MIN_REPEAT_S)


def flop_rate(flops_per_s: float) -> str:
    """"48.5 GFLOP/s", "812 TFLOP/s": three figures, in the unit that keeps them short."""
    giga = float(f"{flops_per_s / 1e9:.3g}")
    return f"{giga:g} GFLOP/s" if giga < 1000 else f"{flops_per_s / 1e12:,.3g} TFLOP/s"


def _seconds(s: float) -> str:
    return f"{s:.2g} s" if s < 10 else f"{s:,.0f} s"


def force_hint(seconds: float) -> str:
    """The flag that runs a case predicted to take ``seconds``: a limit above it, rounded up."""
    need = max(1, math.ceil(seconds * 1.5))
    need = need if need < 10 else int(math.ceil(need / 10) * 10)
    return f"rerun with --case-limit {need} to time it (0: no limit)"


@dataclass(kw_only=True)
class Pace:
    """The limit per case and what the run has measured on one device so far (``learn``)."""

    limit_s: float | None  # None: no limit
    quick: bool = False  # says "--quick" in the notes
    budget_s: float | None = None  # the seconds all cases together may take from ``started``; None: no budget
    started: float = field(default_factory=lambda: time.monotonic())
    gemm: dict[str, tuple[float, float]] = field(default_factory=dict)  # dtype -> (flops, seconds) of its largest call
    gbps: float | None = None  # the best copy bandwidth measured (read + write)

    def learn(self, dtype: str, *, flops: float, seconds: float) -> None:
        """A GEMM of ``dtype`` and ``flops`` took ``seconds`` a call: the largest one measured predicts the next."""
        if not (flops > 0 and seconds > 0 and math.isfinite(seconds)):
            return
        seen = self.gemm.get(dtype)
        if seen is None or flops > seen[0] or (flops == seen[0] and seconds < seen[1]):
            self.gemm[dtype] = (flops, seconds)

    def learn_copy(self, *, nbytes: float, seconds: float) -> None:
        if nbytes > 0 and seconds > 0 and math.isfinite(seconds):
            self.gbps = max(self.gbps or 0.0, nbytes / seconds / 1e9)

    def rate(self, dtype: str) -> float | None:
        """FLOP/s of the largest ``dtype`` GEMM measured, None before any."""
        seen = self.gemm.get(dtype)
        return None if seen is None else seen[0] / seen[1]

    def measured_at(self, dtype: str) -> float:
        """The FLOPs of the GEMM that ``rate`` comes from (0 before any)."""
        return self.gemm.get(dtype, (0.0, 0.0))[0]

    def call_seconds(self, dtype: str, flops: float, *, share: float = 1.0) -> float | None:
        """Seconds one call of ``flops`` should take at ``share`` of this device's ``dtype`` GEMM rate (SHARES for
        ops other than a GEMM); None when no rate is known yet."""
        rate = self.rate(dtype)
        return None if rate is None else flops / (rate * share)

    def copy_seconds(self, nbytes: float) -> float | None:
        return None if not self.gbps else nbytes / (self.gbps * 1e9)

    @property
    def left_s(self) -> float | None:
        """The seconds the next case may take: the limit, or what is left of the budget where that is less."""
        if self.budget_s is None:
            return self.limit_s
        left = max(0.0, self.budget_s - (time.monotonic() - self.started))
        return left if self.limit_s is None else min(self.limit_s, left)

    def fits(self, call_s: float | None) -> bool:
        """Whether a case of calls of ``call_s`` (None: not known, a first GEMM) stays within ``left_s`` with its
        fewest repeats; nothing fits once the budget is spent."""
        left = self.left_s
        if left is None:
            return True
        if call_s is None:
            return left > 0
        return case_seconds(call_s) <= left

    def emulated(self, dtype: str) -> str:
        """", no native bf16 units here: emulated at 1/300 of fp32's rate" when a 16-bit GEMM runs far below fp32's
        rate on this device (a CPU without bf16 or fp16 instructions), else ""."""
        if dtype not in ("bf16", "fp16") or self.rate("fp32") is None or self.rate(dtype) is None:
            return ""
        share = self.rate(dtype) / self.rate("fp32")
        if share >= EMULATED_SHARE:
            return ""
        return f"; no native {dtype} units here: emulated at 1/{1 / share:,.0f} of fp32's rate"

    def over(self, call_s: float | None, why: str) -> str:
        """Why a case does not run at its size: how long it would take, from what, over which limit (or what is left
        of the budget), and the flag that runs it."""
        left, where = self.left_s, " with --quick" if self.quick else ""
        if self.limit_s is not None and left is not None and left < self.limit_s:
            bound = f"over the {left:.2g} s left of the {self.budget_s:g} s all cases may take{where}"
        else:
            bound = f"over the {self.limit_s:g} s a case may take{where}"
        if call_s is None:  # nothing predicts it: only a spent budget stops such a case
            return (f"the {self.budget_s:g} s all cases may take{where} were spent; "
                    f"{force_hint(self.limit_s / 1.5 if self.limit_s else 1)}")
        total = case_seconds(call_s)
        return f"about {_seconds(total)} here ({why}), {bound}; {force_hint(total)}"
