"""KV bytes and concurrency against config arithmetic; the bytes a decode step reads (one row of an untied
embedding) and the rate its weights run at. Tiny models (fakes/small_models.py). Decode speed: test_llm_step.py."""

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
    decode_floor,
    kv_bytes_per_token,
    max_concurrency,
)

CATALOG = load_catalog()
GiB = 2**30
W = CATEGORIES.index("weights")


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(layers=32, kv_heads=32, head_dim=128) == 524_288  # Llama-2-7B, fp16: 2*32*32*128*2
    assert kv_bytes_per_token(layers=32, kv_heads=8, head_dim=128) == 131_072  # Llama-3-8B, GQA 8 of 32 heads
    assert kv_bytes_per_token(layers=80, kv_heads=8, head_dim=128, kv_bytes=1) == 163_840  # Llama-2-70B, fp8 cache


def test_max_concurrency_by_hand():
    acc = CATALOG.get("h100-sxm")  # 80 GiB
    kv = kv_bytes_per_token(layers=32, kv_heads=8, head_dim=128) * 4096  # 512 MiB a sequence
    assert max_concurrency(acc, weight_bytes=16e9, kv_bytes_per_sequence=kv, activation_bytes=2e9) == int(
        (80 * GiB * 0.9 - 18e9) // kv)
    assert max_concurrency(acc, weight_bytes=100e9, kv_bytes_per_sequence=kv) == 0


@pytest.mark.parametrize("bad", [dict(layers=0), dict(head_dim=0), dict(kv_heads=-1), dict(kv_bytes=0)])
def test_bad_inputs_are_user_errors(bad):
    with pytest.raises(GpuwiseError):
        kv_bytes_per_token(**{**dict(layers=32, kv_heads=8, head_dim=128), **bad})
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
