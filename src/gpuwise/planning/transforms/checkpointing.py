"""Activation checkpointing of every block, applied from outside as the real training script does: the whole block
recomputed in backward, or torchtitan's op-level selective policy (``selective_policy``)."""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from gpuwise.compat import TorchDispatchMode

aten = torch.ops.aten


def selective_save_list() -> frozenset:
    """The ops whose outputs torchtitan's selective policy keeps: ``_save_list`` in pytorch/torchtitan
    torchtitan/models/llama/parallelize_llama.py (Dec 2024, the revision behind docs/performance.md's Llama 3.1 8B
    figures): matmuls, flash and memory-efficient SDPA, reduce-scatter, and ``max`` (an fp8 scale's amax).

    Plus the CPU flash kernel: the planner runs on fake CPU tensors, where SDPA is
    ``_scaled_dot_product_flash_attention_for_cpu``, the stand-in for the GPU's flash kernel (tracker.py)."""
    ops = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention.default, aten.max.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default}
    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is not None and hasattr(c10d, "reduce_scatter_tensor"):
        ops.add(c10d.reduce_scatter_tensor.default)
    return frozenset(ops)


def selective_policy(decided: Callable[[bool], None] | None = None) -> Callable:
    """torchtitan's op-level policy for one block's forward (``_apply_ac_to_transformer_block``, mode "selective",
    option "op"): save the outputs of the ops in ``_save_list`` "except every second mm" (the 2nd, 4th, ... mm of the
    block, counted apart in forward and in recomputation), recompute the rest. A fresh count per call, as torchtitan
    makes a fresh ``meta = defaultdict(int)`` per ``context_fn`` call. ``decided(saved)`` hears each decision.

    In a Llama block (no biases, so every linear layer is an ``mm``) the saved outputs are wq, wv, w1 and w2 (the 1st,
    3rd, 5th and 7th mm: wq, wk, wv, wo, w1, w3, w2) and attention's output and logsumexp.

    Under --precision fp8 the planner's linear layers call ``_scaled_mm`` (transforms/float8.py) where torchao's reach
    the policy as an ``aten.mm`` on its float8 tensor subclass: counted and kept as one."""
    save_list = selective_save_list()
    matmuls = (aten.mm.default, aten._scaled_mm.default)
    counts: defaultdict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        mm = func in matmuls
        if mm:
            counts[mode] += 1
        save = (func in save_list or mm) and not (mm and counts[mode] % 2 == 0)
        if decided is not None and not ctx.is_recompute:
            decided(save)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _SavedOutputs(TorchDispatchMode):
    """Above selective checkpointing's caching mode in forward: hands ``on_saved`` the outputs the policy keeps (they
    are held by the checkpoint, not by autograd, so the planner's saved-tensor hook never sees them). The policy runs
    inside the op's call (before the op from torch 2.5, after it with ``op_output`` in later releases), so the
    decision is known when the op returns here."""

    def __init__(self, on_saved: Callable[[object], None]) -> None:
        super().__init__()
        self.on_saved = on_saved
        self.saved: bool | None = None

    def decided(self, saved: bool) -> None:
        self.saved = saved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.saved = None
        out = func(*args, **(kwargs or {}))
        if self.saved:
            self.on_saved(out)
        return out


@contextlib.contextmanager
def _entered(*contexts: AbstractContextManager) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


def apply_checkpointing(blocks: nn.ModuleList, recompute_context: Callable[[], AbstractContextManager] | None = None,
                        *, selective: bool = False, on_saved: Callable[[object], None] | None = None,
                        allow_mutation: bool = False) -> None:
    """Recompute every block in backward (non-reentrant ``torch.utils.checkpoint``): only each block's input is
    kept, or with ``selective`` also the outputs torchtitan's op-level policy saves (``selective_policy``).

    ``recompute_context`` makes the context the recomputation runs in (the planner's autocast); ``on_saved`` is
    handed each output the selective policy keeps (the planner tags them as activations); ``allow_mutation`` lets a
    simulated step update in place what the policy cached (the planner's ring attention under --cp accumulates into
    buffers; a simulated step's values do not matter), where torch has the switch (``allow_cache_entry_mutation``).
    """
    mutation = ({"allow_cache_entry_mutation": True} if allow_mutation and "allow_cache_entry_mutation"
                in inspect.signature(create_selective_checkpoint_contexts).parameters else {})

    def contexts():
        recompute = recompute_context() if recompute_context is not None else contextlib.nullcontext()
        if not selective:
            return contextlib.nullcontext(), recompute
        saved = _SavedOutputs(on_saved) if on_saved is not None else None
        forward, cached = create_selective_checkpoint_contexts(selective_policy(saved and saved.decided), **mutation)
        return (_entered(forward, saved) if saved is not None else forward), _entered(recompute, cached)

    plain = recompute_context is None and not selective
    for block in blocks:
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            if plain:
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, context_fn=contexts, **kwargs)

        block.forward = forward
