"""A Mixture of Experts' decode step reads the experts its batch touches (issue 17): ``gpuwise plan --task decode``
counts every weight the capture holds but the embedding rows no sequence looks up and, of the routed experts, the
share no token picks under uniform routing, ``(1 - k/E)^B``; checked against a hand count of the experts of the
model transformers builds."""

from __future__ import annotations

import json

import pytest
import torch

from gpuwise.planning import Setup
from gpuwise.planning.plan import Planner
from gpuwise.planning.serving import DecodeRead
from gpuwise.planning.source import HFSource
from gpuwise.planning.tracker import CATEGORIES

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
    # the experts' bytes are taken as their parameters' share of the weights' bytes, which also hold a few
    # constants (rotary frequencies): within 1%
    assert DecodeRead.of(step).weight_bytes == pytest.approx(hand, rel=1e-2)
    assert held - DecodeRead.of(step).weight_bytes > bf16 * (V - batch) * H  # some experts are not read
