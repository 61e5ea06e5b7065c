"""The KV cache one sequence holds: read off the model's own captured decode step (``gpuwise plan --task decode``),
so every layer holds what it really caches. A sliding-window layer (Gemma-2/3, Mistral) keeps min(context, window)
tokens, multi-head latent attention (DeepSeek) its latent, a hybrid (Jamba, Qwen3-Next) its attention layers' K and V
and its other layers' states, as transformers' own cache holds them. The dense formula
(``serving.kv_bytes_per_token``: every layer holds K and V of every token) is only the fallback for a model whose
decode step cannot be captured, and says so.

``plan --task decode`` and ``recommend --serve`` both take the figure from ``DecodeRead.of`` (one captured step);
``--kv-dtype`` (vLLM's ``--kv-cache-dtype``) stores the cache in other bytes: the captured cache, held in the dtype
the step computes in, scaled by the ratio of the two itemsizes (``stored_as``).

>>> kv = sequence_kv(Planner(resolve_source("llama3-8b", None)), decoder, context=4096)   # doctest: +SKIP
>>> kv.bytes, kv.captured                      # 2 x 32 layers x 8 heads x 128 x 4096 tokens x 2 B   # doctest: +SKIP
(536870912, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from gpuwise.errors import GpuwiseError, NotApplicable
from gpuwise.planning.capture.tracker import CATEGORIES
from gpuwise.planning.setup import Setup

if TYPE_CHECKING:  # loads torch
    from gpuwise.planning.parallel.sharding import PerGpu

# Bytes an element of the cache takes (None: the dtype the step computes in, vLLM's "auto": the model's dtype).
# vLLM's fp8 is fp8_e4m3 on CUDA (docs.vllm.ai, "FP8 E4M3 KV Cache"; CacheConfig.cache_dtype)
KV_BYTES: dict[str, int | None] = {"auto": None, "bf16": 2, "fp16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
# the value of vLLM's --kv-cache-dtype for each (vllm/config/cache.py CacheDType: auto, fp8, fp8_e4m3, fp8_e5m2): a
# 16-bit cache is vLLM's auto, the model's dtype (serving computes in bf16)
VLLM_KV_CACHE_DTYPE = {"auto": "auto", "bf16": "auto", "fp16": "auto", "fp8": "fp8", "fp8_e4m3": "fp8_e4m3",
                       "fp8_e5m2": "fp8_e5m2"}
KV = CATEGORIES.index("kv_cache")


def kv_itemsize(kv_dtype: str | None, computed: int) -> int:
    """Bytes an element of a ``kv_dtype`` cache takes, where the step computes in ``computed``-byte elements."""
    if kv_dtype is not None and kv_dtype not in KV_BYTES:
        raise GpuwiseError(f"--kv-dtype {kv_dtype!r} is not one of {', '.join(KV_BYTES)}", "pass --kv-dtype fp8")
    return KV_BYTES.get(kv_dtype or "auto") or computed


def stored_as(step: PerGpu, setup: Setup) -> PerGpu:
    """``step`` (captured with its cache in the compute dtype) with the cache stored as ``setup.kv_dtype``: the
    timeline's kv_cache column scaled by the itemsizes' ratio, so the peak, the fit, the largest batch and the bytes a
    step reads all follow; the op-by-op time still reads a 16-bit cache. ``setup`` is ``step``'s with ``kv_dtype``."""
    computed = step.setup.compute_dtype.itemsize
    ratio = kv_itemsize(setup.kv_dtype, computed) / computed
    if ratio == 1:
        return replace(step, setup=setup)

    def scaled(x):
        x = x.astype("float64", copy=True)
        x[..., KV] *= ratio
        return x

    def timeline(tl):
        return None if tl is None else replace(tl, base=scaled(tl.base), slope=scaled(tl.slope))

    live = scaled(step.live)
    return replace(step, setup=setup, timeline=timeline(step.timeline), batch_model=timeline(step.batch_model),
                   live=live, peak_bytes=int(live.sum(axis=1).max()))


@dataclass(frozen=True, kw_only=True)
class SequenceKV:
    """One sequence's KV cache at ``context`` tokens, the whole model on one GPU.

    ``shared``: cached whole on every GPU of a tensor-parallel group (MLA's latent is one per token, not per
    head); else each GPU holds its KV heads' share, ceil(kv_heads / n) of ``kv_heads`` (a head is never split: below
    one a GPU it is replicated, as vLLM does)."""

    bytes: int
    context: int
    kv_dtype: str  # as vLLM names it: auto (the model's dtype), fp8, fp8_e4m3, fp8_e5m2
    itemsize: int
    captured: bool  # False: the dense formula, where no decode step could be captured
    kv_heads: int
    shared: bool
    basis: str

    def per_gpu(self, n: int) -> float:
        """Bytes one GPU of ``n`` (tensor parallel) holds for the sequence."""
        if self.shared or n == 1:
            return float(self.bytes)
        return self.bytes * math.ceil(self.kv_heads / n) / self.kv_heads


class Captures(Protocol):
    """What ``sequence_kv`` needs of a planner.Planner (which imports this module): one GPU's captured step."""

    def per_gpu(self, setup: Setup) -> PerGpu: ...


def sequence_kv(planner: Captures, dims, *, context: int, kv_dtype: str | None = None) -> SequenceKV:
    """The KV cache one sequence holds at ``context`` tokens: the last step of its generation captured (``context``
    - 1 tokens cached and the new one, one sequence, bf16), as ``gpuwise plan --task decode`` captures it; the dense
    formula from ``dims`` (sources.base.Decoder) where the model has no decode step to capture."""
    from gpuwise.planning.cost.serving import DecodeRead, kv_bytes_per_token

    size = kv_itemsize(kv_dtype, 2)
    vllm = VLLM_KV_CACHE_DTYPE[kv_dtype or "auto"]
    latent = getattr(dims, "kv_latent", 0)
    common = {"context": context, "kv_dtype": vllm, "itemsize": size, "kv_heads": dims.kv_heads, "shared": bool(latent)}
    setup = Setup(task="decode", micro_batch=1, context=max(context - 1, 1), precision="bf16", kv_dtype=kv_dtype)
    try:
        read = DecodeRead.of(planner.per_gpu(setup))
    except (GpuwiseError, NotApplicable) as exc:
        why = exc.message if isinstance(exc, GpuwiseError) else exc.args[0]
        per_token = kv_bytes_per_token(layers=dims.layers, kv_heads=dims.kv_heads, head_dim=dims.head_dim,
                                       kv_bytes=size, latent=latent)
        formula = (f"{dims.layers} layers x {latent} latent" if latent else
                   f"2 x {dims.layers} layers x {dims.kv_heads} KV heads x {dims.head_dim}")
        return SequenceKV(bytes=per_token * context, captured=False, **common,
                          basis=f"dense formula, {formula} x {size} B x {context:,} tokens (every layer holds every "
                                f"token; sliding windows and hybrid layers not seen): no decode step captured ({why})")
    return SequenceKV(bytes=read.kv_bytes_per_seq, captured=True, **common,
                      basis=f"captured: the model's own cache after a decode step at {context:,} tokens "
                            f"({vllm} KV cache, {size} B an element; gpuwise plan --task decode --context "
                            f"{setup.context})")
