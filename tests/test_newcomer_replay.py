"""benchmarks/newcomer_replay.py: issue 30's newcomer and fault run as rows. The rows marked fast (each a subprocess
of well under a second of CPU) run here; the whole replay, with its real trainings, signals and write limits, runs as
the benchmark, and each of those cases also has its own test beside the code it exercises."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[1] / "benchmarks" / "newcomer_replay.py"


def _load():
    spec = importlib.util.spec_from_file_location("newcomer_replay", HARNESS)
    module = importlib.util.module_from_spec(spec)
    sys.modules["newcomer_replay"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


replay = _load()
FAST = [c for c in replay.CASES if c.fast]


def test_every_numbered_item_of_the_issue_has_a_row():
    assert {c.item for c in replay.CASES} >= set(range(1, 11))
    assert len({c.name for c in replay.CASES}) == len(replay.CASES)


@pytest.mark.parametrize("case", FAST, ids=[c.name for c in FAST])
def test_a_fast_row_gets_its_exit_and_its_line(case):
    outcome = replay.run(case)
    assert outcome.ok, outcome.problem

