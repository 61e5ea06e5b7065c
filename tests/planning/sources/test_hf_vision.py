"""Hugging Face vision models planned (issue 17): constructors that read tensor values (sources/hf_build.py), images
made from the config (sources/hf_inputs.py), and a planned peak against PyTorch's MemTracker on a real CPU step."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import run_cli
from gpuwise.compat import FakeTensor, FakeTensorMode
from gpuwise.planning.capture.autocast import CudaEmulation
from gpuwise.planning.sources.hf_build import concrete_constants


class DropPathNet(nn.Module):
    """As ConvNeXt's, Swin's and BiT's constructors: drop-path rates read off torch.linspace (or NumPy's), a position
    buffer."""

    def __init__(self, depth: int = 4, width: int = 16):
        super().__init__()
        self.rates = [x.item() for x in torch.linspace(0, 0.1, depth)]
        self.stage_rates = [x.tolist() for x in torch.Tensor(np.linspace(0, 0.1, depth)).split([1, depth - 1])]  # BiT
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.scale = nn.Parameter(torch.tensor([1.0, 2.0]))  # a parameter from a Python list
        self.register_buffer("positions", torch.arange(width).expand(1, -1), persistent=False)


def _build(context) -> DropPathNet:
    with context:
        with concrete_constants() as unreal:
            model = DropPathNet()
        unreal(model)
    return model


@pytest.mark.parametrize("where", ["fake", "meta"])
def test_constants_are_real_while_building_and_the_model_is_not(where):
    context = FakeTensorMode(allow_non_fake_inputs=True) if where == "fake" else torch.device("meta")
    model = _build(context)
    real = DropPathNet()
    assert model.rates == pytest.approx(real.rates) and model.stage_rates[1] == pytest.approx(real.stage_rates[1])
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in real.parameters())
    for t in [*model.parameters(), *model.buffers()]:
        assert isinstance(t, FakeTensor) if where == "fake" else t.is_meta
    assert isinstance(model.scale, nn.Parameter) and model.scale.requires_grad
    assert model.positions.shape == (1, 16) and model.positions.dtype == torch.long


def test_a_real_build_is_left_alone():
    model = _build(torch.device("cpu"))
    assert torch.equal(model.scale, torch.tensor([1.0, 2.0])) and model.positions[0, 3].item() == 3


class ConvertingNet(nn.Module):
    """As DeepSeek-V4's and HY-V4's constructors (``RMSNorm(...).to(dtype=torch.float32)``), Inkling's ``Conv1d``: a
    submodule converted while the model is built."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8).to(dtype=torch.float32)
        self.low = nn.Linear(8, 8).to(torch.bfloat16)
        self.low.weight.requires_grad_(False)


def test_a_constructor_that_converts_a_submodule_builds_on_fake_tensors():
    # swap_tensors refuses a fake parameter the fake mode holds a weak reference to ("Couldn't swap LayerNorm.weight")
    with FakeTensorMode(allow_non_fake_inputs=True):
        with concrete_constants() as unreal:
            model = ConvertingNet()
        unreal(model)
    assert (model.norm.weight.dtype, model.low.weight.dtype, model.low.bias.dtype) == (
        torch.float32, torch.bfloat16, torch.bfloat16)
    assert all(isinstance(p, nn.Parameter) and isinstance(p, FakeTensor) for p in model.parameters())
    assert not model.low.weight.requires_grad and model.low.bias.requires_grad
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ConvertingNet().parameters())


def test_einsum_casts_as_the_bmm_under_it_does():
    # CUDA autocast casts the bmm an einsum becomes, below the Python API: an fp32 buffer against bf16 activations
    # (ProphetNet's relative positions, CvT's einsum of a list) runs in bf16 there, and failed the fake bmm's check
    with FakeTensorMode(allow_non_fake_inputs=True), CudaEmulation(torch.bfloat16):
        x = torch.randn(2, 4, 8, dtype=torch.bfloat16)
        buffer = torch.randn(2, 8, 3)
        assert torch.einsum("bij,bjk->bik", x, buffer).dtype == torch.bfloat16
        assert torch.einsum("bij,bjk->bik", [x, buffer]).shape == (2, 4, 3)
        assert torch.tensordot(buffer, x, dims=([1], [2])).dtype == torch.bfloat16
        assert torch.einsum("bjk->bkj", buffer).dtype == torch.float32  # one operand: no matmul, no cast
        # nothing summed between the operands (an outer product, rotary tables): ATen multiplies, autocast leaves the
        # mul alone and the result is promoted to fp32
        assert torch.einsum("i,j->ij", x[0, 0], buffer[0, :, 0]).dtype == torch.float32
        assert torch.einsum("bi,bi->b", x[:, 0], buffer[:, :, 0]).dtype == torch.bfloat16  # a dot: bmm, cast
        assert torch.tensordot(buffer[0, 0], x[0, 0], dims=0).dtype == torch.bfloat16  # an mm even so: cast


# --- the CLI on image configs -----------------------------------------------------------------------------------

CONVNEXT = {"model_type": "convnext", "architectures": ["ConvNextForImageClassification"], "hidden_sizes": [16, 32],
            "depths": [1, 1], "num_stages": 2, "image_size": 32, "num_labels": 10}


def _config(tmp_path: Path, cfg: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_image_size_scales_a_convnets_flops(capsys, tmp_path):
    """Convolutions cost in proportion to the pixels: 64 px is 4x the FLOPs of 32 px, less the classifier head's
    share (a reference from the arithmetic, not from the planner)."""
    pytest.importorskip("transformers")
    path = _config(tmp_path, CONVNEXT)
    flops = {}
    for size in (32, 64):
        code, out, err = run_cli(capsys, "plan", "--hf-config", path, "--image-size", str(size), "--batch", "2",
                                 "--json")
        assert code == 0, err
        flops[size] = json.loads(out)["flops_per_step"]
    assert 3.8 < flops[64] / flops[32] <= 4.0


def test_image_size_interpolates_a_vits_positions(capsys, tmp_path):
    """A ViT trained at 32 px planned at 64 px: transformers interpolates its learned positions
    (interpolate_pos_encoding), so it runs, with the same parameters, on 64 + 1 tokens instead of 16 + 1: the
    linear layers' FLOPs (most of them at this width) grow 65/17 = 3.8x, attention's more, the head's not at all."""
    pytest.importorskip("transformers")
    vit = {"model_type": "vit", "architectures": ["ViTForImageClassification"], "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "image_size": 32}
    path = _config(tmp_path, vit)
    plans = []
    for size in ("32", "64"):
        code, out, err = run_cli(capsys, "plan", "--hf-config", path, "--image-size", size, "--batch", "2", "--json")
        assert code == 0, err
        plans.append(json.loads(out))
    assert plans[0]["params"] == plans[1]["params"]
    assert 3.5 < plans[1]["flops_per_step"] / plans[0]["flops_per_step"] < 5


@pytest.mark.parametrize(("cfg", "flag", "fix"), [
    (CONVNEXT, ["--seq", "128"], "--image-size"),
    ({"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 1000}, ["--image-size", "64"], "--seq"),
])
def test_the_wrong_size_flag_is_one_line(capsys, tmp_path, cfg, flag, fix):
    pytest.importorskip("transformers")
    code, out, err = run_cli(capsys, "plan", "--hf-config", _config(tmp_path, cfg), *flag)
    assert code == 2 and not out
    assert err.startswith("error: ") and fix in err and "Traceback" not in err
    assert err.count("\n") == 1, err


# --- the planned peak against MemTracker ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep():
    transformers = pytest.importorskip("transformers")
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "hf_sweep.py"
    spec = importlib.util.spec_from_file_location("hf_sweep", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    transformers.logging.set_verbosity_error()
    return module


def test_vit_peak_against_memtracker(sweep):
    """The fp32 training step of a small ViT (2 layers, width 64, 32 px, batch 2) run for real on the CPU under
    PyTorch's MemTracker, against the plan of the same config on fake tensors (1.02x when written)."""
    check = sweep.memtracker_check("image-cls", "vit")
    assert check["measured"] and check["planned"], check
    assert 0.95 < check["ratio"] < 1.15, check


def test_an_image_smaller_than_a_patch_is_the_users_mistake(capsys, tmp_path):
    """It failed on fake tensors as 'an op's fake-tensor rule failed: report it', blaming gpuwise."""
    pytest.importorskip("transformers")
    cfg = {"model_type": "vit", "architectures": ["ViTForImageClassification"], "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "image_size": 32,
           "patch_size": 8, "num_labels": 10}
    code, out, err = run_cli(capsys, "plan", "--hf-config", _config(tmp_path, cfg), "--image-size", "7")
    assert code == 2 and not out and err.count("\n") == 1
    assert "--image-size 7 is smaller than one 8 x 8 patch" in err and "--image-size 8" in err
