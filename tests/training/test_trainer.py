"""The Trainer on the CPU: the loss falls, accumulation equals one big batch, a resumed run repeats the
uninterrupted one exactly, a non-finite loss stops with the step, the LR schedule is nanoGPT's."""

from __future__ import annotations

import math

import pytest
import torch

from gpuwise.errors import GpuwiseError
from gpuwise.models.gpt import GPT, GPTConfig
from gpuwise.training import checkpoint as ckpt
from gpuwise.training.config import TrainConfig
from gpuwise.training.data import CharText
from gpuwise.training.loss import model_loss
from gpuwise.training.trainer import Runtime, Trainer, cosine_with_warmup

DATA = CharText(seq=32)


def _trainer(config: TrainConfig, **kwargs) -> Trainer:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=48, vocab_size=DATA.vocab_size, block_size=32))
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    loss_fn, eval_data = kwargs.pop("loss_fn", model_loss), kwargs.pop("eval_data", None)
    return Trainer(model, opt, DATA, config, loss_fn=loss_fn, eval_data=eval_data, runtime=Runtime(**kwargs))


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


def _dropout_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(32, 3))


def _dataset():
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(40, 8, generator=g), torch.randint(3, (40,), generator=g))


@pytest.mark.parametrize("kind", ["char-gpt", "dropout-dataset"])
def test_resume_repeats_the_uninterrupted_run_exactly(tmp_path, kind):
    """Half a run, a fresh process state, the other half from the checkpoint: the same losses bit for bit.
    The dropout model draws from the global RNG and its Dataset is read by a DataLoader, so this fails if the
    RNG state is not restored or if the loader takes its seed from the global RNG."""
    import shutil

    config = TrainConfig(steps=12, batch=8, log_every=1, checkpoint_every=6)

    def trainer(folder):
        if kind == "char-gpt":
            return _trainer(config, checkpoint_dir=folder)
        model = _dropout_net()
        return Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _dataset(), config,
                       runtime=Runtime(checkpoint_dir=folder))

    straight = trainer(tmp_path / "a").fit()
    trainer(tmp_path / "b").fit()
    shutil.rmtree(tmp_path / "b" / "step-000000012")  # as if killed after the checkpoint at step 6
    torch.manual_seed(999)  # a fresh process would not share the first run's RNG: the checkpoint restores it
    resumed = trainer(tmp_path / "b").fit(resume=True)
    assert resumed.resumed_from == 6
    assert [log.loss for log in resumed.logs] == [log.loss for log in straight.logs[6:]]


def test_resume_refuses_another_config_and_names_the_difference(tmp_path):
    _trainer(TrainConfig(steps=2, batch=8), checkpoint_dir=tmp_path).fit()
    with pytest.raises(GpuwiseError, match="written with batch 8, this run has 4"):
        _trainer(TrainConfig(steps=4, batch=4), checkpoint_dir=tmp_path).fit(resume=True)
    wider = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=DATA.vocab_size, block_size=32))
    trainer = Trainer(wider, torch.optim.AdamW(wider.parameters()), DATA, TrainConfig(steps=4, batch=8),
                      runtime=Runtime(checkpoint_dir=tmp_path))
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
    from gpuwise.planning.capture.workload import simulate
    from gpuwise.planning.planner import Planner
    from gpuwise.planning.setup import Setup
    from gpuwise.planning.sources.zoo import ZooSource
    from gpuwise.training.auto import choose

    gpt = GPTConfig(n_layer=2, n_head=2, n_embd=48, vocab_size=DATA.vocab_size, block_size=32)
    src = ZooSource(zoo=replace(get_model("gpt2"), config=gpt, default_seq=32, max_seq=32))

    def peak(micro: int) -> float:
        w = simulate(src, Setup(micro_batch=micro, seq=32, precision="fp32", grad_accum=2), batch_model=False)
        return float(w.timeline.live(micro).sum(axis=1).max())

    free = (peak(4) + peak(8)) / 2 / 0.9  # 10% headroom is kept
    setup = TrainConfig(batch=16, precision="fp32").to_setup(seq=32)
    choice = choose(Planner(src), setup, free_bytes=int(free), gpu=False)
    assert (choice.micro_batch, choice.grad_accum) == (4, 4)
    assert "micro-batch 4 x 4 accumulation" in choice.reason
    gpu = choose(Planner(src), TrainConfig(batch=16, precision="bf16-mixed").to_setup(seq=32), free_bytes=80 * 2**30,
                 gpu=True)
    assert gpu.micro_batch == 16


def test_fp16_scaler_skips_inf_gradients_counts_them_and_its_scale_survives_a_resume(tmp_path):
    """One GradScaler for the run: an inf gradient at step 2 skips that update and halves the scale; the
    halved scale is in the checkpoint and a resumed run starts from it, not from a fresh 65536."""
    trainer = _trainer(TrainConfig(steps=4, batch=4, precision="fp16-mixed", log_every=1), checkpoint_dir=tmp_path)
    calls = {"n": 0}

    def poison(grad):
        calls["n"] += 1
        return grad * float("inf") if calls["n"] == 2 else grad

    trainer.module.lm_head.weight.register_hook(poison)
    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    result = trainer.fit()
    assert result.skipped_steps == 1 and [log.skipped for log in result.logs] == [False, True, False, False]
    assert trainer.scaler.get_scale() == 65536.0 / 2
    assert any(not torch.equal(before[n], p) for n, p in trainer.module.named_parameters())
    resumed = _trainer(TrainConfig(steps=5, batch=4, precision="fp16-mixed"), checkpoint_dir=tmp_path)
    resumed.fit(resume=True)
    assert resumed.scaler.get_scale() == 65536.0 / 2


def _oom_when_larger_than(limit: int):
    from gpuwise.training.trainer import OutOfMemory

    def loss_fn(model, x, y):
        if x.shape[0] > limit:
            raise OutOfMemory(f"CUDA out of memory. Tried to allocate {x.shape[0]} rows")
        return model_loss(model, x, y)

    return loss_fn


def _plan_of_1000_bytes_a_sample():
    """A RunPlan whose step holds 1000 bytes a sample at every micro-batch (its batch model: base 0, slope 1000)."""
    import numpy as np

    from gpuwise.planning.capture.scaling import Timeline
    from gpuwise.training.runplan import RunPlan

    memory = Timeline(labels=(("forward", None),), base=np.zeros((1, 1)), slope=np.full((1, 1), 1000.0),
                      end_of_forward=0)
    return RunPlan(memory=memory, batch_memory=memory)


def test_an_oom_is_explained_and_retried_once_at_half_the_micro_batch():
    events: list[str] = []
    retried = _trainer(TrainConfig(steps=4, batch=8, micro_batch=4, log_every=1), loss_fn=_oom_when_larger_than(2),
                       plan=_plan_of_1000_bytes_a_sample(), on_event=events.append).fit()
    small = _trainer(TrainConfig(steps=4, batch=8, micro_batch=2, log_every=1)).fit()
    assert [log.loss for log in retried.logs] == pytest.approx([log.loss for log in small.logs], rel=1e-6)
    assert (retried.micro_batch, retried.grad_accum) == (2, 4)
    assert len(events) == 1 and "out of memory at micro-batch 4" in events[0]
    assert "the plan predicted a peak of 3.9 KiB" in events[0] and "retrying step 1 with micro-batch 2 x 4" in events[0]
    assert retried.events == tuple(events)


def test_a_second_oom_stops_with_the_explanation():
    trainer = _trainer(TrainConfig(steps=4, batch=8, micro_batch=8), loss_fn=_oom_when_larger_than(1))
    with pytest.raises(GpuwiseError, match=r"out of memory at micro-batch 4.*after one retry"):
        trainer.fit()


def test_held_out_loss_is_the_mean_over_the_validation_batches():
    val = CharText(seq=32, split="val", text=DATA.text)
    config = TrainConfig(steps=4, batch=8, eval_every=2, eval_batches=3, log_every=100)
    trainer = _trainer(config, eval_data=val)
    result = trainer.fit()
    assert [log.step for log in result.logs] == [2, 4] and result.eval_loss == result.logs[-1].eval_loss
    trainer.module.eval()
    with torch.no_grad():
        expected = sum(float(trainer.module(*val.batch(k, 8))) for k in range(3)) / 3
    assert result.eval_loss == pytest.approx(expected, rel=1e-6)
    assert not torch.equal(val.batch(0, 8)[0], DATA.batch(0, 8)[0])


def test_activation_checkpointing_and_fused_adamw_take_the_same_steps():
    plain = _trainer(TrainConfig(steps=4, batch=8, log_every=1)).fit()
    recomputed = _trainer(TrainConfig(steps=4, batch=8, log_every=1, checkpointing="full")).fit()
    assert [log.loss for log in recomputed.logs] == pytest.approx([log.loss for log in plain.logs], rel=1e-6)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=48, vocab_size=DATA.vocab_size, block_size=32))
    fused = Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True), DATA,
                    TrainConfig(steps=4, batch=8, log_every=1), loss_fn=model_loss).fit()
    assert [log.loss for log in fused.logs] == pytest.approx([log.loss for log in plain.logs], rel=1e-5)


@pytest.mark.slow
def test_compiled_model_takes_the_same_steps():
    config = TrainConfig(steps=3, batch=4, log_every=1)
    eager = _trainer(config).fit()
    compiled = _trainer(TrainConfig(steps=3, batch=4, log_every=1, compile=True)).fit()
    assert [log.loss for log in compiled.logs] == pytest.approx([log.loss for log in eager.logs], rel=1e-5)


def test_data_that_does_not_fit_the_model_is_one_clear_error():
    from gpuwise.training.data import DatasetBatches
    from gpuwise.training.loss import default_loss

    model = torch.nn.Linear(8, 3)
    items = [(torch.randn(5), torch.tensor(1)) for _ in range(16)]  # 5 features for a model that takes 8
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), DatasetBatches(items),
                      TrainConfig(steps=2, batch=4), loss_fn=default_loss)
    with pytest.raises(GpuwiseError, match="the data does not fit the model: RuntimeError: mat1 and mat2"):
        trainer.fit()


def test_step_sampler_splits_each_global_batch_and_covers_every_epoch():
    from gpuwise.training.data import StepSampler

    whole = list(StepSampler(10, 4, seed=3, start=0, steps=10))
    assert all(len(b) == 4 for b in whole)
    flat = [i for b in whole for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))  # epochs
    ranks = [list(StepSampler(10, 4, seed=3, start=0, steps=10, rank=r, world_size=2)) for r in (0, 1)]
    assert [a + b for a, b in zip(*ranks, strict=True)] == whole
    assert list(StepSampler(10, 4, seed=3, start=6, steps=10)) == whole[6:]  # a resumed run reads the same


def test_default_loss_follows_the_targets():

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4)
    labels, values = torch.tensor([0, 2, 1, 1, 0]), torch.randn(5, 3)
    with torch.no_grad():
        check_default_loss(model, x, labels, values)


def check_default_loss(model, x, labels, values):
    from gpuwise.training.loss import default_loss

    assert default_loss(model, x, labels) == pytest.approx(float(torch.nn.functional.cross_entropy(model(x),
                                                                                                   labels)))
    assert default_loss(model, x, values) == pytest.approx(float(((model(x) - values) ** 2).mean()))
    assert default_loss(model, x, None) == pytest.approx(float(model(x).square().mean()))


@pytest.mark.slow
def test_image_task_learns_and_accumulation_equals_one_batch():
    from gpuwise.training.tasks import image_task

    task = image_task(16, seed=0)

    def fit(micro):
        torch.manual_seed(0)
        model = task.build()
        return Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), task.data,
                       TrainConfig(steps=40, batch=16, micro_batch=micro, log_every=1, warmup_steps=5),
                       loss_fn=task.loss_fn).fit()

    whole, parts = fit(None), fit(4)
    assert [log.loss for log in parts.logs] == pytest.approx([log.loss for log in whole.logs], rel=1e-4)
    assert whole.logs[0].loss == pytest.approx(math.log(10), abs=0.3)
    assert sum(log.loss for log in whole.logs[-5:]) / 5 < math.log(10) - 0.3


def test_a_folder_with_checkpoints_is_not_overwritten_without_resume(tmp_path):
    _trainer(TrainConfig(steps=2, batch=4), checkpoint_dir=tmp_path).fit()
    with pytest.raises(GpuwiseError, match="holds checkpoints of a run already"):
        _trainer(TrainConfig(steps=2, batch=4), checkpoint_dir=tmp_path).fit()
    with pytest.raises(GpuwiseError, match="is at step 2 already, --steps is 2"):
        _trainer(TrainConfig(steps=2, batch=4), checkpoint_dir=tmp_path).fit(resume=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(GpuwiseError, match="is a file"):
        _trainer(TrainConfig(steps=2, batch=4), checkpoint_dir=tmp_path / "file")
    with pytest.raises(GpuwiseError, match="--checkpoint-every needs a folder"):
        _trainer(TrainConfig(steps=2, batch=4, checkpoint_every=1))


def test_bad_held_out_data_stops_after_saving_and_ragged_items_are_named(tmp_path):
    model = torch.nn.Linear(8, 3)
    good = [(torch.randn(8), torch.tensor(1)) for _ in range(16)]
    bad_val = [(torch.randn(5), torch.tensor(1)) for _ in range(16)]
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), good, TrainConfig(steps=3, batch=4),
                      eval_data=bad_val, runtime=Runtime(checkpoint_dir=tmp_path))
    with pytest.raises(GpuwiseError, match="the held-out data does not fit the model: RuntimeError"):
        trainer.fit()
    assert (tmp_path / "step-000000003" / "manifest.json").is_file()  # the trained steps were kept
    from gpuwise.training.data import StepSampler

    odd = StepSampler(16, 4, seed=TrainConfig().seed, start=0, steps=8).global_batch(2)[0]  # read at step 3
    ragged = [(torch.randn(9 if i == odd else 8), torch.tensor(1)) for i in range(16)]
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), ragged, TrainConfig(steps=8, batch=4),
                      runtime=Runtime(checkpoint_dir=tmp_path / "r"))
    with pytest.raises(GpuwiseError, match=r"reading the batch of step 3 failed: RuntimeError: stack expects"):
        trainer.fit()
    assert [p.name for p in ckpt.steps_in(tmp_path / "r")] == ["step-000000002"]  # saved what it had done


def test_the_trainer_takes_a_dataset_and_refuses_a_dataloader():
    model = _dropout_net()
    result = Trainer(model, torch.optim.AdamW(model.parameters()), _dataset(), TrainConfig(steps=2, batch=8)).fit()
    assert result.steps == 2
    with pytest.raises(GpuwiseError, match="takes the Dataset, not a DataLoader"):
        Trainer(model, torch.optim.AdamW(model.parameters()), torch.utils.data.DataLoader(_dataset()),
                TrainConfig(steps=2, batch=8))


def test_tf32_is_switched_by_the_run_not_by_constructing_a_trainer():
    """TF32 is a process-wide torch setting: a Trainer leaves it alone; run_training turns it on for a tf32 run
    and restores it afterwards."""
    from gpuwise.training.config import TrainOptions
    from gpuwise.training.run import run_training

    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    try:
        matmul.allow_tf32 = False
        _trainer(TrainConfig(steps=1, batch=4, precision="tf32"))
        assert matmul.allow_tf32 is False
        seen: list[bool] = []
        opts = TrainOptions(seq=16, device="cpu", auto=False, config=TrainConfig(steps=1, batch=4, precision="tf32"))
        run_training(opts, on_log=lambda log: seen.append(matmul.allow_tf32), environ={})
        assert seen == [True] and matmul.allow_tf32 is False
    finally:
        matmul.allow_tf32 = before


WARMED_BEFORE_THE_FIRST_STEP = '''
import torch
from gpuwise import compat
from gpuwise.training import checkpoint as ckpt
from gpuwise.training.config import TrainConfig
from gpuwise.training.trainer import Trainer

assert compat.warm_cpu_vml.cache_info().currsize == 0  # a fresh process: nothing warmed on import
model = torch.nn.Linear(4, 2)
Trainer(model, torch.optim.AdamW(model.parameters()), [(torch.randn(4), torch.randn(2))] * 4,
        TrainConfig(steps=1, batch=2))
print(compat.warm_cpu_vml.cache_info().currsize)
'''


def test_a_trainer_settles_mkl_vml_kernels_before_its_first_step():
    """oneMKL 2024.2 can run a low-accuracy sqrt on one thread's chunk when a VML function's first call is
    multi-threaded (pytorch/pytorch#188792): AdamW's first step drifted in 3 of 20 runs on this machine under
    load. The warm-up must happen in the Trainer, not at import, and before any step."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", WARMED_BEFORE_THE_FIRST_STEP], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_a_run_opens_one_planner_session_and_the_trainer_never_calls_the_planner(monkeypatch):
    """gpuwise train plans once before the Trainer (training/runplan.py): one Planner, each setup captured once
    (--auto's micro-batch-1 step and the run's own), and nothing captured once training starts."""
    import gpuwise.planning.planner as planner_module
    from gpuwise.training import trainer as trainer_module
    from gpuwise.training.config import TrainOptions
    from gpuwise.training.run import run_training

    sessions, captures, started = [], [], []
    real_init, real_capture = planner_module.Planner.__init__, planner_module.simulate_if_applicable

    def init(self, source):
        sessions.append(source)
        real_init(self, source)

    def capture(source, setup, **kwargs):
        assert not started, "the planner was called after the Trainer was made"
        captures.append(setup)
        return real_capture(source, setup, **kwargs)

    real_fit = trainer_module.Trainer.fit

    def fit(self, **kwargs):
        started.append(True)
        assert self.plan is not None and self.plan.flops_per_step  # the Trainer got the plan's MFU numerator
        return real_fit(self, **kwargs)

    monkeypatch.setattr(planner_module.Planner, "__init__", init)
    monkeypatch.setattr(planner_module, "simulate_if_applicable", capture)
    monkeypatch.setattr(trainer_module.Trainer, "fit", fit)
    opts = TrainOptions(seq=16, device="cpu", monitor=False, config=TrainConfig(steps=2, batch=8, log_every=1))
    summary = run_training(opts, environ={})
    assert len(sessions) == 1 and len(captures) == len(set(captures)) == 2 and started
    assert summary.auto is not None and summary.auto.startswith("fp32 (cpu training runs in fp32); micro-batch ")


def test_an_oom_retry_without_auto_still_gets_the_plans_peak_at_the_smaller_micro_batch():
    """Without --auto there is no batch model: the plan's peak at the micro-batch a retry fell back to is captured
    from the same Planner session when the OOM asks, and equals a fresh capture there."""
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.planning.planner import Planner
    from gpuwise.planning.setup import Setup
    from gpuwise.planning.sources.resolve import resolve_source
    from gpuwise.training.runplan import planned

    source = resolve_source("gpt2", None)
    setup = Setup(micro_batch=4, grad_accum=1, seq=128)
    plan = planned(Planner(source), setup, load_catalog().get("rtx-4090"))
    assert plan.batch_memory is None
    fresh = Planner(source).per_gpu(Setup(micro_batch=2, grad_accum=2, seq=128)).peak_bytes
    assert plan.peak_bytes(2) == pytest.approx(fresh, rel=1e-12)
    assert plan.peak_bytes(2) != plan.peak_bytes(4)  # its own step (2 x 2, the gradients held), not the plan's
    assert any("the plan predicted a peak" in line for line in plan.oom_note(2))
