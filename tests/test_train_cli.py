"""``gpuwise train`` out of the box: the character GPT on Python's own text, logs, checkpoints, resume."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli

TINY = ["train", "--steps", "6", "--batch", "4", "--seq", "16"]


run = run_cli


def test_train_json_summary_and_log_lines(capsys, tmp_path):
    log = tmp_path / "log.jsonl"
    code, out, err = run(capsys, *TINY, "--log", str(log), "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["steps"] == 6 and summary["device"] == "cpu" and summary["precision"] == "fp32"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [entry["step"] for entry in lines] == [6]  # log every 10 steps, and the last
    assert lines[-1]["loss"] == pytest.approx(summary["final_loss"])


def test_resume_through_the_command_line_continues_exactly(capsys, tmp_path):
    import shutil

    straight, resumed = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    args = ["train", "--batch", "4", "--seq", "16", "--steps", "20", "--log-every", "1"]
    assert run(capsys, *args, "--log", str(straight))[0] == 0
    ckpts = tmp_path / "ckpt"
    assert run(capsys, *args, "--checkpoint-dir", str(ckpts), "--checkpoint-every", "10")[0] == 0
    shutil.rmtree(ckpts / "step-000000020")  # as if stopped after the checkpoint at step 10
    code, out, _ = run(capsys, *args, "--checkpoint-dir", str(ckpts), "--resume", "--log", str(resumed))
    assert code == 0 and "resumed from 10" in out
    a = [json.loads(line) for line in straight.read_text().splitlines()]
    b = [json.loads(line) for line in resumed.read_text().splitlines()]
    assert [e["loss"] for e in a if e["step"] > 10] == [e["loss"] for e in b] and len(b) == 10


@pytest.mark.parametrize(("args", "message"), [
    (["--seq", "4"], "--seq 4 is outside 8..1024"),
    (["--resume"], "--resume needs a checkpoint folder"),
    (["--batch", "10", "--micro-batch", "4"], "--batch 10 is not a multiple of the micro-batch 4"),
    (["--precision", "fp64"], "--precision 'fp64' is not one of"),
    (["--lr", "-1"], "--lr -1.0 must be positive"),
])
def test_bad_input(capsys, args, message):
    code, _, err = run(capsys, "train", "--steps", "2", *args)
    assert code == 2 and message in err and err.count("\n") == 1


def test_two_processes_over_gloo_match_one_process(capsys, tmp_path):
    """torchrun with 2 CPU processes (DDP over gloo, accumulation with no_sync) takes the same steps as one
    process with the same global batch."""
    import os
    import subprocess
    import sys

    args = ["train", "--steps", "6", "--batch", "8", "--micro-batch", "2", "--seq", "16", "--log-every", "1"]
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert run(capsys, *args, "--log", str(one))[0] == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "gpuwise", *args, "--log-file", str(two), "--checkpoint-dir", str(tmp_path / "ck")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    a = [json.loads(line)["loss"] for line in one.read_text().splitlines()]
    b = [json.loads(line)["loss"] for line in two.read_text().splitlines()]
    assert len(a) == len(b) == 6 and b == pytest.approx(a, rel=1e-5)
    assert (tmp_path / "ck" / "step-000000006" / "manifest.json").is_file()  # written once, by rank 0


USER_FILE = '''
import torch
from torch import nn


def build(batch):
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(batch, 8)


def dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 8, generator=g)
    y = (x @ torch.randn(8, 4, generator=g)).argmax(1)  # a linear rule to learn
    return torch.utils.data.TensorDataset(x[:256], y[:256]), torch.utils.data.TensorDataset(x[256:], y[256:])


def wrong():
    return torch.utils.data.TensorDataset(torch.randn(64, 5), torch.zeros(64, dtype=torch.long))
'''


def test_a_users_model_and_dataset_from_files(capsys, tmp_path):
    import math

    f = tmp_path / "mine.py"
    f.write_text(USER_FILE)
    code, out, err = run(capsys, "train", "--model", f"{f}:build", "--data", f"{f}:dataset", "--steps", "80",
                         "--batch", "16", "--lr", "1e-2", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["unit"] == "samples" and summary["task"] == "mine.py:build"
    assert summary["eval_loss"] < math.log(4) - 0.5  # held-out loss: the rule was learnt, not the rows
    code, _, err = run(capsys, "train", "--model", f"{f}:build", "--data", f"{f}:wrong", "--steps", "2")
    assert code == 2 and "the data does not fit the model: RuntimeError: mat1 and mat2" in err
    code, out, err = run(capsys, "train", "--model", f"{f}:build", "--steps", "5", "--batch", "8", "--json")
    assert code == 0 and json.loads(out)["steps"] == 5  # no --data: the function's example inputs


def test_image_task_out_of_the_box(capsys):
    code, out, err = run(capsys, "train", "--example", "image", "--steps", "3", "--batch", "8", "--image-size", "16",
                         "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["task"] == "small-cnn" and summary["unit"] == "samples" and summary["eval_loss"] is not None


@pytest.mark.parametrize(("args", "message"), [
    (["--data", "x.py:f"], "--data needs --model"),
    (["--example", "image", "--seq", "32"], "--seq applies to --example text"),
    (["--example", "audio"], "--example 'audio' is not text or image"),
    (["--model", "nofile.py"], "--model 'nofile.py' is not file.py:function"),
    (["--model", "nofile.py:f"], "no such file: nofile.py"),
    (["--sharding", "zero9"], "--sharding 'zero9' is not one of ddp, fsdp"),
    (["--eval-every", "-1"], "--eval-every -1 is negative"),
    (["--log", "."], "cannot write the log .: it is a folder"),
    (["--checkpoint-every", "2"], "--checkpoint-every needs a folder"),
    (["--checkpoint-dir", "README.md"], "--checkpoint-dir README.md is a file"),
])
def test_more_bad_input(capsys, args, message):
    code, _, err = run(capsys, "train", "--steps", "2", "--no-auto", *args)
    assert code == 2 and message in err and err.count("\n") == 1, err


def _torchrun(*args, timeout=300):
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "gpuwise", *args], capture_output=True, text=True, env=env, timeout=timeout)


def _losses(path):
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def test_fsdp_over_two_processes_matches_one_process_and_resumes_from_sharded_checkpoints(capsys, tmp_path):
    """FSDP2 (fully_shard per block) over gloo: the same losses as one process; the checkpoint is written by
    both processes with torch.distributed.checkpoint, and a resumed run continues exactly."""
    import shutil

    args = ["train", "--steps", "6", "--batch", "8", "--micro-batch", "2", "--seq", "16", "--log-every", "1"]
    one, two, three = tmp_path / "one.jsonl", tmp_path / "two.jsonl", tmp_path / "three.jsonl"
    assert run(capsys, *args, "--log", str(one))[0] == 0
    ck = tmp_path / "ck"
    done = _torchrun(*args, "--sharding", "fsdp", "--log-file", str(two), "--checkpoint-dir", str(ck),
                     "--checkpoint-every", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-5)
    shards = sorted(p.name for p in (ck / "step-000000003" / "dcp").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    shutil.rmtree(ck / "step-000000006")  # as if stopped after the checkpoint at step 3
    done = _torchrun(*args, "--sharding", "fsdp", "--log-file", str(three), "--checkpoint-dir", str(ck), "--resume")
    assert done.returncode == 0, done.stderr[-2000:]
    assert _losses(three) == pytest.approx(_losses(one)[3:], rel=1e-5)
    code, _, err = run(capsys, *args, "--checkpoint-dir", str(ck), "--resume")
    assert code == 2 and "was written with sharding fsdp, this run has none" in err


KILLED_IN_SAVE = '''
import os, signal, sys
from gpuwise.training import checkpoint
from gpuwise.cli import main

real = checkpoint.save_file
calls = []


def half_then_die(tensors, path):  # the second checkpoint: half its weights on disk, then SIGKILL
    calls.append(path)
    real(tensors, path)
    if len(calls) == 2:
        os.truncate(path, os.path.getsize(path) // 2)
        os.kill(os.getpid(), signal.SIGKILL)


checkpoint.save_file = half_then_die
sys.exit(main(sys.argv[1:]))
'''


def test_sigkill_mid_training_and_mid_checkpoint_then_resume_equals_the_uninterrupted_run(capsys, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    args = ["train", "--steps", "24", "--batch", "4", "--seq", "16", "--log-every", "1", "--no-auto"]
    straight = tmp_path / "straight.jsonl"
    assert run(capsys, *args, "--log", str(straight))[0] == 0
    expected = _losses(straight)

    # killed in the middle of training, a few steps after a checkpoint
    ck, log = tmp_path / "a", tmp_path / "a.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "gpuwise", *args, "--checkpoint-every", "4",
                             "--checkpoint-dir", str(ck), "--log", str(log)], stderr=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 10):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    seen = len(log.read_text().splitlines())
    assert 10 <= seen < 24  # it was killed mid-run
    resumed = tmp_path / "a2.jsonl"
    code, out, _ = run(capsys, *args, "--checkpoint-dir", str(ck), "--resume", "--log", str(resumed))
    assert code == 0
    start = 24 - len(_losses(resumed))
    assert start >= 8 and f"resumed from {start}" in out
    assert _losses(resumed) == expected[start:]  # bit for bit on the CPU

    # killed while writing the second checkpoint (step 8): the first one is used
    ck, log = tmp_path / "b", tmp_path / "b.jsonl"
    done = subprocess.run([sys.executable, "-c", KILLED_IN_SAVE, *args, "--checkpoint-every", "4",
                           "--checkpoint-dir", str(ck)], capture_output=True, timeout=300)
    assert done.returncode == -signal.SIGKILL
    assert [p.name for p in ck.iterdir() if not p.name.startswith(".")] == ["step-000000004"]
    assert any(p.name.startswith(".step-000000008") for p in ck.iterdir())  # the half-written one, hidden
    code, out, _ = run(capsys, *args, "--checkpoint-dir", str(ck), "--resume", "--log", str(log))
    assert code == 0 and "resumed from 4" in out
    assert _losses(log) == expected[4:]
    assert not any(p.name.startswith(".") for p in ck.iterdir())  # the leftover was cleared


def test_a_damaged_newest_checkpoint_is_skipped_with_a_note(capsys, tmp_path):
    import os

    args = ["train", "--batch", "4", "--seq", "16", "--no-auto", "--checkpoint-dir", str(tmp_path)]
    assert run(capsys, *args, "--steps", "4", "--checkpoint-every", "2")[0] == 0
    os.truncate(tmp_path / "step-000000004" / "state.pt", 10)
    code, out, err = run(capsys, *args, "--steps", "6", "--resume")
    assert code == 0 and "resumed from 2" in out
    assert "skipped 1 damaged checkpoint(s): step-000000004/state.pt is missing or truncated" in err


COUNT_ALL_REDUCES = '''
import json, os, sys
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from gpuwise.training.config import TrainConfig
from gpuwise.training.distributed import Ranks, start, stop
from gpuwise.training.trainer import Runtime, Trainer

ranks = Ranks.from_environ(os.environ)
start(ranks, torch.device("cpu"))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
items = [(torch.randn(8), torch.tensor(i % 3)) for i in range(64)]
trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), items,  # 8 per process: 4 micro-steps
                  TrainConfig(steps=3, batch=16, micro_batch=2), runtime=Runtime(ranks=ranks))
calls = []
trainer.model.register_comm_hook(None, lambda state, bucket: (calls.append(1), allreduce_hook(None, bucket))[1])
trainer.fit()
if ranks.main:
    print(json.dumps({"all_reduces": len(calls)}))
stop(ranks)
'''


def test_ddp_accumulation_all_reduces_once_per_step_not_per_micro_batch(tmp_path):
    """Four micro-batches a step on each of two processes: DDP's no_sync holds the gradient all-reduce to the
    last one (a tiny model is one bucket), so 3 steps make 3 all-reduces, not 12."""
    script = tmp_path / "count.py"
    script.write_text(COUNT_ALL_REDUCES)
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"all_reduces": 3}
