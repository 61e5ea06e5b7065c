"""The zoo: parameter counts as published, and each family runs for real on small shapes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gpuwise.errors import GpuwiseError
from gpuwise.models import MODELS, get_model
from gpuwise.models.bert import BertConfig
from gpuwise.models.gpt import GPTConfig
from gpuwise.models.llama import LlamaConfig
from gpuwise.models.mlp import MLPConfig
from gpuwise.models.vit import ViTConfig

# The figures the issue names, from the model cards / papers; the rest are in the registry with sources.
PUBLISHED = {"gpt2": 124_439_808, "llama2-7b": 6_738_415_616, "llama3-8b": 8_030_261_248}


def test_every_builtin_is_listed():
    assert list(MODELS) == ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama3.2-1b", "llama3.2-3b",
                            "llama2-7b", "llama3-8b", "llama2-13b", "llama2-70b", "bert-base", "bert-large",
                            "vit-b16", "vit-l16", "resnet50", "mobilenet-v2", "mlp"]


@pytest.mark.parametrize("name", list(MODELS))
def test_parameter_count_of_the_module_equals_the_published_figure(name):
    zoo = get_model(name)
    with torch.device("meta"):
        model = zoo.instantiate()
    assert sum(p.numel() for p in model.parameters()) == zoo.published_params
    if name in PUBLISHED:
        assert zoo.published_params == PUBLISHED[name]


SMALL = {
    "gpt2": GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=97, block_size=64),
    "llama3-8b": LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, dim=32, ffn_dim=64, vocab_size=97),
    "bert-base": BertConfig(n_layer=2, n_head=2, hidden=32, intermediate=64, vocab_size=97),
    "vit-b16": ViTConfig(n_layer=2, n_head=2, dim=32, mlp_dim=64, image_size=32),
    "mlp": MLPConfig(n_layer=2, in_features=16, hidden=32, num_classes=5),
}


@pytest.mark.parametrize("name", [*SMALL, "resnet50"])
def test_each_family_trains_for_real_on_small_shapes(name):
    zoo = get_model(name)
    if name in SMALL:
        zoo = replace(zoo, config=SMALL[name], default_image_size=32 if name == "vit-b16" else zoo.default_image_size)
    torch.manual_seed(0)
    model = zoo.instantiate()
    inputs, targets = zoo.make_inputs(2, seq=16, image_size=32 if zoo.inputs == "image" else None,
                                      dtype=torch.float32)
    loss = model(*inputs, targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_llama_gqa_matches_repeated_heads():
    """Grouped-query attention through SDPA's enable_gqa equals repeating K and V per query head."""
    cfg = SMALL["llama3-8b"]
    torch.manual_seed(0)
    model = replace(get_model("llama3-8b"), config=cfg).instantiate()
    (idx,), _ = get_model("llama3-8b").make_inputs(2, seq=8, image_size=None, dtype=torch.float32)
    idx = idx % cfg.vocab_size
    attn = model.blocks[0].attention
    x = model.tok_embeddings(idx)
    cos, sin = model.rope(8, x.device)
    from gpuwise.models.llama import rotate

    b, t, _ = x.shape
    q = rotate(attn.wq(x).view(b, t, 4, 8).transpose(1, 2), cos, sin)
    k = rotate(attn.wk(x).view(b, t, 2, 8).transpose(1, 2), cos, sin).repeat_interleave(2, dim=1)
    v = attn.wv(x).view(b, t, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = attn.wo(ref.transpose(1, 2).reshape(b, t, -1))
    torch.testing.assert_close(attn(x, cos, sin), expected)


def test_unknown_model_names_the_closest():
    with pytest.raises(GpuwiseError, match="did you mean llama2-7b"):
        get_model("llama-7b")
