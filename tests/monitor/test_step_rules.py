"""monitor.step_rules.stalls through monitor.rules.judge: the issue's periodic stalls (every 10th step 250-400 ms
more) against a hand computation, where the time went (data wait, inside the step, between steps, communication),
the records that must not fire (one slow step, one burst, a few slow steps under the cut, healthy jitter, an
input-bound run), and one real Monitor loop on this CPU."""

from __future__ import annotations

import random
import time

import pytest

from gpuwise.monitor.rules import judge
from gpuwise.monitor.samples import Record, StepEvent
from gpuwise.monitor.step_rules import STALL_RATIO, STALL_SHARE, stalls
from gpuwise.monitor.thresholds import INPUT_WAIT_SHARE
from gpuwise.monitor.verdict import Context, Diagnosis, Loader, Verdict
from gpuwise.monitor.window import window

CPU = Context(device="cpu", usable_cores=4)
BASE = 0.030  # a normal step, seconds


def record(walls, *, wait=None, part="inside", gap=None, comm=None, **kw) -> Record:
    """Steps back to back from t=0. ``walls[i]``: step i+1's span. ``part`` says where a step's time over BASE goes:
    "inside" (the timed step), "data" (its data wait), "between" (after the previous step ended, before this one
    began: untimed), "comm" (exposed communication). ``wait``: a data wait every step has anyway."""
    out, t = [], 0.0
    for i, w in enumerate(walls):
        extra = w - BASE
        t += w
        seconds = BASE if part == "between" else w
        data = (wait or 0.0) + (extra if part == "data" else 0.0)
        exposed = extra if part == "comm" else comm
        out.append(StepEvent(step=i + 1, t=t, seconds=seconds, data_wait_s=data, exposed_comm_s=exposed, **kw))
    return Record(steps=tuple(out))


def issue_walls(n=100):
    """The issue's scenario: every 10th step 250, 300, 350 or 400 ms longer than a 30 ms step."""
    extras = {k: 0.25 + 0.05 * ((k // 10) % 4) for k in range(10, n + 1, 10)}
    return [BASE + extras.get(i + 1, 0.0) for i in range(n)], extras


def stalls_finding(d: Diagnosis) -> Verdict | None:
    return next((f for f in d.findings if f.bottleneck == "stalls"), None)


def test_the_issues_periodic_stalls_fire_with_their_period_and_share_of_wall_time():
    walls, extras = issue_walls()
    d = judge(record(walls), CPU)
    assert d.bottleneck == "stalls"
    f = d.findings[0]
    # by hand: the first 10 steps are the warm-up; steps 11-100 hold 9 stalls (steps 20..100) over 81 plain 30 ms
    # steps, so the time lost is their extra and the wall time 90 x 30 ms plus that
    lost = sum(e for k, e in extras.items() if k > 10)
    assert lost == pytest.approx(2.95)
    wall = 90 * BASE + lost
    assert f.share == pytest.approx(lost / wall, rel=1e-6)  # 0.522: inside the issue's 53-68 % by a hair
    assert f.evidence["period_steps"] == 10 and f.evidence["period_phase"] == 0
    assert f.evidence["outliers"] == 9 and f.evidence["cause"] == "inside the step"
    assert f.evidence["step_wall_s_median"] == pytest.approx(BASE)
    assert f.evidence["step_wall_s_max"] == pytest.approx(BASE + 0.40)
    assert "every 10 steps" in f.summary and "52%" in f.summary
    assert f"{wall / (wall - lost):.2f}×" in f.expected  # 2.09x the steps a second without them
    assert any("gc.freeze()" in x for x in f.fix) and any("async_save" in x for x in f.fix)


def test_a_few_small_slow_steps_between_the_stalls_do_not_hide_their_period():
    """Measured on this loaded CPU: a train run with a stall every 10 steps also had two steps just over the cut
    (steps 40 and 45 between stalls at 31, 41, 51); here one between every two stalls, so no two outliers in a row
    are 10 steps apart."""
    walls, _ = issue_walls()
    small = (24, 33, 47, 56, 64, 73, 87, 95)
    for k in small:
        walls[k - 1] = 2.5 * BASE
    f = stalls_finding(judge(record(walls), CPU))
    assert f.evidence["outliers"] == 9 + len(small)
    assert f.evidence["period_steps"] == 10 and f.evidence["period_phase"] == 0


def test_the_wall_clock_items_a_second_with_and_without_the_stalls():
    walls, extras = issue_walls()
    f = stalls_finding(judge(record(walls, items=32), CPU))
    lost = sum(e for k, e in extras.items() if k > 10)
    assert f.evidence["items_per_s_wall"] == pytest.approx(90 * 32 / (90 * BASE + lost), rel=1e-3)
    assert f.evidence["items_per_s_without_stalls"] == pytest.approx(32 / BASE, rel=1e-3)


def test_a_data_wait_stall_is_blamed_on_the_loader_and_no_applied_setting_is_proposed_again():
    walls, _ = issue_walls()
    rec = record(walls, part="data")
    d = judge(rec, CPU)
    f = stalls_finding(d)
    assert d.bottleneck == "stalls" and "input-bound" not in [x.bottleneck for x in d.findings]
    assert f.evidence["cause"] == "data wait" and f.evidence["extra_by_cause"]["data wait"] == pytest.approx(1.0)
    assert "persistent_workers=True" in f.fix[0]
    on = judge(rec, Context(device="cpu", usable_cores=4, loader=Loader(num_workers=2, persistent_workers=True,
                                                                         prefetch_factor=4)))
    assert not any("persistent_workers" in x or "prefetch_factor" in x for x in stalls_finding(on).fix)


def test_time_lost_between_the_timed_steps_is_named_as_such():
    """gpuwise train times the step alone; a checkpoint save every 10 steps shows between the steps."""
    walls, _ = issue_walls()
    f = stalls_finding(judge(record(walls, part="between"), CPU))
    assert f.evidence["cause"] == "between steps" and f.evidence["period_steps"] == 10
    assert "checkpoint" in f.fix[0]


def test_exposed_communication_spikes_are_synchronisation_not_communication_bound():
    walls, _ = issue_walls()
    d = judge(record(walls, part="comm"), CPU)
    f = stalls_finding(d)
    assert "communication-bound" not in [x.bottleneck for x in d.findings]  # the median step exposes nothing
    assert f.evidence["cause"] == "synchronisation" and "straggler" in f.fix[0]


def test_inside_the_step_the_slow_phase_is_shown_where_the_loop_timed_it():
    walls, _ = issue_walls()
    steps = [StepEvent(step=s.step, t=s.t, seconds=s.seconds, compute_s=0.02, optimizer_s=s.seconds - 0.02)
             for s in record(walls).steps]
    f = stalls_finding(judge(Record(steps=tuple(steps)), CPU))
    inside = f.evidence["inside_the_step"]
    assert inside["optimizer_s"]["slow_steps"] > 10 * inside["optimizer_s"]["other_steps"]
    assert inside["compute_s"]["slow_steps"] == pytest.approx(inside["compute_s"]["other_steps"])


def test_irregular_stalls_that_recur_through_the_run_fire_without_a_period():
    rng = random.Random(1)
    slow = set(rng.sample(range(11, 201), 16))
    walls = [BASE + (0.3 if i + 1 in slow else 0.0) for i in range(200)]
    f = stalls_finding(judge(record(walls), CPU))
    assert f is not None and f.evidence["period_steps"] is None and "irregular" in f.summary


# -- what must not fire --------------------------------------------------------------------------------------------


def test_one_slow_step_does_not_fire():
    walls = [BASE] * 100
    walls[50] = 5.0  # a 5 s checkpoint: most of the wall time, but once
    d = judge(record(walls), CPU)
    assert d.bottleneck == "healthy" and d.evidence["outliers"] == 1


def test_a_burst_of_slow_steps_in_one_window_does_not_fire():
    walls = [BASE] * 200
    for i in (100, 101, 102):
        walls[i] = 1.0  # three slow steps at one moment: a third of the wall time, one window of nine
    d = judge(record(walls), CPU)
    assert d.bottleneck == "healthy"
    assert d.evidence["outliers"] == 3 and d.evidence["stall_share"] > STALL_SHARE
    held, windows = map(int, d.evidence["stall_windows_held"].split("/"))
    assert held < windows / 2


@pytest.mark.parametrize("slow, times", [(1.8, 10), (2.5, 3)])
def test_a_few_slow_steps_under_the_cut_or_under_the_share_do_not_fire(slow, times):
    """1.8x the median is under the outlier cut; three steps at 2.5x lose 1.5 x 90 ms of 2.8 s, 4.8 %."""
    walls = [BASE] * 100
    for k in range(times):
        walls[20 + 7 * k] = slow * BASE
    d = judge(record(walls), CPU)
    assert d.bottleneck == "healthy"
    assert d.evidence["outliers"] == (0 if slow < STALL_RATIO else times)
    assert d.evidence["stall_share"] < STALL_SHARE


def test_a_healthy_jittery_run_does_not_fire():
    rng = random.Random(0)
    walls = [BASE * rng.uniform(0.8, 1.2) for _ in range(200)]
    d = judge(record(walls), CPU)
    assert d.bottleneck == "healthy" and d.evidence["outliers"] == 0
    assert d.evidence["step_wall_s_max"] <= 1.2 * BASE + 1e-9


def test_an_input_bound_run_is_input_bound_not_stalls():
    d = judge(record([0.1] * 40, wait=0.071), CPU)  # every step waits 71 % of its time
    assert d.bottleneck == "input-bound" and stalls_finding(d) is None


def test_stalls_do_not_count_again_the_data_wait_input_bound_explains():
    """A loader that keeps every step waiting, and waits 300 ms more every 10th step: input-bound explains all of
    it (more workers fix both), so stalls says nothing."""
    walls, _ = issue_walls()
    wait = 0.1
    rec = record([w + wait for w in walls], wait=wait, part="data")
    assert all(s.data_wait_s / s.seconds > INPUT_WAIT_SHARE for s in rec.steps)
    d = judge(rec, CPU)
    assert d.bottleneck == "input-bound" and stalls_finding(d) is None
    assert d.findings[0].evidence  # and its checks say the wait was left to input-bound
    view = window(rec, CPU)
    earlier = {"input-bound": (d.findings[0], {})}
    verdict, checked = stalls(view, earlier)
    assert verdict is None and checked["stall_wait_left_to"] == ["input-bound"] and checked["outliers"] == 0


def test_too_few_steps_are_not_judged():
    assert stalls(window(record([BASE, 1.0]), CPU), {}) is None


# -- a real loop ---------------------------------------------------------------------------------------------------


def test_a_real_loop_that_sleeps_every_tenth_step_is_diagnosed_as_stalls_every_10():
    """A plain Monitor loop: ~20 ms steps, and 200 ms more on every 10th (about 1.1 s of 2 s); shares, not times."""
    from gpuwise.monitor.sampler import Monitor

    with Monitor(interval_s=0.1, gpus=False) as mon:
        for i in range(1, 51):
            time.sleep(0.02)
            if i % 10 == 0:
                time.sleep(0.2)
            mon.step()
    d = mon.diagnose(Context(device="cpu", usable_cores=4))
    f = stalls_finding(d)
    assert f is not None, d
    assert f.evidence["period_steps"] == 10 and f.evidence["period_phase"] == 0, f.evidence
    assert f.evidence["cause"] == "inside the step", f.evidence
    assert 0.3 < f.share < 0.8, f.evidence  # 0.2 s lost per 0.4 s of every 10 steps: 0.51-0.52 measured here
