"""The session's capture seed beyond one process's tests (tests/conftest.py; the per-test isolation itself is
planning/capture/test_cache_isolation.py): a patch that cannot change a capture keeps the seed, and the processes a
test starts can be pointed at it."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import gpuwise.planning.capture.cache as capture_cache


def test_a_capture_neutral_patch_keeps_the_seed_and_any_other_does_not(_capture_seed, monkeypatch):
    capture_cache.store("neutral-before", {"ops": 1}, _capture_seed)
    monkeypatch.setattr(importlib.import_module("gpuwise.planning.planner"), "remedies", lambda *a, **k: ())
    assert capture_cache.load("neutral-before") == {"ops": 1}  # read from the seed
    capture_cache.store("neutral-after", {"ops": 2})
    assert (_capture_seed / "neutral-after.npz").exists()  # and added to it
    monkeypatch.setattr(importlib.import_module("gpuwise.planning.planner"), "plan", lambda *a, **k: None)
    assert capture_cache.load("neutral-before") is None  # the planner's own function: the test is on its own
    capture_cache.store("neutral-patched", {"ops": 3})
    assert not (_capture_seed / "neutral-patched.npz").exists()


def test_a_process_the_test_starts_reads_and_adds_to_the_seed(_capture_seed, seeded_subprocesses):
    capture_cache.store("started-before", {"ops": 4}, _capture_seed)
    code = ("import gpuwise.planning.capture.cache as c; assert c.load('started-before') == {'ops': 4}; "
            "c.store('started-after', {'ops': 5})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert capture_cache.load("started-after", _capture_seed) == {"ops": 5}
