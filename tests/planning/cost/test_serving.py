"""Decode speed, KV bytes and concurrency against published llama.cpp and config arithmetic; the bytes a decode
step reads (one row of an untied embedding) and the rate its weights run at. Tiny models (fakes/small_models.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fakes.small_models import GPT, LLAMA, PLANNERS, SEQ
from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import load_catalog
from gpuwise.planning import Setup
from gpuwise.planning.capture.tracker import CATEGORIES
from gpuwise.planning.cost.serving import (
    DecodeRead,
    _rate,
    bytes_per_weight,
    decode_floor,
    decode_time,
    kv_bytes_per_token,
    max_concurrency,
)

CATALOG = load_catalog()
GiB = 2**30
W = CATEGORIES.index("weights")
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


def test_decode_reads_one_row_of_an_untied_embedding():
    """A decode step looks up B rows of an untied token embedding (Llama: 512 x 256 here), not the table; the head
    is read whole. Llama-3-8B nf4, batch 8 at 4,096 tokens on an RTX 4090: 9.92 -> 8.88 ms."""
    s = Setup(task="decode", micro_batch=2, context=64, precision="bf16")
    step = PLANNERS[LLAMA.name].per_gpu(s)
    read = DecodeRead.of(step)
    stored = int(step.live[step.timeline.end_of_forward, W])
    assert stored - read.weight_bytes == (512 - 2) * 256 * 2


def test_a_tied_embedding_is_read_whole():
    """GPT's wte is the head's weight: read whole; its learned positions (128 x 256) only B rows."""
    s = Setup(task="decode", micro_batch=2, context=64, precision="bf16")
    step = PLANNERS[GPT.name].per_gpu(s)
    stored = int(step.live[step.timeline.end_of_forward, W])
    assert stored - DecodeRead.of(step).weight_bytes == (SEQ - 2) * 256 * 2


def test_w8a8_weights_run_at_their_own_rate():
    """--weights int8 (LLM.int8) and fp8 (vLLM) multiply in int8 / fp8 where the catalog has the rate; weight-only
    int4/nf4 in 16 bits; fp8 on an A100 (no fp8) falls back to bf16."""
    cat = load_catalog()
    h100, a100 = cat.get("h100-sxm"), cat.get("a100-80gb-sxm")
    assert _rate(h100, None, "fp8")[:2] == ("fp8", h100.peak_tflops.fp8)
    assert _rate(a100, None, "int8")[:2] == ("int8", a100.peak_tflops.int8)
    assert _rate(a100, None, "fp8")[0] == _rate(a100, None, "nf4")[0] == "bf16"
    read = DecodeRead(weight_bytes=1, kv_cache_bytes=0, flops=int(1e15), context=1, batch=1, weights="int8")
    fast, slow = decode_floor(a100, read), decode_floor(a100, replace(read, weights=None))
    assert fast.bound == "compute" and fast.seconds < slow.seconds
