"""The issue-14 review's findings, each pinned: offload under --pp, paged state and offload, the decode floor's bytes
and rate, refusals that name the flag at fault, labels that say the layout. Tiny models (fakes/small_models.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from conftest import run_cli
from fakes.small_models import GPT, LLAMA, PLANNERS, SEQ
from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import load_catalog
from gpuwise.planning import Setup
from gpuwise.planning.capture.tracker import CATEGORIES
from gpuwise.planning.cost.serving import DecodeRead, _rate, decode_floor
from gpuwise.planning.fit import fit_on
from gpuwise.planning.parallel.layout import layout
from gpuwise.planning.parallel.rank import check
from gpuwise.planning.remedies import TRAINING
from gpuwise.planning.transforms.qlora import Linear4bit
from gpuwise.planning.transforms.quantize import FORMATS

W, G = CATEGORIES.index("weights"), CATEGORIES.index("gradients")
FSDP_PP = Setup(micro_batch=1, grad_accum=4, seq=SEQ, gpus=4, pp=2, sharding="fsdp")


def _at_peak(step, col: int) -> float:
    return float(step.live[np.argmax(step.live.sum(axis=1)), col])


@pytest.mark.parametrize("offload", ["params", "optimizer"])
def test_offload_under_fsdp_pipeline_keeps_the_gathered_stage(offload):
    """torchtitan under PP keeps the stage's 16-bit parameters gathered and its gradients unsharded through the
    micro-batches: offload moves the sharded state to the host, not those (they were zeroed: gpt2 pp 2 --offload
    params showed weights and gradients 0, a peak 464 MiB low)."""
    planner = PLANNERS[GPT.name]
    kept = planner.per_gpu(FSDP_PP)
    off = planner.per_gpu(replace(FSDP_PP, offload=offload))
    w = planner.workload(FSDP_PP)
    assert _at_peak(off, G) == pytest.approx(_at_peak(kept, G))  # the accumulated fp32 gradients
    gathered = w.timeline.base[:, W].max()  # the stage's 16-bit parameters, as captured
    assert _at_peak(off, W) >= gathered > 0
    assert off.host_bytes > 0 and off.peak_bytes < kept.peak_bytes


@pytest.mark.parametrize("optimizer", ["adamw8bit", "paged-adamw8bit"])
@pytest.mark.parametrize("offload", ["optimizer", "params"])
def test_offload_refuses_bitsandbytes_optimizers(optimizer, offload):
    """ZeRO-Offload's CPU Adam cannot step bitsandbytes' state (which was also subtracted twice as paged)."""
    with pytest.raises(GpuwiseError, match=f"where bitsandbytes' {optimizer} cannot run"):
        Setup(optimizer=optimizer, offload=offload, gpus=2, sharding="fsdp")


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


def test_parallelism_for_inference_is_refused_naming_the_flag(capsys):
    code, _, err = run_cli(capsys, "plan", "--model", "gpt2", "--task", "decode", "--tp", "2")
    assert code == 2 and "--tp 2: tensor/pipeline/context parallelism is planned for training" in err
    assert "--gpus" not in err and "--weights int8|nf4" in err


def test_sequence_parallel_needs_a_sequence_tp_divides():
    with pytest.raises(GpuwiseError, match="--sequence-parallel splits --seq 126 over --tp 4") as e:
        check(GPT, Setup(seq=126, tp=4, gpus=4, sp=True))
    assert "pass --seq 128" in e.value.hint


def test_error_messages_name_the_task_and_a_valid_precision():
    with pytest.raises(GpuwiseError) as e:
        Setup(task="decode", weights="fp16")
    assert "--precision fp16-mixed" in e.value.hint
    with pytest.raises(GpuwiseError, match="--task decode"):
        Setup(task="decode", loss="chunked")
    with pytest.raises(GpuwiseError, match="--task decode"):
        Setup(task="decode", optimizer_in_backward=True)


def test_remedy_labels_say_the_layout():
    """Under --tp the LoRA rows keep the layout (they said 'one GPU'); FSDP names the GPUs it shards over."""
    names = {s.change.__name__: s.name for s in TRAINING}
    tp2 = Setup(task="finetune-lora", gpus=2, tp=2)
    assert names["lora"](tp2) == "LoRA rank 16, 2 GPUs (tp 2) (fine-tuning only)"
    assert names["lora"](Setup(task="finetune-lora")) == "LoRA rank 16, one GPU (fine-tuning only)"
    fsdp = Setup(gpus=8, tp=2, sharding="fsdp", micro_batch=1)
    assert names["fsdp"](fsdp) == "FSDP over 4 GPUs x tp 2 = 8 GPUs (global batch 4)"


def test_no_fp8_means_no_micro_batch():
    """A GPU without fp8 tensor cores cannot run --precision fp8: 'no', and no max micro-batch (was 347 on A100)."""
    step = PLANNERS[GPT.name].per_gpu(Setup(seq=SEQ, precision="fp8"), batch_model=True)
    fit = fit_on(step, load_catalog().get("a100-80gb-sxm"))
    assert fit.status == "no" and fit.max_batch == 0
    assert fit_on(step, load_catalog().get("h100-sxm")).max_batch > 0


def test_fsdp_over_the_context_parallel_ranks_is_named():
    s = Setup(seq=SEQ, gpus=8, tp=2, pp=2, cp=2, sharding="fsdp")
    assert "fsdp over the 2 cp ranks" in s.describe()
    assert layout(s, 4, 0).sharding == "fsdp"


def test_one_bubble_and_one_nf4_table():
    s = Setup(gpus=4, pp=4, grad_accum=8)
    assert s.pipeline_bubble == pytest.approx(3 / 11) and layout(s, 4, 0).bubble == s.pipeline_bubble
    import torch

    lin = Linear4bit(torch.nn.Linear(256, 96, bias=False, device="meta"), torch.bfloat16)
    assert sum(b.nbytes for b in lin.buffers()) == FORMATS["nf4"].nbytes(96, 256)
