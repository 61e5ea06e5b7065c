"""monitor.comm_rules on synthetic records, every figure computed by hand: what gradient accumulation really changes
(the exposed all-reduce AND the optimizer step, per sample), accumulation never proposed twice, the exposed
communication read off the least-waiting rank, and the straggler rank (fires on one slow rank, its cause in the data
or the compute; must not fire on balanced ranks, one slow step, or one rank)."""

from __future__ import annotations

import pytest

from gpuwise.monitor.comm_rules import (
    ACCUM_MAX_K,
    ACCUM_MIN_GAIN,
    STRAGGLER_LOSS_SHARE,
    accumulation_effect,
    accumulation_k,
    communication_bound,
    straggler,
)
from gpuwise.monitor.rules import judge
from gpuwise.monitor.samples import Record, StepEvent
from gpuwise.monitor.thresholds import COMM_EXPOSED_SHARE
from gpuwise.monitor.verdict import Context
from gpuwise.monitor.window import window

CTX = Context(device="cuda", usable_cores=16, world_size=2)


def steps(n: int = 30, *, seconds: float = 1.0, rank: int | None = None, **kw) -> tuple[StepEvent, ...]:
    return tuple(StepEvent(step=i + 1, t=(i + 1) * seconds, seconds=seconds, rank=rank, **kw) for i in range(n))


def fired(record: Record, rule, ctx: Context = CTX):
    judged = rule(window(record, ctx), {})
    assert judged is not None
    return judged


# -- what accumulation changes --------------------------------------------------------------------------------------


def test_accumulation_amortises_the_optimizer_step_too():
    # the case: a 1 s step with 0.3 s exposed all-reduce and a 0.2 s optimizer step; the micro-batch's own
    # work M = 1 - 0.3 - 0.2 = 0.5 s. k = 5 gives 0.3 / (5·0.5 + 0.5) = 10 % exactly (not under), k = 6 gives
    # 0.3 / 3.5 = 8.6 %: k = 6, a micro-batch then costs 0.5 + 0.5/6 = 0.5833 s: 1/0.5833 = 1.714x. The old
    # prediction left the optimizer out: 1 / (1 - 0.3·5/6) = 1.333x.
    verdict, _ = fired(Record(steps=steps(seconds=1.0, exposed_comm_s=0.3, optimizer_s=0.2)), communication_bound)
    assert verdict is not None and verdict.share == pytest.approx(0.3)
    e = verdict.evidence
    assert e["accumulation_suggested"] == 6 and e["micro_batches_now"] == 1
    assert e["accumulation_speedup"] == pytest.approx(1 / (0.5 + 0.5 / 6), abs=1e-3)
    assert "1.71×" in verdict.expected and "200 ms optimizer step" in verdict.expected
    assert "583 ms per micro-batch" in verdict.expected
    assert verdict.fix[0].startswith("gradient accumulation: 6 micro-batches per optimizer step, the first 5")
    assert "exposed comm and optimizer step per sample ÷6" in verdict.fix[0]


def test_optimizer_not_timed_is_said_and_the_gain_is_a_lower_bound():
    # M = 1 - 0.3 = 0.7 (O unknown, counted 0): k = floor((3 - 0.3)/0.7) + 1 = 4; 1 / (0.7 + 0.3/4) = 1.290x
    verdict, _ = fired(Record(steps=steps(exposed_comm_s=0.3)), communication_bound)
    assert verdict.evidence["accumulation_suggested"] == 4
    assert verdict.evidence["accumulation_speedup"] == pytest.approx(1 / 0.775, abs=1e-3)
    assert verdict.evidence["optimizer_s_median"] is None and "not timed" in verdict.evidence["optimizer_s"]
    assert "1.29×" in verdict.expected and "at least" in verdict.expected


def test_accumulation_already_applied_proposes_only_a_larger_k_that_pays():
    # 4 micro-batches a step: M = (1 - 0.3 - 0.2)/4 = 0.125; k for 10 %: (3 - 0.5)/0.125 = 20 → 21, capped at 8.
    # Per micro-batch: now 1/4 = 0.25 s, with 8: 0.125 + 0.5/8 = 0.1875 s: 1.333x (>= 1.11): proposed, as "now 4".
    verdict, _ = fired(Record(steps=steps(exposed_comm_s=0.3, optimizer_s=0.2, micro_batches=4)), communication_bound)
    assert verdict.evidence["micro_batches_now"] == 4
    assert verdict.evidence["accumulation_suggested"] == ACCUM_MAX_K == 8
    assert verdict.evidence["accumulation_speedup"] == pytest.approx(0.25 / 0.1875, abs=1e-3)
    assert verdict.fix[0].startswith("gradient accumulation: 8 micro-batches per optimizer step (now 4)")
    assert "÷2" in verdict.fix[0]  # per sample: once per 8 instead of once per 4


def test_accumulation_that_no_longer_pays_is_not_proposed():
    # Context.grad_accum = 3: M = (1 - 0.15 - 0.05)/3 = 0.2667; k = floor((1.5 - 0.2)/0.2667) + 1 = 5;
    # (1/3) / (0.2667 + 0.2/5) = 1.087x < 1.11x: the other fixes only
    ctx = Context(device="cuda", usable_cores=16, world_size=2, grad_accum=3)
    verdict, _ = fired(Record(steps=steps(exposed_comm_s=0.15, optimizer_s=0.05)), communication_bound, ctx)
    assert verdict is not None  # 15 % exposed is still a loss
    assert accumulation_effect(1.0, 0.15, 0.05, 3, 5) == pytest.approx((1 / 3) / (0.8 / 3 + 0.04))
    assert accumulation_effect(1.0, 0.15, 0.05, 3, 5) < ACCUM_MIN_GAIN
    assert verdict.evidence["accumulation_suggested"] is None
    assert not any("accumulation" in f for f in verdict.fix)
    assert verdict.fix[0].startswith("DDP(model, bucket_cap_mb=")
    assert any("faster link" in f for f in verdict.fix) and any("larger micro-batch" in f for f in verdict.fix)
    assert "does not pay" in verdict.expected and "1.09×" in verdict.expected


def test_at_the_cap_accumulation_is_not_proposed_again():
    verdict, _ = fired(Record(steps=steps(exposed_comm_s=0.3, optimizer_s=0.2, micro_batches=8)), communication_bound)
    assert verdict.evidence["accumulation_suggested"] is None
    assert not any("accumulation" in f for f in verdict.fix)
    assert "8 micro-batches already" in verdict.expected


def test_after_the_proposed_fix_the_rule_is_quiet():
    # k = 6 proposed above: the step becomes 6·0.5 + 0.3 + 0.2 = 3.5 s with the same 0.3 s exposed (8.6 %)
    assert accumulation_k(1.0, 0.3, 0.2, 1) == 6
    verdict, checked = fired(Record(steps=steps(seconds=3.5, exposed_comm_s=0.3, optimizer_s=0.2, micro_batches=6)),
                             communication_bound)
    assert verdict is None and checked["exposed_comm_share_median"] == pytest.approx(0.3 / 3.5, abs=1e-4)


def test_exposed_just_under_the_threshold_does_not_fire():
    verdict, checked = fired(Record(steps=steps(exposed_comm_s=0.099, optimizer_s=0.5)), communication_bound)
    assert verdict is None and checked["exposed_comm_threshold"] == COMM_EXPOSED_SHARE


def test_communication_not_timed_is_said():
    verdict, checked = fired(Record(steps=steps()), communication_bound)
    assert verdict is None and "mon.ddp(model)" in checked["exposed_comm"]


# -- the straggler --------------------------------------------------------------------------------------------------


def ranked(n: int = 30, **per_rank: dict) -> Record:
    """Every rank's steps (1 s each), with per-rank fields: ranked(r0={...}, r1={...})."""
    out: list[StepEvent] = []
    for key, fields in per_rank.items():
        out += steps(n, rank=int(key[1:]), **fields)
    return Record(steps=tuple(out))


def test_a_rank_slow_to_load_its_data_is_the_straggler():
    # 4 ranks, 1 s steps. Rank 2 waits 0.1 s in communication, the others 0.4 s: rank 2's own work 0.9 s, the
    # others' 0.6 s: they lose (0.9 - 0.6) / 1.0 = 30 % of each step; 0.24 of rank 2's 0.3 s excess is data wait
    rec = ranked(r0={"exposed_comm_s": 0.4, "data_wait_s": 0.01}, r1={"exposed_comm_s": 0.4, "data_wait_s": 0.01},
                 r2={"exposed_comm_s": 0.1, "data_wait_s": 0.25}, r3={"exposed_comm_s": 0.4, "data_wait_s": 0.01})
    verdict, _ = fired(rec, straggler)
    assert verdict is not None and verdict.bottleneck == "straggler"
    assert verdict.share == pytest.approx(0.3)
    e = verdict.evidence
    assert e["straggler_rank"] == 2 and e["own_work_s"] == {0: 0.6, 1: 0.6, 2: 0.9, 3: 0.6}
    assert e["excess_s"] == pytest.approx(0.3) and e["excess_in_data_wait_s"] == pytest.approx(0.24)
    assert verdict.fix[0].startswith("rank 2's data") and "DistributedSampler" in verdict.fix[0]
    assert "1000 ms → 700 ms (1.43×)" in verdict.expected and "the other 3 ranks wait 30%" in verdict.expected
    assert "rank 2" in verdict.summary


def test_a_rank_slow_to_compute_names_the_device_and_host_first():
    # rank 1 own 0.8 s (exposed 0.2), rank 0 own 0.5 s (exposed 0.5): 30 % lost, none of it in data wait
    rec = ranked(r0={"exposed_comm_s": 0.5}, r1={"exposed_comm_s": 0.2})
    verdict, _ = fired(rec, straggler)
    assert verdict.evidence["straggler_rank"] == 1 and verdict.share == pytest.approx(0.3)
    assert verdict.fix[0].startswith("rank 1's device") and "throttled" in verdict.fix[0]
    assert "numactl" in verdict.fix[1] and verdict.fix[2].startswith("rank 1's data")
    assert "rank 0 waits 30%" in verdict.expected


def test_judge_names_the_straggler_and_counts_only_the_link_as_communication():
    # rank 0 waits 0.4 s, rank 1 (the straggler) 0.05 s: the link costs 5 % (under 10 %), the imbalance 35 %
    d = judge(ranked(r0={"exposed_comm_s": 0.4}, r1={"exposed_comm_s": 0.05}), CTX)
    assert d.bottleneck == "straggler" and [f.bottleneck for f in d.findings] == ["straggler"]
    assert d.findings[0].share == pytest.approx(0.35)
    verdict, checked = fired(ranked(r0={"exposed_comm_s": 0.4}, r1={"exposed_comm_s": 0.05}), communication_bound)
    assert verdict is None and checked["exposed_comm_share_median"] == pytest.approx(0.05)


def test_balanced_ranks_do_not_fire():
    # own work jitters by up to ±0.03 s a step on every rank, in turn: the largest median excess is tiny
    out = []
    for r in range(4):
        for i in range(30):
            jitter = 0.03 * (((i + r) % 3) - 1)
            out.append(StepEvent(step=i + 1, t=i + 1.0, seconds=1.0, exposed_comm_s=0.3 - jitter, rank=r))
    verdict, checked = fired(Record(steps=tuple(out)), straggler)
    assert verdict is None and checked["straggler_loss_share_median"] < STRAGGLER_LOSS_SHARE


def test_one_slow_step_on_one_rank_does_not_fire():
    out = list(steps(30, rank=0, exposed_comm_s=0.3))
    out += [StepEvent(step=i + 1, t=i + 1.0, seconds=1.0, rank=1, exposed_comm_s=0.3 if i != 12 else 0.0)
            for i in range(30)]
    verdict, _ = fired(Record(steps=tuple(out)), straggler)
    assert verdict is None


def test_straggler_needs_every_ranks_exposed_communication():
    verdict, checked = fired(ranked(r0={"compute_s": 0.5}, r1={"compute_s": 0.8}), straggler)
    assert verdict is None and "mon.ddp(model)" in checked["straggler"]


def test_one_process_is_not_judged_for_stragglers():
    assert straggler(window(Record(steps=steps(exposed_comm_s=0.3)), CTX), {}) is None
