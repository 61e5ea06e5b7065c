"""A checkpoint read for its weights as stored: safetensors headers written by the safetensors package, GGUF files
written by gguf.GGUFWriter, config.json's quantization_config; and the --weights a plan of it takes."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from conftest import run_cli
from fakes.hf_configs import LLAMA_2_7B
from gpuwise.errors import GpuwiseError
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.checkpoint import (
    CheckpointInfo,
    Quantization,
    Stored,
    checkpoint_info,
    quantization_of,
    read_safetensors,
    read_safetensors_header,
    safetensors_files,
    stored_weights,
)

safetensors_torch = pytest.importorskip("safetensors.torch")

TINY = dict(LLAMA_2_7B, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, vocab_size=100, max_position_embeddings=256)
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


def test_the_header_gives_each_tensors_dtype_shape_and_bytes(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = {"a.weight": torch.zeros(4, 8, dtype=torch.float16), "b.weight": torch.zeros(16, 16, dtype=torch.int8),
               "b.SCB": torch.zeros(16, dtype=torch.float32)}
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})
    header = read_safetensors_header(path)
    assert set(header) == set(tensors)  # __metadata__ is not a tensor
    from safetensors import safe_open

    with safe_open(path, "pt") as f:  # the package's own reading of the same file
        for name in tensors:
            piece = f.get_slice(name)
            assert header[name]["dtype"] == piece.get_dtype()
            assert header[name]["shape"] == piece.get_shape()
    for name, t in tensors.items():
        start, end = header[name]["data_offsets"]
        assert end - start == t.numel() * t.element_size()
    # LLM.int8 as bitsandbytes saves it: int8 weights and an fp32 row scale (SCB), which holds no weights
    stored = read_safetensors([path], Quantization(method="bitsandbytes", bits=8))
    assert stored == (Stored(dtype="I8", tensors=1, params=256, nbytes=256),
                      Stored(dtype="F16", tensors=1, params=32, nbytes=64),
                      Stored(dtype="F32", tensors=1, params=0, nbytes=64))
    info = CheckpointInfo(files=(path,), format="safetensors", stored=stored)
    assert info.bits_per_weight == pytest.approx(8 * (256 + 64 + 64) / (256 + 32))


def test_gptq_packs_eight_weights_an_int32(tmp_path):
    # AutoGPTQ's QuantLinear, in 256 x out 512, 4 bits, group 128: qweight (in/8, out) int32, scales (in/128, out)
    # fp16, qzeros (in/128, out/8) int32, g_idx (in,) int32
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY, quantization_config=GPTQ)))
    safetensors_torch.save_file({
        "l.qweight": torch.zeros(256 // 8, 512, dtype=torch.int32),
        "l.scales": torch.zeros(2, 512, dtype=torch.float16),
        "l.qzeros": torch.zeros(2, 512 // 8, dtype=torch.int32), "l.g_idx": torch.zeros(256, dtype=torch.int32),
    }, tmp_path / "model.safetensors")
    info = checkpoint_info(json.loads((tmp_path / "config.json").read_text()), tmp_path)
    assert info.params == 256 * 512
    # 4 bits a weight, an fp16 scale and a 4-bit zero a group of 128, and the 32-bit g_idx of each input row
    assert info.bits_per_weight == pytest.approx(4 + 16 / 128 + 4 / 128 + 32 / 512)
    assert info.weights == "int4"


def test_sharded_checkpoints_read_the_index_and_only_whole(tmp_path):
    for i in (1, 2):
        safetensors_torch.save_file({f"w{i}": torch.zeros(8, dtype=torch.bfloat16)},
                                    tmp_path / f"model-0000{i}-of-00002.safetensors")
    safetensors_torch.save_file({"w": torch.zeros(8)}, tmp_path / "consolidated.safetensors")  # Mistral's copy
    index = {"weight_map": {"w1": "model-00001-of-00002.safetensors", "w2": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [f.name for f in safetensors_files(tmp_path)] == ["model-00001-of-00002.safetensors",
                                                             "model-00002-of-00002.safetensors"]
    (tmp_path / "model-00002-of-00002.safetensors").unlink()  # a partial download says nothing of the whole
    assert safetensors_files(tmp_path) == ()


@pytest.mark.parametrize(("config", "weights", "text"), [
    (GPTQ, "int4", "GPTQ 4-bit, group 128"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, "int4", "AWQ 4-bit, group 128"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "nf4", "bitsandbytes nf4"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "int8", "bitsandbytes LLM.int8"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "fp8", "fp8 8-bit"),
    ({"quant_method": "compressed-tensors",
      "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
     "fp8", "compressed-tensors 8-bit"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, None, "GPTQ 3-bit, group 128"),
])
def test_quantization_config_names_the_weights(config, weights, text):
    q = quantization_of({"quantization_config": config})
    assert q.weights == weights and q.describe() == text


def test_a_quantised_checkpoint_sets_the_weights_of_inference():
    info = CheckpointInfo(files=(), format="config", stored=(), quantization=quantization_of(
        {"quantization_config": GPTQ}))
    setup, note = stored_weights("m", info, Setup(task="infer"))
    assert setup.weights == "int4" and note == "weights as stored: GPTQ 4-bit, group 128; planned as --weights int4"
    assert stored_weights("m", info, Setup(task="infer", weights="int4"))[0].weights == "int4"
    with pytest.raises(GpuwiseError, match="--weights nf4 contradicts m, whose weights are stored as GPTQ"):
        stored_weights("m", info, Setup(task="infer", weights="nf4"))
    trained, note = stored_weights("m", info, Setup(task="train"))
    assert trained.weights is None and "--task train plans them as --precision bf16-mixed computes" in note
    three = CheckpointInfo(files=(), format="config", stored=(), quantization=Quantization(method="gptq", bits=3))
    with pytest.raises(GpuwiseError, match="a format gpuwise does not lay out"):
        stored_weights("m", three, Setup(task="infer"))
    assert stored_weights("m", three, Setup(task="infer", weights="int4"))[0].weights == "int4"
    # a 16-bit checkpoint is quantised as it loads: any --weights, and none by default
    bf16 = CheckpointInfo(files=(), format="safetensors",
                          stored=(Stored(dtype="BF16", tensors=1, params=8, nbytes=16),))
    assert stored_weights("m", bf16, Setup(task="infer"))[0].weights is None
    assert stored_weights("m", bf16, Setup(task="infer", weights="nf4"))[0].weights == "nf4"


def test_plan_of_a_gptq_checkpoint_is_its_int4(capsys, tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "gptq").mkdir()
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(dict(TINY, quantization_config=GPTQ)))
    args = ["--task", "infer", "--seq", "64", "--gpu", "h100-sxm", "--json"]
    code, out, err = run_cli(capsys, "plan", "--hf-config", str(tmp_path / "gptq"), *args)
    assert code == 0, err
    plan = json.loads(out)
    assert plan["setup"]["weights"] == "int4"
    assert "weights as stored: GPTQ 4-bit, group 128; planned as --weights int4" in plan["notes"]
    code, out, err = run_cli(capsys, "plan", "--hf-config", str(tmp_path / "plain"), *args, "--weights", "int4")
    assert code == 0, err
    assert json.loads(out)["breakdown"]["weights"] == plan["breakdown"]["weights"]
    code, out, err = run_cli(capsys, "plan", "--hf-config", str(tmp_path / "gptq"), *args, "--weights", "nf4")
    assert code == 2 and err.count("\n") == 1 and "--weights nf4 contradicts" in err


def _tiny_gguf(path, gguf, tensors):
    """A llama GGUF of TINY's shape (its metadata as llama.cpp's converter writes it) holding ``tensors``."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(256)
    w.add_feed_forward_length(512)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_vocab_size(100)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(100)])
    w.add_token_scores([0.0] * 100)
    w.add_token_types([1] * 100)
    for name, (data, kind) in tensors.items():
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_tensor_types_give_the_bits(tmp_path):
    gguf = pytest.importorskip("gguf")
    from gpuwise.planning.sources.checkpoint import read_gguf

    q8 = gguf.quantize(np.random.default_rng(0).random((256, 256), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    f16 = np.zeros((100, 256), dtype=np.float16)
    path = tmp_path / "tiny.gguf"
    _tiny_gguf(path, gguf, {"blk.0.attn_q.weight": (q8, gguf.GGMLQuantizationType.Q8_0),
                            "token_embd.weight": (f16, gguf.GGMLQuantizationType.F16)})
    info = read_gguf(path)
    # Q8_0 (ggml-common.h block_q8_0): 32 int8 weights and one fp16 scale, 34 bytes a block of 32
    assert info.stored == (Stored(dtype="Q8_0", tensors=1, params=65_536, nbytes=65_536 // 32 * 34),
                           Stored(dtype="F16", tensors=1, params=25_600, nbytes=51_200))
    assert info.mix == "Q8_0"
    assert info.bits_per_weight == pytest.approx(8 * (51_200 + 69_632) / (25_600 + 65_536))
    only_q8 = CheckpointInfo(files=(), format="gguf", stored=info.stored[:1])
    assert only_q8.bits_per_weight == 8.5 and only_q8.weights == "int8"


def test_plan_of_a_gguf_file(capsys, tmp_path):
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    q8 = gguf.quantize(np.zeros((256, 256), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    path = tmp_path / "tiny.gguf"
    _tiny_gguf(path, gguf, {"blk.0.attn_q.weight": (q8, gguf.GGMLQuantizationType.Q8_0)})
    code, out, err = run_cli(capsys, "plan", "--hf-config", str(path), "--task", "infer", "--seq", "64", "--gpu",
                             "h100-sxm", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["model"] == "tiny.gguf" and plan["setup"]["weights"] == "int8"
    assert "weights as stored: 8.50 bits/weight (Q8_0 mix: Q8_0 100%), 68 KiB; planned as --weights int8" in plan[
        "notes"]
    # its architecture is TINY's, tied (no output.weight): 100 x 256 embeddings and two blocks
    block = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512 + 2 * 256
    assert plan["params"] == 100 * 256 + 2 * block + 256


def test_a_gguf_file_without_the_gguf_package_is_one_line(capsys, tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    code, _, err = run_cli(capsys, "plan", "--hf-config", str(path))
    assert code == 2 and err.count("\n") == 1
    assert "install gguf: pip install 'gpuwise[gguf]'" in err
