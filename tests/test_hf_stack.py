"""--hf-config models whose blocks differ (planning/stack.py): a scaled plan equals the whole model's capture, its
parameter count the real model's on the meta device."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_cli
from gpuwise.planning import Setup
from gpuwise.planning.capture import capture
from gpuwise.planning.source import HFSource
from gpuwise.planning.workload import simulate

DATA = Path(__file__).parent / "data"
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
         "vocab_size": 256}
# 2 dense blocks, then 8 MoE ones (first_k_dense_replace), as DeepSeek-V3's 3 and 58
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], **SMALL,
               "num_hidden_layers": 10, "first_k_dense_replace": 2, "n_routed_experts": 8, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
               "qk_rope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1}
# Gemma-2's sliding-window and global attention alternating, the window shorter than the sequence; 13 blocks: 6 units
# of 2 and one sliding block left over, as Gemma-3's 62 are 10 units of 6 and 2 (its sliding_window_pattern)
GEMMA = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], **SMALL, "head_dim": 16,
         "num_hidden_layers": 13, "sliding_window": 8, "sliding_window_pattern": 2}
# Mamba and attention blocks alternating, the attention ones with experts
JAMBA = {"model_type": "jamba", "architectures": ["JambaForCausalLM"], **SMALL, "num_key_value_heads": 2,
         "num_hidden_layers": 12, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
         "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2, "mamba_d_state": 8, "mamba_expand": 2,
         "mamba_dt_rank": 8}


def _source(tmp_path, cfg: dict) -> HFSource:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return HFSource.from_path(tmp_path / "config.json")


def _meta_params(transformers, cfg: dict) -> int:
    """The real model's parameter count, built by transformers on the meta device (accelerate's way)."""
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "torch_dtype"})
    with torch.device("meta"):
        model = getattr(transformers, cfg["architectures"][0])(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("cfg", "setup", "captured"), [
    (DEEPSEEK_V3, Setup(micro_batch=2, seq=16, precision="bf16"), (4, 5)),  # bf16-mixed MoE training: issue 17
    (GEMMA, Setup(micro_batch=2, seq=16), (5, 7)),
    (JAMBA, Setup(task="infer", micro_batch=2, seq=16), (4, 6)),
], ids=["deepseek-v3", "gemma", "jamba"])
def test_scaled_plan_of_a_mixed_stack_equals_its_whole_capture(tmp_path, cfg, setup, captured):
    """Dense-then-MoE, sliding-and-global and Mamba-and-attention stacks, captured as units of blocks and scaled:
    sample by sample the capture of the whole model, and the parameters of the real model on the meta device.
    Before, DeepSeek's 2 and 3 blocks (dense, dense, MoE) were scaled to 9 dense and one MoE, and Gemma's 2 and 3
    blocks (sliding, global, sliding) to 13. (Gemma under --task infer is captured whole: transformers' cache
    makes a tensor a sliding layer before the first block runs, which units inserted in the blocks do not see.)"""
    transformers = pytest.importorskip("transformers")
    src = _source(tmp_path, cfg)
    scaled = simulate(src, setup, batch_model=False)
    whole = capture(src, setup, batch=setup.micro_batch)
    assert scaled.captured_blocks == captured
    assert scaled.params == whole.params == _meta_params(transformers, cfg)
    assert (scaled.flops_per_step, scaled.bytes_per_step) == (whole.flops_per_step, whole.bytes_per_step)
    assert scaled.timeline.labels == whole.labels
    assert scaled.timeline.end_of_forward == whole.end_of_forward
    np.testing.assert_array_equal(scaled.timeline.live(setup.micro_batch), whole.live)


def test_deepseek_v3_published_config_plans_671b_parameters():
    """DeepSeek-V3's config.json as published (huggingface.co/deepseek-ai/DeepSeek-V3): the model card's 671 B
    parameters (its main model; the 14 B MTP module is not built by transformers), counted exactly as the real
    model on the meta device. Before: 37.4 B, the first 3 blocks (dense) scaled to all 61."""
    transformers = pytest.importorskip("transformers")
    src = HFSource.from_path(DATA / "deepseek-v3-config.json")
    assert src.layer_kinds == (0,) * 3 + (1,) * 58
    w = simulate(src, Setup(task="infer", seq=16), batch_model=False)
    assert w.captured_blocks == (5, 6)  # 3 dense and 2 MoE blocks, then one MoE block more
    assert w.params == _meta_params(transformers, src.config)
    assert round(w.params / 1e9) == 671


def test_pipeline_stages_of_a_mixed_stack_are_refused(tmp_path, capsys):
    """A stage of a dense-then-MoE stack holds blocks the planner would not build (it builds the first ones)."""
    pytest.importorskip("transformers")
    _source(tmp_path, DEEPSEEK_V3)
    code, _, err = run_cli(capsys, "plan", "--hf-config", str(tmp_path / "config.json"), "--gpus", "2", "--pp", "2",
                           "--seq", "32", "--precision", "bf16")
    assert code == 2 and err.startswith("error: --pp 2: ") and "not all alike" in err and err.count("\n") == 1
