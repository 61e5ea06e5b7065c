"""The built-in model zoo: plain ``nn.Module`` s with the published shapes, looked up by name.

>>> from gpuwise.models import get_model
>>> get_model("gpt2").published_params
124439808
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from gpuwise.errors import GpuwiseError
from gpuwise.models.configs import (
    BertConfig,
    GPTConfig,
    LlamaConfig,
    MLPConfig,
    MobileNetConfig,
    ResNetConfig,
    ViTConfig,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

InputKind = Literal["tokens", "image", "features"]


@dataclass(frozen=True, kw_only=True)
class ZooModel:
    """One built-in model: how to build it, what it eats, and the parameter count its authors publish."""

    name: str
    family: str  # "decoder" models take a KV cache when planned for inference
    config: Any
    module: str  # "gpt:GPT": the nn.Module class in gpuwise.models.gpt that builds it (imported on first use)
    inputs: InputKind
    default_seq: int | None = None  # tokens, for "tokens" models
    max_seq: int | None = None  # learned positions cap the sequence
    default_image_size: int | None = None
    published_params: int
    source: str
    hub_id: str | None = None  # the Hugging Face repo of the same model (what vllm serve and --hf-config take)

    @property
    def n_layer(self) -> int | None:
        """Identical blocks, when the model is a stack of them (the planner captures two and three, then scales)."""
        return getattr(self.config, "n_layer", None)

    def build(self, config: Any) -> nn.Module:
        file, cls = self.module.split(":")
        return getattr(importlib.import_module(f"gpuwise.models.{file}"), cls)(config)

    def instantiate(self, n_layer: int | None = None) -> nn.Module:
        cfg = self.config if n_layer is None else replace(self.config, n_layer=n_layer)
        return self.build(cfg)

    def make_inputs(
        self, batch: int, *, seq: int | None, image_size: int | None, dtype: torch.dtype
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Random inputs and targets of the right shapes (inside a fake mode they cost nothing)."""
        import torch

        cfg = self.config
        if self.inputs == "tokens":
            t = seq or self.default_seq
            idx = torch.randint(cfg.vocab_size, (batch, t))
            if self.family == "decoder":
                return (idx,), torch.randint(cfg.vocab_size, (batch, t))
            return (idx,), torch.randint(cfg.num_labels, (batch,))
        if self.inputs == "image":
            s = image_size or self.default_image_size
            return (torch.randn(batch, 3, s, s, dtype=dtype),), torch.randint(cfg.num_classes, (batch,))
        return (torch.randn(batch, cfg.in_features, dtype=dtype),), torch.randint(cfg.num_classes, (batch,))


def _gpt2(name: str, n_layer: int, n_head: int, n_embd: int, params: int) -> ZooModel:
    return ZooModel(
        name=name, family="decoder", config=GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd), module="gpt:GPT",
        inputs="tokens", default_seq=1024, max_seq=1024, published_params=params, hub_id=f"openai-community/{name}",
        source="Radford et al. 2019, GPT-2 model card; counts as karpathy/nanoGPT prints them (tied head)",
    )


def _llama(name: str, cfg: LlamaConfig, seq: int, params: int, source: str, hub_id: str) -> ZooModel:
    return ZooModel(
        name=name, family="decoder", config=cfg, module="llama:Llama", inputs="tokens", default_seq=seq,
        published_params=params, source=source, hub_id=hub_id,
    )


_L2 = "Touvron et al. 2023 (Llama 2), meta-llama/Llama-2-*-hf config.json; count as the safetensors index reports"
_L3 = "Meta Llama 3 / 3.2 model cards, meta-llama/*/config.json; count as the safetensors index reports"

MODELS: dict[str, ZooModel] = {m.name: m for m in (
    _gpt2("gpt2", 12, 12, 768, 124_439_808),
    _gpt2("gpt2-medium", 24, 16, 1024, 354_823_168),
    _gpt2("gpt2-large", 36, 20, 1280, 774_030_080),
    _gpt2("gpt2-xl", 48, 25, 1600, 1_557_611_200),
    _llama("llama3.2-1b", LlamaConfig(n_layer=16, n_head=32, n_kv_head=8, dim=2048, ffn_dim=8192, vocab_size=128256,
                                      rope_theta=500000.0, tie_embeddings=True), 8192, 1_235_814_400, _L3,
           "meta-llama/Llama-3.2-1B"),
    _llama("llama3.2-3b", LlamaConfig(n_layer=28, n_head=24, n_kv_head=8, dim=3072, ffn_dim=8192, vocab_size=128256,
                                      rope_theta=500000.0, tie_embeddings=True), 8192, 3_212_749_824, _L3,
           "meta-llama/Llama-3.2-3B"),
    _llama("llama2-7b", LlamaConfig(n_layer=32, n_head=32, n_kv_head=32, dim=4096, ffn_dim=11008, vocab_size=32000),
           4096, 6_738_415_616, _L2, "meta-llama/Llama-2-7b-hf"),
    _llama("llama3-8b", LlamaConfig(n_layer=32, n_head=32, n_kv_head=8, dim=4096, ffn_dim=14336, vocab_size=128256,
                                    rope_theta=500000.0), 8192, 8_030_261_248, _L3, "meta-llama/Meta-Llama-3-8B"),
    _llama("llama2-13b", LlamaConfig(n_layer=40, n_head=40, n_kv_head=40, dim=5120, ffn_dim=13824, vocab_size=32000),
           4096, 13_015_864_320, _L2, "meta-llama/Llama-2-13b-hf"),
    _llama("llama2-70b", LlamaConfig(n_layer=80, n_head=64, n_kv_head=8, dim=8192, ffn_dim=28672, vocab_size=32000),
           4096, 68_976_648_192, _L2, "meta-llama/Llama-2-70b-hf"),
    ZooModel(name="bert-base", family="encoder",
             config=BertConfig(n_layer=12, n_head=12, hidden=768, intermediate=3072), module="bert:Bert",
             inputs="tokens", default_seq=512, max_seq=512, published_params=109_482_240 + 768 * 2 + 2,
             source="Devlin et al. 2019; bert-base-uncased BertModel 109,482,240 + a 2-class head (1,538)"),
    ZooModel(name="bert-large", family="encoder",
             config=BertConfig(n_layer=24, n_head=16, hidden=1024, intermediate=4096), module="bert:Bert",
             inputs="tokens",
             default_seq=512, max_seq=512, published_params=335_141_888 + 1024 * 2 + 2,
             source="Devlin et al. 2019; bert-large-uncased BertModel 335,141,888 + a 2-class head (2,050)"),
    ZooModel(name="vit-b16", family="vision", config=ViTConfig(n_layer=12, n_head=12, dim=768, mlp_dim=3072),
             module="vit:ViT", inputs="image", default_image_size=224, published_params=86_567_656,
             source="Dosovitskiy et al. 2021; timm vit_base_patch16_224"),
    ZooModel(name="vit-l16", family="vision", config=ViTConfig(n_layer=24, n_head=16, dim=1024, mlp_dim=4096),
             module="vit:ViT", inputs="image", default_image_size=224, published_params=304_326_632,
             source="Dosovitskiy et al. 2021; timm vit_large_patch16_224"),
    ZooModel(name="resnet50", family="vision", config=ResNetConfig(), module="resnet:ResNet", inputs="image",
             default_image_size=224, published_params=25_557_032, source="He et al. 2016; torchvision resnet50"),
    ZooModel(name="mobilenet-v2", family="vision", config=MobileNetConfig(), module="mobilenet:MobileNetV2",
             inputs="image",
             default_image_size=224, published_params=3_504_872,
             source="Sandler et al. 2018; torchvision mobilenet_v2 (3,504,872 parameters)"),
    ZooModel(name="mlp", family="mlp", config=MLPConfig(), module="mlp:MLP", inputs="features",
             published_params=1024 * 4096 + 4096 + 4 * (4096 * 4096 + 4096) + 4096 * 1000 + 1000,
             source="gpuwise's own: 1024 -> 4 x 4096 -> 1000, GELU"),
)}


def get_model(name: str) -> ZooModel:
    """The built-in model called ``name``; an unknown name lists the closest ones."""
    key = name.strip().lower()
    if key in MODELS:
        return MODELS[key]
    close = difflib.get_close_matches(key, MODELS, n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}?" if close else "see `gpuwise plan --list-models`"
    raise GpuwiseError(f"unknown model {name!r}", hint)
