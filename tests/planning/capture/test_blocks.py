"""--hf-config models whose blocks differ (capture/blocks.py), and what transformers' configs and models do under
fake tensors: a scaled plan equals the whole model's capture, its parameter count the real model's on the meta
device; a traced step takes the attention path the real one takes; configs with infinities load; a model that
cannot be built on fake tensors says why."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_cli
from gpuwise.planning import Setup, plan_model
from gpuwise.planning.capture.step import capture
from gpuwise.planning.capture.workload import simulate
from gpuwise.planning.sources.hf import HFSource
from gpuwise.render.plan import plan_json

DATA = Path(__file__).resolve().parents[2] / "data"
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
    (JAMBA, Setup(micro_batch=2, seq=16), (4, 6)),
], ids=["deepseek-v3", "gemma", "jamba"])
def test_scaled_plan_of_a_mixed_stack_equals_its_whole_capture(tmp_path, cfg, setup, captured):
    """Dense-then-MoE, sliding-and-global and Mamba-and-attention stacks, captured as units of blocks and scaled:
    sample by sample the capture of the whole model, and the parameters of the real model on the meta device.
    Before, DeepSeek's 2 and 3 blocks (dense, dense, MoE) were scaled to 9 dense and one MoE, and Gemma's 2 and 3
    blocks (sliding, global, sliding) to 13. (Gemma under --task infer is captured whole: transformers' cache
    makes a tensor a sliding layer before the first block runs, which units inserted in the blocks do not see; and
    so, from transformers 5.25, is Jamba's, whose hybrid cache holds every layer's state before the first block.)"""
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


def test_traced_step_takes_the_real_steps_attention_path(tmp_path, monkeypatch):
    """The SDPA calls of a Llama step on fake tensors are those of the same step on real ones: no mask, is_causal
    (before source._real_masks, fake position ids looked packed and a (B, 1, T, T) mask went to every layer: 2 GiB
    of bf16 a layer for Llama-3.1-8B at 8,192 tokens)."""
    pytest.importorskip("transformers")
    from transformers.integrations import sdpa_attention

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((attn_mask is None, is_causal, q.shape[-2]))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(sdpa_attention.torch.nn.functional, "scaled_dot_product_attention", spy)
    src = _source(tmp_path, {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **SMALL,
                             "num_key_value_heads": 2, "num_hidden_layers": 2})
    setup = Setup(micro_batch=2, seq=64, precision="fp32")
    seen = {}
    for fake in (True, False):
        calls.clear()
        capture(src, setup, batch=2, fake=fake)
        seen[fake] = list(calls)
    assert seen[True] == seen[False] == [(True, True, 64)] * 2


def test_config_with_infinities_plans_and_its_json_is_valid(tmp_path, capsys):
    """Mamba-2's config as transformers saves it: time_step_limit (0.0, inf) written as {"__float__": "Infinity"}
    (and bare Infinity, as Python's json writes it). Before, the tag reached the config class, which refused it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Mamba2Config(hidden_size=32, num_hidden_layers=2, vocab_size=100, num_heads=4, head_dim=16,
                                       state_size=8, n_groups=1, expand=2, chunk_size=16)
    config.architectures = ["Mamba2ForCausalLM"]
    config.save_pretrained(tmp_path)
    assert '"__float__": "Infinity"' in (tmp_path / "config.json").read_text()
    assert HFSource.from_path(tmp_path).config["time_step_limit"] == [0.0, math.inf]
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({**HFSource.from_path(tmp_path).config}))
    assert "Infinity" in bare.read_text() and HFSource.from_path(bare).config["time_step_limit"][1] == math.inf

    def no_constants(name):
        raise ValueError(f"{name} is not JSON")

    code, out, err = run_cli(capsys, "plan", "--hf-config", str(tmp_path), "--task", "infer", "--seq", "16", "--json")
    assert code == 0, err
    assert json.loads(out, parse_constant=no_constants)["params"] > 0


def test_plan_json_has_no_infinities():
    """A non-finite figure (a step time from a calibration of 0 GB/s, say) is null in --json, never Infinity."""
    plan = plan_model("gpt2", Setup(task="infer", seq=16), gpu="h100")
    data = plan_json(replace(plan, gpus=(replace(plan.gpus[0], step_time_s=math.inf),)))
    assert json.loads(json.dumps(data, allow_nan=False))["gpus"][0]["step_time_s"] is None


def test_models_that_read_values_while_built_plan(tmp_path, capsys):
    """ConvNeXt's constructor reads drop-path rates off torch.linspace (.item()), which fake tensors cannot: the
    rates are made for real (planning/sources/hf_build.py), and it plans with the real model's parameters. ModernBERT's
    initialiser (torch 2.13's trunc_normal_) reads values too: it is built without initialising, and plans with the
    real model's parameters."""
    transformers = pytest.importorskip("transformers")
    convnext = {"model_type": "convnext", "architectures": ["ConvNextForImageClassification"],
                "hidden_sizes": [8, 16], "depths": [1, 1], "num_stages": 2, "drop_path_rate": 0.1}
    w = simulate(_source(tmp_path, convnext), Setup(task="infer", image_size=32), batch_model=False)
    assert w.params == _meta_params(transformers, convnext)

    cfg = {"model_type": "modernbert", "architectures": ["ModernBertForMaskedLM"], "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 51000}
    w = simulate(_source(tmp_path, cfg), Setup(task="infer", seq=16), batch_model=False)
    assert w.params == _meta_params(transformers, cfg)


@pytest.mark.parametrize(("config", "message"), [
    ({"num_hidden_layers": 100_000_000}, "num_hidden_layers 100,000,000 is more blocks than any model has"),
    ({"architectures": 5}, "architectures 5 is not a list of class names"),
])
def test_config_values_that_would_build_for_hours_or_crash_are_one_line(capsys, tmp_path, config, message):
    """Checked when the file is read: the stack's meta-device build (blocks.py) came first and ran for minutes."""
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                                "intermediate_size": 128, "vocab_size": 100, **config}))
    code, _, err = run_cli(capsys, "plan", "--hf-config", str(path))
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_pipeline_stage_that_is_not_the_first_blocks_is_one_line(capsys, tmp_path):
    """MiniMax's linear-attention blocks keep the model's block count: a 2-block stage is not its first 2 (exit 3)."""
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "minimax", "architectures": ["MiniMaxForCausalLM"], "num_hidden_layers": 4, "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 1000, "num_local_experts": 4, "num_experts_per_tok": 2, "block_size": 16,
        "layer_types": ["linear_attention"] * 4}))
    code, _, err = run_cli(capsys, "plan", "--hf-config", str(path), "--gpus", "2", "--pp", "2", "--seq", "32",
                           "--batch", "2")
    assert code == 2 and "does not build as its first 2 blocks" in err and err.count("\n") == 1, err
