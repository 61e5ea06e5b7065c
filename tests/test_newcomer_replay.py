"""benchmarks/newcomer_replay.py: issue 30's newcomer and fault run as rows. The rows marked fast (each a subprocess
of well under a second of CPU) run here; the whole replay, with its real trainings, signals and write limits, runs as
the benchmark, and each of those cases also has its own test beside the code it exercises."""

from __future__ import annotations

from pathlib import Path

import pytest

from fakes.scripts import load_script

HARNESS = Path(__file__).resolve().parents[1] / "benchmarks" / "newcomer_replay.py"


replay = load_script(HARNESS)
FAST = [c for c in replay.CASES if c.fast]


def test_every_numbered_item_of_the_issue_has_a_row():
    assert {c.item for c in replay.CASES} >= set(range(1, 11))
    assert len({c.name for c in replay.CASES}) == len(replay.CASES)


@pytest.mark.parametrize("case", FAST, ids=[c.name for c in FAST])
def test_a_fast_row_gets_its_exit_and_its_line(case):
    outcome = replay.run(case)
    assert outcome.ok, outcome.problem

