"""The built-in models' shapes, apart from their modules, so the zoo can be listed without torch.

Each model's file (gpt.py, llama.py, ...) builds its module from the config named after it here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int = 50257
    block_size: int = 1024  # learned positions, hence the longest sequence
    attn_impl: str = "sdpa"  # or "gpuwise": gpuwise.ops.attention (block-sparse FlashAttention in Triton)
    loss: str = "standard"  # or "chunked", "fused": the training loss's path (gpuwise.models.loss)


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    n_layer: int
    n_head: int
    n_kv_head: int
    dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attn_impl: str = "sdpa"  # or "gpuwise": gpuwise.ops.attention (block-sparse FlashAttention in Triton)
    loss: str = "standard"  # or "chunked", "fused": the training loss's path (gpuwise.models.loss)


@dataclass(frozen=True, kw_only=True)
class BertConfig:
    n_layer: int
    n_head: int
    hidden: int
    intermediate: int
    vocab_size: int = 30522
    max_positions: int = 512
    type_vocab_size: int = 2
    num_labels: int = 2
    eps: float = 1e-12
    attn_impl: str = "sdpa"  # or "eager": the math path (NVIDIA DeepLearningExamples' and HF's eager BERT)


@dataclass(frozen=True, kw_only=True)
class ViTConfig:
    n_layer: int
    n_head: int
    dim: int
    mlp_dim: int
    patch: int = 16
    image_size: int = 224  # sets the number of learned positions
    num_classes: int = 1000
    eps: float = 1e-6


@dataclass(frozen=True, kw_only=True)
class ResNetConfig:
    layers: tuple[int, ...] = (3, 4, 6, 3)
    num_classes: int = 1000


@dataclass(frozen=True, kw_only=True)
class MobileNetConfig:
    num_classes: int = 1000


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    n_layer: int = 4
    in_features: int = 1024
    hidden: int = 4096
    num_classes: int = 1000
