"""The Trainer on the CPU: the loss falls, accumulation equals one big batch, a resumed run repeats the
uninterrupted one exactly, a non-finite loss stops with the step, the LR schedule is nanoGPT's."""

from __future__ import annotations

import math

import pytest
import torch

from gpuwise.errors import GpuwiseError
from gpuwise.models.gpt import GPT, GPTConfig
from gpuwise.training.config import TrainConfig
from gpuwise.training.data import CharText
from gpuwise.training.trainer import Trainer, cosine_with_warmup

DATA = CharText(seq=32)


def _trainer(config: TrainConfig, **kwargs) -> Trainer:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=48, vocab_size=DATA.vocab_size, block_size=32))
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    return Trainer(model, opt, DATA, config, **kwargs)


def test_the_loss_falls_on_the_text_python_ships():
    result = _trainer(TrainConfig(steps=60, batch=16, lr=1e-2, warmup_steps=5, log_every=1)).fit()
    assert result.logs[0].loss == pytest.approx(math.log(DATA.vocab_size), abs=0.3)  # starts at chance
    last = [log.loss for log in result.logs[-5:]]
    assert sum(last) / len(last) < result.logs[0].loss - 1.0
    assert all(log.tokens_per_s > 0 for log in result.logs)


def test_accumulation_equals_one_big_batch():
    whole = _trainer(TrainConfig(steps=5, batch=16, log_every=1, grad_clip=None)).fit()
    parts = _trainer(TrainConfig(steps=5, batch=16, micro_batch=4, log_every=1, grad_clip=None)).fit()
    for a, b in zip(whole.logs, parts.logs, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-5)


def test_resume_repeats_the_uninterrupted_run_exactly(tmp_path):
    config = TrainConfig(steps=12, batch=8, log_every=1, checkpoint_every=6)
    straight = _trainer(config).fit()
    first = _trainer(TrainConfig(steps=6, batch=8, log_every=1), checkpoint_dir=tmp_path).fit()
    assert [log.loss for log in first.logs] == [log.loss for log in straight.logs[:6]]
    torch.manual_seed(999)  # a fresh process would not share the first run's RNG: the checkpoint restores it
    resumed = _trainer(config, checkpoint_dir=tmp_path).fit(resume=True)
    assert resumed.resumed_from == 6
    assert [log.loss for log in resumed.logs] == [log.loss for log in straight.logs[6:]]


def test_resume_refuses_another_config_and_names_the_difference(tmp_path):
    _trainer(TrainConfig(steps=2, batch=8), checkpoint_dir=tmp_path).fit()
    with pytest.raises(GpuwiseError, match="written with batch 8, this run has 4"):
        _trainer(TrainConfig(steps=4, batch=4), checkpoint_dir=tmp_path).fit(resume=True)
    wider = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=DATA.vocab_size, block_size=32))
    trainer = Trainer(wider, torch.optim.AdamW(wider.parameters()), DATA, TrainConfig(steps=4, batch=8),
                      checkpoint_dir=tmp_path)
    with pytest.raises(GpuwiseError, match=r"from another model: wte.weight is \[\[\d+, 48\], 'float32'\] there"):
        trainer.fit(resume=True)


def test_a_non_finite_loss_stops_with_the_step():
    trainer = _trainer(TrainConfig(steps=5, batch=4))
    forward = trainer.model.forward
    calls = {"n": 0}

    def poisoned(idx, targets=None):
        calls["n"] += 1
        loss = forward(idx, targets)
        return loss * float("nan") if calls["n"] == 3 else loss

    trainer.model.forward = poisoned
    with pytest.raises(GpuwiseError, match="the loss is nan at step 3"):
        trainer.fit()


def test_fp16_keeps_one_scaler_for_the_run():
    trainer = _trainer(TrainConfig(steps=3, batch=4, precision="fp16-mixed"))
    scaler = trainer.scaler
    trainer.fit()
    assert trainer.scaler is scaler and scaler.is_enabled()


def test_schedule_warms_up_then_follows_a_cosine():
    f = cosine_with_warmup(TrainConfig(steps=110, warmup_steps=10, min_lr_ratio=0.1))
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(110) == pytest.approx(0.1)


def test_batches_are_a_function_of_their_number():
    a, b = DATA.batch(7, 4), DATA.batch(7, 4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1][:, :-1], a[0][:, 1:])  # targets: the next character
    assert not torch.equal(DATA.batch(8, 4)[0], a[0])


def test_auto_picks_the_largest_micro_batch_the_plan_fits():
    """Between the plan's peaks at micro-batch 4 and 8, the choice is 4 (the largest divisor of 16 that fits)."""
    from dataclasses import replace

    from gpuwise.models import get_model
    from gpuwise.planning.setup import Setup
    from gpuwise.planning.source import ZooSource
    from gpuwise.planning.workload import simulate
    from gpuwise.training.auto import choose

    gpt = GPTConfig(n_layer=2, n_head=2, n_embd=48, vocab_size=DATA.vocab_size, block_size=32)
    src = ZooSource(zoo=replace(get_model("gpt2"), config=gpt, default_seq=32, max_seq=32))

    def peak(micro: int) -> float:
        w = simulate(src, Setup(batch=micro, seq=32, precision="fp32", grad_accum=2), batch_model=False)
        return float(w.timeline.live(micro).sum(axis=1).max())

    free = (peak(4) + peak(8)) / 2 / 0.9  # 10% headroom is kept
    choice = choose(src, precision=None, seq=32, per_rank=16, free_bytes=int(free), device_type="cpu", bf16=False)
    assert (choice.precision, choice.micro_batch, choice.grad_accum) == ("fp32", 4, 4)
    assert "micro-batch 4 x 4 accumulation" in choice.reason
    gpu = choose(src, precision=None, seq=32, per_rank=16, free_bytes=80 * 2**30, device_type="cuda", bf16=True)
    assert gpu.precision == "bf16-mixed" and gpu.micro_batch == 16
