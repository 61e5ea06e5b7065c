"""Mixture-of-Experts follow-ups (issue 17): transformers 5's fused 3-D expert parameters under weight-only
quantisation (stored as vLLM's fused-MoE kernels store them for int4/int8/fp8, left 16-bit where bitsandbytes skips
them, and the plan says so), and multi-head latent attention's KV cache (DeepSeek-V2/V3) in recommend's serving
formula, against what the captured transformers decode step holds."""

from __future__ import annotations

import json

import pytest

from gpuwise.planning import Setup
from gpuwise.planning.serving import kv_bytes_per_token

# a small DeepSeek-V3: 3 blocks (the first dense), 4 heads, latent 64 + rotary key 16, 4 routed experts top-2
DEEPSEEK = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 1000,
            "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64, "num_hidden_layers": 3,
            "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64,
            "q_lora_rank": 96, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
            "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1}


def _source(tmp_path, cfg: dict):
    from gpuwise.planning.source import HFSource

    path = tmp_path / f"{cfg['model_type']}.json"
    path.write_text(json.dumps(cfg))
    return HFSource.from_path(path)


def test_mla_cache_is_the_latent_as_the_captured_decode_holds_it(tmp_path):
    pytest.importorskip("transformers")
    from gpuwise.planning.serving import DecodeRead
    from gpuwise.planning.sharding import per_gpu
    from gpuwise.planning.workload import simulate

    source = _source(tmp_path, DEEPSEEK)
    dims = source.decoder
    assert dims.kv_latent == 64 + 16  # kv_lora_rank + qk_rope_head_dim
    setup = Setup(task="decode", context=255, micro_batch=2, precision="bf16")
    read = DecodeRead.of(per_gpu(simulate(source, setup, batch_model=False), setup))
    # transformers' DeepseekV3Attention caches the normed latent (B, 1, T, 64) and the rotary key (B, 1, T, 16) a
    # layer: 3 layers x 80 x 256 tokens (255 and the new one) x 2 sequences x 2 bytes
    hand = 3 * 80 * 256 * 2 * 2
    assert read.kv_cache_bytes == hand
    per_token = kv_bytes_per_token(layers=dims.layers, kv_heads=dims.kv_heads, head_dim=dims.head_dim,
                                   latent=dims.kv_latent)
    assert per_token * 256 * 2 == hand  # recommend's serving formula holds the same
    # per-head K and V would be 2 x 4 heads x 64: 6.4x more
    assert kv_bytes_per_token(layers=3, kv_heads=4, head_dim=64) == 6.4 * per_token


def test_deepseek_v3_caches_576_values_a_token_a_layer():
    pytest.importorskip("transformers")
    from pathlib import Path

    from gpuwise.planning.source import HFSource

    dims = HFSource.from_path(Path(__file__).parent / "data" / "deepseek-v3-config.json").decoder
    # kv_lora_rank 512 + qk_rope_head_dim 64, 61 layers, bf16: 70,272 B a token (DeepSeek-V2 paper, arXiv:2405.04434,
    # Table 1: MLA caches (d_c + d_h^R) l elements a token), where 128 heads of K and V would be 25x that
    assert dims.kv_latent == 576
    assert kv_bytes_per_token(layers=dims.layers, kv_heads=dims.kv_heads, head_dim=dims.head_dim,
                              latent=dims.kv_latent) == 61 * 576 * 2
