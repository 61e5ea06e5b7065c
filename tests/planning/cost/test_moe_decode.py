"""A Mixture of Experts' decode step reads the experts its batch touches (issue 17): ``gpuwise plan --task decode``
counts every weight the capture holds but the embedding rows no sequence looks up and, of the routed experts, the
share no token picks under uniform routing, ``(1 - k/E)^B``; checked against a hand count of the experts of the
model transformers builds."""

from __future__ import annotations

import json

import pytest
import torch

from gpuwise.planning import Setup
from gpuwise.planning.capture.tracker import CATEGORIES
from gpuwise.planning.cost.serving import DecodeRead
from gpuwise.planning.planner import Planner
from gpuwise.planning.sources.hf import HFSource

H, FFN, E, K, V, LAYERS = 64, 128, 4, 2, 1000, 2
MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": V, "hidden_size": H,
           "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_local_experts": E, "num_experts_per_tok": K, "tie_word_embeddings": False}


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_reads_the_experts_touched(tmp_path, batch):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "mixtral.json"
    path.write_text(json.dumps(MIXTRAL))
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(transformers.AutoConfig.for_model(**MIXTRAL))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == LAYERS * E * 3 * H * FFN  # gate, up and down of each expert
    step = Planner(HFSource.from_path(path)).per_gpu(
        Setup.for_batch(batch=batch, task="decode", context=16, precision="bf16"), batch_model=True)
    held = int(step.live[step.timeline.end_of_forward, CATEGORIES.index("weights")])
    bf16 = 2
    untouched = (1 - K / E) ** batch  # an expert missed by all B tokens
    hand = held - bf16 * (V - batch) * H - bf16 * experts * untouched  # the head is read whole, B embedding rows
    assert DecodeRead.of(step).weight_bytes == pytest.approx(hand, abs=1)


def test_decode_reads_quantised_experts_by_their_bytes(tmp_path):
    """--weights int4: the fused experts held as AWQ packs them (vLLM's fused MoE), the embeddings and head in
    bf16: the experts no token picks are that many int4 bytes, not their share of the parameters (27% off)."""
    from gpuwise.planning.transforms.quantize import FORMATS

    path = tmp_path / "mixtral.json"
    path.write_text(json.dumps(MIXTRAL))
    step = Planner(HFSource.from_path(path)).per_gpu(
        Setup.for_batch(batch=1, task="decode", context=16, precision="bf16", weights="int4"), batch_model=True)
    held = int(step.live[step.timeline.end_of_forward, CATEGORIES.index("weights")])
    awq = FORMATS["int4"]
    # each expert's gate/up (2 ffn x h) and down (h x ffn) matrices, packed per expert
    packed = LAYERS * E * (awq.nbytes(2 * FFN, H) + awq.nbytes(H, FFN))
    unread = held - DecodeRead.of(step).weight_bytes - 2 * (V - 1) * H
    # the format's bytes a weight at a 4096 x 4096 layer's grouping against these small matrices' own: within 5%
    assert unread == pytest.approx(packed * (1 - K / E), rel=0.05)
