"""The per-test capture cache (tests/conftest.py): a test reads the session's seed and adds to it only while it has
patched nothing, so no capture one test writes can change another's result."""

from __future__ import annotations

import gpuwise.planning.capture.cache as capture_cache


def test_an_unpatched_test_reads_and_adds_to_the_seed(_capture_seed):
    capture_cache.store("isolation-clean", {"ops": 1})
    assert (capture_cache.folder() / "isolation-clean.npz").exists()
    assert (_capture_seed / "isolation-clean.npz").exists()
    capture_cache.store("isolation-seeded", {"ops": 2}, _capture_seed)
    assert capture_cache.load("isolation-seeded") == {"ops": 2}  # not in this test's folder: read from the seed


def test_a_test_that_patches_anything_keeps_its_captures_to_itself(_capture_seed, monkeypatch):
    capture_cache.store("isolation-before", {"ops": 3}, _capture_seed)
    monkeypatch.setenv("COLUMNS", "80")  # an environment variable does not reach a capture
    assert capture_cache.load("isolation-before") == {"ops": 3}
    monkeypatch.setattr(capture_cache, "MAX_FILES", 999)  # a flag a capture might read
    assert capture_cache.load("isolation-before") is None
    capture_cache.store("isolation-patched", {"ops": 4})
    assert capture_cache.load("isolation-patched") == {"ops": 4}  # its own folder still works
    assert not (_capture_seed / "isolation-patched.npz").exists()


def test_the_cache_switched_off_reads_no_seed(_capture_seed, monkeypatch):
    capture_cache.store("isolation-off", {"ops": 5}, _capture_seed)
    monkeypatch.setenv("GPUWISE_CACHE", "off")
    assert capture_cache.load("isolation-off") is None
    capture_cache.store("isolation-off-2", {"ops": 6})
    assert not (_capture_seed / "isolation-off-2.npz").exists()
