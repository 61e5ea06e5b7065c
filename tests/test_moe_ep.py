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
from gpuwise.planning.parallel import AllToAll, hot_rank_factor
from gpuwise.planning.plan import Planner
from gpuwise.planning.routing import balanced_topk
from gpuwise.planning.sharding import state_divisor
from gpuwise.planning.source import HFSource
from gpuwise.planning.tracker import CATEGORIES

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


def test_tensor_and_expert_parallel_together_split_what_each_splits(planner):
    # --tp 2: q, k, v, o and the vocabulary halved (transformers' Mixtral views its logits by its own vocab_size, cut
    # too); the stacked experts are not linear layers, so TP leaves them whole and --ep 2 halves them
    step = planner.per_gpu(Setup(micro_batch=BATCH, seq=SEQ, gpus=GPUS, tp=2, ep=2))
    attention = (2 * H * H + 2 * H * H // 2) * LAYERS
    vocab = 2 * 1000 * H  # the embedding and the untied LM head
    assert step.workload.params == planner.source.experts.total - attention // 2 - vocab // 2 - E // 2 * EXPERT * LAYERS


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
    mixtral = HFSource.from_path(Path(__file__).parent / "data" / "mixtral-8x7b-config.json").experts
    assert (mixtral.layers, mixtral.hidden) == (32, 4096)


@pytest.mark.parametrize(("args", "message", "hint"), [
    (["--gpus", "3", "--ep", "3"], "--ep 3 does not divide mixtral's 4 routed experts", "pass --ep 2, 4"),
    (["--gpus", "2", "--ep", "4"], "--ep 4 does not divide the 2 data-parallel GPUs it borrows", "pass --ep 2"),
    (["--ep", "2", "--task", "infer"], "--ep 2: expert parallelism is planned for --task train", "drop --ep"),
    (["--moe-imbalance", "3"], "--moe-imbalance 3 is more than mixtral's busiest expert can get",
     "between 1 and 2"),
    (["--moe-imbalance", "0.5"], "--moe-imbalance 0.5 is not a finite number of at least 1", "--moe-imbalance 1.25"),
    (["--moe-imbalance", "nan"], "--moe-imbalance nan is not a finite number", "--moe-imbalance 1.25"),
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


def test_train_refuses_ep_as_plan_only(capsys):
    code, _, err = run_cli(capsys, "train", "--steps", "1", "--no-auto", "--ep", "2")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: plan only: --ep 2 is planned by gpuwise plan") and "drop --ep" in err
