"""Which (query block, key block) tiles attention must visit, and the element mask inside the partial ones.

A ``BlockMask`` is defined by an element rule ``rule(b, q, k) -> bool`` (True: query ``q`` may attend to key
``k`` in batch row ``b``), evaluated with NumPy one row of blocks at a time. Every tile is then *empty*
(skipped), *full* (no element mask needed) or *partial* (its ``block_size x block_size`` element mask is
stored). Out-of-range positions (sequences that are not a multiple of the block) do not count: the kernel
masks them separately, so a tile that is whole within the sequence is full.

Tables, per batch row (a leading dimension of 1 broadcasts over the batch), as FlexAttention lays them out:

- ``kv_num_blocks[b, i]`` partial and ``full_kv_num_blocks[b, i]`` full key blocks of query block ``i``;
  ``kv_indices[b, i, :]`` lists the partial ones then the full ones; ``kv_mask_ids`` the partial tiles'
  rows in ``masks``;
- ``q_num_blocks``, ``full_q_num_blocks``, ``q_indices``, ``q_mask_ids``: the same per key block (the
  transposed view the backward pass walks to produce dK and dV without atomics).

Masks are built with NumPy, never with torch, so building one inside the planner's fake-tensor mode costs
nothing and its ``density`` is known there.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from gpuwise.errors import GpuwiseError

Rule = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]  # (b, q, k) index grids -> bool
EMPTY, PARTIAL, FULL = 0, 1, 2
BLOCK_SIZES = (64, 128)
# Where the causal diagonal sits when seq_q != seq_k, in torch.nn.attention.bias.CausalVariant's names:
# "upper_left" starts it at the first key (SDPA's is_causal), "lower_right" ends it at the last key, so query i
# sees keys up to i + seq_k - seq_q (FlashAttention >= 2.1's causal=True: decoding over a KV cache).
CAUSAL_VARIANTS = ("upper_left", "lower_right")
_CAUSAL_ALIASES = {"top_left": "upper_left", "bottom_right": "lower_right"}  # FlashAttention's README words


def causal_variant(causal, arg: str = "causal") -> str | None:
    """``causal=`` as given to ``attention`` (False, True, a name or a ``CausalVariant``) -> None, "upper_left"
    or "lower_right"; ``arg`` names the argument in the error."""
    if isinstance(causal, bool | np.bool_):
        return "upper_left" if causal else None
    options = "True, False, 'upper_left' or 'lower_right'" if arg == "causal" else "'upper_left' or 'lower_right'"
    name = getattr(causal, "name", causal)  # torch.nn.attention.bias.CausalVariant.LOWER_RIGHT -> its name
    if isinstance(name, str):
        key = name.strip().lower().replace("-", "_")
        key = _CAUSAL_ALIASES.get(key, key)
        if key in CAUSAL_VARIANTS:
            return key
        close = difflib.get_close_matches(key, [*CAUSAL_VARIANTS, *_CAUSAL_ALIASES], n=1, cutoff=0.5)
        if close:
            raise GpuwiseError(f"{arg}={causal!r} is not {options}",
                               f"did you mean {arg}={_CAUSAL_ALIASES.get(close[0], close[0])!r}?")
    raise GpuwiseError(f"{arg}={causal!r} is not {options}",
                       f"pass {arg}='upper_left' (as SDPA's is_causal) or {arg}='lower_right' (decoding with a KV "
                       "cache, as FlashAttention)")


@dataclass(frozen=True)
class Tables:
    """The mask as int32 tensors on one device (what the kernels read)."""

    kv_num_blocks: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    kv_mask_ids: torch.Tensor
    q_num_blocks: torch.Tensor
    full_q_num_blocks: torch.Tensor
    q_indices: torch.Tensor
    q_mask_ids: torch.Tensor
    masks: torch.Tensor  # (partial tiles, block, block) int8: 1 attends


def _ordered(kind: np.ndarray, mask_id: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row of ``kind`` (..., n): partial count, full count, indices (partial first, then full), mask ids."""
    partial, full = kind == PARTIAL, kind == FULL
    # a stable sort on (not partial, not full) puts partial tiles first, then full ones, then empty ones
    order = np.argsort(np.where(partial, 0, np.where(full, 1, 2)), axis=-1, kind="stable").astype(np.int32)
    ids = np.take_along_axis(mask_id, order, axis=-1).astype(np.int32)
    return (partial.sum(-1).astype(np.int32), full.sum(-1).astype(np.int32), order, ids)


@dataclass(frozen=True, eq=False)
class BlockMask:
    seq_q: int
    seq_k: int
    block_size: int
    rule: Rule = field(repr=False)
    batch: int = 1  # rows of the rule's batch dimension (1: the same mask for every batch row)
    # optional closed form of the tiles' kinds, tiles(b, q_lo, q_hi, k_lo, k_hi) with inclusive in-range bounds
    # shaped (nQ, 1) and (1, nK); PARTIAL marks a tile to evaluate element by element
    tiles: Callable[..., np.ndarray] | None = field(default=None, repr=False)
    kind: np.ndarray = field(init=False, repr=False)  # (batch, nQ, nK): EMPTY, PARTIAL or FULL
    mask_id: np.ndarray = field(init=False, repr=False)  # (batch, nQ, nK): row in masks, -1 if not partial
    masks: np.ndarray = field(init=False, repr=False)  # (partial tiles, block, block) bool

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise GpuwiseError(f"block_size {self.block_size} is not 64 or 128", "pass block_size=128 (or 64)")
        if self.seq_q < 1 or self.seq_k < 1:
            raise GpuwiseError(f"sequence lengths {self.seq_q} x {self.seq_k} must be positive", "")
        bs = self.block_size
        nq, nk = -(-self.seq_q // bs), -(-self.seq_k // bs)
        if self.tiles is not None:  # the tiles' kinds in closed form: only the partial ones are evaluated
            lo_q, lo_k = np.arange(nq)[:, None] * bs, np.arange(nk)[None, :] * bs
            hi_q, hi_k = np.minimum(lo_q + bs, self.seq_q) - 1, np.minimum(lo_k + bs, self.seq_k) - 1
            kind = np.stack([np.broadcast_to(self.tiles(b, lo_q, hi_q, lo_k, hi_k), (nq, nk))
                             for b in range(self.batch)]).astype(np.int8)
        else:
            kind = np.full((self.batch, nq, nk), PARTIAL, np.int8)
        mask_id = np.full((self.batch, nq, nk), -1, np.int32)
        tiles: list[np.ndarray] = []
        k_all = np.arange(nk * bs)
        k_in = (k_all < self.seq_k).reshape(nk, bs)
        for b in range(self.batch):
            bb = np.full((1, 1), b)
            for i in np.flatnonzero((kind[b] == PARTIAL).any(axis=1)):
                q = np.arange(i * bs, (i + 1) * bs)
                cols = np.flatnonzero(kind[b, i] == PARTIAL)  # evaluate these tiles' elements only
                ks = (cols[:, None] * bs + np.arange(bs)[None, :]).reshape(-1)
                g = np.broadcast_to(np.asarray(self.rule(bb, q[:, None], ks[None, :]), bool),
                                    (bs, ks.size)).reshape(bs, cols.size, bs)
                inside = (q < self.seq_q)[:, None, None] & k_in[cols][None, :, :]
                anyb = (g & inside).any(axis=(0, 2))
                allb = (g | ~inside).all(axis=(0, 2))
                kind[b, i, cols] = np.where(allb, FULL, np.where(anyb, PARTIAL, EMPTY))
                for c, j in enumerate(cols):
                    if kind[b, i, j] == PARTIAL:
                        mask_id[b, i, j] = len(tiles)
                        tiles.append(g[:, c, :].copy())
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "mask_id", mask_id)
        object.__setattr__(self, "masks", np.stack(tiles) if tiles else np.zeros((1, bs, bs), bool))

    @staticmethod
    def _both(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """The tile kinds of an AND: empty if either is, full if both are, else to be evaluated."""
        return np.where((a == EMPTY) | (b == EMPTY), EMPTY, np.where((a == FULL) & (b == FULL), FULL, PARTIAL))

    @staticmethod
    def _either(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.where((a == FULL) | (b == FULL), FULL, np.where((a == EMPTY) & (b == EMPTY), EMPTY, PARTIAL))

    # -- constructors ------------------------------------------------------------------------------------

    @classmethod
    def causal(cls, seq_q: int, seq_k: int | None = None, block_size: int = 128, *,
               variant: str = "upper_left") -> BlockMask:
        """Query ``q`` attends to keys ``k <= q`` (``variant="upper_left"``, as SDPA's ``is_causal``) or
        ``k <= q + seq_k - seq_q`` (``"lower_right"``, as FlashAttention's ``causal=True`` and torch's
        ``causal_lower_right``: the last query sees every key; with seq_q > seq_k the first rows see none).

        >>> BlockMask.causal(1, 4096, variant="lower_right").sparsity  # one decoded token: every key
        0.0
        """
        seq_k = seq_q if seq_k is None else seq_k
        if isinstance(variant, bool | np.bool_):  # names only: variant=False is no causal mask at all
            raise GpuwiseError(f"variant={variant!r} is not 'upper_left' or 'lower_right'",
                               "pass variant='lower_right' for a KV cache, or leave it out")
        shift = seq_k - seq_q if causal_variant(variant, "variant") == "lower_right" else 0
        return cls(seq_q, seq_k, block_size, lambda b, q, k: k <= q + shift,
                   tiles=lambda b, ql, qh, kl, kh: np.where(kh <= ql + shift, FULL,
                                                            np.where(kl > qh + shift, EMPTY, PARTIAL)))

    @classmethod
    def sliding_window(cls, seq: int, window: int, block_size: int = 128) -> BlockMask:
        """Causal within the last ``window`` keys: ``q - window < k <= q``."""
        if window < 1:
            raise GpuwiseError(f"window {window} must be at least 1", "pass the number of keys each query sees")
        def tiles(b, ql, qh, kl, kh):
            full = (kh <= ql) & (kl > qh - window)
            return np.where(full, FULL, np.where((kl > qh) | (kh <= ql - window), EMPTY, PARTIAL))

        return cls(seq, seq, block_size, lambda b, q, k: (k <= q) & (k > q - window), tiles=tiles)

    @classmethod
    def document(cls, doc_ids, block_size: int = 128, causal: bool = False) -> BlockMask:
        """Packed documents: a query attends only to keys of its own document (``doc_ids`` shaped (seq,) or
        (batch, seq)); ``causal=True`` also keeps ``k <= q``."""
        try:
            ids = np.asarray(doc_ids.cpu() if isinstance(doc_ids, torch.Tensor) else doc_ids)
        except ValueError:  # ragged lists
            raise GpuwiseError("doc_ids rows have different lengths", "pass one id per position, every row "
                               "as long as the sequence") from None
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.shape[1] < 1:
            raise GpuwiseError(f"doc_ids shaped {tuple(ids.shape)} is not (seq,) or (batch, seq)",
                               "pass one document id per position")
        seq = ids.shape[1]

        def rule(b, q, k):
            row = ids[b.reshape(-1)[0]]
            same = row[np.minimum(q, seq - 1)] == row[np.minimum(k, seq - 1)]
            return same & (k <= q) if causal else same

        tiles = None
        if (np.diff(ids, axis=1) >= 0).all():  # packed in order: a document is one run, ranges decide the tiles
            def tiles(b, ql, qh, kl, kh):
                row = ids[b]
                qmin, qmax, kmin, kmax = row[ql], row[qh], row[kl], row[kh]
                doc = np.where((qmax < kmin) | (kmax < qmin), EMPTY,
                               np.where((qmin == qmax) & (kmin == kmax) & (qmin == kmin), FULL, PARTIAL))
                if not causal:
                    return doc
                return cls._both(doc, np.where(kh <= ql, FULL, np.where(kl > qh, EMPTY, PARTIAL)))

        return cls(seq, seq, block_size, rule, batch=ids.shape[0], tiles=tiles)

    @classmethod
    def from_dense(cls, block_bool, block_size: int, seq_q: int | None = None, seq_k: int | None = None
                   ) -> BlockMask:
        """Whole blocks on or off: ``block_bool`` shaped (query blocks, key blocks) or (batch, ...)."""
        blocks = np.asarray(block_bool.cpu() if isinstance(block_bool, torch.Tensor) else block_bool, bool)
        if blocks.ndim == 2:
            blocks = blocks[None]
        if blocks.ndim != 3:
            raise GpuwiseError(f"block_bool shaped {tuple(blocks.shape)} is not (q blocks, k blocks)",
                               "pass a 2-D boolean array of blocks")
        sq = seq_q or blocks.shape[1] * block_size
        sk = seq_k or blocks.shape[2] * block_size
        if -(-sq // block_size) != blocks.shape[1] or -(-sk // block_size) != blocks.shape[2]:
            raise GpuwiseError(f"block_bool {tuple(blocks.shape[1:])} does not cover {sq} x {sk} in blocks of "
                               f"{block_size}", "pass one entry per block")
        return cls(sq, sk, block_size, lambda b, q, k: blocks[b.reshape(-1)[0], q // block_size, k // block_size],
                   batch=blocks.shape[0], tiles=lambda b, ql, qh, kl, kh: np.where(blocks[b], FULL, EMPTY))

    def _combine(self, other: BlockMask, op) -> BlockMask:
        if not isinstance(other, BlockMask):
            return NotImplemented
        if (self.seq_q, self.seq_k, self.block_size) != (other.seq_q, other.seq_k, other.block_size):
            raise GpuwiseError(f"cannot combine a {self.seq_q}x{self.seq_k} mask of blocks {self.block_size} with "
                               f"a {other.seq_q}x{other.seq_k} one of blocks {other.block_size}",
                               "build both for the same lengths and block size")
        if 1 not in (self.batch, other.batch) and self.batch != other.batch:
            raise GpuwiseError(f"cannot combine masks for {self.batch} and {other.batch} batch rows", "")
        a, a_rows, c, c_rows = self.rule, self.batch, other.rule, other.batch

        def rule(b, q, k):  # a mask shared by every batch row is asked for row 0
            left = a(b if a_rows > 1 else b * 0, q, k)
            right = c(b if c_rows > 1 else b * 0, q, k)
            return op(np.asarray(left, bool), np.asarray(right, bool))

        combine = self._both if op is np.logical_and else self._either
        kinds_a, kinds_c = self.kind, other.kind  # classified already: combine them, evaluate the undecided

        def tiles(b, ql, qh, kl, kh):
            return combine(kinds_a[b if a_rows > 1 else 0], kinds_c[b if c_rows > 1 else 0])

        return BlockMask(self.seq_q, self.seq_k, self.block_size, rule, batch=max(self.batch, other.batch),
                         tiles=tiles)

    def with_causal(self, variant: str = "upper_left") -> BlockMask:
        """``self & causal``, built once per mask and variant (``attention(..., causal=True)`` asks every call)."""
        cache = self.__dict__.setdefault("_with_causal", {})
        if variant not in cache:
            cache[variant] = self & BlockMask.causal(self.seq_q, self.seq_k, self.block_size, variant=variant)
        return cache[variant]

    def __and__(self, other: BlockMask) -> BlockMask:
        return self._combine(other, np.logical_and)

    def __or__(self, other: BlockMask) -> BlockMask:
        return self._combine(other, np.logical_or)

    # -- views ---------------------------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.kind.shape  # type: ignore[return-value]

    @property
    def sparsity(self) -> float:
        """The fraction of tiles skipped."""
        return float((self.kind == EMPTY).mean())

    @property
    def density(self) -> float:
        """The fraction of the dense attention work visited: tiles visited, each counting its in-range area."""
        bs = self.block_size
        rows = np.minimum(bs, self.seq_q - np.arange(self.kind.shape[1]) * bs)
        cols = np.minimum(bs, self.seq_k - np.arange(self.kind.shape[2]) * bs)
        area = rows[:, None] * cols[None, :]
        return float(((self.kind != EMPTY) * area).sum() / (area.sum() * self.batch))

    def to_dense(self, seq_q: int | None = None, seq_k: int | None = None) -> torch.Tensor:
        """The element mask, (batch, seq_q, seq_k) bool (batch 1 when shared)."""
        sq, sk = seq_q or self.seq_q, seq_k or self.seq_k
        if (sq, sk) != (self.seq_q, self.seq_k):
            raise GpuwiseError(f"the mask is for {self.seq_q} x {self.seq_k}, not {sq} x {sk}",
                               "build the mask for the sequence lengths of q and k")
        return torch.from_numpy(self._dense_numpy())

    def _dense_numpy(self) -> np.ndarray:
        """The element mask (batch, seq_q, seq_k) as a NumPy array (no torch: free under fake tensors)."""
        q, k = np.arange(self.seq_q)[:, None], np.arange(self.seq_k)[None, :]
        return np.stack([np.broadcast_to(np.asarray(self.rule(np.full((1, 1), b), q, k), bool),
                                         (self.seq_q, self.seq_k)) for b in range(self.batch)])

    @functools.cached_property
    def _numpy_tables(self) -> dict[str, np.ndarray]:
        kv = _ordered(self.kind, self.mask_id)
        qt = _ordered(self.kind.transpose(0, 2, 1), self.mask_id.transpose(0, 2, 1))
        return {"kv_num_blocks": kv[0], "full_kv_num_blocks": kv[1], "kv_indices": kv[2], "kv_mask_ids": kv[3],
                "q_num_blocks": qt[0], "full_q_num_blocks": qt[1], "q_indices": qt[2], "q_mask_ids": qt[3],
                "masks": self.masks.astype(np.int8)}

    def tables(self, device: torch.device | str = "cpu") -> Tables:
        """The int32 tables on ``device`` (cached per device)."""
        key = str(torch.device(device))
        cache = self.__dict__.setdefault("_device_tables", {})
        if key not in cache:
            cache[key] = Tables(**{name: torch.from_numpy(np.ascontiguousarray(a)).to(device)
                                   for name, a in self._numpy_tables.items()})
        return cache[key]

    def __repr__(self) -> str:
        return (f"BlockMask({self.seq_q}x{self.seq_k}, block {self.block_size}, batch {self.batch}, "
                f"sparsity {self.sparsity:.1%})")
