"""Which modules are a Mixture of Experts' routed experts, and what they hold: the one rule the sources (their
``Experts``), quantisation (the fused expert weights bitsandbytes skips) and expert parallelism (the modules --ep and
--tp split) all read.

A module of routed experts is named ``experts`` (Mixtral's ``block_sparse_moe.experts``, transformers 5's stacked
``MixtralExperts``) or is of a class whose name ends ``Experts`` (JetMoE's ``JetMoeParallelExperts``); a module inside
another one is part of it. ``shared_experts`` are not routed: every token runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


def is_routed(name: str, module: nn.Module) -> bool:
    """Whether ``module`` (qualified ``name``) holds routed experts: named ``experts``, or a class ``...Experts``."""
    return name.rpartition(".")[2] == "experts" or type(module).__name__.endswith("Experts")


def routed_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every routed experts module of ``model``, outermost only (JetMoE's two expert
    linears are two; a stacked experts module's own children are part of it)."""
    found = [(name, m) for name, m in model.named_modules() if is_routed(name, m)]
    return [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found)]


def moe_layers(model: nn.Module) -> int:
    """The MoE layers of ``model``: modules holding routed experts (JetMoE's two expert linears count once)."""
    return len({name.rpartition(".")[0] for name, _ in routed_modules(model)})


def fused_expert_weights(root: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """(owner, name, parameter) of every routed-expert weight ``root`` holds as a plain ``nn.Parameter`` of two or
    more dimensions (transformers 5's ``[E, out, in]`` stacks, DBRX's ``[E x ffn, hidden]``), not in an
    ``nn.Linear``: what an ``nn.Linear`` walker (bitsandbytes) never sees. Biases are left out."""
    found, seen = [], set()
    for name, mod in root.named_modules():
        if not is_routed(name, mod):
            continue
        for sub in mod.modules():
            if isinstance(sub, nn.Linear):
                continue
            for pname, p in sub.named_parameters(recurse=False):
                if p.dim() >= 2 and "bias" not in pname and id(p) not in seen:
                    seen.add(id(p))
                    found.append((sub, pname, p))
    return found


@dataclass(frozen=True, kw_only=True)
class Experts:
    """A Mixture-of-Experts model's routed experts, read off the model built on the meta device.

    Active parameters, as Mixtral's model card counts its 12.9 B of 46.7 B: every parameter one token's forward
    touches, embeddings and LM head included (attention, norms, routers, shared experts, and ``top_k`` of the
    ``experts`` routed ones), i.e. all but ``(experts - top_k) / experts`` of the routed experts' weights."""

    experts: int  # routed experts per MoE layer
    top_k: int  # routed experts per token
    params: int  # all routed experts' parameters, every layer
    total: int  # the whole model's parameters
    layers: int = 0  # MoE layers (blocks holding routed experts): what --ep's all-to-alls run in
    hidden: int = 0  # the width of the tokens the experts take (the input embedding's): what the all-to-alls move
    # of ``params``, those held as plain (fused 3-D) parameters, not nn.Linear: what bitsandbytes skips (quantize.py)
    fused: int = 0

    @property
    def active(self) -> int:
        return self.total - self.params * (self.experts - self.top_k) // self.experts


# config.json keys of the routed experts (transformers' names, and the attribute maps' originals)
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_top_k", "num_selected_experts", "experts_per_token", "top_k")


def experts_of(config: Any, model: nn.Module) -> Experts | None:
    """The routed experts of ``model`` (``routed_modules``; ``shared_experts`` are always active) and their count and
    top-k from ``config`` (or its ``ffn_config``, DBRX's); None for a dense model."""
    outer = [name for name, _ in routed_modules(model)]
    params = sum(p.numel() for name, p in model.named_parameters()
                 if any(name.startswith(prefix + ".") for prefix in outer))
    if not params:
        return None
    found = {}
    for part in (config, getattr(config, "ffn_config", None)):
        for kind, keys in (("experts", _EXPERT_KEYS), ("top_k", _TOP_K_KEYS)):
            for key in keys:
                value = part.get(key) if isinstance(part, dict) else getattr(part, key, None)
                if kind not in found and isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    found[kind] = value
    if len(found) < 2 or found["top_k"] > found["experts"]:
        return None
    emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    return Experts(experts=found["experts"], top_k=found["top_k"], params=params,
                   total=sum(p.numel() for p in model.parameters()),
                   layers=moe_layers(model),
                   hidden=getattr(emb, "embedding_dim", 0) if isinstance(emb, nn.Embedding) else 0,
                   fused=sum(p.numel() for _, _, p in fused_expert_weights(model)))
