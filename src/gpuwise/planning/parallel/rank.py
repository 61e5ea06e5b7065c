"""What one GPU of a parallel run holds and runs: the model's checks for --tp, --pp, --cp, --sequence-parallel and
--ep, and the step cut to one rank (tensor.py, pipeline.py, context.py, expert.py)."""

from __future__ import annotations

import math

from gpuwise.errors import GpuwiseError
from gpuwise.planning.parallel.context import context_parallel
from gpuwise.planning.parallel.expert import check_experts, expert_parallel
from gpuwise.planning.parallel.pipeline import pipeline_stage
from gpuwise.planning.parallel.tensor import sequence_parallel, shard_tensor_parallel
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.base import Source


def check(source: Source, setup: Setup) -> None:
    """What the model must allow: blocks to split, heads that divide, as many layers as stages, experts to split.
    One line each."""
    check_experts(source, setup)
    if not setup.parallel:
        return
    flags = " ".join(f"--{k} {n}" for k, n in (("tp", setup.tp), ("pp", setup.pp), ("cp", setup.cp)) if n > 1)
    if source.n_layer is None:
        raise GpuwiseError(f"{flags} splits a stack of blocks, and {source.name} has none the planner can scale",
                           f"drop {flags}, or plan a built-in decoder or an --hf-config causal LM")
    if setup.pp > source.n_layer:
        raise GpuwiseError(f"--pp {setup.pp} is more stages than {source.name}'s {source.n_layer} layers",
                           f"pass --pp {source.n_layer} or less")
    if setup.cp > 1:
        seq = source.tokens(setup)
        if source.decoder is None:
            raise GpuwiseError(f"--cp {setup.cp} splits a causal LM's sequence; {source.name} is not one",
                               "drop --cp, or plan a built-in GPT/Llama or an --hf-config causal LM")
        if seq % (2 * setup.cp):
            raise GpuwiseError(f"--cp {setup.cp} does not split --seq {seq} into 2 x {setup.cp} equal chunks "
                               "(load-balanced ring attention)", f"pass a --seq that is a multiple of {2 * setup.cp}")
    if setup.sp:
        seq = source.tokens(setup)
        if (seq // setup.cp) % setup.tp:  # each context-parallel rank's s / cp tokens, split --tp ways
            step = math.lcm(setup.tp * setup.cp, 2 * setup.cp if setup.cp > 1 else 1)
            near = max(step, round(seq / step) * step)
            raise GpuwiseError(f"--sequence-parallel splits --seq {seq}"
                               + (f" / --cp {setup.cp}" if setup.cp > 1 else "")
                               + f" over --tp {setup.tp}, which does not divide it",
                               f"pass --seq {near} (a multiple of {step}), or drop --sequence-parallel")
    if setup.tp > 1:
        dec = source.decoder
        if dec is None:
            raise GpuwiseError(f"--tp {setup.tp} splits attention heads; {source.name} is not a decoder language model",
                               "drop --tp, or plan a built-in GPT/Llama or an --hf-config causal LM")
        for what, n in (("attention heads", dec.heads), ("key/value heads", dec.kv_heads)):
            if n % setup.tp:
                ok = [t for t in range(1, n + 1) if n % t == 0 and dec.heads % t == 0 and dec.kv_heads % t == 0]
                raise GpuwiseError(f"--tp {setup.tp} does not divide {source.name}'s {n} {what}",
                                   f"pass --tp {max(t for t in ok if t <= setup.tp)} (it divides: "
                                   f"{', '.join(map(str, ok))})")


def rank_step(built, setup: Setup):
    """``built`` (a source's Built, inside the fake mode) cut to what one GPU of ``setup`` runs."""
    if setup.ep > 1:
        ids = built.inputs[0] if built.inputs else None
        seq = ids.shape[1] // setup.cp if ids is not None and ids.dim() == 2 and not ids.is_floating_point() else None
        expert_parallel(built.model, setup, seq)
    if setup.tp > 1:
        shard_tensor_parallel(built.model, setup.tp)
        if setup.sp:
            sequence_parallel(built.model, setup.tp)
    if setup.pp > 1:
        built = pipeline_stage(built, setup.stage or 0, setup.pp)
    if setup.cp > 1:
        built = context_parallel(built, setup.cp)
    return built
