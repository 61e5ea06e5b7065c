"""LoRA adapters (Hu et al. 2021) on the layers ``--lora-targets`` names (targets.py: the grammar), with
``--lora-dropout``, over a frozen base, 16-bit or in 4 bits (QLoRA: qlora.py); applied to the model from outside,
as PEFT does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuwise.errors import NotApplicable
from gpuwise.planning.transforms.qlora import Linear4bit
from gpuwise.planning.transforms.targets import SHORT_NAMES, target_items


class UnevenTargets(Exception):
    """The targets differ from block to block, so a capture of 2 and 3 blocks cannot stand for the stack."""


class LoRALinear(nn.Module):
    """y = base(x) + (dropout(x) A^T) B^T * alpha/r with the base frozen (Hu et al. 2021); B starts at zero.

    The dropout is PEFT's ``lora_dropout`` (peft/tuners/lora/layer.py): on the adapter's input only, so in
    training each adapted layer keeps its own mask and dropped copy of the input for the backward of A."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, rank: int, dtype: torch.dtype,
                 device: torch.device, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.empty(rank, in_features, dtype=dtype, device=device))
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.lora_a, a=5**0.5)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scale = 2.0  # alpha = 2r, a common choice; it does not change memory

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b) * self.scale


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` layers of ``model`` LoRA can wrap, by qualified name: not those ``nn.MultiheadAttention``
    reads the weight of directly (its out_proj)."""
    inside_mha = {f"{name}.{sub}" if name else sub for name, mod in model.named_modules()
                  if isinstance(mod, nn.MultiheadAttention) for sub, _ in mod.named_modules() if sub}
    return [(name, mod) for name, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and name and name not in inside_mha]


def _head(model: nn.Module, outside: list[tuple[str, nn.Linear]]) -> str | None:
    """The output head: Hugging Face's ``get_output_embeddings()``, else the last linear layer outside the blocks
    (a decoder's LM head, a classifier)."""
    get = getattr(model, "get_output_embeddings", None)
    emb = get() if callable(get) else None
    if emb is not None:
        return next((name for name, mod in outside if mod is emb), None)
    return outside[-1][0] if outside else None


def _prefix(model: nn.Module, blocks: nn.ModuleList | None) -> str | None:
    return next((name for name, mod in model.named_modules() if mod is blocks), None) if blocks is not None else None


def select_targets(model: nn.Module, blocks: nn.ModuleList | None, targets: str | None, *,
                   depth: int | None = None) -> tuple[list[str], set[str], str | None]:
    """(every linear layer's qualified name, the LoRA targets among them, the output head) for ``--lora-targets``
    ``targets`` (None: every linear layer in the blocks). ``depth``: the blocks of the full model when ``blocks`` holds
    fewer (a scaled capture); targets that differ between the blocks of the full model raise UnevenTargets."""
    found = _linears(model)
    linears = [name for name, _ in found]
    prefix = _prefix(model, blocks)
    outside = [n for n in linears if not (prefix and n.startswith(prefix + "."))]
    head = _head(model, [(n, m) for n, m in found if n in outside])
    if targets is None:
        return linears, {n for n in linears if n not in outside}, head
    n_blocks = len(blocks) if blocks is not None else 0
    depth = max(depth or n_blocks, n_blocks)
    # the full model's names: block 0's layers repeated for every block, and the layers outside the blocks
    inner = [n[len(prefix) + 1:].partition(".")[2] for n in linears if prefix and n.startswith(f"{prefix}.0.")]
    full = outside + [f"{prefix}.{i}.{r}" for i in range(depth) for r in inner]
    items = target_items(targets)
    chosen = {n for n in full if any(match(n, n == head) for _, match in items)}
    for item, match in items:
        if not any(match(n, n == head) for n in full):
            names = [f"{prefix}.N.{r}" for r in inner] + outside
            short = {r: k for r in inner for k, leaves in SHORT_NAMES.items() if r.rpartition(".")[2] in leaves}
            shown = ", ".join(f"{n} ({short[n.partition('.N.')[2]]})" if n.partition(".N.")[2] in short else n
                              for n in names)
            raise NotApplicable(f"--lora-targets {item!r} matches no linear layer of the model; its linear layers: "
                                f"{shown or 'none'}",
                                "name one (or its end, e.g. wq), a short name q,k,v,o,gate,up,down, all-linear, "
                                "a pattern such as '*.wq', or re:REGEX")
    for r in inner:
        hit = {i for i in range(depth) if f"{prefix}.{i}.{r}" in chosen}
        if hit and len(hit) < depth and n_blocks < depth:
            raise UnevenTargets(r)
    return linears, {n for n in linears if n in chosen}, head


def apply_lora(model: nn.Module, blocks: nn.ModuleList | None, *, rank: int, adapter_dtype: torch.dtype,
               quantize_base: bool, compute_dtype: torch.dtype, targets: str | None = None, dropout: float = 0.0,
               depth: int | None = None) -> int:
    """Freeze ``model`` and wrap the linear layers ``targets`` names (targets.py's grammar; None: every
    ``nn.Linear`` inside ``blocks``, the QLoRA paper's choice) with LoRA adapters; with ``quantize_base`` every
    linear layer but the output head is stored in 4 bits. Returns the frozen base parameters.

    A model it cannot adapt raises ``NotApplicable(message, hint)``: a remedy is skipped, a user's
    ``--task finetune-lora`` becomes a one-line error (``workload.simulate``). ``depth``: see ``select_targets``."""
    if targets is None and blocks is None:
        raise NotApplicable("--task finetune-lora: the model has no repeated blocks (an nn.ModuleList) to adapt",
                           "put the layers to fine-tune in an nn.ModuleList, or plan --task train")
    linears, chosen, head = select_targets(model, blocks, targets, depth=depth)
    if not chosen:
        raise NotApplicable("--task finetune-lora adapts the nn.Linear layers inside the blocks, and this model's "
                           "blocks have none", "plan --task train")
    model.requires_grad_(False)
    frozen = sum(p.numel() for p in model.parameters())
    for name in linears:
        lin = model.get_submodule(name)
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base: nn.Module = lin
        if quantize_base and name != head:
            frozen -= lin.weight.numel()
            base = Linear4bit(lin, compute_dtype)
        if name in chosen:
            base = LoRALinear(base, lin.in_features, lin.out_features, rank, adapter_dtype, lin.weight.device,
                              dropout)
        if base is not lin:
            setattr(parent, leaf, base)
    return frozen
