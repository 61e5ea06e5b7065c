"""Mixture-of-Experts routing on fake tensors: a balanced top-k stand-in for the router's data-dependent choice.

A router picks each token's top-k experts from values a fake tensor does not have. Most of transformers' expert
layers (``grouped_mm``) never read that choice back on the host: their memory and FLOPs are the same whichever
experts the tokens go to. Some do: DBRX and LongCat-Flash loop over the experts hit (``nonzero``, ``where``), JetMoE
splits the tokens by ``expert_size.tolist()``. There the planner needs the choice, and assumes a balanced one:
``topk`` on a fake tensor also yields concrete indices that send row r's j-th choice to expert (r k + j) mod E, so
every expert gets tokens x k / E of them (capacity factor 1, the auxiliary balancing loss' goal: Fedus et al. 2021,
Switch Transformer §2.2). The bookkeeping that follows (one-hot masks, sums, sorts, scatters) is run on those
concrete tensors alongside the fake ones, and an op that reads values (``nonzero``, ``.item()``) gets its answer
from them; activations indexed by such a boolean mask (``x[mask]``) get its true elements' indices. Tensors that
mix in activations have no concrete twin: a value read there fails as before.

Dense models that read a constant's value are recorded under the same mode, without a routing choice: then every
answer is exact (the twins are the constants' real values), and no stand-in is stated. Longformer reads
``attention_mask.any()`` of the all-ones mask it makes itself, X-MOD indexes activations by ``lang_ids == i`` of
the ids it fills from the default language.
"""

from __future__ import annotations

import weakref

import torch

from gpuwise.compat import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    TorchDispatchMode,
    _disable_current_modes,
    tree_leaves,
    tree_map,
)

ASSUMPTION = "balanced top-k: each expert gets tokens x top-k / experts (the router's choice is data-dependent)"
_SMALL = 1 << 22  # concrete twins of factory outputs (masks, counters) up to 4 M elements; larger ones never route
_FACTORIES = frozenset({"zeros", "ones", "full", "arange", "scalar_tensor", "zeros_like", "ones_like", "full_like",
                        "new_zeros", "new_ones", "new_full"})
aten = torch.ops.aten


def balanced_topk(shape: torch.Size, dim: int, experts: int, imbalance: float = 1.0) -> torch.Tensor:
    """Indices of shape ``shape`` (the k choices along ``dim``), row r's j-th being (r k + j) mod ``experts``.

    ``imbalance`` F > 1 (--moe-imbalance): expert 0 is the first choice of the first round(F x rows x k / experts)
    rows (F times its balanced share, at most every row), and the other choices go round the other experts, which
    share what is left evenly; a row's choices stay distinct."""
    dim = dim % len(shape) if len(shape) else 0
    moved = (*shape[:dim], *shape[dim + 1:], shape[dim]) if len(shape) else (1,)
    flat = torch.arange(int(torch.Size(moved).numel()), dtype=torch.int64) % max(experts, 1)
    k = moved[-1]
    if imbalance > 1 and experts > k and flat.numel():
        rows = flat.numel() // k
        hot = min(rows, round(imbalance * rows * k / experts))
        grid = torch.ones((rows, k), dtype=torch.bool)
        grid[:hot, 0] = False  # expert 0's slots
        flat = torch.zeros((rows, k), dtype=torch.int64)
        flat[grid] = 1 + torch.arange(int(grid.sum())) % (experts - 1)
        flat = flat.flatten()
    return flat.view(moved).movedim(-1, dim) if len(shape) else flat.view(())


class BalancedRouting(TorchDispatchMode):
    """Under a FakeTensorMode: give ``topk`` concrete balanced indices and carry them through the ops that follow, so
    that ops reading values (``nonzero``, ``_local_scalar_dense``) answer. ``used`` tells whether any did."""

    def __init__(self, imbalance: float = 1.0) -> None:
        super().__init__()
        self.imbalance = imbalance  # --moe-imbalance: the busiest expert's share over the balanced one
        # id(fake tensor) -> (weak ref to it, its concrete twin, derived from a routing choice); keyed by id, as a
        # tensor's == is elementwise
        self._twins: dict[int, tuple[weakref.ref, torch.Tensor, bool]] = {}
        self.used = False

    def _set(self, fake: torch.Tensor, twin: torch.Tensor, routing: bool) -> None:
        key = id(fake)
        self._twins[key] = (weakref.ref(fake, lambda _ref, key=key: self._twins.pop(key, None)), twin, routing)

    def _drop(self, fake: torch.Tensor) -> None:
        hit = self._twins.get(id(fake))
        if hit is not None and hit[0]() is fake:
            del self._twins[id(fake)]

    def _get(self, x: object) -> tuple[torch.Tensor, bool] | None:
        """(concrete twin, derived from a routing choice) of ``x``; a real tensor is its own (not routing)."""
        if not isinstance(x, torch.Tensor):
            return None
        if not isinstance(x, FakeTensor):
            return x, False
        hit = self._twins.get(id(x))
        return (hit[1], hit[2]) if hit is not None and hit[0]() is x else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        twins = [self._get(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        known = bool(twins) and all(tw is not None for tw in twins)
        routing = known and any(tw[1] for tw in twins)
        if known and name == "_local_scalar_dense":
            self.used |= routing
            with _disable_current_modes():
                return self._get(args[0])[0].item()
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            masked = self._mask_indices(name, args)
            if masked is not None:  # data without a twin indexed by a known boolean mask (X-MOD's language mask)
                self.used |= masked[1]
                return func(*masked[0], **kwargs)
            if not known:
                raise
            self.used |= routing
            real = self._run(func, args, kwargs)
            out = tree_map(lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype)
                           if isinstance(r, torch.Tensor) else r, real)
            self._pair(out, real, routing)
            return out
        outs = [t for t in tree_leaves(out) if isinstance(t, FakeTensor)]
        if name == "topk" and isinstance(out, tuple) and isinstance(out[1], FakeTensor):
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            experts = args[0].shape[dim] if args[0].dim() else 1
            with _disable_current_modes():
                self._set(out[1], balanced_topk(out[1].shape, dim, experts, self.imbalance), True)
        elif known and (routing or all(t.numel() <= _SMALL for t in outs)):
            self._pair(out, self._run(func, args, kwargs), routing)
        elif name in _FACTORIES and len(outs) == 1 and outs[0].numel() <= _SMALL:
            self._set(outs[0], self._constant(func, args, kwargs), False)
        else:
            for t in outs:  # written by an op whose inputs have no twin: its twin is stale
                self._drop(t)
        return out

    def _mask_indices(self, name: str, args: tuple) -> tuple[tuple, bool] | None:
        """``args`` of an indexing op (``x[mask]``, ``x[mask] = y``) with each boolean mask that has a twin replaced by
        the integer indices of its true elements (``mask.nonzero()``, as the op's own kernel computes them), so that
        the output's shape is known; and whether a mask came from a routing choice. None where the op is not one, or a
        mask has no twin."""
        if name not in ("index", "index_put", "index_put_", "_index_put_impl_") or len(args) < 2:
            return None
        indices, routing, changed = [], False, False
        for idx in args[1]:
            if isinstance(idx, torch.Tensor) and idx.dtype in (torch.bool, torch.uint8):
                hit = self._get(idx)
                if hit is None:
                    return None
                with _disable_current_modes():
                    indices.extend(hit[0].bool().nonzero().unbind(1))
                routing, changed = routing or hit[1], True
            else:
                indices.append(idx)
        return ((args[0], indices, *args[2:]), routing) if changed else None

    def _run(self, func, args, kwargs):
        """``func`` on the concrete twins, outside every mode (an in-place op updates the twin it writes)."""
        def real(x):
            hit = self._get(x)
            return hit[0] if hit is not None else x

        with _disable_current_modes():
            return func(*tree_map(real, args), **tree_map(real, kwargs))

    def _constant(self, func, args, kwargs) -> torch.Tensor:
        """A factory's output for real: ``*_like`` and ``new_*`` read only their input's shape and dtype."""
        def blank(x):
            if isinstance(x, FakeTensor):
                with _disable_current_modes():
                    return torch.empty(x.shape, dtype=x.dtype)
            return x

        with _disable_current_modes():
            return func(*tree_map(blank, args), **tree_map(blank, kwargs))

    def _pair(self, out, real, routing: bool) -> None:
        for fake, twin in zip(tree_leaves(out), tree_leaves(real), strict=False):
            if isinstance(fake, FakeTensor) and isinstance(twin, torch.Tensor):
                self._set(fake, twin, routing)
