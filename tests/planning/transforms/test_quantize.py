"""Mixture-of-Experts follow-ups (issue 17): transformers 5's fused 3-D expert parameters under weight-only
quantisation (stored as vLLM's fused-MoE kernels store them for int4/int8/fp8, left 16-bit where bitsandbytes skips
them, and the plan says so), and multi-head latent attention's KV cache (DeepSeek-V2/V3) in recommend's serving
formula, against what the captured transformers decode step holds."""

from __future__ import annotations

import json

import pytest

from gpuwise.planning import Setup
from gpuwise.planning.cost.serving import kv_bytes_per_token

# a small DeepSeek-V3: 3 blocks (the first dense), 4 heads, latent 64 + rotary key 16, 4 routed experts top-2
DEEPSEEK = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 1000,
            "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64, "num_hidden_layers": 3,
            "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64,
            "q_lora_rank": 96, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
            "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1}


def _source(tmp_path, cfg: dict):
    from gpuwise.planning.sources.hf import HFSource

    path = tmp_path / f"{cfg['model_type']}.json"
    path.write_text(json.dumps(cfg))
    return HFSource.from_path(path)


def test_mla_cache_is_the_latent_as_the_captured_decode_holds_it(tmp_path):
    pytest.importorskip("transformers")
    from gpuwise.planning.capture.workload import simulate
    from gpuwise.planning.cost.serving import DecodeRead
    from gpuwise.planning.parallel.sharding import per_gpu

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

    from gpuwise.planning.sources.hf import HFSource

    dims = HFSource.from_path(Path(__file__).resolve().parents[2] / "data" / "deepseek-v3-config.json").decoder
    # kv_lora_rank 512 + qk_rope_head_dim 64, 61 layers, bf16: 70,272 B a token (DeepSeek-V2 paper, arXiv:2405.04434,
    # Table 1: MLA caches (d_c + d_h^R) l elements a token), where 128 heads of K and V would be 25x that
    assert dims.kv_latent == 576
    assert kv_bytes_per_token(layers=dims.layers, kv_heads=dims.kv_heads, head_dim=dims.head_dim,
                              latent=dims.kv_latent) == 61 * 576 * 2


@pytest.fixture(scope="module")
def mixtral():
    """Mixtral 8x7B from its config.json (tests/data): 32 blocks of 8 experts, hidden 4096, expert width 14336."""
    pytest.importorskip("transformers")
    from pathlib import Path

    from gpuwise.planning.sources.hf import HFSource

    return HFSource.from_path(Path(__file__).resolve().parents[2] / "data" / "mixtral-8x7b-config.json")


@pytest.mark.parametrize("weights", ["int4", "fp8", "nf4", "int8"])
def test_mixtral_experts_stored_as_the_library_stores_them(mixtral, weights):
    from gpuwise.planning.capture.tracker import CATEGORIES
    from gpuwise.planning.capture.workload import simulate
    from gpuwise.planning.transforms.quantize import FORMATS

    h, ffn, experts, layers, vocab, kv = 4096, 14336, 8, 32, 32000, 1024
    fmt = FORMATS[weights]
    # the linear layers of each block: q, o (h x h), k, v (kv x h), the router (8 x h), in the format
    linear = layers * (2 * fmt.nbytes(h, h) + 2 * fmt.nbytes(kv, h) + fmt.nbytes(experts, h))
    # each expert's fused gate/up (2 ffn x h) and down (h x ffn) matrices: vLLM's fused MoE stores int4 (AWQ group
    # 128) and fp8 per expert as the linear formats do; bitsandbytes (nf4, int8) skips them: bf16
    if weights in ("int4", "fp8"):
        fused = layers * experts * (fmt.nbytes(2 * ffn, h) + fmt.nbytes(h, ffn))
    else:
        fused = layers * experts * 3 * h * ffn * 2
    rest = (2 * vocab * h + (2 * layers + 1) * h) * 2  # embedding, head, norms: bf16
    w = simulate(mixtral, Setup(task="infer", micro_batch=1, seq=64, precision="bf16", weights=weights),
                 batch_model=False)
    held = w.timeline.base[:, CATEGORIES.index("weights")].max()
    assert held == pytest.approx(linear + fused + rest, rel=2e-4)  # every tensor rounded up to 512 B
    gib = {"int4": 23.0, "fp8": 43.7, "nf4": 85.1, "int8": 85.7}[weights]  # was 85-86 GiB for all four
    assert held / 2**30 == pytest.approx(gib, abs=0.05)


# a small Mixtral: hidden 64, 4 experts of width 128, top-2, 2 blocks
SMALL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_local_experts": 4, "num_experts_per_tok": 2}


def test_fp8_experts_quantise_their_tokens_and_make_no_16_bit_copy(tmp_path):
    pytest.importorskip("transformers")
    import torch

    from gpuwise.compat import FakeTensorMode, TorchDispatchMode, tree_leaves
    from gpuwise.planning.capture.blocks import find_blocks
    from gpuwise.planning.capture.step import default_dtype
    from gpuwise.planning.transforms.quantize import quantize_weights

    class Made(TorchDispatchMode):
        """(dtype, shape, storage bytes) of every op's outputs."""

        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.made += [(t.dtype, tuple(t.shape), t.untyped_storage().nbytes()) for t in tree_leaves(out)
                          if isinstance(t, torch.Tensor)]
            return out

    batch, seq, h, ffn, e = 2, 8, 64, 128, 4
    with FakeTensorMode(allow_non_fake_inputs=True), default_dtype(torch.bfloat16):
        built = _source(tmp_path, SMALL).build(Setup(task="infer", micro_batch=batch, seq=seq, precision="bf16"),
                                               batch, None)
        blocks = find_blocks(built.model)
        linear = sum(m.weight.numel() for m in blocks.modules() if isinstance(m, torch.nn.Linear))
        assert quantize_weights(blocks, "fp8", torch.bfloat16) == linear + 2 * e * 3 * h * ffn  # and the experts
        experts = blocks[0].mlp.experts
        assert not list(experts.parameters())  # fp8 weights and fp32 scales, one per expert matrix, as buffers
        assert (experts.gate_up_proj_weight.dtype, experts.gate_up_proj_weight.numel()) == (torch.float8_e4m3fn,
                                                                                             e * 2 * ffn * h)
        assert experts.gate_up_proj_weight_scale.numel() == e
        with torch.no_grad(), Made() as seen:
            built.run(built.model, built.inputs, built.targets, None)
    # the tokens entering the experts quantised to fp8, one fp32 scale each (vLLM's W8A8 fused MoE)
    assert (torch.float8_e4m3fn, (batch * seq, h), batch * seq * h) in seen.made
    assert (torch.float32, (batch * seq,), batch * seq * 4) in seen.made
    # and no 16-bit copy of an expert stack: the largest storage made is below one (the stand-in's views share one
    # matrix, counted as no memory)
    assert max(n for _, _, n in seen.made) < e * 2 * ffn * h * 2


@pytest.mark.parametrize(("args", "note"), [
    ({"task": "infer", "weights": "nf4"}, "4-bit conversion skips under transformers 5 (bitsandbytes#1849): they "
                                          "stay bf16"),
    ({"task": "infer", "weights": "int8"}, "int8 (LLM.int8) conversion skips"),
    ({"task": "finetune-lora", "qlora": True}, "they stay bf16 (fp32 after PEFT's prepare_model_for_kbit_training; "
                                               "--qlora-recipe plain keeps them bf16)"),
    ({"task": "infer", "weights": "int4"}, None),
])
def test_the_plan_says_when_bitsandbytes_leaves_the_experts_16_bit(tmp_path, args, note):
    pytest.importorskip("transformers")
    from rich.console import Console

    from gpuwise.planning.planner import plan
    from gpuwise.render.plan import plan_json, render_plan

    source = _source(tmp_path, SMALL)
    p = plan(source, Setup(micro_batch=2, seq=16, precision="bf16-mixed" if "qlora" in args else "bf16", **args),
             gpu="h100-sxm")
    fused = 2 * 4 * 3 * 64 * 128
    assert source.experts.fused == fused
    if note is None:
        assert p.notes == ()
        return
    assert p.notes == (f"{fused / 1e9:.1f} B expert weights are fused 3-D parameters, which bitsandbytes' "
                       + p.notes[0].split("bitsandbytes' ", 1)[1],)
    assert note in p.notes[0] and plan_json(p)["notes"] == list(p.notes)
    console = Console(record=True, width=200)
    render_plan(p, console)
    assert "bitsandbytes#1849" in console.export_text()
