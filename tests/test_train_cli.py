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
    straight, resumed = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    args = ["train", "--batch", "4", "--seq", "16"]
    assert run(capsys, *args, "--steps", "20", "--log", str(straight))[0] == 0
    ckpts = tmp_path / "ckpt"
    assert run(capsys, *args, "--steps", "10", "--checkpoint-dir", str(ckpts))[0] == 0
    code, out, _ = run(capsys, *args, "--steps", "20", "--checkpoint-dir", str(ckpts), "--resume",
                       "--log", str(resumed))
    assert code == 0 and "resumed from 10" in out
    a = [json.loads(line) for line in straight.read_text().splitlines()]
    b = [json.loads(line) for line in resumed.read_text().splitlines()]
    assert [e["loss"] for e in a if e["step"] > 10] == [e["loss"] for e in b]


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

    args = ["train", "--steps", "6", "--batch", "8", "--micro-batch", "2", "--seq", "16"]
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert run(capsys, *args, "--log", str(one))[0] == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "gpuwise", *args, "--log-file", str(two), "--checkpoint-dir", str(tmp_path / "ck")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    a = [json.loads(line)["loss"] for line in one.read_text().splitlines()]
    b = [json.loads(line)["loss"] for line in two.read_text().splitlines()]
    assert len(a) == len(b) == 1 and b[0] == pytest.approx(a[0], rel=1e-4)
    assert (tmp_path / "ck" / "step-000000006" / "manifest.json").is_file()  # written once, by rank 0
