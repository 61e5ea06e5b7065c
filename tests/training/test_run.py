"""The trainer under what newcomers and adversaries do: Ctrl-C, full disks, two trainers on one folder, odd
seeds and data, renamed or damaged checkpoints, a resume without the original flags, misleading hints, Hugging
Face items, DDP randomness and BatchNorm, and the history kept above the progress bar. All in-process."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
import signal

import pytest
import torch
from rich.console import Console
from torch import nn

from conftest import run_cli
from gpuwise.errors import GpuwiseError
from gpuwise.training import checkpoint as ckpt
from gpuwise.training.config import TrainConfig, TrainOptions
from gpuwise.training.interrupt import Interrupted
from gpuwise.training.loss import default_loss
from gpuwise.training.run import resume_options
from gpuwise.training.trainer import Runtime, Trainer

TINY = ["train", "--batch", "4", "--seq", "16", "--no-monitor", "--no-auto"]


class Items(torch.utils.data.Dataset):
    """(x, y) pairs of a linear map; ``make`` shapes one item."""

    def __init__(self, n=32, make=None):
        g = torch.Generator().manual_seed(0)
        self.x, self.w = torch.randn(n, 4, generator=g), torch.randn(4, 2, generator=g)
        self.make = make or (lambda x, y: (x, y))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.make(self.x[i], self.x[i] @ self.w)


def _trainer(tmp_path=None, steps=6, data=None, model=None, **cfg) -> Trainer:
    torch.manual_seed(0)
    model = model or nn.Linear(4, 2)
    config = TrainConfig(steps=steps, batch=4, lr=1e-2, **cfg)
    runtime = Runtime(checkpoint_dir=tmp_path)
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data or Items(), config, runtime=runtime)


# -- 1. Ctrl-C ----------------------------------------------------------------------------------------------------

class Interrupting(Items):
    """Sends this process ``sig`` (SIGINT) while reading the batch of step ``at``."""

    def __init__(self, at: int, twice: bool = False, sig: int = signal.SIGINT):
        super().__init__()
        self.at, self.twice, self.sig = at, twice, sig

    def __getitem__(self, i):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 4 * (self.at - 1) + 1:  # the first item of that step's batch of 4
            os.kill(os.getpid(), self.sig)
        return super().__getitem__(i)


def test_ctrl_c_finishes_the_step_saves_it_and_says_where(tmp_path):
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN when started in the background
    t = _trainer(tmp_path, steps=20, data=Interrupting(at=5), checkpoint_every=100)
    with pytest.raises(Interrupted) as caught:
        t.fit()
    assert caught.value.step == 5 and caught.value.saved.name == "step-000000005"
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back
    resumed = _trainer(tmp_path, steps=20)
    assert resumed.fit(resume=True).resumed_from == 5


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_schedulers_stop_or_a_closed_session_saves_the_step_like_ctrl_c(tmp_path, sig):
    """Issue 30: SIGTERM and SIGHUP killed a run at once and lost every step since the last checkpoint (with the
    default --checkpoint-every 0, SIGHUP at step 6 left only .lock). Now they finish the step and save it."""
    before = signal.getsignal(sig)
    t = _trainer(tmp_path, steps=20, data=Interrupting(at=6, sig=sig), checkpoint_every=0)
    with pytest.raises(Interrupted) as caught:
        t.fit()
    assert caught.value.step == 6 and caught.value.saved.name == "step-000000006" and caught.value.signum == sig
    assert signal.getsignal(sig) is before  # the handler is put back
    assert _trainer(tmp_path, steps=20).fit(resume=True).resumed_from == 6


def test_sigterm_from_outside_stops_gpuwise_train_with_a_saved_step_and_exit_143(tmp_path):
    """A real SIGTERM sent to a running `gpuwise train` (as a scheduler sends it): one line naming the step, the
    signal and how to go on; exit 128 + 15; the checkpoint it names is there."""
    import subprocess
    import sys
    import time

    ck = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "gpuwise", *TINY, "--steps", "100000", "--checkpoint-dir",
                             str(ck), "--log-every", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        seen = ""
        deadline = time.monotonic() + 120
        while "step      3" not in seen and time.monotonic() < deadline:  # training has begun
            line = proc.stderr.readline()
            if not line:
                break
            seen += line
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [x for x in err.splitlines() if x.startswith("stopped at step")]
    assert proc.returncode == 128 + signal.SIGTERM, (seen + err)[-2000:]
    assert len(lines) == 1 and "(SIGTERM); saved step-" in lines[0] and lines[0].endswith("continue with --resume")
    step = int(lines[0].split()[3])
    assert (ck / f"step-{step:09d}").is_dir()


def test_ctrl_c_on_the_command_line_exits_130_with_the_step_and_the_way_on(capsys, tmp_path, monkeypatch):
    import gpuwise.training.run as run

    def interrupted(*args, **kwargs):
        raise Interrupted(7, tmp_path / "step-000000007")

    monkeypatch.setattr(run, "run_training", interrupted)
    code, _, err = run_cli(capsys, *TINY, "--checkpoint-dir", str(tmp_path))
    assert code == 130 and "stopped at step 7; saved step-000000007; continue with --resume" in err


# -- 2. full disks, locks, odd inputs -----------------------------------------------------------------------------

def test_a_real_write_limit_at_either_writer_is_exit_2_naming_the_last_good_checkpoint(capsys, tmp_path):
    """Issue 30: a full disk while checkpointing was exit 3 in every real try (the earlier test mocked OSError, but
    safetensors raises SafetensorError and torch.save RuntimeError). A real `ulimit -f` (EFBIG, as a full disk's
    ENOSPC) under each writer: 256 KiB stops safetensors' model file, 4 MiB lets it through (3.2 MB) and stops
    torch.save's state (6.5 MB). Each: exit 2, one line naming the last good step, no half-written folder; then the
    run resumes from that step without the limit. The limited runs are processes of their own (the limit is the
    process's); the runs without one are run here."""
    import resource
    import subprocess
    import sys

    ck = tmp_path / "ck"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = ["--checkpoint-dir", str(ck), "--checkpoint-every", "2"]

    def limited(limit: int) -> subprocess.CompletedProcess:
        def cap() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        return subprocess.run([sys.executable, "-m", "gpuwise", *TINY, "--steps", "8", *flags, "--resume"],
                              capture_output=True, text=True, env=env, timeout=300, preexec_fn=cap)

    assert run_cli(capsys, *TINY, "--steps", "4", *flags)[0] == 0
    for limit, writer in ((256 * 1024, "SafetensorError"), (4 * 2**20, "RuntimeError")):
        done = limited(limit)
        errors = [x for x in done.stderr.splitlines() if x.startswith("error:")]
        assert done.returncode == 2, done.stderr[-2000:]
        assert len(errors) == 1 and "disk full at checkpoint step-000000006" in errors[0] and writer in errors[0]
        assert "the last good checkpoint is step 4 (step-000000004), intact" in errors[0]
        assert sorted(p.name for p in ck.iterdir()) == [".lock", "step-000000002", "step-000000004"]
    code, _, err = run_cli(capsys, *TINY, "--steps", "6", *flags, "--resume")
    assert code == 0 and (ck / "step-000000006").is_dir(), err[-2000:]


def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_the_checkpoint_before(tmp_path, monkeypatch):
    t = _trainer(tmp_path, steps=4, checkpoint_every=2)
    real = ckpt.save_file

    def full(tensors, path):
        if "000000004" in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(tensors, path)

    monkeypatch.setattr(ckpt, "save_file", full)
    with pytest.raises(GpuwiseError, match=r"disk full at checkpoint step-000000004 .*\(No space left on device\); "
                                           r"the last good checkpoint is step 2 \(step-000000002\), intact"):
        t.fit()
    assert [p.name for p in ckpt.steps_in(tmp_path)] == ["step-000000002"]
    assert not list(tmp_path.glob(".step-*"))  # the half-written one is gone


def test_a_full_disk_for_the_log_warns_once_and_training_goes_on(capsys, tmp_path, monkeypatch):
    from gpuwise import files

    writes = []

    class Full(io.StringIO):
        def write(self, text):
            writes.append(text)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files, "open_log", lambda path: Full())
    code, _, err = run_cli(capsys, *TINY, "--steps", "4", "--log-every", "1", "--log", str(tmp_path / "l.jsonl"))
    assert code == 0, err
    assert err.count("cannot write the log") == 1 and "No space left on device" in err and len(writes) == 1


def test_a_second_trainer_on_the_same_folder_is_refused_in_one_line(tmp_path):
    first = ckpt.Checkpointer(tmp_path, identity={})
    first.lock()
    second = _trainer(tmp_path)
    with pytest.raises(GpuwiseError, match=r"another gpuwise train is using .* is locked"):
        second.fit()
    first.unlock()
    assert second.fit().steps == 6  # free again; and fit released its own lock
    third = ckpt.Checkpointer(tmp_path, identity={})
    third.lock()
    third.unlock()


@pytest.mark.parametrize(("args", "message"), [
    (["--seed", str(1 << 70)], "--seed 1180591620717411303424 is outside 0..4294967295"),
    (["--seed", "-1"], "--seed -1 is outside"),
    (["--workers", "-1", "--model", "m.py:f"], "--workers -1 is negative"),
])
def test_bad_values_are_one_line(capsys, args, message):
    code, _, err = run_cli(capsys, *TINY, "--steps", "2", *args)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_string_items_name_what_they_hold():
    t = _trainer(data=Items(make=lambda x, y: ("some text", y)))
    with pytest.raises(GpuwiseError, match=r"the dataset's inputs hold str \('some text', \.\.\.\), not tensors"):
        t.fit()


def test_a_model_without_parameters_is_refused():
    with pytest.raises(GpuwiseError, match="ReLU has no trainable parameters"):
        Trainer(nn.ReLU(), torch.optim.SGD([torch.zeros(1, requires_grad=True)]), Items(), TrainConfig(batch=4))


def test_sys_exit_in_the_users_module_is_one_line(capsys, tmp_path):
    (tmp_path / "m.py").write_text("import sys\nsys.exit(0)\n")
    code, _, err = run_cli(capsys, "train", "--steps", "2", "--model", f"{tmp_path}/m.py:build")
    assert code == 2 and "importing m.py called sys.exit(0)" in err and err.count("\n") == 1, err

    class Quits(nn.Linear):
        def forward(self, x):
            raise SystemExit(3)

    with pytest.raises(GpuwiseError, match=r"forward called sys.exit\(3\) at step 1"):
        _trainer(model=Quits(4, 2)).fit()


# -- 3. checkpoint folders ----------------------------------------------------------------------------------------

def test_order_and_pruning_follow_the_manifest_not_the_name(tmp_path):
    t = _trainer(tmp_path, steps=6, checkpoint_every=2)
    t.fit()  # steps 2, 4, 6
    os.rename(tmp_path / "step-000000002", tmp_path / "step-000000999")  # renamed by hand
    (tmp_path / "step-junk").mkdir()  # junk: no manifest
    found, _ = ckpt.latest(tmp_path)
    assert found.step == 6 and found.path.name == "step-000000006"
    more = _trainer(tmp_path, steps=10, checkpoint_every=2)
    assert more.fit(resume=True).resumed_from == 6
    names = sorted(p.name for p in tmp_path.glob("step-*"))
    assert names == ["step-000000006", "step-000000008", "step-000000010", "step-junk"]  # 3 kept, junk untouched


def test_a_checkpoint_that_verifies_but_does_not_load_falls_back_to_the_one_before(tmp_path, capsys):
    _trainer(tmp_path, steps=4, checkpoint_every=2).fit()
    newest = tmp_path / "step-000000004"
    state = torch.load(newest / "state.pt", weights_only=True)
    del state["scheduler"]
    torch.save(state, newest / "state.pt")
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["state.pt"] = {"bytes": (newest / "state.pt").stat().st_size,
                                     "sha256": ckpt._sha256(newest / "state.pt")}
    (newest / "manifest.json").write_text(json.dumps(manifest))
    result = _trainer(tmp_path, steps=6).fit(resume=True)
    assert result.resumed_from == 2


def test_all_checkpoints_damaged_offers_the_way_out(tmp_path):
    _trainer(tmp_path, steps=4, checkpoint_every=2).fit()
    for path in ckpt.steps_in(tmp_path):
        (path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(GpuwiseError) as caught:
        _trainer(tmp_path, steps=6).fit(resume=True)
    assert "no usable checkpoint" in caught.value.message and f"mv {tmp_path} {tmp_path}.damaged" in caught.value.hint
    with pytest.raises(GpuwiseError) as caught:
        _trainer(tmp_path, steps=6).fit()  # and without --resume: not "pass --resume"
    assert "no usable one" in caught.value.message and "pass --resume" not in caught.value.hint


def test_a_resume_appends_to_the_log_and_never_rewrites_it(capsys, tmp_path):
    """Issue 30: a resume rewrote a shared --log (another run's lines and the user's notes deleted, 32 -> 22
    lines). Now every line before stays, byte for byte; a resume line follows, then the steps trained again."""
    log, ckpts = tmp_path / "log.jsonl", tmp_path / "ckpt"
    log.write_text("# my notes: lr sweep, run A\n")
    args = [*TINY, "--steps", "4", "--log-every", "1", "--checkpoint-dir", str(ckpts), "--log", str(log)]
    assert run_cli(capsys, *args, "--checkpoint-every", "2")[0] == 0
    before = log.read_text()
    with log.open("a") as f:
        f.write('{"step": 99, "run": "another run sharing the file"}\n')
    shutil.rmtree(ckpts / "step-000000004")  # stopped after step 2's checkpoint; the log went on to 4
    code, _, err = run_cli(capsys, *args, "--resume")
    assert code == 0, err
    text = log.read_text()
    assert text.startswith(before + '{"step": 99, "run": "another run sharing the file"}\n')
    after = [json.loads(line) for line in text[len(before):].splitlines()[1:]]
    assert after[0]["event"] == "resume" and after[0]["step"] == 2
    assert [e["step"] for e in after[1:]] == [3, 4]


# -- 4. resume without retyping the flags --------------------------------------------------------------------------

def test_resume_takes_the_checkpoints_flags_and_names_a_real_conflict(capsys, tmp_path):
    ckpts = str(tmp_path / "c")
    assert run_cli(capsys, *TINY, "--steps", "4", "--lr", "1e-3", "--checkpoint-dir", ckpts,
                   "--checkpoint-every", "2")[0] == 0
    shutil.rmtree(tmp_path / "c" / "step-000000004")
    code, out, err = run_cli(capsys, "train", "--checkpoint-dir", ckpts, "--resume", "--no-monitor", "--no-auto",
                             "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["resumed_from"] == 2 and summary["steps"] == 4 and summary["batch"] == 4
    _, notes = resume_options(TrainOptions(checkpoint_dir=ckpts, resume=True), set())
    assert "--seq 16" in notes[0] and "--lr 0.001" in notes[0] and "--steps 4" in notes[0]
    code, _, err = run_cli(capsys, "train", "--checkpoint-dir", ckpts, "--resume", "--seq", "32", "--steps", "6")
    assert code == 2 and "--seq 32 here, 16 in the checkpoint" in err and err.count("\n") == 1


MODEL_FILE = """import torch
from torch import nn


def build(batch):
    return nn.Sequential(nn.Linear(8, {width}), nn.ReLU(), nn.Linear({width}, 3)), torch.randn(batch, 8)


def data():
    return [(torch.randn(8), i % 3) for i in range(64)]
"""


def test_a_resume_from_another_folder_trains_the_same_file_and_refuses_a_changed_one(capsys, tmp_path, monkeypatch):
    """Issue 30: the manifest kept --model/--data as typed (relative), so resuming from another folder silently
    trained that folder's file (exit 0, another loss). Now they are kept absolute with their SHA-256: the resume
    finds the first file wherever it runs, and a changed file is refused in one line."""
    first, other, ck = tmp_path / "a", tmp_path / "b", tmp_path / "ck"
    first.mkdir()
    other.mkdir()
    (first / "m.py").write_text(MODEL_FILE.format(width=16))
    (other / "m.py").write_text(MODEL_FILE.format(width=64))  # same name, another model
    args = ["train", "--model", "m.py:build", "--data", "m.py:data", "--batch", "4", "--no-monitor", "--no-auto",
            "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--json"]
    monkeypatch.chdir(first)
    code, out, err = run_cli(capsys, *args, "--steps", "4")
    assert code == 0, err
    params = json.loads(out)["params"]
    shutil.rmtree(ck / "step-000000004")
    monkeypatch.chdir(other)
    code, out, err = run_cli(capsys, "train", "--checkpoint-dir", str(ck), "--resume", "--no-monitor", "--no-auto",
                             "--json")
    assert code == 0, err
    resumed = json.loads(out)
    assert resumed["resumed_from"] == 2 and resumed["params"] == params == 8 * 16 + 16 + 16 * 3 + 3
    (first / "m.py").write_text(MODEL_FILE.format(width=16) + "# edited\n")
    shutil.rmtree(ck / "step-000000004")
    code, _, err = run_cli(capsys, "train", "--checkpoint-dir", str(ck), "--resume", "--no-monitor", "--no-auto")
    assert code == 2 and f"{first / 'm.py'} changed since the checkpoint" in err and err.count("\n") == 1


@pytest.mark.parametrize(("out_shape", "y_shape", "says"), [((4, 1), (4,), "(B, 1) against (B,) into (B, B)"),
                                                          ((4, 3), (4,), "differ in size")])
def test_a_float_target_of_another_shape_than_the_output_is_refused(out_shape, y_shape, says):
    """Issue 30: a (B, 1) output against (B,) float targets broadcast MSE to (B, B) (the loss rose; only a PyTorch
    UserWarning). Now one line before the first step, naming both shapes."""
    model = nn.Linear(8, out_shape[1])
    with pytest.raises(GpuwiseError, match=re.escape(says)) as caught:
        default_loss(model, torch.randn(out_shape[0], 8), torch.randn(*y_shape))
    assert f"{out_shape}" in caught.value.message and f"{y_shape}" in caught.value.message
    assert default_loss(model, torch.randn(4, 8), torch.randn(*out_shape)).dim() == 0  # the same shape trains


# -- 5. hints that name the cause ----------------------------------------------------------------------------------

def test_nan_in_the_batch_is_blamed_on_the_data_not_the_learning_rate():
    def poisoned(x, y):
        return x.clone().fill_(float("nan")), y

    with pytest.raises(GpuwiseError, match="the batch of step 1 holds NaN in its inputs") as caught:
        _trainer(data=Items(make=poisoned)).fit()
    assert "--lr" not in str(caught.value)
    with pytest.raises(GpuwiseError, match="holds Inf in its targets"):
        _trainer(data=Items(make=lambda x, y: (x, y + float("inf")))).fit()


def test_a_forward_returning_a_dict_uses_its_loss_or_logits():
    class DictOut(nn.Linear):
        def forward(self, x):
            return {"logits": super().forward(x)}

    model = DictOut(4, 3)
    y = torch.tensor([0, 2])
    loss = default_loss(model, torch.randn(2, 4), y)
    assert loss.dim() == 0
    with pytest.raises(GpuwiseError, match=r"returns dict \(hidden\) with no 'loss' or 'logits'"):
        default_loss(lambda x: {"hidden": x}, torch.randn(2, 4), y)


def test_a_batch_that_does_not_split_over_the_processes_names_no_micro_batch():
    with pytest.raises(GpuwiseError) as caught:
        TrainConfig(batch=10).per_process(4)
    assert caught.value.message == "--batch 10 does not split over 4 processes" and "micro" not in str(caught.value)


# -- 6. Hugging Face items -----------------------------------------------------------------------------------------

class KeywordModel(nn.Module):
    """forward(input_ids, attention_mask, labels=None) -> an object with .loss (None) and .logits, as HF models."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(11, 8), nn.Linear(8, 11)

    def forward(self, input_ids, attention_mask, labels=None):
        from types import SimpleNamespace

        return SimpleNamespace(loss=None, logits=self.head(self.emb(input_ids)) * attention_mask[..., None])


def _token_items(n=16):
    ids = torch.randint(11, (n, 5), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": ids[i], "attention_mask": torch.ones(5), "labels": ids[i]} for i in range(n)]


def test_dict_items_train_with_keywords_and_the_loss_from_logits():
    result = _trainer(data=_token_items(), model=KeywordModel(), steps=3, micro_batch=2).fit()
    assert result.steps == 3 and torch.isfinite(torch.tensor(result.final_loss))


def test_a_tuple_of_dict_items_and_targets_trains():
    items = [(d, d["labels"]) for d in _token_items()]
    for d, _ in items:
        del d["labels"]
    assert _trainer(data=items, model=KeywordModel(), steps=2, micro_batch=2).fit().steps == 2


def test_a_hugging_face_gpt2_trains_on_dict_items():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=11, n_positions=8)
    model = transformers.GPT2LMHeadModel(config)
    result = _trainer(data=_token_items(), model=model, steps=2).fit()
    assert result.steps == 2 and 1.0 < result.final_loss < 4.0  # ~ln 11 at the start


# -- 7. DDP randomness, BatchNorm, teardown ------------------------------------------------------------------------

def test_each_rank_draws_its_own_randomness_and_rank_0_keeps_the_seed():
    from gpuwise.training.checkpoint import rank_seed

    assert rank_seed(1337, 0) == 1337 and len({rank_seed(1337, r) for r in range(8)}) == 8


def test_batchnorm_says_when_the_micro_batch_changes_its_statistics():
    from gpuwise.training.parallelize import batchnorm_note

    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert batchnorm_note(bn, micro_batch=8, per_rank=8, world_size=1, synced=False) is None
    assert "over 2 samples, not the batch of 8 (micro-batches of 2)" in batchnorm_note(
        bn, micro_batch=2, per_rank=8, world_size=1, synced=False)
    assert "--sync-batchnorm" in batchnorm_note(bn, micro_batch=8, per_rank=8, world_size=2, synced=False)
    assert batchnorm_note(bn, micro_batch=8, per_rank=8, world_size=2, synced=True) is None
    t = _trainer(model=nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2)), micro_batch=2, steps=1)
    assert any("BatchNorm normalises over 2 samples" in e for e in t.fit().events)


def test_the_process_group_is_left_after_every_process_finished(monkeypatch):
    from gpuwise.training import distributed

    calls = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(distributed.dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: calls.append("destroy"))
    distributed.stop(distributed.Ranks(world_size=2))
    distributed.stop(distributed.Ranks(world_size=2), clean=False)  # after a failure: no waiting on the others
    assert calls == ["barrier", "destroy", "destroy"]


# -- 8. the history above the progress bar -------------------------------------------------------------------------

def test_a_line_per_log_step_stays_above_the_progress_bar():
    from gpuwise.render.train import TrainProgress
    from gpuwise.training.trainer import StepLog

    out = io.StringIO()
    progress = TrainProgress(Console(file=out, force_terminal=True, width=100, highlight=False), live=True, total=20)
    for step in (10, 20):
        progress.log(StepLog(step=step, loss=2.5, lr=1e-3, grad_norm=0.5, tokens_per_s=100.0, mfu=None,
                             peak_memory_bytes=None, data_wait=0.0, skipped=False))
    progress.stop()
    text = out.getvalue()
    assert "step     10  loss 2.5000" in text and "step     20  loss 2.5000" in text


def test_compile_says_so_and_that_resume_is_bit_exact_in_eager_mode_only(monkeypatch):
    from gpuwise.training import run

    events = []
    monkeypatch.setattr("torch.compile", lambda model, **kw: model)
    run.run_training(TrainOptions(seq=16, monitor=False, auto=False, config=TrainConfig(steps=1, batch=2,
                                                                                        compile=True)),
                     on_event=events.append, environ={})
    assert any("compiling the model" in e and "eager mode only" in e for e in events)


def test_the_default_warm_up_is_long_enough_for_the_short_demo():
    # --steps 60 warmed up in 6 steps and its loss rose from 4.6 to 7.1 at step 10 (grad norm 27)
    assert [TrainConfig(steps=n).warmup for n in (1, 6, 60, 200, 500, 5000)] == [1, 3, 20, 20, 50, 100]
    assert TrainConfig(steps=60, warmup_steps=6).warmup == 6


def test_a_dataset_smaller_than_the_batch_is_named():
    # a one-item Dataset was read 8 times a step at --batch 8, silently
    events = _trainer(data=Items(n=1), steps=1).fit().events  # batch 4
    assert "the dataset holds 1 item, fewer than the batch of 4: each step reads every item about 4 times" in (
        " ".join(events))
    assert not any("fewer than the batch" in e for e in _trainer(data=Items(n=4), steps=1).fit().events)


def test_the_readme_says_compile_is_not_bit_exact_on_resume():
    from pathlib import Path

    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    assert "bit-exact resume holds in eager mode only" in readme


def test_sync_batchnorm_converts_in_place_on_gpus_and_is_refused_on_the_cpu():
    from gpuwise.training.parallelize import apply_sync_batchnorm

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    params = list(model.parameters())
    synced = apply_sync_batchnorm(model, torch.device("cuda"))  # swaps modules: no GPU touched
    assert isinstance(synced[1], nn.SyncBatchNorm) and all(a is b for a, b in zip(params, synced.parameters(),
                                                                                      strict=True))
    with pytest.raises(GpuwiseError, match="--sync-batchnorm runs on GPUs only"):
        apply_sync_batchnorm(model, torch.device("cpu"))
