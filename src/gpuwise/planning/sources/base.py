"""What the capture needs from a model's origin: the ``Source`` protocol and the ``Built`` step a source hands it.

Every source builds *inside* the fake mode, so nothing is allocated and nothing is downloaded. The sources: the
built-in zoo (zoo.py), a user's ``file.py:function`` (file.py), a model factory (factory.py), a Hugging Face
config.json (hf.py); resolve.py picks the one the command line names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from gpuwise.errors import GpuwiseError
from gpuwise.planning.setup import Setup


@dataclass(frozen=True, kw_only=True)
class Decoder:
    """What decode speed depends on besides the weights: the KV cache's shape per token, and the query heads.

    Multi-head latent attention (DeepSeek-V2/V3, ``kv_lora_rank`` in config.json) caches no K and V per head: each
    token's compressed latent (``kv_lora_rank``) and its one shared rotary key (``qk_rope_head_dim``) a layer,
    ``kv_latent`` elements (576 for DeepSeek-V3). transformers 5 caches exactly these (``DeepseekV3Attention``:
    ``cache.update(kv_nope, k_rot)``, each a single-head tensor, decompressed into per-head K and V by ``kv_b_proj``
    after the read), and so do vLLM and SGLang (their MLA backends, one 576-wide entry a token a layer); under tensor
    parallelism every GPU holds the whole latent (one "KV head", not split)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    kv_latent: int = 0  # MLA: elements cached per token per layer (kv_lora_rank + qk_rope_head_dim); 0: K and V a head


@dataclass(frozen=True, kw_only=True)
class Built:
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    targets: torch.Tensor | None
    run: Callable[..., torch.Tensor]  # run(model, inputs, targets, kv_cache) -> loss (training) or output
    kv_cache_shape: tuple[int, ...] | None = None  # per block, for decoder inference
    # the KV cache a model allocates itself while it runs (transformers' cache classes): its tensors in the output
    cache_tensors: Callable[[Any], list[torch.Tensor]] | None = None
    # --task decode: the cache a step starts from (transformers' DynamicCache), asked for when the step starts: the
    # Built holds no reference, so the tensors a DynamicCache replaces while it runs are freed as on the GPU
    kv_filled: Callable[[], list[torch.Tensor]] | None = None


def scalar_loss(out: Any) -> torch.Tensor:
    """The user's loss: the output itself if it is a scalar, else output.float().square().mean()."""
    if hasattr(out, "loss") and isinstance(out.loss, torch.Tensor):
        return out.loss
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise GpuwiseError(f"the model returned {type(out).__name__}, not a tensor",
                           "return a tensor (or a tuple whose first item is one) from forward")
    return out if out.dim() == 0 else out.float().square().mean()


def check_decode(name: str, decoder: bool, context: int, positions: int | None) -> None:
    """--task decode: a decoder language model, with room for the cached tokens and the new one."""
    if not decoder:
        raise GpuwiseError(f"--task decode generates tokens with a decoder language model; {name} is not one",
                           "plan --task infer")
    if positions is not None and context + 1 > positions:
        raise GpuwiseError(f"--context {context} plus the token the step adds is more than {name}'s {positions} "
                           "positions", f"pass --context {positions - 1} or less")


class Source(Protocol):
    """What the capture needs from a model's origin: a name for messages, what a setup may ask of it (``check``), the
    tokens a micro-batch element holds, and the step it builds inside the fake mode (``build``).

    >>> from gpuwise.planning.sources.resolve import resolve_source
    >>> resolve_source("gpt2", None).n_layer
    12
    """

    @property
    def name(self) -> str: ...

    @property
    def n_layer(self) -> int | None:
        """The blocks of its stack, where a capture of a few stands for them all; None: captured whole."""

    @property
    def layer_kinds(self) -> tuple[int, ...] | None:
        """Which blocks are alike (capture/blocks.py); None: all alike, or not known."""

    @property
    def decoder(self) -> Decoder | None:
        """The KV-cache dimensions of a decoder language model; None for the others."""

    @property
    def max_positions(self) -> int | None:
        """The longest sequence its positions allow; None: no limit known."""

    def check(self, setup: Setup) -> None:
        """Raise GpuwiseError (message, the flag that fixes it) for a setup this model cannot take."""

    def tokens(self, setup: Setup) -> int:
        """Tokens (or images, or samples) per micro-batch element."""

    def build(self, setup: Setup, batch: int, n_layer: int | None) -> Built:
        """The model (its first ``n_layer`` blocks, if given), its inputs and its step, built on fake tensors."""
