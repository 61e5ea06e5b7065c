"""Switch Transformer (transformers' SwitchTransformersForConditionalGeneration) from the Hub's published config.json
of google/switch-base-8 (tests/data/switch-base-8-config.json: the file as of its last config change, commit a0c955b,
router_jitter_noise 0; Apache-2.0). Its router converts its classifier to fp32 inside forward and picks experts with
argmax, and its expert loop reads which experts were hit (sources/hf_build.py's ``top1_routers``); the plan captures
it under the balanced routing stand-in.

Independent references: the parameter count the Hub publishes for the checkpoint (619M: the model page's
safetensors figure, and pytorch_model.bin's 1.24 GB of bf16), which the count from the config's dimensions below
reproduces exactly; and the step's FLOPs counted by hand from the same dimensions (2 FLOPs a multiply-add, one expert
a token: Fedus et al. 2021, arXiv:2101.03961, sec. 2.1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuwise.planning.capture.routing import ASSUMPTION
from gpuwise.planning.capture.step import capture
from gpuwise.planning.capture.tracker import CATEGORIES
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.hf import HFSource

CONFIG = Path(__file__).parents[2] / "data" / "switch-base-8-config.json"
C = json.loads(CONFIG.read_text())
D, FF, E, V, HEADS = C["d_model"], C["d_ff"], C["num_experts"], C["vocab_size"], C["num_heads"]
LAYERS, SPARSE = C["num_layers"], C["num_sparse_encoder_layers"]  # 12 blocks a stack, every 2nd sparse
ATTN, FFN, ROUTER = 4 * D * D, 2 * D * FF, D * E  # q, k, v, o; wi, wo (no biases, no gate); the router's classifier
BIAS = C["relative_attention_num_buckets"] * HEADS  # the first block's relative position bias, a stack
B, SEQ = 2, 128  # SEQ / E = 16 tokens an expert a sequence: under expert_capacity (64), none dropped


def _params() -> int:
    """The model's parameters from the config: two stacks of 12 blocks, 6 of them with 8 experts and a router, the
    shared embedding (the LM head tied to it, as T5's), one norm a sublayer and one at each stack's end."""
    ffn = (LAYERS - SPARSE) * FFN + SPARSE * (E * FFN + ROUTER)
    encoder = LAYERS * (ATTN + 2 * D) + ffn + BIAS + D
    decoder = LAYERS * (2 * ATTN + 3 * D) + ffn + BIAS + D
    return encoder + decoder + V * D


def _infer_flops(tokens: int, seq: int) -> int:
    """One forward over ``tokens`` encoder and as many decoder tokens: each linear layer's 2 x params a token (one
    expert and the router in a sparse block), the LM head, and eager attention's QK^T and PV over every pair of
    positions (the decoder's causal mask hides scores it still computes): 4 x s^2 x d_model a sequence per layer."""
    ffn = (LAYERS - SPARSE) * FFN + SPARSE * (FFN + ROUTER)
    matmuls = LAYERS * ATTN + ffn + LAYERS * 2 * ATTN + ffn + V * D  # encoder; decoder with cross-attention; head
    attention = 3 * LAYERS * 4 * (tokens // seq) * seq * seq * D  # encoder self, decoder self and cross
    return 2 * matmuls * tokens + attention


@pytest.fixture(scope="module")
def source() -> HFSource:
    return HFSource.from_path(CONFIG)


def test_switch_base_8_captures_with_the_published_parameter_count(source):
    """An inference step in bf16: every weight in bf16 but the routers' classifiers, which transformers converts to
    router_dtype (fp32) on the first forward and which stay so; each storage rounded to the allocator's 512 bytes
    (the two 32 x 12 relative-bias tables, 768 bytes each, to 1024)."""
    c = capture(source, Setup(task="infer", micro_batch=B, seq=SEQ), batch=B)
    assert c.params == _params() == 619_339_008
    assert c.params == pytest.approx(619e6, rel=1e-3)  # the Hub's "619M params"
    assert c.flops_per_step == _infer_flops(B * SEQ, SEQ)
    assert c.routing == ASSUMPTION
    routers = 2 * SPARSE * ROUTER
    assert c.live[0, CATEGORIES.index("weights")] == 2 * (_params() - routers - 2 * BIAS) + 4 * routers + 2 * 1024


@pytest.mark.slow
def test_a_switch_training_step_costs_three_forwards(source):
    """Backward is twice the forward for every matmul (input and weight gradients): 3x the forward in all."""
    c = capture(source, Setup(micro_batch=B, seq=SEQ), batch=B)
    assert c.flops_per_step == 3 * _infer_flops(B * SEQ, SEQ)
    assert c.trainable_params == _params()

