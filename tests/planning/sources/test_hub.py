"""--hf-config OWNER/NAME: a Hub id read from a Hugging Face cache laid out as huggingface_hub lays it out
(``models--owner--name/refs/main`` naming a commit, ``snapshots/<commit>/config.json``), offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from fakes.hf_configs import LLAMA_2_7B
from gpuwise.planning.sources.hub import is_hub_id, split_hub_id

hub = pytest.importorskip("huggingface_hub")
pytest.importorskip("transformers")

# Llama-2-7B's published config with the widths cut: 86,848 parameters by hand (embeddings 100 x 64 and an untied
# head of as many; a block: q and o 64 x 64, k and v 64 x 32 (2 of 4 heads of 16), the MLP 3 x 64 x 128, two norms)
TINY = dict(LLAMA_2_7B, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, vocab_size=100, max_position_embeddings=256)
TINY_PARAMS = 2 * 100 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(root: Path, repo: str, config: dict, *, ref: str = "main") -> Path:
    """The layout huggingface_hub's cache uses: models--owner--name/refs/<ref> holds the commit of
    snapshots/<commit>/."""
    folder = root / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    (folder / "refs").mkdir()
    (folder / "refs" / ref).write_text(COMMIT)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """A cache in tmp_path, with HF_HUB_OFFLINE=1, as huggingface_hub reads them (its constants, set from the
    environment when it is imported)."""
    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)
    return root


@pytest.mark.parametrize(("text", "hub_id"), [
    ("meta-llama/Llama-3.1-8B", True), ("Qwen/Qwen2.5-0.5B-Instruct@main", True), ("owner/name@v1.0", True),
    ("gpt2", False),  # no owner: a missing file, not a repository
    ("configs/config.json", False), ("models/llama.gguf", False), ("a/b/c", False), ("./a/b", False),
    ("a--b/c", False), ("/abs/path", False), ("owner/", False),
])
def test_what_counts_as_a_hub_id(text, hub_id):
    assert is_hub_id(text) is hub_id


def test_an_existing_path_is_never_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner" / "name").mkdir(parents=True)
    assert not is_hub_id("owner/name")
    assert split_hub_id("owner/name@abc") == ("owner/name", "abc")


def test_plan_reads_a_hub_id_from_the_cache_offline(capsys, tmp_path, offline_cache):
    fake_cache(offline_cache, "owner/tiny-llama", TINY)
    code, out, err = run_cli(capsys, "plan", "--hf-config", "owner/tiny-llama", "--seq", "64", "--gpu", "h100-sxm",
                             "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["model"] == "owner/tiny-llama"
    assert plan["params"] == TINY_PARAMS == 86_848
    # the same config.json by its path plans the same step
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    code, out, err = run_cli(capsys, "plan", "--hf-config", str(path), "--seq", "64", "--gpu", "h100-sxm", "--json")
    assert code == 0, err
    assert json.loads(out)["peak_bytes"] == plan["peak_bytes"]


def test_a_revision_is_read_through_its_ref(capsys, offline_cache):
    fake_cache(offline_cache, "owner/tiny-llama", TINY, ref="v1")
    code, out, err = run_cli(capsys, "plan", "--hf-config", "owner/tiny-llama@v1", "--seq", "64", "--gpu",
                             "h100-sxm", "--json")
    assert code == 0, err
    assert json.loads(out)["params"] == TINY_PARAMS
    code, _, err = run_cli(capsys, "plan", "--hf-config", "owner/tiny-llama", "--seq", "64")  # no refs/main
    assert code == 2 and "not in the Hugging Face cache" in err


def test_a_missing_hub_id_offline_is_one_line_and_exit_2(capsys, offline_cache):
    for command in (["plan"], ["recommend", "--serve"]):
        code, out, err = run_cli(capsys, *command, "--hf-config", "owner/not-cached")
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and "Traceback" not in err
        assert "owner/not-cached's config.json is not in the Hugging Face cache and the Hub cannot be reached" in err
        assert "hf download owner/not-cached config.json" in err and "--hf-config path/to/config.json" in err


@pytest.mark.slow
def test_hf_hub_offline_from_the_environment(tmp_path):
    """As a user runs it: HF_HUB_CACHE and HF_HUB_OFFLINE=1 in the environment, read by huggingface_hub itself."""
    fake_cache(tmp_path / "hub", "owner/tiny-llama", TINY)
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1", XDG_CACHE_HOME=str(tmp_path))
    run = [sys.executable, "-m", "gpuwise", "plan", "--seq", "64", "--gpu", "h100-sxm", "--json", "--hf-config"]
    done = subprocess.run([*run, "owner/tiny-llama"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["params"] == TINY_PARAMS
    missing = subprocess.run([*run, "owner/other"], env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "not in the Hugging Face cache" in missing.stderr


def _online(monkeypatch, answer):
    """The Hub reachable, the cache empty, and hf_hub_download answering ``answer()`` when it may download."""
    from gpuwise.planning.sources import hub as hub_module

    def download(repo, filename, *, revision=None, local_files_only=False):
        if local_files_only:
            raise hub.errors.LocalEntryNotFoundError("not cached")
        return answer()

    monkeypatch.setattr(hub, "hf_hub_download", download)
    monkeypatch.setattr(hub_module, "_reachable", lambda *args: True)


@pytest.mark.parametrize(("error", "message", "hint"), [
    ("GatedRepoError", "owner/tiny is a gated repository", "accept the terms on https://huggingface.co/owner/tiny"),
    ("RepositoryNotFoundError", "owner/tiny is neither a local path nor a Hub repository", "hf auth login"),
    ("RemoteEntryNotFoundError", "owner/tiny has no config.json", "--hf-config path/to/model.gguf"),
])
def test_each_hub_failure_is_one_line_with_its_fix(capsys, monkeypatch, error, message, hint):
    from types import SimpleNamespace

    def answer():
        raise getattr(hub.errors, error)("from the Hub", response=SimpleNamespace(headers={}, request=None))

    _online(monkeypatch, answer)
    code, out, err = run_cli(capsys, "plan", "--hf-config", "owner/tiny")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert message in err and hint in err


def test_a_hub_id_not_cached_is_downloaded(capsys, tmp_path, monkeypatch):
    config = tmp_path / "downloaded" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(TINY))
    _online(monkeypatch, lambda: str(config))
    from gpuwise.planning.sources.resolve import resolve_source

    source = resolve_source(None, "owner/tiny@v2")
    assert source.name == "owner/tiny@v2" and source.path == config and source.checkpoint is None


def test_a_cached_snapshot_is_read_for_its_stored_weights(offline_cache):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    import torch

    snapshot = fake_cache(offline_cache, "owner/tiny-llama", TINY)
    safetensors_torch.save_file({"w": torch.zeros(4, 4, dtype=torch.bfloat16)}, snapshot / "model.safetensors")
    from gpuwise.planning.sources.resolve import resolve_source

    info = resolve_source(None, "owner/tiny-llama").checkpoint
    assert info.format == "safetensors" and info.bits_per_weight == 16 and info.weights is None
