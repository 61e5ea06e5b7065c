"""From a few small captures to the full model at any batch size, exactly.

Batch: every tensor of a step is either independent of the micro-batch (weights, gradients,
optimizer state) or proportional to it (activations, their gradients), so each sample's live bytes
are affine in the batch: ``live(b) = base + b * slope``. Two captures (b and b+1) with the same op
sequence give both terms for every sample, and the peak at any batch is ``max`` over samples.

Blocks: a stack of L identical blocks is captured with 2 and with 3 blocks. The 3-block timeline
is the 2-block one with one more block's samples inserted in each pass (forward, backward); the
samples they share differ by what one extra block holds at that point. The L-block timeline
repeats the inserted block L-2 times, each copy offset by what one block leaves behind, and
scales the shared samples by L-2. With L=2 or 3 it gives back the captures themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import groupby

import numpy as np

from gpuwise.planning.capture import Capture, weighed
from gpuwise.planning.tracker import OpRows


class Misaligned(Exception):
    """Two captures did not run the same op sequence, so they cannot be combined."""


@dataclass(frozen=True)
class Timeline:
    """Live bytes per category after each allocating op: ``base + batch * slope``, shape (samples, categories)."""

    labels: tuple[tuple[str, int | None], ...]
    base: np.ndarray = field(repr=False)
    slope: np.ndarray = field(repr=False)
    end_of_forward: int

    def live(self, batch: int) -> np.ndarray:
        return self.base + batch * self.slope

    def max_batch(self, capacity_bytes: float, limit: int) -> int:
        """The largest batch whose peak stays within ``capacity_bytes`` (0 if none does), at most ``limit``."""
        base, slope = self.base.sum(axis=1), self.slope.sum(axis=1)
        if np.any((slope <= 0) & (base + slope > capacity_bytes)):
            return 0
        grows = slope > 0
        if not grows.any():
            return limit
        best = np.floor((capacity_bytes - base[grows]) / slope[grows]).min()
        return int(min(max(best, 0), limit))


def batch_affine(a: Capture, b: Capture) -> Timeline:
    """Combine captures at two batch sizes into a timeline affine in the batch."""
    if a.ops != b.ops or a.labels != b.labels:
        raise Misaligned(f"batch {a.batch} and batch {b.batch} ran different ops")
    x1, x2 = a.live.astype(np.float64), b.live.astype(np.float64)
    slope = (x2 - x1) / (b.batch - a.batch)
    return Timeline(labels=a.labels, base=x1 - a.batch * slope, slope=slope, end_of_forward=a.end_of_forward)


def _affine(x1: np.ndarray, x2: np.ndarray, b1: int, b2: int, batch: int) -> np.ndarray:
    """``x`` at ``batch`` from its values at ``b1`` and ``b2``, in integers: exact where ``x`` is affine."""
    step, rest = np.divmod(x2 - x1, b2 - b1)
    if rest.any():
        raise Misaligned(f"batch {b1} and batch {b2} differ by a step that is not a whole number of bytes a sample")
    return x1 + (batch - b1) * step


def capture_at(a: Capture, b: Capture, batch: int) -> Capture:
    """The capture at ``batch`` as two captures of the same step (at ``a.batch`` and ``b.batch``) predict it:
    every storage's size and every op's FLOPs and bytes affine in the batch (see the module docstring), each
    storage then rounded as the allocator rounds it, the weighted totals and per-op costs recomputed from those
    ops. Misaligned if the two did not allocate the same storages at the same ops and run the same ops."""
    if (a.ops != b.ops or a.labels != b.labels or a.rows is None or b.rows is None or not a.rows.same_ops(b.rows)
            or a.storages is None or b.storages is None or not a.storages.same_lives(b.storages)
            or (a.end_of_forward, a.held, a.grad_accum, a.fb_ops, a.fb_samples, a.first_ops, a.first_samples)
            != (b.end_of_forward, b.held, b.grad_accum, b.fb_ops, b.fb_samples, b.first_ops, b.first_samples)
            or a.uncosted != b.uncosted or a.params != b.params or a.batch == b.batch):
        raise Misaligned(f"batch {a.batch} and batch {b.batch} ran different ops")
    if batch in (a.batch, b.batch):
        return a if batch == a.batch else b
    rows = OpRows(flops=_affine(a.rows.flops, b.rows.flops, a.batch, b.batch, batch),
                  bytes=_affine(a.rows.bytes, b.rows.bytes, a.batch, b.batch, batch),
                  kind=a.rows.kind, phase=a.rows.phase)
    storages = replace(a.storages, nbytes=_affine(a.storages.nbytes, b.storages.nbytes, a.batch, b.batch, batch))
    if (rows.flops < 0).any() or (rows.bytes < 0).any() or (storages.nbytes < 0).any():
        raise Misaligned(f"batch {batch} is outside what batch {a.batch} and batch {b.batch} predict")
    return replace(a, batch=batch, live=storages.timeline(len(a.labels)), rows=rows, storages=storages,
                   measured_peak_bytes=None, **weighed(rows, a.fb_ops, a.held, a.grad_accum))


def _runs(labels) -> list[tuple[tuple[str, int | None], int, int]]:
    """(label, start, stop) of each stretch of equal labels."""
    out, i = [], 0
    for label, grp in groupby(labels):
        n = sum(1 for _ in grp)
        out.append((label, i, i + n))
        i += n
    return out


def extrapolate_blocks(t2: Timeline, t3: Timeline, n_layer: int) -> Timeline:
    """The timeline of ``n_layer`` blocks from those of 2 and 3 blocks (see the module docstring)."""
    if n_layer < 2:
        raise ValueError("extrapolate_blocks needs n_layer >= 2")
    runs2, runs3 = _runs(t2.labels), _runs(t3.labels)
    shared3 = [r for r in runs3 if r[0][1] != 1]
    relabel = [((ph, 1 if blk == 2 else blk), s, e) for (ph, blk), s, e in shared3]
    if [(lab, e - s) for lab, s, e in relabel] != [(lab, e - s) for lab, s, e in runs2]:
        raise Misaligned("the 3-block capture is not the 2-block one plus a block")
    pairs = {s3: (s2, e2) for (_, s3, _), (_, s2, e2) in zip(shared3, runs2, strict=True)}
    k = n_layer - 2
    labels: list[tuple[str, int | None]] = []
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    eof = -1
    for idx, ((phase, blk), s3, e3) in enumerate(runs3):
        if blk != 1:
            s2, e2 = pairs[s3]
            grow = [x3[s3:e3] - x2[s2:e2] for x2, x3 in ((t2.base, t3.base), (t2.slope, t3.slope))]
            parts.append((t2.base[s2:e2] + k * grow[0], t2.slope[s2:e2] + k * grow[1]))
            if s3 <= t3.end_of_forward < e3:
                eof = sum(len(p[0]) for p in parts[:-1]) + t3.end_of_forward - s3
            labels += [(phase, n_layer - 1 if blk == 2 else blk)] * (e3 - s3)
            continue
        if idx == 0 or idx == len(runs3) - 1:
            raise Misaligned("an inserted block at the very start or end of the step")
        before3, after3 = s3 - 1, e3  # the shared samples just before and after the inserted block
        before2 = pairs[runs3[idx - 1][1]][1] - 1
        after2 = pairs[runs3[idx + 1][1]][0]
        copies = []
        for x2, x3 in ((t2.base, t3.base), (t2.slope, t3.slope)):
            extra = x3[before3] - x2[before2]  # one more block, not yet run
            step = (x3[after3] - x2[after2]) - extra  # what running it leaves behind
            copies.append(np.concatenate([x3[s3:e3] + (k - 1) * extra + r * step for r in range(k)])
                          if k else x3[s3:s3])
        parts.append((copies[0], copies[1]))
        for r in range(k):  # forward runs blocks 1..L-2 here, backward runs them in reverse
            labels += [(phase, n_layer - 2 - r if phase == "backward" else 1 + r)] * (e3 - s3)
    base = np.concatenate([p[0] for p in parts])
    slope = np.concatenate([p[1] for p in parts])
    return Timeline(labels=tuple(labels), base=base, slope=slope, end_of_forward=eof)
