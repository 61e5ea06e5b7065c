"""recommend --serve names its runtime, prices it as that runtime serves (issue 28): --runtime, --split,
--request-rate, GGUF and FP4 weights, and the JSON every serving row carries."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli


def _rows(capsys, *args):
    code, out, err = run_cli(capsys, "recommend", "--model", "llama3-8b", "--serve", *args, "--json")
    assert code == 0, err
    data = json.loads(out)
    return data, [r for r in data["rows"] if r["excluded"] is None]


def test_every_serving_row_names_its_runtime_and_layout(capsys):
    data, rows = _rows(capsys, "--gpus", "h100-sxm", "--concurrency", "64")
    assert rows and data["traffic"]["runtime"] is None  # not given: the default, said on every row
    for r in rows:
        assert r["runtime"] == "vllm"
        p = r["parallel"]
        assert p["tp"] * p["pp"] == r["count"] and p["replicas"] == r["replicas"]
        assert r["tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 and r["ttft_s"] > 0 and r["tpot_s"] > 0
        # the fleet's output tokens: the replicas' share of the 64 users, each stream at 1 / tpot at most
        assert r["tokens_per_s"] <= 64 * r["decode_tokens_per_s"] * (1 + 1e-9)
        assert 0 < r["prefill_share"] < 1


def test_gguf_weights_default_to_llama_cpp_and_its_layer_split(capsys):
    """Q4_K_M is llama.cpp's: its rows say so, split layers over GPUs by default, and give llama-server's command;
    two RTX 3090s decode one stream slower than one (the GPUs take turns)."""
    _data, rows = _rows(capsys, "--gpus", "rtx-3090", "--weights", "q4_k_m", "--concurrency", "1", "--split", "layer")
    by = {r["count"]: r for r in rows}
    assert {r["runtime"] for r in rows} == {"llama.cpp"}
    assert by[2]["parallel"] == {"tp": 1, "pp": 2, "replicas": 1}
    assert by[2]["decode_tokens_per_s"] < by[1]["decode_tokens_per_s"]
    assert by[2]["runtime_command"].startswith("llama-server -m ") and "--split-mode layer" in by[2]["runtime_command"]
    assert by[1]["vllm_args"] is None


def test_a_request_rate_is_served_and_more_replicas_take_more(capsys):
    _, low = _rows(capsys, "--gpus", "h100-sxm", "--request-rate", "1", "--max-gpus", "8")
    _, high = _rows(capsys, "--gpus", "h100-sxm", "--request-rate", "100", "--max-gpus", "8")
    one = next(r for r in low if r["count"] == 1)
    many = next(r for r in high if r["count"] == 1)
    assert one["replicas"] == 1 and many["replicas"] > 1
    # a request a second of 256 output tokens: 256 tokens/s out
    assert one["tokens_per_s"] == pytest.approx(256, rel=1e-3)


def test_fp4_needs_blackwell(capsys):
    data, rows = _rows(capsys, "--gpus", "h100-sxm,b200", "--weights", "nvfp4", "--runtime",
                       "tensorrt-llm")
    assert {r["gpu"] for r in rows} == {"b200"}
    (h100,) = [r for r in data["rows"] if r["gpu"] == "h100-sxm"]
    assert "FP4 tensor cores" in h100["excluded"]


@pytest.mark.parametrize(("args", "message"), [
    (["--runtime", "ollama"], "--runtime 'ollama' is not one gpuwise prices"),
    (["--weights", "int4", "--runtime", "llama.cpp"], "llama.cpp does not run --weights int4"),
    (["--split", "diagonal"], "--split 'diagonal' is not one of"),
    (["--request-rate", "2", "--tokens-per-s", "100"], "both set the demand"),
])
def test_bad_serving_input_is_one_line_and_exit_2(capsys, args, message):
    code, _out, err = run_cli(capsys, "recommend", "--model", "llama3-8b", "--serve", "--gpus", "h100-sxm", *args)
    assert code == 2 and message in err and "Traceback" not in err


def test_runtime_flags_need_serve(capsys):
    code, _, err = run_cli(capsys, "recommend", "--model", "gpt2", "--runtime", "vllm")
    assert code == 2 and "--runtime applies to serving" in err


@pytest.mark.parametrize("flag", [["--runtime", "vllm"], ["--split", "tp"], ["--request-rate", "5"]])
def test_llm_serving_flags_are_refused_for_a_vision_model(capsys, flag):
    code, _, err = run_cli(capsys, "recommend", "--model", "resnet50", "--serve", "--gpus", "l4", *flag)
    assert code == 2 and f"{flag[0]} applies to serving a language model" in err
