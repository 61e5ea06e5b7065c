"""Checkpoints: exact round trip, tied weights, pruning, corruption and truncation skipped, pickled code
refused, another run's checkpoint refused, and a process killed while writing leaves a usable folder."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from gpuwise.errors import GpuwiseError
from gpuwise.models.gpt import GPT, GPTConfig
from gpuwise.training import checkpoint as ckpt

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16)


def _trained():
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(64, (2, 16))
    model(idx, idx).backward()
    opt.step()
    return model, opt


def test_round_trip_is_exact_with_tied_weights_and_rng(tmp_path):
    model, opt = _trained()
    torch.manual_seed(123)
    saved = ckpt.save(tmp_path, 7, model_state=model.state_dict(),
                      state={"optimizer": opt.state_dict(), "rng": ckpt.rng_state(), "data_position": 14},
                      fingerprint="run-a")
    expected_draw = torch.rand(5)
    found, skipped = ckpt.latest(tmp_path)
    assert found == saved and not skipped
    weights, state = ckpt.load(found, fingerprint="run-a")
    fresh = GPT(CFG)
    fresh.load_state_dict(weights)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert fresh.lm_head.weight is fresh.wte.weight  # tying survives (the alias was restored by name)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    opt2.load_state_dict(state["optimizer"])
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    ckpt.set_rng_state(state["rng"])
    assert torch.equal(torch.rand(5), expected_draw)
    assert state["data_position"] == 14


def test_keeps_the_newest(tmp_path):
    model, _ = _trained()
    for step in (1, 2, 3, 4):
        ckpt.save(tmp_path, step, model_state=model.state_dict(), state={}, fingerprint="f", keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000003", "step-000000004"]


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda p: p.joinpath("model.safetensors").write_bytes(
        bytes(b ^ 0xFF if i == 100 else b for i, b in enumerate(p.joinpath("model.safetensors").read_bytes()))),
     "does not match its checksum"),
    (lambda p: os.truncate(p / "state.pt", 10), "missing or truncated"),
    (lambda p: (p / "manifest.json").write_text("{"), "no readable manifest"),
])
def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path, damage, reason):
    model, _ = _trained()
    ckpt.save(tmp_path, 1, model_state=model.state_dict(), state={"n": 1}, fingerprint="f")
    newest = ckpt.save(tmp_path, 2, model_state=model.state_dict(), state={"n": 2}, fingerprint="f")
    damage(newest.path)
    found, skipped = ckpt.latest(tmp_path)
    assert found.step == 1 and len(skipped) == 1 and reason in skipped[0]
    assert ckpt.load(found)[1] == {"n": 1}


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_pickled_code_is_refused(tmp_path):
    model, _ = _trained()
    c = ckpt.save(tmp_path, 1, model_state=model.state_dict(), state={}, fingerprint="f")
    with (c.path / "state.pt").open("wb") as f:
        pickle.dump({"evil": Payload()}, f, protocol=2)  # torch.save's protocol
    manifest = json.loads((c.path / "manifest.json").read_text())  # make the checksums agree: the refusal
    manifest["files"]["state.pt"] = {"bytes": (c.path / "state.pt").stat().st_size,  # must come from loading
                                     "sha256": ckpt._sha256(c.path / "state.pt")}
    (c.path / "manifest.json").write_text(json.dumps(manifest))
    found, _ = ckpt.latest(tmp_path)
    with pytest.raises(GpuwiseError, match="refused: it is not plain data"):
        ckpt.load(found)


def test_another_runs_checkpoint_is_refused(tmp_path):
    model, _ = _trained()
    c = ckpt.save(tmp_path, 1, model_state=model.state_dict(), state={}, fingerprint="aaaa" * 8)
    with pytest.raises(GpuwiseError, match="written by another model or config"):
        ckpt.load(c, fingerprint="bbbb" * 8)


WRITER = """
import sys, torch
from gpuwise.training import checkpoint as ckpt
state = {"w": torch.randn(4_000_000)}  # 16 MB a checkpoint: writes take a while
for step in range(1, 10_000):
    ckpt.save(sys.argv[1], step, model_state=state, state={"step": step}, fingerprint="f", keep=2)
    print(step, flush=True)
"""


def test_sigkill_while_writing_leaves_a_usable_checkpoint(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "1"  # one checkpoint is complete; more are being written
        time.sleep(0.37)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    found, skipped = ckpt.latest(tmp_path)
    assert found is not None and not skipped
    weights, state = ckpt.load(found)
    assert state == {"step": found.step} and weights["w"].numel() == 4_000_000
    visible = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert all(name.startswith("step-") for name in visible) and len(visible) <= 3  # keep=2, + one not pruned yet
    for name in visible:  # every visible checkpoint is whole
        ckpt._verify(tmp_path / name)


def test_a_malformed_manifest_or_a_pickle_posing_as_safetensors_is_refused(tmp_path):
    model, _ = _trained()
    ckpt.save(tmp_path, 1, model_state=model.state_dict(), state={"n": 1}, fingerprint="f")
    newest = ckpt.save(tmp_path, 2, model_state=model.state_dict(), state={"n": 2}, fingerprint="f")
    manifest = json.loads((newest.path / "manifest.json").read_text())
    manifest["files"]["state.pt"] = {"size": 3}  # no bytes, no sha256
    (newest.path / "manifest.json").write_text(json.dumps(manifest))
    found, skipped = ckpt.latest(tmp_path)
    assert found.step == 1 and "no readable manifest (KeyError)" in skipped[0]

    c = ckpt.save(tmp_path, 3, model_state=model.state_dict(), state={}, fingerprint="f")
    torch.save({"w": torch.zeros(2)}, c.path / "model.safetensors")  # a pickle under the safetensors name
    manifest = json.loads((c.path / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = {"bytes": (c.path / "model.safetensors").stat().st_size,
                                              "sha256": ckpt._sha256(c.path / "model.safetensors")}
    (c.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GpuwiseError, match=r"model\.safetensors is refused: not a safetensors file"):
        ckpt.load(ckpt.latest(tmp_path)[0])
    del manifest["files"]["model.safetensors"]
    (c.path / "manifest.json").write_text(json.dumps(manifest))
    assert "the manifest does not list model.safetensors" in ckpt.latest(tmp_path)[1][0]


def test_the_checkpointer_saves_and_resumes_a_whole_run(tmp_path):
    model, opt = _trained()
    from gpuwise.training.config import TrainConfig

    config = TrainConfig(batch=2, precision="fp32")
    checkpointer = ckpt.Checkpointer(tmp_path, identity=ckpt.identity(model, config), keep=2)
    checkpointer.check_fresh()
    checkpointer.save(3, model, opt, {"step": 3})
    with pytest.raises(GpuwiseError, match="holds checkpoints of a run already"):
        checkpointer.check_fresh()
    torch.manual_seed(1)
    fresh = GPT(CFG)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    state, skipped = checkpointer.resume(fresh, fresh_opt, steps=10)
    assert state == {"step": 3} and skipped == []
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True))
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(GpuwiseError, match="step-000000003 is at step 3 already, --steps is 3"):
        checkpointer.resume(fresh, fresh_opt, steps=3)
    other = ckpt.Checkpointer(tmp_path, identity=ckpt.identity(model, TrainConfig(batch=4, precision="fp32")))
    with pytest.raises(GpuwiseError, match="written with batch 2, this run has 4"):
        other.resume(fresh, fresh_opt, steps=10)
    sharded = ckpt.Checkpointer(tmp_path, identity=ckpt.identity(model, config), sharded=True)
    with pytest.raises(GpuwiseError, match="step-000000003 is whole, this run is sharded"):
        sharded.resume(fresh, fresh_opt, steps=10)
