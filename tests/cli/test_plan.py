"""``gpuwise plan`` as users run it: every output mode, the JSON keys, the plot, and bad input."""

from __future__ import annotations

import importlib
import json
import textwrap

import pytest

from conftest import run_cli
from gpuwise.hardware.catalog import load_catalog
from gpuwise.models import MODELS
from gpuwise.planning import Setup, plan_model

run = run_cli


SMALL = ["--model", "gpt2", "--seq", "128", "--batch", "2"]


@pytest.mark.parametrize("args", [SMALL, [*SMALL, "--json"], [*SMALL, "--gpu", "rtx-4090"], ["--list-models"],
                                  ["--list-models", "--json"], ["--help"]])
def test_plan_output_modes(capsys, args):
    code, out, err = run(capsys, "plan", *args)
    assert code == 0, err
    assert out.strip() and not err
    if "--json" in args:
        json.loads(out)


def test_plan_json_has_the_documented_keys(capsys):
    code, out, _ = run(capsys, "plan", *SMALL, "--gpu", "rtx-4090", "--json")
    assert code == 0
    data = json.loads(out)
    assert {"params", "trainable_params", "flops_per_step", "peak_bytes", "overhead_bytes", "activations_bytes",
            "max_batch", "breakdown", "gpus", "remedies", "uncosted"} <= set(data)
    assert {"weights", "gradients", "optimizer", "activations", "temporaries"} <= set(data["breakdown"])
    assert sum(data["breakdown"].values()) == data["peak_bytes"]
    assert data["params"] == MODELS["gpt2"].published_params
    (fit,) = data["gpus"]
    assert fit["gpu"] == "rtx-4090" and fit["fits"] and fit["max_batch"] == data["max_batch"] >= 2
    assert fit["required_bytes"] == data["peak_bytes"] + data["overhead_bytes"]
    # the step's modelled time (cost/step.py StepTime, recommend's), itemised, and the roofline bound beside it
    step = fit["step"]
    assert {"seconds", "phases_s", "families_s", "exposed_comm_s", "mfu", "bound_s", "basis", "error"} <= set(step)
    assert set(fit["phases_s"]) == {"forward", "backward", "optimizer", "communication", "bubble"}
    assert sum(fit["phases_s"].values()) == pytest.approx(fit["step_time_s"])
    assert fit["families_s"]["matmul"] > 0 and fit["step_time_error"] == step["error"] > 0
    assert fit["step_time_s"] == step["seconds"] and fit["step_time_bound_s"] == step["bound_s"] < step["seconds"]
    assert fit["rates"] == step["rates"] == "datasheet"


def test_plan_lists_every_catalog_gpu_by_default(capsys):
    _code, out, _ = run(capsys, "plan", *SMALL, "--json")
    assert [g["gpu"] for g in json.loads(out)["gpus"]] == [a.key for a in load_catalog()]


def test_plot_writes_a_png(capsys, tmp_path):
    target = tmp_path / "timeline.png"
    code, _, err = run(capsys, "plan", *SMALL, "--gpu", "h100", "--plot", str(target))
    assert code == 0, err
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.png"]  # no temporary left behind
    assert target.stat().st_mode & 0o044  # readable by others, as files written with open() are


def test_max_batch_is_the_edge_of_fitting(monkeypatch):
    """The largest micro-batch fits and one more does not, each checked by its own capture (without the remedies
    a plan that does not fit lists: not what is checked here)."""
    gpu = "rtx-3060-12gb"
    base = Setup(seq=512)
    best = plan_model("gpt2", base, gpu=gpu).max_batch
    assert best > 1
    monkeypatch.setattr(importlib.import_module("gpuwise.planning.planner"), "remedies", lambda *a, **k: ())
    assert plan_model("gpt2", Setup(seq=512, micro_batch=best), gpu=gpu).gpus[0].fits
    assert not plan_model("gpt2", Setup(seq=512, micro_batch=best + 1), gpu=gpu).gpus[0].fits


def test_remedies_in_order_with_flags(capsys):
    """Llama 2 7B in fp32 on a 24 GB card: every remedy of the chain, each needing less than the one before. The
    command is one test_remedies.py re-plans remedy by remedy (its llama2-7b-fp32 case): the session captures it
    once."""
    command = ["plan", "--model", "llama2-7b", "--seq", "2048", "--batch", "8", "--precision", "fp32", "--gpu",
               "rtx-4090", "--json"]
    code, out, _ = run(capsys, *command)
    data = json.loads(out)
    assert code == 0 and not data["gpus"][0]["fits"]
    names = [r["name"] for r in data["remedies"]]
    assert names[:2] == ["bf16 mixed precision", "activation checkpointing"]
    assert names[-2:] == ["LoRA rank 16, one GPU (fine-tuning only)", "QLoRA, 4-bit base, one GPU (fine-tuning only)"]
    needs = [data["gpus"][0]["required_bytes"]] + [r["required_bytes"] for r in data["remedies"][:3]]
    assert needs == sorted(needs, reverse=True) and needs[1] < needs[0]
    assert data["remedies"][1]["flags"] == "--precision bf16-mixed --checkpointing full"
    assert data["remedies"][-1]["flags"].startswith("--task finetune-lora --precision bf16-mixed")
    assert data["remedies"][-1]["flags"].endswith("--lora-rank 16 --qlora")
    # the flags are the whole change: adding them to the command gives the memory the remedy shows
    fsdp = next(r for r in data["remedies"] if r["name"].startswith("FSDP over"))
    assert fsdp["fits"] and "--sharding fsdp" in fsdp["flags"]
    code, out, _ = run(capsys, *command, *fsdp["flags"].split())
    again = json.loads(out)
    assert code == 0 and again["gpus"][0]["required_bytes"] == fsdp["required_bytes"] and again["gpus"][0]["fits"]


USER_MODEL = """
import torch
from torch import nn

def build(batch_size):
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    return model, torch.randn(batch_size, 64)

class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.cumprod(self.lin(x), dim=1)

def odd(batch_size):
    return Odd(), torch.randn(batch_size, 8)

def reads_values(batch_size):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) if x.sum().item() > 0 else x
    return M(), torch.randn(batch_size, 4)

def broken(batch_size):
    raise ValueError("no data for you")
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_net.py"
    path.write_text(textwrap.dedent(USER_MODEL))
    return path


def test_user_model_from_a_file(capsys, user_file):
    code, out, err = run(capsys, "plan", "--model", f"{user_file}:build", "--batch", "32", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["params"] == 64 * 256 + 256 + 256 * 10 + 10
    assert data["uncosted"] == {}


def test_an_op_without_a_formula_is_listed_as_uncosted(capsys, user_file):
    code, out, err = run(capsys, "plan", "--model", f"{user_file}:odd", "--json")
    assert code == 0, err
    assert "cumprod" in json.loads(out)["uncosted"]


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "gtp2"], "unknown model 'gtp2' (hint: did you mean gpt2"),
    (["--model", "{file}:nope"], "no function 'nope' (hint: functions there: Odd, broken, build, odd, reads_values)"),
    (["--model", "{file}:broken"], "my_net.py:broken(1) raised ValueError: no data for you"),
    (["--model", "{file}:reads_values"], "reads a tensor's value"),
    (["--model", "{file}"], "names a file but no function"),
    (["--model", "missing.py:f"], "no such file: missing.py"),
    (["--model", "gpt2", "--qlora"], "--qlora applies to LoRA fine-tuning (hint: add --task finetune-lora)"),
    (["--model", "gpt2", "--lora-rank", "8"], "--lora-rank applies to LoRA fine-tuning"),
    (["--model", "gpt2", "--sharding", "zero2"], "--sharding zero2 shards over GPUs but --gpus is 1"),
    (["--model", "gpt2", "--task", "infer", "--batch", "8", "--micro-batch", "2"],
     "--batch above --micro-batch (accumulation) has no meaning for --task infer"),
    (["--model", "gpt2", "--batch", "6", "--micro-batch", "4"], "--batch 6 does not split evenly"),
    (["--model", "gpt2", "--seq", "4096"], "--seq 4096 is longer than gpt2's 1024 learned positions"),
    (["--model", "resnet50", "--seq", "128"], "--seq does not apply to resnet50"),
    (["--model", "gpt2", "--batch", "0"], "--batch 0 is outside 1.."),
    (["--model", "gpt2", "--precision", "fp4"], "--precision 'fp4' is not one of"),
    (["--model", "gpt2", "--gpu", "h1000"], "h1000"),
    (["--model", "gpt2", "--plot", "out.jpg"], "the picture is a PNG"),
    (["--model", "gpt2", "--hf-config", "x.json"], "--model and --hf-config both name a model"),
    ([], "no model to plan"),
    (["--hf-config", "{dir}/nope.json"], "no such file"),
    (["--model", "gpt2", "--optimizer", "adam8bit"], "--optimizer 'adam8bit' is not one of adamw, sgd, adamw8bit"),
    (["--model", "gpt2", "--optimizer-in-backward", "--batch", "8", "--micro-batch", "2"],
     "--optimizer-in-backward steps every micro-batch, so it cannot accumulate 4 of them"),
    (["--model", "gpt2", "--optimizer-in-backward", "--gpus", "2", "--sharding", "fsdp"],
     "--optimizer-in-backward is planned on one GPU, not 2"),
    (["--model", "gpt2", "--task", "infer", "--optimizer-in-backward"],
     "--optimizer-in-backward has no meaning for --task infer"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, user_file, args, message):
    args = [a.replace("{file}", str(user_file)).replace("{dir}", str(user_file.parent)) for a in args]
    code, _out, err = run(capsys, "plan", *args)
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err


def test_hf_config(capsys, tmp_path):
    pytest.importorskip("transformers")
    cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, out, err = run(capsys, "plan", "--hf-config", str(path), "--seq", "64", "--json")
    assert code == 0, err
    data = json.loads(out)
    per_layer = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512 + 2 * 256  # q,o + k,v (2 of 4 heads) + MLP + norms
    assert data["params"] == 6 * per_layer + 2 * 1000 * 256 + 256


# --- regressions found in review -----------------------------------------------------------------


# ResNet-50 in fp32 on a T4 (no bf16), checkpointing already on: a short chain (mixed precision fits), with LoRA tried
# and left out. The two tests below read the same plan, the second from the session's captures.
RESNET_FP32_ON_T4 = ["plan", "--model", "resnet50", "--batch", "512", "--precision", "fp32", "--checkpointing", "full",
                     "--gpu", "t4", "--json"]


def test_remedies_skip_what_does_not_apply(capsys):
    """ResNet blocks have no nn.Linear: no LoRA remedy, and the plan still completes."""
    code, out, err = run(capsys, *RESNET_FP32_ON_T4)
    assert code == 0, err
    names = [r["name"] for r in json.loads(out)["remedies"]]
    assert names and not any("LoRA" in n for n in names)


def test_gpus_without_bf16_get_fp16(capsys):
    code, out, _ = run(capsys, *RESNET_FP32_ON_T4)
    assert code == 0
    assert json.loads(out)["remedies"][0]["flags"] == "--precision fp16-mixed"


def test_inference_uses_running_statistics_and_explains_a_misfit(capsys):
    code, _, err = run(capsys, "plan", "--model", "resnet50", "--task", "infer", "--image-size", "32")
    assert code == 0, err
    code, out, _ = run(capsys, "plan", "--model", "llama2-70b", "--task", "infer", "--seq", "256", "--gpu",
                       "rtx-4090")
    assert code == 0 and "does not fit rtx-4090 even at batch 1" in out


def test_fsdp_shards_the_frozen_lora_base():
    one = plan_model("llama2-7b", Setup(task="finetune-lora", seq=256), gpu="h100")
    two = plan_model("llama2-7b", Setup(task="finetune-lora", seq=256, gpus=4, sharding="fsdp"), gpu="h100")
    assert two.peak_bytes < one.peak_bytes
    assert two.timeline[:, 0].max() < one.timeline[:, 0].max() / 3  # weights column, 4-way sharded


ATTENTION_DROPOUT = """
from __future__ import annotations
from dataclasses import dataclass
import torch
import torch.nn.functional as F
from torch import nn

@dataclass
class Cfg:
    p: float

class Attn(nn.Module):
    def __init__(self, cfg: Cfg):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(64, 192)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.cfg.p, is_causal=True)

def with_dropout(batch_size):
    return Attn(Cfg(0.1)), torch.randn(batch_size, 1024, 64)

def without_dropout(batch_size):
    return Attn(Cfg(0.0)), torch.randn(batch_size, 1024, 64)
"""


def test_attention_dropout_keeps_the_flash_path(capsys, tmp_path):
    """CUDA flash attention drops out inside the kernel: no s x s matrix is saved (a dataclass in the file, too)."""
    path = tmp_path / "attn.py"
    path.write_text(ATTENTION_DROPOUT)
    peaks = []
    for fn in ("with_dropout", "without_dropout"):
        code, out, err = run(capsys, "plan", "--model", f"{path}:{fn}", "--batch", "4", "--json")
        assert code == 0, err
        peaks.append(json.loads(out)["peak_bytes"])
    assert peaks[0] == peaks[1]


def test_optimizer_means_nothing_for_inference(capsys):
    code, _, err = run(capsys, "plan", "--model", "gpt2", "--task", "infer", "--optimizer", "sgd")
    assert code == 2 and "--optimizer has no meaning for --task infer" in err


def test_hf_config_dtype_and_layer_types(capsys, tmp_path):
    pytest.importorskip("transformers")
    cfg = {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 500,
           "max_position_embeddings": 256, "layer_types": ["full_attention"] * 4}
    peaks = []
    for extra in ({}, {"torch_dtype": "bfloat16"}):
        path = tmp_path / "config.json"
        path.write_text(json.dumps({**cfg, **extra}))
        code, out, err = run(capsys, "plan", "--hf-config", str(path), "--seq", "64", "--json")
        assert code == 0, err
        peaks.append(json.loads(out)["peak_bytes"])
    assert peaks[0] == peaks[1]  # the setup's precision decides, not the config's dtype
    code, _, err = run(capsys, "plan", "--hf-config", str(path), "--seq", "512")
    assert code == 2 and "longer than the config's 256 positions" in err


def test_remedies_default_to_this_machines_gpu(capsys, monkeypatch):
    from conftest import cuda_env, gpu, nvml
    from gpuwise import environment
    from gpuwise.units import GiB

    name = "NVIDIA GeForce RTX 4090"
    env = cuda_env(name=name, cc=(8, 9), torch_changes={"devices": (gpu(name, (8, 9), memory=24 * GiB),)},
                   nvml_devices=(nvml(name, (8, 9), memory=24 * GiB),))
    monkeypatch.setattr(environment, "gather_environment", lambda environ: env)
    code, out, _ = run(capsys, "plan", *SMALL, "--json")
    data = json.loads(out)
    assert code == 0 and data["gpu"] == "rtx-4090"
    assert len(data["gpus"]) == len(load_catalog())
    assert data["max_batch"] == next(g["max_batch"] for g in data["gpus"] if g["gpu"] == "rtx-4090")


def test_hf_config_builds_the_architecture_it_names(capsys, tmp_path):
    """A BertForSequenceClassification config gives HF's own BERT-large: the same count as our zoo's."""
    pytest.importorskip("transformers")
    cfg = {"architectures": ["BertForSequenceClassification"], "model_type": "bert", "hidden_size": 1024,
           "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096, "vocab_size": 30522,
           "max_position_embeddings": 512, "type_vocab_size": 2}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, out, err = run(capsys, "plan", "--hf-config", str(path), "--seq", "64", "--json")
    assert code == 0, err
    assert json.loads(out)["params"] == MODELS["bert-large"].published_params


TORCH_TRANSFORMER = """
import torch
from torch import nn

def encoder(batch_size, dropout=0.1):
    layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=dropout, batch_first=True)
    return nn.TransformerEncoder(layer, 2), torch.randn(batch_size, 512, 128)

def encoder_no_dropout(batch_size):
    return encoder(batch_size, dropout=0.0)

def converts(batch_size):
    return nn.Linear(256, 256).to(torch.bfloat16), torch.randn(batch_size, 256)
"""


def test_multihead_attention_dropout_stays_in_the_kernel(capsys, tmp_path):
    """nn.MultiheadAttention calls SDPA from inside F.multi_head_attention_forward: its dropout must not bring
    back the s x s matrix (2 layers x 4 x 4 heads x 512^2 x 4 B = 32 MiB per matrix kept)."""
    path = tmp_path / "enc.py"
    path.write_text(TORCH_TRANSFORMER)
    peaks = {}
    for fn in ("encoder", "encoder_no_dropout"):
        code, out, err = run(capsys, "plan", "--model", f"{path}:{fn}", "--batch", "4", "--gpu", "h100", "--json")
        assert code == 0, err
        peaks[fn] = json.loads(out)["peak_bytes"]
    assert peaks["encoder"] - peaks["encoder_no_dropout"] < 4 * 4 * 512 * 512 * 4  # less than one s x s matrix
    code, out, err = run(capsys, "plan", "--model", f"{path}:encoder", "--task", "finetune-lora", "--json")
    assert code == 0, err
    assert json.loads(out)["trainable_params"] == 2 * 16 * ((128 + 512) + (512 + 128))  # the MLPs, not MHA


def test_a_model_the_function_converts_is_planned_as_converted(capsys, tmp_path):
    """nn.Linear(256, 256).to(torch.bfloat16): its weights in 2 bytes each, whatever --precision builds in (fake
    parameters refused the swap or not depending on the fake mode's caches: a one-line refusal, or not, by the
    order of the tests)."""
    path = tmp_path / "enc.py"
    path.write_text(TORCH_TRANSFORMER)
    for precision in ("fp32", "bf16-mixed"):
        code, out, err = run(capsys, "plan", "--model", f"{path}:converts", "--task", "infer", "--precision",
                             precision, "--json")
        assert code == 0, err
        assert json.loads(out)["breakdown"]["weights"] == (256 * 256 + 256) * 2  # multiples of 512 B: no rounding


def test_plot_to_a_folder_is_a_one_line_error_after_the_plan(capsys, tmp_path):
    (tmp_path / "timeline.png").mkdir()
    code, out, err = run(capsys, "plan", *SMALL, "--gpu", "h100", "--plot", str(tmp_path / "timeline.png"))
    assert code == 2 and "it is a folder" in err and err.count("\n") == 1, err
    assert "gpuwise plan" in out  # the plan was shown before the picture failed


def test_optimizer_in_backward_drops_the_remedies_it_cannot_take(capsys):
    """It cannot accumulate and is planned on one GPU: no accumulation or FSDP rows; the ones left run as printed."""
    code, out, err = run(capsys, "plan", "--model", "gpt2", "--batch", "64", "--gpu", "t4", "--precision", "fp32",
                         "--optimizer", "adafactor", "--optimizer-in-backward", "--json")
    assert code == 0, err
    data = json.loads(out)
    names = [r["name"] for r in data["remedies"]]
    assert names and not any(n.startswith(("micro-batch", "FSDP")) for n in names)
    assert "adafactor in backward" in Setup(optimizer="adafactor", optimizer_in_backward=True).describe()
