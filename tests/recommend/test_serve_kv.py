"""recommend --serve sizes its sequences with the model's own captured KV cache (plan --task decode's), not the dense
formula; --kv-dtype stores it in fewer bytes; each row carries the vllm serve flags that run it."""

from __future__ import annotations

import functools
import json

import pytest

from conftest import run_cli
from fakes.hf_configs import _config
from gpuwise.hardware.catalog import load_catalog
from gpuwise.planning import Setup, plan_model
from gpuwise.planning.cost.serving import kv_bytes_per_token
from gpuwise.planning.sources.resolve import resolve_source
from gpuwise.recommend.request import Constraints, Traffic
from gpuwise.recommend.serve import serve

# google/gemma-2-2b's attention as its config.json gives it (head_dim 256, 8 heads, 4 KV heads, sliding_window 4096,
# every other layer sliding: transformers' Gemma2Config layer_types), on a small stack (6 layers, hidden 512) with
# room for 32k positions. At 16,384 tokens the 3 global layers hold every token and the 3 sliding ones their 4,096:
# 2 (K, V) x 4 heads x 256 x 2 B = 4,096 B a layer a token, x (3 x 16,384 + 3 x 4,096) = 251,658,240 B;
# the dense formula (every layer every token) says 6 x 16,384 x 4,096 = 402,653,184 B, 1.6x.
GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
          "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 512, "intermediate_size": 1024,
          "max_position_embeddings": 32768, "model_type": "gemma2", "num_attention_heads": 8,
          "num_hidden_layers": 6, "num_key_value_heads": 4, "query_pre_attn_scalar": 256, "sliding_window": 4096,
          "vocab_size": 1000}
CONTEXT = 16384
HAND = 4096 * (3 * CONTEXT + 3 * 4096)
DENSE = kv_bytes_per_token(layers=6, kv_heads=4, head_dim=256) * CONTEXT
H100 = load_catalog().get("h100-sxm")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    pytest.importorskip("transformers")
    return _config(tmp_path_factory.mktemp("gemma2"), GEMMA2)


@functools.cache
def _serve(config: str, **traffic):
    return serve(resolve_source(None, config), Traffic(**traffic), Constraints(gpus=("h100-sxm",)))


@pytest.mark.slow  # the module's first transformers captures: Gemma-2's prefill and decode steps, and plan's
def test_serving_holds_the_kv_cache_plan_captures(gemma):
    """The issue's acceptance test: recommend --serve's KV a sequence at 16k equals plan --task decode's captured
    cache (within 2%: plan's step holds the 16,384 cached tokens and the new one), the hand figure exactly, and the
    dense formula would have charged 1.6x, so fewer sequences would have fit."""
    r = _serve(gemma, max_model_len=CONTEXT, concurrency=8)
    plan = plan_model(None, Setup(task="decode", context=CONTEXT, precision="bf16"), hf_config=gemma, gpu="h100-sxm")
    assert r.kv.captured and r.kv.bytes == HAND
    assert plan.decode.kv_bytes_per_seq == pytest.approx(r.kv.bytes, rel=0.02)
    assert plan.decode.kv_bytes_per_seq == 4096 * (3 * (CONTEXT + 1) + 3 * 4096)  # the new token in the global layers
    assert DENSE / r.kv.bytes == pytest.approx(1.6)
    one = next(o for o in r.rows if o.count == 1)
    assert one.kv_bytes_per_seq == HAND
    assert 0 < one.max_concurrency * HAND <= H100.memory_bytes * 0.9  # vLLM's 90%, less weights and activations


def test_tensor_parallel_splits_the_captured_cache_by_kv_heads(gemma):
    """4 KV heads over 2 GPUs: each holds 2, half the cache; over 8: one head each (replicated), a quarter."""
    r = _serve(gemma, max_model_len=CONTEXT, concurrency=8)
    per = {o.count: o.kv_bytes_per_seq for o in r.rows}
    assert per[2] == HAND / 2 and per[8] == HAND / 4


def test_fp8_kv_halves_the_cache_and_lets_more_sequences_fit(gemma):
    """--kv-dtype fp8 (vLLM's --kv-cache-dtype fp8): one byte an element, so plan's cache and serving's both halve."""
    bf16 = _serve(gemma, max_model_len=CONTEXT, concurrency=8)
    fp8 = _serve(gemma, max_model_len=CONTEXT, concurrency=8, kv_dtype="fp8")
    assert fp8.kv.bytes == HAND // 2 and fp8.kv.kv_dtype == "fp8"
    a, b = (next(o for o in x.rows if o.count == 1) for x in (bf16, fp8))
    assert b.max_concurrency > 1.9 * a.max_concurrency
    assert b.vllm_args[b.vllm_args.index("--kv-cache-dtype") + 1] == "fp8"
    plan = plan_model(None, Setup(task="decode", context=CONTEXT, precision="bf16", kv_dtype="fp8"),
                      hf_config=gemma, gpu="h100-sxm")
    assert plan.decode.kv_cache_bytes == plan.breakdown["kv_cache"] == 2048 * (3 * (CONTEXT + 1) + 3 * 4096)
    assert "fp8 KV cache" in plan.setup.describe()


def test_the_vllm_flags_run_the_row(gemma):
    """Each row's vllm serve flags: the context, the replica size, the sequences it decodes (capped at vLLM's 256),
    and the share of the GPU's whole memory its weights, activations and those sequences' caches take."""
    r = _serve(gemma, max_model_len=CONTEXT, concurrency=1000)
    for o in r.rows:
        args = dict(zip(o.vllm_args[::2], o.vllm_args[1::2], strict=True))
        assert args["--max-model-len"] == str(CONTEXT)
        layout = dict(o.parallel)  # tensor parallel, or pipeline stages, over the replica's GPUs
        assert args["--tensor-parallel-size"] == str(layout["tp"])
        assert int(args.get("--pipeline-parallel-size", 1)) == layout["pp"] and layout["tp"] * layout["pp"] == o.count
        # the users spread evenly over the replicas (1000 over 4: 250 each), each engine allowed its 256
        assert int(args["--max-num-seqs"]) == min(256, o.max_concurrency) >= o.decode_batch
        assert args["--kv-cache-dtype"] == "auto" and "--quantization" not in args
        share = float(args["--gpu-memory-utilization"])
        assert int(args["--max-num-seqs"]) * o.kv_bytes_per_seq / H100.memory_bytes < share <= 0.9


def test_vllm_names_as_inputs(gemma, capsys):
    """--max-model-len sizes the cache, --tensor-parallel-size pins the replica, --max-num-seqs alone is the users,
    --gpu-memory-utilization the budget; --json carries the flags as a list and as one line."""
    code, out, err = run_cli(capsys, "recommend", "--hf-config", gemma, "--serve", "--gpu", "h100-sxm",
                             "--max-model-len", str(CONTEXT), "--tensor-parallel-size", "2", "--max-num-seqs", "32",
                             "--gpu-memory-utilization", "0.5", "--kv-dtype", "fp8", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["kv_cache"]["bytes"] == HAND // 2 and data["kv_cache"]["captured"]
    (row,) = [r for r in data["rows"] if r["excluded"] is None]
    assert row["count"] == 2 and row["kv_bytes_per_seq"] == HAND // 4
    assert row["decode_batch"] == 32 and data["traffic"]["concurrency"] == 32
    assert row["max_concurrency"] * HAND // 4 <= H100.memory_bytes * 0.5  # the budget, not vLLM's 0.9
    assert float(row["vllm_args"][row["vllm_args"].index("--gpu-memory-utilization") + 1]) <= 0.5
    assert row["vllm_command"] == " ".join(["vllm", "serve", data["workload"]["model"], *row["vllm_args"]])
    assert row["vllm_args"][:2] == ["--max-model-len", str(CONTEXT)]
    assert "--tensor-parallel-size 2 --kv-cache-dtype fp8" in row["vllm_command"]
    code, out, err = run_cli(capsys, "recommend", "--hf-config", gemma, "--serve", "--gpu", "h100-sxm",
                             "--max-model-len", str(CONTEXT), "--tensor-parallel-size", "2", "--max-num-seqs", "32",
                             "--gpu-memory-utilization", "0.5", "--kv-dtype", "fp8")
    assert code == 0, err
    # printed in lines of 80 columns at most, continued with backslashes: the shell reads the command --json gives
    after = out.split("to run the first row, each replica:\n")[1].splitlines()
    shown = [x for i, x in enumerate(after) if x.startswith("  ") and all(y.endswith(" \\") for y in after[:i])]
    assert len(shown) > 1 and all(len(x) <= 80 for x in shown)
    assert " ".join(" ".join(shown).replace(" \\", " ").split()) == row["vllm_command"]


def test_the_dense_formula_is_the_fallback_and_says_so(monkeypatch):
    """A model whose decode step cannot be captured is sized by the dense formula, and its basis says why."""
    from gpuwise.planning.cost import kv_cache
    from gpuwise.planning.planner import Planner

    source = resolve_source("llama3.2-1b", None)
    planner = Planner(source)
    captured = kv_cache.sequence_kv(planner, source.decoder, context=1024)
    assert captured.captured and captured.bytes == kv_bytes_per_token(layers=16, kv_heads=8, head_dim=64) * 1024

    def refuse(setup, **_):
        from gpuwise.errors import NotApplicable
        raise NotApplicable("no cache")

    monkeypatch.setattr(planner, "per_gpu", refuse)
    dense = kv_cache.sequence_kv(planner, source.decoder, context=1024, kv_dtype="fp8")
    assert not dense.captured and dense.bytes == captured.bytes // 2
    assert "dense formula" in dense.basis and "no cache" in dense.basis


@pytest.mark.parametrize(("args", "message"), [
    (["--serve", "--kv-dtype", "int4"], "--kv-dtype 'int4' is not one of"),
    (["--serve", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5 is outside (0, 1]"),
    (["--serve", "--max-model-len", "100"], "--max-model-len 100 is shorter than"),
    (["--serve", "--max-model-len", "2048"], "--max-model-len = 2048 is more than gpt2's 1024 positions"),
    (["--kv-dtype", "fp8", "--tokens", "1e9"], "--kv-dtype applies to serving"),
    (["--tensor-parallel-size", "2", "--tokens", "1e9"], "--tp 2: recommend ranks data-parallel GPU counts"),
])
def test_bad_serving_flags_are_one_line(capsys, args, message):
    code, out, err = run_cli(capsys, "recommend", "--model", "gpt2", *args)
    assert code == 2, (out, err)
    assert message in err and len(err.strip().splitlines()) == 1


def test_plan_refuses_a_kv_dtype_without_decode(capsys):
    code, _, err = run_cli(capsys, "plan", "--model", "gpt2", "--kv-dtype", "fp8")
    assert code == 2 and "--kv-dtype fp8 is the KV cache of a decode step" in err


def test_serving_takes_a_quantised_checkpoints_own_weights_and_refuses_a_contradiction():
    """A GPTQ 4-bit checkpoint serves as int4 when --weights is not given; --weights nf4 contradicts it (as plan
    refuses it); a 16-bit checkpoint takes whatever --weights says."""
    from types import SimpleNamespace

    from gpuwise.errors import GpuwiseError
    from gpuwise.recommend.serve import served_weights

    def source(quantized, weights):
        info = SimpleNamespace(quantized=quantized, weights=weights, describe=lambda: "GPTQ 4-bit, group 128")
        return SimpleNamespace(name="llama", checkpoint=info)

    assert served_weights(source(True, "int4"), None) == "int4"
    assert served_weights(source(True, "int4"), "int4") == "int4"
    with pytest.raises(GpuwiseError, match="contradicts llama"):
        served_weights(source(True, "int4"), "nf4")
    with pytest.raises(GpuwiseError, match="does not lay out"):
        served_weights(source(True, None), None)
    assert served_weights(source(False, None), "int8") == "int8"
    assert served_weights(SimpleNamespace(name="gpt2"), None) is None


def test_vllm_serves_a_built_in_model_by_its_hub_repo():
    """vllm serve takes a Hugging Face repo: a built-in model's command names the repo its config.json is from;
    a Hub id or a config path the user gave is kept as given."""
    from gpuwise.recommend.serve import served_name

    assert served_name("llama3-8b") == "meta-llama/Meta-Llama-3-8B"
    assert served_name("gpt2-xl") == "openai-community/gpt2-xl"
    assert served_name("Qwen/Qwen2.5-7B") == "Qwen/Qwen2.5-7B"
    assert served_name("resnet50") == "resnet50"  # not a decoder: no vllm command is printed for it anyway
