"""What the user sees and the exit codes (issue 15): tables never cut a number at 80 columns, --help keeps its
bracketed defaults, a bad flag is refused before torch loads, a closed pipe and GPUWISE_DEBUG exit as documented,
and the plan refuses steps that cannot run."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import textwrap

import pytest
from rich.console import Console

from gpuwise.cli import main
from gpuwise.hardware.catalog import load_catalog


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv", [["plan", "--model", "mlp"], ["gpus"], ["gpus", "h100"], ["plan", "--list-models"],
                                  ["doctor"]])
def test_tables_never_cut_a_number_at_80_columns(capsys, monkeypatch, argv):
    monkeypatch.setenv("COLUMNS", "80")  # what rich uses for a pipe
    code, out, _ = _run(capsys, *argv)
    assert code in (0, 1) and "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    if argv[0] == "plan" and "--model" in argv:  # the fit table: every GPU's key whole on its row, grouped
        keys = [a.key for a in load_catalog().filter()]
        assert all(re.search(rf"^{re.escape(k)}\s", out, re.M) for k in keys), out
        assert re.search(r"^consumer\s*$", out, re.M) and re.search(r"^datacenter\s*$", out, re.M)
        assert re.search(r"\sstep\s+bound$", out, re.M)  # the modelled step time, and its roofline bound beside it


@pytest.mark.parametrize("width", [60, 200])
def test_the_plans_gpu_table_drops_columns_rather_than_break_a_cell(capsys, monkeypatch, width):
    """Issue 27: narrower than 80 the fit table leaves columns out and says which; wider it shows them all; never a
    split key, never a cut figure."""
    monkeypatch.setenv("COLUMNS", str(width))
    code, out, _ = _run(capsys, "plan", "--model", "mlp")
    assert code == 0 and "…" not in out and max(len(line) for line in out.splitlines()) <= width
    keys = [a.key for a in load_catalog().filter()]
    assert all(re.search(rf"^{re.escape(k)}\s", out, re.M) for k in keys), out
    assert ("hidden at 60 columns" in out) == (width == 60)
    assert bool(re.search(r"\sstep\s+bound$", out, re.M)) == (width == 200)


def test_bench_table_keeps_its_numbers_at_80_columns():
    from gpuwise.bench.suite import BenchResult
    from gpuwise.render import render_bench

    r = BenchResult(op="attention", dtype="bf16", shape="b8 h32 s4096 d128 causal", device="cuda:0",
                    median_s=0.012345, p10_s=0.0121, p90_s=0.0131, repeats=20, flops=1e12, bytes=None, tflops=812.3,
                    gbps=None, peak_memory_bytes=None, pct_of_peak=82.0, speedup_vs_cpu=1234.5,
                    backend="flash")
    buf = io.StringIO()
    render_bench([r] * 3, "NVIDIA H100 80GB HBM3 (cuda:0), torch 2.13.0+cu130", Console(file=buf, width=80))
    out = buf.getvalue()
    assert "…" not in out and "12.35 ms" in out and "812 TF/s" in out and "1234.5x" in out


def test_train_summary_keeps_its_figures_at_80_columns(tmp_path):
    from gpuwise.render import render_train
    from gpuwise.training.run import TrainSummary

    where = str(tmp_path / ("a-long-checkpoint-folder-name-without-spaces-" * 3))
    s = TrainSummary(task="train", steps=200, final_loss=2.4123, eval_loss=2.5, seconds=123.4, resumed_from=None,
                     skipped_steps=0, device="cuda:0", gpu="h100-sxm", processes=1, sharding=None,
                     precision="bf16-mixed", params=124_439_808, micro_batch=8, grad_accum=4, batch=32,
                     unit="tokens", throughput=259_330.5, mfu=0.412, peak_memory_bytes=12 << 30, compiled=False,
                     optimizer="adamw", auto=None, events=(), checkpoint_dir=where)
    buf = io.StringIO()
    render_train(s, Console(file=buf, width=80))
    out = buf.getvalue()
    assert "…" not in out and "259,330 tokens/s" in out and "41.2%" in out
    assert "".join(line.strip(" │") for line in out.splitlines()).count("without-spaces") == 3  # folded, whole


def test_help_keeps_bracketed_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = _run(capsys, "plan", "--help")
    words = " ".join(out.split())  # click wraps help at 80 columns: a bracket may span two lines
    assert code == 0 and "[standard]" in words and "gpuwise[hf]" in words and "[as computed]" in words
    assert "<bool>" not in out  # no type column for flags
    assert "\n    gpuwise plan --model gpt2 --batch 8\n" in out  # one example a line
    _, out, _ = _run(capsys, "train", "--help")
    assert "[ddp]" in out and "\\[" not in out


_NO_TORCH = textwrap.dedent("""
    import sys
    from gpuwise.cli import main
    code = main(sys.argv[1:])
    sys.exit(code + 10 * ("torch" in sys.modules))
""")


@pytest.mark.parametrize("argv", [["plan", "--batch", "0"], ["plan", "--model", "gpt2", "--sharding", "foo"],
                                  ["plan", "--precision", "fp9"], ["gpus", "--min-memory", "24"]])
def test_a_bad_flag_is_refused_before_torch_loads(argv):
    done = subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.returncode, done.stderr)  # 12: refused, but after importing torch
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")


# One bad value per check of every command that loads torch for its work: each is refused before torch loads (one
# process for all: each argv is run in turn and sys.modules looked at after it).
_NO_TORCH_EACH = textwrap.dedent("""
    import json, sys
    from gpuwise.cli import main
    for argv in json.loads(sys.argv[1]):
        code = main(argv)
        if code != 2 or "torch" in sys.modules:
            sys.exit(f"{argv}: exit {code}, torch loaded: {'torch' in sys.modules}")
""")
_REFUSED_WITHOUT_TORCH = [
    ["recommend", "--batch", "0"], ["recommend", "--model", "gpt2", "--precision", "fp9"],
    ["recommend", "--model", "gpt2", "--deadline", "xx"], ["recommend", "--model", "gpt2", "--tokens", "nan"],
    ["recommend", "--model", "gpt2", "--segment", "moon"], ["recommend", "--model", "gpt2", "--gpu", "h1000"],
    ["recommend", "--model", "gpt2", "--serve", "--weights", "q5"], ["recommend", "--model", "gpt2", "--sort", ""],
    ["recommend", "--model", "gpt2", "--prices", "/nonexistent/prices.csv"],
    ["recommend", "--model", "gpt2", "--checkpointing", "some"], ["recommend", "--model", "gpt2", "--max-gpus", "0"],
    ["train", "--batch", "0"], ["train", "--steps", "-1"], ["train", "--precision", "fp9"], ["train", "--lr", "inf"],
    ["train", "--example", "foo"], ["train", "--seq", "0"], ["train", "--tp", "2"], ["train", "--optimizer", "sgd"],
    ["train", "--batch", "10", "--micro-batch", "3"], ["train", "--fix-input", "--no-monitor"],
    ["plan", "--model", "missing.py:f"], ["plan", "--hf-config", "nope/config.json"],
    ["recommend", "--hf-config", "nope.json"], ["train", "--model", "missing.py:f"],
    ["train", "--hf-config", "nope/config.json"], ["train", "--hf-config", __file__, "--example", "image"],
    ["train", "--model", __file__ + ":f", "--data", "missing.py:g"],
    ["train", "--checkpoint-dir", __file__],  # a file: refused before the plan prints its "auto:" line
    ["bench", "--ops", "foo"], ["bench", "--dtype", "fp9"], ["bench", "--plot", "a.jpg"],
    ["bench", "--calibrate", "--ops", "attention"], ["bench", "--compare", "nosuch.json"],
    ["bench", "--compare", "a", "--compare", "b", "--quick"],
    ["watch", "--interval", "0"], ["watch", "--pid", "-1"], ["gpus", "nosuch"], ["doctor", "--foo"],
]


def test_every_command_refuses_bad_values_before_torch_loads():
    done = subprocess.run([sys.executable, "-c", _NO_TORCH_EACH, json.dumps(_REFUSED_WITHOUT_TORCH)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr.splitlines()[-1:]
    lines = done.stderr.splitlines()
    assert len(lines) == len(_REFUSED_WITHOUT_TORCH) and all(line.startswith("error: ") for line in lines), lines


def test_the_model_list_needs_no_torch():
    done = subprocess.run([sys.executable, "-c", _NO_TORCH, "plan", "--list-models", "--json"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr)  # 10: listed, but after importing torch
    listed = json.loads(done.stdout)["models"]
    from gpuwise.models import MODELS

    assert [m["name"] for m in listed] == list(MODELS) and listed[0]["params"] == MODELS["gpt2"].published_params


def test_a_closed_pipe_exits_quietly_with_141():
    code = "import sys; from gpuwise.cli import main; sys.exit(main(sys.argv[1:]))"
    for argv in (["gpus"], ["gpus", "--json"]):
        proc = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.close()  # the reader is gone before the first write
        assert proc.wait(timeout=60) == 141
        assert proc.stderr.read() == b""


def test_debug_internal_error_prints_the_traceback_and_exits_3(capsys, monkeypatch):
    import gpuwise.hardware.catalog as catalog
    import gpuwise.render  # noqa: F401  (imported here, it would keep the broken load_catalog for later tests)

    def broken(*_a, **_k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(catalog, "load_catalog", broken)
    monkeypatch.setenv("GPUWISE_DEBUG", "1")
    code, _, err = _run(capsys, "gpus")
    assert code == 3 and "Traceback" in err and err.rstrip().splitlines()[-1].startswith("error: internal error")


def test_silent_oddities_are_refused_or_named(capsys):
    code, _, err = _run(capsys, "gpus", "--min-memory", "24")
    assert code == 2 and "24GB" in err and "24GiB" in err
    code, _, err = _run(capsys, "plan", "--model", "mlp", "--gpu", "")
    assert code == 2 and "names no GPU" in err
    code, _, err = _run(capsys, "recommend", "--model", "mlp", "--gpu", ",")
    assert code == 2 and "names no GPU" in err
    code, _, err = _run(capsys, "recommend", "--model", "mlp", "--batch", "0")  # it meant --batch 64
    assert code == 2 and "--batch 0" in err
    code, _, err = _run(capsys, "plan", "--model", "mlp", "--device", "cpu:3")
    assert code == 2 and "the CPU has no index" in err
    code, out, _ = _run(capsys, "gpus", "a100")
    note = " ".join(out.split())  # the note wraps at 80 columns
    assert code == 0 and "a100-80gb-sxm" in note and "showing a100-40gb-sxm" in note and "A100 40GB" in out


def test_plan_refuses_integer_inputs_into_a_linear_layer(capsys, tmp_path):
    (tmp_path / "net.py").write_text("import torch\nfrom torch import nn\n\ndef build(batch_size):\n"
                                     "    return nn.Linear(16, 4), torch.randint(0, 9, (batch_size, 16))\n")
    code, _, err = _run(capsys, "plan", "--model", f"{tmp_path / 'net.py'}:build", "--gpu", "h100")
    assert code == 2 and err.count("\n") == 1 and "int64" in err and "nn.Embedding" in err


def test_plan_marks_bf16_on_gpus_without_it(capsys):
    code, out, _ = _run(capsys, "plan", "--model", "mlp", "--gpu", "t4")
    assert code == 0 and "no bf16" in out and "fp16-mixed" in out
    code, out, _ = _run(capsys, "plan", "--model", "mlp", "--gpu", "t4", "--json")
    assert json.loads(out)["gpus"][0]["missing_dtype"] == "bf16"
    code, out, _ = _run(capsys, "plan", "--model", "mlp", "--gpu", "t4", "--precision", "fp16-mixed")
    assert code == 0 and "no bf16" not in out


def test_hf_config_typos_are_one_line(capsys, tmp_path):
    pytest.importorskip("transformers")
    for config, expect in (({"model_type": "lama", "hidden_size": 64}, "closest: llama"),
                           ({"model_type": "gpt2", "n_layer": 10**12, "n_embd": 64}, "n_layer 1,000,000,000,000"),
                           ({"model_type": "llama", "hidden_size": 10**9, "intermediate_size": 64, "vocab_size": 64,
                             "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 8},
                            "past the planner's 64-bit counts")):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config))
        code, _, err = _run(capsys, "plan", "--hf-config", str(path), "--gpu", "h100", "--seq", "8")
        assert code == 2 and expect in err and len(err) < 600, err
        assert err.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.parametrize("argv, words", [
    (["plan", "--model", "gpt2", "--plot", "a\nb"], "--plot a\\nb"),  # a newline in a value: shown escaped, one line
    (["plan", "--model", "gpt2", "--precision", "bf16\x1b[31m"], "'bf16\\x1b[31m'"),
    (["train", "--lr", "inf"], "--lr inf"),  # ran to a nan loss at step 2
    (["train", "--seq", "0"], "--seq 0"),  # trained at the default 128
    (["train", "--example", "image", "--image-size", "0"], "--image-size 0"),
    (["recommend", "--model", "gpt2", "--segment", ""], "names no segment"),  # ranked every segment
    (["recommend", "--model", "gpt2", "--vendor", ",,"], "names no vendor"),
    (["recommend", "--model", "gpt2", "--sort", ""], "--sort ''"),  # sorted by time
    (["recommend", "--model", "gpt2", "--epochs", "-1", "--dataset-size", "-5"], "--epochs -1"),  # 5 samples
    (["recommend", "--model", "gpt2", "--epochs", "3", "--dataset-size", "0"], "--dataset-size 0"),  # said --samples
])
def test_the_fuzz_findings_are_refused_in_one_line(capsys, argv, words):
    code, _, err = _run(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and words in err, err


def test_the_torch_free_names_match_the_tables_they_stand_for():
    """recommend --weights and bench --ops/--dtype are checked against names written without torch: the same set."""
    from gpuwise.bench import DTYPES
    from gpuwise.planning.cost.llm_step import WEIGHT_BYTES
    from gpuwise.precision import ELEMENT_TYPES
    from gpuwise.recommend.request import SERVED_WEIGHTS

    assert set(SERVED_WEIGHTS) == set(WEIGHT_BYTES) and set(DTYPES) == set(ELEMENT_TYPES)
