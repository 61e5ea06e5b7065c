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
A stack whose blocks differ (blocks.py: dense then MoE, sliding and global attention) is captured
the same way with a repeating unit of blocks in place of the block.

Of the four captures, the 2-block one at b+1 is not run (``fewer_blocks_at``): each of its ops and
storages grows with the batch as the same op and storage of the 3-block step does, which the other
three captures give. A capture is most of a cold plan's time; this is one in four of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import groupby

import numpy as np

from gpuwise.planning.capture.blocks import Misaligned, Stack
from gpuwise.planning.capture.step import Capture, weighed
from gpuwise.planning.capture.tracker import IN_STEP, NO_BLOCK, PHASES, OpRows

__all__ = ["Misaligned", "Timeline", "batch_affine", "capture_at", "extrapolate_blocks", "fewer_blocks_at"]


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


def _affine_dims(x1: np.ndarray, x2: np.ndarray, b1: int, b2: int, batch: int) -> np.ndarray:
    """A GEMM's (b, m, n, k) at ``batch``, each affine in the batch as the FLOPs are, rounded (an expert's share of
    the routed tokens is a whole number at each batch but need not step evenly), never below 1 where it was >= 1."""
    got = np.rint(x1 + (x2 - x1) * ((batch - b1) / (b2 - b1))).astype(np.int64)
    return np.where(x1 > 0, np.maximum(got, 1), 0)


def _paired(a: Capture, b: Capture) -> bool:
    """Captures of the same step at two batch sizes that ran the same ops and allocated the same storages at them."""
    return not (a.ops != b.ops or a.labels != b.labels or a.rows is None or b.rows is None
                or not a.rows.same_ops(b.rows) or a.storages is None or b.storages is None
                or not a.storages.same_lives(b.storages)
                or (a.end_of_forward, a.held, a.grad_accum, a.fb_ops, a.fb_samples, a.first_ops, a.first_samples)
                != (b.end_of_forward, b.held, b.grad_accum, b.fb_ops, b.fb_samples, b.first_ops, b.first_samples)
                or a.uncosted != b.uncosted or a.params != b.params or a.batch == b.batch)


def capture_at(a: Capture, b: Capture, batch: int) -> Capture:
    """The capture at ``batch`` as two captures of the same step (at ``a.batch`` and ``b.batch``) predict it:
    every storage's size and every op's FLOPs and bytes affine in the batch (see the module docstring), each
    storage then rounded as the allocator rounds it, the weighted totals and per-op costs recomputed from those
    ops. Misaligned if the two did not allocate the same storages at the same ops and run the same ops."""
    if not _paired(a, b):
        raise Misaligned(f"batch {a.batch} and batch {b.batch} ran different ops")
    if batch in (a.batch, b.batch):
        return a if batch == a.batch else b
    rows = OpRows(flops=_affine(a.rows.flops, b.rows.flops, a.batch, b.batch, batch),
                  bytes=_affine(a.rows.bytes, b.rows.bytes, a.batch, b.batch, batch),
                  kind=a.rows.kind, phase=a.rows.phase, family=a.rows.family,
                  dims=_affine_dims(a.rows.dims, b.rows.dims, a.batch, b.batch, batch))
    storages = replace(a.storages, nbytes=_affine(a.storages.nbytes, b.storages.nbytes, a.batch, b.batch, batch))
    if (rows.flops < 0).any() or (rows.bytes < 0).any() or (storages.nbytes < 0).any():
        raise Misaligned(f"batch {batch} is outside what batch {a.batch} and batch {b.batch} predict")
    return replace(a, batch=batch, live=storages.timeline(len(a.labels)), rows=rows, storages=storages,
                   measured_peak_bytes=None, **weighed(rows, a.fb_ops, a.held, a.grad_accum))


def _inserted(labels, first: int, period: int) -> np.ndarray:
    """Which samples of the larger capture are the inserted unit's: those of blocks ``first`` to
    ``first + period - 1``, and unlabelled samples between two of them in the same phase."""
    blk = [b if b is not None and b >= 0 else None for _, b in labels]
    unit = [b is not None and first <= b < first + period for b in blk]
    out = np.array(unit, dtype=bool)
    last = None  # the last labelled sample's index, within a phase
    for i, (phase, _) in enumerate(labels):
        if i and labels[i - 1][0] != phase:
            last = None
        if blk[i] is None:
            continue
        if last is not None and unit[last] and unit[i]:
            out[last + 1:i] = True
        last = i
    return out


def _stretches(mask: np.ndarray) -> list[tuple[bool, int, int]]:
    """(value, start, stop) of each stretch of equal values."""
    out, i = [], 0
    for value, grp in groupby(mask.tolist()):
        n = sum(1 for _ in grp)
        out.append((value, i, i + n))
        i += n
    return out


def extrapolate_blocks(t2: Timeline, t3: Timeline, n_layer: int | Stack) -> Timeline:
    """The timeline of ``n_layer`` blocks from those of 2 and 3 blocks (see the module docstring), or of the
    stack a Stack describes from its captures at ``Stack.captured`` blocks (blocks.py)."""
    stack = n_layer if isinstance(n_layer, Stack) else Stack.uniform(n_layer)
    if stack.n_layer < stack.small:
        raise ValueError(f"extrapolate_blocks needs n_layer >= {stack.small}")
    first, period, k = stack.first, stack.period, stack.copies
    ins = _inserted(t3.labels, first, period)

    def shifted(label):  # t3's blocks after the inserted unit, numbered as in t2 (by = -period) or the full stack
        phase, blk = label
        return lambda by: (phase, blk + by if blk is not None and blk >= first + period else blk)

    if [shifted(lab)(-period) for lab, i in zip(t3.labels, ins, strict=True) if not i] != list(t2.labels):
        raise Misaligned(f"the {stack.small + period}-block capture is not the {stack.small}-block one plus "
                         f"{period} block{'s' if period > 1 else ''}")
    to2 = np.cumsum(~ins) - 1  # t3 sample -> t2 sample, for the shared ones
    labels: list[tuple[str, int | None]] = []
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    eof = -1
    runs = _stretches(ins)
    for idx, (inserted, s3, e3) in enumerate(runs):
        if not inserted:
            s2, e2 = to2[s3], to2[e3 - 1] + 1
            grow = [x3[s3:e3] - x2[s2:e2] for x2, x3 in ((t2.base, t3.base), (t2.slope, t3.slope))]
            parts.append((t2.base[s2:e2] + k * grow[0], t2.slope[s2:e2] + k * grow[1]))
            if s3 <= t3.end_of_forward < e3:
                eof = sum(len(p[0]) for p in parts[:-1]) + t3.end_of_forward - s3
            labels += [shifted(lab)((k - 1) * period) for lab in t3.labels[s3:e3]]
            continue
        if idx == 0 or idx == len(runs) - 1:
            raise Misaligned("an inserted block at the very start or end of the step")
        before3, after3 = s3 - 1, e3  # the shared samples just before and after the inserted unit
        before2, after2 = to2[before3], to2[after3]
        copies = []
        for x2, x3 in ((t2.base, t3.base), (t2.slope, t3.slope)):
            extra = x3[before3] - x2[before2]  # one more unit, not yet run
            step = (x3[after3] - x2[after2]) - extra  # what running it leaves behind
            copies.append(np.concatenate([x3[s3:e3] + (k - 1) * extra + r * step for r in range(k)])
                          if k else x3[s3:s3])
        parts.append((copies[0], copies[1]))
        for r in range(k):  # forward runs the copies in order, backward in reverse
            unit = k - 1 - r if t3.labels[s3][0] == "backward" else r
            labels += [(phase, None if blk is None or blk < 0 else blk + unit * period)
                       for phase, blk in t3.labels[s3:e3]]
    base = np.concatenate([p[0] for p in parts])
    slope = np.concatenate([p[1] for p in parts])
    return Timeline(labels=tuple(labels), base=base, slope=slope, end_of_forward=eof)


def fewer_blocks_at(small: Capture, large: Capture, large_next: Capture, stack: Stack) -> Capture:
    """The capture of ``stack.small`` blocks at ``large_next.batch``, without running it: ``small`` (that step at
    ``large.batch``) with each op and storage grown by what its counterpart in the ``small + period``-block step grew
    by from ``large`` to ``large_next``. Counterparts are what extrapolate_blocks pairs: the larger step less its
    inserted unit, sample by sample, op row by op row and storage by storage, each checked to be the same op, block,
    category and size at ``large.batch``. The optimizer step's ops and storages must not grow with the batch (they are
    the parameters', gradients' and states'), nor may anything the captures say is independent of it.

    Misaligned where any of it does not hold: the smaller step is then captured at that batch."""
    if not _paired(large, large_next) or small.batch != large.batch:
        raise Misaligned(f"batch {large.batch} and batch {large_next.batch} ran different ops")
    steady = ("trainable_params", "block_bytes", "block_trainable_params", "paged_bytes", "embeddings", "routing",
              "uncosted_first", "uncosted_optimizer")
    if any(getattr(large, f) != getattr(large_next, f) for f in steady) or (small.held, small.grad_accum) != (
            large.held, large.grad_accum):
        raise Misaligned(f"the step at batch {large_next.batch} differs beyond its sizes")
    if (small.rows is None or small.storages is None or small.row_blocks is None or large.row_blocks is None
            or small.storages.home is None or large.storages.home is None):
        raise Misaligned("a capture without its rows' blocks or its storages' homes")
    first, period = stack.first, stack.period

    def shifted(block):  # the larger step's block as the smaller one numbers it (the inserted unit left out)
        return block - period if block is not None and block >= first + period else block

    # samples: the larger step's, less the inserted unit's, are the smaller step's
    ins = _inserted(large.labels, first, period)
    if ([(ph, shifted(blk)) for (ph, blk), i in zip(large.labels, ins, strict=True) if not i] != list(small.labels)
            or [op for op, i in zip(large.ops, ins, strict=True) if not i] != list(small.ops)):
        raise Misaligned(f"the {stack.small + period}-block capture is not the {stack.small}-block one plus a unit")
    to_small = np.cumsum(~ins) - 1

    rows = _rows_at(small, large, large_next, shifted, first, period)
    storages = replace(small.storages, nbytes=small.storages.nbytes + _storage_growth(
        small, large, large_next, ins, to_small, shifted, first, period))
    if (storages.nbytes < 0).any():
        raise Misaligned(f"batch {large_next.batch} is outside what the captures predict")
    return replace(small, batch=large_next.batch, live=storages.timeline(len(small.labels)), rows=rows,
                   storages=storages, measured_peak_bytes=None,
                   **weighed(rows, small.fb_ops, small.held, small.grad_accum))


def _rows_at(small: Capture, large: Capture, large_next: Capture, shifted, first: int, period: int) -> OpRows:
    """``small``'s op rows at ``large_next.batch`` (fewer_blocks_at): its forward and backward rows grown as their
    counterparts in ``large``, its optimizer rows as they are."""
    a, b, s = large.rows, large_next.rows, small.rows
    n, m = large.fb_ops, small.fb_ops
    if (b.flops[n:] != a.flops[n:]).any() or (b.bytes[n:] != a.bytes[n:]).any() or (b.dims[n:] != a.dims[n:]).any():
        raise Misaligned("the optimizer step's ops grow with the batch")

    def labels(c: Capture, k: int) -> list[tuple[str, int | None]]:
        return [(PHASES[ph], None if blk == NO_BLOCK else int(blk))
                for ph, blk in zip(c.rows.phase[:k], c.row_blocks[:k], strict=True)]

    big = labels(large, n)
    kept = np.flatnonzero(~_inserted(big, first, period))
    if len(kept) != m or [(ph, shifted(blk)) for ph, blk in (big[i] for i in kept)] != labels(small, m) or any(
            not np.array_equal(getattr(a, f)[kept], getattr(s, f)[:m]) for f in ("flops", "bytes", "kind", "family",
                                                                                   "dims")):
        raise Misaligned("the smaller step's ops are not the larger one's less a unit")

    def grown(f: str) -> np.ndarray:
        x = getattr(s, f).copy()
        x[:m] += getattr(b, f)[kept] - getattr(a, f)[kept]
        return x

    return replace(s, flops=grown("flops"), bytes=grown("bytes"), dims=grown("dims"))


def _storage_growth(small: Capture, large: Capture, large_next: Capture, ins: np.ndarray, to_small: np.ndarray,
                    shifted, first: int, period: int) -> np.ndarray:
    """What each of ``small``'s storages grows by from ``large.batch`` to ``large_next.batch`` (fewer_blocks_at): as its
    counterpart in ``large`` grows. Before the step, the larger step's storages less the inserted unit's blocks' pair
    with the smaller's in order; during it, those each forward or backward sample allocates pair with those its
    counterpart sample allocates; those allocated in the optimizer step (or after the last sample) do not grow."""
    big, s = large.storages, small.storages
    grow = large_next.storages.nbytes - big.nbytes
    out = np.zeros(len(s.nbytes), dtype=np.int64)

    def pair(i: np.ndarray, j: np.ndarray) -> None:  # large's storages i are small's j
        if len(i) != len(j) or (big.category[i] != s.category[j]).any() or (big.nbytes[i] != s.nbytes[j]).any():
            raise Misaligned("the smaller step's storages are not the larger one's less a unit")
        out[j] = grow[i]

    before, before_small = big.home != IN_STEP, s.home != IN_STEP
    inserted = before & (big.home >= first) & (big.home < first + period)
    i, j = np.flatnonzero(before & ~inserted), np.flatnonzero(before_small)
    if len(i) == len(j) and any(shifted(int(h)) != int(k) if h >= 0 else h != k
                                for h, k in zip(big.home[i], s.home[j], strict=True)):
        raise Misaligned("the storages before the step belong to other blocks")
    pair(i, j)

    phases = [ph for ph, _ in large.labels]
    n = len(phases)
    during = np.flatnonzero(~before)
    at = {k: np.flatnonzero(~before & (big.born == k)) for k in np.unique(big.born[during])}
    at_small = {k: np.flatnonzero(~before_small & (s.born == k)) for k in np.unique(s.born[~before_small])}
    none = np.zeros(0, dtype=np.int64)
    for k in range(n + 1):
        mine = at.get(k, none)
        if k == n or phases[k] == "optimizer":
            if grow[mine].any():
                raise Misaligned("the optimizer step's storages grow with the batch")
            continue
        if not ins[k]:
            pair(mine, at_small.get(to_small[k], none))
    return out
