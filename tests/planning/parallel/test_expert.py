"""Expert parallelism (--ep) and --moe-imbalance (issue 17): a Mixtral-like model's expert weights, gradients and
AdamW states per GPU against a hand count, the rest unchanged, activations and FLOPs as without EP, FSDP sharding the
experts over the ranks EP leaves, the all-to-all bytes against their formula, the busiest rank's experts under an
imbalance, and the one-line errors of the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from gpuwise.planning import Setup
from gpuwise.planning.capture.routing import balanced_topk
from gpuwise.planning.capture.tracker import CATEGORIES
from gpuwise.planning.parallel.expert import AllToAll, hot_rank_factor
from gpuwise.planning.parallel.sharding import state_divisor
from gpuwise.planning.planner import Planner
from gpuwise.planning.sources.hf import HFSource

pytest.importorskip("transformers")

# tests/data/mixtral-8x7b-config.json's architecture at a width the CPU captures in a second: hidden 64, expert width
# 128, 4 experts top-2, 2 blocks, 4 heads (2 KV), vocabulary 1000
H, FFN, E, K, LAYERS = 64, 128, 4, 2, 2
MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 1000, "hidden_size": H,
           "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_local_experts": E, "num_experts_per_tok": K}
BATCH, SEQ, GPUS = 2, 32, 4
TOKENS = BATCH * SEQ  # one GPU's, one micro-batch
EXPERT = 3 * H * FFN  # an expert's gate, up and down matrices (transformers stacks gate and up: gate_up_proj)
CAT = {c: i for i, c in enumerate(CATEGORIES)}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "mixtral.json"
    path.write_text(json.dumps(MIXTRAL))
    return path


@pytest.fixture(scope="module")
def planner(config):
    return Planner(HFSource.from_path(config))


def _step(planner, **kw):
    step = planner.per_gpu(Setup(micro_batch=BATCH, seq=SEQ, gpus=GPUS, **kw))
    peak = step.live.max(axis=0)
    saved = step.live[step.workload.timeline.end_of_forward, CAT["activations"]]
    return step, {c: int(peak[i]) for c, i in CAT.items()}, int(saved)


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_states_per_gpu_are_experts_over_ep_and_the_rest_unchanged(planner, ep):
    one, base, saved_one = _step(planner)
    step, mem, saved = _step(planner, ep=ep)
    # bf16-mixed AdamW under DDP, per parameter: fp32 weight (4 B), fp32 gradient and its DDP bucket (8 B), exp_avg
    # and exp_avg_sq (8 B);
    # each GPU holds E / ep experts of every MoE layer, and every other parameter whole
    gone = (E - E // ep) * EXPERT * LAYERS
    assert step.workload.params == one.workload.params - gone
    assert step.workload.expert_params == E // ep * EXPERT * LAYERS
    for cat, per_param in (("weights", 4), ("gradients", 8), ("optimizer", 8)):
        expert_bytes = E // ep * EXPERT * LAYERS * per_param  # the hand count of the experts this GPU holds
        assert mem[cat] - expert_bytes == base[cat] - E * EXPERT * LAYERS * per_param, cat  # the rest: unchanged
    # balanced routing: each GPU's experts receive as many rows as it sends, tokens x k, so their saved activations
    # and their FLOPs are the run's without EP
    assert saved == saved_one
    assert step.workload.flops_per_step == one.workload.flops_per_step


def test_each_all_to_all_holds_its_send_and_receive_buffers_while_it_runs(planner):
    step, _, _ = _step(planner, ep=2)
    c = step.workload.captures[0][0]
    first = next(i for i, (op, label) in enumerate(zip(c.ops, c.labels, strict=True))
                 if op == "new_empty" and label == ("forward", 0))  # block 0's dispatch
    temp = c.live[first - 1:first + 3, CAT["temporaries"]]
    rows = TOKENS * K * H * 4  # fp32 rows of hidden width, one a routed token
    # the send buffer, then the receive buffer beside it; both freed, the tokens received handed on (T x H)
    assert (temp[1] - temp[0], temp[2] - temp[1], temp[3] - temp[0]) == (rows, rows, TOKENS * H * 4)


ATTENTION = (2 * H * H + 2 * H * H // 2) * LAYERS  # q and o (H x H), k and v (H x H/2: 2 of 4 heads are KV)
VOCAB = 2 * 1000 * H  # the embedding and the untied LM head
ROUTER = H * E * LAYERS  # the router's gate: whole on every rank


def test_tensor_parallel_splits_every_expert_ffn_width(planner):
    # --tp 2 without --ep: q, k, v, o and the vocabulary halved (transformers' Mixtral views its logits by its own
    # vocab_size, cut too), and every expert's gate, up (fused gate_up_proj) and down matrices at FFN / 2 wide
    one = planner.per_gpu(Setup(micro_batch=BATCH, seq=SEQ, gpus=2))
    step = planner.per_gpu(Setup(micro_batch=BATCH, seq=SEQ, gpus=2, tp=2))
    total = planner.source.experts.total
    assert total == 350_016
    assert step.workload.params == total - ATTENTION // 2 - VOCAB // 2 - E * EXPERT * LAYERS // 2 == 175_424
    assert step.workload.expert_params == E * EXPERT // 2 * LAYERS
    # FLOPs: everything halves but the router (forward 2, backward 4 per weight and token), which stays whole
    router = 6 * TOKENS * ROUTER
    assert step.workload.flops_per_step == (one.workload.flops_per_step - router) // 2 + router


def test_tensor_and_expert_parallel_together_split_what_each_splits(planner):
    # --tp 2 --ep 2: each GPU holds E / 2 experts of every layer (EP), each FFN / 2 wide (TP), the rest as --tp 2
    step = planner.per_gpu(Setup(micro_batch=BATCH, seq=SEQ, gpus=GPUS, tp=2, ep=2))
    held = E // 2 * EXPERT // 2 * LAYERS
    assert step.workload.params == planner.source.experts.total - ATTENTION // 2 - VOCAB // 2 - E * EXPERT * LAYERS \
        + held == 126_272
    assert step.workload.expert_params == held


def _experts_module(cfg: dict):
    import transformers

    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = getattr(transformers, cfg["architectures"][0])(config)
    from gpuwise.planning.experts import routed_modules

    return routed_modules(model)[0]


# (config, {parameter: (shape whole, shape on one of --tp 2 ranks)}) at hidden 64, expert width 128, 4 experts: the
# layouts transformers 5 stores the experts in
_WIDE = {"hidden_size": H, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 256}
LAYOUTS = [
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "intermediate_size": FFN,
      "num_local_experts": E, **_WIDE},  # [E, 2 ffn, hidden] with gate and up concatenated; down [E, hidden, ffn]
     {"gate_up_proj": ((E, 2 * FFN, H), (E, FFN, H)), "down_proj": ((E, H, FFN), (E, H, FFN // 2))}),
    ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "moe_intermediate_size": FFN,
      "num_experts": E, "head_dim": 16, **_WIDE},
     {"gate_up_proj": ((E, 2 * FFN, H), (E, FFN, H)), "down_proj": ((E, H, FFN), (E, H, FFN // 2))}),
    ({"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "intermediate_size": FFN,
      "num_local_experts": E, "head_dim": 16, "layer_types": ["full_attention"], **_WIDE},  # is_transposed, biases
     {"gate_up_proj": ((E, H, 2 * FFN), (E, H, FFN)), "gate_up_proj_bias": ((E, 2 * FFN), (E, FFN)),
      "down_proj": ((E, FFN, H), (E, FFN // 2, H)), "down_proj_bias": ((E, H), (E, H))}),  # added after the reduce
    ({"model_type": "dbrx", "architectures": ["DbrxForCausalLM"], "d_model": H, "n_heads": 4, "n_layers": 1,
      "vocab_size": 256, "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0},
      "ffn_config": {"ffn_hidden_size": FFN, "moe_num_experts": E, "moe_top_k": 2}},  # [E x ffn, hidden], three
     {"mlp.w1": ((E * FFN, H), (E * FFN // 2, H)), "mlp.v1": ((E * FFN, H), (E * FFN // 2, H)),
      "mlp.w2": ((E * FFN, H), (E * FFN // 2, H))}),
]


@pytest.mark.parametrize(("cfg", "shapes"), LAYOUTS, ids=lambda c: c.get("model_type", ""))
def test_tensor_parallel_cuts_each_expert_layout_along_its_ffn_width(cfg, shapes):
    from gpuwise.planning.parallel.expert import shard_experts

    name, module = _experts_module(cfg)
    assert {n: tuple(p.shape) for n, p in module.named_parameters()} == {n: whole for n, (whole, _) in shapes.items()}
    shard_experts(module, name, 2)
    assert {n: tuple(p.shape) for n, p in module.named_parameters()} == {n: half for n, (_, half) in shapes.items()}
    if "gate_up_proj" in shapes and not module.is_transposed:  # the fused [gate; up], as the forward splits it:
        gate, up = torch.empty(3, module.gate_up_proj.shape[1]).chunk(2, dim=-1)  # a rank's FFN / 2 of each
        assert gate.shape[-1] == up.shape[-1] == FFN // 2
    if cfg["model_type"] == "dbrx":  # its forward views the stacked matrices by ffn_hidden_size: cut too
        assert module.ffn_hidden_size == FFN // 2


def test_fsdp_shards_expert_states_over_the_ranks_ep_leaves(planner):
    step, mem, _ = _step(planner, ep=2, sharding="fsdp")
    _, fsdp, _ = _step(planner, sharding="fsdp")
    pe = step.workload.expert_params  # 2 of 4 experts a layer
    pn = step.workload.params - pe
    n = state_divisor(step.setup, step.workload.params, pe)
    # torchtitan: the experts shard over dp_shard / ep = 2 GPUs, the rest over all 4: per GPU Pn/4 + Pe/2 of the
    # captured GPU's parameters, which is the whole model's over 4, as FSDP without EP
    assert (pn + pe) / n == pytest.approx(pn / GPUS + pe / (GPUS // 2))
    assert (pn + pe) / n == pytest.approx((pn + E * EXPERT * LAYERS) / GPUS)
    assert mem["optimizer"] == pytest.approx(fsdp["optimizer"], rel=2e-3)  # fp32 AdamW states; 512-B rounding apart


def test_paged_optimizer_share_under_ep_is_sharded_as_the_optimizer_column(tmp_path):
    # bitsandbytes pages the 8-bit states of 1e5 elements or more: at hidden 128 and expert width 512 each GPU's
    # experts' gate_up_proj (1 x 1024 x 128 at ep = 4) and the embedding and head (1000 x 128); fsdp over 4 GPUs.
    # The paged bytes are part of the optimizer column, so they shard with it: the same share of the column after
    # sharding as the capture's (before: the GPU's paged bytes over all 4 GPUs while the column, its experts over the
    # 4 / ep ranks holding them, shrank less: 0.35 of the column at ep = 4 against 0.75 captured)
    cfg = {**MIXTRAL, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 1}
    path = tmp_path / "mixtral.json"
    path.write_text(json.dumps(cfg))
    wide = Planner(HFSource.from_path(path))
    opt = CAT["optimizer"]
    for ep in (1, 4):
        step = wide.per_gpu(Setup(micro_batch=1, seq=16, gpus=GPUS, ep=ep, sharding="fsdp",
                                  optimizer="paged-adamw8bit"))
        captured = step.workload.timeline.base[:, opt].max()
        column = step.live[:, opt].max()
        assert step.workload.paged_bytes > 0
        assert step.paged_bytes / column == pytest.approx(step.workload.paged_bytes / captured, rel=1e-4), ep


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_expert_gradients_reduce_over_the_ranks_that_hold_them(planner, sharding):
    from gpuwise.planning.cost.comm import comm_bytes

    # 4 GPUs, bf16-mixed: the non-expert Pn parameters reduce over all 4 ranks (share 3/4); each GPU's experts over
    # the 4 / ep ranks holding the same ones: share 1/2 at ep = 2, none at ep = 4 (every GPU its own)
    pn = planner.source.experts.total - E * EXPERT * LAYERS
    # DDP: all-reduce 2 x share x fp32 gradients; FSDP: reduce-scatter fp32 gradients (share x 4 B) and all-gather
    # 16-bit parameters in forward and backward (share x 2 x 2 B): 8 B a parameter either way
    per_param = 8
    for ep, experts in ((4, 0), (2, 0.5 * E // 2 * EXPERT * LAYERS * per_param)):
        step = planner.per_gpu(Setup(micro_batch=BATCH, seq=SEQ, gpus=GPUS, ep=ep, sharding=sharding))
        assert comm_bytes(step)[0] == pytest.approx(0.75 * pn * per_param + experts), ep


def test_all_to_all_counts_recompute_and_the_busiest_gpu(capsys, config, planner):
    from collections import Counter

    unit = LAYERS * TOKENS * K * H * 4 // 2  # one exchange's rows leaving a GPU, fp32, (ep - 1) / ep of them
    # --checkpointing full: the block's recomputation runs the dispatch again (torch's checkpoint stops after the
    # experts' saved inputs, before the combine): the capture's backward holds one more exchange's buffers a layer
    counts = {}
    for ck in ("none", "full"):
        step = planner.per_gpu(Setup(micro_batch=BATCH, seq=SEQ, gpus=GPUS, ep=2, checkpointing=ck))
        c = step.workload.captures[0][0]
        counts[ck] = Counter(label[0] for op, label in zip(c.ops, c.labels, strict=True) if op == "new_empty")
    assert counts["full"]["backward"] - counts["none"]["backward"] == 3 * LAYERS  # send, receive, rows handed on
    base = ["plan", "--hf-config", str(config), "--seq", str(SEQ), "--micro-batch", str(BATCH), "--gpus", str(GPUS),
            "--ep", "2", "--gpu", "h100-sxm", "--json"]
    # --moe-imbalance 2: the busiest GPU takes 2 x tokens x k rows in each dispatch (forward, recomputed) and in the
    # combine's backward, and sends them back in the combine and the dispatch's backward; its own tokens' rows the
    # other way
    code, out, err = run_cli(capsys, *base, "--checkpointing", "full", "--moe-imbalance", "2")
    assert code == 0, err
    a2a = json.loads(out)["all_to_all"]
    assert a2a["exchanges"] == 5  # dispatch and combine, forward and backward, and the dispatch recomputed
    sent = unit * (1 + 1 + 1) + 2 * unit * (1 + 1)  # dispatch x2 and combine-backward: 1x; combine, dispatch-bwd: 2x
    received = 2 * unit * (2 + 1) + unit * (1 + 1)
    assert (a2a["bytes"], a2a["received"], a2a["busiest"]) == (sent, received, 5 * 2 * unit)
    # timed: every exchange waits on the busiest GPU's 2 x unit over H100 NVLink 4 (450 GB/s a direction, never
    # faster), one all-to-all a layer and exchange, each paying NCCL's latency as OpenXLA's H100 table measured it
    assert a2a["seconds"] > 5 * 2 * unit / 450e9 and a2a["seconds"] > 5 * LAYERS * 10e-6
    assert "OpenXLA" in a2a["link"]
    code, out, err = run_cli(capsys, *base[:-1], "--checkpointing", "full", "--moe-imbalance", "2")
    text = " ".join(out.split())
    assert "as much received" not in text and f"receives {received / 1024:g} KiB per step" in text, text
    assert "added to the step time" in text and "OpenXLA" in text


def test_all_to_all_bytes_are_the_formula_in_the_json_and_the_text(capsys, config):
    base = ["plan", "--hf-config", str(config), "--seq", str(SEQ), "--micro-batch", str(BATCH), "--gpus", str(GPUS),
            "--ep", "2", "--gpu", "h100-sxm"]
    code, out, err = run_cli(capsys, *base, "--json")
    assert code == 0, err
    a2a = json.loads(out)["all_to_all"]
    # 2 (dispatch, combine) x 2 (forward, backward) x MoE layers x tokens x top-k x hidden x bytes x (ep - 1) / ep:
    # the residual stream the experts take is fp32 under bf16 autocast over fp32 weights (DDP)
    assert a2a["bytes"] == 2 * 2 * LAYERS * TOKENS * K * H * 4 * (2 - 1) // 2
    assert (a2a["moe_layers"], a2a["tokens"], a2a["hidden"], a2a["itemsize"]) == (LAYERS, TOKENS, H, 4)
    code, out, err = run_cli(capsys, *base, "--sharding", "fsdp", "--json")  # 16-bit parameters, bf16 tokens
    assert code == 0, err
    assert json.loads(out)["all_to_all"]["bytes"] == 2 * 2 * LAYERS * TOKENS * K * H * 2 // 2
    code, out, err = run_cli(capsys, *base)
    assert code == 0, err
    text = " ".join(out.split())  # the table folds its cells at the terminal's width
    assert "all-to-all 128 KiB sent per GPU per step" in text and "each holds 2 of 4 experts" in text
    assert AllToAll(moe_layers=58, tokens=4096, top_k=8, hidden=7168, itemsize=2, ep=1).bytes == 0


def test_imbalance_grows_the_busiest_rank_experts_activations_and_flops(planner):
    one, mem, saved = _step(planner, ep=2)
    hot, mem_hot, saved_hot = _step(planner, ep=2, moe_imbalance=2.0)
    half, _, saved_half = _step(planner, ep=2, moe_imbalance=1.5)
    rows = TOKENS * K  # the extra rows the busiest GPU receives at F = 2 (its experts each at twice their share)
    # FLOPs: each extra row meets the gate, up and down matrices, forward (2) and backward (4) per weight
    assert hot.workload.flops_per_step - one.workload.flops_per_step == 6 * rows * EXPERT * LAYERS
    assert half.workload.flops_per_step - one.workload.flops_per_step == 6 * rows // 2 * EXPERT * LAYERS
    # saved per routed row, fp32: its input (H), the gate-up output (2 FFN), the activation and the gated product
    # (FFN each), the down output (H); plus its index and routing weight (at most 32 B)
    per_row = 4 * (H + 2 * FFN + FFN + FFN + H)
    assert rows * per_row * LAYERS <= saved_hot - saved <= rows * (per_row + 32) * LAYERS
    assert saved_hot - saved == pytest.approx(2 * (saved_half - saved), abs=4 * 512 * LAYERS)  # linear in F
    assert [mem_hot[c] for c in ("weights", "gradients", "optimizer")] == [mem[c] for c in ("weights", "gradients",
                                                                                          "optimizer")]
    # capped at every rank's rows: a GPU of ep = 2 receives at most 2 x tokens x k
    assert hot_rank_factor(Setup(gpus=2, ep=2, moe_imbalance=3.0)) == 2
    assert hot_rank_factor(Setup(moe_imbalance=3.0)) == 1  # one GPU computes every routed row


def test_imbalance_without_ep_changes_a_grouped_matmul_nothing_and_says_so(planner, config):
    from gpuwise.planning import plan_model

    _, mem, saved = _step(planner)
    _, skew, saved_skew = _step(planner, moe_imbalance=2.0)
    assert (mem, saved) == (skew, saved_skew)
    p = plan_model(None, Setup(micro_batch=BATCH, seq=SEQ, moe_imbalance=2.0), hf_config=str(config), gpu="h100-sxm")
    assert "--moe-imbalance 2 changes nothing on one GPU" in p.routing


def test_the_stand_in_gives_the_busiest_expert_f_times_its_share():
    # routers read on the host (DBRX, JetMoE): expert 0 gets F x tokens x k / E rows, the others share the rest,
    # and a token's k choices stay distinct
    idx = balanced_topk(torch.Size((24, 2)), -1, 8, 2.0)
    counts = torch.bincount(idx.flatten(), minlength=8).tolist()
    assert counts[0] == 2 * 24 * 2 // 8 and sum(counts) == 48 and max(counts[1:]) - min(counts[1:]) <= 1
    assert all(len(set(row)) == 2 for row in idx.tolist())
    assert torch.equal(balanced_topk(torch.Size((24, 2)), -1, 8, 1.0), balanced_topk(torch.Size((24, 2)), -1, 8))


def test_moe_layers_and_width_of_the_fixtures():
    mixtral = HFSource.from_path(Path(__file__).resolve().parents[2] / "data" / "mixtral-8x7b-config.json").experts
    assert (mixtral.layers, mixtral.hidden) == (32, 4096)


@pytest.mark.parametrize(("args", "message", "hint"), [
    (["--gpus", "3", "--ep", "3"], "--ep 3 does not divide mixtral's 4 routed experts", "pass --ep 2, 4"),
    (["--gpus", "2", "--ep", "4"], "--ep 4 does not divide the 2 data-parallel GPUs it borrows", "pass --ep 2"),
    (["--ep", "2", "--task", "infer"], "--ep 2: expert parallelism is planned for --task train", "drop --ep"),
    (["--moe-imbalance", "3"], "--moe-imbalance 3 is more than mixtral's busiest expert can get",
     "between 1 and 2"),
    (["--moe-imbalance", "0.5"], "--moe-imbalance 0.5 is not a finite number of at least 1", "--moe-imbalance 1.25"),
    (["--moe-imbalance", "nan"], "--moe-imbalance nan is not a finite number", "--moe-imbalance 1.25"),
    (["--ep", "-2"], "--ep -2 is outside 1..4096", "pass a whole number"),  # not the --gpus -2 they made
    (["--tp", "-2"], "--tp -2 is outside 1..4096", "pass a whole number"),
])
def test_bad_ep_and_imbalance_are_one_line_errors(capsys, config, args, message, hint):
    code, _, err = run_cli(capsys, "plan", "--hf-config", str(config), "--seq", str(SEQ), *args)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {message}") and hint in err


@pytest.mark.parametrize("flag", [["--ep", "2", "--gpus", "2"], ["--moe-imbalance", "2"]])
def test_ep_and_imbalance_on_a_dense_model_are_one_line_errors(capsys, flag):
    code, _, err = run_cli(capsys, "plan", "--model", "gpt2", "--seq", "64", *flag)
    assert code == 2 and err.count("\n") == 1, err
    assert "applies to a Mixture-of-Experts model's routed experts; gpt2 has none" in err


@pytest.mark.parametrize(("flag", "value"), [("--ep", "2"), ("--moe-imbalance", "2")])
def test_train_refuses_ep_as_plan_only(capsys, flag, value):
    code, _, err = run_cli(capsys, "train", "--steps", "1", "--no-auto", flag, value)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: plan only: {flag} {value} is planned by gpuwise plan") and f"drop {flag}" in err
