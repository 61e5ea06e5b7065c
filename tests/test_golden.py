"""A golden plan: ``gpuwise plan --model gpt2 --batch 8 --json`` must print what tests/data/golden/plan_gpt2.json
holds (less the fields for this machine's GPU), so no number of the plan drifts unseen.

When a change is meant, ``python scripts/golden.py`` rewrites the file and lists the fields that changed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("golden", ROOT / "scripts" / "golden.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)


def test_the_gpt2_plan_is_the_golden_one(capsys):
    code, out, err = run_cli(capsys, *golden.COMMAND)  # conftest: an empty cache folder, so no calibrations
    assert code == 0, err
    changed = golden.differences(json.loads(golden.GOLDEN.read_text()), golden.without_machine(json.loads(out)))
    assert not changed, "the plan drifted from the golden file (if meant: python scripts/golden.py):\n" + "\n".join(
        changed[:40])


def test_a_drift_is_named_by_its_field():
    a = {"peak_bytes": 10, "gpus": [{"step": {"seconds": 0.5}}], "notes": []}
    b = {"peak_bytes": 11, "gpus": [{"step": {"seconds": 0.5 * (1 + 1e-12)}}], "notes": [], "new": 1}
    assert golden.differences(a, b) == [".new: new", ".peak_bytes: 10 -> 11"]
    assert golden.differences({"x": 1}, {"x": 1.0}) == [] and golden.differences({"x": True}, {"x": 1}) != []
