"""Fixtures every test shares: TRITON_INTERPRET on the CPU, ``run_cli``, a per-test capture cache, the catalog text;
the hand-made environments live in fakes/environments.py."""

from __future__ import annotations

import os
import types

import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run interpreted on the CPU (set before they are defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite sees the built-in catalog only, even at collection (modules load it at import): a developer's own rows
# (GPUWISE_CATALOG, ~/.config/gpuwise/catalog.toml) never reach it; the tests of those rows set them themselves.
os.environ.pop("GPUWISE_CATALOG", None)
os.environ["XDG_CONFIG_HOME"] = os.path.join(os.path.dirname(__file__), "data", "no-user-config")

from fakes.environments import ARCHS_CU126, ARCHS_CU130, CPU, GpuProcess, cpu_env, cuda_env, gpu, nvml

pytest_plugins = ["cpu_report"]  # --cpu-report N: the suite's CPU time, test by test (tests/cpu_report.py)

__all__ = ["ARCHS_CU126", "ARCHS_CU130", "CPU", "GpuProcess", "cpu_env", "cuda_env", "gpu", "nvml", "run_cli"]


def run_cli(capsys, *args):
    """Run ``gpuwise *args`` in-process: (exit code, stdout, stderr)."""
    from gpuwise import cli

    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="session")
def _capture_seed(tmp_path_factory):
    """Captures shared between the tests of one session, read-only to them: only a test that has patched nothing
    writes here (see _own_cache_folder). Under xdist the workers share one seed, in the folder above their own (an
    entry is written atomically, and an entry's key is all a capture depends on, whichever worker wrote it). The
    folder is ``gpuwise/captures`` under its own cache home, so processes a test starts can be pointed at it
    (``seeded_subprocesses``)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    seed = root / "capture-seed" / "gpuwise" / "captures"
    seed.mkdir(parents=True, exist_ok=True)
    return seed


# Attributes a test may replace and still share the seed: each decides what is planned after the captures, or where,
# never how one runs (the planner's remedies, which test_remedies.py leaves out of its re-plans; the cores the guide
# spreads its jobs over, one in test_search.py's guide test)
CAPTURE_NEUTRAL = {("gpuwise.planning.planner", "remedies"), ("gpuwise.environment", "usable_cores")}


def _patched(monkeypatch, cache_module) -> bool:
    """Whether the test has patched anything a capture could depend on: an attribute (a function, a flag) other than
    the cache's load and store (ours) and ``CAPTURE_NEUTRAL``, or a dict item other than an environment variable.
    Environment variables do not reach the capture (no ``os.environ`` below the CLI; the cache's own switches,
    XDG_CACHE_HOME and GPUWISE_CACHE, are read by ``folder()``)."""
    # pytest's own undo lists: (object, name, old value) and (dict, key, old value)
    def ours(obj, name) -> bool:
        return (obj is cache_module and name in ("load", "store")) or (
            isinstance(obj, types.ModuleType) and (obj.__name__, name) in CAPTURE_NEUTRAL)

    return (any(not ours(obj, name) for obj, name, _ in monkeypatch._setattr)
            or any(d is not os.environ for d, _, _ in monkeypatch._setitem))


@pytest.fixture(autouse=True)
def _own_cache_folder(request, tmp_path_factory, monkeypatch, _capture_seed):
    """Each test has its own cache folder: it never reads or writes the user's ~/.cache/gpuwise (calibrations from
    gpuwise bench, captures), and no capture one test writes can change what another sees.

    The suite plans the same models again and again, so captures are also kept for the session, as a user's are kept
    between runs (the key is every byte of gpuwise's source, torch's version, the model and the setup, and
    capture/test_cache.py checks a kept capture equals a fresh one): a capture the test's own folder lacks is read from
    the session's seed, and one the test makes is added to the seed, but only while the test has patched nothing
    (``_patched``). A test that patches something captures afresh and keeps its captures to itself, so a flag it
    flips (or a function it replaces) never reaches, nor is hidden by, another test's capture. Tests of the cache
    itself (marker own_captures) see the library's cache untouched, starting empty. A test whose captures are made
    in processes it starts may share the seed with them (``seeded_subprocesses``)."""
    cache = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setenv("XDG_DATA_HOME", str(cache / "data"))  # calibrations: never the developer's own
    monkeypatch.setenv("XDG_CONFIG_HOME", str(cache / "config"))  # nor their own catalog rows
    monkeypatch.delenv("GPUWISE_CATALOG", raising=False)
    if request.node.get_closest_marker("own_captures") is not None:
        return
    import gpuwise.planning.capture.cache as capture_cache

    load, store = capture_cache.load, capture_cache.store

    def shared() -> bool:  # the seed is read and written while the cache is on and the test has patched nothing
        return capture_cache.folder() is not None and not _patched(monkeypatch, capture_cache)

    def layered_load(name, where=None):
        hit = load(name, where)
        return load(name, _capture_seed) if hit is None and where is None and shared() else hit

    def layered_store(name, capture, where=None):
        store(name, capture, where)
        if where is None and shared() and capture_cache.folder() != _capture_seed:
            store(name, capture, _capture_seed)

    monkeypatch.setattr(capture_cache, "load", layered_load)
    monkeypatch.setattr(capture_cache, "store", layered_store)


@pytest.fixture
def seeded_subprocesses(_own_cache_folder, _capture_seed, monkeypatch):
    """For a test whose captures are made in processes it starts (the guide's spawned workers): its cache home is
    the seed's, so those processes read and add to the seed as the test's own process does. A started process
    inherits no patch, but the seed's rule stands: the test must patch nothing (checked after it)."""
    import gpuwise.planning.capture.cache as capture_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(_capture_seed.parents[1]))
    yield
    assert not _patched(monkeypatch, capture_cache), "a test sharing the capture seed with its processes patched"


@pytest.fixture
def tmp_catalog_text() -> str:
    return '''
[[accelerator]]
key = "x1"
name = "Example X1"
vendor = "NVIDIA"
segment = "datacenter"
arch = "Test"
aliases = ["x1 sxm"]
memory_gib = 10
peak_tflops = { bf16 = 100.0 }
source = "https://example.com/x1"
'''


def pytest_collection_modifyitems(config, items):
    """Tests marked requires_cuda run only where torch sees a CUDA GPU (benchmarks/gpu_check.sh)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)
