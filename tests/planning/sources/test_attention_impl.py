"""``--attention`` (Setup.attention; sources/zoo.py, sources/hf.py): eager runs the math path and keeps the scores,
flash and flex are captured as SDPA and named as asked, a config.json's ``attn_implementation`` holds unless the flag
is given, and combinations a model cannot run are one-line errors. The independent reference for what eager keeps is
autograd's own rule for each op of the math path (a softmax saves its output, a matmul its operands, masked_fill its
mask) against FlashAttention-2's saved logsumexp (Dao 2023, arXiv:2307.08691, Algorithm 1)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwise.errors import GpuwiseError
from gpuwise.models import get_model
from gpuwise.models.gpt import GPTConfig
from gpuwise.planning.capture.step import capture
from gpuwise.planning.capture.tracker import CATEGORIES
from gpuwise.planning.setup import Request, Setup, resolve
from gpuwise.planning.sources.hf import HFSource
from gpuwise.planning.sources.zoo import ZooSource

ACT = CATEGORIES.index("activations")
B, S, H, NH = 2, 128, 256, 8
GPT = ZooSource(zoo=replace(get_model("gpt2"), name="gpt-attention-test",
                            config=GPTConfig(n_layer=4, n_head=NH, n_embd=H, vocab_size=512, block_size=S)))
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
         "max_position_embeddings": 256}
SWITCH = "tests/data/switch-base-8-config.json"


def _block_kept(source, setup: Setup) -> int:
    """Bytes one block leaves saved at the end of forward: the 3-block capture less the 2-block one."""
    two, three = (capture(source, setup, batch=setup.micro_batch, n_layer=n) for n in (2, 3))
    return int(three.live[three.end_of_forward, ACT] - two.live[two.end_of_forward, ACT])


@pytest.mark.parametrize(("precision", "score_bytes"), [("bf16", 2), ("bf16-mixed", 4 + 2)])
def test_eager_keeps_the_scores_that_flash_does_not(precision, score_bytes):
    """Per block, eager keeps the softmax's output (B, heads, S, S) and the causal mask (S x S bools) where flash keeps
    an fp32 logsumexp (B, heads, S). Under autocast the softmax runs in fp32 (CUDA's fp32 list) and the matmul after
    it saves its own bf16 copy: 4 + 2 bytes a score."""
    setup = Setup(micro_batch=B, seq=S, precision=precision)
    sdpa, eager = (_block_kept(GPT, replace(setup, attention=a)) for a in ("sdpa", "eager"))
    assert eager - sdpa == score_bytes * B * NH * S * S + S * S - 4 * B * NH * S


def test_flash_and_flex_are_captured_as_sdpa_and_named_as_asked():
    setup = Setup(micro_batch=B, seq=S, precision="bf16")
    sdpa = capture(GPT, setup, batch=B, n_layer=2)
    for name in ("flash", "flex"):
        other = capture(GPT, replace(setup, attention=name), batch=B, n_layer=2)
        assert (other.live == sdpa.live).all() and other.flops_per_step == sdpa.flops_per_step
        assert GPT.attention(replace(setup, attention=name)) == name
    assert GPT.attention(setup) == "sdpa"  # not given: the built-in models call SDPA
    eager = capture(GPT, replace(setup, attention="eager"), batch=B, n_layer=2)
    assert "bmm" in eager.ops and "_softmax" in eager.ops
    assert not any("attention" in op for op in eager.ops) and any("flash_attention" in op for op in sdpa.ops)


def test_models_without_an_attention_choice_refuse_one():
    with pytest.raises(GpuwiseError, match="applies to the GPT and Llama models, not resnet50"):
        ZooSource(zoo=get_model("resnet50")).check(Setup(attention="eager"))
    ZooSource(zoo=get_model("resnet50")).check(Setup(attention="sdpa"))


def _hf(tmp_path, cfg: dict) -> HFSource:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return HFSource.from_path(path)


def test_a_config_attn_implementation_holds_unless_the_flag_is_given(tmp_path):
    own = _hf(tmp_path, {**LLAMA, "attn_implementation": "eager"})
    assert own.attention(Setup()) == "eager" and own.attention(Setup(attention="sdpa")) == "sdpa"
    ops = set(capture(own, Setup(micro_batch=2, seq=32), batch=2).ops)
    assert "bmm" in ops and not any("flash_attention" in op for op in ops)  # transformers' eager_attention_forward
    flagged = set(capture(own, Setup(micro_batch=2, seq=32, attention="sdpa"), batch=2).ops)
    assert any("flash_attention" in op for op in flagged) and "bmm" not in flagged
    for value, name in (("flash_attention_2", "flash"), ("flash_attention_3", "flash"), ("flex_attention", "flex"),
                        ("sdpa", "sdpa"), ("no-such-kernel", "sdpa")):
        assert _hf(tmp_path, {**LLAMA, "attn_implementation": value}).attention(Setup()) == name, value
    assert _hf(tmp_path, LLAMA).attention(Setup(attention="flex")) == "flex"


def test_flash_and_flex_on_a_config_capture_as_sdpa(tmp_path):
    source = _hf(tmp_path, LLAMA)
    setup = Setup(micro_batch=2, seq=32, precision="bf16")
    sdpa = capture(source, setup, batch=2)
    for name in ("flash", "flex"):
        other = capture(source, replace(setup, attention=name), batch=2)
        assert (other.live == sdpa.live).all() and other.ops == sdpa.ops


def test_a_model_without_sdpa_resolves_to_eager_and_refuses_sdpa():
    """transformers' Switch Transformer has no SDPA path (_supports_sdpa False): not given, its attention is eager;
    asked for sdpa, flash or flex, the plan says so and names the one it runs."""
    source = HFSource.from_path(Path(SWITCH))
    assert source.attention(Setup()) == "eager"
    for name in ("sdpa", "flash"):
        with pytest.raises(GpuwiseError, match=f"--attention {name}: transformers' SwitchTransformers") as e:
            source.check(Setup(attention=name, precision="bf16-mixed"))
        assert "--attention eager" in e.value.hint


def test_bad_attention_combinations_are_one_line_errors(tmp_path):
    with pytest.raises(GpuwiseError, match="applies to the built-in GPT and Llama"):
        _hf(tmp_path, LLAMA).check(Setup(attention="gpuwise"))
    with pytest.raises(GpuwiseError, match="takes fp16 and bf16 only, not --precision fp32") as e:
        Setup(attention="flash", precision="fp32")
    assert "--precision bf16-mixed" in e.value.hint
    with pytest.raises(GpuwiseError, match="--attention 'paged' is not one of sdpa, eager, flash, flex, gpuwise"):
        resolve(Request(attention="paged"))
    with pytest.raises(GpuwiseError, match="--cp 2 runs ring attention through SDPA"):
        Setup(gpus=2, cp=2, attention="eager")  # ring attention replaces SDPA's calls (parallel/context.py)
    assert resolve(Request()).attention is None  # not given: the model's own
