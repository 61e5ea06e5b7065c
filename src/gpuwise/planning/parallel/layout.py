"""How a run's GPUs split the work, as the plan reports it (``Layout``), and what the kinds of parallelism share: the
blocks a pipeline stage holds and the micro-batches it keeps in flight (1F1B, pipeline.py), and the names of a
decoder's ends (embeddings, final norm, head) that tensor and pipeline parallelism cut or move.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from gpuwise.planning.setup import Setup

# (embeddings, final norm, head) of the built-in decoders; Hugging Face models say theirs themselves
_ENDS = {"Llama": (("tok_embeddings",), "norm", "output"), "GPT": (("wte", "wpe"), "ln_f", "lm_head")}
_FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm")


def stage_layers(n_layer: int, setup: Setup) -> int:
    """Blocks on ``setup.stage`` (the first stages take one more when ``pp`` does not divide the layers)."""
    stage = setup.stage or 0
    return n_layer // setup.pp + (1 if stage < n_layer % setup.pp else 0)


def in_flight_micro_batches(setup: Setup) -> int:
    """Micro-batches whose activations stage ``setup.stage`` holds at once under 1F1B: ``pp - stage`` (the
    warm-up forwards before its first backward), at most the micro-batches of a step (``grad_accum``)."""
    if setup.pp == 1:
        return 1
    return max(1, min(setup.pp - (setup.stage or 0), setup.grad_accum))


def ends(model: nn.Module) -> tuple[tuple[str, ...], str | None, str | None]:
    """Qualified names of the embedding(s), the final norm and the head of a decoder LM."""
    if type(model).__name__ in _ENDS:
        return _ENDS[type(model).__name__]
    names = {id(m): n for n, m in model.named_modules()}
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    emb = names.get(id(get_in())) if callable(get_in) else None
    head = names.get(id(get_out())) if callable(get_out) and get_out() is not None else None
    base = emb.rsplit(".", 1)[0] + "." if emb and "." in emb else ""
    norm = next((base + n for n in _FINAL_NORMS if base + n in dict(model.named_modules())), None)
    return ((emb,) if emb else ()), norm, head


def swap(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where ``model``'s module ``name`` was."""
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)



@dataclass(frozen=True, kw_only=True)
class Layout:
    """How the run's GPUs split the work, as the plan reports it."""

    gpus: int
    dp: int  # data-parallel degree: gpus / (tp x pp x cp)
    tp: int
    pp: int
    cp: int
    nodes: int
    shard_gpus: int  # the GPUs the model states are sharded over (within a node under HSDP)
    stage: int | None  # the pipeline stage the plan's memory is of (the worst), None without --pp
    stage_layers: int | None  # its blocks
    in_flight: int  # micro-batches whose activations that stage holds at once (1F1B)
    bubble: float  # the 1F1B pipeline's idle fraction, (pp - 1) / (m + pp - 1)
    offload: str
    host_bytes: int  # host memory per GPU for the offloaded state
    host_bytes_per_node: int | None  # with --nodes: host_bytes x the GPUs of one node
    sharding: str = "ddp"  # how the model states are split over the shard_gpus (--sharding)
    ep: int = 1  # expert-parallel degree: each GPU holds experts / ep of every MoE layer's routed experts


def layout(setup: Setup, n_layer: int | None, host_bytes: int) -> Layout:
    per_node = setup.gpus // setup.nodes if setup.nodes > 1 else None
    return Layout(gpus=setup.gpus, dp=setup.dp, tp=setup.tp, pp=setup.pp, cp=setup.cp, nodes=setup.nodes,
                  shard_gpus=setup.shard_gpus, stage=setup.stage if setup.pp > 1 else None,
                  stage_layers=stage_layers(n_layer, setup) if setup.pp > 1 and n_layer else None,
                  in_flight=in_flight_micro_batches(setup), bubble=setup.pipeline_bubble,
                  offload=setup.offload, host_bytes=host_bytes, sharding=setup.sharding, ep=setup.ep,
                  host_bytes_per_node=None if per_node is None else host_bytes * per_node)
