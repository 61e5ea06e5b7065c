"""benchmarks/watch_truth.py: scenarios whose bottleneck is known by construction, run through the real tools.

The fast ones (a plain loop that watch cannot see, the same loop with Monitor, periodic stalls) run here, and a few
slower ones marked slow. The leak and the user's DDP loop have their own real-run tests (test_memory_rules,
test_user_ddp); the tiny model needs two idle cores and the CPU-hog scenarios (e, g) would slow every test beside
them: those run only in the benchmark."""

from __future__ import annotations

from pathlib import Path

import pytest

from fakes.scripts import load_script

HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "watch_truth.py"


truth = load_script(HARNESS)


def _passes(key: str, attempts: int = 1):
    """The scenario's outcome; on a shared CPU a second attempt where the first was pushed off by the load (every
    attempt is a real run: a rule that is wrong fails them all)."""
    s = truth.BY_KEY[key]
    outs = []
    for _ in range(attempts):
        out = s.run()
        outs.append(out)
        if out.passed:
            return out
    pytest.fail(f"{key} ({s.name}): expected {s.expected}; " + "; ".join(f"got {o.got}: {o.figure}" for o in outs))


# -- the harness itself (milliseconds) ----------------------------------------------------------------------------


def test_find_reaches_into_findings_and_lists_and_says_none_when_absent():
    d = {"bottleneck": "stalls", "findings": [{"bottleneck": "x", "evidence": {"a": None}},
                                              {"bottleneck": "stalls", "evidence": {"period_steps": 10, "a": 3}}]}
    assert truth.find(d, "period_steps") == 10
    assert truth.find(d, "a") == 3  # a None is no answer: the search goes on
    assert truth.find(d, "nowhere") is None
    assert truth.finding(d, "stalls")["evidence"]["period_steps"] == 10
    assert truth.finding(d, "memory-leak") is None
    assert truth.classes(d) == "stalls (+x)"


def test_a_scenario_that_raises_is_a_failed_row_with_its_error_and_the_next_one_still_runs(monkeypatch):
    def broken():
        raise truth.ScenarioError("exit 1: ModuleNotFoundError: no module named report")

    bad = truth.Scenario(key="x", name="broken", how="-", expected="healthy", run=broken)
    good = truth.Scenario(key="y", name="fine", how="-", expected="healthy",
                          run=lambda: truth.Outcome(got="healthy", figure="42", passed=True))
    monkeypatch.setattr(truth, "BY_KEY", {"x": bad, "y": good})
    rows = [truth.run_scenario(s) for s in truth.select("x,y", False)]
    assert [(r.got, r.passed) for r in rows] == [("error", False), ("healthy", True)]
    assert "no module named report" in rows[0].error
    text = truth.table(rows)
    assert "error: ScenarioError: exit 1" in text and "| NO |" in text and "1/2 pass" in text


def test_selection_by_key_fast_and_an_unknown_key():
    assert [s.key for s in truth.select("b,a", False)] == ["b", "a"]
    fast = {s.key for s in truth.select(None, True)}
    assert {"a", "b", "c"} <= fast and not fast & {"d", "e", "f", "g", "h", "i"}
    assert len(truth.select(None, False)) == len(truth.SCENARIOS_ALL)
    with pytest.raises(SystemExit, match="unknown scenario zz"):
        truth.select("a,zz", False)


# -- the scenarios (real runs) --------------------------------------------------------------------------------


def test_a_plain_loop_with_a_sleepy_loader_under_watch_is_not_judged_never_healthy():
    out = _passes("a")
    assert out.got == "not-judged" and "step timings" in out.figure


@pytest.mark.slow
def test_the_same_loop_with_monitor_is_input_bound():
    out = _passes("b", attempts=2)
    assert out.got.startswith("input-bound")


def test_periodic_stalls_are_named_with_their_period_and_wall_clock_samples_per_s():
    _passes("c", attempts=2)


@pytest.mark.slow
def test_watch_joins_a_monitored_loops_events_and_finds_it_input_bound():
    _passes("j", attempts=2)


@pytest.mark.slow
def test_one_slow_step_is_no_stall():
    _passes("k", attempts=2)


@pytest.mark.slow
def test_a_cache_that_fills_then_stays_flat_is_no_leak():
    _passes("l", attempts=2)


@pytest.mark.slow
def test_a_healthy_cpu_loop_is_healthy():
    _passes("i", attempts=2)
