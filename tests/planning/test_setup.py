"""The run's setup (planning/setup.py): refusals that name the flag at fault and its fix, a Request resolved in one
place, and ``largest_micro_batch`` against a brute-force search over every divisor."""

from __future__ import annotations

import pytest

from conftest import run_cli
from gpuwise.errors import GpuwiseError
from gpuwise.planning.setup import Request, Setup, largest_micro_batch, resolve


@pytest.mark.parametrize("optimizer", ["adamw8bit", "paged-adamw8bit"])
@pytest.mark.parametrize("offload", ["optimizer", "params"])
def test_offload_refuses_bitsandbytes_optimizers(optimizer, offload):
    """ZeRO-Offload's CPU Adam cannot step bitsandbytes' state (which was also subtracted twice as paged)."""
    with pytest.raises(GpuwiseError, match=f"where bitsandbytes' {optimizer} cannot run"):
        Setup(optimizer=optimizer, offload=offload, gpus=2, sharding="fsdp")


def test_parallelism_for_inference_is_refused_naming_the_flag(capsys):
    code, _, err = run_cli(capsys, "plan", "--model", "gpt2", "--task", "decode", "--tp", "2")
    assert code == 2 and "--tp 2: tensor/pipeline/context parallelism is planned for training" in err
    assert "--gpus" not in err and "--weights int8|nf4" in err


def test_error_messages_name_the_task_and_a_valid_precision():
    with pytest.raises(GpuwiseError) as e:
        Setup(task="decode", weights="fp16")
    assert "--precision fp16-mixed" in e.value.hint
    with pytest.raises(GpuwiseError, match="--task decode"):
        Setup(task="decode", loss="chunked")
    with pytest.raises(GpuwiseError, match="--task decode"):
        Setup(task="decode", optimizer_in_backward=True)


def test_a_request_resolves_to_its_setup_in_one_place():
    """What the user gave (None: not given) becomes the run: defaults are the Setup's, --gpus the product of the
    parallel degrees, PEFT's QLoRA turns checkpointing on unless it was given, and the batch splits as Setup.for_batch
    does; flags the task cannot use are one-line errors naming the fix."""
    assert resolve(Request()) == Setup()
    assert resolve(Request(batch=32, micro_batch=4, gpus=2)) == Setup.for_batch(batch=32, micro_batch=4, gpus=2)
    assert resolve(Request(tp=2, pp=2, batch=8)).gpus == 4
    assert resolve(Request(task="finetune-lora", qlora=True)).checkpointing == "full"
    assert resolve(Request(task="finetune-lora", qlora=True, checkpointing="none")).checkpointing == "none"
    assert resolve(Request(compile=False, sp=False, qlora=False)) == Setup()  # an unset flag is "not given"
    for request, message in ((Request(task="infer", optimizer="sgd"), "--optimizer has no meaning for --task infer"),
                             (Request(lora_rank=8), "--lora-rank applies to LoRA fine-tuning"),
                             (Request(ep=0), "--ep 0 is outside 1..4096"),
                             (Request(batch=6, micro_batch=4), "--batch 6 does not split evenly")):
        with pytest.raises(GpuwiseError, match=message):
            resolve(request)


def test_largest_micro_batch_against_a_brute_force_search():
    """Every (per_rank, limit) up to 64: the largest m in 1..limit with per_rank = m x accumulation, 0 if none."""
    for per_rank in range(1, 65):
        divisors = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
        for limit in range(-1, 65):
            expected = max((m for m in divisors if m <= limit), default=0)
            assert largest_micro_batch(per_rank, limit) == expected, (per_rank, limit)
