"""``gpuwise plan --task decode --context N`` and ``--weights int8|int4|nf4|fp8``: one generation step over a filled KV
cache, weight-only quantised inference, and the per-token latency floor, each against a hand-derived figure."""

from __future__ import annotations

import functools
import json

import pytest

from conftest import run_cli
from fakes.hf_configs import LLAMA_2_7B, _config
from gpuwise.hardware.catalog import load_catalog
from gpuwise.models import get_model
from gpuwise.planning import Setup, plan_model
from gpuwise.planning.cost.llm_step import WEIGHT_BYTES
from gpuwise.planning.planner import Planner
from gpuwise.planning.sources.zoo import ZooSource
from gpuwise.planning.transforms.quantize import FORMATS

run = run_cli

# Llama-2-7B from its published config.json (meta-llama/Llama-2-7b-hf): 32 layers, hidden 4096, MLP 11008, 32 heads
# and 32 KV heads of 128, vocabulary 32000, untied head. Per block the linear layers hold q,k,v,o 4 x 4096^2 and the
# SwiGLU MLP 3 x 4096 x 11008 weights; outside them the embedding and head (32000 x 4096 each) and the RMSNorm gains.
L7, D7, F7, V7 = 32, 4096, 11008, 32000
LINEAR_7B = L7 * (4 * D7 * D7 + 3 * D7 * F7)  # 6,476,005,376
OTHER_7B = 2 * V7 * D7 + (2 * L7 + 1) * D7  # 262,410,240, kept in 16 bits by bitsandbytes and AWQ
ROWS_7B = L7 * (4 * D7 + 3 * F7 - F7 + D7)  # output rows of the linear layers: q,k,v,o,down 4096, gate,up 11008
UNREAD_7B = (V7 - 1) * D7 * 2  # a decode step of one sequence looks up one row of the (untied) token embedding


@functools.cache
def _zoo(model: str, **setup) -> object:
    return plan_model(model, Setup(**setup), gpu="rtx-4090")


def kv_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int, batch: int) -> int:
    """K and V, 16-bit, of every layer for every token of every sequence (PagedAttention §3.1)."""
    return 2 * layers * kv_heads * head_dim * tokens * batch * 2


@pytest.mark.parametrize(("model", "kv_heads", "context", "batch"), [("llama2-7b", 32, 4095, 1),
                                                                      ("llama3-8b", 8, 8191, 2)])
def test_the_kv_cache_holds_the_context_and_the_new_token(model, kv_heads, context, batch):
    """Llama-2-7B (32 KV heads) and Llama-3-8B (8, grouped-query; meta-llama/Meta-Llama-3-8B config.json): 32 layers,
    head dim 128. The step reads and holds 2 x layers x kv_heads x head_dim x (N + 1) x batch x 2 bytes."""
    p = _zoo(model, task="decode", context=context, micro_batch=batch, precision="bf16")
    expected = kv_bytes(32, kv_heads, 128, context + 1, batch)
    assert p.decode.kv_cache_bytes == expected == p.breakdown["kv_cache"]
    assert p.tokens_per_step == batch and p.trainable_params == 0
    assert p.setup.context == context and f"{context:,} tokens cached" in p.setup.describe()


def test_decode_flops_are_the_matmuls_and_attention_over_the_cache():
    """GPT-2 (124M): 2 FLOPs per matmul weight per new token (the blocks' 84,934,656 and the tied head's 38,597,376)
    plus QK^T and PV over the N + 1 cached tokens, 4 x layers x 768 x (N + 1) per sequence (Kaplan et al. 2020)."""
    p = _zoo("gpt2", task="decode", context=256, micro_batch=2)
    assert p.flops_per_step == 2 * (84_934_656 + 38_597_376) * 2 + 4 * 12 * 768 * 257 * 2


def test_nf4_weights_as_bitsandbytes_stores_them():
    """bitsandbytes Linear4bit NF4 with double quantisation (QLoRA §2): 4 bits a weight, an 8-bit absmax per block of
    64, an fp32 constant per 256 absmax; the embedding, head and norms stay 16-bit (get_keys_to_not_convert).
    About 3.87 GB for Llama-2-7B, the ~3.9 GB people see for a 7B model loaded in 4 bits."""
    p = _zoo("llama2-7b", task="decode", context=1023, precision="bf16", weights="nf4")
    expected = LINEAR_7B * (0.5 + 1 / 64 + 4 / (64 * 256)) + 2 * OTHER_7B
    assert p.breakdown["weights"] == pytest.approx(expected, rel=1e-3)
    assert 3.8e9 < p.breakdown["weights"] < 3.9e9
    assert p.decode.weight_bytes == p.breakdown["weights"] - UNREAD_7B  # read: all but the embedding's other rows
    assert FORMATS["nf4"].bytes_per_weight() * 8 == pytest.approx(4.127, abs=1e-3)  # QLoRA §2: 4.127 bits


def test_int8_weights_as_llm_int8_stores_them():
    """bitsandbytes Linear8bitLt (LLM.int8, Dettmers et al. 2022): one int8 per weight (CB) and one fp32 absmax per
    output row (SCB); the rest 16-bit. Its matmul never makes a 16-bit copy of the weight."""
    p = _zoo("llama2-7b", task="decode", context=1023, precision="bf16", weights="int8")
    expected = LINEAR_7B + 4 * ROWS_7B + 2 * OTHER_7B  # 7,006,265,344
    assert p.breakdown["weights"] == pytest.approx(expected, rel=1e-4)
    assert p.decode.weight_bytes == p.breakdown["weights"] - UNREAD_7B
    assert p.breakdown["temporaries"] < 1 << 20  # no dequantised weight at batch 1


def test_the_weight_table_is_the_simulated_storage():
    """serving.WEIGHT_BYTES (recommend --serve) takes the simulated formats from quantize.FORMATS: one table. AWQ's
    int4 at group 128: 0.5 B + an fp16 scale and a 4-bit zero per 128 weights (AutoAWQ WQLinear_GEMM)."""
    assert WEIGHT_BYTES["int4"] == pytest.approx(0.5 + 2 / 128 + 0.5 / 128)
    assert all(WEIGHT_BYTES[k] == f.bytes_per_weight() for k, f in FORMATS.items())


def test_the_latency_floor_is_bytes_read_over_bandwidth():
    """Llama-2-7B in bf16, one sequence at 4,095 cached tokens, on an RTX 4090 (1,008 GB/s, NVIDIA Ada whitepaper):
    the step reads 2 x 6,738,415,616 weight bytes but the token embedding's 31,999 rows no sequence looks up, and a
    2 GiB cache: 15.24 ms a token, memory-bound (its 13.5 GFLOPs
    take 0.08 ms at 165 TFLOPS). The serving model's step (llm_step: kernels at their measured bandwidth, the
    runtime's host time) is slower than this floor."""
    acc = load_catalog().get("rtx-4090")
    assert acc.memory_bandwidth_gbps == 1008
    p = _zoo("llama2-7b", task="decode", context=4095, precision="bf16")
    read = 2 * (LINEAR_7B + OTHER_7B) - UNREAD_7B + kv_bytes(32, 32, 128, 4096, 1)
    (fit,) = p.gpus
    assert fit.token_floor_s == pytest.approx(read / 1008e9, rel=1e-3) == fit.step_time_bound_s == fit.step.bound_s
    assert fit.step.seconds > fit.token_floor_s  # the step modelled op by op is slower than its floor
    assert fit.token_floor_s == pytest.approx(15.24e-3, rel=2e-3)
    from gpuwise.planning.cost.llm_step import LlmShape, step_seconds
    from gpuwise.planning.cost.runtimes import RUNTIMES

    src = ZooSource(zoo=get_model("llama2-7b"))
    step = Planner(src).per_gpu(Setup(task="decode", micro_batch=1, context=4095, precision="bf16"))
    shape = LlmShape.of(step, src.decoder, kv_bytes=kv_bytes(32, 32, 128, 4096, 1))
    est = step_seconds(shape, acc, RUNTIMES["vllm"], decode=1, context=4096)
    assert est.seconds > fit.token_floor_s and est.bound == "memory"


def test_hf_config_and_zoo_agree_on_decode(tmp_path):
    """transformers' LlamaForCausalLM from Llama-2-7B's config.json, its own DynamicCache filled with N tokens, against
    the zoo's Llama with a static cache: within 3% on the peak (the DynamicCache's concatenation briefly holds one
    layer twice), the same weights and the same cache read."""
    pytest.importorskip("transformers")
    config = _config(tmp_path, LLAMA_2_7B)
    setup = Setup(task="decode", context=2047, micro_batch=2, precision="bf16", weights="int4")
    zoo = _zoo("llama2-7b", task="decode", context=2047, micro_batch=2, precision="bf16", weights="int4")
    hf = plan_model(None, setup, hf_config=config, gpu="rtx-4090")
    assert hf.peak_bytes == pytest.approx(zoo.peak_bytes, rel=0.03)
    assert hf.decode.kv_cache_bytes == zoo.decode.kv_cache_bytes == kv_bytes(32, 32, 128, 2048, 2)
    assert hf.decode.weight_bytes == pytest.approx(zoo.decode.weight_bytes, rel=1e-3)
    assert hf.trainable_params == 0 and hf.tokens_per_step == 2


def test_inference_trains_nothing():
    assert _zoo("gpt2", task="infer", seq=64).trainable_params == 0


def test_decode_json_carries_the_new_fields(capsys):
    code, out, err = run(capsys, "plan", "--model", "gpt2", "--task", "decode", "--context", "100", "--batch", "2",
                         "--weights", "int8", "--gpu", "rtx-4090", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["setup"]["context"] == 100 and data["setup"]["weights"] == "int8" and data["trainable_params"] == 0
    d = data["decode"]
    assert d["kv_cache_bytes"] == kv_bytes(12, 12, 64, 101, 2) and d["weight_bytes"] > 0
    (fit,) = data["gpus"]
    assert fit["token_floor_s"] == pytest.approx((d["weight_bytes"] + d["kv_cache_bytes"]) / 1008e9, rel=1e-3)
    code, out, err = run(capsys, "plan", "--model", "gpt2", "--task", "decode", "--context", "100", "--batch", "2",
                         "--weights", "int8", "--gpu", "rtx-4090")  # the same captures, as tables
    assert code == 0, err
    note = " ".join(out.split())  # the note wraps
    assert "token: one decode step modelled" in note and "bound: max(bytes read / bandwidth" in note
    assert "2 sequences x 100 cached tokens" in out and "int8 in the blocks'" in out


@pytest.mark.parametrize("args", [
    ["plan", "--model", "vit-b16", "--task", "decode"],
    ["plan", "--model", "bert-base", "--task", "decode", "--context", "64"],
    ["plan", "--model", "gpt2", "--weights", "nf4"],
    ["plan", "--model", "gpt2", "--task", "finetune-lora", "--weights", "int4"],
    ["plan", "--model", "gpt2", "--context", "64"],
    ["plan", "--model", "gpt2", "--task", "infer", "--context", "64"],
    ["plan", "--model", "gpt2", "--task", "decode", "--context", "0"],
    ["plan", "--model", "gpt2", "--task", "decode", "--context", "1024"],
    ["plan", "--model", "gpt2", "--task", "decode", "--seq", "64"],
    ["plan", "--model", "gpt2", "--task", "infer", "--weights", "int3"],
    ["plan", "--model", "gpt2", "--task", "infer", "--weights", "fp16"],
    ["train", "--task", "decode"],
    ["train", "--weights", "nf4"],
    ["train", "--context", "64"],
    ["recommend", "--model", "gpt2", "--task", "decode"],
    ["recommend", "--model", "gpt2", "--tokens", "1e9", "--weights", "int4"],
])
def test_bad_combinations_are_one_line_and_exit_2(capsys, args):
    code, out, err = run(capsys, *args)
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and "hint" in err and "Traceback" not in err


@pytest.mark.parametrize(("gpu", "measured_tok_s"), [("rtx-4090", 54.34), ("rtx-3090", 46.51)])
def test_the_floor_is_below_a_measured_decode(gpu, measured_tok_s):
    """llama.cpp F16 Llama-3-8B, tg at about 512 tokens of context (XiongjieDai/GPU-Benchmarks-on-LLM-Inference):
    54.34 tokens/s on an RTX 4090, 46.51 on an RTX 3090. The floor is faster than any real run, and not by much:
    a memory-bound step reaches 75-85% of the datasheet bandwidth there (the floor reads one row of the token
    embedding, not its 1 GB table)."""
    p = plan_model("llama3-8b", Setup(task="decode", context=512, precision="bf16"), gpu=gpu)
    ratio = (1 / measured_tok_s) / p.gpus[0].token_floor_s  # measured time over the floor
    assert 1.0 < ratio < 1.4


def test_a_sliding_window_cache_holds_its_window(tmp_path):
    """Mistral-7B-v0.1's config.json (sliding_window 4096, 8 KV heads of 128, 32 layers): transformers' sliding layers
    keep the last 4,095 tokens and attend over them and the new one, so 8,000 cached tokens read a 4,096-token cache:
    2 x 32 x 8 x 128 x 4096 x 2 bytes, and the peak holds one layer's concatenation more."""
    pytest.importorskip("transformers")
    config = _config(tmp_path, {
        "architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": False, "vocab_size": 32000})
    p = plan_model(None, Setup(task="decode", context=8000, precision="bf16"), hf_config=config, gpu="rtx-4090")
    assert p.decode.kv_cache_bytes == kv_bytes(32, 8, 128, 4096, 1)
    assert p.breakdown["kv_cache"] < 1.05 * p.decode.kv_cache_bytes


def test_a_model_from_a_file_has_no_decode_step(capsys, tmp_path):
    f = tmp_path / "net.py"
    f.write_text("import torch\nfrom torch import nn\n\ndef build(batch_size):\n"
                 "    return nn.Linear(8, 8), torch.randn(batch_size, 8)\n")
    code, _, err = run(capsys, "plan", "--model", f"{f}:build", "--task", "decode")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--task decode" in err


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_decode_step_gives_the_full_forwards_last_logits(family):
    """Real tensors: a prefill of T tokens into a static cache of T + 1, then one step at position T, gives the logits
    a full forward of the T + 1 tokens gives at its last position (rotary and learned positions offset, the new
    query attending to every cached key)."""
    import torch

    from gpuwise.models.gpt import GPT, GPTConfig
    from gpuwise.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    if family == "gpt":
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=50, block_size=32))
        heads, hd = 2, 8
    else:
        model = Llama(LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, dim=16, ffn_dim=32, vocab_size=50))
        heads, hd = 2, 4
    model.eval()
    idx = torch.randint(50, (2, 9))
    with torch.no_grad():
        full = model(idx)[:, -1]
        cache = [(torch.zeros(2, heads, 9, hd), torch.zeros(2, heads, 9, hd)) for _ in range(2)]
        model(idx[:, :8], kv_cache=cache)
        step = model(idx[:, 8:], kv_cache=cache, pos=8)[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


def test_a_model_too_big_for_the_card_is_offered_quantised_weights():
    """Llama-2-13B in bf16 (26 GB of weights) never fits a 24 GB RTX 4090; in LLM.int8 (13 GB) it decodes 8 sequences
    of 1,024 tokens there. The remedy is a flag plan takes as printed."""
    p = plan_model("llama2-13b", Setup(task="decode", context=1024, micro_batch=8, precision="bf16"), gpu="rtx-4090")
    assert not p.fits
    (r,) = p.remedies
    assert r.flags == "--weights int8" and r.fits and r.setup.weights == "int8"
