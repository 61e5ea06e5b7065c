"""Captures kept on disk: read back equal to a fresh capture, never for a user's file, never failing a command."""

from __future__ import annotations

import numpy as np
import pytest

from gpuwise.planning import Setup
from gpuwise.planning.capture import cache as capture_cache
from gpuwise.planning.capture import workload as workload_module
from gpuwise.planning.capture.workload import simulate
from gpuwise.planning.sources.resolve import resolve_source

pytestmark = pytest.mark.own_captures  # these count the captures that really run

SETUP = Setup(micro_batch=2, seq=64)


@pytest.fixture
def captures(monkeypatch):
    """Counts the captures that really run (not read back from the cache)."""
    calls = []
    real = workload_module.capture

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(workload_module, "capture", counted)
    return calls


def _same(a, b) -> None:
    assert (a.params, a.flops_per_step, a.bytes_per_step, a.tokens_per_step) == (
        b.params, b.flops_per_step, b.bytes_per_step, b.tokens_per_step)
    assert np.array_equal(a.timeline.base, b.timeline.base) and np.array_equal(a.batch_model.slope,
                                                                               b.batch_model.slope)
    assert a.costs.total_flops == b.costs.total_flops and a.costs.total_bytes == b.costs.total_bytes
    assert a.uncosted == b.uncosted


def test_a_second_simulation_reads_every_capture_back_and_equals_the_first(captures):
    source = resolve_source("gpt2", None)
    first = simulate(source, SETUP)
    n = len(captures)
    assert n == 3  # 2 and 3 blocks at the batch, 3 at batch + 1 (2 at batch + 1 derived: scaling.fewer_blocks_at)
    again = simulate(source, SETUP)
    assert len(captures) == n  # nothing captured again
    _same(first, again)
    assert len(list(capture_cache.folder().glob("*.npz"))) == n


def test_another_setup_or_model_is_another_entry(captures):
    simulate(resolve_source("gpt2", None), SETUP)
    simulate(resolve_source("gpt2", None), Setup(micro_batch=2, seq=32))
    simulate(resolve_source("llama3.2-1b", None), SETUP)
    assert len(captures) == 9


def test_the_cache_is_off_with_gpuwise_cache_off(captures, monkeypatch):
    monkeypatch.setenv("GPUWISE_CACHE", "off")
    simulate(resolve_source("gpt2", None), SETUP)
    simulate(resolve_source("gpt2", None), SETUP)
    assert len(captures) == 6
    assert capture_cache.folder() is None


def test_a_damaged_entry_is_captured_again_and_replaced(captures):
    source = resolve_source("gpt2", None)
    first = simulate(source, SETUP)
    files = sorted(capture_cache.folder().glob("*.npz"))
    files[0].write_bytes(b"not an entry")
    files[1].write_bytes(files[1].read_bytes()[:100])  # cut short, as a full disk would leave it
    again = simulate(source, SETUP)
    assert len(captures) == 5
    _same(first, again)
    assert len(list(capture_cache.folder().glob("*.npz"))) == 3


def test_a_folder_that_cannot_be_written_costs_the_cache_not_the_command(captures, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    w = simulate(resolve_source("gpt2", None), SETUP)
    assert w.params > 0 and len(captures) == 3


def test_a_users_own_model_file_is_never_kept(captures, tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("import torch\n\ndef build(batch):\n"
                    "    return torch.nn.Linear(8, 8), torch.randn(batch, 8)\n")
    source = resolve_source(f"{path}:build", None)
    simulate(source, Setup(micro_batch=2))
    simulate(source, Setup(micro_batch=2))
    assert len(captures) == 4
    assert not (capture_cache.folder().exists() and any(capture_cache.folder().iterdir()))


def test_the_key_follows_gpuwises_own_code(monkeypatch):
    source = resolve_source("gpt2", None)
    before = capture_cache.key(source, SETUP, 2, 2)
    monkeypatch.setattr(capture_cache, "_code_fingerprint", lambda: "another version")
    assert capture_cache.key(source, SETUP, 2, 2) != before


def test_the_folder_is_trimmed_to_the_most_recently_used(captures, monkeypatch):
    monkeypatch.setattr(capture_cache, "MAX_FILES", 2)
    simulate(resolve_source("gpt2", None), SETUP)  # 3 captures kept
    assert len(list(capture_cache.folder().glob("*.npz"))) == 2


def test_a_planted_pickle_never_runs(tmp_path, monkeypatch):
    """Issue 30: a pickle planted in the captures folder ran os.system on the next gpuwise plan. Entries are now an
    .npz read without pickle: a planted .pkl is never opened (and is removed when the folder is trimmed), and a
    planted .npz whose arrays are pickled objects is refused and dropped, its code never run."""
    import os
    import pickle

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    source = resolve_source("gpt2", None)
    name = capture_cache.key(source, SETUP, 2, None)
    where = capture_cache.folder()
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{name}.pkl").write_bytes(pickle.dumps(Payload()))
    obj = np.empty(1, dtype=object)
    obj[0] = Payload()
    np.savez(where / f"{name}.npz", __meta__=obj, __sha256__=obj)
    assert capture_cache.load(name) is None
    assert not marker.exists() and not (where / f"{name}.npz").exists()
    capture_cache.store("another", {"ops": 1})  # a write trims the folder: the old pickle goes
    assert not marker.exists() and not (where / f"{name}.pkl").exists()


def test_an_entry_whose_checksum_does_not_match_is_captured_again(captures):
    """A flipped byte inside an array (the zip's own CRC rewritten to match) is caught by the entry's SHA-256."""
    import io
    import zipfile

    source = resolve_source("gpt2", None)
    first = simulate(source, SETUP)
    path = sorted(capture_cache.folder().glob("*.npz"))[0]
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    target = next(n for n in members if not n.startswith("__"))
    data = bytearray(members[target])
    data[-1] ^= 0xFF  # the last byte of the array's data
    members[target] = bytes(data)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for n, b in members.items():
            z.writestr(n, b)
    path.write_bytes(buf.getvalue())
    assert capture_cache.load(path.stem) is None and not path.exists()
    _same(first, simulate(source, SETUP))
    assert len(captures) == 4  # the three first captures and the damaged one again


def test_a_capture_round_trips_field_by_field():
    """Every field of a real capture back equal: ints, tuples, dicts, arrays (dtype and shape) and the nested
    dataclasses."""
    import dataclasses

    from gpuwise.planning.capture.step import capture

    c = capture(resolve_source("gpt2", None), SETUP, batch=2, n_layer=2)
    back = capture_cache.loads(capture_cache.dumps(c))

    def same(a, b):
        assert type(a) is type(b), (type(a), type(b))
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        elif dataclasses.is_dataclass(a):
            for f in dataclasses.fields(a):
                same(getattr(a, f.name), getattr(b, f.name))
        elif isinstance(a, (tuple, list)):
            assert len(a) == len(b)
            for x, y in zip(a, b, strict=True):
                same(x, y)
        elif isinstance(a, dict):
            assert a.keys() == b.keys()
            for k in a:
                same(a[k], b[k])
        else:
            assert a == b

    same(c, back)
