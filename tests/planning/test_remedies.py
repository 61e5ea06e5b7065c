"""Remedies: the flags each row prints run the row's setup in ``gpuwise plan``, whatever form the user's command
took, the steps apply in order, cumulatively, skipping what does not apply, and the labels say the layout."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field, replace

import pytest

from conftest import run_cli
from gpuwise.errors import GpuwiseError, NotApplicable
from gpuwise.planning import Setup, plan_model
from gpuwise.planning.fit import OVERHEAD_BYTES, GpuFit, status
from gpuwise.planning.remedies import TRAINING, remedies, settings, setup_flags
from gpuwise.render._common import to_jsonable
from gpuwise.units import GiB


def parsed(capsys, monkeypatch, flags: list[str]) -> Setup:
    """The Setup ``gpuwise plan`` makes of ``flags`` (its own parsing: the last of a repeated flag wins)."""
    seen = []

    def record(model, setup, **_):
        seen.append(setup)
        raise GpuwiseError("recorded")

    # the module, not the function the package exports under the same name
    monkeypatch.setattr(importlib.import_module("gpuwise.planning.planner"), "plan_model", record)
    code, _, err = run_cli(capsys, "plan", "--model", "gpt2", "--gpu", "h100", *flags)
    assert code == 2 and seen, err
    return seen[0]


BASES = [
    [], ["--batch", "8"], ["--micro-batch", "8"], ["--batch", "8", "--micro-batch", "8"],
    ["--batch", "16", "--micro-batch", "2"], ["--batch", "16", "--micro-batch", "2", "--gpus", "2"],
    ["--batch", "32", "--micro-batch", "4", "--gpus", "2", "--sharding", "zero2"],
    ["--precision", "fp32", "--batch", "64"], ["--task", "infer", "--batch", "64"],
    ["--task", "infer", "--micro-batch", "64"],
]


def _changes(s: Setup) -> list[Setup]:
    """Setups a remedy could propose from ``s``: another split of the same batch, FSDP, precision, LoRA."""
    if not s.training:
        return [replace(s, micro_batch=m) for m in (1, 3, s.micro_batch - 1) if 0 < m < s.micro_batch]
    per_gpu = s.micro_batch * s.grad_accum
    out = [replace(s, precision="bf16-mixed", checkpointing="full"), replace(s, task="finetune-lora"),
           replace(s, task="finetune-lora", qlora=True, checkpointing="full")]
    out += [replace(s, micro_batch=m, grad_accum=per_gpu // m) for m in (1, 2, per_gpu) if per_gpu % m == 0]
    for n in (2, 4, 64):
        share = max(s.batch // n, 1)
        out += [replace(s, gpus=n, sharding="fsdp", micro_batch=m, grad_accum=share // m)
                for m in (1, share) if share % m == 0]
    split = replace(s, micro_batch=1, grad_accum=per_gpu)
    out += [replace(split, task="finetune-lora"), replace(split, gpus=2, sharding="fsdp")]
    return out


@pytest.mark.parametrize("base_flags", BASES, ids=" ".join)
def test_flags_give_the_remedy_setup_whatever_the_command_said(capsys, monkeypatch, base_flags):
    base = parsed(capsys, monkeypatch, base_flags)
    for target in _changes(base):
        flags = setup_flags(target, base)
        assert "--grad-accum" not in flags
        assert parsed(capsys, monkeypatch, [*base_flags, *flags.split()]) == target, flags


@pytest.mark.parametrize(("target", "base", "flags"), [
    (Setup(micro_batch=16, grad_accum=4, checkpointing="full"), Setup(micro_batch=64),
     "--batch 64 --micro-batch 16 --checkpointing full"),  # accumulation appears: the batch is stated too
    (Setup(micro_batch=2, grad_accum=2, gpus=8, sharding="fsdp"), Setup(micro_batch=2, grad_accum=8, gpus=2),
     "--gpus 8 --sharding fsdp"),  # the command gave both already; the same global batch 32
    (Setup(micro_batch=1, gpus=32, sharding="fsdp"), Setup(), "--batch 32 --gpus 32 --sharding fsdp"),
    (Setup(micro_batch=1, gpus=8, sharding="fsdp"), Setup(micro_batch=8), "--micro-batch 1 --gpus 8 --sharding fsdp"),
    # --qlora alone turns checkpointing on (PEFT's recipe), so a QLoRA setup without it says so
    (Setup(task="finetune-lora", qlora=True), Setup(),
     "--task finetune-lora --checkpointing none --lora-rank 16 --qlora"),
])
def test_flag_forms(target, base, flags):
    assert setup_flags(target, base) == flags


# --- the chain, on a GPU whose memory is a formula ----------------------------------------------------------


@dataclass
class FormulaGpu:
    """Peak = states (16 B/param mixed or fp32 AdamW, sharded by FSDP) + activations per sample (halved by 16 bits,
    / 8 with checkpointing, / 2 with selective checkpointing) x micro-batch; LoRA trains 1% of the weights."""

    memory_bytes: int
    bf16: bool = True
    params: int = GiB // 4
    act_bytes: int = GiB // 2  # per sample in fp32, no checkpointing
    lora_applies: bool = True
    fitted: list[Setup] = field(default_factory=list)

    def peak(self, s: Setup) -> int:
        trained = self.params // 100 if s.task == "finetune-lora" else self.params
        frozen = (self.params - trained) * (0.5 if s.qlora else s.compute_dtype.itemsize)
        states = (16 * trained + frozen) / (s.gpus if s.sharding == "fsdp" else 1)
        act = self.act_bytes * s.compute_dtype.itemsize / 4 / {"full": 8, "selective": 2}.get(s.checkpointing, 1)
        return int(states + act * s.micro_batch)

    def fit(self, setup: Setup, *, batch_model: bool = False) -> GpuFit:
        if setup.task == "finetune-lora" and not self.lora_applies:
            raise NotApplicable("no nn.Linear in the blocks", "plan --task train")
        self.fitted.append(setup)
        required = self.peak(setup) + OVERHEAD_BYTES
        one = self.peak(replace(setup, micro_batch=1)) + OVERHEAD_BYTES
        per_sample = self.peak(replace(setup, micro_batch=2)) - self.peak(replace(setup, micro_batch=1))
        best = 1 + (self.memory_bytes - one) // per_sample if one <= self.memory_bytes else 0
        return GpuFit(gpu="formula", name="formula", memory_bytes=self.memory_bytes, required_bytes=required,
                      headroom_bytes=self.memory_bytes - required, status=status(self.memory_bytes - required,
                      self.memory_bytes), max_batch=int(best) if batch_model else 0, step_time_s=None,
                      step_time_bound_s=None, rates=None)


def test_each_step_builds_on_the_kept_ones_before():
    gpu = FormulaGpu(memory_bytes=24 * GiB, act_bytes=GiB)
    base = Setup(micro_batch=512, precision="fp32")
    rows = remedies(base, gpu)
    # bf16 + checkpointing: 4 GiB of states + 512 x 64 MiB; 311 samples fit, 256 is the largest that divides 512
    assert [r.name for r in rows] == [
        "bf16 mixed precision", "activation checkpointing", "micro-batch 256 x 2 accumulation (same batch)",
        "LoRA rank 16, one GPU (fine-tuning only)", "QLoRA, 4-bit base, one GPU (fine-tuning only)"]
    assert [r.setup.batch for r in rows] == [512] * 5  # the global batch never changes
    assert rows[3].setup == replace(rows[2].setup, task="finetune-lora")  # LoRA on top of the split
    for r in rows:
        assert r.required_bytes == gpu.peak(r.setup) + OVERHEAD_BYTES
        assert r.status == status(gpu.memory_bytes - r.required_bytes, gpu.memory_bytes)
    assert rows[2].fits and not rows[1].fits


def test_fsdp_only_while_short_and_lora_from_the_one_gpu_step():
    gpu = FormulaGpu(memory_bytes=4 * GiB, act_bytes=GiB // 64)
    rows = remedies(Setup(micro_batch=8), gpu)
    names = [r.name for r in rows]
    assert names[0] == "activation checkpointing" and not rows[0].fits
    fsdp = rows[1]
    assert fsdp.name == "FSDP over 2 GPUs (global batch 8)" and fsdp.status == "fits"
    assert fsdp.setup.gpus == 2 and fsdp.setup.micro_batch * fsdp.setup.grad_accum == 4
    assert rows[2].setup.gpus == 1 and rows[2].setup.task == "finetune-lora"  # not on top of FSDP
    roomy = FormulaGpu(memory_bytes=80 * GiB)
    assert [r.name for r in remedies(Setup(micro_batch=200), roomy)][:2] == [  # fits: no split, no FSDP
        "activation checkpointing (selective: torchtitan's op policy)",  # with room: selective, not whole blocks
        "LoRA rank 16, one GPU (fine-tuning only)"]


def test_a_step_the_model_cannot_take_is_left_out():
    gpu = FormulaGpu(memory_bytes=24 * GiB, lora_applies=False, bf16=False)
    names = [r.name for r in remedies(Setup(micro_batch=64, precision="fp32"), gpu)]
    assert names[0] == "fp16 mixed precision"  # no bf16 on this GPU
    assert not any("LoRA" in n for n in names)


def test_inference_gets_a_smaller_batch_only():
    gpu = FormulaGpu(memory_bytes=24 * GiB, params=GiB)
    (row,) = remedies(Setup(task="infer", micro_batch=64), gpu)
    assert row.name == f"smaller batch {row.setup.micro_batch}" and row.fits
    assert not FormulaGpu(memory_bytes=24 * GiB, params=GiB).fit(replace(row.setup, micro_batch=row.setup.micro_batch
                                                                         + 1)).fits


# --- the real planner: every remedy's flags, added to the command, give the remedy's memory -------------------


@pytest.mark.parametrize(("command", "given"), [
    (["--model", "gpt2", "--batch", "64", "--seq", "1024", "--gpu", "t4"], {"batch": 64}),
    (["--model", "gpt2", "--micro-batch", "64", "--seq", "1024", "--gpu", "t4"], {"micro_batch": 64}),
    # the command test_plan.py's test_remedies_in_order_with_flags plans: the session captures it once
    (["--model", "llama2-7b", "--seq", "2048", "--batch", "8", "--precision", "fp32", "--gpu", "rtx-4090"],
     {"batch": 8, "precision": "fp32"}),
    (["--model", "llama2-7b", "--task", "infer", "--batch", "64", "--seq", "2048", "--gpu", "rtx-4090"],
     {"batch": 64, "task": "infer"}),
], ids=["gpt2-batch", "gpt2-micro-batch", "llama2-7b-fp32", "llama2-7b-infer"])
def test_remedy_flags_reproduce_the_remedy_in_plan(capsys, monkeypatch, command, given):
    model, seq, gpu = command[1], int(command[command.index("--seq") + 1]), command[-1]
    expected = plan_model(model, Setup.for_batch(seq=seq, **given), gpu=gpu)
    assert not expected.fits and expected.remedies
    plan_module = importlib.import_module("gpuwise.planning.planner")  # the package exports a function of that name
    monkeypatch.setattr(plan_module, "remedies", lambda *a, **k: ())  # the re-plans' own remedies are not checked
    for remedy in expected.remedies:
        code, out, err = run_cli(capsys, "plan", *command, *remedy.flags.split(), "--json")
        assert code == 0, err
        again = json.loads(out)
        assert again["peak_bytes"] == remedy.peak_bytes, remedy.name
        (fit,) = again["gpus"]
        assert fit["required_bytes"] == remedy.required_bytes and fit["status"] == remedy.status
        assert again["setup"] == {**to_jsonable(remedy.setup), "batch": remedy.setup.batch}


def test_a_search_walks_the_remedies_checkpointing_before_fsdp_and_leaves_the_users_choices():
    """recommend's order on a fixed GPU count: every combination of the earlier remedies before a later one."""
    pairs = [(s.sharding, s.checkpointing) for s in settings(Setup(gpus=4))]
    assert pairs == [("ddp", "none"), ("ddp", "full"), ("fsdp", "none"), ("fsdp", "full")]
    assert [(s.sharding, s.checkpointing) for s in settings(Setup(gpus=1))] == [("ddp", "none"), ("ddp", "full")]
    given = settings(Setup(gpus=4, checkpointing="selective"), given=frozenset({"checkpointing"}))
    assert [(s.sharding, s.checkpointing) for s in given] == [("ddp", "selective"), ("fsdp", "selective")]
    assert settings(Setup(gpus=4, sharding="zero2"), given=frozenset({"sharding", "checkpointing"})) == [
        Setup(gpus=4, sharding="zero2")]


def test_remedy_labels_say_the_layout():
    """Under --tp the LoRA rows keep the layout (they said 'one GPU'); FSDP names the GPUs it shards over."""
    names = {s.change.__name__: s.name for s in TRAINING}
    tp2 = Setup(task="finetune-lora", gpus=2, tp=2)
    assert names["lora"](tp2) == "LoRA rank 16, 2 GPUs (tp 2) (fine-tuning only)"
    assert names["lora"](Setup(task="finetune-lora")) == "LoRA rank 16, one GPU (fine-tuning only)"
    fsdp = Setup(gpus=8, tp=2, sharding="fsdp", micro_batch=1)
    assert names["fsdp"](fsdp) == "FSDP over 4 GPUs x tp 2 = 8 GPUs (global batch 4)"
