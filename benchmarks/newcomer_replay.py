"""Replay of issue 30's newcomer and fault run: every case it found, as a row (what a user did, the exit status and
the line they should get), run for real: real files, real signals, real write limits, real environment variables, each
in a fresh folder with its own cache.

    python benchmarks/newcomer_replay.py            # every case (a few minutes on 2 cores)
    python benchmarks/newcomer_replay.py --fast     # the rows CI runs too (tests/test_newcomer_replay.py)
    python benchmarks/newcomer_replay.py -k sigterm # the rows whose name holds "sigterm"

A row passes when the command exits as expected within its time limit, the expected text is in its output (for a
failure: in the last line on stderr, the one line that says what happened and how to go on), and its own check (a
file that must not exist, a log that must keep its lines) holds. It never passes on a traceback. The
count goes to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["train", "--batch", "4", "--seq", "16", "--no-monitor", "--no-auto"]  # the built-in example, small
OWN = ["train", "--batch", "4", "--no-monitor", "--no-auto"]  # the user's model and data

# A user's model and data, as the README shows them: function(batch) -> (model, inputs); a Dataset of (input, target).
USER = '''
import time
import torch
from torch import nn


class Items(torch.utils.data.Dataset):
    def __init__(self, n=32):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.randn(4, 2, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def build(batch):
    return nn.Linear(4, 2), (torch.randn(batch, 4),)


def dataset():
    return Items()


class Length(Items):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def __len__(self):
        if self.n is None:
            raise RuntimeError("no length")
        return self.n


def negative_len():
    return Length(-3)


def float_len():
    return Length(2.5)


def raising_len():
    return Length(None)


def lazy(batch):
    return nn.Sequential(nn.LazyLinear(2)), (torch.randn(batch, 4),)


class Detached(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x).detach()


def detached(batch):
    return Detached(), (torch.randn(batch, 4),)


def on_meta(batch):
    return nn.Linear(4, 2, device="meta"), (torch.randn(batch, 4),)


class Column(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(x)  # (B, 1)


def column(batch):
    return Column(), (torch.randn(batch, 4),)


class Flat(Items):
    def __getitem__(self, i):
        return self.x[i], self.y[i, 0]  # a scalar target: (B,) against the model's (B, 1)


def flat():
    return Flat()


def never():
    while True:
        time.sleep(1)
'''

# A Llama config.json as people write one by hand: no "architectures".
LLAMA = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8,
         "num_key_value_heads": 8, "num_hidden_layers": 4, "vocab_size": 32000, "max_position_embeddings": 2048,
         "rms_norm_eps": 1e-5}


def _llama(**changes) -> str:
    cfg = {**LLAMA, "architectures": ["LlamaForCausalLM"], **changes}
    return json.dumps({k: v for k, v in cfg.items() if v is not None})


@dataclass
class Case:
    name: str
    item: int  # the numbered item (0: the speed and newcomer notes)
    argv: list[str]  # after `python -m gpuwise`
    exit: int | tuple[int, ...]
    says: str = ""  # a regular expression the output (stdout and stderr together) must match
    files: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    before: list[list[str]] = field(default_factory=list)  # commands run first (each must exit 0)
    prepare: Callable[[Path], None] | None = None  # after ``before``, ahead of the command
    signal_at: tuple[str, int] | None = None  # (a path under the folder that must exist, the signal) then sent
    file_limit: int | None = None  # RLIMIT_FSIZE in bytes (a full disk, as `ulimit -f` makes one)
    stdout_to: str | None = None  # a path stdout is written to (/dev/full)
    check: Callable[[Path, str], str | None] | None = None  # None when fine, else what is wrong
    timeout: float = 120.0
    cwd: str = "."  # the folder the command runs in, under the case's own (``before`` runs in the case's own)
    fast: bool = False  # cheap enough for CI


def _steps(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "ck").glob("step-*"))


def _no_marker(folder: Path, out: str) -> str | None:
    return "the planted pickle ran" if (folder / "ran").exists() else None


def _plant_pickles(folder: Path) -> None:
    """Replace every kept capture with an entry whose arrays are pickled objects that would create ``ran``."""
    import numpy as np

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {folder / 'ran'}",))

    captures = folder / "cache" / "gpuwise" / "captures"
    entries = list(captures.glob("*.npz"))
    assert entries, "plan kept no capture"
    obj = np.empty(1, dtype=object)
    obj[0] = Payload()
    for entry in entries:
        with open(entry, "wb") as f:
            np.savez(f, __meta__=obj, __sha256__=obj)
        entry.with_suffix(".pkl").write_bytes(__import__("pickle").dumps(Payload()))


def _log_kept(folder: Path, out: str) -> str | None:
    lines = (folder / "run.log").read_text().splitlines()
    return None if lines[:3] == ["my notes", "run 1 of 3", "lr 3e-3 diverged"] else "the user's lines are gone"


def _latest_manifest(folder: Path) -> Path:
    return folder / "ck" / _steps(folder)[-1] / "manifest.json"


def _infinite_step(folder: Path) -> None:
    m = _latest_manifest(folder)
    m.write_text(m.read_text().replace('"step": 4', '"step": Infinity', 1))


def _fifo_manifest(folder: Path) -> None:
    m = _latest_manifest(folder)
    m.unlink()
    os.mkfifo(m)


def _change_model(folder: Path) -> None:
    (folder / "m.py").write_text(USER.replace("nn.Linear(4, 2), (torch.randn(batch, 4),)",
                                              "nn.Linear(4, 2, bias=False), (torch.randn(batch, 4),)"))


def _has_step(folder: Path, out: str) -> str | None:
    return None if _steps(folder) else "no checkpoint was saved"


def _no_ellipsis(folder: Path, out: str) -> str | None:
    return "a cell is cut (…)" if "…" in out else None


def _whole_command(folder: Path, out: str) -> str | None:
    lines = [line for line in out.splitlines() if "gpuwise train" in line]
    if not lines:
        return "no suggested command"
    return None if re.search(r"gpuwise train .*--micro-batch \d+", lines[0]) else f"the command is broken: {lines[0]!r}"


def _log_with_notes(folder: Path) -> None:
    (folder / "run.log").write_text("my notes\nrun 1 of 3\nlr 3e-3 diverged\n")


DEEP = "[" * 100_000 + "]" * 100_000
M = ["--model", "m.py:build"]
D = ["--data", "m.py:dataset"]
PLAN_GPT2 = ["plan", "--model", "gpt2", "--batch", "1", "--seq", "64"]

CASES = [
    # 1. code execution through the capture cache
    Case("a planted pickle in the capture cache never runs", 1, PLAN_GPT2, 0, "gpt2", before=[PLAN_GPT2],
         prepare=_plant_pickles, check=_no_marker),
    # 2. a scheduler's stop and a closed ssh session
    Case("SIGTERM finishes the step and saves it", 2, [*TINY, "--steps", "100000", "--checkpoint-dir", "ck"], 143,
         r"\(SIGTERM\); saved step-\d+.*--resume", signal_at=("ck/.lock", signal.SIGTERM), check=_has_step),
    Case("SIGHUP finishes the step and saves it", 2, [*TINY, "--steps", "100000", "--checkpoint-dir", "ck"], 129,
         r"\(SIGHUP\); saved step-\d+.*--resume", signal_at=("ck/.lock", signal.SIGHUP), check=_has_step),
    # 3. full disks
    Case("a full disk at a checkpoint is one line naming the last good one", 3,
         [*TINY, "--steps", "4", "--checkpoint-dir", "ck", "--checkpoint-every", "2"], 2, r"disk full",
         file_limit=200_000),
    Case("--json to a full device is one line", 3, ["gpus", "--json"], 2, r"(?i)no space|full",
         stdout_to="/dev/full", fast=True),
    # 4. resume from elsewhere trains the same file, and refuses a changed one
    Case("a resume from another folder trains the manifest's own file", 4,
         [*OWN, "--resume", "--checkpoint-dir", "../ck", "--steps", "6"], 0, cwd="elsewhere",
         files={"m.py": USER, "elsewhere/m.py": USER.replace("nn.Linear(4, 2)", "nn.Linear(4, 2, bias=False)")},
         before=[[*OWN, *M, *D, "--steps", "4", "--checkpoint-dir", "ck", "--checkpoint-every", "2"]]),
    Case("a resume refuses a model file changed since", 4,
         [*OWN, "--resume", "--checkpoint-dir", "../ck", "--steps", "6"], 2, r"changed", cwd="elsewhere",
         files={"m.py": USER, "elsewhere/m.py": USER},
         before=[[*OWN, *M, *D, "--steps", "4", "--checkpoint-dir", "ck", "--checkpoint-every", "2"]],
         prepare=_change_model),
    # 5. the log is appended to
    Case("a resume keeps the user's own lines in --log", 5,
         [*TINY, "--resume", "--checkpoint-dir", "ck", "--steps", "6", "--log", "run.log"], 0,
         before=[[*TINY, "--steps", "4", "--checkpoint-dir", "ck", "--checkpoint-every", "2", "--log", "run.log"]],
         prepare=_log_with_notes, check=_log_kept),
    # 6. silent wrong training
    Case("a (B, 1) output against (B,) float targets is refused", 6,
         [*OWN, "--model", "m.py:column", "--data", "m.py:flat", "--steps", "2"], 2, r"shape",
         files={"m.py": USER}),
    # 7. exit 3 for the user's own mistakes
    Case('a manifest "step": Infinity falls back to the checkpoint before', 7,
         [*TINY, "--resume", "--checkpoint-dir", "ck", "--steps", "6"], (0, 2), r"step-0+2|Infinity|step",
         before=[[*TINY, "--steps", "4", "--checkpoint-dir", "ck", "--checkpoint-every", "2"]],
         prepare=_infinite_step),
    Case("a Dataset whose __len__ is negative", 7, [*OWN, *M, "--data", "m.py:negative_len", "--steps", "2"], 2,
         r"__len__|len", files={"m.py": USER}),
    Case("a Dataset whose __len__ is a float", 7, [*OWN, *M, "--data", "m.py:float_len", "--steps", "2"], 2,
         r"__len__|len", files={"m.py": USER}),
    Case("a Dataset whose __len__ raises", 7, [*OWN, *M, "--data", "m.py:raising_len", "--steps", "2"], 2,
         r"__len__|len", files={"m.py": USER}),
    Case("nn.LazyLinear in train", 7, [*OWN, "--model", "m.py:lazy", *D, "--steps", "2"], 2, r"(?i)lazy",
         files={"m.py": USER}),
    Case("nn.LazyLinear in plan", 7, ["plan", "--model", "m.py:lazy"], (0, 2), r"(?i)lazy|m\.py",
         files={"m.py": USER}),
    Case("a detached output in train", 7, [*OWN, "--model", "m.py:detached", *D, "--steps", "2"], 2,
         r"(?i)detach|grad", files={"m.py": USER}),
    Case("a model on the meta device in train", 7, [*OWN, "--model", "m.py:on_meta", *D, "--steps", "2"], 2,
         r"(?i)meta", files={"m.py": USER}),
    Case("a model on the meta device in plan", 7, ["plan", "--model", "m.py:on_meta"], (0, 2), r"(?i)meta|m\.py",
         files={"m.py": USER}),
    Case("a 100,000-deep config.json", 7, ["plan", "--hf-config", "config.json"], 2, r"(?i)deep|nest",
         files={"config.json": DEEP}),
    Case("PYTHONIOENCODING=ascii", 7, PLAN_GPT2, 0, r"gpt2", env={"PYTHONIOENCODING": "ascii"}),
    Case("LANG=C", 7, PLAN_GPT2, 0, r"gpt2", env={"LANG": "C", "LC_ALL": "C", "PYTHONIOENCODING": ""}),
    # 8. wrong answers
    Case("recommend --serve of a Llama config without architectures serves tokens", 8,
         ["recommend", "--serve", "--hf-config", "config.json", "--concurrency", "8", "--gpu", "h100"], 0,
         r"tok/s", files={"config.json": json.dumps(LLAMA)}),
    Case("num_hidden_layers -1 is refused", 8, ["plan", "--hf-config", "config.json"], 2, r"num_hidden_layers",
         files={"config.json": _llama(num_hidden_layers=-1)}),
    Case("a config without num_hidden_layers finishes in seconds", 8, ["plan", "--hf-config", "config.json"], (0, 2),
         r"num_hidden_layers|llama", files={"config.json": _llama(num_hidden_layers=None)}, timeout=60),
    Case("a config without vocab_size finishes in seconds", 8, ["plan", "--hf-config", "config.json"], (0, 2),
         r"vocab_size|llama", files={"config.json": _llama(vocab_size=None)}, timeout=60),
    Case("a --prices row with a decimal comma is refused", 8,
         ["recommend", "--model", "gpt2", "--prices", "p.csv"], 2, r"decimal comma",
         files={"p.csv": "gpu,rent_usd_per_hour,buy_usd\nh100,2,99\n"}, fast=True),
    Case("an empty ranking says so", 8, ["recommend", "--model", "llama2-7b", "--gpu", "rtx-3060-12gb",
         "--max-gpus", "1"], 1, r"no option fits"),
    Case("plan --gpu a,b", 8, ["plan", "--model", "gpt2", "--gpu", "h100,a100-80gb"], 0, r"h100"),
    # 9. hangs
    Case("a FIFO named manifest.json", 9, [*TINY, "--resume", "--checkpoint-dir", "ck", "--steps", "6"], (0, 2),
         r"manifest|step", before=[[*TINY, "--steps", "4", "--checkpoint-dir", "ck", "--checkpoint-every", "2"]],
         prepare=_fifo_manifest, timeout=60),
    Case("a data function that never returns", 9, [*OWN, *M, "--data", "m.py:never", "--steps", "2"], 2,
         r"(?i)waiting|never|timed? ?out", files={"m.py": USER}, env={"GPUWISE_DATA_TIMEOUT": "5"}, timeout=60),
    # 10. width
    Case("COLUMNS=40 gpus cuts no cell", 10, ["gpus"], 0, r"h200", env={"COLUMNS": "40"}, check=_no_ellipsis,
         fast=True),
    Case("COLUMNS=0 gpus prints the table", 10, ["gpus"], 0, r"h200", env={"COLUMNS": "0"}, fast=True),
    Case("recommend at 80 columns prints the command whole", 10, ["recommend", "--model", "gpt2"], 0,
         r"to run the first row", env={"COLUMNS": "80"}, check=_whole_command),
]


@dataclass
class Outcome:
    case: Case
    exit: int | None  # None: killed at its time limit
    seconds: float
    cpu: float
    problem: str | None  # None: as expected

    @property
    def ok(self) -> bool:
        return self.problem is None


def _gpuwise(folder: Path, argv: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gpuwise", *argv], cwd=folder, env=env, text=True, **kw)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(case: Case) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="replay-") as tmp:
        folder = Path(tmp)
        env = {**os.environ, "XDG_CACHE_HOME": str(folder / "cache"), "COLUMNS": "100",
               "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("GPUWISE_CATALOG", None)
        for name, text in case.files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
        (folder / case.cwd).mkdir(parents=True, exist_ok=True)
        cpu0, t0 = _children_cpu(), time.monotonic()
        for argv in case.before:
            done = subprocess.run([sys.executable, "-m", "gpuwise", *argv], cwd=folder, env=env, capture_output=True,
                                  text=True, timeout=case.timeout)
            if done.returncode != 0:
                return Outcome(case, done.returncode, time.monotonic() - t0, _children_cpu() - cpu0,
                               f"set-up `gpuwise {' '.join(argv)}` exited {done.returncode}: "
                               f"{done.stderr.strip()[-300:]}")
        if case.prepare is not None:
            case.prepare(folder)
        env.update(case.env)
        for k in [k for k, v in env.items() if v == ""]:
            del env[k]
        limit = case.file_limit

        def preexec() -> None:
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as a shell's `ulimit -f`: the write fails with EFBIG

        stdout = open(case.stdout_to, "w") if case.stdout_to else subprocess.PIPE  # noqa: SIM115
        proc = _gpuwise(folder / case.cwd, case.argv, env, stdout=stdout, stderr=subprocess.PIPE, preexec_fn=preexec)
        t1 = time.monotonic()
        try:
            if case.signal_at is not None:
                path, sig = case.signal_at
                while not (folder / path).exists() and proc.poll() is None and time.monotonic() - t1 < case.timeout:
                    time.sleep(0.05)
                time.sleep(2.0)  # a few steps in
                proc.send_signal(sig)
            out, err = proc.communicate(timeout=max(1.0, case.timeout - (time.monotonic() - t1)))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            code = None
        finally:
            if stdout is not subprocess.PIPE:
                stdout.close()
        seconds, cpu = time.monotonic() - t0, _children_cpu() - cpu0
        text = (out or "") + (err or "")
        # a failure ends in one line saying what and how to go on (lines above it: the run's own log lines)
        last = next((line for line in reversed((err or "").splitlines()) if line.strip()), "")
        expected = case.exit if isinstance(case.exit, tuple) else (case.exit,)
        if code is None:
            problem = f"still running after {case.timeout:.0f} s (a hang)"
        elif "Traceback (most recent call last)" in text:
            problem = f"a traceback (exit {code}): {err.strip().splitlines()[-1][:200]}"
        elif code not in expected:
            problem = f"exit {code}, expected {'/'.join(map(str, expected))}: {text.strip()[-300:]}"
        elif case.says and not re.search(case.says, re.sub(r"\s+", " ", text if code == 0 else last)):
            where = "the output" if code == 0 else "stderr's last line"
            problem = f"{where} does not match {case.says!r}: {(text if code == 0 else last)[-300:]}"
        else:
            problem = case.check(folder, text) if case.check else None
        return Outcome(case, code, seconds, cpu, problem)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fast", action="store_true", help="only the rows CI runs")
    ap.add_argument("-k", default="", help="only the rows whose name holds this (case-insensitive)")
    args = ap.parse_args(argv)
    cases = [c for c in CASES if (c.fast or not args.fast) and args.k.lower() in c.name.lower()]
    outcomes = []
    for case in cases:
        o = run(case)
        outcomes.append(o)
        mark = "ok  " if o.ok else "FAIL"
        print(f"{mark} item {case.item:>2}  {o.seconds:5.1f} s  {o.cpu:5.1f} s CPU  exit {o.exit}  {case.name}"
              + ("" if o.ok else f"\n      {o.problem}"), flush=True)
    passed = sum(o.ok for o in outcomes)
    print(f"\n{passed}/{len(outcomes)} cases as expected; {sum(o.seconds for o in outcomes):.0f} s wall, "
          f"{sum(o.cpu for o in outcomes):.0f} s CPU")
    return 0 if passed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
