"""Issue 30's faults in what the user hands the CLI: config.json files that planned the wrong model or none (no
``architectures``, sizes of 0 or -1, missing depth), ``plan --gpu a,b``, JSON nested past Python's recursion limit,
and output to a stream that cannot encode our characters. Each writes a real file and runs the real command."""

from __future__ import annotations

import io
import json
import sys

import pytest

from conftest import run_cli
from gpuwise.errors import GpuwiseError

# A Llama of 2 blocks of width 64, as a config.json saved without "architectures" (a hand-written or converted one)
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 256}


def _config(tmp_path, cfg: dict | str, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(path)


def _one_line_error(code: int, err: str) -> None:
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, (code, err)


# --- a config.json without architectures -------------------------------------------------------------------------


def test_a_llama_config_without_architectures_is_served_as_a_language_model(capsys, tmp_path):
    """It was ranked as an image model (img/s, one image a batch, --concurrency ignored): transformers builds a
    model_type that only has a causal LM as that (AutoModelForCausalLM), and so does the planner now."""
    pytest.importorskip("transformers")
    path = _config(tmp_path, TINY_LLAMA)
    code, out, err = run_cli(capsys, "recommend", "--serve", "--hf-config", path, "--concurrency", "8", "--gpu",
                             "h100", "--prompt-tokens", "64", "--output-tokens", "32", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["kv_cache"] is not None and data["rows"][0]["decode_batch"] == 8, data["rows"][0]


def test_plan_decodes_a_llama_config_without_architectures(capsys, tmp_path):
    """plan --task decode refused it: "llama is not one" (a decoder language model)."""
    pytest.importorskip("transformers")
    path = _config(tmp_path, TINY_LLAMA)
    code, out, err = run_cli(capsys, "plan", "--hf-config", path, "--task", "decode", "--context", "32", "--gpu",
                             "h100", "--json")
    assert code == 0, err
    assert json.loads(out)["decode"] is not None


@pytest.mark.parametrize(("cfg", "example"), [
    # saved as a masked LM, a causal LM or a classifier: it was planned as BertLMHeadModel
    ({"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100, "num_attention_heads": 4,
      "intermediate_size": 128}, "BertForMaskedLM"),
    # no language-model head: AutoModelForCausalLM refused it ("could not build")
    ({"model_type": "vit", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "intermediate_size": 128}, "ViTModel"),
])
def test_a_config_whose_class_cannot_be_told_asks_for_architectures(capsys, tmp_path, cfg, example):
    pytest.importorskip("transformers")
    code, _, err = run_cli(capsys, "plan", "--hf-config", _config(tmp_path, cfg))
    _one_line_error(code, err)
    assert "has no architectures" in err and f'"architectures": ["{example}"]' in err


# --- sizes that build no model, or the wrong one ----------------------------------------------------------------


@pytest.mark.parametrize(("change", "named"), [
    ({"num_hidden_layers": -1}, "num_hidden_layers -1"),  # planned a model with no blocks, exit 0
    ({"num_hidden_layers": 0}, "num_hidden_layers 0"),
    ({"hidden_size": "512"}, 'hidden_size "512"'),
    ({"hidden_size": 512.5}, "hidden_size 512.5"),
    ({"vocab_size": -5}, "vocab_size -5"),  # transformers' warnings, then torch's negative dimension
    ({"num_attention_heads": 0}, "num_attention_heads 0"),  # ZeroDivisionError
    ({"model_type": "llava", "text_config": {"model_type": "llama", "num_hidden_layers": -2}},
     "text_config.num_hidden_layers -2"),
])
def test_a_size_that_is_not_a_whole_number_from_1_is_one_line(capsys, tmp_path, change, named):
    path = _config(tmp_path, {**TINY_LLAMA, "architectures": ["LlamaForCausalLM"], **change})
    code, _, err = run_cli(capsys, "plan", "--hf-config", path)
    _one_line_error(code, err)
    assert f"{named} is not a whole number of at least 1" in err


def test_a_config_without_num_hidden_layers_has_transformers_default_depth(capsys, tmp_path):
    """LlamaConfig's default is 32 blocks, and that is what was planned; but without the key in config.json the
    planner did not know the stack's depth and captured all 32 blocks whole, in every remedy's plan (a 7B-sized
    config: 70 s wall for plan, killed at 190 s under recommend), instead of its first blocks scaled up."""
    pytest.importorskip("transformers")
    cfg = {k: v for k, v in TINY_LLAMA.items() if k not in ("num_hidden_layers", "vocab_size")}
    path = _config(tmp_path, cfg)
    code, out, err = run_cli(capsys, "plan", "--hf-config", path, "--task", "infer", "--seq", "8", "--gpu", "h100",
                             "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["captured_blocks"], "captured whole: the depth was not known"
    per_block = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64  # q,o + k,v (2 of 4 heads) + MLP + norms
    assert data["params"] == 32 * per_block + 2 * 32000 * 64 + 64  # transformers' 32 blocks, vocabulary 32000


# --- plan --gpu a,b ----------------------------------------------------------------------------------------------


def test_plan_fits_on_the_gpus_a_comma_list_names(capsys):
    """recommend took --gpu h100,a100 and plan refused it as one unknown GPU 't4,h100'."""
    code, out, err = run_cli(capsys, "plan", "--model", "mlp", "--gpu", "t4, h100", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["gpu"] == "t4" and [g["gpu"] for g in data["gpus"]] == ["t4", "h100-sxm"]
    code, _, err = run_cli(capsys, "plan", "--model", "mlp", "--gpu", "t4,h100", "--solve", "max-batch")
    _one_line_error(code, err)
    assert "solves for one GPU" in err


# --- JSON nested past the recursion limit ------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "[" * 100_000 + "]" * 100_000,  # RecursionError in the parser: exit 3
    '{"a":' * 100_000 + "1" + "}" * 100_000,
    json.dumps({**TINY_LLAMA, "rope_scaling": json.loads("[" * 600 + "]" * 600)}),  # parsed; deepcopy's recursion
])
def test_json_nested_past_the_recursion_limit_is_one_line(capsys, tmp_path, text):
    path = _config(tmp_path, text)
    code, _, err = run_cli(capsys, "plan", "--hf-config", path)
    _one_line_error(code, err)
    assert "nested deeper than 100 levels" in err


def test_a_safetensors_header_nested_past_the_recursion_limit_is_one_line(capsys, tmp_path):
    import struct

    _config(tmp_path, {**TINY_LLAMA, "architectures": ["LlamaForCausalLM"]})
    header = ("[" * 100_000 + "]" * 100_000).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    code, _, err = run_cli(capsys, "plan", "--hf-config", str(tmp_path))
    _one_line_error(code, err)
    assert "not a safetensors file" in err and "nested deeper" in err


# --- output a stream cannot encode -------------------------------------------------------------------------------


def test_output_to_an_ascii_stdout_is_printed_not_a_crash(monkeypatch):
    """'·' in plan's heading was a UnicodeEncodeError, exit 3, with PYTHONIOENCODING=ascii. What the stream cannot
    take is written in ASCII. The streams that variable gives (ASCII, strict on stdout, backslashreplace on stderr),
    in-process as below (a process of its own costs seconds)."""
    from gpuwise import cli

    raw, raw_err = io.BytesIO(), io.BytesIO()
    stdout = io.TextIOWrapper(raw, encoding="ascii", errors="strict")
    stderr = io.TextIOWrapper(raw_err, encoding="ascii", errors="backslashreplace")
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stderr", stderr)
    code = cli.main(["plan", "--model", "mlp", "--gpu", "h100"])
    stdout.flush()
    stderr.flush()
    assert code == 0, raw_err.getvalue().decode("ascii")
    out = raw.getvalue().decode("ascii")  # ASCII through and through
    assert "mlp - train - batch 1" in out and "?" not in out


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_output_to_a_c_locale_stdout_is_printed_not_a_crash(monkeypatch, errors):
    """LC_ALL=C without Python's UTF-8 mode (PYTHONUTF8=0) opens stdout as ASCII with surrogateescape, which takes
    no '·' either: the stream itself, in-process (a subprocess per locale costs seconds)."""
    from gpuwise import cli

    raw = io.BytesIO()
    stdout = io.TextIOWrapper(raw, encoding="ascii", errors=errors)
    monkeypatch.setattr(sys, "stdout", stdout)
    code = cli.main(["plan", "--model", "mlp", "--gpu", "h100"])
    stdout.flush()
    assert code == 0
    assert "mlp - train - batch 1" in raw.getvalue().decode("ascii")


DEEP = "[" * 100_000 + "]" * 100_000


def test_a_deep_bench_run_to_compare_is_one_line(capsys, tmp_path):
    """`bench --compare deep.json --compare deep.json` was exit 3 (RecursionError past the reader's except)."""
    path = tmp_path / "run.json"
    path.write_text(DEEP)
    code, _, err = run_cli(capsys, "bench", "--compare", str(path), "--compare", str(path))
    _one_line_error(code, err)
    assert "is not a gpuwise bench file (TooDeep)" in err


def test_a_deep_calibration_file_is_no_calibration(tmp_path):
    """A damaged calibration.json is no calibration (plans use datasheets); a deep one raised RecursionError from
    every plan."""
    from gpuwise.hardware.calibration import FILE_NAME, load_calibrations

    (tmp_path / FILE_NAME).write_text(DEEP)
    assert load_calibrations(tmp_path) == {}


def test_a_deep_line_in_a_watch_log_is_one_line(tmp_path):
    from gpuwise.monitor.samples import read_log

    path = tmp_path / "run.jsonl"
    path.write_text(DEEP + "\n" + "{}\n")
    with pytest.raises(GpuwiseError, match="line 1 is not a gpuwise log line: nested deeper than 100 levels"):
        read_log(path)
