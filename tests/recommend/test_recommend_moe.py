"""gpuwise recommend on a Mixture of Experts (issue 17): a decode step reads the experts its batch touches (the active
weights at batch 1, nearly all at a large batch: serving.moe_weights_read), training costs the routed tokens' FLOPs
(the captured step's, about 6 x N_active a token), and the output says which model it is and what it assumes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpuwise.hardware.catalog import load_catalog
from gpuwise.planning.cost.serving import UNIFORM_ROUTING, experts_touched, moe_weights_read

DATA = Path(__file__).resolve().parents[1] / "data"
CATALOG = load_catalog()


@pytest.fixture(scope="module")
def mixtral():
    """The Mixtral 8x7B source (its meta-device build, once for the module: ~3 s) and its experts."""
    pytest.importorskip("transformers")
    from gpuwise.planning.sources.hf import HFSource

    source = HFSource.from_path(DATA / "mixtral-8x7b-config.json")
    return source, source.experts


@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (256, 8), (64, 6)])
def test_experts_touched_is_the_expectation_of_uniform_routing(experts, top_k):
    # each token draws top_k distinct experts of E uniformly, independently of the others; count the distinct
    # experts a batch hits, 2000 draws a batch: the mean within 3 standard errors of E (1 - (1 - k/E)^B)
    rng = np.random.default_rng(0)
    n = 2000
    for batch in (1, 4, 16, 64):
        picks = np.argpartition(rng.random((n, batch, experts)), top_k, axis=-1)[..., :top_k].reshape(n, -1)
        hit = np.zeros((n, experts), dtype=bool)
        np.put_along_axis(hit, picks, True, axis=1)
        counts = hit.sum(axis=1)
        assert abs(counts.mean() - experts_touched(experts, top_k, batch)) <= 3 * counts.std() / n**0.5 + 1e-6


def test_weights_read_go_from_the_active_at_batch_one_to_all(mixtral):
    _, e = mixtral
    total, active = e.total, e.active
    assert moe_weights_read(total, active, experts=8, top_k=2, tokens=1) == pytest.approx(active)
    # by parameters: the dense ones (total - routed) plus the routed share touched
    for b in (2, 4, 16):
        assert moe_weights_read(total, active, experts=8, top_k=2, tokens=b) == pytest.approx(
            total - e.params + e.params * experts_touched(8, 2, b) / 8)
    assert moe_weights_read(total, active, experts=8, top_k=2, tokens=64) == pytest.approx(total, rel=1e-7)
    assert moe_weights_read(total, total, experts=4, top_k=4, tokens=3) == total  # k = E: a dense model


def _serve(source, **traffic):
    from gpuwise.recommend.request import Constraints, Traffic
    from gpuwise.recommend.serve import serve

    r = serve(source, Traffic(**traffic), Constraints(gpus=("h100-sxm",)))
    return r, {o.count: o for o in r.rows}


@pytest.fixture(scope="module")
def mixtral_shape(mixtral):
    """Mixtral's kernels from its captured decode step at the mean context of 512 in / 256 out."""
    from gpuwise.planning.cost.replica import model_shape
    from gpuwise.planning.planner import Planner

    source, _ = mixtral
    return model_shape(Planner(source), source.decoder, context=640)[0]


def test_the_shape_runs_top_k_of_the_experts_a_token(mixtral, mixtral_shape):
    """The captured step runs all 8 experts as one batched GEMM (transformers' fused experts); a token runs 2."""
    _, e = mixtral
    shape = mixtral_shape
    assert shape.expert_share == 2 / 8 and shape.experts.any()
    # every linear weight a token meets, bf16: the active parameters but the input embedding (one row a token)
    embedding = 32000 * 4096
    assert shape.weights_read("bf16") == pytest.approx(2 * (e.active - embedding), rel=1e-4)  # and the norms
    assert shape.held_linear_params == pytest.approx(e.total - embedding, rel=1e-4)


def test_mixtral_decode_at_batch_one_reads_the_active_weights(mixtral, mixtral_shape):
    source, e = mixtral
    _, rows = _serve(source, prompt_tokens=512, output_tokens=256, concurrency=1)
    assert min(rows) == 2  # 87 GiB of bf16 weights: two H100s (tensor parallel) hold them, one does not
    # per GPU: half of the 12.9 B active parameters at 2 B each (the input embedding is a row a token)
    assert rows[2].weight_bytes_read == pytest.approx(e.active * 2 / 2, rel=0.02)
    # a dense model of the same 46.7 B would read every expert: 3.6x the GEMMs' bytes at batch 1
    from gpuwise.planning.cost.llm_step import step_seconds
    from gpuwise.planning.cost.runtimes import RUNTIMES

    h100, rt = CATALOG.get("h100-sxm"), RUNTIMES["vllm"]
    moe = step_seconds(mixtral_shape, h100, rt, decode=1, context=640, tp=2)
    dense = step_seconds(mixtral_shape, h100, rt, decode=1, context=640, tp=2, expert_read=4.0)
    assert dense.gemm_s / moe.gemm_s == pytest.approx(e.total / e.active, rel=0.05)


def test_mixtral_decode_at_a_big_batch_reads_nearly_every_expert(mixtral):
    source, e = mixtral
    _, rows = _serve(source, prompt_tokens=512, output_tokens=256, concurrency=64)
    # by hand: every weight but the routed experts no token of 64 picks, each missed with (1 - 2/8)^64
    read = e.total - e.params * (1 - 2 / 8) ** 64
    assert read == pytest.approx(moe_weights_read(e.total, e.active, experts=8, top_k=2, tokens=64), rel=1e-12)
    assert read / e.total > 0.9999  # 7.9999 of 8 experts a layer
    assert rows[2].decode_batch == 64
    assert rows[2].weight_bytes_read == pytest.approx(read * 2 / 2, rel=0.02)


def test_mixtral_decode_on_one_a100_against_baseten_tensorrt_llm(mixtral_shape):
    """Held out (nothing in the runtime constants' fit is a MoE): Baseten, "Faster Mixtral inference with
    TensorRT-LLM and quantization" (baseten.co/blog, Dec 2023): Mixtral 8x7B, int8 on one A100 (80 GB: the int8
    weights are 47 GB), TensorRT-LLM, 512 tokens in, 128 out, one request at a time: 81 "perceived" tokens/s. Reading
    all 46.7 B weights, as a dense model, would be ~3.6x slower."""
    from gpuwise.planning.cost.replica import stream_tokens_per_s
    from gpuwise.planning.cost.runtimes import RUNTIMES

    a100 = CATALOG.get("a100-80gb-sxm")
    got = stream_tokens_per_s(mixtral_shape, a100, RUNTIMES["tensorrt-llm"], weights="int8", output=128)
    assert got == pytest.approx(81, rel=0.3)


def test_a_prompt_is_compute_on_the_active_parameters_and_reads_what_it_touches(mixtral, mixtral_shape):
    from gpuwise.planning.cost.llm_step import step_seconds
    from gpuwise.planning.cost.runtimes import RUNTIMES

    _, e = mixtral
    h100, rt = CATALOG.get("h100-sxm"), RUNTIMES["vllm"]
    long = step_seconds(mixtral_shape, h100, rt, decode=0, context=0, prefill=4096, prefill_seqs=1,
                        expert_read=experts_touched(8, 2, 4096) / 2)
    # 4096 tokens: 2 x 12.9 B FLOPs a token (~105 TFLOP) outlast reading all 87 GiB
    assert long.bound == "compute" and long.gemm_s > 2 * e.active * 4096 / 989e12
    short = step_seconds(mixtral_shape, h100, rt, decode=0, context=0, prefill=16, prefill_seqs=1,
                         expert_read=experts_touched(8, 2, 16) / 2)
    one = step_seconds(mixtral_shape, h100, rt, decode=1, context=0)
    # 16 tokens compute in ~1 ms but touch 7.9 of 8 experts: the step reads nearly all the weights
    assert short.gemm_s / one.gemm_s == pytest.approx(
        moe_weights_read(e.total, e.active, experts=8, top_k=2, tokens=16) / e.active, rel=0.05)


def test_moe_arguments_are_checked():
    from gpuwise.errors import GpuwiseError

    for bad in (dict(active_params=50e9), dict(top_k=9), dict(tokens=0)):
        with pytest.raises(GpuwiseError):
            moe_weights_read(46.7e9, **{**dict(active_params=12.9e9, experts=8, top_k=2, tokens=1), **bad})


# A small Mixtral and the dense Mistral of the same parameters (the experts' 8 x 2048 width as one 16384-wide MLP;
# the MoE has a 2048 x 8 router more): large enough that their matmuls outlast the launches on an H100
_BASE = {"vocab_size": 1000, "hidden_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 16,
         "num_key_value_heads": 16, "max_position_embeddings": 4096}
SMALL_MOE = {**_BASE, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "intermediate_size": 2048,
             "num_local_experts": 8, "num_experts_per_tok": 2}
SMALL_DENSE = {**_BASE, "model_type": "mistral", "architectures": ["MistralForCausalLM"], "intermediate_size": 16384}


def _train(tmp_path, cfg):
    from gpuwise.planning.setup import Setup
    from gpuwise.planning.sources.hf import HFSource
    from gpuwise.recommend.request import Constraints, Goal
    from gpuwise.recommend.search import recommend

    path = tmp_path / f"{cfg['model_type']}.json"
    path.write_text(json.dumps(cfg))
    source = HFSource.from_path(path)
    r = recommend(source, Setup.for_batch(batch=8, micro_batch=8, seq=1024), Goal(tokens=1e9),
                  Constraints(gpus=("h100-sxm",), max_gpus=1), precision="bf16")
    return source, r


def test_training_time_is_the_active_flops(tmp_path):
    pytest.importorskip("transformers")
    moe_source, moe = _train(tmp_path, SMALL_MOE)
    _, dense = _train(tmp_path, SMALL_DENSE)
    e = moe_source.experts
    h, layers, vocab, batch, seq, heads = 2048, 2, 1000, 8, 1024, 16
    # the matmul parameters a token meets (test_experts.py): q, k, v, o, the router, its 2 experts' gate, up and
    # down, each block, and the head; the dense model's one 16384-wide MLP instead. 6 N T (forward 2, backward 4)
    # plus causal flash attention, 4 b h s^2 d / 2 forward, x2.5 backward
    attention = 4 * batch * heads * seq * seq * (h // heads) // 2 * 7 // 2 * layers
    active = layers * (4 * h * h + h * 8 + 2 * 3 * h * 2048) + h * vocab
    total = layers * (4 * h * h + 3 * h * 16384) + h * vocab
    peak = CATALOG.get("h100-sxm").peak_tflops.get("bf16") * 1e12
    flops = {}
    for name, r, n in (("moe", moe, active), ("dense", dense, total)):
        row = r.rows[0]
        assert (row.count, row.setup.micro_batch, row.setup.grad_accum) == (1, batch, 1)
        # the FLOPs recommend priced (its MFU x time x peak) are the captured step's: 6 x the ACTIVE parameters a
        # token for the MoE, exactly; no 6 x N_total shortcut
        flops[name] = row.mfu * row.step_time_s * peak
        assert flops[name] == pytest.approx(6 * n * batch * seq + attention, rel=1e-9)
    # against the dense model of the same parameters (its MLP the experts' width x 8; the MoE's routers 32 k more):
    # the FLOPs ratio is active / total 2% high, the input embedding (in both counts, no FLOPs) and the attention
    # (the same in both, 1.5% of the dense step) pulling it up
    assert flops["moe"] / flops["dense"] == pytest.approx(e.active / e.total, rel=0.03)
    # the time: the matmuls scale with the FLOPs, the memory-bound rest (activations, norms, the optimizer: about
    # 20 ms of either step at this size) does not, so the ratio sits between the FLOPs' and 1, well below 1
    ratio = moe.rows[0].time_to_goal_s / dense.rows[0].time_to_goal_s
    assert flops["moe"] / flops["dense"] < ratio < 0.7
    assert moe.experts == e and moe.routing.startswith("any split") and dense.experts is None


def test_the_output_says_moe_with_total_active_and_the_routing(mixtral, tmp_path):
    from rich.console import Console

    from gpuwise.render.recommend import recommend_json, render_recommend

    source, e = mixtral
    r, _ = _serve(source, concurrency=1)
    data = recommend_json(r)
    assert data["experts"]["total"] == e.total and data["experts"]["active"] == e.active
    assert (data["experts"]["experts"], data["experts"]["top_k"]) == (8, 2)
    assert data["routing"] == UNIFORM_ROUTING
    assert data["experts"]["decode_read"][0] == {"batch": 1, "experts_touched": 2.0, "params_read": e.active}
    row = next(x for x in data["rows"] if x["count"] == 2)
    # 2 B / 2 GPUs: the active parameters (but the input embedding's rows no token looks up)
    assert row["decode_batch"] == 1 and row["weight_bytes_read_per_gpu"] == pytest.approx(e.active, rel=0.02)
    console = Console(width=200, record=True)
    render_recommend(r, console)
    text = console.export_text()
    assert "Mixture of Experts: 46.7 B parameters, 12.9 B active per token (top-2 of 8" in text
    assert "2 of 8 at batch 1 (12.9 B read, why it decodes faster than a dense 46.7 B model)" in text
    assert "Assumes uniform routing" in " ".join(text.split())  # wherever the console wraps it
