"""Tensor, pipeline and context parallelism (planning/parallel/; the sharding of model states, offload and HSDP:
test_sharding.py), each against a reference whose source is given: Korthikanti et al. 2022 for tensor-parallel
activations and the 1F1B pipeline, torchtitan's ring attention and its measured context-parallel memory. Tiny
models: the whole file runs in seconds."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from conftest import run_cli
from fakes.small_models import GPT, HEADS, LLAMA, PLANNERS, SEQ, H
from gpuwise.errors import GpuwiseError
from gpuwise.planning import Setup
from gpuwise.planning.capture.tracker import CATEGORIES
from gpuwise.planning.parallel.layout import in_flight_micro_batches, layout
from gpuwise.planning.parallel.rank import check

ACT = CATEGORIES.index("activations")
W, G, OPT, T = (CATEGORIES.index(c) for c in ("weights", "gradients", "optimizer", "temporaries"))
B = 2


def _block_activations(source, setup: Setup) -> int:
    """Bytes one block leaves saved at the end of forward: the 3-block capture less the 2-block one."""
    w = PLANNERS[source.name].workload(setup)
    two, three = w.captures[0][0], w.captures[1][0]
    assert (two.batch, three.batch) == (setup.micro_batch, setup.micro_batch)
    return int(three.live[three.end_of_forward, ACT] - two.live[two.end_of_forward, ACT])


@pytest.mark.parametrize("t", [1, 2, 4])
def test_tensor_parallel_activations_follow_korthikanti_table_2(t):
    """Korthikanti et al. 2022 (arXiv:2205.05198) Table 2, tensor parallel without sequence parallelism:
    sbh(10 + 24/t + 5as/(ht)) per layer; here 8 + 24/t (no dropout) plus flash attention's logsumexp."""
    setup = Setup(micro_batch=B, seq=SEQ, precision="bf16", gpus=t, tp=t)
    sbh = SEQ * B * H
    expected = sbh * (8 + 24 / t) + 4 * HEADS * SEQ * B / t
    assert _block_activations(GPT, setup) == pytest.approx(expected, rel=0.005)


@pytest.mark.parametrize("t", [2, 4])
def test_sequence_parallel_splits_the_norms_and_residual_stream(t):
    """Tensor + sequence parallelism as torchtitan's TP plan runs it (SequenceParallel norms; PrepareModuleInput
    all-gathers the attention's and MLP's input, which F.linear then saves whole): of Korthikanti's terms only the
    two gathered linear inputs (2sbh each) stay whole: sbh(4 + 28/t). Megatron saves the shard and gathers it again
    in backward (Table 2's TP + SP row, 34/t with dropout, 32/t without)."""
    setup = Setup(micro_batch=B, seq=SEQ, precision="bf16", gpus=t, tp=t, sp=True)
    sbh = SEQ * B * H
    expected = sbh * (4 + 28 / t) + 4 * HEADS * SEQ * B / t
    assert _block_activations(GPT, setup) == pytest.approx(expected, rel=0.005)


def test_compiled_sequence_parallel_runs_the_eager_step():
    """--compile traces a block once and every block of the same structure and inputs shares the graph, across
    captures too: the 3-block capture's middle block must not take the 2-block capture's last block's (which
    gathered the sequence for the head: the loss then saw s / t tokens and raised), so the stack's scatter and gather
    sit outside the blocks. And the emulated collectives read their inputs, or AOTAutograd drops as dead code the
    matmuls only they read (the row-parallel outputs, the column-parallel input gradients). The compiled step then
    runs eager's FLOPs (the partitioner recomputes no matmul), keeps less per block (fused norms) but still the two
    gathered linear inputs whole (2sbh each), and peaks no higher."""
    eager, comp = (Setup(micro_batch=B, seq=SEQ, precision="bf16", gpus=2, tp=2, sp=True, compile=c)
                   for c in (False, True))
    we, wc = (PLANNERS[LLAMA.name].workload(s) for s in (eager, comp))
    assert wc.flops_per_step == we.flops_per_step and not wc.uncosted
    for (e, *_), (c, *_) in zip(we.captures, wc.captures, strict=True):  # 2 and 3 blocks, at the micro-batch
        assert c.flops_per_step == e.flops_per_step
        assert c.live.sum(axis=1).max() <= e.live.sum(axis=1).max()
    assert 4 * SEQ * B * H <= _block_activations(LLAMA, comp) < _block_activations(LLAMA, eager)


def test_tensor_parallel_shards_the_block_weights_and_the_vocabulary():
    """One rank holds 1/t of every block linear (the row-parallel biases whole: added after the all-reduce) and of
    the vocabulary-parallel embedding; GPT's learned positions and the norms stay whole."""
    planner = PLANNERS[GPT.name]
    one, four = (planner.workload(Setup(micro_batch=B, seq=SEQ, precision="bf16", gpus=t, tp=t)) for t in (1, 4))
    cfg = GPT.zoo.config
    h, v, n = cfg.n_embd, cfg.vocab_size, cfg.n_layer
    split = n * (12 * h * h + 3 * h + 4 * h) // 4  # qkv, fc (weights and biases), proj and fc2 weights
    whole = n * (2 * h + 4 * h) + 2 * h + cfg.block_size * h  # proj and fc2 biases, the LayerNorms, ln_f, wpe
    assert four.params == split + whole + v * h // 4
    assert one.params == 4 * split + whole + v * h


def test_llama_tensor_parallel_keeps_the_residual_stream_whole():
    """Grouped-query Llama: heads, kv heads and the SwiGLU width split t ways; what does not shrink (RMSNorm's
    fp32 work on the whole residual stream) is the same at every t, so the activations are affine in 1/t."""
    acts = {t: _block_activations(LLAMA, Setup(micro_batch=B, seq=SEQ, precision="bf16", gpus=t, tp=t))
            for t in (1, 2, 4)}
    split = 2 * (acts[1] - acts[2])  # the part divided by t
    assert acts[4] == pytest.approx(acts[1] - split * 3 / 4, rel=0.002)
    assert 0 < split < acts[1]


def test_one_f_one_b_in_flight_counts():
    """1F1B (Narayanan et al. 2021, Fig. 4): stage i runs pp - i warm-up forwards before its first backward, so
    holds that many micro-batches' activations, never more than the micro-batches of the step."""
    counts = [in_flight_micro_batches(Setup(micro_batch=1, grad_accum=8, gpus=4, pp=4, stage=i)) for i in range(4)]
    assert counts == [4, 3, 2, 1]
    assert in_flight_micro_batches(Setup(micro_batch=1, grad_accum=2, gpus=4, pp=4, stage=0)) == 2
    assert in_flight_micro_batches(Setup(micro_batch=1, gpus=4, pp=4, stage=0)) == 1


def test_first_stage_holds_every_layers_activations():
    """Korthikanti et al. sec. 4.2.3: with 1F1B the first stage holds p micro-batches of L/p layers, L layers'
    worth whatever p, plus its embedding; its head and loss are on the last stage."""
    planner = PLANNERS[GPT.name]
    per_block = _block_activations(GPT, Setup(micro_batch=B, seq=SEQ, precision="bf16"))
    L = GPT.zoo.config.n_layer
    for p in (2, 4):
        first = planner.per_gpu(Setup(micro_batch=B, grad_accum=p, seq=SEQ, precision="bf16", gpus=p, pp=p,
                                      stage=0))
        held = first.live[first.timeline.end_of_forward, ACT]
        assert held == pytest.approx(L * per_block, rel=0.03)  # the rest: the embedding's small saved tensors


def test_pipeline_stages_split_the_parameters_and_the_plan_reports_the_worst():
    """Stage 0 holds the embedding, stage p-1 the final norm and the head (GPT ties it to the embedding, so both
    stages hold a copy, as Megatron does); the plan's step is the one with the larger peak."""
    planner = PLANNERS[GPT.name]
    cfg = GPT.zoo.config
    h, v = cfg.n_embd, cfg.vocab_size
    block = 12 * h * h + 13 * h
    base = Setup(micro_batch=B, grad_accum=2, seq=SEQ, gpus=2, pp=2)
    first, last = (planner.workload(replace(base, stage=i)) for i in (0, 1))
    assert first.params == 2 * block + v * h + cfg.block_size * h
    assert last.params == 2 * block + 2 * h + v * h
    worst = planner.per_gpu(base)
    assert worst.peak_bytes == max(planner.per_gpu(replace(base, stage=i)).peak_bytes for i in (0, 1))


@pytest.mark.parametrize("source", [GPT, LLAMA], ids=["gpt", "llama-gqa"])
def test_context_parallel_holds_one_nth_plus_the_ring_buffers(source):
    """Ring attention (torchtitan's context_parallel): each of N ranks holds s/N tokens' activations, exactly 1/N of
    the whole sequence's (flash attention keeps O(s) per token); its attention FLOPs are 1/N of the causal whole
    (load-balanced); while a block's attention runs, the K and V chunk received from the previous rank is held
    beside the rank's own, which a plain capture of s/N tokens does not have."""
    n = 4
    planner = PLANNERS[source.name]
    setups = [Setup(micro_batch=B, seq=SEQ, precision="bf16", gpus=c, cp=c) for c in (1, n)]
    w1, wn = (planner.workload(s) for s in setups)
    whole, ring = (_block_activations(source, s) for s in setups)
    assert ring == pytest.approx(whole / n, rel=0.005)
    assert wn.flops_per_step * n == w1.flops_per_step and wn.tokens_per_step * n == w1.tokens_per_step
    local = planner.workload(Setup(micro_batch=B, seq=SEQ // n, precision="bf16"))  # s/N tokens, attention alone

    def attention_temporaries(w):
        """Temporaries just after each forward flash-attention call (of the 2-block capture)."""
        c = w.captures[0][0]
        at = [i for i, (op, (ph, _)) in enumerate(zip(c.ops, c.labels, strict=True))
              if ph == "forward" and op.startswith("_scaled_dot_product_flash_attention_for_cpu")]
        return c.live[at, T].max()

    dec = source.decoder
    kv_chunk = 2 * B * dec.kv_heads * (SEQ // n) * dec.head_dim * 2  # K and V, bf16
    assert attention_temporaries(wn) - attention_temporaries(local) >= kv_chunk


def test_context_parallel_shards_states_with_the_data_parallel_ranks():
    """torchtitan's FSDP shards over dp_shard x cp (the context-parallel ranks hold the same parameters), so at the
    same tokens per GPU (FSDP 8 / CP 1 at s, FSDP 4 / CP 2 at 2s) the memory is the same: pytorch/torchtitan
    docs/performance.md Table 2 (Llama 3.1 8B, 8 H100s, 32k tokens per GPU) measured 83.9 to 84.5 GiB from CP 1 to
    CP 8 (the planner: 69.4 GiB in every row, without their torch.compile and Float8)."""
    planner = PLANNERS[LLAMA.name]
    fsdp = planner.per_gpu(Setup(micro_batch=1, seq=SEQ, gpus=8, sharding="fsdp"))
    ring = planner.per_gpu(Setup(micro_batch=1, seq=2 * SEQ, gpus=8, cp=2, sharding="fsdp"))
    assert ring.setup.shard_gpus == 8
    for col in (W, G, OPT):
        assert ring.live[:, col].max() == fsdp.live[:, col].max()
    eof = (fsdp.live[fsdp.timeline.end_of_forward, ACT], ring.live[ring.timeline.end_of_forward, ACT])
    assert eof[1] == pytest.approx(eof[0], rel=0.01)


def test_one_pipeline_bubble():
    s = Setup(gpus=4, pp=4, grad_accum=8)
    assert s.pipeline_bubble == pytest.approx(3 / 11) and layout(s, 4, 0).bubble == s.pipeline_bubble


def test_fsdp_over_the_context_parallel_ranks_is_named():
    s = Setup(seq=SEQ, gpus=8, tp=2, pp=2, cp=2, sharding="fsdp")
    assert "fsdp over the 2 cp ranks" in s.describe()
    assert layout(s, 4, 0).sharding == "fsdp"


def test_sequence_parallel_needs_a_sequence_tp_divides():
    with pytest.raises(GpuwiseError, match="--sequence-parallel splits --seq 126 over --tp 4") as e:
        check(GPT, Setup(seq=126, tp=4, gpus=4, sp=True))
    assert "pass --seq 128" in e.value.hint


def test_batch_counts_data_parallel_gpus_only():
    s = Setup.for_batch(batch=32, micro_batch=1, gpus=16, tp=4, pp=2)
    assert (s.dp, s.grad_accum, s.batch) == (2, 16, 32)
    assert "16 GPUs: ddp 2 x tp 4 x pp 2" in s.describe() and "x 2 data-parallel groups)" in s.describe()


def test_plan_shows_the_layout_and_host_memory(capsys):
    """--json carries host_bytes and the layout; the table names the host RAM offload needs."""
    args = ["plan", "--model", "gpt2", "--seq", "64", "--gpus", "4", "--sharding", "fsdp", "--offload", "params",
            "--nodes", "2", "--gpu", "h100"]
    code, out, err = run_cli(capsys, *args, "--json")
    assert code == 0, err
    data = json.loads(out)
    lay = data["layout"]
    assert data["host_bytes"] == lay["host_bytes"] == 16 * data["trainable_params"] // 2  # sharded over 2 in a node
    assert (lay["shard_gpus"], lay["nodes"], lay["host_bytes_per_node"]) == (2, 2, 2 * lay["host_bytes"])
    code, out, _ = run_cli(capsys, *args)
    assert code == 0 and "host memory" in out and "HSDP" in out


@pytest.mark.parametrize(("args", "words"), [
    (["--gpus", "5", "--tp", "5"], "does not divide"),
    (["--pp", "13"], "more stages than"),
    (["--gpus", "6", "--tp", "4"], "not a multiple"),
    (["--gpus", "8", "--nodes", "3", "--sharding", "fsdp"], "does not divide the data-parallel"),
    (["--gpus", "8", "--nodes", "2"], "HSDP"),
    (["--offload", "params"], "--sharding fsdp"),
    (["--offload", "optimizer", "--task", "infer"], "infer"),
    (["--gpus", "2", "--offload", "optimizer"], "zero2"),
    (["--cp", "3"], "equal chunks"),
    (["--sequence-parallel"], "--tp"),
])
def test_bad_combinations_are_one_line(capsys, args, words):
    code, out, err = run_cli(capsys, "plan", "--model", "gpt2", "--seq", "128", *args)
    assert code == 2 and not out
    assert words in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("model", "flag"), [("resnet50", "--tp"), ("resnet50", "--pp"), ("bert-base", "--tp"),
                                           ("bert-base", "--cp")])
def test_models_without_a_decoder_stack_refuse(capsys, model, flag):
    code, _, err = run_cli(capsys, "plan", "--model", model, flag, "2")
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_recommend_and_train_refuse_layouts(capsys):
    code, _, err = run_cli(capsys, "recommend", "--model", "gpt2", "--tp", "2")
    assert code == 2 and "gpuwise plan --tp 2" in err
    code, _, err = run_cli(capsys, "train", "--pp", "2")
    assert code == 2 and err.startswith("error: plan only")
