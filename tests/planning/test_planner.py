"""The plan against published formulas: PaLM FLOPs, scaled parameter counts, the KV cache, LoRA and QLoRA
(ZeRO model states: parallel/test_sharding.py; exact scaling: capture/test_scaling.py)."""

from __future__ import annotations

import pytest

from gpuwise.models import get_model
from gpuwise.planning.capture.tracker import CATEGORIES
from gpuwise.planning.capture.workload import simulate
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.zoo import ZooSource


def test_gpt2_flops_match_palm_appendix_b():
    """6 N per token for the matmuls (Kaplan et al.; PaLM App. B) plus attention. Causal flash attention does
    4*b*s^2*h/2 forward per layer and 2.5x that backward (it recomputes QK^T): 7*b*s^2*h per layer, where
    PaLM's non-causal, no-recompute 12*L*h*s per token would say 12*b*s^2*h."""
    zoo = get_model("gpt2")
    b, s = 2, 1024
    w = simulate(ZooSource(zoo=zoo), Setup(micro_batch=b, seq=s), batch_model=False)
    cfg = zoo.config
    tokens = b * s
    expected = 6 * zoo.published_params * tokens + cfg.n_layer * 7 * b * s * s * cfg.n_embd
    print(f"\nGPT-2 b={b} s={s}: {w.flops_per_step:.4e} FLOPs vs {expected:.4e}, "
          f"ratio {w.flops_per_step / expected:.4f}")
    assert w.flops_per_step == pytest.approx(expected, rel=0.03)
    palm_like = 6 * zoo.published_params * tokens + 12 * cfg.n_layer * cfg.n_embd * s * tokens
    assert w.flops_per_step < palm_like  # causal halving outweighs the recompute


def test_grad_accum_flops_scale_with_micro_batches():
    one = simulate(ZooSource(zoo=get_model("gpt2")), Setup(seq=128), batch_model=False)
    four = simulate(ZooSource(zoo=get_model("gpt2")), Setup(seq=128, grad_accum=4), batch_model=False)
    assert four.flops_per_step == 4 * one.flops_per_step

    def grads_in_forward(w) -> float:  # from the second micro-batch on, the first one's gradients are alive
        live = w.timeline.live(1)[:, CATEGORIES.index("gradients")]
        return max(g for g, (phase, _) in zip(live, w.timeline.labels, strict=True) if phase == "forward")

    assert grads_in_forward(one) == 0
    assert grads_in_forward(four) == pytest.approx(one.trainable_params * 4, rel=1e-3)  # fp32 gradients


def test_scaled_parameter_counts_equal_published():
    for name in ("gpt2-xl", "llama3-8b", "llama2-70b"):
        zoo = get_model(name)
        w = simulate(ZooSource(zoo=zoo), Setup(task="infer", seq=16), batch_model=False)
        assert w.captured_blocks == (2, 3)
        assert w.params == zoo.published_params


def test_kv_cache_bytes():
    zoo = get_model("llama3-8b")
    b, s = 2, 256
    w = simulate(ZooSource(zoo=zoo), Setup(task="infer", micro_batch=b, seq=s), batch_model=False)
    kv = w.timeline.live(b)[:, CATEGORIES.index("kv_cache")].max()
    cfg = zoo.config
    assert kv == 2 * cfg.n_layer * b * cfg.n_kv_head * s * (cfg.dim // cfg.n_head) * 2  # K and V, bf16


def test_lora_trainable_parameters():
    zoo = get_model("llama2-7b")
    r = 8
    w = simulate(ZooSource(zoo=zoo), Setup(task="finetune-lora", lora_rank=r, seq=32), batch_model=False)
    c = zoo.config
    hd = c.dim // c.n_head
    per_block = sum(r * (i + o) for i, o in [(c.dim, c.n_head * hd)] * 2 + [(c.dim, c.n_kv_head * hd)] * 2
                    + [(c.dim, c.ffn_dim), (c.ffn_dim, c.dim), (c.dim, c.ffn_dim)])
    assert w.trainable_params == c.n_layer * per_block
    assert w.params == zoo.published_params


def test_qlora_base_is_four_bits():
    zoo = get_model("llama2-7b")
    setup = Setup(task="finetune-lora", qlora=True, qlora_recipe="plain", seq=32)  # PEFT's fp32 up-cast: test_lora.py
    w = simulate(ZooSource(zoo=zoo), setup, batch_model=False)
    weights = w.timeline.live(1)[0, CATEGORIES.index("weights")]
    c = zoo.config
    embed_and_norms = 2 * c.vocab_size * c.dim + (2 * c.n_layer + 1) * c.dim  # untied, kept in bf16
    quantised = zoo.published_params - embed_and_norms
    adapters = w.trainable_params * 4  # fp32 adapters under bf16-mixed
    # NF4: 0.5 B/param + 8-bit absmax per 64 + fp32 per 256 absmax (Dettmers et al. 2023: ~4.127 bits)
    expected = 2 * embed_and_norms + quantised * (0.5 + 1 / 64 + 4 / (64 * 256)) + adapters
    assert weights == pytest.approx(expected, rel=0.01)


@pytest.mark.own_captures  # counts the captures that really run
def test_the_batch_model_reuses_the_captures_at_the_batch(monkeypatch):
    """A Planner asked for a step without its batch model, then with it (plan's remedies, train --auto), captures the
    step at the batch once: only the 3-block capture at batch + 1 runs the second time (the 2-block one is derived).
    Before, the second request ran every capture again (with GPUWISE_CACHE=off, or for a model from a file)."""
    from gpuwise.planning.capture import workload as workload_module
    from gpuwise.planning.planner import Planner

    monkeypatch.setenv("GPUWISE_CACHE", "off")
    calls = []
    real = workload_module.capture
    monkeypatch.setattr(workload_module, "capture", lambda *a, **k: calls.append(k) or real(*a, **k))
    planner, setup = Planner(ZooSource(zoo=get_model("gpt2"))), Setup(micro_batch=2, seq=32)
    planner.workload(setup)
    assert [(k["batch"], k["n_layer"]) for k in calls] == [(2, 2), (2, 3)]
    with_model = planner.workload(setup, batch_model=True)
    assert [(k["batch"], k["n_layer"]) for k in calls[2:]] == [(3, 3)] and with_model.batch_model is not None
