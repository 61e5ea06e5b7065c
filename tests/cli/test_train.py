"""``gpuwise train`` out of the box: the character GPT on Python's own text, logs, checkpoints, resume."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from gpuwise.errors import GpuwiseError

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
    assert code == 0 and "resumed from 10" in " ".join(out.split())
    a = [json.loads(line) for line in straight.read_text().splitlines()]
    b = [json.loads(line) for line in resumed.read_text().splitlines()]
    assert b[0] == {**b[0], "event": "resume", "step": 10}  # the log says where the run picked up
    b = b[1:]
    assert [e["loss"] for e in a if e["step"] > 10] == [e["loss"] for e in b] and len(b) == 10


@pytest.mark.parametrize(("args", "message"), [
    (["--seq", "4"], "--seq 4 is outside 8..1024"),
    (["--resume"], "--resume needs a checkpoint folder"),
    (["--batch", "10", "--micro-batch", "4"], "--batch 10 is not a multiple of the micro-batch 4"),
    (["--precision", "fp64"], "--precision 'fp64' is not one of"),
    (["--lr", "-1"], "--lr -1.0 must be"),  # "positive" or "a positive number" (config.py in flux)
])
def test_bad_input(capsys, args, message):
    code, _, err = run(capsys, "train", "--steps", "2", *args)
    assert code == 2 and message in err and err.count("\n") == 1


def test_two_processes_over_gloo_match_one_process(capsys, tmp_path, seeded_subprocesses):
    """torchrun with 2 CPU processes (DDP over gloo, accumulation with no_sync) takes the same steps as one
    process with the same global batch. The ranks plan their run from the session's captures."""
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
    # a rank that dies says why before torchrun's summary: keep those lines, not only the summary's tail
    why = [line for line in done.stderr.splitlines() if "error" in line.lower() or "terminate" in line]
    assert done.returncode == 0, "\n".join(why[:20]) + "\n" + done.stderr[-1500:]
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
    (["--model", "nofile.py"], "--model 'nofile.py' names a file but no function"),
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
    return [e["loss"] for e in map(json.loads, path.read_text().splitlines()) if "event" not in e]


@pytest.mark.slow
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
    assert start >= 8 and f"resumed from {start}" in " ".join(out.split())  # a long tmp path may wrap the line
    assert _losses(resumed) == expected[start:]  # bit for bit on the CPU

    # killed while writing the second checkpoint (step 8): the first one is used
    ck, log = tmp_path / "b", tmp_path / "b.jsonl"
    done = subprocess.run([sys.executable, "-c", KILLED_IN_SAVE, *args, "--checkpoint-every", "4",
                           "--checkpoint-dir", str(ck)], capture_output=True, timeout=300)
    assert done.returncode == -signal.SIGKILL
    assert [p.name for p in ck.iterdir() if not p.name.startswith(".")] == ["step-000000004"]
    assert any(p.name.startswith(".step-000000008") for p in ck.iterdir())  # the half-written one, hidden
    code, out, _ = run(capsys, *args, "--checkpoint-dir", str(ck), "--resume", "--log", str(log))
    assert code == 0 and "resumed from 4" in " ".join(out.split())
    assert _losses(log) == expected[4:]
    assert not any(p.name.startswith(".") and p.name != ".lock" for p in ck.iterdir())  # the leftover was cleared


def test_a_damaged_newest_checkpoint_is_skipped_with_a_note(capsys, tmp_path):
    import os

    args = ["train", "--batch", "4", "--seq", "16", "--no-auto", "--checkpoint-dir", str(tmp_path)]
    assert run(capsys, *args, "--steps", "4", "--checkpoint-every", "2")[0] == 0
    os.truncate(tmp_path / "step-000000004" / "state.pt", 10)
    code, out, err = run(capsys, *args, "--steps", "6", "--resume")
    assert code == 0 and "resumed from 2" in " ".join(out.split())
    assert "skipped 1 damaged checkpoint(s): step-000000004/state.pt is missing or truncated" in " ".join(err.split())


COUNT_ALL_REDUCES = """
import contextlib, io, json, os, signal, sys
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from gpuwise.cli import main
from gpuwise.training import trainer as T
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
report = {"all_reduces": len(calls)}

# gpuwise train itself: the weights each process builds, the dropout mask each would draw next, and a Ctrl-C
# that only rank 1 hears (during step 3's update, after that step's all-reduce): both stop after step 4
seen = {}
real_init, real_update = T.Trainer.__init__, T.Trainer._update


def init(self, model, *args, **kwargs):
    seen["weights"] = float(sum(p.detach().double().sum() for p in model.parameters()))
    real_init(self, model, *args, **kwargs)
    with torch.random.fork_rng():
        seen["mask"] = torch.nn.functional.dropout(torch.ones(32), 0.5).nonzero().flatten().tolist()


def update(self):
    if ranks.rank == 1 and self.step == 2:
        os.kill(os.getpid(), signal.SIGINT)
    return real_update(self)


T.Trainer.__init__, T.Trainer._update = init, update
err = io.StringIO()
with contextlib.redirect_stderr(err):
    code = main(["train", "--steps", "40", "--batch", "4", "--seq", "16", "--no-monitor", "--no-auto",
                 "--checkpoint-dir", sys.argv[1], "--checkpoint-every", "100"])
report |= seen | {"code": code, "stderr": err.getvalue(), "left": not torch.distributed.is_initialized()}
sys.stdout.flush()  # one write of one line: the two processes share the pipe, and two prints could interleave
os.write(1, (json.dumps(report | {"rank": ranks.rank}) + "\\n").encode())
stop(ranks)
"""


@pytest.mark.slow
def test_ddp_accumulation_all_reduces_once_per_step_not_per_micro_batch(tmp_path):
    """Four micro-batches a step on each of two processes: DDP's no_sync holds the gradient all-reduce to the
    last one (a tiny model is one bucket), so 3 steps make 3 all-reduces, not 12.

    In the same launch, gpuwise train: every process builds the same weights, then draws its own dropout masks;
    a Ctrl-C heard by one process stops both after the same step, saved once, exit 130; and the process group is
    left cleanly (no rank aborts at exit)."""
    script = tmp_path / "count.py"
    script.write_text(COUNT_ALL_REDUCES)
    import os
    import subprocess
    import sys

    ck = tmp_path / "ck"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), str(ck)], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    reports = sorted((json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")),
                     key=lambda r: r["rank"])
    assert [r["all_reduces"] for r in reports] == [3, 3]
    zero, one = reports
    assert zero["weights"] == one["weights"] and zero["mask"] != one["mask"]
    assert zero["code"] == one["code"] == 130 and zero["left"] and one["left"]
    assert "stopped at step 4; saved step-000000004; continue with --resume" in zero["stderr"]
    assert "stopped at step" not in one["stderr"]  # said once, by the process that reports
    assert [p.name for p in ck.iterdir() if p.name.startswith("step-")] == ["step-000000004"]
    assert "abort" not in done.stderr.lower() and "Signal" not in done.stderr


# -- one vocabulary with gpuwise plan -----------------------------------------------------------------------------

TINY_MODEL = '''
import torch
from torch import nn


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def build(batch):
    return Blocks(), torch.randn(batch, 8)
'''

# Quick to capture on fake tensors, too big for small GPUs: the plan offers every kind of remedy.
WIDE_MODELS = '''
import torch
from torch import nn


class Wide(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(4))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def huge(batch):  # 1.07 B parameters: sharding over GPUs or LoRA
    return Wide(16384), torch.randn(batch, 16384)


def long(batch):  # 8192 rows of 2048 per sample: precision, checkpointing and micro-batches
    return Wide(2048), torch.randn(batch, 8192, 2048)
'''


@pytest.mark.parametrize(("args", "message", "hint"), [
    (["--gpus", "2"], "plan only: --gpus 2 needs 2 processes", "torchrun --nproc_per_node 2 -m gpuwise train"),
    (["--sharding", "zero2"], "plan only: --sharding zero2", "use --sharding fsdp under torchrun"),
    (["--sharding", "zero1"], "plan only: --sharding zero1", "use --sharding fsdp under torchrun"),
    (["--task", "finetune-lora"], "plan only: --task finetune-lora", "drop --task"),
    (["--task", "infer"], "plan only: --task infer", "drop --task"),
    (["--lora-rank", "16"], "plan only: --lora-rank 16", "drop --lora-rank"),
    (["--qlora"], "plan only: --qlora", "drop --qlora"),
    (["--optimizer", "adamw8bit"], "plan only: --optimizer adamw8bit", "gpuwise plan --optimizer adamw8bit"),
    (["--optimizer-in-backward"], "plan only: --optimizer-in-backward", "drop --optimizer-in-backward"),
    (["--optimizer", "adam"], "--optimizer 'adam' is not one of adamw, sgd", "pass --optimizer adamw"),
    (["--task", "pretrain"], "--task 'pretrain' is not one of train, finetune-lora, infer", "pass --task train"),
    (["--checkpointing", "some"], "--checkpointing 'some' is not one of none, full", "pass --checkpointing none"),
])
def test_flags_train_cannot_run_are_one_line_plan_only_errors(capsys, args, message, hint):
    code, _, err = run(capsys, "train", "--steps", "1", "--no-auto", *args)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {message}") and hint in err


def test_the_shared_vocabulary_runs_and_means_what_plan_means(capsys):
    code, out, err = run(capsys, "train", "--steps", "1", "--batch", "8", "--micro-batch", "2", "--precision",
                         "bf16-mixed", "--checkpointing", "full", "--gpus", "1", "--sharding", "ddp", "--task",
                         "train", "--seq", "16", "--device", "cpu", "--json")
    assert code == 0, err
    s = json.loads(out)
    assert (s["batch"], s["micro_batch"], s["grad_accum"], s["precision"]) == (8, 2, 4, "bf16-mixed")
    from gpuwise.planning.setup import Setup

    assert Setup.for_batch(batch=8, micro_batch=2).grad_accum == s["grad_accum"]  # plan reads the flags alike


def test_every_remedy_plan_prints_runs_in_train_as_printed(capsys, tmp_path):
    """Two plans that do not fit (a wide model's 1 B parameters on a T4; long samples on a 12 GB card) print
    every kind of remedy; each row's flags, pasted after the plan's own, train one step of a small model (or are
    refused in one "plan only:" line), with the batch, micro-batch and precision the plan meant."""
    import shlex

    from gpuwise.planning.setup import Setup

    wide, tiny = tmp_path / "wide.py", tmp_path / "tiny.py"
    wide.write_text(WIDE_MODELS)
    tiny.write_text(TINY_MODEL)
    plans = [["--model", f"{wide}:huge", "--batch", "4096", "--gpu", "t4", "--precision", "fp32"],
             ["--model", f"{wide}:long", "--batch", "64", "--gpu", "rtx-3060-12gb", "--precision", "fp32"]]
    ran, refused, names = 0, 0, set()
    for plan in plans:
        code, out, err = run(capsys, "plan", *plan, "--json")
        assert code == 0, err
        remedies = json.loads(out)["remedies"]
        assert remedies
        base = plan[2:4] + plan[6:]  # the plan's --batch and --precision, without --model and --gpu
        for remedy in remedies:
            names.add(remedy["name"].split()[0].rstrip(","))
            flags = shlex.split(remedy["flags"])
            code, out, err = run(capsys, "train", "--model", f"{tiny}:build", "--steps", "1", "--no-auto", *base,
                                 *flags, "--json")
            if code == 2 and err.startswith("error: plan only:"):
                assert err.count("\n") == 1
                refused += 1
                continue
            assert code == 0, (remedy["flags"], err)
            given = dict(zip(base + flags, (base + flags)[1:], strict=False))  # flag -> value; the last one wins
            meant = Setup.for_batch(batch=int(given["--batch"]), precision=given["--precision"],
                                    micro_batch=int(given["--micro-batch"]) if "--micro-batch" in given else None)
            s = json.loads(out)
            assert (s["batch"], s["micro_batch"], s["grad_accum"], s["precision"]) == (
                meant.batch, meant.micro_batch, meant.grad_accum, meant.precision), remedy["flags"]
            ran += 1
    assert {"fp16", "bf16", "activation", "micro-batch", "FSDP", "LoRA", "QLoRA"} <= names
    assert ran >= 5 and refused >= 5, (ran, refused)


# -- the device: hardware.device decides, for train as for bench and plan -----------------------------------------

def _two_gpu_machine(second: str = "NVIDIA A100-SXM4-80GB", cc: tuple[int, int] = (8, 0), memory_gib: int = 80):
    """GPU 0 an H100, GPU 1 another card: two catalog rows, so a wrong index shows."""
    from dataclasses import replace

    from conftest import cuda_env, gpu, nvml
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.hardware.detect import describe_local

    env = cuda_env(count=2)
    from gpuwise.units import GiB

    memory = memory_gib * GiB
    env = replace(env, torch=replace(env.torch, devices=(gpu(index=0), gpu(second, cc, memory, index=1))),
                  nvml_devices=(nvml(index=0), nvml(second, cc, memory, index=1)))
    return describe_local(env, load_catalog())


def test_device_cuda_1_trains_against_gpu_1s_catalog_row(monkeypatch):
    """run_training resolves --device on the machine it is given (this one by default): cuda:1 is the A100, and
    the MFU divides by the A100's bf16 peak, not GPU 0's."""
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.training import run as train_run
    from gpuwise.training.config import TrainOptions
    from gpuwise.training.distributed import Ranks
    from gpuwise.training.meter import mfu_peak_tflops

    monkeypatch.setattr(train_run, "_run", lambda opts, prepared, *rest: prepared)  # stop before the GPU is used
    machine = _two_gpu_machine()
    chosen = train_run.run_training(TrainOptions(device="cuda:1"), machine=machine, environ={})
    assert (chosen.target.name, chosen.target.row.key, chosen.config.precision) == (
        "cuda:1", "a100-80gb-sxm", "bf16-mixed")
    catalog = load_catalog()
    assert mfu_peak_tflops(chosen.target, "bf16-mixed") == catalog.get("a100-80gb-sxm").peak_tflops.get("bf16")
    assert catalog.get("a100-80gb-sxm").peak_tflops.get("bf16") != catalog.get("h100-sxm").peak_tflops.get("bf16")
    assert train_run.run_training(TrainOptions(), machine=machine, environ={}).target.row.key == "h100-sxm"
    # under torchrun each process takes its local rank's GPU
    rank1 = train_run.prepare(TrainOptions(), Ranks(rank=1, world_size=2, local_rank=1), machine)
    assert rank1.target.row.key == "a100-80gb-sxm"


def test_precision_defaults_to_the_devices_and_bf16_is_refused_where_the_gpu_has_none(monkeypatch):
    from gpuwise.training import run as train_run
    from gpuwise.training.config import TrainConfig, TrainOptions

    monkeypatch.setattr(train_run, "_run", lambda opts, prepared, *rest: prepared)
    machine = _two_gpu_machine("Tesla T4", (7, 5), 15)  # Turing: no bf16
    t4 = train_run.run_training(TrainOptions(device="cuda:1"), machine=machine, environ={})
    assert (t4.target.row.key, t4.config.precision) == ("t4", "fp16-mixed")
    assert train_run.run_training(TrainOptions(device="cpu"), machine=machine, environ={}).config.precision == "fp32"
    with pytest.raises(GpuwiseError, match="this GPU has no bf16 for --precision bf16-mixed"):
        train_run.run_training(TrainOptions(device="cuda:1", config=TrainConfig(precision="bf16-mixed")),
                               machine=machine, environ={})
    h100 = train_run.run_training(TrainOptions(device="cuda:0", config=TrainConfig(precision="bf16-mixed")),
                                  machine=machine, environ={})
    assert h100.config.precision == "bf16-mixed"


# --hf-config: transformers' model of a config, trained for real (tests/training/test_tasks.py checks the task)
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
              "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 128, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2}
HF = ["--seq", "16", "--batch", "4", "--lr", "1e-2", "--device", "cpu", "--no-monitor"]


def _tiny_llama(tmp_path) -> str:
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


def test_train_a_hugging_face_config_learns_its_batch(capsys, tmp_path):
    import math

    log = tmp_path / "log.jsonl"
    config = _tiny_llama(tmp_path)
    code, out, err = run(capsys, "train", "--hf-config", config, *HF, "--steps", "20", "--log-every", "1", "--log",
                         str(log), "--json")
    assert code == 0, err
    summary = json.loads(out)
    # 28,832 parameters by hand: embeddings and an untied head of 128 x 32, two blocks of 4 x 32 x 32 attention,
    # 3 x 32 x 64 MLP and two norms, the final norm
    assert summary["params"] == 2 * 128 * 32 + 2 * (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32) + 32
    assert summary["task"] == "llama" and summary["unit"] == "tokens" and summary["steps"] == 20
    assert "the plan fits 4 sequences" in summary["auto"]  # the planner captured the same model
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(128), abs=0.1)  # small random weights: about uniform at first
    assert losses[-1] < losses[0] - 2  # the one repeated batch, learnt by heart


def test_train_a_hub_id_from_the_offline_cache(capsys, tmp_path, monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    _tiny_llama(tmp_path)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny--llama"  # huggingface_hub's cache layout (test_hub.py)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text((tmp_path / "config.json").read_text())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read from the environment at import
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)
    code, out, err = run(capsys, "train", "--hf-config", "tiny/llama", *HF, "--steps", "3", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["task"] == "tiny/llama" and summary["steps"] == 3 and summary["params"] == 28_832
    code, _, err = run(capsys, "train", "--hf-config", "tiny/nope", "--steps", "3")
    assert code == 2 and err.count("\n") == 1 and "tiny/nope's config.json is not in the Hugging Face cache" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "x.py:f"], "--model and --hf-config both name a model"),
    (["--example", "text"], "--example text and --hf-config both name a model"),
    (["--seq", "65"], "--seq 65 is longer than the config's 64 positions"),
    (["--image-size", "16"], "--image-size applies to --example image"),
    (["--loss", "chunked"], "plan only: --loss chunked"),
])
def test_hf_config_conflicts_are_one_line(capsys, tmp_path, args, message):
    code, _, err = run(capsys, "train", "--hf-config", _tiny_llama(tmp_path), "--steps", "2", "--no-auto", *args)
    assert code == 2 and message in err and err.count("\n") == 1, err


HF_DATA = '''
import torch


def tokens():
    """Sequences counting up from a random start, mod 128: the next token is the last plus one."""
    g = torch.Generator().manual_seed(0)
    ids = (torch.randint(128, (40, 1), generator=g) + torch.arange(16)) % 128
    return torch.utils.data.TensorDataset(ids[:32], ids[:32]), torch.utils.data.TensorDataset(ids[32:], ids[32:])
'''


def test_train_a_hugging_face_config_on_a_users_dataset(capsys, tmp_path):
    import math

    data = tmp_path / "data.py"
    data.write_text(HF_DATA)
    code, out, err = run(capsys, "train", "--hf-config", _tiny_llama(tmp_path), "--data", f"{data}:tokens",
                         "--steps", "60", "--batch", "8", "--lr", "1e-2", "--device", "cpu", "--no-monitor",
                         "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["unit"] == "samples" and summary["eval_loss"] < math.log(128) - 2  # the rule, on held-out rows


def test_resume_a_hugging_face_run_and_refuse_another_config(capsys, tmp_path):
    import shutil

    config = _tiny_llama(tmp_path)
    args = ["train", "--hf-config", config, *HF, "--steps", "10", "--log-every", "1"]
    straight, resumed, ckpts = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "ckpt"
    assert run(capsys, *args, "--log", str(straight))[0] == 0
    assert run(capsys, *args, "--checkpoint-dir", str(ckpts), "--checkpoint-every", "5")[0] == 0
    shutil.rmtree(ckpts / "step-000000010")  # as if stopped after the checkpoint at step 5
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(TINY_LLAMA, num_hidden_layers=1)))
    code, _, err = run(capsys, "train", "--hf-config", str(other), "--checkpoint-dir", str(ckpts), "--resume")
    assert code == 2 and f"--hf-config {other} here, {config} in the checkpoint" in err
    code, out, err = run(capsys, "train", "--checkpoint-dir", str(ckpts), "--resume", "--log", str(resumed))
    assert code == 0 and "resumed from 5" in " ".join(out.split()), err  # the config taken from the checkpoint
    a = [json.loads(line) for line in straight.read_text().splitlines()]
    b = [e for e in map(json.loads, resumed.read_text().splitlines()) if "event" not in e]  # past the resume line
    assert [e["loss"] for e in a if e["step"] > 5] == [e["loss"] for e in b] and len(b) == 5
