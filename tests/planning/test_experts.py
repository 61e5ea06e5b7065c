"""Mixture-of-Experts models (issue 17): the grouped expert matmul as CUDA runs it under autocast, total and active
parameters against the model built on the meta device and Mixtral's model card, FLOPs against a hand count from the
active parameters, and the balanced routing stand-in for models that read their router's choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpuwise.compat import FakeTensorMode
from gpuwise.planning import Setup
from gpuwise.planning.capture.autocast import CudaEmulation
from gpuwise.planning.capture.routing import ASSUMPTION, BalancedRouting, balanced_topk
from gpuwise.planning.capture.tracker import Tracker
from gpuwise.planning.capture.workload import simulate
from gpuwise.planning.sources.hf import HFSource

DATA = Path(__file__).resolve().parents[1] / "data"
# hidden 64, expert width 128, 4 experts top-2, 4 heads of 16 (2 KV heads), vocabulary 1000, 2 blocks
H, FFN, E, K, HEADS, KV, V, LAYERS = 64, 128, 4, 2, 4, 2, 1000, 2
MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": V, "hidden_size": H,
           "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": KV, "num_local_experts": E, "num_experts_per_tok": K}
QWEN3_MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": V, "hidden_size": H,
             "intermediate_size": FFN, "moe_intermediate_size": FFN, "num_hidden_layers": LAYERS,
             "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": 16, "num_experts": E,
             "num_experts_per_tok": K}
OLMOE = {"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "vocab_size": V, "hidden_size": H,
         "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
         "num_key_value_heads": KV, "num_experts": E, "num_experts_per_tok": K}
# DBRX loops over the experts hit (nonzero, where) and JetMoE splits the tokens by expert_size.tolist(): both read the
# router's choice, so they plan under the balanced stand-in
DBRX = {"model_type": "dbrx", "architectures": ["DbrxForCausalLM"], "vocab_size": V, "d_model": H, "n_heads": HEADS,
        "n_layers": LAYERS, "attn_config": {"kv_n_heads": KV, "rope_theta": 10000.0, "clip_qkv": 8},
        "ffn_config": {"ffn_hidden_size": FFN, "moe_num_experts": E, "moe_top_k": K}}
JETMOE = {"model_type": "jetmoe", "architectures": ["JetMoeForCausalLM"], "vocab_size": V, "hidden_size": H,
          "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_key_value_heads": KV, "kv_channels": 16,
          "num_local_experts": E, "num_experts_per_tok": K}
BATCH, SEQ = 2, 32


def _source(tmp_path, cfg: dict) -> HFSource:
    path = tmp_path / f"{cfg['model_type']}.json"
    path.write_text(json.dumps(cfg))
    return HFSource.from_path(path)


def _meta(transformers, cfg: dict) -> torch.nn.Module:
    """The real model as transformers builds it, on the meta device."""
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "torch_dtype"})
    with torch.device("meta"):
        return getattr(transformers, cfg["architectures"][0])(config)


def test_grouped_mm_runs_as_cuda_autocast_runs_it():
    # CUDA autocast registers no kernel for _grouped_mm (pytorch/pytorch#174763): it is on neither op list, so under
    # bf16 autocast it takes its operands as they come (transformers casts the tokens to the weights' dtype, fp32 in
    # mixed precision), and the CUDA fallback runs fp32 (GroupedBlas.cpp); the installed torch's registrations say so
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has("aten::mm", "AutocastCUDA") and has("aten::bmm", "AutocastCUDA")
    assert not has("aten::_grouped_mm", "AutocastCUDA")
    s, k, n = 12, 16, 8
    offs = torch.tensor([3, 6, 9, 12], dtype=torch.int32)
    real = torch._grouped_mm(torch.randn(s, k), torch.randn(E, k, n), offs=offs)  # the CPU kernel: same fallback
    with FakeTensorMode(allow_non_fake_inputs=True), CudaEmulation(torch.bfloat16), Tracker() as tr:
        a = torch.randn(s, k, requires_grad=True)
        w = torch.randn(E, k, n, requires_grad=True)
        out = torch._grouped_mm(a, w, offs=offs)  # the fake-tensor rule alone refuses fp32 ("Expected ... BF16")
        half = torch._grouped_mm(a.bfloat16(), w.bfloat16(), offs=offs)
        out.sum().backward()
    assert (out.dtype, out.shape) == (real.dtype, real.shape) == (torch.float32, (s, n))
    assert half.dtype == torch.bfloat16
    assert (a.grad.dtype, w.grad.shape) == (torch.float32, (E, k, n))
    # forward, input gradient and weight gradient: 2 x s x k x n each, whatever the split among the experts
    assert tr.flops_by_op["_grouped_mm"] == 2 * s * k * n * 4  # the bf16 forward too
    assert not tr.uncosted


def test_activations_indexed_by_a_known_mask_have_its_shape():
    # X-MOD picks each language's rows with x[lang_ids == i], lang_ids made from the default language: the mask has a
    # twin, the activations none; the fake index would need nonzero's data-dependent count
    with FakeTensorMode(allow_non_fake_inputs=True), BalancedRouting() as routing:
        ids = torch.arange(6) % 3
        x = torch.randn(6, 4, requires_grad=True)
        picked = x[ids == 0]
        out = torch.zeros(6, 4)
        out[ids != 0] = x[ids != 0] * 2
    assert picked.shape == (2, 4) and out.shape == (6, 4)
    assert not routing.used  # exact: no routing choice was read


def test_balanced_topk_gives_each_expert_tokens_times_k_over_e():
    idx = balanced_topk(torch.Size((24, 2)), -1, 8)
    assert torch.bincount(idx.flatten(), minlength=8).tolist() == [24 * 2 // 8] * 8
    assert all(len(set(row)) == 2 for row in idx.tolist())  # a token's k choices are distinct experts


def test_mixtral_8x7b_total_and_active_parameters():
    transformers = pytest.importorskip("transformers")
    cfg = json.loads((DATA / "mixtral-8x7b-config.json").read_text())
    experts = HFSource.from_path(DATA / "mixtral-8x7b-config.json").experts
    model = _meta(transformers, cfg)
    assert experts.total == sum(p.numel() for p in model.parameters())
    # model card (mistral.ai/news/mixtral-of-experts): 46.7 B parameters in total, 12.9 B used per token
    assert (round(experts.total / 1e9, 1), round(experts.active / 1e9, 1)) == (46.7, 12.9)
    assert (experts.experts, experts.top_k) == (8, 2)
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    assert experts.params == layers * 8 * 3 * h * i  # w1, w2, w3 (gate, down, up) of 8 experts a block


def test_mixtral_8x7b_plan_puts_weights_gradients_and_adam_where_arithmetic_says():
    pytest.importorskip("transformers")
    source = HFSource.from_path(DATA / "mixtral-8x7b-config.json")
    w = simulate(source, Setup(micro_batch=1, seq=64), batch_model=False)
    assert w.params == source.experts.total  # 2 and 3 blocks captured, scaled to 32
    peak = w.timeline.base.max(axis=0)
    gib = {c: peak[i] / 2**30 for i, c in enumerate(("weights", "gradients", "optimizer"))}
    n = w.params / 2**30
    # bf16-mixed AdamW: fp32 master weights (4 B), fp32 gradients (4 B), exp_avg and exp_avg_sq (8 B) per parameter;
    # every tensor rounded up to 512 B by the caching allocator
    assert gib["weights"] == pytest.approx(4 * n, rel=1e-4)
    assert gib["gradients"] == pytest.approx(4 * n, rel=1e-4)
    assert gib["optimizer"] == pytest.approx(8 * n, rel=1e-4)


@pytest.mark.parametrize("cfg", [MIXTRAL, QWEN3_MOE, OLMOE, DBRX, JETMOE], ids=lambda c: c["model_type"])
def test_small_moe_plans_a_training_step_with_exact_parameters(tmp_path, cfg):
    transformers = pytest.importorskip("transformers")
    source = _source(tmp_path, cfg)
    w = simulate(source, Setup(micro_batch=BATCH, seq=SEQ), batch_model=False)
    assert w.params == sum(p.numel() for p in _meta(transformers, cfg).parameters())
    assert not w.uncosted
    stand_in = {c.routing for group in w.captures for c in group}
    assert stand_in == ({ASSUMPTION} if cfg in (DBRX, JETMOE) else {None})


def _hand_flops(active_matmul: int, tokens: int) -> int:
    """6 N T for the matmuls (forward 2, backward 4: Kaplan et al. 2020) plus causal flash attention: 4 b h s^2 d / 2
    forward, x2.5 backward (Dao et al. 2022), each block."""
    attention = 4 * BATCH * HEADS * SEQ * SEQ * (H // HEADS) // 2 * 7 // 2 * LAYERS
    return 6 * active_matmul * tokens + attention


@pytest.mark.parametrize("cfg", [MIXTRAL, DBRX], ids=lambda c: c["model_type"])
def test_moe_flops_are_six_active_parameters_per_token_plus_attention(tmp_path, cfg):
    pytest.importorskip("transformers")
    # the matmul parameters one token meets: q, o (h x h), k, v (h x h/2), the router (h x E), k experts' three
    # h x i matrices, each block; the LM head (h x V). The input embedding is a lookup, no FLOPs.
    attn = 2 * H * H + 2 * H * (H * KV // HEADS)
    active_matmul = LAYERS * (attn + H * E + K * 3 * H * FFN) + H * V
    w = simulate(_source(tmp_path, cfg), Setup(micro_batch=BATCH, seq=SEQ), batch_model=False)
    assert w.flops_per_step == _hand_flops(active_matmul, BATCH * SEQ)


def test_plan_reports_active_parameters_and_the_routing_assumption(tmp_path):
    transformers = pytest.importorskip("transformers")
    from gpuwise.planning import plan_model
    from gpuwise.render.plan import plan_json

    for cfg, routing in ((MIXTRAL, "any split"), (JETMOE, ASSUMPTION)):
        path = tmp_path / f"{cfg['model_type']}.json"
        path.write_text(json.dumps(cfg))
        data = plan_json(plan_model(None, Setup(micro_batch=BATCH, seq=SEQ), hf_config=str(path), gpu="h100-sxm"))
        total = sum(p.numel() for p in _meta(transformers, cfg).parameters())
        if cfg is MIXTRAL:  # (E - k) of E experts' gate, up and down matrices idle for each token, each block
            assert data["experts"]["active"] == total - LAYERS * (E - K) * 3 * H * FFN
        assert (data["params"], data["experts"]["total"]) == (total, total)
        assert data["routing"].startswith(routing)


def test_deepseek_v3_total_and_active_parameters():
    pytest.importorskip("transformers")
    experts = HFSource.from_path(DATA / "deepseek-v3-config.json").experts
    # DeepSeek-V3 technical report (arXiv:2412.19437), abstract: 671 B total, 37 B activated for each token (the
    # main model; its multi-token-prediction module is not in transformers' DeepseekV3ForCausalLM)
    assert round(experts.total / 1e9) == 671
    assert experts.active == pytest.approx(37e9, rel=0.02)
    assert (experts.experts, experts.top_k) == (256, 8)
