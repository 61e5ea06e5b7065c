"""Decode speed, KV bytes and concurrency against published llama.cpp and config arithmetic."""

from __future__ import annotations

import pytest

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import load_catalog
from gpuwise.planning.cost.serving import bytes_per_weight, decode_time, kv_bytes_per_token, max_concurrency

CATALOG = load_catalog()
GiB = 2**30
LLAMA3_8B = dict(params=8.03e9, layers=32, kv_heads=8, heads=32, head_dim=128)


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(layers=32, kv_heads=32, head_dim=128) == 524_288  # Llama-2-7B, fp16: 2*32*32*128*2
    assert kv_bytes_per_token(layers=32, kv_heads=8, head_dim=128) == 131_072  # Llama-3-8B, GQA 8 of 32 heads
    assert kv_bytes_per_token(layers=80, kv_heads=8, head_dim=128, kv_bytes=1) == 163_840  # Llama-2-70B, fp8 cache


@pytest.mark.parametrize(("gpu", "gib", "published", "band"), [
    # XiongjieDai/GPU-Benchmarks-on-LLM-Inference, LLaMA 3 8B, tg1024 (mean context 512); band = the fit's error
    ("rtx-4090", 4.58, 127.74, 0.10),  # Q4_K_M, in the GDDR fit set
    ("l40s", 4.58, 113.60, 0.10),  # held out
    ("rtx-6000-ada", 14.96, 51.97, 0.10),  # F16, held out
    ("a40", 14.96, 33.95, 0.10),  # held out
    ("h100-pcie", 14.96, 67.79, 0.25),  # F16, held out of the HBM fit (A100 only)
])
def test_decode_tokens_per_second_against_llama_cpp(gpu, gib, published, band):
    t = decode_time(CATALOG.get(gpu), **LLAMA3_8B, weight_bytes=gib * GiB, context=512)
    assert t.tokens_per_s == pytest.approx(published, rel=band)
    assert t.bound == "memory" and t.tokens_per_s == t.tokens_per_s_per_user


def test_batching_shares_the_weight_read_until_compute_binds():
    h100 = CATALOG.get("h100-sxm")
    one = decode_time(h100, **LLAMA3_8B, context=2048)
    many = decode_time(h100, **LLAMA3_8B, batch=64, context=2048)
    assert many.tokens_per_s > 20 * one.tokens_per_s and many.tokens_per_s_per_user < one.tokens_per_s_per_user
    huge = decode_time(h100, **LLAMA3_8B, batch=4096, context=16)
    assert huge.bound == "compute"


def test_quantisation_and_experts_cut_the_bytes_read():
    acc = CATALOG.get("rtx-4090")
    bf16 = decode_time(acc, **LLAMA3_8B)
    int4 = decode_time(acc, **LLAMA3_8B, quant="int4")
    assert 0.5 < bytes_per_weight("int4") < 0.55
    # one byte a weight plus their scales (an fp32 per row for LLM.int8, one per tensor for fp8): quantize.FORMATS
    assert bytes_per_weight("int8") == pytest.approx(1, abs=1e-3) and bytes_per_weight("fp8") == pytest.approx(1)
    assert int4.tokens_per_s > 2.5 * bf16.tokens_per_s
    moe = decode_time(acc, params=46.7e9, active_params=12.9e9, layers=32, kv_heads=8, head_dim=128, quant="int4")
    dense = decode_time(acc, params=46.7e9, layers=32, kv_heads=8, head_dim=128, quant="int4")
    assert moe.tokens_per_s > 2.5 * dense.tokens_per_s  # 3.6x fewer bytes, the same fixed 3 ms


def test_time_to_first_token_grows_with_the_prompt():
    acc = CATALOG.get("a100-80gb-sxm")
    short = decode_time(acc, **LLAMA3_8B, prompt_tokens=128)
    long = decode_time(acc, **LLAMA3_8B, prompt_tokens=8192)
    assert short.ttft_s < long.ttft_s
    # 2 x 8.03e9 x 8192 FLOPs + causal attention (2 x 32 x 4096 x 8192^2) at ~0.57 of 312 TFLOPS ~ 0.85 s
    assert long.ttft_s == pytest.approx(0.85, rel=0.15)


def test_max_concurrency_by_hand():
    acc = CATALOG.get("h100-sxm")  # 80 GiB
    kv = kv_bytes_per_token(layers=32, kv_heads=8, head_dim=128) * 4096  # 512 MiB a sequence
    assert max_concurrency(acc, weight_bytes=16e9, kv_bytes_per_sequence=kv, activation_bytes=2e9) == int(
        (80 * GiB * 0.9 - 18e9) // kv)
    assert max_concurrency(acc, weight_bytes=100e9, kv_bytes_per_sequence=kv) == 0


@pytest.mark.parametrize("bad", [dict(params=0), dict(batch=0), dict(context=-1), dict(quant="int3"),
                                 dict(active_params=9e9), dict(head_dim=0), dict(prompt_tokens=-5)])
def test_bad_inputs_are_user_errors(bad):
    with pytest.raises(GpuwiseError):
        decode_time(CATALOG.get("rtx-4090"), **{**LLAMA3_8B, **bad})
    with pytest.raises(GpuwiseError):
        max_concurrency(CATALOG.get("rtx-4090"), weight_bytes=1e9, kv_bytes_per_sequence=1e6, utilization=1.5)
