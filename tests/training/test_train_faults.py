"""Issue 30, the training side still open: an optimizer over another model's parameters, the LR of a resume with more
steps, exit 3 for the user's own mistakes (a manifest's step of Infinity, a Dataset's bad ``__len__``, a lazy,
detached or meta model in train and plan) and hangs (a FIFO as the manifest, a data function or Dataset that never
returns). Real files, real FIFOs, real sleeps and SIGALRM; in-process, each a few seconds at most."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

from conftest import run_cli
from gpuwise.errors import GpuwiseError
from gpuwise.training import checkpoint as ckpt
from gpuwise.training import waiting
from gpuwise.training.config import TrainConfig
from gpuwise.training.trainer import Runtime, Trainer, cosine_with_warmup

TINY = ["train", "--batch", "4", "--seq", "16", "--no-monitor", "--no-auto"]
FILE = ["train", "--batch", "4", "--no-monitor", "--no-auto"]  # a model from a file: no --seq


class Items(torch.utils.data.Dataset):
    def __init__(self, n=32):
        g = torch.Generator().manual_seed(0)
        self.x, self.w = torch.randn(n, 4, generator=g), torch.randn(4, 2, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.x[i] @ self.w


def _trainer(tmp_path=None, steps=6, data=None, model=None, optimizer=None, events=None, **cfg) -> Trainer:
    torch.manual_seed(0)
    model = model or nn.Linear(4, 2)
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-2)
    runtime = Runtime(checkpoint_dir=tmp_path, on_event=None if events is None else events.append)
    data = Items() if data is None else data  # not `data or`: bool() calls the __len__ under test
    return Trainer(model, optimizer, data, TrainConfig(steps=steps, batch=4, lr=1e-2, **cfg), runtime=runtime)


FAULTS = '''
import torch
from torch import nn


def good(batch):
    return nn.Linear(8, 4), torch.randn(batch, 8)


def lazy(batch):
    return nn.Sequential(nn.LazyLinear(4)), torch.randn(batch, 8)


class Detached(nn.Linear):
    def forward(self, x):
        return super().forward(x).detach()


def detached(batch):
    return Detached(8, 4), torch.randn(batch, 8)


def meta(batch):
    with torch.device("meta"):
        model = nn.Linear(8, 4)
    return model, torch.randn(batch, 8)


class Negative(torch.utils.data.Dataset):
    def __len__(self):
        return -3

    def __getitem__(self, i):
        return torch.randn(8), torch.tensor(0)


def negative():
    return Negative()
'''


def _faults(tmp_path, function: str) -> str:
    """``--model``/``--data`` for ``function`` of FAULTS, written as a real file."""
    (tmp_path / "faults.py").write_text(FAULTS)
    return f"{tmp_path}/faults.py:{function}"


# -- 1. an optimizer that steps nothing -----------------------------------------------------------------------------

def test_an_optimizer_over_another_models_parameters_is_refused_and_a_partial_one_named():
    """Issue 30, item 6: Trainer(model, AdamW(other.parameters())) trained 'successfully' and changed no weight."""
    model, other = nn.Linear(4, 2), nn.Linear(4, 2)
    with pytest.raises(GpuwiseError) as caught:
        _trainer(model=model, optimizer=torch.optim.AdamW(other.parameters()))
    assert "the optimizer holds none of Linear's 2 trainable parameters" in caught.value.message
    assert "torch.optim.AdamW(model.parameters())" in caught.value.hint

    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))  # the optimizer forgets the second layer
    trainer = _trainer(model=net, optimizer=torch.optim.AdamW(net[0].parameters(), lr=1e-2))
    note = "the optimizer holds 2 of Sequential's 4 trainable parameters: 1.weight, 1.bias get gradients but"
    assert any(note in e for e in trainer.events), trainer.events

    net[1].requires_grad_(False)  # frozen on purpose: nothing to say
    assert not any("optimizer" in e for e in _trainer(model=net, optimizer=torch.optim.AdamW(
        net[0].parameters(), lr=1e-2)).events)


# -- 2. the LR after a resume with more steps -----------------------------------------------------------------------

def test_a_resume_with_more_steps_takes_the_new_schedules_lr_from_its_first_step(capsys, tmp_path):
    """Issue 30, item 6: the first step after `--resume --steps 12` (from a 4-step run) used the old schedule's LR
    (its last, 0.1 x peak) instead of the new one's. Every resumed step's LR is now an uninterrupted 12-step run's."""
    ck, log, model = tmp_path / "ck", tmp_path / "log.jsonl", _faults(tmp_path, "good")
    assert run_cli(capsys, *FILE, "--model", model, "--steps", "4", "--checkpoint-dir", str(ck))[0] == 0
    code, _, err = run_cli(capsys, *FILE, "--steps", "12", "--checkpoint-dir", str(ck), "--resume",
                           "--log-every", "1", "--log", str(log))
    assert code == 0, err
    logged = {e["step"]: e["lr"] for e in map(json.loads, log.read_text().splitlines()) if "lr" in e}
    factor = cosine_with_warmup(TrainConfig(steps=12))  # warm-up 6 steps: step 5 is still warming up
    expected = {n: 3e-3 * factor(n - 1) for n in range(5, 13)}  # log step n is the update of step index n - 1
    assert logged == pytest.approx(expected, rel=1e-9)


# -- 3. exit 3 for the user's own mistakes ---------------------------------------------------------------------------

@pytest.mark.parametrize(("raw", "shown"), [
    ("Infinity", "Infinity"), ("NaN", "NaN"), ("-Infinity", "-Infinity"), ("1e400", "Infinity"), ("2.5", "2.5"),
    ("-4", "-4"), ('"4"', '"4"'), ("true", "true"), ("null", "null"), ("[4]", "list"), (str(1 << 40), str(1 << 40)),
])
def test_a_manifest_step_that_is_no_step_number_is_skipped_with_the_reason(tmp_path, raw, shown):
    _trainer(tmp_path, steps=4, checkpoint_every=2).fit()
    newest = tmp_path / "step-000000004" / "manifest.json"
    text = newest.read_text()
    newest.write_text(text.replace('"step": 4,', f'"step": {raw},', 1))
    assert ckpt.manifest_step(newest.parent) is None
    found, skipped = ckpt.latest(tmp_path)
    assert found.step == 2 and skipped == [f"step-000000004: the manifest's step is {shown}, not a step number"]


def test_a_manifest_step_of_infinity_falls_back_to_the_checkpoint_before_on_the_command_line(capsys, tmp_path):
    """Issue 30, item 7: `"step": Infinity` (valid JSON to Python) was exit 3 (OverflowError), with no fallback."""
    ck = tmp_path / "ck"
    assert run_cli(capsys, *FILE, "--model", _faults(tmp_path, "good"), "--steps", "4", "--checkpoint-dir", str(ck),
                   "--checkpoint-every", "2")[0] == 0
    manifest = ck / "step-000000004" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"step": 4,', '"step": Infinity,', 1))
    code, out, err = run_cli(capsys, *FILE, "--steps", "6", "--checkpoint-dir", str(ck), "--resume")
    assert code == 0, err
    assert "skipped 1 damaged checkpoint(s): step-000000004: the manifest's step is Infinity, not a step number" \
        in " ".join(err.split())
    assert "resumed from 2" in " ".join(out.split())

    for path in ckpt.steps_in(ck):  # none good: one line, exit 2
        (path / "manifest.json").write_text((path / "manifest.json").read_text().replace(
            f'"step": {ckpt.manifest_step(path)},', '"step": Infinity,', 1))
    code, _, err = run_cli(capsys, *FILE, "--steps", "8", "--checkpoint-dir", str(ck), "--resume")
    assert code == 2 and "no usable checkpoint" in err and "is Infinity" in err and err.count("\n") == 1, err


class Length(Items):
    def __init__(self, length):
        super().__init__()
        self.length = length

    def __len__(self):
        if isinstance(self.length, Exception):
            raise self.length
        return self.length


@pytest.mark.parametrize(("length", "says"), [
    (-3, r"Length.__len__\(\) returned -3, not a number of items"),
    (2.5, r"Length.__len__\(\) returned 2.5, not a number of items"),
    (RuntimeError("no length today"), r"Length.__len__\(\) raised RuntimeError: no length today"),
    ("32", r"Length.__len__\(\) returned '32', not a number of items"),
])
def test_a_datasets_len_that_is_no_count_is_one_line(length, says):
    """Issue 30, item 7: len() raised ValueError / TypeError (or __len__'s own error) through the trainer: exit 3."""
    with pytest.raises(GpuwiseError, match=says) as caught:
        _trainer(data=Length(length))
    assert "__len__" in caught.value.hint
    assert _trainer(data=Length(torch.tensor(32))).fit().steps == 6  # a 0-d integer tensor counts


@pytest.mark.parametrize(("function", "says"), [
    ("lazy", "returns a model with uninitialized parameters"),
    ("detached", "has no gradient: "),
    ("meta", "returns a model on the meta device"),
])
@pytest.mark.parametrize("command", ["train", "plan"])
def test_a_lazy_detached_or_meta_model_is_one_line_in_train_and_plan(capsys, tmp_path, command, function, says):
    """Issue 30, item 7: exit 3 in train ("Attempted to use an uninitialized parameter", "element 0 of tensors does
    not require grad", "Cannot copy out of meta tensor"); exit 2 in plan, but saying "report it" (a fake-tensor rule
    failed) or "must not read tensor values". Now each names the model's fault and the fix."""
    args = [*FILE, "--steps", "2"] if command == "train" else ["plan"]
    code, _, err = run_cli(capsys, *args, "--model", _faults(tmp_path, function))
    error = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(error) == 1 and says in error[0], err
    assert "report" not in error[0] and "internal error" not in err


def test_a_datasets_negative_len_on_the_command_line_is_exit_2(capsys, tmp_path):
    code, _, err = run_cli(capsys, *FILE, "--steps", "2", "--model", _faults(tmp_path, "good"),
                           "--data", _faults(tmp_path, "negative"))
    assert code == 2 and "Negative.__len__() returned -3, not a number of items" in err and err.count("\n") == 1, err


# -- 4. hangs ---------------------------------------------------------------------------------------------------------

def _within(seconds: float, fn, fifo):
    """``fn()`` in a thread; if it is still blocked after ``seconds`` (on the FIFO), release it and fail."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(value=fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # the blocked reader is there: this open succeeds
        os.write(fd, b"{}")
        os.close(fd)
        thread.join(5)
        pytest.fail(f"blocked on the FIFO {fifo} for {seconds} s")
    return result.get("value")


def test_a_fifo_named_manifest_json_is_skipped_not_read(tmp_path):
    """Issue 30, item 9: `mkfifo step-.../manifest.json` blocked `gpuwise train --resume` forever (and a fresh run's
    check of the folder). It is never opened for reading now: skipped, with the reason, for the checkpoint before."""
    _trainer(tmp_path, steps=4, checkpoint_every=2).fit()
    fifo = tmp_path / "step-000000004" / "manifest.json"
    fifo.unlink()
    os.mkfifo(fifo)
    found, skipped = _within(10, lambda: ckpt.latest(tmp_path), fifo)
    assert found.step == 2 and skipped == ["step-000000004: manifest.json is a named pipe (FIFO), not a file"]
    assert _within(10, lambda: ckpt.saved_run(tmp_path), fifo) is None  # this run kept no settings: none found
    events: list[str] = []
    result = _within(30, lambda: _trainer(tmp_path, steps=6, events=events).fit(resume=True), fifo)
    assert result.resumed_from == 2 and any("is a named pipe (FIFO)" in e for e in events), events
    assert fifo.exists()  # kept: pruning reads no FIFO either, and leaves what it cannot read alone


SLOW = '''
import time

import torch


class Stuck(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(60)


def model(batch):
    return torch.nn.Linear(8, 4), torch.randn(batch, 8)


def sleeps():
    while True:
        try:
            time.sleep(60)  # a download that never ends, retried on any Exception
        except Exception:
            pass


def stuck():
    return Stuck()


def late():
    time.sleep(1.0)
    return torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 4))
'''


@pytest.mark.parametrize(("function", "says"), [
    ("sleeps", "gave up waiting for slow.py:sleeps() to return after 1 s (--data-timeout)"),
    ("stuck", "gave up waiting for the first batch (step 1) from the Dataset Stuck after 1 s (--data-timeout)"),
])
def test_a_data_function_or_dataset_that_never_returns_says_so_and_is_bounded(capsys, tmp_path, monkeypatch,
                                                                               function, says):
    """Issue 30, item 9: a --data function (or a Dataset's __getitem__) that never returned hung the run, with no line.
    Now a line says what it waits for, and --data-timeout (or GPUWISE_DATA_TIMEOUT) ends it in one error."""
    (tmp_path / "slow.py").write_text(SLOW)
    before = signal.getsignal(signal.SIGALRM)
    monkeypatch.setenv("GPUWISE_DATA_TIMEOUT", "1")
    start = time.monotonic()
    code, _, err = run_cli(capsys, *FILE, "--steps", "2", "--workers", "0", "--model", f"{tmp_path}/slow.py:model",
                           "--data", f"{tmp_path}/slow.py:{function}")
    assert code == 2 and f"error: {says}" in " ".join(err.split()), err
    assert "still waiting for" in err and "giving up at 1 s" in err
    assert time.monotonic() - start < 30  # not the minute of the sleep
    assert signal.getsignal(signal.SIGALRM) is before  # the handler is put back


def test_without_a_bound_a_slow_data_function_gets_a_line_and_the_run_goes_on(capsys, tmp_path, monkeypatch):
    (tmp_path / "slow.py").write_text(SLOW)
    monkeypatch.setattr(waiting, "NOTE_S", 0.3)  # the 30 s before the first line, shortened
    code, _, err = run_cli(capsys, *FILE, "--steps", "2", "--workers", "0", "--model", f"{tmp_path}/slow.py:model",
                           "--data", f"{tmp_path}/slow.py:late")
    assert code == 0, err
    line = next(x for x in err.splitlines() if x.startswith("still waiting"))
    assert line.startswith("still waiting for slow.py:late() to return (0.") and "--data-timeout SECONDS" in line


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_data_timeout_that_is_no_positive_number_is_one_line(capsys, value):
    code, _, err = run_cli(capsys, *TINY, "--steps", "2", "--data-timeout", value)
    assert code == 2 and "--data-timeout" in err and "is not a positive number of seconds" in err \
        and err.count("\n") == 1, err


def test_the_watch_costs_a_normal_run_microseconds_per_batch():
    """It must not slow normal runs: a wait that ends at once costs a few microseconds (a step is milliseconds)."""
    with waiting.Watchdog(lambda text: None, timeout=60) as dog:
        start = time.perf_counter()
        for _ in range(2000):
            with dog.waiting(str, ""):
                pass
        per_wait = (time.perf_counter() - start) / 2000
    assert per_wait < 100e-6, f"{per_wait * 1e6:.1f} us per batch"
