"""A dozen architectures of benchmarks/hf_sweep.py's sweep (issue 17): a small config of each (2 layers, width 64,
vocabulary 1000) planned in-process, its parameter count against the model transformers builds for real.

The ones that plan today must give the exact count, vision models included (images from the config, constructors
that read drop-path rates built with real constants: sources/hf_inputs.py, hf_build.py). An architecture that fails
today goes in FAIL_TODAY as a strict xfail with the reason, so that it flips (XPASS fails) when its fix lands."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def sweep():
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "hf_sweep.py"
    spec = importlib.util.spec_from_file_location("hf_sweep", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    transformers.logging.set_verbosity_error()
    return module


# (task, model_type, parameters of the small config in transformers 5.24.0)
PLANS = [
    ("causal-lm", "llama", 210_240),
    ("causal-lm", "gpt2", 229_632),
    ("causal-lm", "qwen2", 210_624),
    ("causal-lm", "gpt_neox", 195_072),
    ("masked-lm", "bert", 169_256),
    ("masked-lm", "roberta", 169_256),
    ("masked-lm", "xmod", 177_640),  # its default language, activations indexed by a constant's mask
    ("seq-cls", "distilbert", 151_618),
    ("seq-cls", "bert", 168_258),
    ("seq-cls", "deberta", 168_002),  # reads its labels' values: (labels >= 0).nonzero()
    ("causal-lm", "mixtral", 350_016),
    ("causal-lm", "qwen3_moe", 350_080),
    ("image-cls", "vit", 116_802),
    ("image-cls", "convnext", 84_766),
    ("image-cls", "deit", 116_930),
    ("image-cls", "resnet", 36_962),
]
FAIL_TODAY: list = []  # strict xfails (the reason each fails), flipped to PLANS when a fix lands


@pytest.mark.parametrize(("task", "model_type", "params"), [*PLANS, *FAIL_TODAY])
def test_plan_has_the_real_parameter_count(sweep, task, model_type, params):
    (arch,) = [a for t, m, a in sweep.architectures(task, {model_type}) if t == task][:1]
    row = sweep.sweep_one(task, model_type, arch, timeout=60)
    assert row.level == 0, f"transformers did not build the small config: {row}"
    if transformers.__version__ == "5.24.0":  # the config classes' defaults of another release give other counts
        assert row.real_params == params
    assert (row.result, row.plan_params) == ("ok", row.real_params), row.reason


# Small configs transformers could not build from the class's defaults alone: a None the published configs set
# (head_dim, n_routed_experts, layer_types, DBRX's rope_theta), a top-1 router, expert groups above the experts, Zamba's
# shared attention block in one hybrid layer
BUILD = [("dbrx", "DbrxForCausalLM"), ("dots1", "Dots1ForCausalLM"), ("lfm2_moe", "Lfm2MoeForCausalLM"),
         ("hunyuan_v1_moe", "HunYuanMoEV1ForCausalLM"), ("zaya", "ZayaForCausalLM"),
         ("bailing_hybrid", "BailingHybridForCausalLM"), ("zamba", "ZambaForCausalLM")]


@pytest.mark.parametrize(("model_type", "arch"), BUILD)
def test_small_config_builds_and_runs(sweep, model_type, arch):
    config = sweep.small_config(model_type, arch)
    assert sweep.real_params(config, "causal-lm") < 1_000_000  # built and run on the CPU


def test_token_ids_are_real_and_end_each_row_with_the_eos_token():
    # BART's classifier pools at the end-of-sequence token and refuses rows with different numbers of it; DeBERTa's
    # and XLM's read their labels' and ids' values, which the retry with concrete values reads off real tensors
    from gpuwise.compat import FakeTensor, FakeTensorMode
    from gpuwise.planning.sources.hf_inputs import TOKENS, make_input

    config = transformers.BartConfig(vocab_size=5, eos_token_id=2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        ids = make_input(TOKENS, config, 64, seq=16, image=None, dtype=torch.float32)
    assert not isinstance(ids, FakeTensor)
    assert ((ids == 2).sum(1) == 1).all() and (ids[:, -1] == 2).all()


def test_small_config_is_small(sweep):
    config = sweep.small_config("qwen3_moe", "Qwen3MoeForCausalLM")
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 64 and config["vocab_size"] == 1000
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    llava = sweep.small_config("llava", "LlavaForConditionalGeneration")  # sub-configs are made small too
    assert llava["text_config"]["hidden_size"] == 64 and llava["vision_config"]["image_size"] == 32
    assert sweep._pattern(["sliding_attention"] * 5 + ["full_attention"]) == ["sliding_attention", "full_attention"]
    longcat = sweep.small_config("longcat_flash", "LongcatFlashForCausalLM")  # its 256 identity experts, looped over
    assert (longcat["n_routed_experts"], longcat["zero_expert_num"]) == (4, 4)
    gemma3n = sweep.small_config("gemma3n_text", "Gemma3nForCausalLM")  # per-layer FFN widths, a vocabulary a layer
    assert (gemma3n["intermediate_size"], gemma3n["vocab_size_per_layer_input"]) == ([128, 128], 1000)
    assert sweep.small_config("t5", "T5ForSequenceClassification")["decoder_start_token_id"] == 0
    qwen35 = sweep.small_config("qwen3_5", "Qwen3_5ForSequenceClassification")  # its classifier reads text_config's
    assert qwen35["text_config"]["pad_token_id"] == 0
    perceiver = sweep.small_config("perceiver", "PerceiverForMaskedLM")  # it decodes every position it has
    assert (perceiver["max_position_embeddings"], perceiver["d_latents"], perceiver["num_self_attends_per_block"]) \
        == (32, 64, 2)
