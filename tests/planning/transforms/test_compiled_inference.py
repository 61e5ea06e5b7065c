"""``plan --task infer --compile`` (compiled.py): each block's inference forward as AOTAutograd traces it without
grad (one graph, no partition) and inductor fuses it. Independent checks: the traced graphs run on real tensors give
eager's logits; the storages the capture counts as never allocated are exactly those ``fused_away`` reads off each
block's graph; fusion changes the bytes a block materialises, never the FLOPs."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

import gpuwise.planning.transforms.compiled as compiled
from gpuwise.models import get_model
from gpuwise.models.llama import Llama, LlamaConfig
from gpuwise.planning.capture.step import capture
from gpuwise.planning.capture.tracker import CATEGORIES
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.zoo import ZooSource

B, S, VOCAB = 2, 64, 97
CFG = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, dim=128, ffn_dim=256, vocab_size=VOCAB)
TINY = ZooSource(zoo=replace(get_model("llama3-8b"), config=CFG, default_seq=S))
TEMP = CATEGORIES.index("temporaries")


def _capture(**kw):
    return capture(TINY, Setup(task="infer", micro_batch=B, seq=S, **kw), batch=B, n_layer=CFG.n_layer)


@pytest.fixture(scope="module", autouse=True)
def _own_traces():
    """The traces shared between captures (compiled._TRACES) start and end empty: other files look theirs up."""
    compiled._TRACES.clear()
    yield
    compiled._TRACES.clear()


@pytest.fixture(scope="module")
def captures():
    return _capture(), _capture(compile=True)


def _block_temporaries(c) -> int:
    inside = np.array([block is not None and block >= 0 for _, block in c.labels])
    return int(c.live[inside, TEMP].max())


def test_a_compiled_prefill_fuses_its_blocks_with_the_same_flops(captures):
    eager, comp = captures
    assert comp.flops_per_step == eager.flops_per_step
    graphs = [fn.graphs for key, fn in compiled._TRACES.items() if "task='infer'" in key[0][3]]
    assert len(graphs) == 1 and len(graphs[0]) == 1  # one trace shared by both blocks: a forward, no backward
    fused = compiled.fused_away(graphs[0][0].graph)
    assert fused and int((comp.storages.nbytes == 0).sum()) == CFG.n_layer * len(fused)
    assert not (eager.storages.nbytes == 0).any()
    assert _block_temporaries(comp) < _block_temporaries(eager)


def test_traced_inference_graphs_run_for_real_as_eager_does():
    torch.manual_seed(0)
    model = Llama(CFG).eval()
    twin = copy.deepcopy(model)
    compiled.apply_compile(twin.blocks, context="real fp32 inference")
    idx = torch.randint(0, VOCAB, (B, 16))
    with torch.no_grad():
        torch.testing.assert_close(twin(idx), model(idx))
