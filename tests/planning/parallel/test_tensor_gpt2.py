"""``--tp`` on a Hugging Face GPT-2 config (parallel/tensor.py): transformers' GPT-2 computes its linear layers as
``Conv1D`` (weight stored (in, out); q, k and v fused in one c_attn), which Megatron-LM splits as it splits GPT's
linears (Shoeybi et al. 2019, arXiv:1909.08053, sec. 3): c_attn and c_fc column-parallel (each rank its heads' q, k
and v columns, 4h / t of the MLP), both c_proj row-parallel (their biases whole: added once, after the all-reduce),
the norms whole. The config is the Hub's gpt2 config.json (openai-community/gpt2)."""

from __future__ import annotations

import json

import pytest

from gpuwise.errors import GpuwiseError
from gpuwise.planning.capture.workload import simulate
from gpuwise.planning.parallel.rank import check
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.hf import HFSource

GPT2 = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
        "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12,
        "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1,
        "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True,
        "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}}, "vocab_size": 50257}
H, V = GPT2["n_embd"], GPT2["vocab_size"]
B, SEQ = 2, 128


def _block_params(t: int) -> int:
    """One rank's parameters of a GPT-2 block split t ways."""
    c_attn, c_fc = (H * 3 * H + 3 * H) // t, (H * 4 * H + 4 * H) // t  # column-parallel: weight and bias split
    attn_proj, mlp_proj = H * H // t + H, 4 * H * H // t + H  # row-parallel: weight split, bias whole
    norms = 2 * 2 * H
    return c_attn + attn_proj + c_fc + mlp_proj + norms


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> HFSource:
    path = tmp_path_factory.mktemp("gpt2") / "config.json"
    path.write_text(json.dumps(GPT2))
    return HFSource.from_path(path)


def test_a_gpt2_config_is_a_decoder_stack(source):
    """GPT-2's config.json names its depth, heads and width n_layer, n_head and n_embd."""
    assert source.n_layer == 12
    dec = source.decoder
    assert (dec.layers, dec.heads, dec.kv_heads, dec.head_dim) == (12, 12, 12, 64)


def test_tp_2_holds_half_of_each_gpt2_block_and_sees_every_token(source):
    one, two = (simulate(source, Setup(micro_batch=B, seq=SEQ, precision="bf16", gpus=t, tp=t), batch_model=False)
                for t in (1, 2))
    assert one.block_bytes == 2 * _block_params(1)  # bf16
    assert two.block_bytes == 2 * _block_params(2)
    assert _block_params(2) == (_block_params(1) - 2 * H - 4 * H) / 2 + 2 * H + 4 * H  # half, less what stays whole
    assert two.tokens_per_step == one.tokens_per_step == B * SEQ
    rows = -(-V // 2)  # the vocabulary-parallel embedding (tied to the head); learned positions whole
    assert one.params - two.params == 12 * (_block_params(1) - _block_params(2)) + (V - rows) * H
    assert two.flops_per_step == pytest.approx(one.flops_per_step / 2, rel=0.01)


def test_tp_must_divide_gpt2_heads(source):
    with pytest.raises(GpuwiseError, match="--tp 5 does not divide gpt2's 12 attention heads"):
        check(source, Setup(micro_batch=B, seq=SEQ, gpus=5, tp=5))
