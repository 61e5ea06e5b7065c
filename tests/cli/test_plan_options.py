"""``gpuwise plan`` and ``recommend`` with ``--attention``, ``--compile`` for inference, a Switch Transformer config and
``--tp`` on a GPT-2 config, as users run them: what each accepts, and one line with the fix for what it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli

SWITCH = str(Path(__file__).parents[1] / "data" / "switch-base-8-config.json")
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
         "max_position_embeddings": 256}
SMALL = ["--model", "gpt2", "--seq", "128", "--batch", "2", "--gpu", "h100-sxm"]
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12,
        "n_positions": 1024, "vocab_size": 50257}


def _refused(capsys, *args) -> str:
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and not out, (code, out, err)
    assert len(err.strip().splitlines()) == 1, err  # one line: the problem and its fix
    return err


@pytest.mark.parametrize(("args", "says"), [
    ([*SMALL, "--attention", "paged"], "--attention 'paged' is not one of sdpa, eager, flash, flex, gpuwise"),
    ([*SMALL, "--attention", "flash", "--precision", "fp32"], "takes fp16 and bf16 only"),
    (["--model", "resnet50", "--attention", "eager"], "applies to the GPT and Llama models, not resnet50"),
    (["--model", "gpt2", "--task", "decode", "--compile"], "--compile with --task decode"),
])
def test_plan_refuses_attention_and_compile_it_cannot_plan(capsys, args, says):
    assert says in _refused(capsys, "plan", *args)


def test_plan_refuses_gpuwise_attention_on_a_config(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    err = _refused(capsys, "plan", "--hf-config", str(path), "--attention", "gpuwise", "--gpu", "h100-sxm")
    assert "applies to the built-in GPT and Llama" in err and "--attention eager, sdpa, flash or flex" in err


def test_plan_refuses_sdpa_for_a_model_transformers_runs_eagerly(capsys):
    err = _refused(capsys, "plan", "--hf-config", SWITCH, "--attention", "sdpa", "--gpu", "h100-sxm")
    assert "does not run sdpa" in err and "pass --attention eager" in err


@pytest.mark.parametrize(("args", "says"), [
    (["--serve", "--attention", "flash"], "--attention flash is not ranked when serving"),
    (["--serve", "--compile"], "--compile is not ranked when serving"),
    (["--attention", "paged", "--tokens", "1e9"], "--attention 'paged' is not one of"),
])
def test_recommend_refuses_what_it_does_not_rank(capsys, args, says):
    assert says in _refused(capsys, "recommend", "--model", "gpt2", *args)


def _plan(capsys, *args) -> dict:
    code, out, err = run_cli(capsys, "plan", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_plan_takes_attention_and_a_compiled_prefill(capsys):
    sdpa, eager = (_plan(capsys, *SMALL, "--attention", a) for a in ("sdpa", "eager"))
    assert eager["activations_bytes"] > sdpa["activations_bytes"]  # the s x s scores
    assert (sdpa["setup"]["attention"], eager["setup"]["attention"]) == ("sdpa", "eager")
    eager_infer, compiled = (_plan(capsys, *SMALL, "--task", "infer", *c) for c in ([], ["--compile"]))
    assert compiled["flops_per_step"] == eager_infer["flops_per_step"]


def test_plan_tp_2_on_a_gpt2_config(capsys, tmp_path):
    """GPT-2's Conv1D layers split as Megatron splits them (tests/planning/parallel/test_tensor_gpt2.py: the Hub's
    whole config.json and the per-rank counts)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2))
    one, two = (_plan(capsys, "--hf-config", str(path), "--seq", "128", "--batch", "2", "--gpu", "h100-sxm", *tp)
                for tp in ([], ["--tp", "2"]))
    assert two["params"] < one["params"] and two["tokens_per_step"] == one["tokens_per_step"]


@pytest.mark.slow
def test_plan_captures_switch_base_8(capsys):
    data = _plan(capsys, "--hf-config", SWITCH, "--task", "infer", "--seq", "128", "--gpu", "h100-sxm")
    assert data["params"] == 619_339_008  # the Hub's 619M (tests/planning/sources/test_switch.py)
