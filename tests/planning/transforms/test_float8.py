"""``--precision fp8``: float8 training as torchao runs it (pytorch/ao torchao/float8/float8_linear.py,
``matmul_with_hp_or_float8_args``, default recipe: tensorwise dynamic scaling), simulated on fake tensors.

By torchao's code: forward saves the high-precision input and weight (``ctx.save_for_backward(input_hp,
weight_hp_t)``) and casts both to e4m3 for ``_scaled_mm``; backward casts the output gradient to e5m2 and the weight
to e4m3 for the input gradient, then the gradient and the input again, transposed, for the weight gradient. So
backward keeps bf16 activations, and the fp8 copies are temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from torch import nn

from conftest import run_cli
from gpuwise.compat import FakeTensorMode
from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import load_catalog
from gpuwise.models import get_model
from gpuwise.models.llama import LlamaConfig
from gpuwise.planning import plan_model
from gpuwise.planning.capture.step import capture
from gpuwise.planning.capture.tracker import CATEGORIES, KINDS, Tracker
from gpuwise.planning.cost.roofline import roofline_bound
from gpuwise.planning.planner import Planner
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.base import Built
from gpuwise.planning.sources.resolve import resolve_source
from gpuwise.planning.sources.zoo import ZooSource
from gpuwise.planning.transforms.float8 import _Float8Matmul
from gpuwise.training.config import TrainConfig
from gpuwise.training.parallelize import parallelize
from gpuwise.training.trainer import CPU
from gpuwise.units import GiB

SCALARS = 8 * 512  # the fp32 scales and amaxes, each a 512-byte allocator block


def test_matmul_temporaries_by_hand():
    """One fp8 linear (x: M x K bf16, w: N x K fp32 master) on fake tensors: forward adds x8, w8 (1 byte each) and
    the bf16 output; backward's peak is the weight gradient in bf16 and its fp32 copy for the master, with the input
    gradient alive (after the fp8 copies of the gradient-input phase are freed)."""
    m, k, n = 512, 256, 1024
    with FakeTensorMode():
        x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, k, requires_grad=True)
        g = torch.randn(m, n, dtype=torch.bfloat16)
        tracker = Tracker()
        tracker.tag([x, w, g], "inputs")
        with tracker:
            y = _Float8Matmul.apply(x, w, torch.bfloat16)
            tracker.mark("forward")
            y.backward(g)
        live = tracker.timeline().sum(axis=1)
    held = m * k * 2 + n * k * 4 + m * n * 2  # x, w, g
    fwd = live[:tracker.marks["forward"] + 1].max() - held
    assert 0 <= fwd - (m * k + n * k + m * n * 2) <= SCALARS
    y_bytes = m * n * 2  # y stays alive through backward here
    grad_input_phase = m * n + n * k + m * k * 2  # g8, w8 (column-major), grad_x
    grad_weight_phase = m * k * 2 + m * n + m * k + n * k * 2  # grad_x, g^T8, x8 (column-major), grad_w bf16
    to_master = m * k * 2 + n * k * 2 + n * k * 4  # grad_x, grad_w bf16 and its fp32 copy for the fp32 weight
    bwd = live[tracker.marks["forward"] + 1:].max() - held - y_bytes
    assert 0 <= bwd - max(grad_input_phase, grad_weight_phase, to_master) <= SCALARS


H, S, B = 256, 128, 2


class Linears(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@dataclass(frozen=True)
class LinearsSource:
    name: str = "linears"
    n_layer: int | None = None

    def check(self, setup: Setup) -> None:
        pass

    def tokens(self, setup: Setup) -> int:
        return S

    def build(self, setup: Setup, batch: int, n_layer: int | None) -> Built:
        x = torch.randn(batch, S, H, requires_grad=True)
        return Built(model=Linears(n_layer or 1), inputs=(x,), targets=None,
                     run=lambda m, inputs, targets, kv: m(*inputs).float().square().mean())


def _per_layer_activations(precision: str) -> int:
    act = CATEGORIES.index("activations")
    per = []
    for n in (1, 2):
        c = capture(LinearsSource(), Setup(precision=precision, optimizer="sgd"), batch=B, n_layer=n)
        per.append(int(c.live[c.end_of_forward, act]))
    return per[1] - per[0]


def test_saved_activations_stay_bf16():
    """One more fp8 linear keeps its bf16 input (b*s*h*2 bytes), as torchao saves ``input_hp``; under bf16 autocast a
    plain linear also keeps the bf16 copy of its fp32 weight (autocast's cast), which torchao does not make: it keeps
    the fp32 master and casts it straight to fp8."""
    assert _per_layer_activations("fp8") == B * S * H * 2
    assert _per_layer_activations("bf16-mixed") == B * S * H * 2 + H * H * 2


CFG = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, dim=128, ffn_dim=256, vocab_size=97)
TINY = ZooSource(zoo=replace(get_model("llama3-8b"), config=CFG, default_seq=64))


def test_fp8_flops_are_the_block_linears():
    """The fp8 GEMMs are every linear layer of the blocks, 6 FLOPs per weight per token (2 forward, 4 backward); the
    head (and attention) stay in bf16, as torchtitan converts."""
    c = capture(TINY, Setup(precision="fp8", optimizer="sgd", micro_batch=2, seq=64), batch=2)
    kv = CFG.n_kv_head * CFG.dim // CFG.n_head
    linear_params = CFG.n_layer * (2 * CFG.dim * CFG.dim + 2 * CFG.dim * kv + 3 * CFG.dim * CFG.ffn_dim)
    fp8 = c.costs.kind == KINDS.index("matmul-fp8")
    assert c.costs.flops[fp8] @ c.costs.count[fp8] == 6 * linear_params * 2 * 64
    mm = c.costs.kind == KINDS.index("matmul")
    assert c.costs.flops[mm] @ c.costs.count[mm] == 6 * CFG.dim * CFG.vocab_size * 2 * 64  # the head


def test_fit_needs_fp8_tensor_cores_and_the_floor_uses_the_fp8_rate():
    """A GPU without fp8 (A100) cannot run it; on an H100 the floor's compute is the fp8 GEMMs at the fp8 peak and
    every other FLOP (attention, the head) at the bf16 peak, against the bytes over the bandwidth."""
    setup = Setup(precision="fp8", micro_batch=4, seq=512)
    fits = {f.gpu: f for f in plan_model("gpt2", setup).gpus}
    assert fits["a100-80gb-sxm"].status == "no" and fits["a100-80gb-sxm"].step_time_bound_s is None
    assert fits["h100-sxm"].status == "fits"
    step = Planner(resolve_source("gpt2", None)).per_gpu(setup)
    h100 = load_catalog().get("h100-sxm")
    c = step.workload.costs
    fp8 = c.kind == KINDS.index("matmul-fp8")
    fp8_flops = c.flops[fp8] @ c.count[fp8]
    assert fp8_flops == 6 * 2048 * 12 * (768 * 3 * 768 + 768 * 768 + 2 * 768 * 3072)  # the blocks' linear layers
    compute = (fp8_flops / h100.peak_tflops.fp8 + (step.workload.flops_per_step - fp8_flops)
               / h100.peak_tflops.bf16) / 1e12
    memory = step.workload.bytes_per_step / (h100.memory_bandwidth_gbps * 1e9)
    assert roofline_bound(step, h100).seconds == pytest.approx(max(compute, memory))
    assert fits["h100-sxm"].step_time_bound_s == pytest.approx(max(compute, memory))


def test_torchtitan_llama3_8b_float8_anchor():
    """torchtitan docs/performance.md (Dec 2024): Llama 3.1 8B, 8x H100, FSDP, local batch 2, seq 8192, selective AC,
    +compile +Float8: 76.8 GiB max reserved. The plan has no compile (inductor's fusions), and the torchao of the time
    saved fp8 (not bf16) inputs: reported, with a wide band, not tuned."""
    setup = Setup(micro_batch=2, seq=8192, gpus=8, sharding="fsdp", checkpointing="selective", precision="fp8")
    fit = plan_model("llama3-8b", setup, gpu="h100-sxm").gpus[0]
    ratio = fit.required_bytes / (76.8 * GiB)
    print(f"\nllama3-8b FSDP 8 x bs 2 x 8192, selective, fp8: plan {fit.required_bytes / GiB:.1f} GiB, torchtitan "
          f"76.8 GiB reserved (+compile), ratio {ratio:.3f}")
    assert 0.6 < ratio < 1.2


def test_trainer_refuses_fp8_without_the_hardware_or_torchao():
    with pytest.raises(GpuwiseError, match="needs a GPU with fp8 tensor cores"):
        TrainConfig(precision="fp8").for_device(CPU)
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        model = nn.Sequential(nn.Linear(16, 16))
        with pytest.raises(GpuwiseError, match="torchao is not installed"):
            parallelize(model, torch.optim.SGD(model.parameters()), TrainConfig(precision="fp8"),
                        device=torch.device("cpu"), world_size=1)


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "gpt2", "--precision", "fp8", "--gpu", "a100-80gb-sxm"], "needs fp8 tensor cores"),
    (["--model", "gpt2", "--precision", "fp8", "--task", "infer"], "--precision fp8 is float8 training"),
    (["--model", "gpt2", "--precision", "fp8", "--task", "finetune-lora"], "--precision fp8 is float8 training"),
])
def test_bad_combinations_are_one_line(capsys, args, message):
    code, _, err = run_cli(capsys, "plan", *args)
    assert code == 2 and message in err and err.count("\n") == 1 and err.startswith("error: "), err
