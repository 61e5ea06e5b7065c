"""``gpuwise plan`` and ``recommend`` with ``--attention``, ``--compile`` for inference, a Switch Transformer config and
``--tp`` on a GPT-2 config, as users run them: what each accepts, and one line with the fix for what it refuses."""

from __future__ import annotations

import json
import subprocess
import sys
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


DECODE_P4 = ["--model", "gpt2", "--task", "decode", "--context", "1000", "--gpu", "p4"]


def test_plan_solve_max_batch_json(capsys):
    """The largest decode batch of GPT-2 on an 8 GiB P4 at 1,000 cached tokens: the KV caches fill it. By hand, each
    sequence's static cache holds 1,001 tokens x 12 layers x (K, V) x 768 x 2 bytes = 36,900,864 B, in 8 GiB less the
    544 MiB overhead less 124,439,808 bf16 weights: 210 at most; the logits and temporaries take a little more."""
    data = _plan(capsys, *DECODE_P4, "--solve", "max-batch")
    assert next(iter(data)) == "schema_version"  # the plan's JSON document, with the solve object beside its keys
    solve = data["solve"]
    v = solve["value"]
    by_hand = ((8 << 30) - (544 << 20) - 124_439_808 * 2) // (1001 * 12 * 2 * 768 * 2)
    assert by_hand == 210 and 0.95 * by_hand <= v <= by_hand
    assert (solve["goal"], solve["flag"], solve["gpu"], solve["bound"]) == ("max-batch", "--micro-batch", "p4", None)
    assert solve["failing"]["value"] == v + 1 and solve["failing"]["required_bytes"] > solve["memory_bytes"]
    assert [p["value"] for p in solve["probes"]] == [1, v, v + 1] and solve["captures"] >= 3
    assert data["setup"]["micro_batch"] == v and data["fits"] and data["gpus"][0]["fits"]  # the plan at the answer
    code, out, _ = run_cli(capsys, "plan", *DECODE_P4, "--solve", "max-batch")
    assert code == 0 and out.startswith(f"max micro-batch on p4: {v} ({v + 1} does not fit: ")
    assert "gpuwise plan: gpt2 · decode" in out  # the usual plan below the answer


@pytest.mark.parametrize(("args", "says"), [
    (["--solve", "min-gpus", "--gpus", "4", "--sharding", "fsdp"], "--solve min-gpus solves --gpus, and --gpus 4"),
    (["--solve", "max-batch", "--micro-batch", "2"], "drop --micro-batch 2"),
    (["--solve", "max-context", "--seq", "512"], "drop --seq 512"),
    (["--solve", "min-gpus", "--task", "infer"], "not --task infer"),
    (["--solve", "fewest"], "--solve 'fewest' is not one of max-context, max-batch, min-gpus"),
    (["--model", "resnet50", "--solve", "max-context"], "--solve max-context varies --seq: --seq does not apply"),
])
def test_plan_solve_refuses_a_flag_it_solves(capsys, args, says):
    model = [] if "--model" in args else ["--model", "gpt2"]
    assert says in _refused(capsys, "plan", *model, *args, "--gpu", "p4")


def test_plan_solve_is_refused_before_torch_loads():
    code = "import sys; from gpuwise.cli import main; sys.exit(main(sys.argv[1:]) + 10 * ('torch' in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code, "plan", "--model", "gpt2", "--solve", "max-batch", "--batch",
                           "8"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "drop --batch 8" in done.stderr, (done.returncode, done.stderr)
