"""``attention(q, k, v, block_mask=..., causal=...)``: block-sparse FlashAttention, differentiable.

Where it runs:

- CUDA tensors with Triton installed, head_dim 64 or 128, fp16/bf16/fp32: the Triton kernels (``_kernels``);
- CPU tensors with ``TRITON_INTERPRET=1`` set before Triton was imported: the same kernels, interpreted;
- everything else (CPU, MPS, no Triton, other head dims): a PyTorch path with the same results (SDPA, with
  the BlockMask's dense element mask where it needs one; other head dims say so once in a warning).

Semantics shared by both paths: ``scale`` (a number, NumPy scalar or 0-d tensor, as SDPA takes) defaults to
``1/sqrt(head_dim)``; ``causal=True`` (or ``"upper_left"``) is ``BlockMask.causal`` top-left aligned, as SDPA's
``is_causal``; ``causal="lower_right"`` aligns the diagonal to the last key, as FlashAttention's ``causal=True``
and torch's ``CausalVariant.LOWER_RIGHT`` (a decode step over a KV cache: query i of seq_q sees keys up to
i + seq_k - seq_q); either is combined with ``block_mask`` by ``&`` when both are given; a query row with nothing
to attend to gives zeros (and zero gradients), never NaN; a zero-length query gives an empty output and no keys
give zeros, as SDPA; k and v may have fewer heads than q (grouped-query attention) when that number divides q's.

The PyTorch path runs SDPA: with no mask tensor for dense and top-left causal attention (its fused kernels),
otherwise with the BlockMask's dense element mask, built once per mask and device and kept in a cache of at
most ``MASK_CACHE_BYTES``.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import threading
import warnings
import weakref
from collections import OrderedDict
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from gpuwise.errors import GpuwiseError, first_line
from gpuwise.ops.block_mask import FULL, BlockMask, causal_variant
from gpuwise.units import MiB

KERNEL_HEAD_DIMS = (64, 128)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MASK_CACHE_BYTES = 256 * MiB  # the PyTorch path's dense masks, all devices: one 16k x 16k mask, or 16 at 4k


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    """The Triton kernels' module, or None and why not."""
    try:
        import gpuwise.ops._kernels as k
    except ImportError as exc:  # no Triton, or one that does not import (a broken install, a missing library)
        if isinstance(exc, ModuleNotFoundError) and exc.name == "triton":
            return None, "Triton is not installed (pip install triton)"
        return None, f"Triton does not import ({first_line(exc)})"
    import triton

    return k, f"Triton {triton.__version__}"


def _kernels() -> ModuleType | None:
    """The Triton module, or None when Triton cannot be imported (``kernel_status`` says why)."""
    return _load()[0]


@functools.cache
def _backend_error() -> str | None:
    """Why Triton cannot compile for this machine's GPU, or None when it can (its active driver loads)."""
    import triton

    try:
        triton.runtime.driver.active.get_current_target()
    except RuntimeError as exc:  # "0 active drivers ([]). There should only be one." without a GPU Triton knows
        return f"Triton has no usable GPU backend ({first_line(exc)})"
    return None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_status() -> tuple[bool, str]:
    """Whether ``attention`` runs the Triton kernels in this process (for head_dim 64 or 128), and why or why not.

    >>> kernel_status()  # doctest: +SKIP
    (False, 'Triton is not installed (pip install triton)')
    """
    kern, why = _load()
    if kern is None:
        return False, why
    if _interpreting():
        if not kern.INTERPRET:
            return False, f"TRITON_INTERPRET=1 was set after the kernels were imported: {why} compiles them"
        return True, f"{why} interprets them on the CPU (TRITON_INTERPRET=1: slow, for tests)"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA GPU (TRITON_INTERPRET=1 runs the kernels interpreted on the CPU)"
    if (error := _backend_error()) is not None:
        return False, error
    return True, f"{why} compiles them for {torch.cuda.get_device_name()}"


@functools.cache
def _warn_head_dim(d: int) -> None:
    warnings.warn(f"gpuwise.ops.attention: head_dim {d} has no kernel (64 and 128 do); using the PyTorch path",
                  stacklevel=3)


def uses_kernel(q: torch.Tensor) -> bool:
    """Whether ``attention`` would run the Triton kernels for tensors like ``q``."""
    if q.dtype not in _DTYPES or q.shape[-1] not in KERNEL_HEAD_DIMS:
        return False
    if q.device.type == "cuda":
        return _kernels() is not None and (_interpreting() or _backend_error() is None)
    if q.device.type != "cpu" or not _interpreting():
        return False
    kern = _kernels()
    return kern is not None and kern.INTERPRET  # interpreted only if TRITON_INTERPRET was set before the import


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """Attention in plain PyTorch: fp32 arithmetic (fp64 for fp64 inputs), a dense element mask
    (batch or 1, seq_q, seq_k), fully masked rows giving zeros with zero gradients."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q.to(compute) @ k.to(compute).transpose(-1, -2)) * scale
    if mask is None:
        p = torch.softmax(s, dim=-1)
    else:
        m = mask.to(s.device)[:, None]  # (batch or 1, 1, seq_q, seq_k)
        # a finite fill, not -inf: a row masked everywhere stays finite (uniform), then is zeroed by `has`
        p = torch.softmax(s.masked_fill(~m, torch.finfo(compute).min), dim=-1)
        p = p * (m.any(dim=-1, keepdim=True) & m)
    return (p @ v.to(compute)).to(q.dtype)


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask: BlockMask, scale: float):
        kern = _kernels()
        tables = mask.tables(q.device)
        o, lse = kern.forward(q, k, v, tables, mask, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mask, ctx.scale = mask, scale
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _kernels().backward(do, q, k, v, o, lse, ctx.mask.tables(q.device), ctx.mask, ctx.scale)
        return dq, dk, dv, None, None


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask | None) -> None:
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        raise GpuwiseError("q, k and v must be 4-D tensors (batch, heads, seq, head_dim)",
                           "reshape with .view(b, s, h, d).transpose(1, 2)")
    if not q.is_floating_point():
        raise GpuwiseError(f"q, k and v are {q.dtype}, not floating point", "pass bf16, fp16 or fp32 tensors")
    (b, h, sq, d), (bk, hk, sk, dk), (bv, hv, sv, dv) = q.shape, k.shape, v.shape
    if (bk, hk, sk, dk) != (bv, hv, sv, dv):
        raise GpuwiseError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ", "give k and v the same shape")
    if bk != b or dk != d:
        raise GpuwiseError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head_dim",
                           "give q, k and v the same batch and head_dim")
    if hk < 1 or h % hk:
        raise GpuwiseError(f"q has {h} heads, k and v {hk}: grouped-query attention needs a divisor",
                           "give k and v a number of heads that divides q's")
    if not (q.dtype == k.dtype == v.dtype):
        raise GpuwiseError(f"q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype} differ", "cast them to one dtype")
    if not (q.device == k.device == v.device):
        raise GpuwiseError("q, k and v are on different devices", "move them to one device")
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise GpuwiseError(f"block_mask is {type(block_mask).__name__}, not a gpuwise.ops.BlockMask",
                               "build one with BlockMask.causal, .sliding_window, .document or .from_dense")
        if (block_mask.seq_q, block_mask.seq_k) != (sq, sk):
            raise GpuwiseError(f"the block mask is for {block_mask.seq_q} x {block_mask.seq_k}, q and k are "
                               f"{sq} x {sk}", "build the mask for these sequence lengths")
        if block_mask.batch not in (1, b):
            raise GpuwiseError(f"the block mask has {block_mask.batch} batch rows, q has {b}",
                               "build it from doc_ids shaped (batch, seq), or (seq,) for all rows")


def _scale(scale, head_dim: int) -> float:
    """``scale`` as a float: a number, a NumPy scalar or a 0-d tensor or array without gradient (SDPA takes
    the first three)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    value = scale
    if isinstance(scale, torch.Tensor | np.ndarray):
        if scale.ndim != 0:
            raise GpuwiseError(f"scale has shape {tuple(scale.shape)}, not a single number",
                               "pass a float or a 0-d tensor, e.g. scale=0.125")
        if isinstance(scale, torch.Tensor) and scale.requires_grad:
            raise GpuwiseError("scale is a tensor that requires grad: attention does not differentiate through it",
                               "pass scale.item() (or scale.detach())")
        value = scale.item()
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise GpuwiseError(f"scale {scale!r} is not a number", "pass e.g. scale=0.125, or leave it out")
    if not math.isfinite(value):
        raise GpuwiseError(f"scale {value} is not finite", "pass e.g. scale=0.125, or leave it out")
    return float(value)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_mask: BlockMask | None = None,
              causal: bool | str = False, scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale, masked) v over (batch, heads, seq, head_dim), visiting only unmasked blocks.

    >>> out = attention(q, k_cache, v_cache, causal="lower_right")  # doctest: +SKIP  (decode over a KV cache)
    """
    _check(q, k, v, block_mask)
    variant = causal_variant(causal)
    sq, sk, d = q.shape[2], k.shape[2], q.shape[3]
    scale = _scale(scale, d)
    if sq == 0 or sk == 0:  # no mask can be built: SDPA's answers (an empty output; zeros for no keys)
        return reference(q, k, v, None, scale)
    if variant is not None and sq == sk:
        variant = "upper_left"  # the same mask: one cache entry, and SDPA's is_causal below
    mask = block_mask
    if variant is not None:
        mask = _causal(sq, sk, 128, variant) if block_mask is None else block_mask.with_causal(variant)
    kernel_shape = q.dtype in _DTYPES and d in KERNEL_HEAD_DIMS
    if _is_fake(q) and kernel_shape:  # inside the planner: an op costed from the visited tiles, with the
        out, _ = torch.ops.gpuwise.attention_cost(q, k, v, scale, 1.0 if mask is None else mask.density)
        return out  # kernel's memory (the PyTorch path below is costed as what it is)
    if uses_kernel(q):
        if mask is None:
            mask = _dense(sq, sk, 128)
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        return _BlockSparseAttention.apply(q, k, v, mask, scale)
    if q.shape[-1] not in KERNEL_HEAD_DIMS and (q.is_cuda or _interpreting()):
        _warn_head_dim(q.shape[-1])
    gqa = q.shape[1] != k.shape[1]
    if mask is None or (block_mask is None and variant == "upper_left") or bool((mask.kind == FULL).all()):
        # dense or top-left causal: SDPA's fused kernels, no mask tensor
        is_causal = block_mask is None and variant == "upper_left"
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    keep, rows = _MASKS.get(mask, q.device, cache=not _is_fake(q))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=gqa)
    return out if rows is None else torch.where(rows, out, 0.0)  # rows with nothing to attend to: zeros


class _MaskCache:
    """The PyTorch path's dense masks per (BlockMask, device), least recently used dropped past ``budget_bytes``.

    A BlockMask is immutable, so its identity and the device are the key; the entry holds a weak reference to
    the mask (a recycled ``id`` never matches) whose callback drops the entry when the mask is collected (or,
    when the collection happens while the cache is busy, at its next use). Each entry is ``keep`` (batch or 1,
    1, seq_q, seq_k) bool for SDPA, its rows with nothing to attend to opened (SDPA's backends do not all agree
    on those), and ``rows`` (batch or 1, 1, seq_q, 1), True where a row attends somewhere, or None when every
    row does. A mask larger than the budget is built for each call and not kept.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[tuple[int, str], tuple] = OrderedDict()  # key -> (ref, keep, rows, bytes)
        self._dead: list[tuple[tuple[int, str], weakref.ref]] = []  # collected while the lock was held
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            self._purge()
            return sum(entry[3] for entry in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            self._purge()
            return len(self._entries)

    def get(self, mask: BlockMask, device: torch.device, *, cache: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = (id(mask), str(device))
        with self._lock:
            self._purge()
            entry = self._entries.get(key)
            if entry is not None and entry[0]() is mask:
                self._entries.move_to_end(key)
                return entry[1], entry[2]
        # (batch or 1, seq_q, seq_k), evaluated once per mask, in NumPy (the planner's fake tensors hold no data)
        dense = mask._dense_numpy()
        rows = dense.any(-1, keepdims=True)
        keep = torch.from_numpy(dense | ~rows)[:, None].to(device)
        rows = None if rows.all() else torch.from_numpy(rows)[:, None].to(device)
        nbytes = keep.numel() + (0 if rows is None else rows.numel())
        if cache and nbytes <= self.budget_bytes:
            ref = weakref.ref(mask, functools.partial(self._collected, key))
            with self._lock:
                self._entries[key] = (ref, keep, rows, nbytes)
                total = sum(entry[3] for entry in self._entries.values())
                while total > self.budget_bytes:
                    total -= self._entries.popitem(last=False)[1][3]
        return keep, rows

    def _collected(self, key: tuple[int, str], ref: weakref.ref) -> None:
        self._dead.append((key, ref))
        if self._lock.acquire(blocking=False):  # busy (this thread or another): the next use purges it
            try:
                self._purge()
            finally:
                self._lock.release()

    def _purge(self) -> None:
        while self._dead:
            key, ref = self._dead.pop()
            if key in self._entries and self._entries[key][0] is ref:
                del self._entries[key]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._dead.clear()


_MASKS = _MaskCache(MASK_CACHE_BYTES)


@functools.lru_cache(maxsize=32)
def _causal(sq: int, sk: int, bs: int, variant: str = "upper_left") -> BlockMask:
    return BlockMask.causal(sq, sk, block_size=bs, variant=variant)


@functools.lru_cache(maxsize=32)
def _dense(sq: int, sk: int, bs: int) -> BlockMask:
    """Every tile full: built from the block table, not by evaluating every element."""
    return BlockMask.from_dense(torch.ones(-(-sq // bs), -(-sk // bs), dtype=torch.bool), bs, seq_q=sq, seq_k=sk)


def _is_fake(t: torch.Tensor) -> bool:
    from gpuwise.compat import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


# What the planner sees on fake tensors: the kernel's outputs (O in q's layout and an fp32 log-sum-exp per
# row, both kept for the backward) and, through ``density``, the FLOPs of the visited tiles only.
@torch.library.custom_op("gpuwise::attention_cost", mutates_args=())
def _attention_cost(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, density: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    raise GpuwiseError("gpuwise::attention_cost runs on fake tensors only", "call gpuwise.ops.attention")


@_attention_cost.register_fake
def _(q, k, v, scale, density):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("gpuwise::attention_cost_backward", mutates_args=())
def _attention_cost_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             o: torch.Tensor, lse: torch.Tensor, scale: float, density: float
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise GpuwiseError("gpuwise::attention_cost_backward runs on fake tensors only", "call gpuwise.ops.attention")


@_attention_cost_backward.register_fake
def _(do, q, k, v, o, lse, scale, density):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _cost_setup(ctx, inputs, output) -> None:
    q, k, v, scale, density = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale, ctx.density = scale, density


def _cost_backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.gpuwise.attention_cost_backward(do, q, k, v, o, lse, ctx.scale, ctx.density)
    return dq, dk, dv, None, None


_attention_cost.register_autograd(_cost_backward, setup_context=_cost_setup)
